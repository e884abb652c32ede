"""vLLM worker extension: writes checkpoint-named tensors into the running model in place.

vLLM loads ``LLM(..., worker_extension_cls="swarm.engines.vllm_worker.SwarmWorkerExtension")``
into every worker, and ``llm.collective_rpc("swarm_...")`` calls the methods below there.

Views, checked writes and digests are :mod:`swarm.engines.vllm_views`, the apply path this
extension shares with the ``swarm`` weight-transfer backend (:mod:`swarm.integrations.vllm`).

Importing this module makes vLLM's CPU linear layers keep plain weights and call
``F.linear`` (see ``use_plain_cpu_linear``). It must be imported before a model loads; vLLM
imports the extension class in each worker before loading, and ``swarm.engines.vllm_engine``
imports it before it starts vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch

from swarm.engines import EngineUpdateError
from swarm.engines.tensors import check_sparse, dtype_name, from_bytes
from swarm.engines.vllm_views import (
    FUSED_MODULES,
    checkpoint_views,
    view_digests,
    write_tensors,
)

__all__ = ["FUSED_MODULES", "SwarmWorkerExtension", "checkpoint_views", "use_plain_cpu_linear"]

log = logging.getLogger(__name__)

# One update item: (name, dtype name, shape, tensor or its raw bytes).
UpdateItem = tuple[str, str, tuple[int, ...], "torch.Tensor | bytes"]
# One sparse item: (name, flat int64 indices, values), each a tensor or its raw bytes.
SparseItem = tuple[str, "torch.Tensor | bytes", "torch.Tensor | bytes"]


def _vector(payload: torch.Tensor | bytes, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor from a tensor payload, or rebuilt from raw bytes."""
    if isinstance(payload, torch.Tensor):
        return payload
    data = bytes(payload)
    return from_bytes(dtype_name(dtype), (len(data) // dtype.itemsize,), data)


def _plain_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement for vLLM's CPU GEMM dispatch: keep ``layer.weight``, use ``F.linear``."""
    del remove_weight
    cast(Any, layer).cpu_linear = torch.nn.functional.linear


def use_plain_cpu_linear() -> None:
    """Keep plain linear weights on vLLM's CPU backend. Idempotent.

    By default vLLM's CPU backend repacks each linear weight for oneDNN (or sgl/zentorch)
    and replaces ``layer.weight`` with an empty tensor, so in-place writes fail or do
    nothing. This swaps ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``
    (which vLLM imports at call time, when layers process their loaded weights) for one
    that keeps the weight and computes with ``torch.nn.functional.linear``. GPU platforms
    never call it.
    """
    from vllm.model_executor.layers import utils

    if utils.dispatch_cpu_unquantized_gemm is not _plain_dispatch:
        utils.dispatch_cpu_unquantized_gemm = _plain_dispatch
        log.debug("vLLM CPU linear layers keep plain weights (F.linear)")


use_plain_cpu_linear()


class SwarmWorkerExtension:
    """Mixed into vLLM's worker class; methods are called through ``collective_rpc``."""

    model_runner: Any

    def _swarm_views(self) -> dict[str, torch.Tensor]:
        cached: dict[str, torch.Tensor] | None = getattr(self, "_swarm_view_cache", None)
        if cached is None:
            cached = checkpoint_views(self.model_runner.model)
            self._swarm_view_cache = cached
        return cached

    def swarm_layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(checkpoint name, dtype name, shape) of every tensor the worker holds."""
        return [
            (name, dtype_name(view.dtype), tuple(view.shape))
            for name, view in self._swarm_views().items()
        ]

    def swarm_apply(self, items: Sequence[UpdateItem]) -> int:
        """Copy each item into its view; every item is checked first. Returns the count.

        :raises EngineUpdateError: unknown name, wrong shape or dtype, or bad bytes.
        """
        values: list[tuple[str, torch.Tensor]] = []
        for name, dtype, shape, payload in items:
            if isinstance(payload, torch.Tensor):
                values.append((name, payload))
            else:
                values.append((name, from_bytes(dtype, shape, bytes(payload))))
        return write_tensors(self._swarm_views(), values)

    def swarm_apply_sparse(self, items: Sequence[SparseItem]) -> int:
        """Write values at flat positions of each named tensor; every item is checked first.

        :raises EngineUpdateError: unknown name, bad indices or values, or bad bytes.
        """
        views = self._swarm_views()
        staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for name, index_payload, value_payload in items:
            view = views.get(name)
            if view is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            indices = _vector(index_payload, torch.int64)
            values = _vector(value_payload, view.dtype)
            check_sparse(name, view.numel(), view.dtype, indices, values)
            staged.append((view.view(-1), indices, values))
        with torch.no_grad():
            for flat, indices, values in staged:
                flat.index_copy_(0, indices.to(flat.device), values.to(flat.device))
        return len(staged)

    def swarm_tensor_digests(self, names: Sequence[str] | None) -> dict[str, bytes]:
        """``swarm.engines.tensor_digest`` of the named tensors (all when None).

        :raises EngineUpdateError: an unknown name.
        """
        return view_digests(self._swarm_views(), names)
