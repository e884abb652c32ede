"""Persistence of the trainer's lease book: state operations, snapshots and the store.

:class:`~swarm.protocol.leases.trainer_book.TrainerLeases` turns every state change into
:data:`StateOp` records and hands them to a :class:`LeaseStore` in one
:meth:`~LeaseStore.commit` per call, before any reply is returned; a restarted trainer
rebuilds itself from :meth:`~LeaseStore.load`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swarm.errors import LocalProtocolError
from swarm.protocol.leases.messages import Lease, LeaseState, Result, RolloutTask


@dataclass(frozen=True, slots=True)
class AddTasks:
    """Tasks joined the queue."""

    tasks: tuple[RolloutTask, ...]


@dataclass(frozen=True, slots=True)
class IssueLease:
    """A lease was granted: its tasks leave the queue (a backup's are already leased)."""

    lease: Lease
    expires: float
    timeout_s: float
    deadline: float
    backup: bool = False


@dataclass(frozen=True, slots=True)
class RenewLease:
    lease_id: bytes
    expires: float


@dataclass(frozen=True, slots=True)
class AcceptResult:
    """A result was counted: its tasks are done, exactly once."""

    result: Result
    time: float


@dataclass(frozen=True, slots=True)
class CloseLease:
    """A lease ended; ``requeued`` of its tasks (never counted) go back to the queue, and
    ``reseeded`` replace the tasks of those that are sampled with a new seed from now on."""

    lease_id: bytes
    state: LeaseState
    requeued: tuple[int, ...]
    reseeded: tuple[RolloutTask, ...] = ()


@dataclass(frozen=True, slots=True)
class PublishVersion:
    version: int
    time: float
    step_interval_s: float | None


@dataclass(frozen=True, slots=True)
class ScorePeer:
    peer: str
    score: float


StateOp = (AddTasks | IssueLease | RenewLease | AcceptResult | CloseLease | PublishVersion
           | ScorePeer)


@dataclass(frozen=True, slots=True)
class ActiveLease:
    """A live lease as persisted: the signed lease, its current expiry and what was counted."""

    lease: Lease
    expires: float
    timeout_s: float
    deadline: float
    accepted: frozenset[int]


@dataclass(frozen=True, slots=True)
class TrainerSnapshot:
    """Everything a restarted trainer needs to carry on where the last one committed."""

    latest_version: int = 0
    last_publish: float | None = None
    step_interval_s: float | None = None
    queued: tuple[tuple[RolloutTask, int], ...] = ()
    """Tasks waiting, with how many times each was issued before."""
    active: tuple[ActiveLease, ...] = ()
    closed: Mapping[bytes, LeaseState] = field(default_factory=dict)
    done: frozenset[int] = frozenset()
    next_task_id: int = 0
    lease_seq: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)


class LeaseStore(Protocol):
    """Durable home of the trainer's lease state (SQLite in ``swarm.roles.trainer_state``)."""

    def commit(self, ops: Sequence[StateOp]) -> None:
        """Apply ``ops`` atomically and durably (all or none)."""

    def load(self) -> TrainerSnapshot:
        """The state after the last successful commit."""


class MemoryLeaseStore:
    """In-memory :class:`LeaseStore`: what survives a simulated crash of the trainer object."""

    def __init__(self) -> None:
        self.latest = 0
        self.last_publish: float | None = None
        self.interval: float | None = None
        self.tasks: dict[int, RolloutTask] = {}
        self.issues: Counter[int] = Counter()
        self.queued: set[int] = set()
        self.leases: dict[bytes, tuple[Lease, float, float, float, LeaseState]] = {}
        self.accepted: dict[int, tuple[bytes, Result]] = {}
        self.lease_accepted: dict[bytes, set[int]] = {}
        self.scores: dict[str, float] = {}
        self.commits = 0

    def commit(self, ops: Sequence[StateOp]) -> None:
        for op in ops:
            self._apply(op)
        self.commits += 1

    def _apply(self, op: StateOp) -> None:
        if isinstance(op, AddTasks):
            for t in op.tasks:
                self.tasks[t.task_id] = t
                self.queued.add(t.task_id)
        elif isinstance(op, IssueLease):
            lid = op.lease.lease_id
            self.leases[lid] = (op.lease, op.expires, op.timeout_s, op.deadline,
                                LeaseState.ACTIVE)
            self.lease_accepted[lid] = set()
            for tid in op.lease.task_ids:
                self.queued.discard(tid)
                self.issues[tid] += 1
        elif isinstance(op, RenewLease):
            lease, _, timeout, deadline, state = self.leases[op.lease_id]
            self.leases[op.lease_id] = (lease, op.expires, timeout, deadline, state)
        elif isinstance(op, AcceptResult):
            for tid in op.result.task_ids:
                if tid in self.accepted:
                    raise LocalProtocolError(f"task {tid} counted twice")
                self.accepted[tid] = (op.result.lease_id, op.result)
                self.lease_accepted[op.result.lease_id].add(tid)
        elif isinstance(op, CloseLease):
            lease, expires, timeout, deadline, _ = self.leases[op.lease_id]
            self.leases[op.lease_id] = (lease, expires, timeout, deadline, op.state)
            self.queued.update(op.requeued)
            self.tasks.update((t.task_id, t) for t in op.reseeded)
        elif isinstance(op, PublishVersion):
            self.latest, self.last_publish = op.version, op.time
            self.interval = op.step_interval_s
        else:
            self.scores[op.peer] = op.score

    def load(self) -> TrainerSnapshot:
        active = tuple(
            ActiveLease(lease, expires, timeout, deadline,
                        frozenset(self.lease_accepted[lid]))
            for lid, (lease, expires, timeout, deadline, state) in self.leases.items()
            if state is LeaseState.ACTIVE)
        return TrainerSnapshot(
            latest_version=self.latest, last_publish=self.last_publish,
            step_interval_s=self.interval,
            queued=tuple((self.tasks[t], self.issues[t]) for t in sorted(self.queued)),
            active=active,
            closed={lid: row[4] for lid, row in self.leases.items()
                    if row[4] is not LeaseState.ACTIVE},
            done=frozenset(self.accepted),
            next_task_id=max(self.tasks, default=-1) + 1,
            lease_seq=len(self.leases),
            scores=dict(self.scores),
        )

