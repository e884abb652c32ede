"""The codec's C kernels (swarm.delta._xg): results against a numpy reference, the SIMD
and scalar paths of 2-byte elements agree, and the wrappers refuse bad buffers cleanly."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.delta import _xg
from swarm.delta.dtypes import BIT_FORMATS, BitFormat

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
BF16 = BIT_FORMATS["bfloat16"]
FP16 = BIT_FORMATS["float16"]
# lengths around the SIMD kernels' 32- and 64-element vectors and 256-element superblocks,
# and tails
LENGTHS = [1, 3, 31, 32, 33, 63, 64, 65, 255, 256, 257, 513, 1000, 4097, 70001]


@pytest.fixture(autouse=True)
def _simd_back_on() -> Iterator[None]:
    yield
    _xg.set_simd("avx512")


def _weights(fmt: BitFormat, n: int, seed: int) -> np.ndarray:
    """Trained-weight-like bits (std 0.02: classes bunched) of a 2-byte float format."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if fmt is BF16 else torch.float16
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    return t.view(torch.uint16).numpy().copy()


def _changed(old: np.ndarray, density: float, seed: int) -> np.ndarray:
    """``old`` with a ``density`` fraction of elements moved (mostly by 1 ULP, some far)."""
    rng = np.random.default_rng(seed)
    new = old.copy()
    mask = rng.random(old.shape[0]) < density
    step = rng.choice(np.array([1, 1, 1, 2, -1, 300], np.int64), int(np.count_nonzero(mask)))
    new[mask] = (new[mask].astype(np.int64) + step).astype(new.dtype)
    far = rng.random(old.shape[0]) < density / 20
    new[far] = rng.integers(0, 1 << 16, int(np.count_nonzero(far))).astype(new.dtype)
    return new


def _key(b: np.ndarray, fmt: BitFormat) -> np.ndarray:
    x = b.astype(np.uint64)
    sb, full = np.uint64(int(fmt.signbit)), np.uint64(int(fmt.full))
    if int(sb) == 0:
        return x
    return np.where((x & sb) != 0, full ^ x, x | sb)


def _reference_scan(old: np.ndarray, new: np.ndarray, fmt: BitFormat
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class, rank within the class, key difference) of each change, in element order."""
    cls = (old.astype(np.int64) >> fmt.shift) & fmt.emask
    order = np.argsort(cls, kind="stable")
    sorted_cls = cls[order]
    starts = np.searchsorted(sorted_cls, sorted_cls, side="left")
    rank = np.empty_like(cls)
    rank[order] = np.arange(cls.shape[0]) - starts
    idx = np.flatnonzero(old != new)
    d = (_key(new[idx], fmt) - _key(old[idx], fmt)) & np.uint64(int(fmt.full))
    return cls[idx], rank[idx], d


def _scan(old: np.ndarray, new: np.ndarray, fmt: BitFormat, cap: int | None = None
          ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    cap = old.shape[0] if cap is None else cap
    cls = np.empty(cap, np.uint16)
    rank = np.empty(cap, np.uint32)
    d = np.empty(cap, fmt.uint)
    k = _xg.scan(old, new, fmt.shift, fmt.emask, int(fmt.signbit), int(fmt.full), cls, rank,
                 d)
    n = max(k, 0)
    return k, cls[:n].copy(), rank[:n].copy(), d[:n].copy()


def _locate(old: np.ndarray, fmt: BitFormat, cls: np.ndarray, rank: np.ndarray
            ) -> tuple[int, np.ndarray]:
    """Element positions of changes given by (class, rank), grouped by class."""
    nclass = fmt.nclass
    counts = np.bincount(cls.astype(np.int64), minlength=nclass)
    ends = np.cumsum(counts)
    starts = ends - counts
    order = np.argsort(cls, kind="stable")
    gaps = np.empty(cls.shape[0], np.int64)
    for e in np.flatnonzero(counts):
        r = rank[order[starts[e]:ends[e]]].astype(np.int64)
        gaps[starts[e]:ends[e]] = np.diff(r, prepend=-1) - 1
    pos = np.empty(cls.shape[0], np.uint32)
    err = _xg.locate(old, fmt.shift, fmt.emask, starts.astype(np.int64),
                     ends.astype(np.int64), gaps, pos)
    return err, pos


def _every_path(fn: Callable[[], T]) -> list[T]:
    """fn() on every kernel path this CPU runs, fastest first (the last is scalar); the
    AVX2 path twice, with and without pdep (Zen 1/2 avoid it)."""
    results = []
    for path in _xg.simd_paths():
        _xg.set_simd(path)
        assert _xg.simd() == path
        for slow_pdep in (False, True) if path == "avx2" else (False,):
            was = _xg.set_slow_pdep(slow_pdep)
            try:
                results.append(fn())
            finally:
                _xg.set_slow_pdep(was)
    _xg.set_simd("avx512")
    return results


def _assert_same(results: list[tuple[Any, ...]]) -> None:
    """Every path gave the scalar path's result."""
    for a in results[:-1]:
        for x, y in zip(a, results[-1], strict=True):
            if isinstance(x, np.ndarray):
                assert isinstance(y, np.ndarray)
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y


