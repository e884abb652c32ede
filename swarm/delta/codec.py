"""The ``swarm-xg1`` delta codec: exponent-grouped positions + ULP differences.

A delta is cut into *segments* (a run of at most ``SEGMENT_ELEMS`` elements of one tensor)
and segments are packed into *chunks* (about ``CHUNK_TARGET`` bytes) that decode and apply
independently, in any order. Per segment, with the receiver's old values as context:

- every element belongs to the class of its old value's exponent field (integers: one
  class); changes are grouped by class and their positions coded as gaps between ranks
  *within the class*, Rice-coded with one parameter per class (the encoder picks the
  cheapest; a quotient of 24 or more escapes to a raw u32 gap);
- each change is the difference of order-preserving keys modulo 2**bits, sent as a sign
  bit (packed) and ``magnitude - 1`` as one byte (255 escapes the full-width value).

The gap bitstream and the sign bits are raw; the magnitude bytes are zstd-compressed
(with their content size, bounded on decode). Chunk wire form (canonical msgpack)::

    ["swarm-xg1", [[tensor, start, count, changes, classes, gaps, signs, mags], ...]]

``classes`` is ``u16 class ids || u32 counts || u8 Rice parameters`` (little-endian,
ids ascending). Unverified bytes (:func:`apply_chunk`) are decoded completely and checked
against the state before any byte is written. A chunk whose bytes its id pinned in a signed
manifest (:class:`swarm.delta.patch.Patcher`) is decoded and written in one pass over the
state, each change as it is placed; if it still does not fit, its writes are undone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from swarm.content.layout import StateLayout
from swarm.content.manifest import MAX_CHUNK_BYTES
from swarm.delta import _xg, device
from swarm.delta.dtypes import BIT_FORMATS, BitFormat, bits_view
from swarm.errors import DecodeError, LocalProtocolError
from swarm.wire import strict

CODEC_NAME = "swarm-xg1"
SEGMENT_ELEMS = 1 << 22
CHUNK_TARGET = 1 << 20
MAX_SEGMENTS = 1 << 16
MAX_CHUNK_CHANGES = 1 << 24  # bounds decode memory (about 14 bytes per change)
ZSTD_LEVEL = 1
ENGINES = ("auto", "c", "torch")
_GAP_BITS_MAX = _xg.RICE_QMAX + 32

Bits = np.ndarray
StateView = np.ndarray | torch.Tensor
"""A tensor's elements as bits: a numpy view (C kernels) or a device view (torch ops)."""

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        _local.cctx = c
    return c


def _scratch(name: str, size: int, dtype: np.dtype[Any] | type) -> np.ndarray:
    """A per-thread temporary of ``size`` elements, reused from call to call: fresh
    allocations of these sizes are page-faulted and zeroed by the kernel every time. (A
    dict lookup and a slice: a segment takes six, and building dtypes and views each time
    cost 3 us apiece.)"""
    bufs: dict[tuple[str, Any], np.ndarray] | None = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get((name, dtype))
    if buf is None or buf.shape[0] < size:
        buf = bufs[name, dtype] = np.empty(max(size, 1 << 12), dtype)
    return buf[:size]


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = zstandard.ZstdDecompressor()
        _local.dctx = d
    return d


@dataclass(frozen=True, slots=True)
class EncodedSegment:
    """The coded changes of elements ``[start, start + count)`` of tensor ``tensor``."""

    tensor: int
    start: int
    count: int
    changes: int
    classes: bytes
    gaps: bytes
    signs: bytes
    mags: bytes

    @property
    def nbytes(self) -> int:
        return len(self.classes) + len(self.gaps) + len(self.signs) + len(self.mags) + 24

    def to_wire(self) -> list[object]:
        return [self.tensor, self.start, self.count, self.changes, self.classes, self.gaps,
                self.signs, self.mags]


