"""Pieces and state roots.

A piece is a fixed-size slice of one tensor's raw bytes (the last piece of a tensor may be
shorter; an empty tensor has none). The state root hashes the layout digest, the piece
size and every piece id in order, so any peer holding the state can compute and serve
every piece, and a receiver can check a whole state against one signed 32-byte root.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from swarm.content.ids import DIGEST_LEN, chunk_id, domain_hash
from swarm.content.layout import StateLayout, TensorSpec

DEFAULT_PIECE_SIZE = 4 << 20
MIN_PIECE_SIZE = 1 << 12
MAX_PIECE_SIZE = 64 << 20

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


def check_piece_size(piece_size: int) -> None:
    if not MIN_PIECE_SIZE <= piece_size <= MAX_PIECE_SIZE or piece_size & (piece_size - 1):
        raise ValueError(
            f"piece size must be a power of two in [{MIN_PIECE_SIZE}, {MAX_PIECE_SIZE}]"
        )


def piece_count(spec: TensorSpec, piece_size: int) -> int:
    return -(-spec.nbytes // piece_size)


def piece_slices(layout: StateLayout, piece_size: int) -> list[tuple[int, int, int]]:
    """(tensor index, byte offset, length) of every piece in state order."""
    check_piece_size(piece_size)
    out = []
    for i, spec in enumerate(layout):
        for off in range(0, spec.nbytes, piece_size):
            out.append((i, off, min(piece_size, spec.nbytes - off)))
    return out


def piece_ids_of(
    buffers: Sequence[Buffer],
    layout: StateLayout,
    piece_size: int = DEFAULT_PIECE_SIZE,
    *,
    threads: int | None = None,
) -> list[bytes]:
    """BLAKE3 ids of every piece, hashed on ``threads`` threads (default: all cores).

    ``buffers[i]`` holds the raw bytes of ``layout.tensors[i]``.
    """
    if len(buffers) != len(layout):
        raise ValueError("one buffer per tensor of the layout is required")
    views = []
    for spec, buf in zip(layout, buffers, strict=True):
        view = memoryview(buf).cast("B")
        if view.nbytes != spec.nbytes:
            raise ValueError(f"{spec.name}: buffer has {view.nbytes} bytes, layout says "
                             f"{spec.nbytes}")
        views.append(view)
    slices = piece_slices(layout, piece_size)
    jobs = [views[i][off:off + n] for i, off, n in slices]
    workers = threads or os.cpu_count() or 1
    if workers <= 1 or len(jobs) <= 1:
        return [chunk_id(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        runs = pool.map(_hash_pieces,
                        balanced_runs(jobs, [j.nbytes for j in jobs], 2 * workers))
        return [cid for run in runs for cid in run]


def balanced_runs(items: Sequence[T], weights: Sequence[int], parts: int) -> list[list[T]]:
    """``items`` cut into at most ``parts`` consecutive runs of about equal weight: a
    task per run, not per item, where dispatching a task costs as much as a small item
    (pieces of small tensors, segments of a delta)."""
    total = sum(weights)
    out: list[list[T]] = [[]]
    done = 0
    for item, w in zip(items, weights, strict=True):
        if out[-1] and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(item)
        done += w
    return out


def _hash_pieces(views: list[memoryview]) -> list[bytes]:
    import blake3

    return [bytes(blake3.blake3(v).digest()) for v in views]


def state_root(layout: StateLayout, piece_ids: Iterable[bytes],
               piece_size: int = DEFAULT_PIECE_SIZE) -> bytes:
    """The 32-byte root over the layout digest, piece size and ordered piece ids."""
    check_piece_size(piece_size)
    ids = list(piece_ids)
    if len(ids) != len(piece_slices(layout, piece_size)):
        raise ValueError("piece id count does not match the layout")
    if any(len(i) != DIGEST_LEN for i in ids):
        raise ValueError("piece ids are 32 bytes")
    return domain_hash("swarm/state/v1", layout.digest, piece_size.to_bytes(8, "little"),
                       b"".join(ids))