def test_simd_paths_are_known_and_capped_by_set_simd() -> None:
    paths = _xg.simd_paths()
    assert paths[-1] == "scalar" and set(paths) <= {"avx512", "avx2", "scalar"}
    assert _xg.simd() == paths[0]
    _xg.set_simd("scalar")
    assert _xg.simd() == "scalar"
    _xg.set_simd("avx2")
    assert _xg.simd() == ("avx2" if "avx2" in paths else "scalar")
    with pytest.raises(ValueError, match="path must be"):
        _xg.set_simd("sse2")
    with pytest.raises(ValueError, match="path must be"):
        _xg.set_simd(True)


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("density", [0.0, 0.012, 0.3, 1.0])
def test_scan_and_locate_match_reference_on_every_path(fmt: BitFormat, n: int,
                                                       density: float) -> None:
    old = _weights(fmt, n, seed=n)
    new = _changed(old, density, seed=n + 1)
    if density == 1.0:
        new = old ^ np.uint16(1)  # every element changes
    ref_cls, ref_rank, ref_d = _reference_scan(old, new, fmt)
    every = _every_path(lambda: _scan(old, new, fmt))
    _assert_same(every)
    fast = every[0]
    k, cls, rank, d = fast
    assert k == ref_cls.shape[0]
    np.testing.assert_array_equal(cls, ref_cls)
    np.testing.assert_array_equal(rank, ref_rank)
    np.testing.assert_array_equal(d.astype(np.uint64), ref_d)
    if k == 0:
        return
    located = _every_path(lambda: _locate(old, fmt, cls, rank))
    _assert_same(located)
    err, pos = located[0]
    assert err == 0
    order = np.argsort(cls, kind="stable")
    np.testing.assert_array_equal(np.sort(pos), np.flatnonzero(old != new))
    np.testing.assert_array_equal(pos, np.flatnonzero(old != new)[order])


@pytest.mark.parametrize("n", [5, 40, 300, 5000])
@pytest.mark.parametrize("off", range(33))
def test_every_start_within_a_cache_line_matches_reference(n: int, off: int) -> None:
    """Tensors start anywhere: the SIMD kernels count up to the first 64-byte boundary one
    by one, then go on aligned."""
    big_old = _weights(BF16, n + 64, seed=n)
    old, new = big_old[off:off + n], _changed(big_old, 0.05, seed=n + 7)[off:off + n]
    ref_cls, ref_rank, _ = _reference_scan(old, new, BF16)
    every = _every_path(lambda: _scan(old, new, BF16))
    _assert_same(every)
    k, cls, rank, d = every[0]
    np.testing.assert_array_equal(cls, ref_cls)
    np.testing.assert_array_equal(rank, ref_rank)
    if k == 0:
        return
    located = _every_path(lambda: _locate(old, BF16, cls, rank))
    _assert_same(located)
    np.testing.assert_array_equal(np.sort(located[0][1]), np.flatnonzero(old != new))
    slots = _slots(BF16, cls, rank, d)

    def apply() -> np.ndarray:
        arr = big_old.copy()[off:off + n]
        assert _locate_apply(arr, BF16, slots)[0] == 0
        return arr

    for arr in _every_path(apply):
        np.testing.assert_array_equal(arr, new)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), fp16=st.booleans(), n=st.integers(1, 3000))
