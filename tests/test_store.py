"""Chunk stores: verification, retention, corruption and crash safety."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from swarm.content import ChunkStore, DiskChunkStore, MemoryChunkStore, chunk_id
from swarm.errors import IntegrityError, StoreError


def _chunk(i: int, size: int = 1000) -> tuple[bytes, bytes]:
    data = random.Random(i).randbytes(size)
    return chunk_id(data), data


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ChunkStore:
    if request.param == "memory":
        return MemoryChunkStore(budget_bytes=10_000, keep_latest=1)
    return DiskChunkStore(tmp_path / "s", budget_bytes=10_000, keep_latest=1)


def test_put_get_and_verify(store: ChunkStore) -> None:
    cid, data = _chunk(1)
    assert isinstance(store, ChunkStore)
    assert store.get(cid) is None and not store.has(cid)
    store.put(cid, data, version=1)
    assert store.get(cid) == data and store.has(cid)
    with pytest.raises(IntegrityError):
        store.put(cid, data + b"x", version=1)
    with pytest.raises(ValueError):
        store.put(b"short", data, version=1)


def test_retention_drops_oldest_versions_over_budget(store: ChunkStore) -> None:
    shared_id, shared = _chunk(999)
    for v in range(1, 6):
        store.put(shared_id, shared, version=v)
        for k in range(3):
            cid, data = _chunk(v * 10 + k)
            store.put(cid, data, version=v)
    assert store.nbytes <= 10_000
    kept = store.versions()
    assert kept[-1] == 5 and kept == sorted(kept) and 1 not in kept
    assert store.get(shared_id) == shared  # still referenced by kept versions
    for v in kept:
        assert all(store.get(c) is not None for c in store.chunks_of(v))
    assert store.get(_chunk(10)[0]) is None  # version 1's chunks are gone
    store.drop_version(5)
    assert 5 not in store.versions()


def test_disk_corruption_detected_reported_removed(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    s = DiskChunkStore(tmp_path / "s")
    cid, data = _chunk(3)
    s.put(cid, data, version=0)
    path = tmp_path / "s" / "chunks" / cid.hex()[:2] / cid.hex()
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0x10
    path.write_bytes(bytes(raw))
    assert s.get(cid) is None
    assert s.corrupt_found == 1 and not path.exists() and not s.has(cid)
    assert "corrupt" in caplog.text


def test_disk_reopen_keeps_versions(tmp_path: Path) -> None:
    s = DiskChunkStore(tmp_path / "s")
    items = [_chunk(i) for i in range(5)]
    for i, (cid, data) in enumerate(items):
        s.put(cid, data, version=i % 2)
    again = DiskChunkStore(tmp_path / "s")
    assert again.versions() == [0, 1]
    assert again.chunks_of(1) == {items[1][0], items[3][0]}
    assert all(again.get(c) == d for c, d in items)
    assert again.nbytes == 5000


def test_disk_store_unusable_root_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot open"):
        DiskChunkStore(blocker)


def test_concurrent_readers_never_see_bad_bytes(tmp_path: Path) -> None:
    s = DiskChunkStore(tmp_path / "s", budget_bytes=60_000, keep_latest=1, fsync=False)
    items = [_chunk(i, 5000) for i in range(60)]
    wrong: list[bytes] = []
    done = threading.Event()

    def reader() -> None:
        rng = random.Random(7)
        for _ in range(3000):
            if done.is_set():
                break
            cid, data = items[rng.randrange(len(items))]
            got = s.get(cid)
            if got is not None and got != data:
                wrong.append(cid)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i, (cid, data) in enumerate(items):
        s.put(cid, data, version=i // 4)
    done.set()
    for t in threads:
        t.join(timeout=30)
    assert not wrong and s.corrupt_found == 0 and s.nbytes <= 60_000


WRITER = textwrap.dedent("""
    import random, sys
    from swarm.content import DiskChunkStore, chunk_id
    s = DiskChunkStore(sys.argv[1])
    print("ready", flush=True)
    for i in range(100000):
        data = random.Random(i).randbytes(256 * 1024)
        s.put(chunk_id(data), data, version=i // 8)
        print(i, flush=True)
""")


def test_killed_writer_leaves_no_partial_chunk(tmp_path: Path) -> None:
    root = tmp_path / "s"
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # Let it store some chunks, then kill it wherever it is in the next writes.
        for _ in range(20 + attempt * 7):
            assert proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        reopened = DiskChunkStore(root)
        assert not any((root / "tmp").iterdir())
        files = [p for p in (root / "chunks").rglob("*") if p.is_file()]
        assert files, "the writer should have stored some chunks"
        for f in files:
            assert chunk_id(f.read_bytes()).hex() == f.name
        for v in reopened.versions():
            for cid in reopened.chunks_of(v):
                assert reopened.get(cid) is not None
        assert reopened.corrupt_found == 0
