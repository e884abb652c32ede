"""Peer scores (sans-IO, no clock): a misbehaving peer is scored down and, below a threshold,
banned.

Two tables, one per layer:

- :class:`PeerScores`: the transports call :meth:`PeerScores.penalize` when a peer violates
  the wire protocol (malformed frame, failed handshake, bad chunk...) and consult
  :meth:`PeerScores.is_banned` before accepting or dialing it. Every violation costs the
  same; the table is bounded in size.
- :class:`ReasonScores`: the lease books count each message's outcome; a refusal costs what
  its reason is worth in a penalty table (``swarm.protocol.leases.messages.PENALTIES``),
  accepted work earns a capped reward, and each peer keeps a :class:`PeerRecord`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScoreConfig:
    """How hard protocol violations count."""

    #: Points taken for one violation (malformed frame, failed handshake, bad chunk...).
    penalty: float = 10.0
    #: A peer at or below this score is refused for the rest of the session.
    ban_below: float = -30.0
    #: At most this many peers are tracked; the best-scored entries are evicted first.
    max_tracked: int = 4096


class PeerScores:
    """Scores by peer id; bounded in size."""

    def __init__(self, config: ScoreConfig | None = None) -> None:
        self.config = config or ScoreConfig()
        self._scores: dict[str, float] = {}

    def score(self, peer_id: str) -> float:
        return self._scores.get(peer_id, 0.0)

    def penalize(self, peer_id: str, reason: str, weight: float = 1.0) -> float:
        """Take ``weight`` penalties from ``peer_id``; returns the new score."""
        new = self.score(peer_id) - self.config.penalty * weight
        self._scores[peer_id] = new
        logger.info("peer %s scored down to %.1f: %s", peer_id, new, reason)
        if len(self._scores) > self.config.max_tracked:
            best = max(self._scores, key=self._scores.__getitem__)
            del self._scores[best]
        return new

    def is_banned(self, peer_id: str) -> bool:
        return self.score(peer_id) <= self.config.ban_below


@dataclass(slots=True)
class PeerRecord:
    """What one peer earned: its score and how many messages were refused, by reason."""

    score: float = 0.0
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)


class ReasonScores:
    """Score table: refusals cost their reason's ``penalties`` entry, accepted work earns
    ``reward`` (up to ``cap``).

    A peer at or below ``ban_below`` is banned. Reasons absent from ``penalties`` cost
    nothing. One record per peer that ever sent something; the population bounds it.
    """

    __slots__ = ("_ban_below", "_penalties", "_records", "_reward")

    def __init__(self, penalties: Mapping[str, float], *, ban_below: float = -20.0,
                 reward: float = 1.0, cap: float = 20.0) -> None:
        self._penalties = penalties
        self._ban_below = ban_below
        self._reward = (reward, cap)
        self._records: dict[str, PeerRecord] = {}

    def accept(self, peer: str) -> float:
        """Count one accepted message for ``peer``; returns the new score."""
        rec = self._records.setdefault(peer, PeerRecord())
        reward, cap = self._reward
        rec.accepted += 1
        rec.score = min(cap, rec.score + reward)
        return rec.score

    def refuse(self, peer: str, reason: str) -> float:
        """Count one message of ``peer`` refused for ``reason``; returns the new score."""
        rec = self._records.setdefault(peer, PeerRecord())
        rec.refused[str(reason)] += 1
        rec.score -= self._penalties.get(reason, 0.0)
        return rec.score

    def set_score(self, peer: str, score: float) -> None:
        self._records.setdefault(peer, PeerRecord()).score = score

    def score(self, peer: str) -> float:
        rec = self._records.get(peer)
        return rec.score if rec else 0.0

    def banned(self, peer: str) -> bool:
        return self.score(peer) <= self._ban_below

    def table(self) -> dict[str, PeerRecord]:
        return dict(self._records)
