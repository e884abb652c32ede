"""Signed rollout leases: messages, the trainer's lease book and the peer's side (sans-IO).

Flow: a peer sends a :class:`Claim` (its measured tokens/s, usable policy version, how many
tasks it wants); the trainer answers with a :class:`Lease` (tasks, allowed versions, expiry)
signed by the trainer key, or a :class:`Verdict` saying why not. The peer verifies the lease
(signed by *its* trainer, addressed to itself), generates, sends :class:`Heartbeat` messages
that renew the lease, and finally a :class:`Result` signed by itself. The trainer accepts a
result only if the signature is valid, the signer holds the lease, the lease is live (before
expiry plus grace), the version is within the staleness bound ``latest - k`` and no task in
it was counted before; the :class:`Verdict` names a :class:`Reason` either way. Silence
expires a lease and its unfinished tasks go back to the queue, so every task counts once.

Wire form of every message: canonical msgpack ``[tag, body, signature]`` where ``body`` is
the canonical msgpack map of the fields and the Ed25519 signature covers
``b"swarm/<tag>/v1\\0" + body`` (one domain per message type, so no signature can be
replayed as another kind of message). Times travel as integer milliseconds; the API takes
``now`` in seconds (float). Nothing here does I/O: the driver moves messages and calls
:meth:`TrainerLeases.tick` on a timer; state changes go to a :class:`LeaseStore` in one
:meth:`~LeaseStore.commit` per call, before any reply is returned.
"""

from __future__ import annotations

import array
import enum
import heapq
import logging
import math
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, TypeVar, cast

from swarm.content.ids import domain_hash
from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    Identity,
    peer_id_from_public_key,
)
from swarm.identity import verify as verify_signature
from swarm.protocol.scheduling import (
    SchedulingConfig,
    SpeedTable,
    ewma,
    plan_lease,
    staleness_headroom,
)
from swarm.wire import strict

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LEASE_ID_LEN = 16
MAX_MESSAGE_BYTES = 64 << 20
MAX_CONTROL_BYTES = 4 << 20
MAX_RUN_LEN = 128
MAX_PROMPT_ID_LEN = 256
MAX_DETAIL_LEN = 200
MAX_TASKS_PER_LEASE = 4096
MAX_GROUP_SIZE = 1024
MAX_PROMPT_TOKENS = 1 << 17
MAX_COMPLETION_TOKENS = 1 << 17
MAX_VERSION = (1 << 63) - 1
MAX_TIME_MS = (1 << 63) - 1
MAX_TASK_ID = (1 << 63) - 1
MAX_TOKEN_ID = (1 << 32) - 1
MAX_TOKENS_PER_S = 1e9


class Reason(enum.StrEnum):
    """Why a message was accepted or refused; peers log it, the trainer counts it."""

    ACCEPTED = "accepted"
    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad_signature"
    FOREIGN_LEASE = "foreign_lease"
    """A lease not signed by our trainer (peer side)."""
    WRONG_RUN = "wrong_run"
    SENDER_MISMATCH = "sender_mismatch"
    """The transport sender is not the signer: someone replays another peer's message."""
    REPLAY = "replay"
    """A claim or heartbeat not newer than the last one seen from its signer."""
    UNKNOWN_LEASE = "unknown_lease"
    NOT_HOLDER = "not_holder"
    DUPLICATE = "duplicate"
    """Tasks already counted, or the lease already completed."""
    SUPERSEDED = "superseded"
    """A backup lease delivered these tasks first (no fault of the holder)."""
    EXPIRED = "expired"
    STALE_VERSION = "stale_version"
    UNKNOWN_VERSION = "unknown_version"
    TASK_NOT_IN_LEASE = "task_not_in_lease"
    BAD_SHAPE = "bad_shape"
    NO_WORK = "no_work"
    BANNED = "banned"
    TOO_MANY_LEASES = "too_many_leases"


class LeaseState(enum.StrEnum):
    ACTIVE = "active"
    COMPLETED = "completed"
    EXPIRED = "expired"
    RELEASED = "released"
    """Closed early by the trainer (its results fell out of the staleness bound)."""
    SUPERSEDED = "superseded"
    """Every task it still had was delivered first through a backup lease."""


