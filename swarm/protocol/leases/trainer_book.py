"""The trainer's lease book (sans-IO): queue, live leases, counted tasks, peer scores.

The trainer accepts a result only if the signature is valid, the signer holds the lease,
the lease is live (before expiry plus grace), the version is within the staleness bound
``latest - k`` and no task in it was counted before; the :class:`Verdict` names a
:class:`Reason` either way. Silence expires a lease and its unfinished tasks go back to the
queue, so every task counts once. Nothing here does I/O: the driver moves messages and
calls :meth:`TrainerLeases.tick` on a timer; state changes go to a :class:`LeaseStore`.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from swarm.content.ids import domain_hash
from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import Identity
from swarm.protocol.leases.messages import (
    LEASE_ID_LEN,
    MAX_RUN_LEN,
    MAX_SEED,
    PENALTIES,
    Claim,
    Heartbeat,
    Lease,
    LeaseState,
    Message,
    Reason,
    Result,
    RolloutTask,
    Sampling,
    TaskResult,
    Verdict,
    _Refused,
    decode_message,
    ms,
)
from swarm.protocol.leases.store import (
    AcceptResult,
    AddTasks,
    CloseLease,
    IssueLease,
    LeaseStore,
    MemoryLeaseStore,
    PublishVersion,
    RenewLease,
    ScorePeer,
    StateOp,
    TrainerSnapshot,
)
from swarm.protocol.scheduling import (
    SchedulingConfig,
    SpeedTable,
    ewma,
    plan_lease,
    staleness_headroom,
)
from swarm.protocol.scoring import ReasonScores

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    """The trainer's lease policy."""

    run: str
    """Run name; every message names it, so two runs never mix."""
    max_staleness: int = 1
    """``k``: results may use any version ``>= latest - k``."""
    grace_s: float = 5.0
    """Results are still accepted this long after a lease's expiry; then its tasks requeue."""
    max_leases_per_peer: int = 2
    """Live leases one peer may hold at once."""
    claim_window_s: float = 300.0
    """A claim's timestamp must be within this of the trainer's clock."""
    restart_grace_s: float = 30.0
    """After a restart every live lease gets at least this long before it expires."""
    ban_below: float = -20.0
    """Peers whose score falls to this are refused work."""
    max_queue: int = 1 << 20
    """Most tasks waiting or leased at once; :meth:`TrainerLeases.add_tasks` refuses more."""
    backup_after: float | None = 1.5
    """When the queue is empty, tasks of a lease this many times past its expected duration
    go to idle peers as backups; the first result counts, the other is ``SUPERSEDED``.
    ``None``: stragglers are only re-issued when their lease expires."""
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)

    def __post_init__(self) -> None:
        if not self.run or len(self.run) > MAX_RUN_LEN:
            raise ValueError(f"run is 1..{MAX_RUN_LEN} characters")
        if self.max_staleness < 0 or self.grace_s < 0 or self.max_leases_per_peer < 1:
            raise ValueError("max_staleness, grace_s >= 0; max_leases_per_peer >= 1")
        if self.backup_after is not None and self.backup_after <= 0:
            raise ValueError("backup_after is positive (or None)")


@dataclass(slots=True)
class LeaseStats:
    """Counters of one trainer process: the figures fault tests print."""

    tasks_added: int = 0
    tasks_issued: int = 0
    tasks_reissued: int = 0
    tasks_backup: int = 0
    tasks_completed: int = 0
    leases_issued: int = 0
    leases_completed: int = 0
    leases_expired: int = 0
    leases_released: int = 0
    leases_superseded: int = 0
    renewals: int = 0
    results_accepted: int = 0
    results_rejected: int = 0
    """Results refused by a check of their completions (see :meth:`TrainerLeases.reject`)."""
    leases_rejected: int = 0
    tasks_requeued_by_checks: int = 0
    refused: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks_added": self.tasks_added, "tasks_issued": self.tasks_issued,
            "tasks_reissued": self.tasks_reissued, "tasks_backup": self.tasks_backup,
            "tasks_completed": self.tasks_completed,
            "leases_issued": self.leases_issued, "leases_completed": self.leases_completed,
            "leases_expired": self.leases_expired, "leases_released": self.leases_released,
            "leases_superseded": self.leases_superseded,
            "renewals": self.renewals, "results_accepted": self.results_accepted,
            "results_rejected": self.results_rejected,
            "leases_rejected": self.leases_rejected,
            "tasks_requeued_by_checks": self.tasks_requeued_by_checks,
            "refused": dict(sorted(self.refused.items())),
        }


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    """:meth:`TrainerLeases.tick` event: a silent lease ended and its tasks were requeued."""

    lease_id: bytes
    holder: str
    requeued: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Accepted:
    """A counted result, as the training loop consumes it."""

    lease_id: bytes
    holder: str
    version: int
    results: tuple[TaskResult, ...]