def test_random_bits_agree_on_every_path(data: st.DataObject, fp16: bool, n: int) -> None:
    """Arbitrary bit patterns (classes spread over the whole range, NaNs, -0.0)."""
    fmt = FP16 if fp16 else BF16
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n).astype(np.uint16)
    density = data.draw(st.sampled_from([0.0, 0.01, 0.5, 1.0]))
    new = old.copy()
    mask = rng.random(n) < density
    new[mask] = rng.integers(0, 1 << 16, int(np.count_nonzero(mask))).astype(np.uint16)
    every = _every_path(lambda: _scan(old, new, fmt))
    _assert_same(every)
    fast = every[0]
    ref_cls, ref_rank, _ = _reference_scan(old, new, fmt)
    np.testing.assert_array_equal(fast[1], ref_cls)
    np.testing.assert_array_equal(fast[2], ref_rank)
    if fast[0] > 0:
        located = _every_path(lambda: _locate(old, fmt, fast[1], fast[2]))
        _assert_same(located)
        assert located[0][0] == 0


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
def test_scan_reports_overflow_on_every_path(fmt: BitFormat) -> None:
    old = _weights(fmt, 5000, seed=3)
    new = _changed(old, 0.3, seed=4)
    assert set(_every_path(lambda: _scan(old, new, fmt, cap=100)[0])) == {-1}


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
def test_locate_past_the_population_is_code_1_on_every_path(fmt: BitFormat) -> None:
    old = _weights(fmt, 700, seed=5)
    e = int((int(old[0]) >> fmt.shift) & fmt.emask)
    population = int(np.count_nonzero(((old.astype(np.int64) >> fmt.shift) & fmt.emask) == e))
    starts = np.zeros(fmt.nclass, np.int64)
    ends = np.zeros(fmt.nclass, np.int64)
    ends[e:] = 1
    starts[e + 1:] = 1
    gaps = np.array([population], np.int64)  # rank == population: one past the last
    codes = _every_path(lambda: _xg.locate(old, fmt.shift, fmt.emask, starts, ends, gaps,
                                           np.empty(1, np.uint32)))
    assert set(codes) == {1}


@pytest.mark.parametrize("big", [2**62, 2**40, 2**31, 5000])
def test_locate_gaps_past_the_segment_are_code_1_on_every_path(big: int) -> None:
    """A hostile gap (even one whose running sum would wrap) is an error, never a write out
    of place: the SIMD path keeps ranks in 32-bit lanes."""
    old = _weights(BF16, 5000, seed=6)
    e = int((int(old[10]) >> BF16.shift) & BF16.emask)
    starts = np.zeros(BF16.nclass, np.int64)
    ends = np.zeros(BF16.nclass, np.int64)
    ends[e:] = 3
    starts[e + 1:] = 3
    gaps = np.array([0, big, big], np.int64)
    codes = _every_path(lambda: _xg.locate(old, BF16.shift, BF16.emask, starts, ends, gaps,
                                           np.empty(3, np.uint32)))
    assert set(codes) == {1}


@pytest.mark.parametrize("name", ["uint8", "int16", "float32", "float64", "float8_e4m3fn"])
def test_other_widths_match_reference(name: str) -> None:
    fmt = BIT_FORMATS[name]
    rng = np.random.default_rng(11)
    old = rng.integers(0, 1 << 62, 3001, dtype=np.uint64).astype(fmt.uint)
    new = old.copy()
    new[::7] = rng.integers(0, 1 << 62, new[::7].shape[0], dtype=np.uint64).astype(fmt.uint)
    k, cls, rank, d = _scan(old, new, fmt)
    ref_cls, ref_rank, ref_d = _reference_scan(old, new, fmt)
    assert k == ref_cls.shape[0]
    np.testing.assert_array_equal(cls, ref_cls)
    np.testing.assert_array_equal(rank, ref_rank)
    np.testing.assert_array_equal(d.astype(np.uint64), ref_d)
    err, pos = _locate(old, fmt, cls, rank)
    assert err == 0
    np.testing.assert_array_equal(np.sort(pos), np.flatnonzero(old != new))
    arr = old.copy()
    _xg.apply_diffs(arr, np.flatnonzero(old != new).astype(np.uint32), d, int(fmt.signbit),
                    int(fmt.full), False)
    np.testing.assert_array_equal(arr, new)
    _xg.apply_diffs(arr, np.flatnonzero(old != new).astype(np.uint32), d, int(fmt.signbit),
                    int(fmt.full), True)
    np.testing.assert_array_equal(arr, old)


# -- the wrappers refuse bad buffers -------------------------------------------------------


def _scan_args(n: int = 16, cap: int = 16) -> list[Any]:
    old = np.zeros(n, np.uint16)
    return [old, old.copy(), BF16.shift, BF16.emask, int(BF16.signbit), int(BF16.full),
            np.empty(cap, np.uint16), np.empty(cap, np.uint32), np.empty(cap, np.uint16)]


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(("index", "value", "message"), [
    (0, [0, 1, 2], "old must be a buffer"),
    (0, np.zeros(16, np.float16), "old must be a 1-D array of uint"),
    (0, np.zeros(16, np.int16), "old must be a 1-D array of uint"),
    (0, np.zeros((4, 4), np.uint16), "1-D"),
    (0, np.zeros(32, np.uint16)[::2], "C-contiguous"),
    (1, np.zeros(16, np.uint32), "new must be a 1-D array of uint16"),
    (6, np.empty(16, np.uint32), "cls_out must be a 1-D array of uint16"),
    (6, _readonly(np.empty(16, np.uint16)), "writable"),
    (7, _readonly(np.empty(16, np.uint32)), "writable"),
    (8, _readonly(np.empty(16, np.uint16)), "writable"),
    (8, b"\0" * 32, "writable"),
])
def test_scan_refuses_wrong_buffers(index: int, value: object, message: str) -> None:
    args = _scan_args()
    args[index] = value
    with pytest.raises(TypeError, match=message):
        _xg.scan(*args)