PENALTIES: Mapping[Reason, float] = {
    Reason.MALFORMED: 10.0,
    Reason.BAD_SIGNATURE: 10.0,
    Reason.FOREIGN_LEASE: 10.0,
    Reason.SENDER_MISMATCH: 10.0,
    Reason.NOT_HOLDER: 10.0,
    Reason.TASK_NOT_IN_LEASE: 10.0,
    Reason.UNKNOWN_LEASE: 5.0,
    Reason.BAD_SHAPE: 5.0,
    Reason.REPLAY: 3.0,
    Reason.DUPLICATE: 2.0,
    Reason.EXPIRED: 1.0,
    Reason.UNKNOWN_VERSION: 1.0,
    Reason.WRONG_RUN: 1.0,
    Reason.STALE_VERSION: 0.5,
}
"""Score lost per refusal; reasons absent here (no work, too many leases) cost nothing."""


def ms(now: float) -> int:
    """Seconds (float) to integer milliseconds, as times travel on the wire."""
    return round(now * 1000)


# --------------------------------------------------------------------------- field codecs


def _get_float(m: Mapping[str, Any], key: str, lo: float, hi: float) -> float:
    v = m[key]
    if type(v) is not float or not math.isfinite(v) or not lo <= v <= hi:
        raise DecodeError(f"field {key!r}: expected a finite float in [{lo}, {hi}]")
    return v


def _get_opt_int(m: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    return None if m[key] is None else strict.get_int(m, key, lo, hi)


def _array_bytes(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    arr = array.array(typecode, values)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _array_values(typecode: str, data: bytes, what: str, max_count: int) -> array.array[Any]:
    size = array.array(typecode).itemsize
    if len(data) % size or len(data) // size > max_count:
        raise DecodeError(f"{what}: {len(data)} bytes is not a list of at most {max_count} "
                          f"{typecode!r} items")
    arr = array.array(typecode)
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def _u32_bytes(values: Sequence[int]) -> bytes:
    return _array_bytes("I", values)


def _u32_values(data: bytes, what: str, max_count: int) -> tuple[int, ...]:
    return tuple(_array_values("I", data, what, max_count))


def _f64_bytes(values: Sequence[float]) -> bytes:
    return _array_bytes("d", values)


def _f64_values(data: bytes, what: str, max_count: int) -> tuple[float, ...]:
    arr = _array_values("d", data, what, max_count)
    # NaN anywhere makes the sum NaN and +inf makes it +inf or NaN, so a finite (or -inf)
    # sum proves the values clean in one fast pass; only then is each value examined.
    total = sum(arr)
    if (math.isnan(total) or total == math.inf) and not all(
            math.isfinite(x) or x == -math.inf for x in arr):
        raise DecodeError(f"{what}: log-probs are finite or -inf")
    return tuple(arr)


def _check_float(name: str, value: float, lo: float, hi: float) -> float:
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name} must be a finite number in [{lo}, {hi}]")
    return v


# --------------------------------------------------------------------------- task types


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings a rollout engine applies to every completion of a task."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _check_float("temperature", self.temperature,
                                                             0.0, 100.0))
        object.__setattr__(self, "top_p", _check_float("top_p", self.top_p, 0.0, 1.0))
        if not 1 <= self.max_new_tokens <= MAX_COMPLETION_TOKENS:
            raise ValueError(f"max_new_tokens is in [1, {MAX_COMPLETION_TOKENS}]")
        if not 0 <= self.seed <= MAX_TIME_MS:
            raise ValueError("seed is a non-negative 63-bit integer")

    def to_wire(self) -> dict[str, Any]:
        return {"temp": self.temperature, "top_p": self.top_p, "max_new": self.max_new_tokens,
                "seed": self.seed}

    _KEYS: ClassVar[frozenset[str]] = frozenset({"temp", "top_p", "max_new", "seed"})

    @classmethod
    def from_wire(cls, obj: object) -> SamplingParams:
        m = strict.as_map(obj, cls._KEYS, "sampling")
        return cls(_get_float(m, "temp", 0.0, 100.0), _get_float(m, "top_p", 0.0, 1.0),
                   strict.get_int(m, "max_new", 1, MAX_COMPLETION_TOKENS),
                   strict.get_int(m, "seed", 0, MAX_TIME_MS))


