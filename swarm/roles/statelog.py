"""Incremental saved states: a base checkpoint and an append-only journal of deltas.

Two files side by side (``peer.state`` and ``peer.state.journal``; the same for a
trainer's ``published.state``):

- the base, a full checkpoint of a verified version in :mod:`swarm.roles.persist`'s format,
  written atomically (temporary file, fsync, rename, fsync of the directory);
- the journal, the versions that followed that base, one record each::

      b"SWARMJ01" | u32 header length (big endian) | {"v": 1, "step": s, "root": r}
      record*     = u64 body length | BLAKE3(body) | body
      body        = u32 manifest length | signed delta manifest | its chunks in order

  The header names the base the journal extends (step and root of its newest manifest).
  A record is the delta exactly as the trainer signed it, so a version costs about the
  delta's size on disk (not the state's). Each record is appended, then fsynced.

Loading reads the base (signatures checked, root not yet), replays the records in order
through :class:`~swarm.delta.patch.Patcher` while each is whole (length and checksum),
signed by the trainer, of this run and layout, and chains on the previous version (its
base root is that version's root, its step is later), stops at the first that is not, then
hashes the state once and compares it with the last replayed manifest's target root. On a
mismatch the base is read again and checked alone; if that fails too the state is refused
(the caller moves the files aside and syncs from the swarm).

Crash story (the process killed at any instant; fsynced bytes survive a power loss):

- an append writes beyond the last whole record; a torn record fails its length or
  checksum and is ignored (the next append cuts it away): the previous version loads;
- a compaction (the journal would outgrow ``compact_fraction`` of the state or
  ``max_records``; or a keyframe, or a version that does not chain onto what is on disk)
  first replaces the base atomically, then replaces the journal atomically with an empty
  one naming the new base. Killed before the first rename: old base and journal (the old
  version); between the renames: the new base and a journal naming the old base, which is
  ignored (the new version); after: the new version. Never a mix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import blake3
import torch

from swarm.content.layout import StateLayout
from swarm.content.manifest import MAX_MANIFEST_BYTES, SignedManifest
from swarm.delta.codec import CODEC_NAME
from swarm.delta.patch import Patcher
from swarm.delta.state import layout_of, state_root_of
from swarm.errors import DecodeError, IntegrityError, StoreError, SwarmError
from swarm.roles import persist
from swarm.roles.persist import SavedState
from swarm.wire import strict

log = logging.getLogger(__name__)

JOURNAL_SUFFIX = ".journal"
JOURNAL_MAGIC = b"SWARMJ01"
MAX_JOURNAL_HEADER = 1024
_U32 = struct.Struct(">I")
_REC = struct.Struct(">Q32s")
_THREADED_MIN = 1 << 22

Chunk = bytes | bytearray | memoryview


def journal_path(path: Path) -> Path:
    """The journal next to base file ``path``."""
    return path.with_name(path.name + JOURNAL_SUFFIX)


def encode_header(step: int, root: bytes) -> bytes:
    """The journal's header: it extends the base whose newest version is (step, root)."""
    header = strict.pack({"v": 1, "step": step, "root": root})
    return JOURNAL_MAGIC + _U32.pack(len(header)) + header


def read_header(fh: BinaryIO) -> tuple[int, bytes, int]:
    """(base step, base root, offset of the first record) of an open journal.

    :raises DecodeError: not a journal, or a malformed header.
    """
    head = fh.read(len(JOURNAL_MAGIC) + _U32.size)
    if len(head) != len(JOURNAL_MAGIC) + _U32.size or not head.startswith(JOURNAL_MAGIC):
        raise DecodeError("journal: bad magic")
    (hlen,) = _U32.unpack(head[len(JOURNAL_MAGIC):])
    if hlen > MAX_JOURNAL_HEADER:
        raise DecodeError(f"journal: header of {hlen} bytes")
    data = fh.read(hlen)
    if len(data) != hlen:
        raise DecodeError("journal: truncated header")
    obj = strict.unpack(data, max_bytes=MAX_JOURNAL_HEADER, max_bin=32, max_map=3,
                        max_str=8, max_array=0)
    h = strict.as_map(obj, frozenset({"v", "step", "root"}), "journal header")
    strict.get_int(h, "v", 1, 1)
    return (strict.get_int(h, "step", 0, (1 << 63) - 1), strict.get_bytes(h, "root", 32),
            len(head) + hlen)


