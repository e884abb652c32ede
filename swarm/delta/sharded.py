"""Sharded publishing: the ranks of an FSDP2 job extract, encode and hash their own shards.

Each rank holds, of each parameter, a run of whole rows of the full tensor (FSDP2's
``Shard(0)``, possibly over several mesh dimensions) or a replica (``Replicate``; only the
replica at mesh coordinate 0 takes part). Every rank keeps the previous version of its own
shards in the inference dtype, finds and encodes its own changes in the coordinates of the
full tensors (tensor index and global element offset, the codec's own), and hashes the state
pieces it holds. A piece that straddles two ranks is summarised by each side as the BLAKE3
chaining values of the tree nodes it holds whole (:mod:`swarm.content.piecetree`).

What crosses the process group: chunk ids and sizes, piece digests, those summaries (a few
hundred bytes per straddling piece, plus the bytes of at most two 1 KiB BLAKE3 chunks where a
shard boundary is not 1 KiB aligned) and the signed manifest. Never the tensors. The root rank
merges the piece digests into the state root an unsharded publish of the same full state
gives, bit for bit, and signs one manifest listing every rank's chunks, in rank order; each
rank keeps the bytes of its own chunks (:attr:`ShardedVersion.chunks`).

A rank that fails mid-publish fails the collective: :meth:`ShardedPublisher.publish` raises
:class:`ShardedPublishError` on the ranks that survive it, nothing is signed, and the previous
version stays the base. A restarted job starts again from its checkpoint with
:meth:`ShardedPublisher.start`, which checks the root against the last announced one.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import blake3
import torch
import torch.distributed as dist

from swarm.content import piecetree
from swarm.content.layout import StateLayout, TensorSpec
from swarm.content.manifest import Manifest, SignedManifest
from swarm.content.pieces import (
    DEFAULT_PIECE_SIZE,
    check_piece_size,
    piece_slices,
    state_root,
)
from swarm.delta.codec import CODEC_NAME, SEGMENT_ELEMS, EncodedSegment, encode_segment
from swarm.delta.dtypes import BIT_FORMATS, bits_view, dtype_name
from swarm.delta.pipeline import ChunkAssembler
from swarm.errors import IntegrityError, LocalProtocolError, SwarmError
from swarm.identity import Identity, public_key_from_peer_id

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShardedPublishError(SwarmError):
    """A collective of the publish failed (a rank died or timed out): nothing was signed."""


@dataclass(frozen=True, slots=True)
class LocalShard:
    """The part of one tensor of the state this rank holds and publishes."""

    index: int
    """Its tensor's index in the state layout."""
    name: str
    start: int
    """Element offset of the part in the full tensor (flat, row-major)."""
    tensor: torch.Tensor
    """The local part (any dtype and device; converted when published)."""


def local_shards(state: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 group: dist.ProcessGroup | None = None) -> tuple[StateLayout, list[LocalShard]]:
    """The layout of the full state in ``dtype`` and the parts of it this rank publishes.

    ``state`` maps names to DTensors (an FSDP2 model's ``state_dict()``) or to plain
    tensors (taken as replicated: rank 0 of ``group`` publishes them).

    :raises LocalProtocolError: a placement other than ``Shard(0)`` and ``Replicate``,
        naming the parameter and its placement.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rank = dist.get_rank(group)
    specs = []
    shards = []
    for i, (name, t) in enumerate(state.items()):
        shape = tuple(int(d) for d in t.shape)
        specs.append(TensorSpec(name, dtype_name(torch.empty(0, dtype=dtype)), shape))
        if not isinstance(t, DTensor):
            if rank == 0:
                shards.append(LocalShard(i, name, 0, t.detach()))
            continue
        for p in t.placements:
            if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
                raise LocalProtocolError(
                    f"{name}: placement {p} is not supported by the sharded publisher "
                    f"(placements {tuple(t.placements)}; Shard(0) and Replicate only)")
        coord = t.device_mesh.get_coordinate()
        if coord is None or any(c != 0 for c, p in zip(coord, t.placements, strict=True)
                                if isinstance(p, Replicate)):
            continue
        local = t.to_local().detach()
        if local.numel() == 0:
            continue
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                          t.placements)
        row = 1
        for d in shape[1:]:
            row *= d
        shards.append(LocalShard(i, name, int(offset[0]) * row if shape else 0, local))
    return StateLayout(tuple(specs)), shards


@dataclass(frozen=True, slots=True)
class ShardedVersion:
    """What one :meth:`ShardedPublisher.publish` (or ``start``) did on this rank."""

    step: int
    root: bytes
    manifest: SignedManifest | None
    """The signed delta (None for ``start``)."""
    chunks: dict[int, bytes]
    """This rank's chunks, by index in the manifest: the ones it seeds."""
    pieces: tuple[tuple[bytes, int], ...]
    """The full state's pieces (id, size), in order, on the root rank: the chunks of a
    keyframe of this version, which any peer holding the version serves; empty on the
    other ranks."""
    changes: int
    """Elements this rank found changed."""
    group_bytes: int
    """Bytes this rank sent over the process group (pickled collectives)."""
    seconds: float
    layout_digest: bytes
    """The full state's layout digest and piece size (those of its keyframes)."""
    piece_size: int


