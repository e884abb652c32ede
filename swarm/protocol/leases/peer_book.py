"""A rollout peer's side of the lease protocol (sans-IO).

The peer verifies a lease (signed by *its* trainer, addressed to itself), generates, sends
:class:`Heartbeat` messages that renew the lease, and finally a :class:`Result` signed by
itself; verdicts from the trainer tell it which tasks counted and which leases to drop.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import PUBLIC_KEY_LEN, Identity
from swarm.protocol.leases.messages import (
    NO_ROOT,
    PENALTIES,
    Claim,
    Heartbeat,
    Lease,
    Message,
    Reason,
    Result,
    TaskResult,
    Verdict,
    _Refused,
    _Signed,
    decode_message,
    ms,
)
from swarm.protocol.scoring import ReasonScores

logger = logging.getLogger(__name__)


_DROPS_LEASE = frozenset({Reason.EXPIRED, Reason.STALE_VERSION, Reason.UNKNOWN_LEASE,
                          Reason.NOT_HOLDER, Reason.REJECTED})


@dataclass(slots=True)
class HeldLease:
    """A lease this peer accepted, with its expiry on the peer's own clock."""

    lease: Lease
    expires: float
    last_heartbeat: float
    submitted: set[int] = field(default_factory=set)
    counted: set[int] = field(default_factory=set)


