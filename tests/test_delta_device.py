"""The torch-ops engine (extraction and patching on the tensors' own device) agrees with
the C engine: the same chunk bytes, the same positions, the same patched and reverted bits.

Without a GPU the torch engine runs on CPU tensors (``engine="torch"``): the same integer
ops a CUDA state runs, checked byte for byte against the C kernels. Where CUDA is present,
the tests marked with ``DEVICES`` also run on states moved to the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_delta_codec import SMALL, make_pair
from test_delta_helpers import TORCH_DTYPES, clone_state, gaussian_bf16_pair, same_bits

from swarm.delta import (
    EncoderConfig,
    Patcher,
    decode_chunk,
    delta_chunks,
    encode_delta_sync,
    layout_of,
    state_root_of,
)
from swarm.delta.codec import state_views
from swarm.delta.device import device_bits, scan_segment
from swarm.delta.dtypes import BIT_FORMATS
from swarm.errors import DecodeError, LocalProtocolError, SwarmError
from swarm.identity import Identity

pytestmark = pytest.mark.timeout(240)

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
TORCH = EncoderConfig(segment_elems=97, chunk_target=300, bucket_bytes=1000, threads=2,
                      engine="torch")
IDENTITY = Identity.from_seed(b"\x0d" * 32)


def _same_chunks(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                 c_cfg: EncoderConfig, t_cfg: EncoderConfig) -> int:
    c = [(x.cid, x.data) for x in delta_chunks(old, new, c_cfg)]
    t = [(x.cid, x.data) for x in delta_chunks(old, new, t_cfg)]
    assert t == c
    return len(c)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(TORCH_DTYPES)),
       n=st.integers(1, 400),
       mode=st.sampled_from(["empty", "dense", "sparse", "ulp", "specials"]),
       seed=st.integers(0, 2**32 - 1))
def test_torch_engine_chunks_are_the_c_engines_bytes(dtype: str, n: int, mode: str,
                                                     seed: int) -> None:
    old, new = make_pair(dtype, n, mode, seed)
    _same_chunks(old, new, SMALL, TORCH)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_every_dtype_with_specials_matches(dtype: str) -> None:
    old, new = make_pair(dtype, 301, "specials", 3)
    assert _same_chunks(old, new, SMALL, TORCH) > 0


def _on(state: dict[str, torch.Tensor], dev: str) -> dict[str, torch.Tensor]:
    return {k: v.to(dev) for k, v in state.items()}


@pytest.mark.parametrize("dev", DEVICES)
def test_weight_like_state_matches_and_patches_to_the_target_root(dev: str) -> None:
    old, new = gaussian_bf16_pair(1 << 16, 0.012, seed=4)
    big_c = EncoderConfig(segment_elems=1 << 14, chunk_target=300, threads=2)
    big_t = EncoderConfig(segment_elems=1 << 14, chunk_target=300, threads=2,
                          engine="torch")
    c = [x.data for x in delta_chunks(old, new, big_c)]
    assert [x.data for x in delta_chunks(_on(old, dev), _on(new, dev), big_t)] == c
    assert len(c) > 1
    signed, chunks = encode_delta_sync(_on(old, dev), _on(new, dev), IDENTITY, "run", 2,
                                       config=big_t)
    assert signed.manifest.target_root == state_root_of(new)
    state = _on(old, dev)
    patcher = Patcher(state, signed, engine="torch")
    for ch in reversed(chunks):
        patcher.apply(ch.cid, ch.data)
    patcher.finish()
    assert same_bits(_on(state, "cpu"), new)


def test_scan_segment_ranks_within_classes() -> None:
    fmt = BIT_FORMATS["bfloat16"]
    old = torch.tensor([0x3F80, 0x4000, 0x3F81, 0x4001, 0x3F82], dtype=torch.int16)
    new = old.clone()
    new[2] += 1  # second element of class 0x7F
    new[3] -= 1  # second element of class 0x80
    found = scan_segment(old, new, fmt)
    assert found is not None
    cls, rank, diff = found
    assert cls.tolist() == [0x7F, 0x80] and rank.tolist() == [1, 1]
    assert diff.tolist() == [1, 0xFFFF]
    assert scan_segment(old, old.clone(), fmt) is None


def test_device_bits_refuses_a_strided_tensor() -> None:
    t = torch.zeros(4, 4, dtype=torch.bfloat16).t()
    with pytest.raises(LocalProtocolError, match="not contiguous"):
        device_bits(t, "w")


def test_c_engine_refuses_a_non_cpu_state_and_states_must_share_a_device() -> None:
    old, new = gaussian_bf16_pair(256, 0.1, seed=1)
    meta_old = {k: v.to("meta") for k, v in old.items()}
    with pytest.raises(LocalProtocolError, match="C engine reads CPU tensors"):
        list(delta_chunks(meta_old, {k: v.to("meta") for k, v in new.items()},
                          EncoderConfig(engine="c")))
    with pytest.raises(LocalProtocolError, match="span devices"):
        list(delta_chunks(meta_old, new))


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine must be one of"):
        EncoderConfig(engine="gpu")


def test_root_of_a_state_is_hashed_per_tensor_off_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A state whose tensors are not on the CPU is hashed one host copy at a time."""
    old, _ = gaussian_bf16_pair(1 << 17, 0.0, seed=2)
    want = state_root_of(old, piece_size=1 << 16)
    copies: list[int] = []

    class Remote(torch.Tensor):
        """A CPU tensor that reports another device (stands in for a GPU tensor)."""

        @property  # type: ignore[misc]
        def device(self) -> torch.device:
            return torch.device("meta")

        def cpu(self, *args: object, **kwargs: object) -> torch.Tensor:
            copies.append(int(self.numel()))
            return torch.Tensor.clone(self.as_subclass(torch.Tensor))

    remote = {k: v.as_subclass(Remote) for k, v in old.items()}
    assert state_root_of(remote, piece_size=1 << 16) == want
    assert sorted(copies) == sorted(int(v.numel()) for v in old.values())
    assert np.all(np.asarray(copies) > 0)