@dataclass(frozen=True, slots=True)
class Rejected:
    """A result a check refused: who sent it, for which tasks, and why."""

    lease_id: bytes
    holder: str
    version: int
    task_ids: tuple[int, ...]
    reason: str
    commitment: bytes
    at: float
    banned: bool
    """Whether the holder was banned from new leases after this rejection."""


def _reseeded(task: RolloutTask) -> RolloutTask:
    """``task`` with a new sampling seed, derived from its old one. A check refused a result
    of it: with the same seed every honest peer would draw the same completions, and a
    check's false positive (however rare) would refuse them all again, for good."""
    assert task.sampling.seed is not None
    digest = domain_hash("swarm/reseed", task.sampling.seed.to_bytes(8, "little"),
                         task.task_id.to_bytes(8, "little"))
    seed = int.from_bytes(digest[:8], "little") % (MAX_SEED + 1)
    return replace(task, sampling=replace(task.sampling, seed=seed))


@dataclass(slots=True)
class _LeaseRec:
    lease: Lease
    expires: float
    timeout_s: float
    deadline: float
    pending: set[int]
    accepted: set[int]
    last_progress: float
    speed: float = 0.0
    expected_s: float = 0.0
    superseded: set[int] = field(default_factory=set)
    last_heartbeat_ms: int = -1


