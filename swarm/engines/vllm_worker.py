"""vLLM worker extension: writes checkpoint-named tensors into the running model in place.

vLLM loads ``LLM(..., worker_extension_cls="swarm.engines.vllm_worker.SwarmWorkerExtension")``
into every worker, and ``llm.collective_rpc("swarm_...")`` calls the methods below there.

vLLM fuses a checkpoint's ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` parameter
and ``gate_proj``/``up_proj`` into ``gate_up_proj``; each checkpoint tensor is mapped to a
row range (a view) of the fused parameter, from the layer's ``output_sizes``. Writes copy
into those views, so nothing is reallocated and the running engine sees the new values.

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
from swarm.engines.tensors import (
    check_sparse,
    check_update,
    digest_of,
    dtype_name,
    from_bytes,
)

log = logging.getLogger(__name__)

# Fused vLLM module -> the checkpoint modules stacked in it, in row order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

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


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the view of the running model's storage that holds it.

    :raises EngineUpdateError: an empty (repacked) weight, or tensor parallelism (each
        worker would hold only a slice; not supported).
    """
    views: dict[str, torch.Tensor] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = pname.rpartition(".")
        module = model.get_submodule(module_name)
        if int(getattr(module, "tp_size", 1)) != 1:
            raise EngineUpdateError("tensor-parallel vLLM workers are not supported")
        data = param.data
        if data.numel() == 0:
            raise EngineUpdateError(
                f"{pname} is empty: vLLM repacked it (plain CPU linear weights were not kept)"
            )
        prefix, _, short = module_name.rpartition(".")
        stacked = FUSED_MODULES.get(short)
        sizes = getattr(module, "output_sizes", None)
        if stacked is not None and sizes is not None and len(sizes) == len(stacked):
            offset = 0
            for shard, size in zip(stacked, sizes, strict=True):
                name = f"{prefix}.{shard}.{leaf}" if prefix else f"{shard}.{leaf}"
                views[name] = data.narrow(0, offset, int(size))
                offset += int(size)
            if offset != data.shape[0]:
                raise EngineUpdateError(f"{pname}: shards cover {offset} of {data.shape[0]} rows")
            continue
        org_rows = getattr(module, "org_vocab_size", None)
        if org_rows is not None and data.ndim >= 1 and int(org_rows) < data.shape[0]:
            data = data.narrow(0, 0, int(org_rows))
        views[pname] = data
    return views


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
        views = self._swarm_views()
        tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, dtype, shape, payload in items:
            view = views.get(name)
            if view is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            if isinstance(payload, torch.Tensor):
                value = payload
            else:
                value = from_bytes(dtype, shape, bytes(payload))
            check_update(name, view.shape, view.dtype, value)
            tensors.append((view, value))
        with torch.no_grad():
            for view, value in tensors:
                view.copy_(value)
        return len(tensors)

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
        views = self._swarm_views()
        wanted = list(views) if names is None else list(names)
        out: dict[str, bytes] = {}
        for name in wanted:
            view = views.get(name)
            if view is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            out[name] = digest_of(view)
        return out
