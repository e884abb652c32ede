"""Lease-protocol messages: limits, reasons, task types and the five signed messages.

Wire form of every message: canonical msgpack ``[tag, body, signature]`` where ``body`` is
the canonical msgpack map of the fields and the Ed25519 signature covers
``b"swarm/<tag>/v1\\0" + body`` (one domain per message type, so no signature can be
replayed as another kind of message). Times travel as integer milliseconds; the API takes
``now`` in seconds (float). :func:`decode_message` bounds every size before allocating.
"""

from __future__ import annotations

import array
import enum
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, TypeVar, cast

from swarm.content.ids import domain_hash
from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    Identity,
    peer_id_from_public_key,
    sign_message,
    signing_domain,
    verify_message,
)
from swarm.wire import strict

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
MAX_SEED = (1 << 63) - 1
MAX_STOP_TOKENS = 256
MAX_TEMPERATURE = 100.0
ROOT_LEN = 32
MAX_ENGINE_LEN = 32
NO_ROOT = b"\0" * ROOT_LEN
"""The weight root of a result that does not name one (the trainer's checks refuse it)."""


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
    RUN_OVER = "run_over"
    """The trainer finished the run, and the claimant holds its last version."""
    BANNED = "banned"
    TOO_MANY_LEASES = "too_many_leases"
    REJECTED = "rejected"
    """A check of the result's completions failed (log-probs, plausibility, weight root,
    a copy, or a check of the user's): its tasks are re-issued to others."""


class LeaseState(enum.StrEnum):
    ACTIVE = "active"
    COMPLETED = "completed"
    EXPIRED = "expired"
    RELEASED = "released"
    """Closed early by the trainer (its results fell out of the staleness bound)."""
    SUPERSEDED = "superseded"
    """Every task it still had was delivered first through a backup lease."""
    REJECTED = "rejected"
    """Its result failed a check of the completions; its tasks went back to the queue."""


PENALTIES: Mapping[str, float] = {
    Reason.MALFORMED: 10.0,
    Reason.BAD_SIGNATURE: 10.0,
    Reason.FOREIGN_LEASE: 10.0,
    Reason.SENDER_MISMATCH: 10.0,
    Reason.NOT_HOLDER: 10.0,
    Reason.TASK_NOT_IN_LEASE: 10.0,
    Reason.REJECTED: 10.0,
    Reason.UNKNOWN_LEASE: 5.0,
    Reason.BAD_SHAPE: 5.0,
    Reason.REPLAY: 3.0,
    Reason.DUPLICATE: 2.0,
    Reason.EXPIRED: 1.0,
    Reason.UNKNOWN_VERSION: 1.0,
    Reason.WRONG_RUN: 1.0,
    Reason.STALE_VERSION: 0.5,
}
"""Score lost per refusal; reasons absent here (no work, too many leases) cost nothing, and
so does a stale claim from a peer that says it is fetching a version inside the bound."""


def ms(now: float) -> int:
    """Seconds (float) to integer milliseconds, as times travel on the wire."""
    return round(now * 1000)


