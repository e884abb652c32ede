"""The one apply path into a running vLLM model: checkpoint-named views, checked writes, digests.

Both the in-tree engine (:mod:`swarm.engines.vllm_worker`, a worker extension) and the
``swarm`` weight-transfer backend (:mod:`swarm.integrations.vllm`) write through these
functions. This module imports neither vLLM nor anything with a side effect on it: it only
reads the model's parameters (torch modules).

vLLM fuses a checkpoint's ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` parameter
and ``gate_proj``/``up_proj`` into ``gate_up_proj``; each checkpoint tensor is mapped to a
row range (a view) of the fused parameter, from the layer's ``output_sizes``. Writes copy
into those views, so nothing is reallocated and the running engine sees the new values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from swarm.engines import EngineUpdateError
from swarm.engines.tensors import check_update, digest_of

# Fused vLLM module -> the checkpoint modules stacked in it, in row order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


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


def write_tensors(views: Mapping[str, torch.Tensor],
                  items: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (name, value) into its view; every item is checked before any write.
    Returns the count.

    :raises EngineUpdateError: unknown name, wrong shape or dtype (nothing is written).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, value in items:
        view = views.get(name)
        if view is None:
            raise EngineUpdateError(f"engine holds no tensor named {name!r}")
        check_update(name, view.shape, view.dtype, value)
        pairs.append((view, value))
    with torch.no_grad():
        for view, value in pairs:
            view.copy_(value)
    return len(pairs)


def view_digests(views: Mapping[str, torch.Tensor],
                 names: Sequence[str] | None = None) -> dict[str, bytes]:
    """``swarm.engines.tensor_digest`` of the named views (all when None).

    :raises EngineUpdateError: an unknown name.
    """
    wanted = list(views) if names is None else list(names)
    out: dict[str, bytes] = {}
    for name in wanted:
        view = views.get(name)
        if view is None:
            raise EngineUpdateError(f"engine holds no tensor named {name!r}")
        out[name] = digest_of(view)
    return out
