"""A rollout engine around another one: every call goes to ``inner`` unless overridden.

The engines that watch or change another engine's behaviour (``--check-engine``'s
:class:`~swarm.engines.checked.CheckedEngine`, ``--chaos-cheat``'s
:class:`~swarm.engines.cheater.CheatingEngine`) subclass it and override what they do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from swarm.engines import Completion, RolloutEngine, Sampling


class EngineWrapper:
    """Delegates the :class:`~swarm.engines.RolloutEngine` calls to ``inner``."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.kind = inner.kind

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return self.inner.generate(prompts, sampling)

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        self.inner.apply(update)

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner.apply_sparse(update)

    def tensor_names(self) -> list[str]:
        return self.inner.tensor_names()

    def tensor_digests(self, names: Iterable[str] | None = None) -> dict[str, bytes]:
        return self.inner.tensor_digests(names)

    def close(self) -> None:
        self.inner.close()
