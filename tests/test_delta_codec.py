"""Property tests: decode(encode(delta)) applied to old gives new bit-exactly; revert gives
old back; every dtype, special values, empty and fully dense deltas."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_delta_helpers import TORCH_DTYPES, clone_state, same_bits, tensor_from_bytes

from swarm.content.layout import DTYPE_SIZES
from swarm.delta import (
    EncoderConfig,
    Patcher,
    apply_chunk,
    delta_chunks,
    encode_delta_sync,
    revert_chunk,
    state_root_of,
)
from swarm.identity import Identity

pytestmark = pytest.mark.timeout(240)

IDENTITY = Identity.from_seed(bytes(range(32)))
SMALL = EncoderConfig(segment_elems=97, chunk_target=300, bucket_bytes=1000, threads=2)
FLOATS = {"float16": (0x8000, 0x7C00), "bfloat16": (0x8000, 0x7F80),
          "float32": (0x80000000, 0x7F800000), "float64": (1 << 63, 0x7FF << 52),
          "float8_e4m3fn": (0x80, 0x78), "float8_e5m2": (0x80, 0x7C)}


def _specials(dtype: str, rng: np.random.Generator, old: np.ndarray, new: np.ndarray) -> None:
    """Plant -0.0/+0.0 flips and NaN payload changes (floats), and extreme jumps."""
    n = old.shape[0]
    if n < 4:
        return
    if dtype in FLOATS:
        sign, exp = FLOATS[dtype]
        i, j = rng.integers(0, n, 2)
        old[i], new[i] = 0, sign  # +0.0 -> -0.0
        old[j], new[j] = sign, 0  # -0.0 -> +0.0
        k = int(rng.integers(0, n))
        old[k] = exp | 1  # a NaN (or e4m3's max-ish pattern) with payload 1
        new[k] = exp | 3 if dtype != "float8_e4m3fn" else 0x7F  # another payload
    full = (1 << (8 * DTYPE_SIZES[dtype])) - 1
    m = int(rng.integers(0, n))
    old[m], new[m] = 0, full  # the largest possible key difference
    new[0] ^= 1  # first element
    new[n - 1] ^= 1 << (8 * DTYPE_SIZES[dtype] - 1)  # last element, top bit


def make_pair(dtype: str, n: int, mode: str, seed: int
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    size = DTYPE_SIZES[dtype]
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    if dtype == "bool":
        old = rng.integers(0, 2, n, dtype=np.uint8)
        flip = rng.random(n) < {"empty": 0.0, "dense": 1.0}.get(mode, 0.05)
        new = np.where(flip, 1 - old, old).astype(np.uint8)
    else:
        old = rng.integers(0, 256, n * size, dtype=np.uint8).view(uint).copy()
        new = old.copy()
        if mode == "dense":
            new = rng.integers(0, 256, n * size, dtype=np.uint8).view(uint).copy()
            new[new == old] ^= 1
        elif mode == "sparse":
            mask = rng.random(n) < 0.03
            new[mask] = rng.integers(0, 256, int(mask.sum()) * size, dtype=np.uint8).view(uint)
        elif mode == "ulp":
            mask = rng.random(n) < 0.1
            new[mask] = old[mask] + rng.choice(np.array([1, np.iinfo(uint).max], uint),
                                               int(mask.sum()))
        elif mode == "specials":
            _specials(dtype, rng, old, new)
    shape = (n,) if n % 3 else (3, n // 3)
    other = torch.arange(5, dtype=torch.int64)
    o = {"x": tensor_from_bytes(old.view(np.uint8), dtype, shape), "i": other}
    w = {"x": tensor_from_bytes(new.view(np.uint8), dtype, shape), "i": other.clone()}
    return o, w


def roundtrip(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
              config: EncoderConfig, seed: int) -> None:
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 1, config=config)
    assert signed.manifest.target_root == state_root_of(new)
    state = clone_state(old)
    patcher = Patcher(state, signed)
    order = list(chunks)
    random.Random(seed).shuffle(order)
    for c in order:
        patcher.apply(c.cid, c.data)
    changed = patcher.finish()
    assert same_bits(state, new)
    assert changed == {k for k in old if not torch.equal(
        old[k].reshape(-1).view(torch.uint8), new[k].reshape(-1).view(torch.uint8))}
    state2 = clone_state(old)
    records = [apply_chunk(state2, c.data) for c in order]
    assert same_bits(state2, new)
    for rec in reversed(records):
        revert_chunk(state2, rec)
    assert same_bits(state2, old)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(TORCH_DTYPES)),
       n=st.integers(1, 400),
       mode=st.sampled_from(["empty", "dense", "sparse", "ulp", "specials"]),
       seed=st.integers(0, 2**32 - 1))
def test_roundtrip_every_dtype(dtype: str, n: int, mode: str, seed: int) -> None:
    old, new = make_pair(dtype, n, mode, seed)
    roundtrip(old, new, SMALL, seed)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("mode", ["empty", "dense", "specials"])
def test_roundtrip_each_dtype_and_edge(dtype: str, mode: str) -> None:
    old, new = make_pair(dtype, 301, mode, 7)
    roundtrip(old, new, SMALL, 7)


def test_empty_delta_has_no_chunks() -> None:
    old, new = make_pair("bfloat16", 1000, "empty", 1)
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 3)
    assert chunks == []
    assert signed.manifest.chunks == ()
    assert signed.manifest.base_root == signed.manifest.target_root
    state = clone_state(old)
    assert Patcher(state, signed).finish() == frozenset()


def test_chunks_are_independent_and_sized() -> None:
    """Chunks split a big delta into independently applicable pieces near the target."""
    g = torch.Generator().manual_seed(5)
    old = {f"t{i}": (torch.randn(50_000, generator=g) * 0.02).bfloat16() for i in range(6)}
    new = clone_state(old)
    for t in new.values():
        bits = t.view(torch.int16)
        idx = torch.randint(0, t.numel(), (5000,), generator=g)
        bits[idx] += 1
    cfg = EncoderConfig(segment_elems=20_000, chunk_target=4000, bucket_bytes=60_000)
    chunks = list(delta_chunks(old, new, cfg))
    assert len(chunks) > 3
    assert all(len(c.data) < 3 * 4000 for c in chunks)
    # each chunk alone moves the state toward new, only in the tensors it names
    for c in chunks:
        s = clone_state(old)
        rec = apply_chunk(s, c.data)
        touched = {k for k in s if not torch.equal(s[k], old[k])}
        assert touched <= set(c.names) == rec.tensor_names
        assert rec.changes == c.changes


@pytest.mark.parametrize("density", [0.0005, 0.012, 0.2])
def test_weight_like_delta_is_small_and_exact(density: float) -> None:
    from test_delta_helpers import gaussian_bf16_pair

    old, new = gaussian_bf16_pair(1 << 18, density, seed=3)
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 1)
    changes = sum(c.changes for c in chunks)
    dense_bytes = 2 * (1 << 18)
    total = signed.manifest.total_bytes
    # a +-1 ULP change costs its position's entropy plus a sign bit, plus a few bytes
    p = density
    entropy_bits = (-(p * np.log2(p) + (1 - p) * np.log2(1 - p))) * (1 << 18) + changes
    assert total * 8 < 1.15 * entropy_bits + 8 * 400
    assert total < dense_bytes
    roundtrip(old, new, EncoderConfig(), 0)


def test_far_apart_changes_use_escaped_gaps_and_stay_exact() -> None:
    """A class with many adjacent changes and one far away: the far gap overflows the Rice
    quotient and travels as an escaped raw gap; decoding restores it exactly."""
    n = 3_000_000
    old = {"w": torch.ones(n, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    far = [2_999_999, 1_500_000]
    new["w"][:200] = 1.0078125  # one ULP up, gaps of 0
    new["w"][far] = 0.99609375  # one ULP down, far from the rest
    roundtrip(old, new, EncoderConfig(threads=1), 3)
    state = clone_state(old)
    for c in delta_chunks(old, new):
        apply_chunk(state, c.data)
    assert same_bits(state, new)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dense_segment_past_the_first_change_buffer_is_exact(dtype: str) -> None:
    """More changes than the encoder's first guess (1/16 of a segment), and a segment
    length that is not a whole number of 64-bit words: the scan restarts larger and the
    word-wise and element-wise parts agree."""
    old, new = make_pair(dtype, 40_003, "dense", 11)
    roundtrip(old, new, EncoderConfig(threads=2), 11)
