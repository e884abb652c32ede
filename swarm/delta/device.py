"""The codec's dense passes with torch ops on the device a state lives on (CUDA...).

A trainer's bf16 inference copy usually lives on its GPU. Copying both versions to the
host to diff them would move the whole state over PCIe every step; here the dense part of
extraction (compare every element, class every old value, rank the changes within their
class) runs where the tensors are, and only the changes cross to the host: per change its
class, rank and old and new bits (a few bytes, for about 1% of elements). The host then
codes them with the same C kernel as the CPU path, so chunks are byte-identical to it.
Patching is the mirror image: the host decodes a chunk's streams, the device turns ranks
into element positions (the same stable sort), and only the changed elements' bits
travel each way.

Only integer tensor ops are used (bit views, shifts, a stable sort, gathers), so results
do not depend on the device's float arithmetic; unsigned 16/32/64-bit dtypes, which CUDA
barely supports, are avoided (views are signed and masked).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from swarm.delta.dtypes import BIT_FORMATS, BitFormat, dtype_name
from swarm.errors import DecodeError, LocalProtocolError

_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_VIEW_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# A sort holds about 18 bytes of device memory per element of its segment; device work
# is serialized on the device anyway, so more encoder threads only add memory.
_DEVICE_SLOTS = threading.BoundedSemaphore(2)


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


def _flip(x: np.ndarray, fmt: BitFormat, to_key: bool) -> np.ndarray:
    """Order-preserving keys of unsigned float bits (the C kernels' ``xg_key``), or with
    ``to_key=False`` the bits of keys: a negative float has every bit flipped, any other its
    sign bit (a key's sign bit is set for non-negative floats). Integers are their own keys."""
    if not fmt.is_float:
        return x
    u = fmt.uint.type
    sign, full = u(fmt.signbit), u(fmt.full)
    set_sign = (x & sign) != 0
    out: np.ndarray = x ^ np.where(set_sign, full if to_key else sign,
                                   sign if to_key else full)
    return out


def _class_order(old: torch.Tensor, fmt: BitFormat) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """A stable sort of the elements by class (lists each class's elements in element
    order), and each class's first slot in it (``nclass + 1`` entries)."""
    wide = torch.int64 if fmt.nbytes == 8 else torch.int32
    classes = (old.to(wide) >> fmt.shift) & fmt.emask
    if wide is torch.int64:
        classes = classes.to(torch.int32)
    ordered, order = torch.sort(classes, stable=True)
    bounds = torch.arange(fmt.nclass + 1, device=old.device, dtype=ordered.dtype)
    return ordered, order, torch.searchsorted(ordered, bounds)


def scan_segment(old: torch.Tensor, new: torch.Tensor, fmt: BitFormat
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Changes between two equal-length views of :func:`device_bits`, on their device.

    Returns host arrays (class uint16, rank within the class uint32, key difference
    ``fmt.uint``), in element order within each class; None when nothing changed.
    """
    with _DEVICE_SLOTS:
        return _scan(old, new, fmt)


def _scan(old: torch.Tensor, new: torch.Tensor, fmt: BitFormat
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    changed = old != new
    if fmt.nclass == 1:
        idx = torch.nonzero(changed).squeeze(1)
        if idx.numel() == 0:
            return None
        cls = torch.zeros_like(idx, dtype=torch.int16)
        rank = idx.to(torch.int32)
    else:
        # the slot of an element in the class order minus its class's first slot is its
        # rank within the class
        ordered, order, first = _class_order(old, fmt)
        slots = torch.nonzero(changed[order]).squeeze(1)
        if slots.numel() == 0:
            return None
        idx = order[slots]
        cls_full = ordered[slots]
        rank = (slots - first[cls_full]).to(torch.int32)
        cls = cls_full.to(torch.int16)
    u = fmt.uint
    before = _host(old[idx], u)
    after = _host(new[idx], u)
    diff = (_flip(after, fmt, True) - _flip(before, fmt, True)).astype(u, copy=False)
    return _host(cls, np.dtype(np.uint16)), _host(rank, np.dtype(np.uint32)), diff


def locate_segment(old: torch.Tensor, fmt: BitFormat, class_start: np.ndarray,
                   class_end: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """Element positions of a segment's changes (the C ``locate``): class ``c``'s rank gaps
    are ``gaps[class_start[c]:class_end[c]]``; positions come back in the same slots.

    :raises DecodeError: a class has fewer elements in ``old`` than its changes need.
    """
    k = gaps.shape[0]
    cls = np.zeros(k, np.int64)
    through = np.cumsum(gaps + 1)  # gaps were checked: every rank lies in the segment
    ranks = through - 1
    for c in np.flatnonzero(class_end > class_start):
        s, e = int(class_start[c]), int(class_end[c])
        cls[s:e] = c
        if s:
            ranks[s:e] -= through[s - 1]
    if fmt.nclass == 1:
        if k and int(ranks[-1]) >= old.shape[0]:
            raise DecodeError("chunk: a change's rank is past its class population")
        return ranks.astype(np.uint32)
    with _DEVICE_SLOTS:
        return _place(old, fmt, cls, ranks)


def _place(old: torch.Tensor, fmt: BitFormat, cls: np.ndarray, ranks: np.ndarray
           ) -> np.ndarray:
    _, order, first = _class_order(old, fmt)
    c_d = torch.from_numpy(cls).to(old.device)
    slot = first[c_d] + torch.from_numpy(ranks).to(old.device)
    if bool((slot >= first[c_d + 1]).any()):
        raise DecodeError("chunk: a change's rank is past its class population")
    return _host(order[slot].to(torch.int32), np.dtype(np.uint32))


def apply_segment(view: torch.Tensor, start: int, positions: np.ndarray, diffs: np.ndarray,
                  fmt: BitFormat, negate: bool) -> None:
    """``view[start + p] = unkey(key(view[start + p]) + d)`` in place (minus ``d`` when
    ``negate``), the key arithmetic done exactly on the host."""
    idx = torch.from_numpy(positions.astype(np.int64) + start).to(view.device)
    keys = _flip(_host(view[idx], fmt.uint), fmt, True)
    moved = keys - diffs if negate else keys + diffs
    bits = _flip(moved.astype(fmt.uint, copy=False), fmt, False)
    view[idx] = torch.from_numpy(bits.view(_VIEW_NP[fmt.nbytes])).to(view.device)
