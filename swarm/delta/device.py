"""Change detection with torch ops on the device a state lives on (CUDA, or any other).

A trainer's bf16 inference copy usually lives on its GPU. Copying both versions to the
host to diff them would move the whole state over PCIe every step; here the dense part of
extraction (compare every element, class every old value, rank the changes within their
class) runs where the tensors are, and only the changes cross to the host: per change its
class, rank and old and new bits (a few bytes, for about 1% of elements). The host then
codes them with the same C kernel as the CPU path, so chunks are byte-identical to it.

Only integer tensor ops are used (bit views, shifts, a stable sort, gathers), so results
do not depend on the device's float arithmetic; unsigned 16/32/64-bit dtypes, which CUDA
barely supports, are avoided (views are signed and masked).
"""

from __future__ import annotations

import numpy as np
import torch

from swarm.delta.codec import EncodedSegment, encode_changes
from swarm.delta.dtypes import BIT_FORMATS, BitFormat, dtype_name
from swarm.errors import LocalProtocolError

_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def device_bits(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """A flat integer view of a contiguous tensor's elements on its own device (no copy)."""
    fmt = BIT_FORMATS[dtype_name(t)]
    if not t.is_contiguous():
        raise LocalProtocolError(f"{what}: tensor is not contiguous")
    return t.detach().reshape(-1).view(_VIEW[fmt.nbytes])


def _host(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """The bits of a small device tensor as a host array of an unsigned dtype."""
    arr: np.ndarray = t.cpu().numpy().view(dtype)
    return arr


def _keys(bits: np.ndarray, fmt: BitFormat) -> np.ndarray:
    """Order-preserving keys (the C kernels' ``xg_key``) of unsigned bits."""
    if not fmt.is_float:
        return bits
    u = fmt.uint.type
    out: np.ndarray = bits ^ np.where((bits & u(fmt.signbit)) != 0, u(fmt.full),
                                      u(fmt.signbit))
    return out


def scan_segment(old: torch.Tensor, new: torch.Tensor, fmt: BitFormat
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Changes between two equal-length views of :func:`device_bits`, on their device.

    Returns host arrays (class uint16, rank within the class uint32, key difference
    ``fmt.uint``), in element order within each class; None when nothing changed.
    """
    n = old.shape[0]
    changed = old != new
    if fmt.nclass == 1:
        idx = torch.nonzero(changed).squeeze(1)
        if idx.numel() == 0:
            return None
        cls = torch.zeros_like(idx, dtype=torch.int16)
        rank = idx.to(torch.int32)
    else:
        wide = torch.int64 if fmt.nbytes == 8 else torch.int32
        classes = (old.to(wide) >> fmt.shift) & fmt.emask
        if wide is torch.int64:
            classes = classes.to(torch.int32)
        # a stable sort by class lists each class's elements in element order: the slot of
        # an element minus its class's first slot is its rank within the class
        ordered, order = torch.sort(classes, stable=True)
        slots = torch.nonzero(changed[order]).squeeze(1)
        if slots.numel() == 0:
            return None
        idx = order[slots]
        bounds = torch.arange(fmt.nclass, device=old.device, dtype=ordered.dtype)
        first = torch.searchsorted(ordered, bounds)
        cls_full = ordered[slots]
        rank = (slots - first[cls_full]).to(torch.int32)
        cls = cls_full.to(torch.int16)
    if n > np.iinfo(np.uint32).max:
        raise LocalProtocolError("a segment holds at most 2**32 - 1 elements")
    u = fmt.uint
    before = _host(old[idx], u)
    after = _host(new[idx], u)
    diff = (_keys(after, fmt) - _keys(before, fmt)).astype(u, copy=False)
    return _host(cls, np.dtype(np.uint16)), _host(rank, np.dtype(np.uint32)), diff


def encode_segment_on_device(old: torch.Tensor, new: torch.Tensor, fmt: BitFormat,
                             tensor: int, start: int) -> EncodedSegment | None:
    """:func:`swarm.delta.codec.encode_segment` for device views: the same bytes."""
    found = scan_segment(old, new, fmt)
    if found is None:
        return None
    cls, rank, diff = found
    return encode_changes(cls, rank, diff, int(cls.shape[0]), fmt, tensor, start,
                          int(old.shape[0]))
