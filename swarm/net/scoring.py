"""Peer scores: a misbehaving peer is scored down and, below a threshold, banned.

Pure bookkeeping (no I/O, no clock): the transports call :meth:`PeerScores.penalize`
when a peer violates the protocol and consult :meth:`PeerScores.is_banned` before
accepting or dialing it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