def encode_segment(old: Bits, new: Bits, fmt: BitFormat, tensor: int, start: int
                   ) -> EncodedSegment | None:
    """Encode the changed bits between two equal-length unsigned views; None if none."""
    n = old.shape[0]
    cap = max(1024, n // 16)
    while True:
        cls = _scratch("cls", cap, np.uint16)
        rank = _scratch("rank", cap, np.uint32)
        d = _scratch("diff", cap, fmt.uint)
        k = _xg.scan(old, new, fmt.shift, fmt.emask, int(fmt.signbit), int(fmt.full), cls,
                     rank, d)
        if k >= 0:
            break
        cap = n
    if k == 0:
        return None
    return encode_changes(cls, rank, d, int(k), fmt, tensor, start, n)


def encode_device_segment(old: torch.Tensor, new: torch.Tensor, fmt: BitFormat, tensor: int,
                          start: int) -> EncodedSegment | None:
    """:func:`encode_segment` for views of :func:`swarm.delta.device.device_bits` (changes
    found on the tensors' device): the same bytes."""
    found = device.scan_segment(old, new, fmt)
    if found is None:
        return None
    cls, rank, diff = found
    return encode_changes(cls, rank, diff, int(cls.shape[0]), fmt, tensor, start,
                          int(old.shape[0]))


def encode_changes(cls: np.ndarray, rank: np.ndarray, d: np.ndarray, k: int, fmt: BitFormat,
                   tensor: int, start: int, count: int) -> EncodedSegment:
    """Code the first ``k`` changes of a ``count``-element segment, in element order: their
    classes (uint16), ranks within their class in the segment (uint32) and key differences
    (``fmt.uint``), as the scan finds them."""
    ccount = _scratch("ccount", fmt.nclass, np.int64)  # group_encode writes every entry
    kparam = _scratch("kparam", fmt.nclass, np.int64)
    gaps = _scratch("gaps", _gap_bound(k), np.uint8)
    signs = _scratch("signs", (k + 7) // 8, np.uint8)
    mags = _scratch("mags", k * (1 + fmt.nbytes), np.uint8)
    g, m = _xg.group_encode(cls, rank, d, k, fmt.nclass, ccount, kparam, gaps, signs, mags)
    present = np.flatnonzero(ccount)
    classes = (present.astype("<u2").tobytes() + ccount[present].astype("<u4").tobytes()
               + kparam[present].astype(np.uint8).tobytes())
    return EncodedSegment(tensor, start, count, k, classes, gaps[:g].tobytes(),
                          signs.tobytes(), _compressor().compress(mags[:m].data))


def _gap_bound(changes: int) -> int:
    return (_GAP_BITS_MAX * changes + 7) // 8


def pack_chunk(segments: Sequence[EncodedSegment]) -> bytes:
    """Wire bytes of a chunk holding ``segments`` (in state order)."""
    if not segments or len(segments) > MAX_SEGMENTS:
        raise LocalProtocolError(f"a chunk holds 1..{MAX_SEGMENTS} segments")
    return strict.pack([CODEC_NAME, [s.to_wire() for s in segments]])


@dataclass(frozen=True, slots=True)
class SegmentChange:
    """Decoded changes of one segment: element positions (relative to ``start``) and key
    differences."""

    tensor: int
    start: int
    positions: np.ndarray
    diffs: np.ndarray


@dataclass(frozen=True, slots=True)
class AppliedChunk:
    """What one applied chunk changed; enough to revert it exactly."""

    segments: tuple[SegmentChange, ...]
    tensor_names: frozenset[str]

    @property
    def changes(self) -> int:
        return sum(int(s.positions.shape[0]) for s in self.segments)


def _unzstd(blob: bytes, bound: int, what: str) -> np.ndarray:
    try:
        size = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"chunk: {what} stream is not a zstd frame") from exc
    if size < 0 or size > bound:
        raise DecodeError(f"chunk: {what} stream declares {size} bytes (bound {bound})")
    try:
        out = _decompressor().decompress(blob, max_output_size=bound)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"chunk: {what} stream is not valid zstd: {exc}") from exc
    if len(out) != size:
        raise DecodeError(f"chunk: {what} stream has {len(out)} bytes, header says {size}")
    return np.frombuffer(out, np.uint8)


