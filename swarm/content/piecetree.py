"""A piece's BLAKE3 id from parts hashed where they lie (ranks of a sharded trainer).

BLAKE3 is a binary tree over 1024-byte chunks: the left child of a node of k > 1 chunks
holds the largest power of two of chunks below k. A rank holding bytes [start, end) of a
piece summarises them as the chaining values of the maximal tree nodes inside the range
plus the raw bytes of the at most two chunks it covers only in part, a few hundred bytes
to 2 KiB; ``merge`` joins the summaries of parts that tile the piece into
``blake3(piece).digest()``, and no tensor bytes but those partial chunks move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from swarm.content.ids import DIGEST_LEN, chunk_id
from swarm.content.pieces import MAX_PIECE_SIZE, Buffer
from swarm.delta._xg import b3_node_cv, b3_parent

CHUNK = 1024


def _mid(lo: int, hi: int) -> int:
    """Where the node of chunks [lo, hi), hi - lo > 1, splits into its children."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def _cover(lo: int, hi: int, a: int, b: int, out: list[tuple[int, int]]) -> None:
    if b <= lo or hi <= a:
        return
    if a <= lo and hi <= b:
        out.append((lo, hi))
        return
    mid = _mid(lo, hi)
    _cover(lo, mid, a, b, out)
    _cover(mid, hi, a, b, out)


def _check_range(piece_len: int, start: int, end: int) -> None:
    if not 1 <= piece_len <= MAX_PIECE_SIZE:
        raise ValueError(f"piece length {piece_len} outside [1, {MAX_PIECE_SIZE}]")
    if not 0 <= start < end <= piece_len:
        raise ValueError(f"part [{start}, {end}) is not a non-empty range of a piece of "
                         f"{piece_len} bytes")