def _hasher(size: int) -> blake3.blake3:
    return blake3.blake3(max_threads=blake3.blake3.AUTO) if size >= _THREADED_MIN \
        else blake3.blake3()


def record_parts(sm: SignedManifest, chunks: Sequence[Chunk]) -> list[Chunk]:
    """The bytes of one journal record, in order (length, checksum, body parts).

    :raises ValueError: ``chunks`` are not the manifest's (count or sizes).
    """
    sizes = [n for _, n in sm.manifest.chunks]
    if len(chunks) != len(sizes) or any(memoryview(c).nbytes != n
                                        for c, n in zip(chunks, sizes, strict=True)):
        raise ValueError("journal: chunks do not match their manifest")
    raw = sm.encode()
    body: list[Chunk] = [_U32.pack(len(raw)), raw, *chunks]
    size = sum(memoryview(p).nbytes for p in body)
    h = _hasher(size)
    for part in body:
        h.update(part)
    return [_REC.pack(size, h.digest()), *body]


@dataclass(frozen=True, slots=True)
class Record:
    """One whole journal record (length and checksum right; not yet trusted)."""

    offset: int
    end: int
    body: bytes

    def split(self, trusted_signer: bytes | None) -> tuple[SignedManifest, list[memoryview]]:
        """The record's manifest (signature checked unless ``trusted_signer`` is None) and
        chunk bytes.

        :raises DecodeError: malformed. :raises SignatureError: not signed by the trainer.
        """
        view = memoryview(self.body)
        if len(view) < _U32.size:
            raise DecodeError("journal: record too short")
        (mlen,) = _U32.unpack(view[:_U32.size])
        if mlen > MAX_MANIFEST_BYTES or _U32.size + mlen > len(view):
            raise DecodeError("journal: manifest does not fit its record")
        raw = bytes(view[_U32.size:_U32.size + mlen])
        sm = SignedManifest.decode(raw, trusted_signer=trusted_signer,
                                   check_signature=trusted_signer is not None)
        pos = _U32.size + mlen
        chunks = []
        for _, n in sm.manifest.chunks:
            chunks.append(view[pos:pos + n])
            pos += n
        if pos != len(view):
            raise DecodeError("journal: chunk bytes do not match the manifest's sizes")
        return sm, chunks


class Scan:
    """Whole records of an open journal from ``start``; iteration stops at the end or at
    the first torn or corrupt record, and :attr:`stopped` says which (``""``: the end)."""

    def __init__(self, fh: BinaryIO, start: int) -> None:
        self._fh = fh
        self._start = start
        self.size = os.fstat(fh.fileno()).st_size
        self.stopped = ""

    def __iter__(self) -> Iterator[Record]:
        pos = self._start
        self._fh.seek(pos)
        while pos < self.size:
            head = self._fh.read(_REC.size)
            if len(head) != _REC.size:
                self.stopped = f"torn record header at byte {pos}"
                return
            size, digest = _REC.unpack(head)
            if size > self.size - pos - _REC.size:
                self.stopped = f"torn record at byte {pos} ({size} bytes announced)"
                return
            body = self._fh.read(size)
            h = _hasher(size)
            h.update(body)
            if len(body) != size or h.digest() != digest:
                self.stopped = f"corrupt record at byte {pos} (checksum)"
                return
            end = pos + _REC.size + size
            yield Record(pos, end, body)
            pos = end


@dataclass(frozen=True, slots=True)
class _Tip:
    """What the files hold (as this process last wrote or read them)."""

    step: int
    root: bytes
    base_step: int
    base_root: bytes
    end: int
    """Journal offset after the last record in use; 0: no journal for this base yet."""
    records: int = 0
    journal_bytes: int = 0