class _Refused(Exception):
    """A message refused for ``reason``; raised and caught inside the lease books."""

    def __init__(self, reason: Reason, detail: str, counted: tuple[int, ...] = (), *,
                 free: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.counted = counted
        self.free = free
        """Refused without the reason's penalty (an honest state, not misbehaviour)."""


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
class Sampling:
    """How a rollout engine samples every completion of a task; the same settings, seed and
    weights give the same tokens. It travels signed inside leases, so every field is
    bounded and checked both when built and when decoded."""

    max_tokens: int = 256
    """Most tokens generated per completion (a stop token counts)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax, lowest token id on ties)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Base seed: prompt i of a batch samples with seed + i. None: not reproducible."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a prompt ends after one of these tokens (included in the output)."""

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or not 1 <= self.max_tokens <= MAX_COMPLETION_TOKENS:
            raise ValueError(f"max_tokens is an int in [1, {MAX_COMPLETION_TOKENS}]")
        object.__setattr__(self, "temperature", _check_float(
            "temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        top_p = _check_float("top_p", self.top_p, 0.0, 1.0)
        if top_p == 0.0:
            raise ValueError("top_p must be in (0, 1]")
        object.__setattr__(self, "top_p", top_p)
        if type(self.top_k) is not int or not 0 <= self.top_k <= MAX_TOKEN_ID:
            raise ValueError(f"top_k is an int in [0, {MAX_TOKEN_ID}]")
        if self.seed is not None and (type(self.seed) is not int
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError("seed is None or a non-negative 63-bit int")
        stop = tuple(self.stop_token_ids)
        if len(stop) > MAX_STOP_TOKENS or any(
                type(t) is not int or not 0 <= t <= MAX_TOKEN_ID for t in stop):
            raise ValueError(f"stop_token_ids are at most {MAX_STOP_TOKENS} token ids")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_wire(self) -> dict[str, Any]:
        return {"max": self.max_tokens, "temp": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed,
                "stop": _u32_bytes(self.stop_token_ids)}

    _KEYS: ClassVar[frozenset[str]] = frozenset({"max", "temp", "top_p", "top_k", "seed",
                                                 "stop"})

    @classmethod
    def from_wire(cls, obj: object) -> Sampling:
        m = strict.as_map(obj, cls._KEYS, "sampling")
        top_p = _get_float(m, "top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise DecodeError("sampling: top_p is in (0, 1]")
        stop = strict.get_bytes(m, "stop", max_len=4 * MAX_STOP_TOKENS)
        return cls(strict.get_int(m, "max", 1, MAX_COMPLETION_TOKENS),
                   _get_float(m, "temp", 0.0, MAX_TEMPERATURE), top_p,
                   strict.get_int(m, "top_k", 0, MAX_TOKEN_ID),
                   _get_opt_int(m, "seed", 0, MAX_SEED),
                   _u32_values(stop, "stop", MAX_STOP_TOKENS))


@dataclass(frozen=True, slots=True)
class RolloutTask:
    """One unit of rollout work: a prompt (by id and/or tokens), sampled ``group_size`` times."""

    task_id: int
    prompt_id: str
    prompt_tokens: tuple[int, ...] = ()
    group_size: int = 1
    sampling: Sampling = field(default_factory=Sampling)

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
                       Sampling.from_wire(m["sampling"]))
        except ValueError as exc:
            raise DecodeError(f"task: {exc}") from exc


FinishReason = Literal["stop", "length"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length"})


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation, as an engine returns it and a result carries it."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the model's raw distribution (before
    temperature, top-p and top-k), as the trainer's policy computes it."""
    finish_reason: FinishReason = "length"
    """``"stop"``: it ended on a stop token; ``"length"``: it ran to ``max_tokens``."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("one log-prob per token")
        if len(self.token_ids) > MAX_COMPLETION_TOKENS:
            raise ValueError(f"at most {MAX_COMPLETION_TOKENS} tokens per completion")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason is one of {sorted(FINISH_REASONS)}")

    def to_wire(self) -> list[bytes | str]:
        return [_u32_bytes(self.token_ids), _f64_bytes(self.logprobs), self.finish_reason]

    @classmethod
    def from_wire(cls, obj: object) -> Completion:
        if (type(obj) is not list or len(obj) != 3 or type(obj[0]) is not bytes
                or type(obj[1]) is not bytes or type(obj[2]) is not str
                or obj[2] not in FINISH_REASONS):
            raise DecodeError("completion: expected [token bytes, log-prob bytes, "
                              "'stop' or 'length']")
        tokens = _u32_values(obj[0], "tokens", MAX_COMPLETION_TOKENS)
        logprobs = _f64_values(obj[1], "logprobs", MAX_COMPLETION_TOKENS)
        if len(tokens) != len(logprobs):
            raise DecodeError("completion: one log-prob per token")
        return cls(tokens, logprobs, cast(FinishReason, obj[2]))


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
        verify_message(self.signer, self.signature, lease_domain(self.TAG), self.body())

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


def lease_domain(tag: str) -> bytes:
    """The prefix a message of type ``tag`` signs before its body: ``swarm/<tag>/v1\\0``."""
    return signing_domain(tag, FORMAT_VERSION)


_M = TypeVar("_M", bound=_Signed)


def _sign(msg: _M, identity: Identity) -> _M:
    unsigned: Any = replace(cast(Any, msg), signer=identity.public_key, signature=b"")
    signed: _M = replace(unsigned,
                         signature=sign_message(identity, lease_domain(msg.TAG), unsigned.body()))
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
    root: bytes = NO_ROOT
    """The state root of the weights that generated it (the version's, for an honest peer)."""
    engine: str = ""
    """The class of engine that generated it (``"torch"``, ``"vllm"``; at most 32 chars)."""
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.lease_id) != LEASE_ID_LEN:
            raise ValueError(f"lease_id is {LEASE_ID_LEN} bytes")
        if not 1 <= len(self.results) <= MAX_TASKS_PER_LEASE:
            raise ValueError(f"a result covers 1..{MAX_TASKS_PER_LEASE} tasks")
        if len(self.root) != ROOT_LEN:
            raise ValueError(f"root is {ROOT_LEN} bytes")
        if len(self.engine) > MAX_ENGINE_LEN:
            raise ValueError(f"engine is at most {MAX_ENGINE_LEN} characters")
        _check_key("signer", self.signer)

    @property
    def commitment(self) -> bytes:
        """32 bytes binding everything the result says (run, lease, version, weight root,
        every token and log-prob, time) but not its signature; the trainer's verdict on
        the result names it."""
        return domain_hash("swarm/result-commitment", self.body())

    @property
    def task_ids(self) -> tuple[int, ...]:
        return tuple(r.task_id for r in self.results)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.results)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "lease": self.lease_id, "version": self.version,
                "results": [r.to_wire() for r in self.results], "time": self.time_ms,
                "root": self.root, "engine": self.engine}

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
                   strict.get_bytes(m, "root", ROOT_LEN),
                   strict.get_str(m, "engine", MAX_ENGINE_LEN),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


SUBJECTS = frozenset({"claim", "heartbeat", "result"})


def _commitment(data: bytes) -> bytes:
    if len(data) not in (0, ROOT_LEN):
        raise DecodeError(f"verdict: result is empty or a {ROOT_LEN}-byte commitment")
    return data


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
    result: bytes = b""
    """For a result: the :attr:`Result.commitment` it judged (empty otherwise)."""
    signer: bytes = b"\0" * PUBLIC_KEY_LEN
    signature: bytes = b""
    _body: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.subject not in SUBJECTS:
            raise ValueError(f"subject is one of {sorted(SUBJECTS)}")
        if len(self.lease_id) not in (0, LEASE_ID_LEN):
            raise ValueError(f"lease_id is empty or {LEASE_ID_LEN} bytes")
        if len(self.result) not in (0, ROOT_LEN):
            raise ValueError(f"result is empty or a {ROOT_LEN}-byte commitment")
        object.__setattr__(self, "reason", Reason(self.reason))
        object.__setattr__(self, "detail", self.detail[:MAX_DETAIL_LEN])
        _check_key("signer", self.signer)

    def _fields(self) -> dict[str, Any]:
        return {"run": self.run, "subject": self.subject, "lease": self.lease_id,
                "reason": self.reason.value, "accepted": list(self.accepted),
                "expires": self.expires_ms, "detail": self.detail, "time": self.time_ms,
                "result": self.result}

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
                   _commitment(strict.get_bytes(m, "result", max_len=ROOT_LEN)),
                   strict.get_bytes(m, "signer", PUBLIC_KEY_LEN))


Message = Claim | Lease | Heartbeat | Result | Verdict
_TYPES: Mapping[str, Any] = {c.TAG: c for c in (Claim, Lease, Heartbeat, Result, Verdict)}
_BODY_KEYS: Mapping[str, frozenset[str]] = {
    "claim": frozenset({"v", "signer", "run", "tps", "version", "want", "time", "downloading"}),
    "lease": frozenset({"v", "signer", "id", "run", "holder", "tasks", "min_version", "latest",
                        "k", "issued", "expires", "grace"}),
    "heartbeat": frozenset({"v", "signer", "run", "lease", "done", "time"}),
    "result": frozenset({"v", "signer", "run", "lease", "version", "results", "time",
                         "root", "engine"}),
    "verdict": frozenset({"v", "signer", "run", "subject", "lease", "reason", "accepted",
                          "expires", "detail", "time", "result"}),
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
        verify_message(msg.signer, signature, lease_domain(tag), body)
    return msg

