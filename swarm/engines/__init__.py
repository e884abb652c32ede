"""Rollout engines: what a peer generates with, and how verified weights reach it.

An engine takes prompts as token ids and returns completions with the log-probability of
every generated token (the trainer needs them for GRPO). ``apply`` writes the tensors that
changed in a new version into the running engine in place, named as in the trainer's
state_dict (Hugging Face names such as ``model.layers.0.self_attn.q_proj.weight``), and
``tensor_digests`` reports a digest of every tensor the engine holds, in that same naming,
so a peer can check the engine matches the state it verified.

This module is light: it imports neither torch nor vLLM. The engines live in
``swarm.engines.torch_engine`` and ``swarm.engines.vllm_engine``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import blake3

from swarm.content.ids import domain_hash
from swarm.errors import LocalProtocolError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Completion",
    "EngineUpdateError",
    "RolloutEngine",
    "Sampling",
    "request_seed",
    "tensor_digest",
    "weights_digest",
]

# Inputs at least this large are hashed with blake3's worker threads (it releases the GIL).
_THREADED_MIN = 1 << 22
_TENSOR_DOMAIN = b"swarm/engine/tensor/v1\0"


class EngineUpdateError(LocalProtocolError):
    """An update names a tensor the engine lacks, or has the wrong shape or dtype."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to sample completions. The same settings and seed give the same tokens."""

    max_tokens: int = 64
    """Most tokens generated per prompt (the stop token counts)."""
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
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError("max_tokens must be a positive int")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError("top_k must be an int >= 0")
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ValueError("seed must be None or an int >= 0")
        if any(type(t) is not int or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be ints >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_seed(sampling: Sampling, index: int) -> int | None:
    """The seed of prompt ``index`` of a batch (engines share this rule)."""
    if sampling.seed is None:
        return None
    return (sampling.seed + index) % (1 << 63)


@dataclass(frozen=True, slots=True)
class Completion:
    """The tokens generated for one prompt and the log-probability of each."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each generated token under the model's raw distribution (before
    temperature, top-p and top-k), as the trainer's policy computes it."""
    finish_reason: Literal["stop", "length"]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("one log-prob per generated token")


@runtime_checkable
class RolloutEngine(Protocol):
    """A model that generates rollouts and takes verified weight updates in place."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """One completion per prompt, in order. Prompts are token ids."""
        ...

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        """Write the changed tensors (state_dict names, the engine's dtype and shapes).

        Every name is checked before anything is written.

        :raises EngineUpdateError: unknown name, or wrong shape or dtype.
        """
        ...

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write new values at flat positions: name -> (indices, values), in place.

        Indices are 1-D int64, strictly increasing, into the tensor's C-order flattening;
        values are 1-D in the engine's dtype, one per index. Every entry is checked before
        anything is written.

        :raises EngineUpdateError: unknown name, bad indices, or wrong value count or dtype.
        """
        ...

    def tensor_names(self) -> list[str]:
        """Names of the tensors the engine holds, in state_dict naming."""
        ...

    def tensor_digests(self, names: Iterable[str] | None = None) -> dict[str, bytes]:
        """``tensor_digest`` of each named tensor (all of them when names is None).

        :raises EngineUpdateError: an unknown name.
        """
        ...

    def close(self) -> None:
        """Release the model. Idempotent."""
        ...


def tensor_digest(dtype: str, shape: Sequence[int], data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3 digest of one tensor: its dtype name, shape and raw little-endian bytes.

    A peer computes it from the verified state's raw bytes (dtype names as in
    ``swarm.content.layout.DTYPE_SIZES``) and compares it with an engine's report.
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if len(data) >= _THREADED_MIN else 1)
    h.update(_TENSOR_DOMAIN)
    header = dtype.encode() + b"\0" + ",".join(str(int(d)) for d in shape).encode() + b"\0"
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    return bytes(h.digest())


def weights_digest(digests: Mapping[str, bytes]) -> bytes:
    """One digest over named tensor digests (order-independent: names are sorted)."""
    parts: list[bytes] = []
    for name in sorted(digests):
        parts.append(name.encode())
        parts.append(digests[name])
    return domain_hash("swarm/engine/weights/v1", *parts)
