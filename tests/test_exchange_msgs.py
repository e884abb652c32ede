"""Exchange message codec: round trips, canonical form, hostile bytes."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import DecodeError
from swarm.protocol.exchange_msgs import (
    MAX_PIECE_BYTES,
    Bitfield,
    Cancel,
    Choke,
    Have,
    Message,
    Piece,
    Reject,
    Request,
    Suggest,
    Unchoke,
    Want,
    bits_of,
    decode,
    encode,
    indices_of,
)

objs = st.binary(min_size=32, max_size=32)
idx = st.integers(0, (1 << 18) - 1)


@st.composite
def bitfields(draw: st.DrawFn) -> Bitfield:
    count = draw(st.integers(0, 300))
    have = draw(st.sets(st.integers(0, max(0, count - 1)), max_size=count)) if count else set()
    return Bitfield(draw(objs), count, bits_of(have, count))


messages = st.one_of(
    st.builds(Have, objs, idx), st.builds(Request, objs, idx), st.builds(Cancel, objs, idx),
    st.builds(Reject, objs, idx), st.builds(Suggest, objs, idx), st.builds(Want, objs, idx),
    st.builds(Piece, objs, idx, st.binary(max_size=2048)),
    st.just(Choke()), st.just(Unchoke()), bitfields(),
)


@given(messages)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg


@given(st.binary(max_size=200))
@settings(max_examples=400)
def test_garbage_is_a_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(data)


@given(messages, st.data())
def test_every_truncation_is_rejected(msg: Message, data: st.DataObject) -> None:
    raw = encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(DecodeError):
        decode(raw[:cut])


@pytest.mark.parametrize("raw", [
    msgpack.packb([2, b"x" * 31, 0]),          # short object id
    msgpack.packb([2, b"x" * 32, -1]),         # negative index
    msgpack.packb([2, b"x" * 32, 1 << 18]),    # index past the bound
    msgpack.packb([2, b"x" * 32]),             # missing field
    msgpack.packb([99, b"x" * 32, 0]),         # unknown tag
    msgpack.packb([7, 1]),                     # choke with a field
    msgpack.packb([0, b"x" * 32, 9, b"\0"]),   # bitfield too short for its count
    msgpack.packb([0, b"x" * 32, 3, b"\xff"]),  # bits set past the count
    msgpack.packb({"tag": 1}),                 # not a list
    msgpack.packb([6, b"x" * 32, 0, "text"]),  # piece data not bytes
])
def test_malformed_fields_are_rejected(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        msg = decode(raw)
        if isinstance(msg, Bitfield):
            indices_of(msg.bits, msg.count)


def test_oversized_piece_is_rejected_before_allocation() -> None:
    # a piece header claiming a bin longer than the bound, with no body behind it
    raw = (b"\x94\x06" + msgpack.packb(b"x" * 32) + b"\x00"
           + b"\xc6" + (MAX_PIECE_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(DecodeError):
        decode(raw)


def test_non_canonical_encoding_is_rejected() -> None:
    raw = b"\x93" + b"\xd0\x01" + msgpack.packb(b"x" * 32) + b"\x00"  # int8 tag
    with pytest.raises(DecodeError):
        decode(raw)


def test_bitfield_helpers() -> None:
    assert indices_of(bits_of({0, 7, 8, 20}, 21), 21) == {0, 7, 8, 20}
    assert bits_of(set(), 0) == b""