def parse_chunk(data: bytes | bytearray | memoryview, *, canonical: bool = True
                ) -> list[list[object]]:
    """Strictly parse a chunk's container (no state needed). ``canonical=False`` skips
    re-encoding the chunk to compare bytes (about 1 ms a MiB), for bytes already pinned by
    their id in a signed manifest: every field is still bounded and type-checked.

    :raises DecodeError: oversized, malformed, non-canonical or another codec's chunk.
    """
    obj = strict.unpack(data, max_bytes=MAX_CHUNK_BYTES, max_str=32, max_bin=MAX_CHUNK_BYTES,
                        max_array=MAX_SEGMENTS, max_map=0, canonical=canonical)
    if type(obj) is not list or len(obj) != 2:
        raise DecodeError("chunk: expected [codec, segments]")
    if obj[0] != CODEC_NAME:
        raise DecodeError(f"chunk: codec {obj[0]!r:.40} is not {CODEC_NAME!r}")
    segs = obj[1]
    if type(segs) is not list or not segs:
        raise DecodeError("chunk: segments must be a non-empty list")
    for seg in segs:
        if (type(seg) is not list or len(seg) != 8
                or any(type(x) is not int for x in seg[:4])
                or any(type(x) is not bytes for x in seg[4:])):
            raise DecodeError("chunk: a segment is [tensor, start, count, changes, "
                              "classes, gaps, signs, mags]")
    return segs


def decode_segment(seg: list[object], layout: StateLayout, views: Sequence[StateView], *,
                   write: bool = False) -> SegmentChange:
    """Decode one parsed segment against the current (old) values; writes nothing unless
    ``write``: then each change is written as it is placed (one pass over the state), and a
    segment whose changes do not fit the state is undone before :class:`DecodeError`."""
    tensor, start, count, changes = (int(x) for x in seg[:4])  # type: ignore[call-overload]
    classes, gaps, signs, mags = (bytes(x) for x in seg[4:])  # type: ignore[call-overload]
    if not 0 <= tensor < len(layout):
        raise DecodeError(f"chunk: tensor index {tensor} outside the layout")
    spec = layout.tensors[tensor]
    if not (start >= 0 and 0 < count <= SEGMENT_ELEMS and start + count <= spec.numel):
        raise DecodeError(f"chunk: segment [{start}, +{count}) outside {spec.name}")
    if not 0 < changes <= count:
        raise DecodeError(f"chunk: {changes} changes in a {count}-element segment")
    fmt = BIT_FORMATS[spec.dtype]
    if len(classes) % 7 or not 0 < len(classes) // 7 <= fmt.nclass:
        raise DecodeError("chunk: malformed class table")
    nc = len(classes) // 7
    ccounts = np.empty(nc, np.int64)
    kparams = np.empty(nc, np.int64)
    class_start = np.empty(fmt.nclass, np.int64)
    class_end = np.empty(fmt.nclass, np.int64)
    if _xg.class_table(classes, changes, ccounts, kparams, class_start, class_end):
        raise DecodeError("chunk: class table inconsistent with the change count")
    if len(signs) != (changes + 7) // 8:
        raise DecodeError("chunk: sign stream has the wrong length")
    if len(gaps) > _gap_bound(changes):
        raise DecodeError("chunk: gap stream is longer than its changes allow")
    mag_bytes = _unzstd(mags, (1 + fmt.nbytes) * changes, "magnitude")
    gapv = _scratch("gapv", changes, np.int64)
    err = _xg.decode_gaps(ccounts, kparams, gaps, gapv, count)
    if err:
        raise DecodeError(f"chunk: bad gap stream (code {err})")
    diffs = np.empty(changes, fmt.uint)
    err = _xg.decode_values(signs, mag_bytes, changes, diffs)
    if err:
        raise DecodeError(f"chunk: bad sign/magnitude stream (code {err})")
    old = views[tensor][start:start + count]
    if isinstance(old, torch.Tensor):
        pos = device.locate_segment(old, fmt, class_start, class_end, gapv)
        if write:
            device.apply_segment(old, 0, pos, diffs, fmt, False)
        return SegmentChange(tensor, start, pos, diffs)
    pos = np.empty(changes, np.uint32)
    if write:
        err = _xg.locate_apply(old, fmt.shift, fmt.emask, int(fmt.signbit), int(fmt.full),
                               class_start, class_end, gapv, diffs, pos)
    else:
        err = _xg.locate(old, fmt.shift, fmt.emask, class_start, class_end, gapv, pos)
    if err:
        raise DecodeError("chunk: a change's rank is past its class population")
    return SegmentChange(tensor, start, pos, diffs)


