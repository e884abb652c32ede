"""Rollout engines: what a peer generates with, and how verified weights reach it.

An engine takes prompts as token ids and returns completions with the log-probability of
every generated token (the trainer needs them for GRPO). ``apply`` writes the tensors that
changed in a new version into the running engine in place, named as in the trainer's
state_dict (Hugging Face names such as ``model.layers.0.self_attn.q_proj.weight``), and
``tensor_digests`` reports a digest of every tensor the engine holds, in that same naming,
so a peer can check the engine matches the state it verified.

:class:`Sampling` and :class:`Completion` are the lease protocol's own types
(:mod:`swarm.protocol.leases`): the settings a lease carries go to the engine as
they are, and what the engine returns goes into the signed result as it is.

This module is light: it imports neither torch nor vLLM. The engines live in
``swarm.engines.torch_engine`` and ``swarm.engines.vllm_engine``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import blake3

from swarm.content.ids import domain_hash
from swarm.errors import LocalProtocolError
from swarm.protocol.leases import Completion, Sampling

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHEAT_STRATEGIES",
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


#: How :class:`swarm.engines.cheater.CheatingEngine` can cheat (``swarm peer --chaos-cheat``).
CHEAT_STRATEGIES = ("random", "fake-logprobs", "stale", "other-model", "copy", "cherry-pick")


class EngineUpdateError(LocalProtocolError):
    """An update names a tensor the engine lacks, or has the wrong shape or dtype."""


def request_seed(sampling: Sampling, index: int) -> int | None:
    """The seed of prompt ``index`` of a batch (engines share this rule)."""
    if sampling.seed is None:
        return None
    return (sampling.seed + index) % (1 << 63)


@runtime_checkable
class RolloutEngine(Protocol):
    """A model that generates rollouts and takes verified weight updates in place."""

    kind: str
    """The engine's class (``"torch"``, ``"vllm"``): results name it, since engines of one
    class agree on log-probs closer than others (the trainer's tolerance) and reproduce
    one another's seeded samples (its replays)."""

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