@pytest.mark.parametrize(("index", "value", "message"), [
    (1, np.zeros(15, np.uint16), "old has 16 elements but new has 15"),
    (7, np.empty(15, np.uint32), "rank_out has 15 elements"),
    (8, np.empty(3, np.uint16), "d_out has 3 elements"),
    (2, 16, "shift 16 outside"),
    (3, 2048, "emask 2048 outside"),
    (4, 0x4000, "signbit must be 0 or 2\\*\\*15"),
    (5, 0xFFFFFF, "full must be 2\\*\\*16 - 1"),
    (5, -1, "integer in \\[0, 2\\*\\*64\\)"),
])
def test_scan_refuses_wrong_sizes_and_fields(index: int, value: object, message: str) -> None:
    args = _scan_args()
    args[index] = value
    with pytest.raises(ValueError, match=message):
        _xg.scan(*args)


def _encode_args(k: int = 3) -> list[Any]:
    return [np.array([1, 1, 2], np.uint16), np.array([0, 5, 0], np.uint32),
            np.array([1, 2, 3], np.uint16), k, 256, np.zeros(256, np.int64),
            np.zeros(256, np.int64), np.empty(7 * k, np.uint8), np.zeros(1, np.uint8),
            np.empty(3 * k, np.uint8)]


def test_group_encode_writes_within_its_buffers() -> None:
    g, m = _xg.group_encode(*_encode_args())
    assert 0 < g <= 21 and m == 3


@pytest.mark.parametrize(("index", "value", "message"), [
    (0, np.array([1, 300, 2], np.uint16), "class outside"),
    (1, np.array([5, 0, 0], np.uint32), "rank not increasing"),
    (3, 4, "cls has 3 elements, needs at least 4"),
    (4, 0, "nclass 0 outside"),
    (5, np.zeros(10, np.int64), "ccount has 10 elements"),
    (7, np.empty(20, np.uint8), "gaps_out has 20 elements, needs at least 21"),
    (9, np.empty(8, np.uint8), "mags_out has 8 elements"),
])
def test_group_encode_refuses_bad_input(index: int, value: object, message: str) -> None:
    args = _encode_args()
    args[index] = value
    with pytest.raises(ValueError, match=message):
        _xg.group_encode(*args)


def test_group_encode_refuses_read_only_output() -> None:
    args = _encode_args()
    args[8] = bytes(1)
    with pytest.raises(TypeError, match="signs_out must be a C-contiguous, writable buffer"):
        _xg.group_encode(*args)


def test_decode_gaps_refuses_bad_tables_and_codes_bad_streams() -> None:
    one = np.array([1], np.int64)
    out = np.empty(1, np.int64)
    with pytest.raises(ValueError, match="kparams must lie in"):
        _xg.decode_gaps(one, np.array([25], np.int64), b"\x00", out, 10)
    with pytest.raises(ValueError, match="sum to at most"):
        _xg.decode_gaps(np.array([2], np.int64), one * 0, b"\x00", out, 10)
    with pytest.raises(ValueError, match="differ in length"):
        _xg.decode_gaps(one, np.zeros(2, np.int64), b"\x00", out, 10)
    with pytest.raises(TypeError, match="gaps_out must be a 1-D array of int64"):
        _xg.decode_gaps(one, one * 0, b"\x00", np.empty(1, np.uint64), 10)
    k0 = np.zeros(1, np.int64)
    assert _xg.decode_gaps(one, k0, b"\x00", out, 10) == 0 and out[0] == 0  # code "0"
    assert _xg.decode_gaps(one, k0, b"", out, 10) == 1  # truncated
    assert _xg.decode_gaps(one, k0, b"\x00\x00", out, 10) == 2  # trailing byte
    assert _xg.decode_gaps(one, k0, b"\x02", out, 10) == 2  # trailing bits
    assert _xg.decode_gaps(one, k0, b"\x01", out, 1) == 4  # gap 1 in a 1-element segment
    escape = ((1 << 24) - 1) | (3 << 24)  # an escaped gap that fits the short code
    assert _xg.decode_gaps(one, k0, escape.to_bytes(7, "little"), out, 1 << 20) == 3


