"""States as content: layouts, state roots over every core, pieces, keyframes.

A state is an ordered ``dict[str, torch.Tensor]`` of contiguous CPU tensors (state_dict
order). Its root is :func:`swarm.content.pieces.state_root` over the raw bytes, so any
peer holding the state can compute every piece id and serve any piece.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from swarm.content.ids import chunk_id
from swarm.content.layout import StateLayout, TensorSpec
from swarm.content.manifest import Manifest, SignedManifest
from swarm.content.pieces import DEFAULT_PIECE_SIZE, piece_ids_of, piece_slices, state_root
from swarm.delta.dtypes import byte_view, dtype_name
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError
from swarm.identity import Identity

log = logging.getLogger(__name__)

KEYFRAME_CODEC = "pieces"


def layout_of(state: Mapping[str, torch.Tensor]) -> StateLayout:
    """The layout (names, dtype names, shapes) of a state, in its order."""
    return StateLayout(tuple(
        TensorSpec(name, dtype_name(t), tuple(int(d) for d in t.shape))
        for name, t in state.items()
    ))


def byte_views(state: Mapping[str, torch.Tensor]) -> list[np.ndarray]:
    """uint8 views of every tensor's raw bytes (no copies)."""
    return [byte_view(t, name) for name, t in state.items()]


def piece_ids_of_state(state: Mapping[str, torch.Tensor],
                       piece_size: int = DEFAULT_PIECE_SIZE,
                       threads: int | None = None) -> list[bytes]:
    """BLAKE3 ids of every piece of the state, hashed on every core.

    Tensors on another device (a GPU) are copied to the host one at a time to be hashed.
    """
    return _piece_ids(state, layout_of(state), piece_size, threads)


def _piece_ids(state: Mapping[str, torch.Tensor], layout: StateLayout, piece_size: int,
               threads: int | None) -> list[bytes]:
    if all(t.device.type == "cpu" for t in state.values()):
        views = [v.data for v in byte_views(state)]
        return piece_ids_of(views, layout, piece_size, threads=threads)
    ids: list[bytes] = []
    for spec, (name, t) in zip(layout, state.items(), strict=True):
        host = t if t.device.type == "cpu" else t.detach().cpu()
        ids += piece_ids_of([byte_view(host, name).data], StateLayout((spec,)), piece_size,
                            threads=threads)
    return ids


def state_root_of(state: Mapping[str, torch.Tensor], piece_size: int = DEFAULT_PIECE_SIZE,
                  threads: int | None = None) -> bytes:
    """The state root (equal to ``state_root`` over the raw bytes), hashed on every core."""
    layout = layout_of(state)
    return state_root(layout, _piece_ids(state, layout, piece_size, threads), piece_size)


def piece_views(state: Mapping[str, torch.Tensor], piece_size: int = DEFAULT_PIECE_SIZE
                ) -> dict[int, memoryview]:
    """Every piece of a CPU state as a read-only view of its bytes, by index: no copy, so
    a node serves a state it holds without a second copy of it. The views read the
    tensors as they are when read: withdraw them before writing to the state."""
    views = [v.data.toreadonly() for v in byte_views(state)]
    return {i: views[t][off:off + n]
            for i, (t, off, n) in enumerate(piece_slices(layout_of(state), piece_size))}


def keyframe_manifest(state: Mapping[str, torch.Tensor], identity: Identity, run: str,
                      step: int, *, piece_size: int = DEFAULT_PIECE_SIZE, time_ms: int = 0,
                      keep_versions: int = 8) -> SignedManifest:
    """A signed ``kind="keyframe"`` manifest whose chunks are the state's pieces.

    Chunk ``i`` is piece ``i`` of :func:`swarm.content.pieces.piece_slices`; serve it with
    :func:`piece_views`.
    """
    layout = layout_of(state)
    ids = piece_ids_of_state(state, piece_size)
    slices = piece_slices(layout, piece_size)
    pieces = tuple((cid, n) for cid, (_, _, n) in zip(ids, slices, strict=True))
    return pieces_keyframe(pieces, state_root(layout, ids, piece_size), layout.digest,
                           identity, run, step, piece_size=piece_size, time_ms=time_ms,
                           keep_versions=keep_versions)


def pieces_keyframe(pieces: tuple[tuple[bytes, int], ...], root: bytes, layout_digest: bytes,
                    identity: Identity, run: str, step: int, *, piece_size: int,
                    time_ms: int = 0, keep_versions: int = 8) -> SignedManifest:
    """A signed keyframe manifest of a state known by its pieces (id, size), in order, and
    its root: whoever holds the state serves them."""
    return Manifest(run=run, step=step, kind="keyframe", base_root=None, target_root=root,
                    layout_digest=layout_digest, codec=KEYFRAME_CODEC, piece_size=piece_size,
                    chunks=pieces, keep_versions=keep_versions, time_ms=time_ms
                    ).sign(identity)


class KeyframeFiller:
    """Fills a state of the right layout from verified keyframe pieces (late joiners).

    Pieces may arrive in any order; each is checked against its id in the manifest before
    it is written. :meth:`finish` recomputes the root and compares it with the manifest.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], signed: SignedManifest) -> None:
        m = signed.manifest
        if m.kind != "keyframe":
            raise LocalProtocolError("KeyframeFiller needs a keyframe manifest")
        self._state = state
        self._layout = layout_of(state)
        if self._layout.digest != m.layout_digest:
            raise IntegrityError("the state's layout does not match the keyframe manifest")
        self._slices = piece_slices(self._layout, m.piece_size)
        if len(self._slices) != len(m.chunks):
            raise IntegrityError("keyframe manifest piece count does not match its layout")
        for (_, _, n), (_, size) in zip(self._slices, m.chunks, strict=True):
            if n != size:
                raise IntegrityError("keyframe manifest piece sizes do not match its layout")
        self._manifest = m
        self._views = byte_views(state)
        self._missing = set(range(len(self._slices)))

    @property
    def missing(self) -> frozenset[int]:
        """Piece indices not yet written."""
        return frozenset(self._missing)

    def put_piece(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Verify piece ``index`` against its id and write it.

        :raises IntegrityError: the bytes do not hash to the manifest's id.
        :raises DecodeError: wrong index or length.
        """
        if not 0 <= index < len(self._slices):
            raise DecodeError(f"piece index {index} outside the keyframe")
        tensor, offset, length = self._slices[index]
        if len(data) != length:
            raise DecodeError(f"piece {index} has {len(data)} bytes, expected {length}")
        if chunk_id(data) != self._manifest.chunks[index][0]:
            raise IntegrityError(f"piece {index} does not match its id")
        self._views[tensor][offset:offset + length] = np.frombuffer(data, np.uint8)
        self._missing.discard(index)

    def finish(self) -> bytes:
        """Check the filled state against the target root; returns it.

        :raises LocalProtocolError: pieces are missing.
        :raises IntegrityError: the root does not match.
        """
        if self._missing:
            raise LocalProtocolError(f"{len(self._missing)} pieces still missing")
        root = state_root_of(self._state, self._manifest.piece_size)
        if root != self._manifest.target_root:
            raise IntegrityError("filled state does not hash to the keyframe's root")
        return root
