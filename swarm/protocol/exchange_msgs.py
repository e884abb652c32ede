"""Chunk exchange messages and their strict bounded codec.

Wire form of every message: canonical msgpack ``[tag, field, ...]``. The decoder bounds
the frame and each field before allocating, checks every field's type and range, and
refuses non-canonical encodings (see :mod:`swarm.wire.strict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.content.ids import DIGEST_LEN
from swarm.errors import DecodeError
from swarm.wire import strict

MAX_CHUNKS_PER_OBJECT = 1 << 18
MAX_PIECE_BYTES = 64 << 20
MAX_FRAME = MAX_PIECE_BYTES + 256


@dataclass(frozen=True, slots=True)
class Bitfield:
    """Which chunks of ``obj`` the sender holds: bit ``i`` (LSB first in byte ``i // 8``)."""

    obj: bytes
    count: int
    bits: bytes


@dataclass(frozen=True, slots=True)
class Have:
    """The sender now holds chunk ``index`` of ``obj``."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Request:
    """Please send chunk ``index`` of ``obj``."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Forget an earlier request (another source delivered it)."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Reject:
    """The sender will not serve this request (choked, absent, or over its queue bound)."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Suggest:
    """Super-seeding: the sender asks the receiver to fetch this chunk from it."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Want:
    """Send chunk ``index`` of ``obj`` once you hold it: a standing request, served like
    a :class:`Request` when the sender already holds the chunk, else kept (counted in the
    same per-neighbour queue bound) and queued the moment the chunk arrives; refused with
    :class:`Reject` when it cannot be kept, withdrawn with :class:`Cancel`."""

    obj: bytes
    index: int


@dataclass(frozen=True, slots=True)
class Piece:
    """The bytes of chunk ``index`` of ``obj`` (as received: ``bytes``; as sent, also a
    read-only view of a state the sender holds)."""

    obj: bytes
    index: int
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Choke:
    """The sender will serve no requests from the receiver until it unchokes."""


@dataclass(frozen=True, slots=True)
class Unchoke:
    """The sender will serve the receiver's requests."""


Message = (Bitfield | Have | Request | Cancel | Reject | Suggest | Piece | Choke | Unchoke
           | Want)

_INDEXED: dict[int, type[Have | Request | Cancel | Reject | Suggest | Want]] = {
    1: Have, 2: Request, 3: Cancel, 4: Reject, 5: Suggest, 9: Want,
}
_TAG_OF: dict[type[Any], int] = {v: k for k, v in _INDEXED.items()}
_BITFIELD, _PIECE, _CHOKE, _UNCHOKE = 0, 6, 7, 8


def encode(msg: Message) -> bytes:
    """Canonical bytes of one message."""
    if isinstance(msg, Bitfield):
        return strict.pack([_BITFIELD, msg.obj, msg.count, msg.bits])
    if isinstance(msg, Piece):
        return strict.pack([_PIECE, msg.obj, msg.index, msg.data])
    if isinstance(msg, Choke):
        return strict.pack([_CHOKE])
    if isinstance(msg, Unchoke):
        return strict.pack([_UNCHOKE])
    return strict.pack([_TAG_OF[type(msg)], msg.obj, msg.index])


def wire_size(msg: Message) -> int:
    """Bytes ``msg`` occupies on the wire, without encoding a piece's payload."""
    if isinstance(msg, Piece):
        return len(msg.data) + 48
    if isinstance(msg, Bitfield):
        return len(msg.bits) + 48
    return 44


def _obj(v: object) -> bytes:
    if type(v) is not bytes or len(v) != DIGEST_LEN:
        raise DecodeError("exchange message: object id must be 32 bytes")
    return v


def _index(v: object) -> int:
    if type(v) is not int or not 0 <= v < MAX_CHUNKS_PER_OBJECT:
        raise DecodeError("exchange message: chunk index out of range")
    return v


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Strictly decode one message.

    :raises DecodeError: malformed, oversized, non-canonical or an unknown tag.
    """
    obj = strict.unpack(data, max_bytes=MAX_FRAME, max_bin=MAX_PIECE_BYTES, max_array=4,
                        max_map=0, max_str=0)
    if type(obj) is not list or not obj or type(obj[0]) is not int:
        raise DecodeError("exchange message: expected [tag, ...]")
    tag, rest = obj[0], obj[1:]
    if tag in _INDEXED:
        if len(rest) != 2:
            raise DecodeError("exchange message: expected [tag, obj, index]")
        return _INDEXED[tag](_obj(rest[0]), _index(rest[1]))
    if tag == _PIECE:
        if len(rest) != 3 or type(rest[2]) is not bytes:
            raise DecodeError("piece: expected [tag, obj, index, data]")
        return Piece(_obj(rest[0]), _index(rest[1]), rest[2])
    if tag == _BITFIELD:
        if len(rest) != 3 or type(rest[1]) is not int or type(rest[2]) is not bytes:
            raise DecodeError("bitfield: expected [tag, obj, count, bits]")
        count = rest[1]
        if not 0 <= count <= MAX_CHUNKS_PER_OBJECT or len(rest[2]) != (count + 7) // 8:
            raise DecodeError("bitfield: count and bit length disagree")
        return Bitfield(_obj(rest[0]), count, rest[2])
    if tag in (_CHOKE, _UNCHOKE):
        if rest:
            raise DecodeError("choke/unchoke carry no fields")
        return Choke() if tag == _CHOKE else Unchoke()
    raise DecodeError(f"exchange message: unknown tag {tag}")


def bits_of(indices: set[int] | frozenset[int], count: int) -> bytes:
    """Pack chunk indices into a bitfield of ``count`` bits."""
    out = bytearray((count + 7) // 8)
    for i in indices:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def indices_of(bits: bytes, count: int) -> set[int]:
    """Indices set in a bitfield (bits past ``count`` must be zero)."""
    out = set()
    for byte_i, b in enumerate(bits):
        while b:
            low = b & -b
            i = byte_i * 8 + low.bit_length() - 1
            if i >= count:
                raise DecodeError("bitfield: bit set past the chunk count")
            out.add(i)
            b ^= low
    return out