def test_decode_values_refuses_short_buffers_and_codes_bad_streams() -> None:
    d = np.empty(2, np.uint16)
    with pytest.raises(ValueError, match="d_out has 2 elements"):
        _xg.decode_values(b"\x00", b"\x00\x00\x00", 3, d)
    with pytest.raises(ValueError, match="signs has 0 elements"):
        _xg.decode_values(b"", b"\x00", 1, d)
    with pytest.raises(TypeError, match="d_out must be a C-contiguous, writable buffer"):
        _xg.decode_values(b"\x00", b"\x00", 1, _readonly(d))
    assert _xg.decode_values(b"\x02", b"\x00\x04", 2, d) == 0
    assert d.tolist() == [1, 0xFFFB]
    assert _xg.decode_values(b"\x00", b"\x00", 2, d) == 1  # truncated
    assert _xg.decode_values(b"\x00", b"\x00\x00", 1, d) == 2  # trailing byte
    assert _xg.decode_values(b"\x00", b"\xff\x01\x00", 1, d) == 3  # non-canonical escape
    assert _xg.decode_values(b"\x02", b"\x00", 1, d) == 3  # sign bit past the last change


def test_locate_refuses_class_ranges_outside_its_buffers() -> None:
    old = np.zeros(8, np.uint16)
    starts = np.zeros(256, np.int64)
    ends = np.zeros(256, np.int64)
    ends[0] = 2
    with pytest.raises(ValueError, match="class 0"):
        _xg.locate(old, 7, 255, starts, ends, np.zeros(1, np.int64), np.empty(2, np.uint32))
    with pytest.raises(ValueError, match="class 0"):
        _xg.locate(old, 7, 255, starts, ends, np.zeros(2, np.int64), np.empty(1, np.uint32))
    with pytest.raises(ValueError, match="emask \\+ 1 = 256"):
        _xg.locate(old, 7, 255, starts[:10], ends, np.zeros(2, np.int64),
                   np.empty(2, np.uint32))
    with pytest.raises(TypeError, match="pos_out must be a C-contiguous, writable"):
        _xg.locate(old, 7, 255, starts, ends, np.zeros(2, np.int64),
                   _readonly(np.empty(2, np.uint32)))


def test_apply_diffs_refuses_out_of_range_positions_before_writing() -> None:
    arr = np.arange(10, dtype=np.uint16)
    before = arr.copy()
    with pytest.raises(ValueError, match="position 10 is outside arr"):
        _xg.apply_diffs(arr, np.array([0, 10], np.uint32), np.ones(2, np.uint16), 0x8000,
                        0xFFFF, False)
    np.testing.assert_array_equal(arr, before)
    with pytest.raises(ValueError, match="pos has 1 entries but d has 2"):
        _xg.apply_diffs(arr, np.array([0], np.uint32), np.ones(2, np.uint16), 0x8000, 0xFFFF,
                        False)
    with pytest.raises(TypeError, match="arr must be a C-contiguous, writable"):
        _xg.apply_diffs(_readonly(arr), np.array([0], np.uint32), np.ones(1, np.uint16),
                        0x8000, 0xFFFF, False)
    with pytest.raises(TypeError, match="d must be a 1-D array of uint16"):
        _xg.apply_diffs(arr, np.array([0], np.uint32), np.ones(1, np.uint32), 0x8000, 0xFFFF,
                        False)