def _patch_with_torch(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                      config: EncoderConfig) -> None:
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 3, config=config)
    state = clone_state(old)
    patcher = Patcher(state, signed, engine="torch")
    for c in reversed(chunks):
        patcher.apply(c.cid, c.data)
    patcher.revert()
    assert same_bits(state, old)
    for c in chunks:
        patcher.apply(c.cid, c.data)
    patcher.finish()
    assert same_bits(state, new)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(TORCH_DTYPES)),
       n=st.integers(1, 400),
       mode=st.sampled_from(["empty", "dense", "sparse", "ulp", "specials"]),
       seed=st.integers(0, 2**32 - 1))
def test_torch_engine_patches_and_reverts_every_dtype_exactly(dtype: str, n: int, mode: str,
                                                               seed: int) -> None:
    old, new = make_pair(dtype, n, mode, seed)
    _patch_with_torch(old, new, SMALL)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_torch_engine_places_changes_where_the_c_engine_does(dtype: str) -> None:
    old, new = make_pair(dtype, 301, "specials", 5)
    chunks = list(delta_chunks(old, new, SMALL))
    layout = layout_of(old)
    for c in chunks:
        by_c = decode_chunk(c.data, layout, state_views(old, layout, "c"))
        by_torch = decode_chunk(c.data, layout, state_views(old, layout, "torch"))
        for a, b in zip(by_c.segments, by_torch.segments, strict=True):
            assert (a.tensor, a.start) == (b.tensor, b.start)
            assert np.array_equal(a.positions, b.positions)
            assert np.array_equal(a.diffs, b.diffs)


def test_torch_engine_refuses_a_chunk_that_does_not_fit_before_writing() -> None:
    """Ranks past a class's population in this state: DecodeError, nothing written."""
    old, new = gaussian_bf16_pair(1 << 14, 0.05, seed=6)
    other = {k: torch.zeros_like(v) for k, v in old.items()}  # one class only
    layout = layout_of(old)
    chunk = next(iter(delta_chunks(old, new, EncoderConfig(segment_elems=4096))))
    views = state_views(other, layout, "torch")
    with pytest.raises(DecodeError, match="past its class population"):
        decode_chunk(chunk.data, layout, views)
    assert all(not v.any() for v in other.values())


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, 10**9), xor=st.integers(1, 255), cut=st.integers(0, 10**9))
def test_fuzzed_chunks_never_crash_or_write_on_the_torch_engine(pos: int, xor: int,
                                                                cut: int) -> None:
    old, new = gaussian_bf16_pair(4096, 0.05, seed=2)
    data = next(iter(delta_chunks(old, new, EncoderConfig(segment_elems=1024)))).data
    mutated = bytearray(data)
    mutated[pos % len(data)] ^= xor
    layout = layout_of(old)
    for cand in (bytes(mutated), bytes(mutated[: cut % len(data)])):
        state = clone_state(old)
        try:
            decode_chunk(cand, layout, state_views(state, layout, "torch"))
        except SwarmError as exc:
            assert isinstance(exc, DecodeError)
        assert same_bits(state, old)


def test_c_engine_refuses_to_patch_a_non_cpu_state_and_engines_are_checked() -> None:
    old, _ = gaussian_bf16_pair(256, 0.1, seed=1)
    layout = layout_of(old)
    with pytest.raises(LocalProtocolError, match="C engine patches CPU tensors"):
        state_views({k: v.to("meta") for k, v in old.items()}, layout, "c")
    with pytest.raises(ValueError, match="engine must be one of"):
        state_views(old, layout, "gpu")
