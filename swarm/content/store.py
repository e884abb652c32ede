"""Chunk stores: content-addressed bytes grouped by version, with a byte budget.

Both implementations verify the BLAKE3 id on put and on every read. The disk store writes
to a temporary file, fsyncs and renames, so a killed process never leaves a partial chunk
visible; a file corrupted on disk is detected on read, logged, removed and not served.
Retention drops whole versions, oldest first, when the stored bytes exceed the budget;
a chunk shared by several versions stays while any of them is kept.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from swarm.content.ids import DIGEST_LEN, chunk_id, hex_id
from swarm.errors import IntegrityError, StoreError

log = logging.getLogger(__name__)

MAX_STORED_CHUNK = 64 << 20


@runtime_checkable
class ChunkStore(Protocol):
    """Content-addressed chunk storage grouped by version."""

    def put(self, cid: bytes, data: bytes, version: int) -> None:
        """Store ``data`` under ``cid`` for ``version``. :raises IntegrityError: wrong id."""

    def get(self, cid: bytes) -> bytes | None:
        """The verified bytes of ``cid``, or ``None`` if absent (or found corrupt)."""

    def has(self, cid: bytes) -> bool:
        """Whether ``cid`` is stored."""

    def versions(self) -> list[int]:
        """Versions with at least one chunk recorded, ascending."""

    def chunks_of(self, version: int) -> set[bytes]:
        """Ids recorded for ``version``."""

    def drop_version(self, version: int) -> None:
        """Forget ``version``; delete chunks no remaining version references."""

    @property
    def nbytes(self) -> int:
        """Bytes of chunk data held."""


class _Index:
    """Version membership, sizes and the budget policy shared by both stores."""

    def __init__(self, budget_bytes: int | None, keep_latest: int) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if keep_latest < 1:
            raise ValueError("keep_latest must be at least 1")
        self.budget_bytes = budget_bytes
        self.keep_latest = keep_latest
        self.members: dict[int, set[bytes]] = {}
        self.sizes: dict[bytes, int] = {}
        self.refs: dict[bytes, int] = {}
        self.lock = threading.RLock()
        self.corrupt_found = 0

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def add(self, cid: bytes, size: int, version: int) -> bool:
        """Record membership; True when the version did not list ``cid`` yet."""
        members = self.members.setdefault(version, set())
        if cid in members:
            return False
        members.add(cid)
        self.refs[cid] = self.refs.get(cid, 0) + 1
        self.sizes[cid] = size
        return True

    def remove_version(self, version: int) -> list[bytes]:
        """Forget a version; return ids that no version references any more."""
        dead = []
        for cid in self.members.pop(version, set()):
            self.refs[cid] -= 1
            if self.refs[cid] == 0:
                del self.refs[cid]
                self.sizes.pop(cid, None)
                dead.append(cid)
        return dead

    def over_budget_victims(self) -> list[int]:
        """Oldest versions to drop to get under budget, never the newest ``keep_latest``."""
        if self.budget_bytes is None:
            return []
        order = sorted(self.members)
        droppable = order[: max(0, len(order) - self.keep_latest)]
        victims = []
        total = self.nbytes
        for v in droppable:
            if total <= self.budget_bytes:
                break
            victims.append(v)
            total -= sum(self.sizes[c] for c in self.members[v] if self.refs[c] == 1)
        return victims


def _check_put(cid: bytes, data: bytes | bytearray | memoryview, version: int) -> None:
    if len(cid) != DIGEST_LEN:
        raise ValueError("chunk ids are 32 bytes")
    if version < 0:
        raise ValueError("versions are non-negative")
    if len(data) > MAX_STORED_CHUNK:
        raise StoreError(f"chunk of {len(data)} bytes exceeds {MAX_STORED_CHUNK}")
    if chunk_id(data) != cid:
        raise IntegrityError(f"chunk bytes do not hash to {hex_id(cid, short=True)}")


class MemoryChunkStore:
    """In-memory :class:`ChunkStore` (tests, simulation, small peers)."""

    def __init__(self, budget_bytes: int | None = None, keep_latest: int = 2) -> None:
        self._index = _Index(budget_bytes, keep_latest)
        self._data: dict[bytes, bytes] = {}

    def put(self, cid: bytes, data: bytes, version: int) -> None:
        _check_put(cid, data, version)
        with self._index.lock:
            self._index.add(cid, len(data), version)
            self._data[cid] = bytes(data)
            for v in self._index.over_budget_victims():
                self.drop_version(v)

    def get(self, cid: bytes) -> bytes | None:
        with self._index.lock:
            data = self._data.get(cid)
        if data is not None and chunk_id(data) != cid:
            log.error("chunk %s corrupt in memory; removed", hex_id(cid, short=True))
            with self._index.lock:
                self._index.corrupt_found += 1
                self._data.pop(cid, None)
            return None
        return data

    def has(self, cid: bytes) -> bool:
        return cid in self._data

    def versions(self) -> list[int]:
        with self._index.lock:
            return sorted(v for v, m in self._index.members.items() if m)

    def chunks_of(self, version: int) -> set[bytes]:
        with self._index.lock:
            return set(self._index.members.get(version, set()))

    def drop_version(self, version: int) -> None:
        with self._index.lock:
            for cid in self._index.remove_version(version):
                self._data.pop(cid, None)

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def corrupt_found(self) -> int:
        return self._index.corrupt_found


class DiskChunkStore:
    """On-disk :class:`ChunkStore`.

    Layout under ``root``: ``chunks/ab/<hex id>`` (content), ``versions/<v>.log``
    (append-only 32-byte ids of each version; a torn tail is ignored), ``tmp/`` (writes
    in progress; emptied on open). A version's log entry is written before its chunk is
    renamed into place, so a crash can leave a listed-but-absent chunk (refetched) but
    never a visible partial one.
    """

    def __init__(self, root: str | os.PathLike[str], budget_bytes: int | None = None,
                 keep_latest: int = 2, fsync: bool = True) -> None:
        self.root = Path(root)
        self._chunks = self.root / "chunks"
        self._versions = self.root / "versions"
        self._tmp = self.root / "tmp"
        self._fsync = fsync
        self._index = _Index(budget_bytes, keep_latest)
        try:
            for d in (self._chunks, self._versions, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
            for stale in self._tmp.iterdir():
                stale.unlink(missing_ok=True)
            self._load()
        except OSError as exc:
            raise StoreError(f"cannot open chunk store at {self.root}: {exc}") from exc

    def _path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self._chunks / h[:2] / h

    def _load(self) -> None:
        for log_file in sorted(self._versions.glob("*.log")):
            try:
                version = int(log_file.stem)
            except ValueError:
                log.warning("ignoring unexpected file %s in chunk store", log_file)
                continue
            raw = log_file.read_bytes()
            for off in range(0, len(raw) - len(raw) % DIGEST_LEN, DIGEST_LEN):
                cid = raw[off:off + DIGEST_LEN]
                try:
                    size = self._path(cid).stat().st_size
                except FileNotFoundError:
                    continue
                self._index.add(cid, size, version)
        listed = set(self._index.sizes)
        for sub in self._chunks.iterdir():
            for f in sub.iterdir() if sub.is_dir() else ():
                try:
                    cid = bytes.fromhex(f.name)
                except ValueError:
                    cid = b""
                if cid not in listed:
                    f.unlink(missing_ok=True)

    def put(self, cid: bytes, data: bytes, version: int) -> None:
        _check_put(cid, data, version)
        with self._index.lock:
            if cid in self._index.members.get(version, set()) and self._path(cid).exists():
                return
            try:
                self._append_log(cid, version)
                path = self._path(cid)
                if not path.exists():
                    self._write_atomic(path, data)
            except OSError as exc:
                raise StoreError(f"cannot store chunk {hex_id(cid, short=True)}: {exc}") from exc
            self._index.add(cid, len(data), version)
            for v in self._index.over_budget_victims():
                self.drop_version(v)

    def _append_log(self, cid: bytes, version: int) -> None:
        log_path = self._versions / f"{version:020d}.log"
        with open(log_path, "ab") as fh:
            size = fh.tell()
            if size % DIGEST_LEN:
                fh.truncate(size - size % DIGEST_LEN)
            fh.write(cid)
            if self._fsync:
                fh.flush()
                os.fsync(fh.fileno())

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = self._tmp / f"{path.name}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                if self._fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, cid: bytes) -> bytes | None:
        if len(cid) != DIGEST_LEN:
            return None
        path = self._path(cid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read chunk {hex_id(cid, short=True)}: {exc}") from exc
        if chunk_id(data) != cid:
            log.error("chunk %s is corrupt on disk (%s); removed", hex_id(cid, short=True), path)
            with self._index.lock:
                self._index.corrupt_found += 1
                path.unlink(missing_ok=True)
            return None
        return data

    def has(self, cid: bytes) -> bool:
        return len(cid) == DIGEST_LEN and self._path(cid).exists()

    def versions(self) -> list[int]:
        with self._index.lock:
            return sorted(v for v, m in self._index.members.items() if m)

    def chunks_of(self, version: int) -> set[bytes]:
        with self._index.lock:
            return set(self._index.members.get(version, set()))

    def drop_version(self, version: int) -> None:
        with self._index.lock:
            dead = self._index.remove_version(version)
            (self._versions / f"{version:020d}.log").unlink(missing_ok=True)
            for cid in dead:
                self._path(cid).unlink(missing_ok=True)

    def put_many(self, items: Iterable[tuple[bytes, bytes]], version: int) -> None:
        for cid, data in items:
            self.put(cid, data, version)

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def corrupt_found(self) -> int:
        return self._index.corrupt_found