def _layout(piece_len: int, start: int, end: int) -> tuple[list[tuple[int, int]], int, int]:
    """Chunk ranges of the maximal tree nodes inside a part that is not the whole piece,
    and the lengths of its bytes in the chunks it covers in part: at its start (head) and
    at its end (tail)."""
    first = -(-start // CHUNK)
    stop = -(-piece_len // CHUNK) if end == piece_len else end // CHUNK
    nodes: list[tuple[int, int]] = []
    if first < stop:
        _cover(0, -(-piece_len // CHUNK), first, stop, nodes)
    head = min(end, first * CHUNK) - start
    tail = max(0, end - max(start, max(first, stop) * CHUNK))
    return nodes, head, tail


@dataclass(frozen=True)
class PiecePart:
    """The summary of bytes [start, end) of a piece of ``piece_len`` bytes: ``digest``
    (the piece id) when the part is the whole piece, else ``nodes`` (first chunk, end
    chunk, chaining value) of the maximal tree nodes inside the part in chunk order, and
    the part's bytes in the chunks it covers in part (``head`` at its start, ``tail`` at
    its end). Construction checks that the fields are consistent."""

    piece_len: int
    start: int
    end: int
    nodes: tuple[tuple[int, int, bytes], ...] = ()
    head: bytes = b""
    tail: bytes = b""
    digest: bytes | None = None

    def __post_init__(self) -> None:
        if not all(type(v) is int for v in (self.piece_len, self.start, self.end)):
            raise ValueError("piece length, start and end must be ints")
        _check_range(self.piece_len, self.start, self.end)
        if type(self.head) is not bytes or type(self.tail) is not bytes:
            raise ValueError("head and tail must be bytes")
        if self.start == 0 and self.end == self.piece_len:
            if (type(self.digest) is not bytes or len(self.digest) != DIGEST_LEN
                    or self.nodes or self.head or self.tail):
                raise ValueError("a whole piece's part carries its 32-byte digest only")
            return
        ranges, head, tail = _layout(self.piece_len, self.start, self.end)
        if self.digest is not None:
            raise ValueError("only a whole piece's part carries a digest")
        if [(lo, hi) for lo, hi, _ in self.nodes] != ranges:
            raise ValueError(f"nodes of part [{self.start}, {self.end}) must cover chunks "
                             f"{ranges}")
        if not all(type(cv) is bytes and len(cv) == DIGEST_LEN for _, _, cv in self.nodes):
            raise ValueError("chaining values must be 32 bytes")
        if (len(self.head), len(self.tail)) != (head, tail):
            raise ValueError(f"part [{self.start}, {self.end}) has head and tail of {head} "
                             f"and {tail} bytes, not {len(self.head)} and {len(self.tail)}")

    def to_wire(self) -> list[int | bytes]:
        """[piece_len, start, end, digest or the nodes' chaining values joined, head,
        tail]: the node ranges follow from the first three."""
        cvs = self.digest if self.digest is not None else b"".join(n[2] for n in self.nodes)
        return [self.piece_len, self.start, self.end, cvs, self.head, self.tail]

    @classmethod
    def from_wire(cls, obj: object) -> PiecePart:
        """The part ``to_wire`` gave; ValueError on anything else."""
        if not isinstance(obj, list | tuple) or len(obj) != 6:
            raise ValueError("a piece part is a list of 6 fields")
        piece_len, start, end, cvs, head, tail = obj
        if not all(type(v) is int for v in (piece_len, start, end)):
            raise ValueError("piece length, start and end must be ints")
        if not all(type(v) is bytes for v in (cvs, head, tail)):
            raise ValueError("chaining values, head and tail must be bytes")
        _check_range(piece_len, start, end)
        if start == 0 and end == piece_len:
            return cls(piece_len, start, end, head=head, tail=tail, digest=cvs)
        ranges = _layout(piece_len, start, end)[0]
        if len(cvs) != DIGEST_LEN * len(ranges):
            raise ValueError(f"part [{start}, {end}) has {len(ranges)} chaining values, not "
                             f"{len(cvs)} bytes of them")
        nodes = tuple((lo, hi, cvs[DIGEST_LEN * i:DIGEST_LEN * (i + 1)])
                      for i, (lo, hi) in enumerate(ranges))
        return cls(piece_len, start, end, nodes, head, tail)


def summarise(data: Buffer, start: int, piece_len: int) -> PiecePart:
    """The summary of ``data``, the bytes [start, start + len(data)) of a piece."""
    view = memoryview(data).cast("B")
    end = start + view.nbytes
    _check_range(piece_len, start, end)
    if start == 0 and end == piece_len:
        return PiecePart(piece_len, start, end, digest=chunk_id(view))
    ranges, head, tail = _layout(piece_len, start, end)
    nodes = tuple(
        (lo, hi, b3_node_cv(view[lo * CHUNK - start:min(hi * CHUNK, piece_len) - start], lo))
        for lo, hi in ranges)
    return PiecePart(piece_len, start, end, nodes, bytes(view[:head]),
                     bytes(view[view.nbytes - tail:]))


def merge(piece_len: int, parts: Sequence[PiecePart]) -> bytes:
    """The BLAKE3 digest of a piece from the summaries of parts that cover [0, piece_len)
    exactly once, in any order; ValueError otherwise."""
    pos = 0
    ordered = sorted(parts, key=lambda p: p.start)
    for p in ordered:
        if p.piece_len != piece_len:
            raise ValueError(f"a part of a piece of {p.piece_len} bytes, not {piece_len}")
        if p.start != pos:
            raise ValueError(f"parts {'overlap' if p.start < pos else 'leave a gap'} at "
                             f"byte {min(pos, p.start)} of {piece_len}")
        pos = p.end
    if pos != piece_len or not ordered:
        raise ValueError(f"parts cover [0, {pos}) of a piece of {piece_len} bytes")
    if ordered[0].digest is not None:
        return ordered[0].digest
    known: dict[tuple[int, int], bytes] = {}
    partial: dict[int, list[bytes]] = {}
    for p in ordered:
        known.update(((lo, hi), cv) for lo, hi, cv in p.nodes)
        if p.head:
            partial.setdefault(p.start // CHUNK, []).append(p.head)
        if p.tail:
            partial.setdefault((p.end - 1) // CHUNK, []).append(p.tail)
    chunks = -(-piece_len // CHUNK)
    if chunks == 1:
        return bytes(blake3.blake3(b"".join(partial[0])).digest())
    for i, frags in partial.items():
        known[(i, i + 1)] = b3_node_cv(b"".join(frags), i)
    mid = _mid(0, chunks)
    return b3_parent(_node(known, 0, mid), _node(known, mid, chunks), True)


def _node(known: dict[tuple[int, int], bytes], lo: int, hi: int) -> bytes:
    cv = known.get((lo, hi))
    if cv is not None:
        return cv
    mid = _mid(lo, hi)
    return b3_parent(_node(known, lo, mid), _node(known, mid, hi), False)
