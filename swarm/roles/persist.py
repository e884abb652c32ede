"""Saved states of the roles: a verified state with the signed manifests that vouch for it.

One file holds everything a node resumes from, written atomically (temporary file in the
same directory, fsync, rename, fsync of the directory), so a killed process leaves either
the previous file or the new one, never a half-written state::

    b"SWARMST1" | u32 header length (big endian) | header | raw tensor bytes

The header is canonical msgpack ``{"v": 1, "layout": <layout bytes>, "manifests":
[<signed manifest bytes>, ...]}``; the last manifest is the one whose ``target_root`` the
state hashes to. Loading checks every manifest's signature against the trainer's key, the
run, the layout and size, and recomputes the root: a saved state is only ever trusted as
far as the trainer signed it.

The roles keep such a file as the base of a :class:`~swarm.roles.statelog.StateLog`: the
versions that follow it are appended to a journal beside it, delta by delta, and folded
into a new base now and then.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.content.layout import MAX_LAYOUT_BYTES, StateLayout
from swarm.content.manifest import MAX_MANIFEST_BYTES, SignedManifest
from swarm.delta.state import byte_views, layout_of, state_root_of
from swarm.errors import DecodeError, IntegrityError, StoreError
from swarm.wire import strict

log = logging.getLogger(__name__)

MAGIC = b"SWARMST1"
MAX_HEADER_BYTES = 64 << 20
MAX_SAVED_MANIFESTS = 1024
_LEN = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class SavedState:
    """What :func:`load_state` restored."""

    state: dict[str, torch.Tensor]
    manifests: tuple[SignedManifest, ...]
    """Oldest first; the last one vouches for ``state``."""

    @property
    def manifest(self) -> SignedManifest:
        return self.manifests[-1]

    @property
    def step(self) -> int:
        return self.manifest.manifest.step

    @property
    def root(self) -> bytes:
        return self.manifest.manifest.target_root


def write_atomic(path: Path, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write ``parts`` to ``path`` through a temporary file, fsync and rename.

    :raises StoreError: the file could not be written.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write {path}: {exc}") from exc


def save_state(path: Path, state: Mapping[str, torch.Tensor],
               manifests: Sequence[SignedManifest]) -> int:
    """Atomically save ``state`` with the manifests that vouch for it (last: its own);
    returns the bytes written.

    :raises StoreError: the file could not be written.
    """
    if not manifests:
        raise ValueError("a saved state needs the manifest of its version")
    header = strict.pack({"v": 1, "layout": layout_of(state).encode(),
                          "manifests": [m.encode() for m in manifests]})
    if len(header) > MAX_HEADER_BYTES:
        raise StoreError(f"state header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    parts: list[bytes | memoryview] = [MAGIC, _LEN.pack(len(header)), header]
    parts.extend(v.data for v in byte_views(state))
    write_atomic(path, parts)
    return sum(memoryview(p).nbytes for p in parts)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"saved state: dtype {name!r} unknown to this torch")
    return dtype


def load_state(path: Path, *, trusted_signer: bytes, run: str,
               layout: StateLayout | None = None) -> SavedState | None:
    """Load and check a saved state; ``None`` when there is none.

    ``layout``, when given, is the layout the caller's model has: anything else is refused.

    :raises StoreError: the file cannot be read.
    :raises DecodeError: the file is malformed or truncated.
    :raises SignatureError: a manifest is not signed by ``trusted_signer``.
    :raises IntegrityError: wrong run, wrong layout, or the state does not hash to the root
        its manifest signs.
    """
    saved = read_state(path, trusted_signer=trusted_signer, run=run, layout=layout)
    if saved is not None:
        check_root(saved)
    return saved


def check_root(saved: SavedState) -> None:
    """:raises IntegrityError: ``saved.state`` does not hash to its manifest's root."""
    m = saved.manifest.manifest
    if state_root_of(saved.state, m.piece_size) != m.target_root:
        raise IntegrityError(f"saved state does not hash to the root of step {m.step}")


def read_state(path: Path, *, trusted_signer: bytes, run: str,
               layout: StateLayout | None = None) -> SavedState | None:
    """:func:`load_state` without the root check (the caller hashes the state once, after
    it replayed a journal on top: :mod:`swarm.roles.statelog`).

    :raises StoreError: the file cannot be read.
    :raises DecodeError: the file is malformed or truncated.
    :raises SignatureError: a manifest is not signed by ``trusted_signer``.
    :raises IntegrityError: wrong run or wrong layout.
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below, sized reads
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot open {path}: {exc}") from exc
    with fh:
        try:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(len(MAGIC) + _LEN.size)
            if len(head) != len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
                raise DecodeError("saved state: bad magic (not a state file)")
            (hlen,) = _LEN.unpack(head[len(MAGIC):])
            if hlen > MAX_HEADER_BYTES or len(head) + hlen > size:
                raise DecodeError(f"saved state: header of {hlen} bytes does not fit")
            header = fh.read(hlen)
            saved = _decode_header(header, trusted_signer=trusted_signer, run=run)
            file_layout, manifests = saved
            if layout is not None and file_layout != layout:
                raise IntegrityError("saved state: its layout is not this model's")
            if file_layout.digest != manifests[-1].manifest.layout_digest:
                raise IntegrityError("saved state: layout does not match its manifest")
            if size - len(head) - hlen != file_layout.nbytes:
                raise DecodeError(f"saved state: {size - len(head) - hlen} tensor bytes, "
                                  f"layout needs {file_layout.nbytes}")
            state: dict[str, torch.Tensor] = {}
            for spec in file_layout:
                raw = bytearray(spec.nbytes)
                if fh.readinto(raw) != spec.nbytes:
                    raise DecodeError("saved state: truncated tensor bytes")
                flat = torch.frombuffer(raw, dtype=torch.uint8) if spec.nbytes else \
                    torch.empty(0, dtype=torch.uint8)
                state[spec.name] = flat.view(_torch_dtype(spec.dtype)).reshape(spec.shape)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
    return SavedState(state, manifests)


def _decode_header(data: bytes, *, trusted_signer: bytes, run: str
                   ) -> tuple[StateLayout, tuple[SignedManifest, ...]]:
    obj = strict.unpack(data, max_bytes=MAX_HEADER_BYTES,
                        max_bin=max(MAX_LAYOUT_BYTES, MAX_MANIFEST_BYTES),
                        max_array=MAX_SAVED_MANIFESTS, max_map=3, max_str=16)
    h = strict.as_map(obj, frozenset({"v", "layout", "manifests"}), "saved state")
    strict.get_int(h, "v", 1, 1)
    layout = StateLayout.decode(strict.get_bytes(h, "layout", max_len=MAX_LAYOUT_BYTES))
    raw = strict.get_list(h, "manifests", MAX_SAVED_MANIFESTS)
    if not raw or any(type(x) is not bytes for x in raw):
        raise DecodeError("saved state: manifests is a non-empty list of bytes")
    manifests = tuple(SignedManifest.decode(x, trusted_signer=trusted_signer) for x in raw)
    steps = [sm.manifest.step for sm in manifests]
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise DecodeError("saved state: manifests are not in step order")
    if any(sm.manifest.run != run for sm in manifests):
        raise IntegrityError("saved state: a manifest of another run")
    return layout, manifests


def discard(path: Path, reason: str) -> None:
    """Move a refused state file aside (kept once for inspection) and say why."""
    log.warning("discarding saved state %s: %s; starting from the swarm instead", path, reason)
    try:
        os.replace(path, path.with_name(path.name + ".bad"))
    except OSError as exc:
        log.warning("could not move %s aside: %s", path, exc)