@dataclass(frozen=True, slots=True)
class RolloutTask:
    """One unit of rollout work: a prompt (by id and/or tokens), sampled ``group_size`` times."""

    task_id: int
    prompt_id: str
    prompt_tokens: tuple[int, ...] = ()
    group_size: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not 0 <= self.task_id <= MAX_TASK_ID:
            raise ValueError("task_id is a non-negative 63-bit integer")
        if len(self.prompt_id) > MAX_PROMPT_ID_LEN:
            raise ValueError(f"prompt_id is at most {MAX_PROMPT_ID_LEN} characters")
        if len(self.prompt_tokens) > MAX_PROMPT_TOKENS:
            raise ValueError(f"at most {MAX_PROMPT_TOKENS} prompt tokens")
        if not 1 <= self.group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"group_size is in [1, {MAX_GROUP_SIZE}]")

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.task_id, "prompt_id": self.prompt_id,
                "prompt": _u32_bytes(self.prompt_tokens), "group": self.group_size,
                "sampling": self.sampling.to_wire()}

    _KEYS: ClassVar[frozenset[str]] = frozenset({"id", "prompt_id", "prompt", "group",
                                                 "sampling"})

    @classmethod
    def from_wire(cls, obj: object) -> RolloutTask:
        m = strict.as_map(obj, cls._KEYS, "task")
        prompt = strict.get_bytes(m, "prompt", max_len=4 * MAX_PROMPT_TOKENS)
        try:
            return cls(strict.get_int(m, "id", 0, MAX_TASK_ID),
                       strict.get_str(m, "prompt_id", MAX_PROMPT_ID_LEN),
                       _u32_values(prompt, "prompt", MAX_PROMPT_TOKENS),
                       strict.get_int(m, "group", 1, MAX_GROUP_SIZE),
                       SamplingParams.from_wire(m["sampling"]))
        except ValueError as exc:
            raise DecodeError(f"task: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation: its token ids and the log-prob of each under the policy."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("one log-prob per token")
        if len(self.token_ids) > MAX_COMPLETION_TOKENS:
            raise ValueError(f"at most {MAX_COMPLETION_TOKENS} tokens per completion")

    def to_wire(self) -> list[bytes]:
        return [_u32_bytes(self.token_ids), _f64_bytes(self.logprobs)]

    @classmethod
    def from_wire(cls, obj: object) -> Completion:
        if (type(obj) is not list or len(obj) != 2 or type(obj[0]) is not bytes
                or type(obj[1]) is not bytes):
            raise DecodeError("completion: expected [token bytes, log-prob bytes]")
        tokens = _u32_values(obj[0], "tokens", MAX_COMPLETION_TOKENS)
        logprobs = _f64_values(obj[1], "logprobs", MAX_COMPLETION_TOKENS)
        if len(tokens) != len(logprobs):
            raise DecodeError("completion: one log-prob per token")
        return cls(tokens, logprobs)


@dataclass(frozen=True, slots=True)
class TaskResult:
    """The ``group_size`` completions of one task."""

    task_id: int
    completions: tuple[Completion, ...]

    @property
    def n_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def to_wire(self) -> list[Any]:
        return [self.task_id, [c.to_wire() for c in self.completions]]

    @classmethod
    def from_wire(cls, obj: object) -> TaskResult:
        if (type(obj) is not list or len(obj) != 2 or type(obj[0]) is not int
                or not 0 <= obj[0] <= MAX_TASK_ID or type(obj[1]) is not list
                or len(obj[1]) > MAX_GROUP_SIZE):
            raise DecodeError("task result: expected [task id, [completion, ...]]")
        return cls(obj[0], tuple(Completion.from_wire(c) for c in obj[1]))


# --------------------------------------------------------------------------- messages


def _check_key(name: str, key: bytes) -> None:
    if len(key) != PUBLIC_KEY_LEN:
        raise ValueError(f"{name} is a 32-byte Ed25519 public key")


class _Signed:
    """Shared signing, verification and encoding of the message dataclasses."""

    __slots__ = ()
    TAG: ClassVar[str]
    signer: bytes
    signature: bytes
    _body: bytes | None

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def body(self) -> bytes:
        """The canonical body bytes the signature covers (every field but the signature).

        Computed once per message object (``replace`` makes a new object, so a changed
        field never reuses a stale body).
        """
        cached: bytes | None = self._body
        if cached is None:
            fields = self._fields()
            fields["v"] = FORMAT_VERSION
            fields["signer"] = self.signer
            cached = strict.pack(fields)
            object.__setattr__(self, "_body", cached)
        return cached

    @property
    def signer_peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)

    def encode(self) -> bytes:
        """Wire bytes ``[tag, body, signature]``.

        :raises LocalProtocolError: the message is not signed.
        """
        if len(self.signature) != SIGNATURE_LEN:
            raise LocalProtocolError(f"{self.TAG}: sign the message before encoding it")
        return strict.pack([self.TAG, self.body(), self.signature])

    def verify(self) -> None:
        """:raises SignatureError: unsigned, or the signature does not match the signer."""
        if len(self.signature) != SIGNATURE_LEN:
            raise SignatureError(f"{self.TAG}: unsigned")
        verify_signature(self.signer, self.signature, _domain(self.TAG) + self.body())

    def is_valid(self) -> bool:
        try:
            self.verify()
        except SignatureError:
            return False
        return True

    @property
    def digest(self) -> bytes:
        """A 32-byte id of this signed message (over tag, body and signature)."""
        return domain_hash("swarm/lease-message", self.TAG.encode(), self.body(), self.signature)


