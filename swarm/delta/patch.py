"""Patching a state with a signed delta: verify base, apply chunks as they arrive, verify
target, revert everything on mismatch."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor

import torch

from swarm.content.ids import chunk_id, hex_id
from swarm.content.manifest import SignedManifest
from swarm.delta.codec import (
    CODEC_NAME,
    AppliedChunk,
    apply_verified_chunk,
    revert_decoded,
    state_views,
)
from swarm.delta.state import layout_of, state_root_of
from swarm.errors import IntegrityError, LocalProtocolError

log = logging.getLogger(__name__)


class Patcher:
    """Applies one signed delta to a state in place, chunk by chunk, in any order.

    Construction refuses a state whose layout or root is not the manifest's base (before
    any write). :meth:`apply` checks a chunk's id against the signed manifest, then decodes
    it and writes each change as it is placed (one pass over the state); a chunk that still
    does not fit (a bad delta the trainer signed) has its writes undone before the error.
    :meth:`finish` recomputes the state root; on mismatch every applied chunk is reverted
    and :class:`IntegrityError` is raised.

    Methods are CPU-bound (milliseconds per MiB of chunk, a hash of the whole state in
    :meth:`finish`) and not thread-safe: async callers run them one at a time in a worker
    thread (``asyncio.to_thread``).
    """

    def __init__(self, state: Mapping[str, torch.Tensor], signed: SignedManifest, *,
                 current_root: bytes | None = None, executor: Executor | None = None,
                 engine: str = "auto") -> None:
        """``current_root`` skips hashing when the caller knows the state's root;
        ``executor`` decodes a chunk's segments in parallel; ``engine`` is where ranks
        become positions and changes are written: ``"c"`` (CPU states), ``"torch"`` (torch
        ops on the state's device) or ``"auto"`` (C on the CPU, torch elsewhere).

        :raises IntegrityError: wrong layout or base root.
        :raises LocalProtocolError: not a delta manifest of this codec."""
        m = signed.manifest
        if m.kind != "delta" or m.codec != CODEC_NAME:
            raise LocalProtocolError(f"Patcher needs a {CODEC_NAME} delta manifest, got "
                                     f"{m.kind}/{m.codec}")
        self._layout = layout_of(state)
        if self._layout.digest != m.layout_digest:
            raise IntegrityError("the state's layout is not the delta's layout")
        root = current_root if current_root is not None else state_root_of(state, m.piece_size)
        if root != m.base_root:
            raise IntegrityError(f"state root {hex_id(root, True)} is not the delta's base "
                                 f"{hex_id(m.base_root or b'', True)}")
        self._state = state
        self._manifest = m
        self._views = state_views(state, self._layout, engine)
        self._sizes = dict(m.chunks)
        self._applied: list[AppliedChunk] = []
        self._done: set[bytes] = set()
        self._changed: set[str] = set()
        self._closed = False
        self._executor = executor

    @property
    def missing(self) -> frozenset[bytes]:
        """Chunk ids of the manifest not applied yet."""
        return frozenset(self._sizes) - self._done

    @property
    def changed(self) -> frozenset[str]:
        """Names of tensors changed by the chunks applied so far."""
        return frozenset(self._changed)

    def apply(self, cid: bytes, data: bytes | bytearray | memoryview) -> frozenset[str]:
        """Verify and apply one chunk; returns the tensor names it changed.

        A chunk already applied is ignored (returns an empty set).

        :raises IntegrityError: the chunk is not in the manifest or does not match its id.
        :raises DecodeError: the chunk does not decode or fit the state (a chunk whose id
            matched can only do that if the trainer signed a bad delta): every change it
            wrote was undone.
        """
        if self._closed:
            raise LocalProtocolError("this patcher is finished")
        size = self._sizes.get(cid)
        if size is None:
            raise IntegrityError(f"chunk {hex_id(cid, True)} is not part of this delta")
        if cid in self._done:
            return frozenset()
        if len(data) != size or chunk_id(data) != cid:
            raise IntegrityError(f"chunk {hex_id(cid, True)} does not match its id")
        decoded = apply_verified_chunk(data, self._layout, self._views, self._executor)
        self._applied.append(decoded)
        self._done.add(cid)
        self._changed |= decoded.tensor_names
        return decoded.tensor_names

    def revert(self) -> None:
        """Undo every applied chunk exactly (newest first); the state is the base again."""
        while self._applied:
            revert_decoded(self._layout, self._views, self._applied.pop(), self._executor)
        self._done.clear()
        self._changed.clear()

    def finish(self) -> frozenset[str]:
        """Check the patched state against the target root; returns the changed names.

        :raises LocalProtocolError: chunks are missing.
        :raises IntegrityError: root mismatch (the state was reverted to the base).
        """
        if self._closed:
            raise LocalProtocolError("this patcher is finished")
        if self.missing:
            raise LocalProtocolError(f"{len(self.missing)} chunks of the delta are missing")
        root = state_root_of(self._state, self._manifest.piece_size)
        if root != self._manifest.target_root:
            log.warning("patched root %s != target %s; reverting", hex_id(root, True),
                        hex_id(self._manifest.target_root, True))
            self.revert()
            raise IntegrityError("patched state does not hash to the delta's target root")
        self._closed = True
        return frozenset(self._changed)