def _ordered_segments(data: bytes | bytearray | memoryview, canonical: bool = True
                      ) -> list[list[object]]:
    """A parsed chunk's segments, checked to be in state order and within the change bound."""
    segs = parse_chunk(data, canonical=canonical)
    prev = (-1, 0)
    total = 0
    for seg in segs:
        tensor, start, count, changes = (int(x) for x in seg[:4])  # type: ignore[call-overload]
        if (tensor, start) < prev:
            raise DecodeError("chunk: segments overlap or are out of order")
        prev = (tensor, start + count)
        total += changes
    if total > MAX_CHUNK_CHANGES:
        raise DecodeError(f"chunk: {total} changes exceed the bound {MAX_CHUNK_CHANGES}")
    return segs


def _each(fn: Callable[[list[object]], SegmentChange], segs: list[list[object]],
          executor: Executor | None) -> list[SegmentChange | Exception]:
    def guarded(seg: list[object]) -> SegmentChange | Exception:
        try:
            return fn(seg)
        except Exception as exc:  # handed back: the caller undoes the other segments
            return exc

    if executor is not None and len(segs) > 1:
        return list(executor.map(guarded, segs))
    return [guarded(s) for s in segs]


def _chunk(layout: StateLayout, out: Sequence[SegmentChange]) -> AppliedChunk:
    return AppliedChunk(tuple(out), frozenset(layout.tensors[s.tensor].name for s in out))


def decode_chunk(data: bytes | bytearray | memoryview, layout: StateLayout,
                 views: Sequence[StateView], executor: Executor | None = None
                 ) -> AppliedChunk:
    """Decode and check a whole chunk against the state's current values; writes nothing.

    With ``executor``, segments are decoded in parallel on its threads.

    :raises DecodeError: the chunk is corrupt, truncated, oversized or does not fit the
        layout.
    """
    segs = _ordered_segments(data)
    if executor is not None and len(segs) > 1:
        out = list(executor.map(lambda s: decode_segment(s, layout, views), segs))
    else:
        out = [decode_segment(s, layout, views) for s in segs]
    return _chunk(layout, out)


def apply_verified_chunk(data: bytes | bytearray | memoryview, layout: StateLayout,
                         views: Sequence[StateView], executor: Executor | None = None
                         ) -> AppliedChunk:
    """Decode a chunk and write its changes as they are placed: one pass over the state,
    for chunks whose bytes were verified against a signed manifest (:class:`Patcher`).

    A chunk that fails to decode or does not fit the state has every change it wrote
    undone before the error is raised, so the state is as it was; unverified bytes should
    go through :func:`decode_chunk`, which checks the whole chunk before any write. The
    container is not re-encoded to check its canonical form: the id pins the bytes.

    :raises DecodeError: the chunk is corrupt or does not fit the state (nothing changed).
    """
    segs = _ordered_segments(data, canonical=False)
    out = _each(lambda s: decode_segment(s, layout, views, write=True), segs, executor)
    done = [s for s in out if isinstance(s, SegmentChange)]
    if len(done) < len(out):
        _apply(layout, views, _chunk(layout, done), True, executor)
        raise next(e for e in out if isinstance(e, Exception))
    return _chunk(layout, done)