def _domain(tag: str) -> bytes:
    return f"swarm/{tag}/v{FORMAT_VERSION}".encode() + b"\0"


_M = TypeVar("_M", bound=_Signed)


def _sign(msg: _M, identity: Identity) -> _M:
    unsigned: Any = replace(cast(Any, msg), signer=identity.public_key, signature=b"")
    signed: _M = replace(unsigned, signature=identity.sign(_domain(msg.TAG) + unsigned.body()))
    return signed


@dataclass(frozen=True, slots=True)
class Claim(_Signed):
    """A peer asks for work: its speed, the version it can generate with, how much it wants."""

    TAG: ClassVar[str] = "claim"
    run: str
    tokens_per_s: float
    version: int
    want: int
    time_ms: int
    downloading: int | None = None
    """The newer version the peer is fetching, if any."""
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens_per_s", _check_float(
            "tokens_per_s", self.tokens_per_s, 0.0, MAX_TOKENS_PER_S))
        if not 1 <= self.want <= MAX_TASKS_PER_LEASE:
            raise ValueError(f"want is in [1, {MAX_TASKS_PER_LEASE}]")
        _check_key("signer", self.signer)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "tps": self.tokens_per_s, "version": self.version,
                "want": self.want, "time": self.time_ms, "downloading": self.downloading}

    def sign(self, identity: Identity) -> Claim:
        return _sign(self, identity)

    @classmethod
    def _from_map(cls, m: Mapping[str, Any]) -> Claim:
        return cls(strict.get_str(m, "run", MAX_RUN_LEN),
                   _get_float(m, "tps", 0.0, MAX_TOKENS_PER_S),
                   strict.get_int(m, "version", 0, MAX_VERSION),
                   strict.get_int(m, "want", 1, MAX_TASKS_PER_LEASE),
                   strict.get_int(m, "time", 0, MAX_TIME_MS),
                   _get_opt_int(m, "downloading", 0, MAX_VERSION),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


@dataclass(frozen=True, slots=True)
class Lease(_Signed):
    """The trainer's grant of ``tasks`` to ``holder`` until ``expires_ms`` (renewable).

    Results may use any version ``v`` with ``v >= min_version`` and ``v >= latest - max_staleness``
    at the time they arrive; they are accepted until ``expires_ms + grace_ms``.
    """

    TAG: ClassVar[str] = "lease"
    lease_id: bytes
    run: str
    holder: bytes
    tasks: tuple[RolloutTask, ...]
    min_version: int
    latest_version: int
    max_staleness: int
    issued_ms: int
    expires_ms: int
    grace_ms: int
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.lease_id) != LEASE_ID_LEN:
            raise ValueError(f"lease_id is {LEASE_ID_LEN} bytes")
        _check_key("holder", self.holder)
        _check_key("signer", self.signer)
        if not 1 <= len(self.tasks) <= MAX_TASKS_PER_LEASE:
            raise ValueError(f"a lease holds 1..{MAX_TASKS_PER_LEASE} tasks")
        if len({t.task_id for t in self.tasks}) != len(self.tasks):
            raise ValueError("task ids in a lease are distinct")
        if self.expires_ms < self.issued_ms or self.min_version > self.latest_version:
            raise ValueError("expiry before issue, or min_version above latest_version")

    @property
    def holder_peer_id(self) -> str:
        return peer_id_from_public_key(self.holder)

    @property
    def task_ids(self) -> tuple[int, ...]:
        return tuple(t.task_id for t in self.tasks)

    def _fields(self) -> dict[str, Any]:
        return {"id": self.lease_id, "run": self.run, "holder": self.holder,
                "tasks": [t.to_wire() for t in self.tasks], "min_version": self.min_version,
                "latest": self.latest_version, "k": self.max_staleness,
                "issued": self.issued_ms, "expires": self.expires_ms, "grace": self.grace_ms}

    def sign(self, identity: Identity) -> Lease:
        return _sign(self, identity)

    @classmethod
    def _from_map(cls, m: Mapping[str, Any]) -> Lease:
        rows = strict.get_list(m, "tasks", MAX_TASKS_PER_LEASE)
        return cls(strict.get_bytes(m, "id", LEASE_ID_LEN),
                   strict.get_str(m, "run", MAX_RUN_LEN),
                   strict.get_bytes(m, "holder", PUBLIC_KEY_LEN),
                   tuple(RolloutTask.from_wire(r) for r in rows),
                   strict.get_int(m, "min_version", 0, MAX_VERSION),
                   strict.get_int(m, "latest", 0, MAX_VERSION),
                   strict.get_int(m, "k", 0, MAX_VERSION),
                   strict.get_int(m, "issued", 0, MAX_TIME_MS),
                   strict.get_int(m, "expires", 0, MAX_TIME_MS),
                   strict.get_int(m, "grace", 0, MAX_TIME_MS),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


@dataclass(frozen=True, slots=True)
class Heartbeat(_Signed):
    """The holder is still working on ``lease_id`` (``done`` tasks finished so far)."""

    TAG: ClassVar[str] = "heartbeat"
    run: str
    lease_id: bytes
    done: int
    time_ms: int
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.lease_id) != LEASE_ID_LEN:
            raise ValueError(f"lease_id is {LEASE_ID_LEN} bytes")
        _check_key("signer", self.signer)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "lease": self.lease_id, "done": self.done,
                "time": self.time_ms}

    def sign(self, identity: Identity) -> Heartbeat:
        return _sign(self, identity)

    @classmethod
    def _from_map(cls, m: Mapping[str, Any]) -> Heartbeat:
        return cls(strict.get_str(m, "run", MAX_RUN_LEN),
                   strict.get_bytes(m, "lease", LEASE_ID_LEN),
                   strict.get_int(m, "done", 0, MAX_TASKS_PER_LEASE),
                   strict.get_int(m, "time", 0, MAX_TIME_MS),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


@dataclass(frozen=True, slots=True)
class Result(_Signed):
    """Completions for some or all tasks of ``lease_id``, generated with ``version``."""

    TAG: ClassVar[str] = "result"
    run: str
    lease_id: bytes
    version: int
    results: tuple[TaskResult, ...]
    time_ms: int
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.lease_id) != LEASE_ID_LEN:
            raise ValueError(f"lease_id is {LEASE_ID_LEN} bytes")
        if not 1 <= len(self.results) <= MAX_TASKS_PER_LEASE:
            raise ValueError(f"a result covers 1..{MAX_TASKS_PER_LEASE} tasks")
        _check_key("signer", self.signer)

    @property
    def task_ids(self) -> tuple[int, ...]:
        return tuple(r.task_id for r in self.results)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.results)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "lease": self.lease_id, "version": self.version,
                "results": [r.to_wire() for r in self.results], "time": self.time_ms}

    def sign(self, identity: Identity) -> Result:
        return _sign(self, identity)

    @classmethod
    def _from_map(cls, m: Mapping[str, Any]) -> Result:
        rows = strict.get_list(m, "results", MAX_TASKS_PER_LEASE)
        if not rows:
            raise DecodeError("result: no task results")
        return cls(strict.get_str(m, "run", MAX_RUN_LEN),
                   strict.get_bytes(m, "lease", LEASE_ID_LEN),
                   strict.get_int(m, "version", 0, MAX_VERSION),
                   tuple(TaskResult.from_wire(r) for r in rows),
                   strict.get_int(m, "time", 0, MAX_TIME_MS),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


SUBJECTS = frozenset({"claim", "heartbeat", "result"})


@dataclass(frozen=True, slots=True)
class Verdict(_Signed):
    """The trainer's answer to a claim it cannot grant, a heartbeat or a result.

    ``expires_ms`` is the lease's new expiry after a renewal (0 otherwise); ``accepted``
    lists the task ids a result got counted for (for ``DUPLICATE``: those of its tasks
    that were already counted; empty when the whole lease was).
    """

    TAG: ClassVar[str] = "verdict"
    run: str
    subject: str
    lease_id: bytes
    reason: Reason
    accepted: tuple[int, ...] = ()
    expires_ms: int = 0
    detail: str = ""
    time_ms: int = 0
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.subject not in SUBJECTS:
            raise ValueError(f"subject is one of {sorted(SUBJECTS)}")
        if len(self.lease_id) not in (0, LEASE_ID_LEN):
            raise ValueError(f"lease_id is empty or {LEASE_ID_LEN} bytes")
        object.__setattr__(self, "reason", Reason(self.reason))
        object.__setattr__(self, "detail", self.detail[:MAX_DETAIL_LEN])
        _check_key("signer", self.signer)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "subject": self.subject, "lease": self.lease_id,
                "reason": self.reason.value, "accepted": list(self.accepted),
                "expires": self.expires_ms, "detail": self.detail, "time": self.time_ms}

    def sign(self, identity: Identity) -> Verdict:
        return _sign(self, identity)

    @classmethod
    def _from_map(cls, m: Mapping[str, Any]) -> Verdict:
        lease_id = strict.get_bytes(m, "lease", max_len=LEASE_ID_LEN)
        if len(lease_id) not in (0, LEASE_ID_LEN):
            raise DecodeError("verdict: lease id is empty or 16 bytes")
        accepted = strict.get_list(m, "accepted", MAX_TASKS_PER_LEASE)
        if not all(type(t) is int and 0 <= t <= MAX_TASK_ID for t in accepted):
            raise DecodeError("verdict: accepted task ids are non-negative integers")
        return cls(strict.get_str(m, "run", MAX_RUN_LEN),
                   strict.get_str(m, "subject", 16, SUBJECTS),
                   lease_id,
                   Reason(strict.get_str(m, "reason", 32, frozenset(r.value for r in Reason))),
                   tuple(accepted),
                   strict.get_int(m, "expires", 0, MAX_TIME_MS),
                   strict.get_str(m, "detail", MAX_DETAIL_LEN),
                   strict.get_int(m, "time", 0, MAX_TIME_MS),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


Message = Claim | Lease | Heartbeat | Result | Verdict
_TYPES: Mapping[str, Any] = {c.TAG: c for c in (Claim, Lease, Heartbeat, Result, Verdict)}
_BODY_KEYS: Mapping[str, frozenset[str]] = {
    "claim": frozenset({"v", "signer", "run", "tps", "version", "want", "time", "downloading"}),
    "lease": frozenset({"v", "signer", "id", "run", "holder", "tasks", "min_version", "latest",
                        "k", "issued", "expires", "grace"}),
    "heartbeat": frozenset({"v", "signer", "run", "lease", "done", "time"}),
    "result": frozenset({"v", "signer", "run", "lease", "version", "results", "time"}),
    "verdict": frozenset({"v", "signer", "run", "subject", "lease", "reason", "accepted",
                          "expires", "detail", "time"}),
}
_MAX_BYTES: Mapping[str, int] = {"claim": 4096, "heartbeat": 4096, "verdict": 64 << 10,
                                 "lease": MAX_CONTROL_BYTES, "result": MAX_MESSAGE_BYTES}


def decode_message(data: bytes | bytearray | memoryview, *,
                   check_signature: bool = True) -> Message:
    """Strictly decode one lease-protocol message and verify its signature.

    Sizes are bounded per message type before decoding the body.

    :raises DecodeError: malformed, oversized, non-canonical, unknown tag or version.
    :raises SignatureError: the signature does not verify against the signer in the body.
    """
    outer = strict.unpack(data, max_bytes=MAX_MESSAGE_BYTES + 256, max_bin=MAX_MESSAGE_BYTES,
                          max_str=16, max_array=3, max_map=0)
    if (type(outer) is not list or len(outer) != 3 or type(outer[0]) is not str
            or type(outer[1]) is not bytes or type(outer[2]) is not bytes):
        raise DecodeError("lease message: expected [tag, body, signature]")
    tag, body, signature = outer
    cls = _TYPES.get(tag)
    if cls is None:
        raise DecodeError(f"lease message: unknown tag {tag!r}")
    if len(body) > _MAX_BYTES[tag]:
        raise DecodeError(f"{tag}: body of {len(body)} bytes exceeds {_MAX_BYTES[tag]}")
    if len(signature) != SIGNATURE_LEN:
        raise SignatureError(f"{tag}: signature is not {SIGNATURE_LEN} bytes")
    obj = strict.unpack(body, max_bytes=_MAX_BYTES[tag], max_str=max(MAX_PROMPT_ID_LEN,
                        MAX_DETAIL_LEN, MAX_RUN_LEN), max_bin=8 * MAX_COMPLETION_TOKENS,
                        max_array=MAX_TASKS_PER_LEASE, max_map=16)
    if isinstance(obj, dict) and obj.get("v", FORMAT_VERSION) != FORMAT_VERSION:
        raise DecodeError(f"{tag}: unknown format version {obj['v']!r}")
    m = strict.as_map(obj, _BODY_KEYS[tag], tag)
    strict.get_int(m, "v", FORMAT_VERSION, FORMAT_VERSION)
    try:
        msg: Message = cls._from_map(m)
    except ValueError as exc:
        raise DecodeError(f"{tag}: {exc}") from exc
    msg = replace(msg, signature=signature)
    object.__setattr__(msg, "_body", body)  # canonical: exactly what the fields pack to
    if check_signature:
        verify_signature(msg.signer, signature, _domain(tag) + body)
    return msg


# --------------------------------------------------------------------------- peer scores


@dataclass(slots=True)
class PeerRecord:
    """What one peer earned: its score and how many messages were refused, by reason."""

    score: float = 0.0
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)