class StateLog:
    """A node's saved state as a base checkpoint and a journal of deltas (module doc).

    Not thread-safe: one load or save at a time (the roles run them in a worker thread,
    one after the other).
    """

    def __init__(self, path: Path, *, compact_fraction: float = 0.5,
                 max_records: int = 64) -> None:
        if not compact_fraction > 0 or max_records < 1:
            raise ValueError("compact_fraction must be positive and max_records at least 1")
        self.path = path
        self.journal = journal_path(path)
        self.compact_fraction = compact_fraction
        self.max_records = max_records
        self._tip: _Tip | None = None
        #: Bytes the last :meth:`save` wrote.
        self.last_written = 0

    # -- loading -------------------------------------------------------------------------
    def load(self, *, trusted_signer: bytes, run: str,
             layout: StateLayout | None = None) -> SavedState | None:
        """The newest verified version on disk (base plus journal); ``None``: none saved.

        :raises SwarmError: the base itself is refused (see
            :func:`~swarm.roles.persist.load_state`): move the files aside (:meth:`discard`).
        """
        self._tip = None
        self._remove_stale_tmp()
        saved = persist.read_state(self.path, trusted_signer=trusted_signer, run=run,
                                   layout=layout)
        if saved is None:
            return None
        base_step, base_root = saved.step, saved.root
        applied: list[SignedManifest] = []
        start = end = nbytes = 0  # start: first record of a journal of this base (0: none)
        try:
            fh = open(self.journal, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            fh = None
        except OSError as exc:
            raise StoreError(f"cannot open {self.journal}: {exc}") from exc
        if fh is not None:
            with fh:
                try:
                    step, root, first = read_header(fh)
                except DecodeError as exc:
                    log.warning("ignoring journal %s: %s", self.journal, exc)
                else:
                    if (step, root) != (base_step, base_root):
                        log.info("ignoring journal %s: it extends another base (step %d)",
                                 self.journal, step)
                    else:
                        start = end = first
                        applied, end, nbytes = self._replay(saved, fh, start,
                                                            trusted_signer, run)
        if applied:
            last = applied[-1].manifest
            if state_root_of(saved.state, last.piece_size) == last.target_root:
                self._tip = _Tip(last.step, last.target_root, base_step, base_root, end,
                                 len(applied), nbytes)
                kept = (*saved.manifests, *applied)[-persist.MAX_SAVED_MANIFESTS:]
                return SavedState(saved.state, kept)
            log.warning("journal %s: replayed state does not hash to the root of step %d; "
                        "falling back to its base (step %d)", self.journal, last.step,
                        base_step)
            saved = persist.read_state(self.path, trusted_signer=trusted_signer, run=run,
                                       layout=layout)
            if saved is None:
                raise StoreError(f"{self.path} vanished while loading")
        persist.check_root(saved)
        self._tip = _Tip(base_step, base_root, base_step, base_root, start)
        return saved

    def _replay(self, saved: SavedState, fh: BinaryIO, start: int, trusted_signer: bytes,
                run: str) -> tuple[list[SignedManifest], int, int]:
        """Apply the journal's records to ``saved.state`` while they chain; returns the
        applied manifests, the offset after the last, and their record bytes."""
        applied: list[SignedManifest] = []
        step, root = saved.step, saved.root
        digest = saved.manifest.manifest.layout_digest
        end = start
        scan = Scan(fh, start)
        for rec in scan:
            try:
                sm, chunks = rec.split(trusted_signer)
                m = sm.manifest
                if m.run != run or m.kind != "delta" or m.codec != CODEC_NAME:
                    raise IntegrityError(f"step {m.step}: not a {CODEC_NAME} delta of run "
                                         f"{run!r}")
                if m.layout_digest != digest:
                    raise IntegrityError(f"step {m.step}: another layout")
                if m.step <= step or m.base_root != root:
                    raise IntegrityError(f"step {m.step} does not follow step {step}")
                patcher = Patcher(saved.state, sm, current_root=root)
                try:
                    for (cid, _), data in zip(m.chunks, chunks, strict=True):
                        patcher.apply(cid, data)
                except SwarmError:
                    patcher.revert()
                    raise
            except SwarmError as exc:
                log.warning("journal %s: record at byte %d and later ones ignored: %s",
                            self.journal, rec.offset, exc)
                break
            applied.append(sm)
            step, root, end = m.step, m.target_root, rec.end
        else:
            if scan.stopped:
                log.warning("journal %s: %s; loading step %d", self.journal, scan.stopped, step)
        return applied, end, end - start

    # -- saving --------------------------------------------------------------------------
    def save(self, state: Mapping[str, torch.Tensor], manifests: Sequence[SignedManifest],
             chunks: Sequence[Chunk] | None = None) -> int:
        """Save version ``manifests[-1]``, which ``state`` holds (verified by the caller);
        returns the bytes written.

        ``chunks``, the version's delta chunks in manifest order, let a delta that follows
        the version on disk be appended to the journal; otherwise (or when the journal is
        due for compaction) ``state`` is written as the new base with ``manifests``.

        :raises StoreError: a file could not be written (what is on disk still loads at
            the previous version, or this one).
        """
        if not manifests:
            raise ValueError("a saved state needs the manifest of its version")
        sm = manifests[-1]
        m = sm.manifest
        tip, self._tip = self._tip, None  # unknown until this save succeeds
        self.last_written = 0
        if tip is not None and (tip.step, tip.root) == (m.step, m.target_root):
            self._tip = tip  # already on disk
            return 0
        if (chunks is not None and m.kind == "delta" and tip is not None
                and tip.root == m.base_root and tip.step < m.step
                and tip.records < self.max_records):
            parts = record_parts(sm, chunks)
            size = sum(memoryview(p).nbytes for p in parts)
            if tip.journal_bytes + size <= self.compact_fraction * layout_of(state).nbytes:
                written, end = self._append(tip, parts)
                self._tip = _Tip(m.step, m.target_root, tip.base_step, tip.base_root, end,
                                 tip.records + 1, tip.journal_bytes + size)
                self.last_written = written
                return written
        written = persist.save_state(self.path, state, manifests)
        header = encode_header(m.step, m.target_root)
        persist.write_atomic(self.journal, [header])
        self._tip = _Tip(m.step, m.target_root, m.step, m.target_root, len(header))
        self.last_written = written + len(header)
        return self.last_written

    def _append(self, tip: _Tip, parts: Sequence[Chunk]) -> tuple[int, int]:
        """Write a record after the last one in use; returns (bytes written, new end)."""
        size = sum(memoryview(p).nbytes for p in parts)
        if not tip.end:  # no journal for this base on disk: a new one, atomically
            header = encode_header(tip.base_step, tip.base_root)
            persist.write_atomic(self.journal, [header, *parts])
            return len(header) + size, len(header) + size
        try:
            with open(self.journal, "r+b") as fh:
                fh.seek(tip.end)
                fh.truncate()  # a torn record left by a crash, or records not replayed
                for part in parts:
                    fh.write(part)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise StoreError(f"cannot append to {self.journal}: {exc}") from exc
        return size, tip.end + size

    # -- housekeeping --------------------------------------------------------------------
    def discard(self, reason: str) -> None:
        """Move a refused base and its journal aside (kept once for inspection)."""
        self._tip = None
        persist.discard(self.path, reason)
        if self.journal.exists():
            try:
                os.replace(self.journal, self.journal.with_name(self.journal.name + ".bad"))
            except OSError as exc:
                log.warning("could not move %s aside: %s", self.journal, exc)

    def _remove_stale_tmp(self) -> None:
        """Temporary files of writes killed midway (a whole state's worth, possibly)."""
        for name in (self.path.name, self.journal.name):
            for tmp in self.path.parent.glob(f".{name}.*.tmp"):
                pid = tmp.name[len(name) + 2:-len(".tmp")]
                if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class JournalInfo:
    """What :func:`describe_journal` found (signatures not checked, roots not hashed)."""

    manifests: tuple[SignedManifest, ...]
    """The records that chain onto the base, oldest first."""
    record_bytes: int
    ignored: str
    """Why the rest of the file is not used (``""``: nothing left over)."""


def describe_journal(path: Path, base_step: int, base_root: bytes) -> JournalInfo | None:
    """The journal next to base ``path`` as far as it extends that base (``swarm inspect``);
    ``None``: there is none.

    :raises DecodeError: the journal is unreadable.
    """
    jpath = journal_path(path)
    if not jpath.is_file():
        return None
    with open(jpath, "rb") as fh:
        step, root, start = read_header(fh)
        if (step, root) != (base_step, base_root):
            return JournalInfo((), 0, f"extends another base (step {step}): ignored")
        out: list[SignedManifest] = []
        scan = Scan(fh, start)
        end = start
        ignored = ""
        for rec in scan:
            try:
                sm, _ = rec.split(None)
            except SwarmError as exc:
                ignored = f"record at byte {rec.offset}: {exc}"
                break
            m = sm.manifest
            if m.kind != "delta" or m.step <= step or m.base_root != root:
                ignored = f"record at byte {rec.offset}: step {m.step} does not follow"
                break
            out.append(sm)
            step, root, end = m.step, m.target_root, rec.end
        else:
            ignored = scan.stopped
        if ignored and end < scan.size:
            ignored += f" ({scan.size - end} bytes ignored)"
        return JournalInfo(tuple(out), end - start, ignored)