class TrainerLeases:
    """The trainer's lease book: queue, live leases, counted tasks, peer scores (sans-IO).

    The driver passes every incoming message to :meth:`handle` with ``now`` and the
    transport-authenticated sender, sends back what it returns, and calls :meth:`tick` at
    :meth:`next_deadline`. Counted results come out of :meth:`take_accepted`.
    """

    def __init__(self, identity: Identity, config: LeaseConfig, *,
                 store: LeaseStore | None = None, snapshot: TrainerSnapshot | None = None,
                 now: float = 0.0) -> None:
        self._id = identity
        self._cfg = config
        self._store: LeaseStore = store if store is not None else MemoryLeaseStore()
        snap = snapshot if snapshot is not None else TrainerSnapshot()
        self._latest = snap.latest_version
        self._last_publish = snap.last_publish
        self._interval = snap.step_interval_s
        self._tasks: dict[int, RolloutTask] = {}
        self._issues: Counter[int] = Counter()
        self._queue: list[int] = []
        for task, issues in snap.queued:
            self._tasks[task.task_id] = task
            self._issues[task.task_id] = issues
            self._queue.append(task.task_id)
        heapq.heapify(self._queue)
        self._done: set[int] = set(snap.done)
        # One entry per lease ever closed (a few dozen bytes each), kept so a late or replayed
        # message gets a precise reason; the store keeps them too.
        self._closed: dict[bytes, LeaseState] = dict(snap.closed)
        self._leases: dict[bytes, _LeaseRec] = {}
        self._holders: dict[int, set[bytes]] = {}
        """Live leases holding each uncounted leased task: one, or two with a backup."""
        self._next_task = snap.next_task_id
        self._lease_seq = snap.lease_seq
        self._speeds = SpeedTable(config.scheduling)
        self._scores = ReasonScores(PENALTIES, ban_below=config.ban_below)
        for peer, score in snap.scores.items():
            self._scores.set_score(peer, score)
        self._last_claim: dict[str, int] = {}
        self._fresh: list[Accepted] = []
        self._rejected: list[Rejected] = []
        self._finished = False
        self.stats = LeaseStats()
        ops: list[StateOp] = []
        for act in snap.active:
            pending = set(act.lease.task_ids) - act.accepted - self._done
            for t in act.lease.tasks:
                self._tasks.setdefault(t.task_id, t)
            for tid in pending:
                self._holders.setdefault(tid, set()).add(act.lease.lease_id)
            expires = act.expires
            if snapshot is not None and expires < now + config.restart_grace_s:
                expires = now + config.restart_grace_s
                ops.append(RenewLease(act.lease.lease_id, expires))
            self._leases[act.lease.lease_id] = _LeaseRec(
                act.lease, expires, act.timeout_s, max(act.deadline, expires), pending,
                set(act.accepted), now,
                expected_s=act.timeout_s / config.scheduling.timeout_slack,
                superseded=(set(act.lease.task_ids) & self._done) - act.accepted)
        if ops:
            self._store.commit(ops)

    @classmethod
    def restore(cls, identity: Identity, config: LeaseConfig, store: LeaseStore,
                now: float) -> TrainerLeases:
        """Rebuild from ``store`` after a restart; live leases get ``restart_grace_s``."""
        return cls(identity, config, store=store, snapshot=store.load(), now=now)

    # ------------------------------------------------------------------ queries

    @property
    def config(self) -> LeaseConfig:
        return self._cfg

    @property
    def public_key(self) -> bytes:
        return self._id.public_key

    @property
    def latest_version(self) -> int:
        return self._latest

    @property
    def scores(self) -> ReasonScores:
        return self._scores

    @property
    def speeds(self) -> SpeedTable:
        return self._speeds

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def outstanding(self) -> int:
        """Tasks not yet counted: queued or in a live lease."""
        return len(self._queue) + len(self._holders)

    @property
    def done(self) -> frozenset[int]:
        return frozenset(self._done)

    def live_leases(self) -> list[Lease]:
        return [r.lease for r in self._leases.values()]

    def lease_state(self, lease_id: bytes) -> LeaseState | None:
        if lease_id in self._leases:
            return LeaseState.ACTIVE
        return self._closed.get(lease_id)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (a lease's expiry plus grace)."""
        return min((r.expires + self._cfg.grace_s for r in self._leases.values()), default=None)

    def take_accepted(self) -> list[Accepted]:
        """Results counted since the last call, oldest first."""
        out, self._fresh = self._fresh, []
        return out

    # ------------------------------------------------------------------ trainer's own inputs

    def add_tasks(self, prompts: Iterable[tuple[str, Sequence[int]]], *, group_size: int = 1,
                  sampling: Sampling | None = None) -> list[RolloutTask]:
        """Queue one task per ``(prompt_id, prompt_tokens)``.

        :raises LocalProtocolError: the queue bound ``max_queue`` would be exceeded.
        """
        params = sampling or Sampling()
        tasks = [RolloutTask(self._next_task + i, pid, tuple(tokens), group_size, params)
                 for i, (pid, tokens) in enumerate(prompts)]
        if self.outstanding + len(tasks) > self._cfg.max_queue:
            raise LocalProtocolError(f"task queue is bounded at {self._cfg.max_queue}")
        self._store.commit([AddTasks(tuple(tasks))])
        self._next_task += len(tasks)
        for t in tasks:
            self._tasks[t.task_id] = t
            heapq.heappush(self._queue, t.task_id)
        self.stats.tasks_added += len(tasks)
        return tasks

    def finish(self) -> None:
        """The run is over (its last version is published): a claim from a peer holding
        that version gets :attr:`Reason.RUN_OVER`, one from a peer behind it is told to
        update first. Tasks still queued are never leased again by this book."""
        self._finished = True

    def publish_version(self, version: int, now: float) -> None:
        """The policy moved to ``version``: the staleness bound moves with it.

        :raises LocalProtocolError: ``version`` is not newer than the latest.
        """
        if version <= self._latest and self._last_publish is not None:
            raise LocalProtocolError(f"version {version} is not newer than {self._latest}")
        interval = self._interval
        if self._last_publish is not None and version > self._latest:
            per_step = (now - self._last_publish) / (version - self._latest)
            interval = ewma(interval, per_step, self._cfg.scheduling.ewma_alpha)
        self._store.commit([PublishVersion(version, now, interval)])
        self._latest, self._last_publish, self._interval = version, now, interval

    # ------------------------------------------------------------------ messages

    def handle(self, message: Message | bytes, now: float, *,
               sender: str | None = None) -> list[Message]:
        """Process one message from a peer; returns the signed replies to send it.

        ``sender`` is the transport-authenticated peer id, when the transport knows it;
        it is who gets scored for garbage. Never raises on hostile input.
        """
        verified = False
        if isinstance(message, bytes | bytearray | memoryview):
            try:
                message = decode_message(message)
                verified = True
            except SignatureError as exc:
                self._refuse_silently(Reason.BAD_SIGNATURE, sender, str(exc))
                return []
            except DecodeError as exc:
                self._refuse_silently(Reason.MALFORMED, sender, str(exc))
                return []
        if not isinstance(message, Claim | Heartbeat | Result):
            self._refuse_silently(Reason.MALFORMED, sender,
                                  f"a trainer does not take {message.TAG} messages")
            return []
        if not verified and not message.is_valid():
            self._refuse_silently(Reason.BAD_SIGNATURE, sender, f"{message.TAG} signature")
            return []
        peer = message.signer_peer_id
        subject = message.TAG
        lease_id = b"" if isinstance(message, Claim) else message.lease_id
        ops: list[StateOp] = []
        try:
            if sender is not None and sender != peer:
                raise _Refused(Reason.SENDER_MISMATCH, f"sent by {sender}, signed by {peer}")
            if message.run != self._cfg.run:
                raise _Refused(Reason.WRONG_RUN, f"run {message.run!r}")
            if isinstance(message, Claim):
                reply: Message = self._claim(message, peer, now, ops)
            elif isinstance(message, Heartbeat):
                reply = self._heartbeat(message, peer, now, ops)
            else:
                reply = self._result(message, peer, now, ops)
        except _Refused as ref:
            blamed = sender if ref.reason is Reason.SENDER_MISMATCH and sender else peer
            self._count_refusal(ref.reason, blamed, subject, ref.detail, ops, free=ref.free)
            self._store.commit(ops)
            judged = message.commitment if isinstance(message, Result) else b""
            return [self._verdict(subject, lease_id, ref.reason, now, detail=ref.detail,
                                  accepted=ref.counted, result=judged)]
        self._store.commit(ops)
        return [reply]

    def tick(self, now: float) -> list[LeaseExpired]:
        """Expire leases silent past expiry plus grace; their uncounted tasks requeue."""
        events: list[LeaseExpired] = []
        ops: list[StateOp] = []
        for lid, rec in list(self._leases.items()):
            if now > rec.expires + self._cfg.grace_s:
                requeued = self._close(lid, LeaseState.EXPIRED, ops)
                events.append(LeaseExpired(lid, rec.lease.holder_peer_id, requeued))
        if ops:
            self._store.commit(ops)
        for ev in events:
            logger.info("lease %s of %s expired; %d tasks requeued", ev.lease_id.hex()[:12],
                        ev.holder, len(ev.requeued))
        return events

    # ------------------------------------------------------------------ internals

    def _refuse_silently(self, reason: Reason, sender: str | None, detail: str) -> None:
        self.stats.refused[reason.value] += 1
        logger.warning("refused message from %s: %s (%s)", sender or "unknown peer",
                       reason.value, detail)
        if sender is not None:
            score = self._scores.refuse(sender, reason)
            self._store.commit([ScorePeer(sender, score)])

    def _count_refusal(self, reason: Reason, peer: str, subject: str, detail: str,
                       ops: list[StateOp], *, free: bool = False) -> None:
        self.stats.refused[reason.value] += 1
        if reason in PENALTIES and not free:
            ops.append(ScorePeer(peer, self._scores.refuse(peer, reason)))
            logger.warning("refused %s from %s: %s (%s)", subject, peer, reason.value, detail)
        else:
            logger.debug("refused %s from %s: %s (%s)", subject, peer, reason.value, detail)

    def _verdict(self, subject: str, lease_id: bytes, reason: Reason, now: float, *,
                 accepted: tuple[int, ...] = (), expires: float = 0.0,
                 detail: str = "", result: bytes = b"") -> Verdict:
        return Verdict(self._cfg.run, subject, lease_id, reason, accepted,
                       max(0, ms(expires)), detail, max(0, ms(now)), result).sign(self._id)

    def _claim(self, claim: Claim, peer: str, now: float, ops: list[StateOp]) -> Message:
        if self._scores.banned(peer):
            raise _Refused(Reason.BANNED, f"score {self._scores.score(peer):.1f}")
        last = self._last_claim.get(peer, -1)
        if claim.time_ms <= last:
            raise _Refused(Reason.REPLAY, f"claim time {claim.time_ms} <= last {last}")
        if abs(claim.time_ms - ms(now)) > ms(self._cfg.claim_window_s):
            raise _Refused(Reason.REPLAY, "claim time outside the window")
        self._last_claim[peer] = claim.time_ms
        # Leases past expiry (still in their grace period) no longer count against the peer.
        held = sum(1 for r in self._leases.values()
                   if r.lease.holder == claim.signer and r.expires >= now)
        if held >= self._cfg.max_leases_per_peer:
            raise _Refused(Reason.TOO_MANY_LEASES, f"holds {held}")
        if self._finished:
            if claim.version < self._latest:
                raise _Refused(Reason.STALE_VERSION, f"version {claim.version} < "
                               f"{self._latest}, the run's last; update first", free=True)
            raise _Refused(Reason.RUN_OVER, f"the run finished at version {self._latest}")
        floor = max(0, self._latest - self._cfg.max_staleness)
        if claim.version < floor:
            # A peer that says it is fetching a newer version is catching up, which costs
            # nothing (through a chain of deltas, those it fetches first are below the
            # bound: at 0.5 a claim, one every 2 s, a peer catching up for 80 s was banned
            # for good); one that claims with an old version and fetches nothing loses a
            # little score (it is told to update first).
            catching_up = claim.downloading is not None and \
                claim.version < claim.downloading <= self._latest
            raise _Refused(Reason.STALE_VERSION,
                           f"version {claim.version} < {floor}; update first",
                           free=catching_up)
        backups = [] if self._queue else self._backup_candidates(claim.signer, now)
        if not self._queue and not backups:
            raise _Refused(Reason.NO_WORK, "queue empty")
        sched = self._cfg.scheduling
        headroom = None
        if self._last_publish is not None:
            headroom = staleness_headroom(
                peer_version=min(claim.version, self._latest), latest=self._latest,
                max_staleness=self._cfg.max_staleness, step_interval_s=self._interval,
                since_publish_s=max(0.0, now - self._last_publish))
        # A version inside the bound always gets work (at least ``min_tasks``): a trainer
        # that waits for rollouts before stepping must never be starved by its own forecast.
        speed = self._speeds.effective(peer, claim.tokens_per_s)
        plan = plan_lease(sched, speed=speed, tokens_per_task=self._speeds.tokens_per_task,
                          want=claim.want, available=len(self._queue) or len(backups),
                          headroom_s=headroom)
        if backups:
            ids = backups[:plan.n_tasks]
        else:
            ids = [heapq.heappop(self._queue) for _ in range(plan.n_tasks)]
        lease_id = domain_hash("swarm/lease-id", self._id.public_key, self._cfg.run.encode(),
                               self._lease_seq.to_bytes(8, "little"))[:LEASE_ID_LEN]
        expires = now + plan.timeout_s
        lease = Lease(lease_id, self._cfg.run, claim.signer,
                      tuple(self._tasks[t] for t in ids), floor, self._latest,
                      self._cfg.max_staleness, ms(now), ms(expires),
                      ms(self._cfg.grace_s)).sign(self._id)
        ops.append(IssueLease(lease, expires, plan.timeout_s, now + plan.max_lifetime_s,
                              backup=bool(backups)))
        self._lease_seq += 1
        self._leases[lease_id] = _LeaseRec(lease, expires, plan.timeout_s,
                                           now + plan.max_lifetime_s, set(ids), set(), now,
                                           speed, plan.expected_s)
        for t in ids:
            self._holders.setdefault(t, set()).add(lease_id)
        if backups:
            self.stats.tasks_backup += len(ids)
        reissued = sum(1 for t in ids if self._issues[t] > 0)
        for t in ids:
            self._issues[t] += 1
        self.stats.leases_issued += 1
        self.stats.tasks_issued += len(ids)
        self.stats.tasks_reissued += reissued
        logger.debug("lease %s: %d %stasks to %s for %.1fs", lease_id.hex()[:12], len(ids),
                     "backup " if backups else "", peer, plan.timeout_s)
        return lease

    def _backup_candidates(self, claimant: bytes, now: float) -> list[int]:
        """Uncounted tasks of overdue leases not held by ``claimant`` and not yet backed up."""
        after = self._cfg.backup_after
        if after is None:
            return []
        out: list[int] = []
        for rec in sorted(self._leases.values(), key=lambda r: r.lease.issued_ms):
            if (rec.lease.holder != claimant
                    and now - rec.lease.issued_ms / 1000 > after * rec.expected_s):
                out += sorted(t for t in rec.pending if len(self._holders.get(t, ())) == 1)
        return out

    def _live(self, lease_id: bytes, signer: bytes, now: float,
              ops: list[StateOp], *, heartbeat: bool = False) -> _LeaseRec:
        rec = self._leases.get(lease_id)
        if rec is None:
            state = self._closed.get(lease_id)
            if state is LeaseState.COMPLETED:
                # A heartbeat that crossed our verdict on the wire (it sits behind chunks
                # on a slow uplink for seconds) is a race, not a fault: it costs nothing,
                # and the verdict tells the peer to drop the lease.
                raise _Refused(Reason.DUPLICATE, "lease already completed", free=heartbeat)
            if state is LeaseState.SUPERSEDED:
                raise _Refused(Reason.SUPERSEDED, "backup leases delivered every task first")
            if state is not None:
                raise _Refused(Reason.EXPIRED, f"lease {state.value}")
            raise _Refused(Reason.UNKNOWN_LEASE, "no such lease")
        if rec.lease.holder != signer:
            raise _Refused(Reason.NOT_HOLDER, f"lease held by {rec.lease.holder_peer_id}")
        if now > rec.expires + self._cfg.grace_s:
            self._close(lease_id, LeaseState.EXPIRED, ops)
            raise _Refused(Reason.EXPIRED, "past expiry and grace")
        return rec

    def _heartbeat(self, hb: Heartbeat, peer: str, now: float, ops: list[StateOp]) -> Verdict:
        rec = self._live(hb.lease_id, hb.signer, now, ops, heartbeat=True)
        if hb.time_ms <= rec.last_heartbeat_ms:
            raise _Refused(Reason.REPLAY, "heartbeat not newer than the last")
        rec.last_heartbeat_ms = hb.time_ms
        expires = max(rec.expires, min(now + rec.timeout_s, rec.deadline))
        if expires != rec.expires:
            rec.expires = expires
            ops.append(RenewLease(hb.lease_id, expires))
            self.stats.renewals += 1
        return self._verdict("heartbeat", hb.lease_id, Reason.ACCEPTED, now, expires=expires)

    def _admit(self, res: Result, peer: str, now: float, ops: list[StateOp]) -> _LeaseRec:
        """Every check of a result the book itself makes; raises :class:`_Refused`."""
        rec = self._live(res.lease_id, res.signer, now, ops)
        ids = res.task_ids
        if len(set(ids)) != len(ids):
            raise _Refused(Reason.MALFORMED, "a task appears twice in one result")
        if res.version > self._latest:
            raise _Refused(Reason.UNKNOWN_VERSION, f"version {res.version} > {self._latest}")
        floor = max(rec.lease.min_version, self._latest - self._cfg.max_staleness)
        if res.version < floor:
            self._close(res.lease_id, LeaseState.RELEASED, ops)
            raise _Refused(Reason.STALE_VERSION, f"version {res.version} < {floor}")
        counted = tuple(t for t in ids if t in rec.accepted)
        if counted:
            raise _Refused(Reason.DUPLICATE, "tasks already counted", counted)
        superseded = tuple(t for t in ids if t in rec.superseded)
        if superseded:
            raise _Refused(Reason.SUPERSEDED, "a backup lease delivered these first", superseded)
        if any(t not in rec.pending for t in ids):
            raise _Refused(Reason.TASK_NOT_IN_LEASE, "result names tasks outside the lease")
        for tr in res.results:
            task = self._tasks[tr.task_id]
            if len(tr.completions) != task.group_size or any(
                    len(c.token_ids) > task.sampling.max_tokens for c in tr.completions):
                raise _Refused(Reason.BAD_SHAPE,
                               f"task {tr.task_id}: {len(tr.completions)} completions for a "
                               f"group of {task.group_size}, or too many tokens")
        return rec

    def _result(self, res: Result, peer: str, now: float, ops: list[StateOp]) -> Verdict:
        rec = self._admit(res, peer, now, ops)
        ids = res.task_ids
        ops.append(AcceptResult(res, now))
        for t in ids:
            for other in self._holders.pop(t, set()) - {res.lease_id}:
                orec = self._leases[other]
                orec.pending.discard(t)
                orec.superseded.add(t)
                if not orec.pending:
                    self._close(other, LeaseState.SUPERSEDED, ops)
        rec.pending.difference_update(ids)
        rec.accepted.update(ids)
        self._done.update(ids)
        for t in ids:  # counted tasks need neither their prompt nor their issue count
            self._tasks.pop(t, None)
            self._issues.pop(t, None)
        self._speeds.observe(peer, res.n_tokens, len(ids), now - rec.last_progress)
        rec.last_progress = now
        ops.append(ScorePeer(peer, self._scores.accept(peer)))
        self.stats.results_accepted += 1
        self.stats.tasks_completed += len(ids)
        self._fresh.append(Accepted(res.lease_id, peer, res.version, res.results))
        if not rec.pending:
            self._close(res.lease_id, LeaseState.COMPLETED, ops)
        return self._verdict("result", res.lease_id, Reason.ACCEPTED, now, accepted=ids,
                             result=res.commitment)

    # ------------------------------------------------------------------ checked results

    def task(self, task_id: int) -> RolloutTask | None:
        """A queued or leased task (counted tasks are forgotten)."""
        return self._tasks.get(task_id)

    def admissible(self, message: Message, now: float, *, sender: str | None = None) -> bool:
        """Whether :meth:`handle` would count this result now (a dry run: nothing changes).
        The trainer runs its checks of the completions only on admissible results, so a
        stranger cannot make it spend a forward pass."""
        if not isinstance(message, Result) or message.run != self._cfg.run:
            return False
        peer = message.signer_peer_id
        if sender is not None and sender != peer:
            return False
        rec = self._leases.get(message.lease_id)
        if rec is None or now > rec.expires + self._cfg.grace_s:
            return False
        try:
            self._admit(message, peer, now, [])
        except _Refused:
            return False
        return message.is_valid()

    def reject(self, res: Result, now: float, detail: str) -> Verdict:
        """A check of ``res``'s completions failed: nothing of it counts, its lease closes
        and its tasks go back to the queue for other peers, its signer is scored (banned
        after repeated failures). Call it instead of :meth:`handle` for an admissible
        result; returns the signed verdict to send the peer."""
        peer = res.signer_peer_id
        ops: list[StateOp] = []
        requeued: tuple[int, ...] = ()
        if res.lease_id in self._leases:
            requeued = self._close(res.lease_id, LeaseState.REJECTED, ops)
        self._count_refusal(Reason.REJECTED, peer, "result", detail, ops)
        self._store.commit(ops)
        self.stats.results_rejected += 1
        self.stats.tasks_requeued_by_checks += len(requeued)
        self._rejected.append(Rejected(res.lease_id, peer, res.version, res.task_ids,
                                       detail, res.commitment, now,
                                       self._scores.banned(peer)))
        return self._verdict("result", res.lease_id, Reason.REJECTED, now, detail=detail,
                             result=res.commitment)

    def take_rejected(self) -> list[Rejected]:
        """Results rejected by checks since the last call, oldest first."""
        out, self._rejected = self._rejected, []
        return out

    def _close(self, lease_id: bytes, state: LeaseState, ops: list[StateOp]) -> tuple[int, ...]:
        """End a live lease; its uncounted tasks no other live lease holds go back to the queue.

        Memory changes at once and ``ops`` carry them to the store in the caller's commit; if
        that commit fails the object must be discarded and restored from the store.
        """
        rec = self._leases.pop(lease_id)
        requeued = []
        for t in sorted(rec.pending):
            holders = self._holders.get(t, set())
            holders.discard(lease_id)
            if not holders:
                self._holders.pop(t, None)
                requeued.append(t)
                heapq.heappush(self._queue, t)
        reseeded: tuple[RolloutTask, ...] = ()
        if state is LeaseState.REJECTED:
            reseeded = tuple(_reseeded(self._tasks[t]) for t in requeued
                             if self._tasks[t].sampling.seed is not None)
            self._tasks.update((task.task_id, task) for task in reseeded)
        ops.append(CloseLease(lease_id, state, tuple(requeued), reseeded))
        self._closed[lease_id] = state
        if state is LeaseState.COMPLETED:
            self.stats.leases_completed += 1
        elif state is LeaseState.EXPIRED:
            self.stats.leases_expired += 1
            self._speeds.timed_out(rec.lease.holder_peer_id, rec.speed)
        elif state is LeaseState.SUPERSEDED:
            self.stats.leases_superseded += 1
        elif state is LeaseState.REJECTED:
            self.stats.leases_rejected += 1
        else:
            self.stats.leases_released += 1
        return tuple(requeued)