class PeerScores:
    """Score table: refusals cost :data:`PENALTIES`, accepted results earn ``reward``.

    A peer at or below ``ban_below`` is banned (its claims are refused). One record per
    peer that ever sent something; the population bounds it.
    """

    __slots__ = ("_ban_below", "_records", "_reward")

    def __init__(self, *, ban_below: float = -20.0, reward: float = 1.0,
                 cap: float = 20.0) -> None:
        self._ban_below = ban_below
        self._reward = (reward, cap)
        self._records: dict[str, PeerRecord] = {}

    def record(self, peer: str, reason: Reason) -> float:
        """Count ``reason`` against (or for) ``peer``; returns the new score."""
        rec = self._records.setdefault(peer, PeerRecord())
        if reason is Reason.ACCEPTED:
            reward, cap = self._reward
            rec.accepted += 1
            rec.score = min(cap, rec.score + reward)
        else:
            rec.refused[reason.value] += 1
            rec.score -= PENALTIES.get(reason, 0.0)
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


# --------------------------------------------------------------------------- persistence


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
    """A lease ended; ``requeued`` of its tasks (never counted) go back to the queue."""

    lease_id: bytes
    state: LeaseState
    requeued: tuple[int, ...]


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


# --------------------------------------------------------------------------- trainer side


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