class PeerLeases:
    """A rollout peer's side of the lease protocol (sans-IO).

    Builds signed claims, heartbeats and results; verifies that a lease is signed by
    ``trainer_key``, names this run and this peer; tracks expiries on the peer's own clock
    (from the lease's duration, so clocks need not agree); scores whoever sends forgeries.
    """

    def __init__(self, identity: Identity, trainer_key: bytes, run: str, *,
                 heartbeat_fraction: float = 1 / 3, max_held: int = 64) -> None:
        if len(trainer_key) != PUBLIC_KEY_LEN:
            raise ValueError("trainer_key is a 32-byte Ed25519 public key")
        self._id = identity
        self._trainer = trainer_key
        self._run = run
        self._hb_fraction = heartbeat_fraction
        self._max_held = max_held
        self._last_ms = -1
        self.held: dict[bytes, HeldLease] = {}
        self.scores = ReasonScores(PENALTIES)
        self.verdicts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    @property
    def peer_id(self) -> str:
        return self._id.peer_id

    def _stamp(self, now: float) -> int:
        self._last_ms = max(self._last_ms + 1, ms(now))
        return self._last_ms

    def claim(self, now: float, *, tokens_per_s: float, version: int, want: int,
              downloading: int | None = None) -> Claim:
        """A signed claim (timestamps strictly increase, so the trainer can spot replays)."""
        return Claim(self._run, tokens_per_s, version, want, self._stamp(now),
                     downloading).sign(self._id)

    def heartbeats(self, now: float) -> list[Heartbeat]:
        """Heartbeats due: for each held lease, every ``heartbeat_fraction`` of its timeout."""
        out = []
        for lid, held in self.held.items():
            period = self._hb_fraction * (held.lease.expires_ms - held.lease.issued_ms) / 1000
            if now - held.last_heartbeat >= period:
                held.last_heartbeat = now
                out.append(Heartbeat(self._run, lid, len(held.submitted),
                                     self._stamp(now)).sign(self._id))
        return out

    def result(self, lease_id: bytes, version: int, results: Sequence[TaskResult],
               now: float, *, root: bytes = NO_ROOT) -> Result:
        """A signed result for tasks of a held lease, generated with the weights of
        ``version`` whose state root is ``root``.

        :raises LocalProtocolError: the lease is not held, or a task is not in it.
        """
        held = self.held.get(lease_id)
        if held is None:
            raise LocalProtocolError("no such held lease (expired or never accepted)")
        if version < held.lease.min_version:
            raise LocalProtocolError(f"version {version} is below the lease's minimum "
                                     f"{held.lease.min_version}")
        ids = {r.task_id for r in results}
        if not ids <= set(held.lease.task_ids):
            raise LocalProtocolError("results for tasks outside the lease")
        held.submitted |= ids
        return Result(self._run, lease_id, version, tuple(results),
                      self._stamp(now), root).sign(self._id)

    def next_deadline(self) -> float | None:
        """When :meth:`heartbeats` or :meth:`tick` next has something to do."""
        times = []
        for held in self.held.values():
            period = self._hb_fraction * (held.lease.expires_ms - held.lease.issued_ms) / 1000
            times += [held.last_heartbeat + period, held.expires]
        return min(times, default=None)

    def tick(self, now: float) -> list[bytes]:
        """Drop leases past their expiry: the engine should stop working on them."""
        gone = [lid for lid, h in self.held.items() if now > h.expires]
        for lid in gone:
            del self.held[lid]
            logger.info("lease %s expired locally; dropping its work", lid.hex()[:12])
        return gone

    def receive(self, message: Message | bytes, now: float, *,
                sender: str | None = None) -> Reason:
        """Take a lease or a verdict from the network.

        For a lease: ``ACCEPTED`` (now in :attr:`held`) or why it was refused. For an
        authentic verdict: the trainer's reason (refusals of a lease's results drop it).
        Forged, foreign or malformed input is refused, logged and its sender scored down.
        """
        try:
            if isinstance(message, bytes | bytearray | memoryview):
                message = decode_message(message)
            if not isinstance(message, Lease | Verdict):
                raise _Refused(Reason.MALFORMED, f"a peer does not take {message.TAG}")
            if message.signer != self._trainer:
                raise _Refused(Reason.FOREIGN_LEASE,
                               f"{message.TAG} signed by {message.signer_peer_id}")
            if not message.is_valid():
                raise _Refused(Reason.BAD_SIGNATURE, f"{message.TAG} signature")
            if message.run != self._run:
                raise _Refused(Reason.WRONG_RUN, f"run {message.run!r}")
            if isinstance(message, Lease):
                return self._lease(message, now)
            return self._verdict(message, now)
        except SignatureError as exc:
            return self._refuse(Reason.BAD_SIGNATURE, sender, str(exc))
        except DecodeError as exc:
            return self._refuse(Reason.MALFORMED, sender, str(exc))
        except _Refused as ref:
            blamed = sender or (message.signer_peer_id
                                if isinstance(message, _Signed) else None)
            return self._refuse(ref.reason, blamed, ref.detail)

    def _refuse(self, reason: Reason, blamed: str | None, detail: str) -> Reason:
        self.refused[reason.value] += 1
        if blamed is not None:
            self.scores.refuse(blamed, reason)
        logger.warning("peer %s refused input from %s: %s (%s)", self.peer_id,
                       blamed or "unknown", reason.value, detail)
        return reason

    def _lease(self, lease: Lease, now: float) -> Reason:
        if lease.holder != self._id.public_key:
            raise _Refused(Reason.NOT_HOLDER, f"lease is for {lease.holder_peer_id}")
        if lease.lease_id in self.held:
            raise _Refused(Reason.DUPLICATE, "lease already held")
        if len(self.held) >= self._max_held:
            raise _Refused(Reason.TOO_MANY_LEASES, f"holding {len(self.held)}")
        duration = (lease.expires_ms - lease.issued_ms) / 1000
        self.held[lease.lease_id] = HeldLease(lease, now + duration, now)
        return Reason.ACCEPTED

    def _verdict(self, verdict: Verdict, now: float) -> Reason:
        self.verdicts[verdict.reason.value] += 1
        held = self.held.get(verdict.lease_id)
        if verdict.reason is Reason.ACCEPTED:
            if held is not None and verdict.subject == "heartbeat" and verdict.expires_ms:
                held.expires = max(held.expires,
                                   now + (verdict.expires_ms - verdict.time_ms) / 1000)
            elif held is not None and verdict.subject == "result":
                held.counted.update(verdict.accepted)
                if held.counted >= set(held.lease.task_ids):
                    del self.held[verdict.lease_id]
            return verdict.reason
        logger.info("trainer refused our %s for lease %s: %s (%s)", verdict.subject,
                    verdict.lease_id.hex()[:12] or "-", verdict.reason.value, verdict.detail)
        if held is not None and verdict.subject == "result" and verdict.reason in (
                Reason.DUPLICATE, Reason.SUPERSEDED):
            # Counted before (our verdict was lost): the listed tasks, or the whole lease.
            held.counted.update(verdict.accepted or held.lease.task_ids)
            if held.counted >= set(held.lease.task_ids):
                del self.held[verdict.lease_id]
        elif held is not None and verdict.reason in _DROPS_LEASE:
            del self.held[verdict.lease_id]
        return verdict.reason

