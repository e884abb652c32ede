"""Torch helpers shared by the engines: dtype names, raw bytes, digests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.content.layout import DTYPE_SIZES
from swarm.engines import EngineUpdateError, tensor_digest

# Every dtype a state layout may hold; layout names are torch's own dtype names.
_BY_NAME: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise EngineUpdateError(f"unsupported dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise EngineUpdateError(f"unsupported dtype {name!r}") from None


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's raw bytes in C order, on the CPU (a copy only when needed)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def digest_of(t: torch.Tensor) -> bytes:
    """``swarm.engines.tensor_digest`` of a torch tensor."""
    return tensor_digest(dtype_name(t.dtype), tuple(t.shape), raw_bytes(t))


def from_bytes(dtype: str, shape: Sequence[int], data: bytes) -> torch.Tensor:
    """A CPU tensor rebuilt from ``raw_bytes`` output (it owns a copy of the data).

    :raises EngineUpdateError: the byte count does not match dtype and shape.
    """
    dt = torch_dtype(dtype)
    numel = 1
    for d in shape:
        numel *= d
    if numel * dt.itemsize != len(data):
        raise EngineUpdateError(
            f"{len(data)} bytes do not hold a {dtype} tensor of shape {tuple(shape)}"
        )
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dt)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.view(dt).reshape(tuple(shape))


def check_update(name: str, target_shape: Sequence[int], target_dtype: torch.dtype,
                 value: torch.Tensor) -> None:
    """:raises EngineUpdateError: ``value`` cannot be written over the named tensor."""
    if tuple(value.shape) != tuple(target_shape):
        raise EngineUpdateError(
            f"{name}: update has shape {tuple(value.shape)}, engine holds {tuple(target_shape)}"
        )
    if value.dtype != target_dtype:
        raise EngineUpdateError(
            f"{name}: update has dtype {value.dtype}, engine holds {target_dtype}"
        )


def check_sparse(name: str, numel: int, target_dtype: torch.dtype,
                 indices: torch.Tensor, values: torch.Tensor) -> None:
    """:raises EngineUpdateError: the (flat indices, values) pair cannot be written.

    Indices are int64, one-dimensional, strictly increasing and below ``numel``; values
    are one per index, in the target's dtype.
    """
    if indices.dtype != torch.int64 or indices.ndim != 1:
        raise EngineUpdateError(f"{name}: indices must be a 1-D int64 tensor")
    if values.ndim != 1 or values.shape[0] != indices.shape[0]:
        raise EngineUpdateError(f"{name}: need one value per index")
    if values.dtype != target_dtype:
        raise EngineUpdateError(
            f"{name}: values have dtype {values.dtype}, engine holds {target_dtype}"
        )
    if indices.numel() == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise EngineUpdateError(f"{name}: index outside a tensor of {numel} values")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise EngineUpdateError(f"{name}: indices must be strictly increasing")