class _Refused(Exception):
    def __init__(self, reason: Reason, detail: str, counted: tuple[int, ...] = ()) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.counted = counted


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
        self._scores = PeerScores(ban_below=config.ban_below)
        for peer, score in snap.scores.items():
            self._scores.set_score(peer, score)
        self._last_claim: dict[str, int] = {}
        self._fresh: list[Accepted] = []
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
    def scores(self) -> PeerScores:
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
                  sampling: SamplingParams | None = None) -> list[RolloutTask]:
        """Queue one task per ``(prompt_id, prompt_tokens)``.

        :raises LocalProtocolError: the queue bound ``max_queue`` would be exceeded.
        """
        params = sampling or SamplingParams()
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
            self._count_refusal(ref.reason, blamed, subject, ref.detail, ops)
            self._store.commit(ops)
            return [self._verdict(subject, lease_id, ref.reason, now, detail=ref.detail,
                                  accepted=ref.counted)]
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
            score = self._scores.record(sender, reason)
            self._store.commit([ScorePeer(sender, score)])

    def _count_refusal(self, reason: Reason, peer: str, subject: str, detail: str,
                       ops: list[StateOp]) -> None:
        self.stats.refused[reason.value] += 1
        if reason in PENALTIES:
            ops.append(ScorePeer(peer, self._scores.record(peer, reason)))
            logger.warning("refused %s from %s: %s (%s)", subject, peer, reason.value, detail)
        else:
            logger.debug("refused %s from %s: %s (%s)", subject, peer, reason.value, detail)

    def _verdict(self, subject: str, lease_id: bytes, reason: Reason, now: float, *,
                 accepted: tuple[int, ...] = (), expires: float = 0.0,
                 detail: str = "") -> Verdict:
        return Verdict(self._cfg.run, subject, lease_id, reason, accepted,
                       max(0, ms(expires)), detail, max(0, ms(now))).sign(self._id)

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
        floor = max(0, self._latest - self._cfg.max_staleness)
        if claim.version < floor:
            raise _Refused(Reason.STALE_VERSION,
                           f"version {claim.version} < {floor}; update first")
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
              ops: list[StateOp]) -> _LeaseRec:
        rec = self._leases.get(lease_id)
        if rec is None:
            state = self._closed.get(lease_id)
            if state is LeaseState.COMPLETED:
                raise _Refused(Reason.DUPLICATE, "lease already completed")
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
        rec = self._live(hb.lease_id, hb.signer, now, ops)
        if hb.time_ms <= rec.last_heartbeat_ms:
            raise _Refused(Reason.REPLAY, "heartbeat not newer than the last")
        rec.last_heartbeat_ms = hb.time_ms
        expires = max(rec.expires, min(now + rec.timeout_s, rec.deadline))
        if expires != rec.expires:
            rec.expires = expires
            ops.append(RenewLease(hb.lease_id, expires))
            self.stats.renewals += 1
        return self._verdict("heartbeat", hb.lease_id, Reason.ACCEPTED, now, expires=expires)

    def _result(self, res: Result, peer: str, now: float, ops: list[StateOp]) -> Verdict:
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
                    len(c.token_ids) > task.sampling.max_new_tokens for c in tr.completions):
                raise _Refused(Reason.BAD_SHAPE,
                               f"task {tr.task_id}: {len(tr.completions)} completions for a "
                               f"group of {task.group_size}, or too many tokens")
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
        ops.append(ScorePeer(peer, self._scores.record(peer, Reason.ACCEPTED)))
        self.stats.results_accepted += 1
        self.stats.tasks_completed += len(ids)
        self._fresh.append(Accepted(res.lease_id, peer, res.version, res.results))
        if not rec.pending:
            self._close(res.lease_id, LeaseState.COMPLETED, ops)
        return self._verdict("result", res.lease_id, Reason.ACCEPTED, now, accepted=ids)

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
        ops.append(CloseLease(lease_id, state, tuple(requeued)))
        self._closed[lease_id] = state
        if state is LeaseState.COMPLETED:
            self.stats.leases_completed += 1
        elif state is LeaseState.EXPIRED:
            self.stats.leases_expired += 1
            self._speeds.timed_out(rec.lease.holder_peer_id, rec.speed)
        elif state is LeaseState.SUPERSEDED:
            self.stats.leases_superseded += 1
        else:
            self.stats.leases_released += 1
        return tuple(requeued)


# --------------------------------------------------------------------------- peer side

_DROPS_LEASE = frozenset({Reason.EXPIRED, Reason.STALE_VERSION, Reason.UNKNOWN_LEASE,
                          Reason.NOT_HOLDER})


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
        self.scores = PeerScores()
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
               now: float) -> Result:
        """A signed result for tasks of a held lease.

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
                      self._stamp(now)).sign(self._id)

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
            self.scores.record(blamed, reason)
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
