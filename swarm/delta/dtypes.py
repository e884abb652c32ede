"""Bit-level facts about each dtype a state may hold, and raw views of torch tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from swarm.content.layout import DTYPE_SIZES
from swarm.errors import LocalProtocolError


@dataclass(frozen=True, slots=True)
class BitFormat:
    """How the codec reads one dtype's bits.

    ``shift``/``emask`` select the exponent field (the class a change is grouped by; 0/0
    for integers, which form one class). ``signbit`` is set for sign-magnitude floats,
    whose bits are mapped to order-preserving keys.
    """

    bits: int
    shift: int
    emask: int
    is_float: bool

    @property
    def nbytes(self) -> int:
        return self.bits // 8

    @property
    def nclass(self) -> int:
        return self.emask + 1

    @property
    def full(self) -> np.uint64:
        return np.uint64((1 << self.bits) - 1)

    @property
    def half(self) -> np.uint64:
        return np.uint64(1 << (self.bits - 1))

    @property
    def signbit(self) -> np.uint64:
        return np.uint64(1 << (self.bits - 1)) if self.is_float else np.uint64(0)

    @property
    def uint(self) -> np.dtype[Any]:
        """The unsigned integer dtype of the same width."""
        return np.dtype(f"uint{self.bits}")


_FLOATS = {
    "bfloat16": BitFormat(16, 7, 0xFF, True),
    "float16": BitFormat(16, 10, 0x1F, True),
    "float32": BitFormat(32, 23, 0xFF, True),
    "float64": BitFormat(64, 52, 0x7FF, True),
    "float8_e4m3fn": BitFormat(8, 3, 0xF, True),
    "float8_e5m2": BitFormat(8, 2, 0x1F, True),
}

BIT_FORMATS: dict[str, BitFormat] = {
    name: _FLOATS.get(name, BitFormat(8 * size, 0, 0, False))
    for name, size in DTYPE_SIZES.items()
}


def dtype_name(t: torch.Tensor) -> str:
    """The layout dtype name of a tensor (``"bfloat16"``, ``"int64"``...).

    :raises LocalProtocolError: a dtype the codec does not carry (complex, quantized...).
    """
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise LocalProtocolError(f"unsupported tensor dtype {t.dtype}")
    return name


def _host_contiguous(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise LocalProtocolError(f"{what}: tensor is on {t.device}; the codec runs on CPU tensors")
    if not t.is_contiguous():
        raise LocalProtocolError(f"{what}: tensor is not contiguous")
    return t.detach()


def byte_view(t: torch.Tensor, what: str = "tensor") -> np.ndarray:
    """A writable uint8 numpy view of a CPU tensor's raw bytes (no copy)."""
    t = _host_contiguous(t, what)
    arr: np.ndarray = t.reshape(-1).view(torch.uint8).numpy()
    return arr


def bits_view(t: torch.Tensor, what: str = "tensor") -> np.ndarray:
    """A writable unsigned-integer numpy view of a CPU tensor's elements (no copy)."""
    fmt = BIT_FORMATS[dtype_name(t)]
    return byte_view(t, what).view(fmt.uint)
