"""Frame reader: exact reassembly under any split, hard size bound, fuzzed garbage."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import DecodeError
from swarm.wire.frames import HEADER_LEN, FrameReader, encode_frame


def drain(reader: FrameReader) -> list[bytes]:
    out = []
    while (f := reader.next_frame()) is not None:
        out.append(bytes(f))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=12), st.lists(st.integers(1, 5000),
                                                                  max_size=40))
def test_frames_survive_any_split(bodies: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(encode_frame(b) for b in bodies)
    reader = FrameReader(4096, scratch=64)
    pos = 0
    for c in cuts:
        reader.feed(wire[pos:pos + c])
        pos += c
    reader.feed(wire[pos:])
    assert drain(reader) == bodies
    assert not reader.mid_frame


def test_buffer_reads_put_large_bodies_straight_into_their_buffer() -> None:
    body = bytes(range(256)) * 1000
    wire = encode_frame(body) + encode_frame(b"tail")
    reader = FrameReader(1 << 20, scratch=1024)
    pos = 0
    while pos < len(wire):
        buf = reader.get_buffer()
        n = min(len(buf), len(wire) - pos, 777)
        buf[:n] = wire[pos:pos + n]
        reader.advance(n)
        pos += n
    assert drain(reader) == [body, b"tail"]


def test_oversized_header_is_refused_before_allocating() -> None:
    reader = FrameReader(1000)
    with pytest.raises(DecodeError, match="over the bound"):
        reader.feed(struct.pack(">I", 0xFFFFFFFF))
    assert reader._body is None  # nothing of that size was allocated


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_garbage_raises_only_decode_error_and_stays_bounded(data: bytes) -> None:
    reader = FrameReader(512, scratch=32)
    try:
        reader.feed(data)
    except DecodeError:
        return
    for f in drain(reader):
        assert len(f) <= 512
    assert reader._body is None or len(reader._body) <= 512
    assert len(data) < HEADER_LEN or reader.pending == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6))
def test_hold_mode_yields_one_frame_per_resume_then_applies_the_new_bound(
        bodies: list[bytes]) -> None:
    reader = FrameReader(512, scratch=4096, hold=True)
    reader.feed(b"".join(encode_frame(b) for b in bodies) + encode_frame(bytes(1000)))
    for i, b in enumerate(bodies):
        assert drain(reader) == [b]
        if i == len(bodies) - 1:
            reader.max_frame, reader.hold = 2000, False  # the handshake raised the bound
        reader.resume()
    assert drain(reader) == [bytes(1000)]
