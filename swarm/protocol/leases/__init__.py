"""Signed rollout leases (sans-IO): messages, the trainer's lease book and the peer's side.

Flow: a peer sends a :class:`Claim` (its measured tokens/s, usable policy version, how many
tasks it wants); the trainer answers with a :class:`Lease` (tasks, allowed versions, expiry)
signed by the trainer key, or a :class:`Verdict` saying why not. The peer verifies the lease
(signed by *its* trainer, addressed to itself), generates, sends :class:`Heartbeat` messages
that renew the lease, and finally a :class:`Result` signed by itself. The trainer accepts a
result only if the signature is valid, the signer holds the lease, the lease is live (before
expiry plus grace), the version is within the staleness bound ``latest - k`` and no task in
it was counted before; the :class:`Verdict` names a :class:`Reason` either way. Silence
expires a lease and its unfinished tasks go back to the queue, so every task counts once.

Modules:

- :mod:`~swarm.protocol.leases.messages`: limits, reasons, task types, the signed messages
  and :func:`decode_message` (their wire form);
- :mod:`~swarm.protocol.leases.store`: the state operations the trainer commits, its
  snapshot and the :class:`LeaseStore` protocol (:class:`MemoryLeaseStore` in memory);
- :mod:`~swarm.protocol.leases.trainer_book`: :class:`TrainerLeases`, the trainer's side;
- :mod:`~swarm.protocol.leases.peer_book`: :class:`PeerLeases`, a rollout peer's side.

The fault scenarios that exercise them live in :mod:`swarm.sim.lease_faults`.
"""

from swarm.protocol.leases.messages import (
    NO_ROOT,
    Claim,
    Completion,
    FinishReason,
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
    decode_message,
)
from swarm.protocol.leases.peer_book import HeldLease, PeerLeases
from swarm.protocol.leases.store import (
    AcceptResult,
    ActiveLease,
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
from swarm.protocol.leases.trainer_book import (
    Accepted,
    LeaseConfig,
    LeaseExpired,
    LeaseStats,
    Rejected,
    TrainerLeases,
)

__all__ = [
    "NO_ROOT",
    "AcceptResult",
    "Accepted",
    "ActiveLease",
    "AddTasks",
    "Claim",
    "CloseLease",
    "Completion",
    "FinishReason",
    "Heartbeat",
    "HeldLease",
    "IssueLease",
    "Lease",
    "LeaseConfig",
    "LeaseExpired",
    "LeaseState",
    "LeaseStats",
    "LeaseStore",
    "MemoryLeaseStore",
    "Message",
    "PeerLeases",
    "PublishVersion",
    "Reason",
    "Rejected",
    "RenewLease",
    "Result",
    "RolloutTask",
    "Sampling",
    "ScorePeer",
    "StateOp",
    "TaskResult",
    "TrainerLeases",
    "TrainerSnapshot",
    "Verdict",
    "decode_message",
]
