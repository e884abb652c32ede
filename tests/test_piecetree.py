"""A piece's BLAKE3 id merged from summaries of its parts (swarm/content/piecetree.py)."""

from __future__ import annotations

import itertools
import random

import blake3
import msgpack
import pytest

from swarm.content.piecetree import CHUNK, PiecePart, merge, summarise
from swarm.delta._xg import b3_node_cv, b3_parent, set_simd, simd_paths

LENGTHS = [1, 1023, 1024, 1025, 2048, 4096 + 17, 64 << 10, (1 << 20) + 3, 4 << 20]
WIRE_MAX = 2048 + 32 * 2 * 13


def _piece(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def _parts(p: bytes, bounds: list[int]) -> list[PiecePart]:
    return [summarise(p[a:b], a, len(p)) for a, b in itertools.pairwise(bounds)]


def _wire(part: PiecePart) -> PiecePart:
    return PiecePart.from_wire(msgpack.unpackb(msgpack.packb(part.to_wire())))


def _cut_sets(n: int, rng: random.Random) -> list[list[int]]:
    """Inner cut offsets of 2, 3 and 4 parts: unaligned, aligned to chunks, inside one
    chunk, around chunk boundaries, and with a part of 1 byte."""
    chunks = -(-n // CHUNK)
    near = sorted({c for k in range(1, chunks + 1) for c in (k * CHUNK - 1, k * CHUNK,
                                                             k * CHUNK + 1)
                   if 0 < c < n})
    out: list[list[int]] = []
    for k in (2, 3, 4):
        if n < k:
            continue
        for _ in range(4):
            out.append(sorted(rng.sample(range(1, n), k - 1)))
        if chunks > k:
            out.append(sorted(CHUNK * c for c in rng.sample(range(1, chunks), k - 1)))
        if len(near) >= k - 1:
            out.append(sorted(rng.sample(near, k - 1)))
        c = rng.randrange(chunks) * CHUNK
        if min(n, c + CHUNK) - c > k:
            out.append(sorted(rng.sample(range(c + 1, min(n, c + CHUNK)), k - 1)))
        x = rng.randrange(1, n - 1) if k > 2 else rng.choice((0, n - 1))
        one = {x, x + 1} - {0, n}
        while len(one) < k - 1:
            one.add(rng.randrange(1, n))
        out.append(sorted(one))
    return out


@pytest.mark.parametrize("n", LENGTHS)
def test_merged_parts_give_the_piece_id(n: int) -> None:
    p = _piece(n)
    want = blake3.blake3(p).digest()
    rng = random.Random(n + 1)
    assert merge(n, [summarise(p, 0, n)]) == want
    for cuts in _cut_sets(n, rng):
        parts = [_wire(x) for x in _parts(p, [0, *cuts, n])]
        rng.shuffle(parts)
        assert merge(n, parts) == want, cuts


@pytest.mark.parametrize("path", simd_paths())
def test_every_simd_path_gives_the_piece_id(path: str) -> None:
    """Full chunks go 16, 8 or 4 at a time, up to 256 a batch, the rest one by one."""
    n = 300 * CHUNK + 5
    p = _piece(n)
    want = blake3.blake3(p).digest()
    set_simd(path)
    try:
        for cuts in ([1], [CHUNK], [2 * CHUNK], [17 * CHUNK], [256 * CHUNK], [257 * CHUNK - 1],
                     [CHUNK + 1, 260 * CHUNK], [24 * CHUNK, 288 * CHUNK + 9]):
            assert merge(n, _parts(p, [0, *cuts, n])) == want, cuts
    finally:
        set_simd("avx512")


def test_every_two_part_cut_of_a_small_piece() -> None:
    n = 3 * CHUNK + 5
    p = _piece(n)
    want = blake3.blake3(p).digest()
    for cut in range(1, n):
        assert merge(n, _parts(p, [0, cut, n])) == want, cut


def test_a_part_of_one_byte_anywhere() -> None:
    n = 5 * CHUNK
    p = _piece(n)
    want = blake3.blake3(p).digest()
    for at in (0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 7, n - 1):
        bounds = sorted({0, at, at + 1, n})
        assert merge(n, _parts(p, bounds)) == want, at


def test_summaries_of_a_4mib_piece_are_small() -> None:
    n = 4 << 20
    p = _piece(n)
    rng = random.Random(7)
    ranges = [(1, n - 1), (CHUNK - 1, n - CHUNK + 1), (0, n - 1), (1, n), (5, 6)]
    ranges += [(min(c), max(c)) for c in (rng.sample(range(n + 1), 2) for _ in range(8))]
    for a, b in ranges:
        part = summarise(p[a:b], a, n)
        assert len(msgpack.packb(part.to_wire())) < WIRE_MAX, (a, b)
    assert len(msgpack.packb(summarise(p, 0, n).to_wire())) < 64


def test_parts_that_do_not_tile_the_piece_are_refused() -> None:
    n = 3 * CHUNK + 100
    p = _piece(n)
    a, b, c = _parts(p, [0, 1500, 2500, n])
    with pytest.raises(ValueError, match="gap"):
        merge(n, [a, c])
    with pytest.raises(ValueError, match="cover"):
        merge(n, [a, b])
    with pytest.raises(ValueError, match="cover"):
        merge(n, [])
    with pytest.raises(ValueError, match="overlap"):
        merge(n, [a, b, b, c])
    with pytest.raises(ValueError, match="overlap"):
        merge(n, [a, summarise(p[1400:2500], 1400, n), c])
    with pytest.raises(ValueError, match="overlap"):
        merge(n, [summarise(p, 0, n), a, b, c])
    with pytest.raises(ValueError, match="piece of"):
        merge(n + 1, [a, b, c])
    with pytest.raises(ValueError):
        summarise(p[:10], n - 5, n)
    with pytest.raises(ValueError):
        summarise(b"", 0, n)


def test_malformed_wire_is_refused() -> None:
    n = 8 * CHUNK + 3
    p = _piece(n)
    part = summarise(p[100:5000], 100, n)
    good = part.to_wire()
    assert PiecePart.from_wire(good) == part
    assert PiecePart.from_wire(tuple(good)) == part
    cvs, head, tail = b"".join(cv for _, _, cv in part.nodes), part.head, part.tail
    assert good == [n, 100, 5000, cvs, head, tail] and len(part.nodes) > 1 and tail
    bad: list[object] = [
        None, b"", {}, good[:5], [*good, b""],
        [True, *good[1:]], [n, 100.0, *good[2:]], [n, 100, "5000", *good[3:]],
        [n, 100, 5000, bytearray(cvs), *good[4:]], [n, 100, 5000, cvs, "x", tail],
        [n, 100, 5000, cvs[:-1], *good[4:]], [n, 100, 5000, cvs + bytes(32), *good[4:]],
        [n, 100, 5000, cvs, head + b"x", tail], [n, 100, 5000, cvs, head, b""],
        [n, 100, 100, b"", b"", b""], [n, 5000, 100, *good[3:]], [n, -1, 5000, *good[3:]],
        [n, 100, n + 1, *good[3:]], [0, 0, 0, b"", b"", b""], [1 << 40, 100, 5000, *good[3:]],
        [n, 0, n, bytes(31), b"", b""], [n, 0, n, bytes(32), b"x", b""],
        [n, 101, 5000, *good[3:]],
    ]
    for obj in bad:
        with pytest.raises(ValueError):
            PiecePart.from_wire(obj)
    with pytest.raises(ValueError):
        PiecePart(n, 100, 5000, part.nodes[1:], part.head, part.tail)
    with pytest.raises(ValueError):
        PiecePart(n, 100, 5000, part.nodes, part.head, part.tail, digest=bytes(32))


def test_node_cv_and_parent_refuse_bad_input() -> None:
    for data, first in ((b"", 0), (bytes(2 * CHUNK), 1), (bytes(3 * CHUNK), 2),
                        (b"x", -1), (b"x", 1 << 64)):
        with pytest.raises(ValueError):
            b3_node_cv(data, first)
    with pytest.raises(TypeError):
        b3_node_cv("text", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        b3_parent(bytes(32), bytes(31), False)
    cv = b3_node_cv(bytes(3 * CHUNK), 4)
    assert len(cv) == 32 and cv != b3_node_cv(bytes(3 * CHUNK), 0)
    assert b3_node_cv(memoryview(bytes(CHUNK)), (1 << 64) - 1) != b3_node_cv(bytes(CHUNK), 0)