def test_import_swarm_loads_neither_the_extension_nor_torch() -> None:
    code = ("import sys, swarm; bad = [m for m in ('swarm.delta._xg', 'torch', 'numpy') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@settings(max_examples=200, deadline=None)
@given(stream=st.binary(max_size=64), counts=st.lists(st.integers(0, 12), min_size=1,
                                                      max_size=4),
       kparam=st.integers(0, 24), limit=st.integers(1, 1 << 33))
def test_decode_gaps_answers_any_stream_with_a_code(stream: bytes, counts: list[int],
                                                    kparam: int, limit: int) -> None:
    cc = np.array(counts, np.int64)
    out = np.full(int(cc.sum()), -1, np.int64)
    err = _xg.decode_gaps(cc, np.full(len(counts), kparam, np.int64), stream, out, limit)
    assert err in (0, 1, 2, 3, 4)
    if err == 0:  # every class's ranks lie within the segment
        assert np.all(out >= 0)
        start = 0
        for c in counts:
            assert c == 0 or int(out[start:start + c].sum()) + c - 1 < limit
            start += c


@settings(max_examples=200, deadline=None)
@given(signs=st.binary(max_size=8), mags=st.binary(max_size=40), k=st.integers(0, 64),
       width=st.sampled_from([1, 2, 4, 8]))
def test_decode_values_answers_any_stream_with_a_code(signs: bytes, mags: bytes, k: int,
                                                      width: int) -> None:
    k = min(k, 8 * len(signs))
    d = np.zeros(k, np.dtype(f"uint{8 * width}"))
    err = _xg.decode_values(signs, mags, k, d)
    assert err in (0, 1, 2, 3)
    if err == 0:  # a canonical stream: nonzero differences below half the range each way
        assert np.all(d != 0)


def _table(ids: list[int], counts: list[int], kparams: list[int]) -> bytes:
    return (np.array(ids, "<u2").tobytes() + np.array(counts, "<u4").tobytes()
            + np.array(kparams, np.uint8).tobytes())


def _parse_table(table: bytes, changes: int, nclass: int = 256
                 ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    nc = len(table) // 7
    cc, kp = np.full(nc, -1, np.int64), np.full(nc, -1, np.int64)
    cs, ce = np.full(nclass, -1, np.int64), np.full(nclass, -1, np.int64)
    return _xg.class_table(table, changes, cc, kp, cs, ce), cc, kp, cs, ce


def test_class_table_gives_each_class_its_slots() -> None:
    err, cc, kp, cs, ce = _parse_table(_table([3, 7, 200], [2, 5, 1], [0, 3, 24]), 8)
    assert err == 0
    assert cc.tolist() == [2, 5, 1] and kp.tolist() == [0, 3, 24]
    assert (cs[3], ce[3], cs[7], ce[7], cs[200], ce[200]) == (0, 2, 2, 7, 7, 8)
    absent = np.ones(256, bool)
    absent[[3, 7, 200]] = False
    assert np.all(cs[absent] == 0) and np.all(ce[absent] == 0)


@pytest.mark.parametrize(("table", "changes"), [
    (_table([7, 3], [1, 1], [0, 0]), 2),  # ids not ascending
    (_table([3, 3], [1, 1], [0, 0]), 2),  # repeated id
    (_table([256], [1], [0]), 1),  # id past the classes
    (_table([3], [0], [0]), 0),  # a class without changes
    (_table([3], [1], [25]), 1),  # Rice parameter too large
    (_table([3, 4], [1, 1], [0, 0]), 3),  # counts do not sum to the changes
    (_table([3], [0xFFFFFFFF], [0]), 1),
])
def test_class_table_flags_malformed_tables(table: bytes, changes: int) -> None:
    assert _parse_table(table, changes)[0] == 1


def test_class_table_refuses_wrong_buffers() -> None:
    table = _table([3], [1], [0])
    cs, ce = np.empty(256, np.int64), np.empty(256, np.int64)
    one = np.empty(1, np.int64)
    with pytest.raises(ValueError, match="not a multiple of 7"):
        _xg.class_table(table[:-1], 1, one, one, cs, ce)
    with pytest.raises(ValueError, match="ccounts has 0 elements"):
        _xg.class_table(table, 1, one[:0], one, cs, ce)
    with pytest.raises(ValueError, match="same number of classes"):
        _xg.class_table(table, 1, one, one.copy(), cs, ce[:10])
    with pytest.raises(TypeError, match="class_start must be a C-contiguous, writable"):
        _xg.class_table(table, 1, one, one.copy(), _readonly(cs), ce)


@pytest.mark.parametrize(("shift", "emask"), [(12, 0xFF), (15, 0x7FF), (0, 0x7FF), (9, 0x3F),
                                            (13, 0x7), (4, 0xF)])
def test_any_class_field_of_2_byte_elements_matches_reference(shift: int, emask: int) -> None:
    """Fields that do not fit the element (shift + mask width > 16 bits) only see its bits."""
    fmt = BitFormat(16, shift, emask, True)
    old = _weights(BF16, 5003, seed=shift)
    new = _changed(old, 0.05, seed=emask)
    ref_cls, ref_rank, ref_d = _reference_scan(old, new, fmt)
    every = _every_path(lambda: _scan(old, new, fmt))
    _assert_same(every)
    fast = every[0]
    np.testing.assert_array_equal(fast[1], ref_cls)
    np.testing.assert_array_equal(fast[2], ref_rank)
    np.testing.assert_array_equal(fast[3].astype(np.uint64), ref_d)
    located = _every_path(lambda: _locate(old, fmt, fast[1], fast[2]))
    _assert_same(located)
    assert located[0][0] == 0
    np.testing.assert_array_equal(np.sort(located[0][1]), np.flatnonzero(old != new))


def test_read_pair_reads_both_buffers_whole_words() -> None:
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1 << 16, 1003).astype(np.uint16)
    b = rng.integers(0, 1 << 16, 1003).astype(np.uint16)
    words = 2006 // 8
    fold = _xg.read_pair(a, b)
    assert isinstance(fold, int) and 0 <= fold < 1 << 64
    b2 = b.copy()
    b2[4 * words:] ^= 1  # the bytes past the last whole word are not read
    assert _xg.read_pair(a, b2) == fold
    with pytest.raises(ValueError, match="a has 2006 bytes but b has 2004"):
        _xg.read_pair(a, b[:-1])


# -- group_encode against a slow reference -------------------------------------------------


def _reference_group_encode(cls: np.ndarray, rank: np.ndarray, d: np.ndarray, nclass: int
                            ) -> tuple[list[int], list[int], bytes, bytes, bytes]:
    """(ccount, kparam, gap bytes, sign bytes, magnitude bytes) as codec.py describes them:
    per class the cheapest of five Rice parameters around log2 of the mean gap."""
    qmax, width = _xg.RICE_QMAX, d.dtype.itemsize
    ccount, kparam = [0] * nclass, [0] * nclass
    bits: list[int] = []
    signs, mags = [], bytearray()
    for e in range(nclass):
        idx = np.flatnonzero(cls == e)
        if idx.size == 0:
            continue
        ccount[e] = c = int(idx.size)
        gaps = [int(g) for g in np.diff(rank[idx].astype(np.int64), prepend=-1) - 1]
        k0 = 0
        while k0 < _xg.RICE_KMAX and (c << (k0 + 1)) <= sum(gaps):
            k0 += 1
        cands = range(max(k0 - 2, 0), min(k0 + 2, _xg.RICE_KMAX) + 1)
        costs = [sum((g >> kk) + 1 + kk if g >> kk < qmax else qmax + 32 for g in gaps)
                 for kk in cands]
        kparam[e] = kk = cands[costs.index(min(costs))]
        for g in gaps:
            if g >> kk < qmax:
                bits += [1] * (g >> kk) + [0] + [(g >> b) & 1 for b in range(kk)]
            else:
                bits += [1] * qmax + [(g >> b) & 1 for b in range(32)]
        for x in d[idx].tolist():
            neg = x >> (8 * width - 1)
            mm = ((-x if neg else x) - 1) % (1 << (8 * width))
            signs.append(neg)
            mags += bytes([mm]) if mm < 255 else b"\xff" + mm.to_bytes(width, "little")
    bits += [0] * (-len(bits) % 8)
    signs += [0] * (-len(signs) % 8)
    pack = lambda b: bytes(np.packbits(np.array(b, np.uint8), bitorder="little"))  # noqa
    return ccount, kparam, pack(bits), pack(signs), bytes(mags)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), k=st.integers(0, 400), nclass=st.integers(1, 40),
       width=st.sampled_from([1, 2, 4, 8]), scale=st.integers(0, 31))