def _apply(layout: StateLayout, views: Sequence[StateView], chunk: AppliedChunk, negate: bool,
           executor: Executor | None) -> None:
    def one(s: SegmentChange) -> None:
        fmt = BIT_FORMATS[layout.tensors[s.tensor].dtype]
        view = views[s.tensor]
        if isinstance(view, torch.Tensor):
            device.apply_segment(view, s.start, s.positions, s.diffs, fmt, negate)
        else:
            _xg.apply_diffs(view[s.start:], s.positions, s.diffs, int(fmt.signbit),
                            int(fmt.full), negate)

    # segments of a chunk cover disjoint elements: any order, any thread
    if executor is not None and len(chunk.segments) > 1:
        for _ in executor.map(one, chunk.segments):
            pass
    else:
        for s in chunk.segments:
            one(s)


def apply_decoded(layout: StateLayout, views: Sequence[StateView], chunk: AppliedChunk,
                  executor: Executor | None = None) -> None:
    """Write a decoded chunk's changes into the state (views of its tensors); with
    ``executor``, segments are written in parallel on its threads."""
    _apply(layout, views, chunk, False, executor)


def revert_decoded(layout: StateLayout, views: Sequence[StateView], chunk: AppliedChunk,
                   executor: Executor | None = None) -> None:
    """Undo :func:`apply_decoded` exactly."""
    _apply(layout, views, chunk, True, executor)


def state_views(state: Mapping[str, torch.Tensor], layout: StateLayout,
                engine: str = "auto") -> list[StateView]:
    """Writable bit views of every tensor, checked against ``layout``: numpy views of CPU
    tensors for the C kernels, or (``engine="torch"``, or tensors on another device)
    :func:`swarm.delta.device.device_bits` views patched with torch ops.

    :raises LocalProtocolError: the state does not match the layout, or the C engine was
        asked for tensors that are not on the CPU.
    """
    from swarm.delta.state import layout_of

    if layout_of(state) != layout:
        raise LocalProtocolError("the state does not match the delta's layout")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
    on_cpu = all(t.device.type == "cpu" for t in state.values())
    if engine == "c" and not on_cpu:
        raise LocalProtocolError("the C engine patches CPU tensors; use engine 'auto' or "
                                 "'torch' for a state on a device")
    if engine == "torch" or not on_cpu:
        return [device.device_bits(t, name) for name, t in state.items()]
    views: list[StateView] = [bits_view(t, name) for name, t in state.items()]
    return views


def apply_chunk(state: Mapping[str, torch.Tensor], data: bytes | bytearray | memoryview,
                layout: StateLayout | None = None) -> AppliedChunk:
    """Decode ``data`` and apply it to ``state`` in place; returns what reverts it.

    Nothing is written unless the whole chunk decodes and fits the state.

    :raises DecodeError: corrupt, truncated or oversized chunk.
    """
    from swarm.delta.state import layout_of

    lay = layout if layout is not None else layout_of(state)
    views = state_views(state, lay)
    decoded = decode_chunk(data, lay, views)
    apply_decoded(lay, views, decoded)
    return decoded


def revert_chunk(state: Mapping[str, torch.Tensor], applied: AppliedChunk,
                 layout: StateLayout | None = None) -> None:
    """Undo :func:`apply_chunk` exactly (revert several in reverse order of applying)."""
    from swarm.delta.state import layout_of

    lay = layout if layout is not None else layout_of(state)
    revert_decoded(lay, state_views(state, lay), applied)
