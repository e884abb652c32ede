"""Shared helpers of the delta tests: seeded random states of every dtype."""

from __future__ import annotations

import numpy as np
import torch

from swarm.content.layout import DTYPE_SIZES

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


def tensor_from_bytes(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` whose raw bytes are ``raw`` (uint8), copied."""
    t = torch.from_numpy(raw.copy())
    return t.view(TORCH_DTYPES[dtype]).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(raw_bytes(a[k]) == raw_bytes(b[k]) for k in a)


def clone_state(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in s.items()}


def gaussian_bf16_pair(n: int, density: float, seed: int
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A weight-like bf16 state and a copy where ``density`` of elements moved by +-1 ULP."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    bits = w.view(torch.int16).clone()
    mask = torch.rand(n, generator=g) < density
    step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1).to(torch.int16)
    bits[mask] += step[mask]
    old = {"w": w.reshape(-1, 64) if n % 64 == 0 else w, "b": torch.zeros(3)}
    new = {"w": bits.view(torch.bfloat16).reshape(old["w"].shape), "b": torch.zeros(3)}
    return old, new


def test_layout_names_every_dtype_as_the_content_layer_does() -> None:
    from swarm.content.layout import DTYPE_SIZES
    from swarm.delta import layout_of

    state = {name: torch.zeros(2, 3, dtype=dt) for name, dt in TORCH_DTYPES.items()}
    layout = layout_of(state)
    assert [t.dtype for t in layout] == list(TORCH_DTYPES)
    assert all(t.nbytes == 6 * DTYPE_SIZES[t.dtype] for t in layout)