def test_group_encode_matches_reference(data: st.DataObject, k: int, nclass: int, width: int,
                                        scale: int) -> None:
    """Random classes, heavy-tailed rank gaps (escapes at some parameters, not at others)
    and any differences, 0 and half the range included."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    cls = rng.integers(0, nclass, k).astype(np.uint16)
    rank = np.empty(k, np.uint32)
    for e in range(nclass):
        idx = np.flatnonzero(cls == e)
        tail = np.minimum(rng.pareto(1.2, idx.size), 1 << 12)
        step = (tail * (1 << scale % 20)).astype(np.int64) + 1
        if data.draw(st.booleans()):
            step[rng.random(idx.size) < 0.05] = (1 << 32) // max(idx.size, 1)
        rank[idx] = np.minimum(np.cumsum(step) - 1, (1 << 32) - idx.size + np.arange(idx.size))
    dtype = np.dtype(f"uint{8 * width}")
    d = rng.integers(0, 1 << min(8 * width, 63), k, dtype=np.uint64).astype(dtype)
    small = rng.random(k) < 0.7  # mostly a few ULPs either way
    d[small] = rng.integers(-300, 300, int(small.sum())).astype(dtype)  # wraps
    specials = [0, 1, 255, 256, 1 << (8 * width - 1), (1 << 8 * width) - 1]
    special = rng.random(k) < 0.05
    d[special] = np.array(specials, np.uint64)[rng.integers(0, 6, int(special.sum()))]
    gaps = np.empty(7 * k + 1, np.uint8)
    signs = np.empty((k + 7) // 8, np.uint8)
    mags = np.empty(k * (1 + width), np.uint8)
    cc, kp = np.full(nclass, -1, np.int64), np.full(nclass, -1, np.int64)
    g, m = _xg.group_encode(cls, rank, d, k, nclass, cc, kp, gaps, signs, mags)
    ref = _reference_group_encode(cls, rank, d, nclass)
    assert cc.tolist() == ref[0] and kp.tolist() == ref[1]
    assert gaps[:g].tobytes() == ref[2]
    assert signs.tobytes() == ref[3]
    assert mags[:m].tobytes() == ref[4]


def test_group_encode_leaves_its_outputs_alone_on_bad_input() -> None:
    args = _encode_args()
    args[1] = np.array([0, 5, 0], np.uint32)
    args[0] = np.array([1, 1, 1], np.uint16)  # rank 0 after rank 5 in class 1
    for i in (5, 6, 7, 8, 9):
        args[i] = np.full(args[i].shape[0], 7, args[i].dtype)
    with pytest.raises(ValueError, match="change 2: class outside"):
        _xg.group_encode(*args)
    for i in (5, 6, 7, 8, 9):
        assert np.all(args[i] == 7)


def _slots(fmt: BitFormat, cls: np.ndarray, rank: np.ndarray, d: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(class_start, class_end, rank gaps, key differences) in the decoder's slot order."""
    counts = np.bincount(cls.astype(np.int64), minlength=fmt.nclass)
    ends = np.cumsum(counts).astype(np.int64)
    starts = (ends - counts).astype(np.int64)
    order = np.argsort(cls, kind="stable")
    gaps = np.empty(cls.shape[0], np.int64)
    for e in np.flatnonzero(counts):
        r = rank[order[starts[e]:ends[e]]].astype(np.int64)
        gaps[starts[e]:ends[e]] = np.diff(r, prepend=-1) - 1
    return starts, ends, gaps, d[order].astype(fmt.uint)