class ShardedPublisher:
    """One per rank of the job; every method is a collective over ``group``."""

    def __init__(self, run: str, *, identity: Identity | None = None,
                 group: dist.ProcessGroup | None = None, root_rank: int = 0,
                 dtype: torch.dtype = torch.bfloat16, piece_size: int = DEFAULT_PIECE_SIZE,
                 chunk_target: int = 2 << 20, keep_versions: int = 16,
                 threads: int | None = None, seeder: str | None = None) -> None:
        """``identity``: the run's key, needed on ``root_rank`` (a rank of ``group``)
        only: it signs. ``seeder``: the peer id of the node that seeds this rank's chunks
        (a :class:`~swarm.roles.seeder.SeederNode`; on the root rank, the trainer's own
        node, which needs no listing); the manifests authorize every other rank's."""
        check_piece_size(piece_size)
        self.run = run
        self.group = group
        self.root_rank = root_rank
        self.rank = dist.get_rank(group)
        if self.rank == root_rank and identity is None:
            raise LocalProtocolError("the root rank signs the manifests: it needs the "
                                     "run's identity")
        self.identity = identity
        self.dtype = dtype
        self.piece_size = piece_size
        self.chunk_target = chunk_target
        self.keep_versions = keep_versions
        self.threads = threads or os.cpu_count() or 1
        self.seeder = None if seeder is None else public_key_from_peer_id(seeder)
        self._seeders: tuple[bytes, ...] = ()
        self.step = -1
        self.root: bytes | None = None
        self._layout: StateLayout | None = None
        self._prev: list[tuple[LocalShard, torch.Tensor]] = []

    # -- collectives -------------------------------------------------------------------
    def start(self, state: Mapping[str, torch.Tensor], step: int = 0, *,
              expect_root: bytes | None = None) -> ShardedVersion:
        """Take ``state`` as version ``step`` (the run card's version 0, or the version a
        restarted job resumes from); returns its root.

        :raises IntegrityError: ``expect_root`` (the last announced root) differs: the
            state is not the version peers hold.
        """
        t0 = time.monotonic()
        layout, shards, snaps = self._snapshot(state)
        keys = self._gather(self.seeder, step)
        if keys is not None:
            own = self.identity.public_key if self.identity is not None else None
            self._seeders = tuple(dict.fromkeys(
                k for r, k in enumerate(keys)
                if k is not None and k != own and r != self.root_rank))
        pieces = self._pieces(layout, shards, snaps)
        gathered = self._gather(pieces, step)
        ids: list[bytes] = []

        def merge() -> bytes:
            assert gathered is not None
            ids.extend(self._merge_ids(layout, gathered))
            return state_root(layout, ids, self.piece_size)

        root = self._from_root(merge, step)
        sent = _pickled(self.seeder) + _pickled(pieces) + \
            (_pickled(root) if self.rank == self.root_rank else 0)
        if expect_root is not None and root != expect_root:
            raise IntegrityError(f"the state's root is not the announced root of step {step}: "
                                 f"it is not the version peers hold")
        self._take(layout, shards, snaps, step, root)
        return ShardedVersion(step, root, None, {}, _sized(layout, ids, self.piece_size), 0,
                              sent, time.monotonic() - t0, layout.digest, self.piece_size)

    def publish(self, state: Mapping[str, torch.Tensor], *,
                time_ms: int = 0) -> ShardedVersion:
        """Encode the changes since the last version and sign them as the next step.

        :raises ShardedPublishError: a rank failed mid-publish; the version is not signed
            and the previous one stays the base.
        """
        if self._layout is None or self.root is None:
            raise LocalProtocolError("call start() with the version peers hold first")
        t0 = time.monotonic()
        step = self.step + 1
        layout, shards, snaps = self._snapshot(state)
        if layout != self._layout or [s.index for s in shards] != \
                [s.index for s, _ in self._prev]:
            raise LocalProtocolError("the state's layout or sharding changed since the last "
                                     "version: start() again")
        chunks = self._encode(layout, [old for _, old in self._prev], shards, snaps)
        mine = [(c.cid, len(c.data)) for c in chunks]
        sent = 0
        pieces = self._pieces(layout, shards, snaps)
        payload = [mine, pieces]
        gathered = self._gather(payload, step)
        sent += _pickled(payload)

        ids: list[bytes] = []

        def sign() -> list[Any]:
            assert gathered is not None and self.identity is not None
            ids.extend(self._merge_ids(layout, [g[1] for g in gathered]))
            root = state_root(layout, ids, self.piece_size)
            offsets = [0]
            for g in gathered:
                offsets.append(offsets[-1] + len(g[0]))
            sm = Manifest(run=self.run, step=step, kind="delta", base_root=self.root,
                          target_root=root, layout_digest=layout.digest, codec=CODEC_NAME,
                          piece_size=self.piece_size,
                          chunks=tuple(tuple(c) for g in gathered for c in g[0]),
                          keep_versions=self.keep_versions, time_ms=time_ms,
                          seeders=self._seeders).sign(self.identity)
            return [sm.encode(), offsets]

        data, offsets = self._from_root(sign, step)
        if self.rank == self.root_rank:
            sent += _pickled([data, offsets])
        sm = SignedManifest.decode(data)
        first = offsets[self.rank]
        own = {first + i: c.data for i, c in enumerate(chunks)}
        for i, c in enumerate(chunks):
            if sm.manifest.chunks[first + i] != (c.cid, len(c.data)):
                raise IntegrityError(f"rank {self.rank}: chunk {i} is not where the manifest "
                                     f"lists it")
        root = sm.manifest.target_root
        self._take(layout, shards, snaps, step, root)
        return ShardedVersion(step, root, sm, own, _sized(layout, ids, self.piece_size),
                              sum(c.changes for c in chunks), sent, time.monotonic() - t0,
                              layout.digest, self.piece_size)

    # -- this rank's part --------------------------------------------------------------
    def _snapshot(self, state: Mapping[str, torch.Tensor]
                  ) -> tuple[StateLayout, list[LocalShard], list[torch.Tensor]]:
        layout, shards = local_shards(state, self.dtype, self.group)
        snaps = [s.tensor.to(device="cpu", dtype=self.dtype, copy=True).contiguous().view(-1)
                 for s in shards]
        return layout, shards, snaps

    def _take(self, layout: StateLayout, shards: list[LocalShard],
              snaps: list[torch.Tensor], step: int, root: bytes) -> None:
        self._layout, self.step, self.root = layout, step, root
        self._prev = list(zip(shards, snaps, strict=True))

    def _encode(self, layout: StateLayout, old: Sequence[torch.Tensor],
                shards: Sequence[LocalShard], new: Sequence[torch.Tensor]
                ) -> list[Any]:
        jobs = []
        for s, a, b in zip(shards, old, new, strict=True):
            fmt = BIT_FORMATS[layout.tensors[s.index].dtype]
            va, vb = bits_view(a, s.name), bits_view(b, s.name)
            for off in range(0, b.numel(), SEGMENT_ELEMS):
                end = min(b.numel(), off + SEGMENT_ELEMS)
                jobs.append((va[off:end], vb[off:end], fmt, s.index, s.start + off))

        def one(job: tuple[Any, ...]) -> EncodedSegment | None:
            return encode_segment(*job)

        asm = ChunkAssembler(layout, self.chunk_target)
        out = []
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for seg in pool.map(one, jobs):
                out += asm.add(seg)
        last = asm.flush()
        return out + ([last] if last is not None else [])

    def _pieces(self, layout: StateLayout, shards: Sequence[LocalShard],
                snaps: Sequence[torch.Tensor]) -> list[list[Any]]:
        """``[tensor, piece, digest]`` of the pieces held whole, ``[tensor, piece, part]``
        (a :class:`~swarm.content.piecetree.PiecePart` on the wire) of the others."""
        size = self.piece_size
        jobs = []
        for s, snap in zip(shards, snaps, strict=True):
            spec = layout.tensors[s.index]
            raw = snap.view(torch.uint8).numpy().data.cast("B")
            lo = s.start * spec.itemsize
            hi = lo + raw.nbytes
            for k in range(lo // size, -(-hi // size)):
                p0, p1 = k * size, min((k + 1) * size, spec.nbytes)
                a, b = max(lo, p0), min(hi, p1)
                jobs.append((s.index, k, raw[a - lo:b - lo], a - p0, p1 - p0))

        def one(job: tuple[int, int, memoryview, int, int]) -> list[Any]:
            index, k, view, at, n = job
            if at == 0 and view.nbytes == n:
                return [index, k, blake3.blake3(view).digest()]
            return [index, k, piecetree.summarise(view, at, n).to_wire()]

        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            return list(pool.map(one, jobs))

    # -- the root rank -----------------------------------------------------------------
    def _merge_ids(self, layout: StateLayout, by_rank: Sequence[Sequence[list[Any]]]
                   ) -> list[bytes]:
        """Every piece id of the state, in order, from the ranks' digests and summaries."""
        size = self.piece_size
        whole: dict[tuple[int, int], bytes] = {}
        parts: dict[tuple[int, int], list[piecetree.PiecePart]] = {}
        for rows in by_rank:
            for index, k, what in rows:
                if isinstance(what, bytes):
                    whole[(index, k)] = what
                    continue
                try:
                    part = piecetree.PiecePart.from_wire(what)
                except ValueError as exc:
                    raise LocalProtocolError(f"{layout.tensors[index].name}: piece {k}: a "
                                             f"rank sent a bad summary: {exc}") from exc
                parts.setdefault((index, k), []).append(part)
        ids = []
        for i, spec in enumerate(layout.tensors):
            for k in range(-(-spec.nbytes // size)):
                key = (i, k)
                if key in whole:
                    ids.append(whole[key])
                    continue
                if key not in parts:
                    raise LocalProtocolError(
                        f"{spec.name}: piece {k} is held by no rank (is every tensor "
                        f"sharded Shard(0) or replicated over this process group?)")
                n = min(size, spec.nbytes - k * size)
                try:
                    ids.append(piecetree.merge(n, parts[key]))
                except ValueError as exc:
                    raise LocalProtocolError(f"{spec.name}: piece {k}: {exc}") from exc
        return ids

    def _gather(self, obj: object, step: int) -> list[Any] | None:
        out: list[Any] | None = None
        if self.rank == self.root_rank:
            out = [None] * dist.get_world_size(self.group)
        try:
            dist.gather_object(obj, out, group=self.group, group_dst=self.root_rank)
        except (RuntimeError, ValueError) as exc:  # gloo and NCCL errors are RuntimeErrors
            raise ShardedPublishError(f"step {step} was not published: a rank failed "
                                      f"mid-publish ({exc})") from exc
        return out

    def _from_root(self, work: Callable[[], T], step: int) -> T:
        """``work()`` on the root rank, its result on every rank; an error on the root is
        raised on every rank (none is left waiting in the broadcast)."""
        box: list[Any] = [None]
        failed: SwarmError | None = None
        if self.rank == self.root_rank:
            try:
                box = [("ok", work())]
            except SwarmError as exc:
                failed = exc
                box = [("error", str(exc))]
        try:
            dist.broadcast_object_list(box, group=self.group, group_src=self.root_rank)
        except (RuntimeError, ValueError) as exc:
            raise ShardedPublishError(f"step {step} was not published: a rank failed "
                                      f"mid-publish ({exc})") from exc
        if failed is not None:
            raise failed
        status, value = box[0]
        if status != "ok":
            raise LocalProtocolError(f"step {step} was not published: the root rank "
                                     f"failed: {value}")
        return value  # type: ignore[no-any-return]


def _sized(layout: StateLayout, ids: Sequence[bytes], piece_size: int
           ) -> tuple[tuple[bytes, int], ...]:
    if not ids:
        return ()
    return tuple((cid, n) for cid, (_, _, n) in zip(ids, piece_slices(layout, piece_size),
                                                   strict=True))


def _pickled(obj: object) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