def _locate_apply(arr: np.ndarray, fmt: BitFormat, slots: tuple[np.ndarray, ...]
                  ) -> tuple[int, np.ndarray]:
    starts, ends, gaps, d = slots
    pos = np.empty(gaps.shape[0], np.uint32)
    err = _xg.locate_apply(arr, fmt.shift, fmt.emask, int(fmt.signbit), int(fmt.full), starts,
                           ends, gaps, d, pos)
    return err, pos


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("density", [0.012, 0.3])
def test_locate_apply_writes_new_exactly_on_every_path(fmt: BitFormat, n: int,
                                                       density: float) -> None:
    old = _weights(fmt, n, seed=n)
    new = _changed(old, density, seed=n + 1)
    _, cls, rank, d = _scan(old, new, fmt)
    slots = _slots(fmt, cls, rank, d)
    err, want = _locate(old, fmt, cls, rank)
    assert err == 0

    def run() -> tuple[int, np.ndarray, np.ndarray]:
        arr = old.copy()
        e, pos = _locate_apply(arr, fmt, slots)
        return e, pos, arr

    for e, pos, arr in _every_path(run):
        assert e == 0
        np.testing.assert_array_equal(pos, want)
        np.testing.assert_array_equal(arr, new)


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=["bf16", "fp16"])
def test_locate_apply_past_the_population_leaves_arr_as_it_was(fmt: BitFormat) -> None:
    old = _weights(fmt, 70001, seed=3)
    new = _changed(old, 0.05, seed=4)
    _, cls, rank, d = _scan(old, new, fmt)
    starts, ends, gaps, dd = _slots(fmt, cls, rank, d)
    last = int(np.flatnonzero(ends > starts)[-1])
    gaps[ends[last] - 1] += 70001  # the class's last change lies past its elements

    def run() -> tuple[int, np.ndarray]:
        arr = old.copy()
        e, _ = _locate_apply(arr, fmt, (starts, ends, gaps, dd))
        return e, arr

    for e, arr in _every_path(run):
        assert e == 1
        np.testing.assert_array_equal(arr, old)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float32", "float64", "int64", "uint8"])
def test_locate_apply_other_widths_write_new(name: str) -> None:
    fmt = BIT_FORMATS[name]
    rng = np.random.default_rng(7)
    old = rng.integers(0, 256, 5000 * fmt.nbytes, dtype=np.uint8).view(fmt.uint)
    new = old.copy()
    mask = rng.random(5000) < 0.05
    new[mask] = rng.integers(0, 256, int(mask.sum()) * fmt.nbytes, dtype=np.uint8).view(fmt.uint)
    _, cls, rank, d = _scan(old, new, fmt)
    arr = old.copy()
    err, _ = _locate_apply(arr, fmt, _slots(fmt, cls, rank, d))
    assert err == 0
    np.testing.assert_array_equal(arr, new)


def test_locate_apply_refuses_read_only_short_or_mistyped_buffers() -> None:
    old = _weights(BF16, 4096, seed=5)
    new = _changed(old, 0.05, seed=6)
    _, cls, rank, d = _scan(old, new, BF16)
    starts, ends, gaps, dd = _slots(BF16, cls, rank, d)
    frozen = old.copy()
    frozen.flags.writeable = False
    with pytest.raises((TypeError, ValueError), match="arr"):
        _locate_apply(frozen, BF16, (starts, ends, gaps, dd))
    with pytest.raises((TypeError, ValueError), match="d"):
        _locate_apply(old.copy(), BF16, (starts, ends, gaps, dd.astype(np.uint32)))
    with pytest.raises(ValueError, match="pos_out and d"):
        _locate_apply(old.copy(), BF16, (starts, ends, gaps, dd[:-1]))
