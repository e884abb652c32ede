"""The incremental saved state: a base checkpoint and a journal of signed deltas.

Bytes written per version are about the delta's; a torn or corrupt journal tail, a journal
that does not chain or hash, and a kill at any point of a compaction all load a verified
version, never a mix; a writer process SIGKILLed at random moments leaves a version that
loads and is exactly one of the versions it saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarm.content.manifest import SignedManifest
from swarm.delta.pipeline import EncoderConfig, encode_delta_sync
from swarm.delta.state import keyframe_manifest, layout_of, state_root_of
from swarm.errors import SwarmError
from swarm.identity import Identity
from swarm.roles import persist, statelog
from swarm.roles.statelog import StateLog

pytestmark = pytest.mark.timeout(120)

TRAINER = Identity.from_seed(b"J" * 32)
PIECE = 1 << 12
RUN = "r"

Version = tuple[dict[str, torch.Tensor], SignedManifest, list[bytes]]


def _versions(n: int, sizes: tuple[int, ...], seed: int = 0, frac: float = 0.01,
              chunk_target: int = 1 << 14) -> list[Version]:
    """Version 0 (a keyframe) and ``n - 1`` sparse deltas, each with its full state."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(s, generator=gen).to(torch.bfloat16)
             for i, s in enumerate(sizes)}
    out: list[Version] = [(state, keyframe_manifest(state, TRAINER, RUN, 0, piece_size=PIECE),
                           [])]
    cfg = EncoderConfig(piece_size=PIECE, chunk_target=chunk_target, threads=1)
    for step in range(1, n):
        new = {}
        for k, t in state.items():
            mask = torch.rand(t.shape, generator=gen) < frac
            new[k] = torch.where(mask, (t.float() + torch.randn(t.shape, generator=gen))
                                 .to(torch.bfloat16), t)
        sm, chunks = encode_delta_sync(state, new, TRAINER, RUN, step, config=cfg)
        out.append((new, sm, [c.data for c in chunks]))
        state = new
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16),
                                                    b[k].view(torch.int16)) for k in a)


def _load(path: Path) -> persist.SavedState | None:
    return StateLog(path).load(trusted_signer=TRAINER.public_key, run=RUN)


def _save_all(log: StateLog, versions: list[Version]) -> list[int]:
    """Save the versions in order, as a peer does after each install; bytes written."""
    written = []
    for state, sm, chunks in versions:
        written.append(log.save(state, [sm], chunks or None))
    return written


def _check(path: Path, versions: list[Version], want: int) -> None:
    saved = _load(path)
    assert saved is not None and saved.step == want
    assert saved.root == versions[want][1].manifest.target_root
    assert _same(saved.state, versions[want][0])


def test_a_journal_of_deltas_replays_to_the_newest_version(tmp_path: Path) -> None:
    versions = _versions(6, (1 << 20, 1 << 19, 3000))  # 3 MB of bf16
    dense = layout_of(versions[0][0]).nbytes
    path = tmp_path / "peer.state"
    log = StateLog(path)
    written = _save_all(log, versions[:1])
    base = path.stat().st_ino, path.stat().st_size
    written += _save_all(log, versions[1:])
    assert written[0] > dense  # version 0: the base
    for (_, sm, _), n in zip(versions[1:], written[1:], strict=True):
        delta = sm.manifest.total_bytes
        assert delta < dense // 20
        assert delta < n < 3 * delta, (n, delta)
    assert (path.stat().st_ino, path.stat().st_size) == base  # not rewritten
    saved = _load(path)
    assert saved is not None and saved.step == 5
    assert [m.manifest.step for m in saved.manifests] == [0, 1, 2, 3, 4, 5]
    assert _same(saved.state, versions[5][0])
    assert state_root_of(saved.state, PIECE) == versions[5][1].manifest.target_root
    # A reopened log goes on appending after what it loaded.
    more = _versions(8, (1 << 20, 1 << 19, 3000))
    assert all(_same(a[0], b[0]) for a, b in zip(versions, more, strict=False))
    log2 = StateLog(path)
    stale = tmp_path / f".peer.state.{1 << 30}.tmp"  # left by a killed write
    stale.write_bytes(b"x")
    assert log2.load(trusted_signer=TRAINER.public_key, run=RUN) is not None
    assert not stale.exists()
    assert _save_all(log2, more[6:])[0] < 3 * more[6][1].manifest.total_bytes
    _check(path, more, 7)
    # The same version again costs nothing.
    assert log2.save(more[7][0], [more[7][1]], more[7][2]) == 0


def test_compaction_by_size_and_by_count(tmp_path: Path) -> None:
    versions = _versions(8, (1 << 15,), frac=0.05)
    dense = layout_of(versions[0][0]).nbytes
    log = StateLog(tmp_path / "a.state", compact_fraction=0.25)
    journal = statelog.journal_path(tmp_path / "a.state")
    written = []
    for v in versions:
        written += _save_all(log, [v])
        assert journal.stat().st_size <= 0.25 * dense + 64
    assert any(n > dense for n in written[1:])  # the journal was folded into a new base
    _check(tmp_path / "a.state", versions, 7)
    log = StateLog(tmp_path / "b.state", max_records=2)
    written = _save_all(log, versions)
    assert [n > dense for n in written] == [True, False, False, True, False, False, True,
                                            False]
    _check(tmp_path / "b.state", versions, 7)
    # a version that does not follow what is on disk is a new base
    log = StateLog(tmp_path / "c.state")
    _save_all(log, versions[:2])
    assert log.save(versions[3][0], [versions[3][1]], versions[3][2]) > dense
    _check(tmp_path / "c.state", versions, 3)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    return dst / "peer.state"


def test_a_torn_tail_loads_the_previous_version_at_every_cut(tmp_path: Path) -> None:
    versions = _versions(4, (300, 200), frac=0.05, chunk_target=256)
    src = tmp_path / "src"
    log = StateLog(src / "peer.state", compact_fraction=8.0)  # a tiny state: keep records
    _save_all(log, versions[:3])
    journal = statelog.journal_path(src / "peer.state")
    start = journal.stat().st_size
    _save_all(log, versions[3:])
    full = journal.read_bytes()
    assert len(full) - start > 100
    for cut in range(start, len(full)):
        path = _copy(src, tmp_path / f"cut{cut}")
        statelog.journal_path(path).write_bytes(full[:cut])
        _check(path, versions, 2)
        if cut % 37 == 0:  # the next append cuts the torn record away
            again = StateLog(path, compact_fraction=8.0)
            assert again.load(trusted_signer=TRAINER.public_key, run=RUN) is not None
            _save_all(again, versions[3:])
            assert statelog.journal_path(path).read_bytes() == full
            _check(path, versions, 3)
        shutil.rmtree(path.parent)
    _check(src / "peer.state", versions, 3)


def test_a_corrupt_record_loads_the_version_before_it(tmp_path: Path) -> None:
    versions = _versions(4, (4000, 1000), frac=0.02, chunk_target=512)
    src = tmp_path / "src"
    log = StateLog(src / "peer.state")
    offsets = []
    for v in versions:
        _save_all(log, [v])
        offsets.append(statelog.journal_path(src / "peer.state").stat().st_size)
    full = statelog.journal_path(src / "peer.state").read_bytes()
    rng = random.Random(5)
    # a flipped bit in record k (checksum): version k (record k holds version k + 1)
    for k in (1, 2):
        for _ in range(5):
            pos = rng.randrange(offsets[k], offsets[k + 1])
            raw = bytearray(full)
            raw[pos] ^= 1 << rng.randrange(8)
            path = _copy(src, tmp_path / f"flip{k}-{pos}")
            statelog.journal_path(path).write_bytes(bytes(raw))
            _check(path, versions, k)
            shutil.rmtree(path.parent)
    # a whole record, checksum right, signed by someone else: ignored with all after it
    other = Identity.from_seed(b"O" * 32)
    path = _copy(src, tmp_path / "forged")
    forged = versions[2][1].manifest.sign(other)
    rec = b"".join(bytes(p) for p in statelog.record_parts(forged, versions[2][2]))
    statelog.journal_path(path).write_bytes(full[:offsets[1]] + rec + full[offsets[2]:])
    _check(path, versions, 1)
    # signed by the trainer but its chunks do not reach its target root (a bad delta the
    # trainer signed): the replay does not hash, the base alone is loaded
    wrong = dataclasses.replace(versions[3][1].manifest, target_root=b"\x01" * 32)
    path = _copy(src, tmp_path / "wrong")
    rec = b"".join(bytes(p) for p in statelog.record_parts(wrong.sign(TRAINER), versions[3][2]))
    statelog.journal_path(path).write_bytes(full[:offsets[2]] + rec)
    _check(path, versions, 0)
    # a bit of the base itself: only the root can tell, and the state is refused
    path = _copy(src, tmp_path / "base")
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(SwarmError, match="root"):
        _load(path)
    StateLog(path).discard("test")
    assert not path.exists() and (path.parent / "peer.state.bad").exists()
    assert (path.parent / "peer.state.journal.bad").exists()
    assert _load(path) is None


class Crash(BaseException):
    """A kill at this point (not an OSError: nothing is cleaned up)."""


def test_a_crash_at_any_point_of_a_compaction_leaves_old_or_new(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    versions = _versions(5, (6000, 2000), frac=0.02)
    seen = set()
    real_replace, real_fsync = os.replace, os.fsync
    for crash_at in range(100):
        d = tmp_path / f"c{crash_at}"
        log = StateLog(d / "peer.state", max_records=3)
        _save_all(log, versions[:4])  # version 4 compacts: records are full
        calls = [0]

        def hook(real: Callable[..., None], calls: list[int] = calls,
                 crash_at: int = crash_at) -> Callable[..., None]:
            def f(*a: object) -> None:
                calls[0] += 1
                if calls[0] > crash_at:
                    raise Crash
                real(*a)
            return f

        monkeypatch.setattr(os, "replace", hook(real_replace))
        monkeypatch.setattr(os, "fsync", hook(real_fsync))
        try:
            n = log.save(versions[4][0], [versions[4][1]], versions[4][2])
            crashed = False
        except Crash:
            crashed = True
        monkeypatch.undo()
        saved = _load(d / "peer.state")
        assert saved is not None and saved.step in (3, 4), crash_at
        _check(d / "peer.state", versions, saved.step)
        seen.add(saved.step)
        if not crashed:
            assert n > layout_of(versions[0][0]).nbytes
            break
    else:
        pytest.fail("the save never completed")
    assert crash_at >= 4 and seen == {3, 4}


_WRITER = r"""
import os, pickle, sys, traceback
from pathlib import Path
import torch
from swarm.delta.patch import Patcher
from swarm.roles.statelog import StateLog
from swarm.content.manifest import SignedManifest

with open(sys.argv[1], "rb") as fh:
    spec = pickle.load(fh)
key, run = spec["key"], spec["run"]
manifests = [SignedManifest.decode(m) for m in spec["manifests"]]
os.write(1, b"zygote\n")
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            log = StateLog(Path(spec["dir"]) / "peer.state", max_records=3)
            saved = log.load(trusted_signer=key, run=run)
            if saved is None:
                state = {n: torch.frombuffer(bytearray(b), dtype=torch.bfloat16)
                         for n, b in spec["v0"]}
                log.save(state, [manifests[0]])
                at = 0
            else:
                state, at = saved.state, saved.step
            os.write(1, b"ready %d %d\n" % (at, os.getpid()))
            for k in range(at + 1, len(manifests)):
                sm = manifests[k]
                patcher = Patcher(state, sm, engine="c")
                for (cid, _), data in zip(sm.manifest.chunks, spec["chunks"][k]):
                    patcher.apply(cid, data)
                patcher.finish()
                log.save(state, [sm], spec["chunks"][k])
                os.write(1, b"saved %d\n" % k)
            os.write(1, b"done\n")
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)
    os.write(1, b"exit\n")
"""


class _Lines:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buf = b""

    def next(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise TimeoutError("the writer said nothing")
            data = os.read(self.fd, 4096)
            if not data:
                raise EOFError("the writer exited")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def test_a_writer_killed_at_random_moments_leaves_a_verified_version(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.roles.statelog")
    versions = _versions(40, (40000, 20000), frac=0.02)
    d = tmp_path / "state"
    d.mkdir()
    spec = tmp_path / "spec.pkl"
    spec.write_bytes(pickle.dumps({
        "key": TRAINER.public_key, "run": RUN, "dir": str(d),
        "manifests": [sm.encode() for _, sm, _ in versions],
        "chunks": [[bytes(c) for c in ch] for _, _, ch in versions],
        "v0": [(n, t.view(torch.uint8).numpy().tobytes()) for n, t in versions[0][0].items()],
    }))
    # A zygote imports once and forks one writer per run: each writer is a real process,
    # killed with SIGKILL, in well under 2 s.
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    assert proc.stdin is not None
    rng = random.Random(2024)
    lines = _Lines(proc)
    outcomes = dict.fromkeys(("said", "one more", "finished", "tmp left", "torn tail"), 0)
    try:
        assert lines.next(60) == "zygote"
        for _run in range(20):
            t0 = time.monotonic()
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            ready = lines.next()
            assert ready.startswith("ready "), ready
            last, pid = map(int, ready.split()[1:])
            writes = rng.randrange(0, 4)
            line = ""
            while writes > 0:
                line = lines.next()
                if line == "done":
                    break
                assert line.startswith("saved "), line
                last = int(line.split()[1])
                writes -= 1
            time.sleep(rng.uniform(0, 0.004))  # the kill lands anywhere in the next save
            with contextlib.suppress(ProcessLookupError):  # unless it finished first
                os.kill(pid, signal.SIGKILL)
            while (line := lines.next()) != "exit":
                if line.startswith("saved "):
                    last = int(line.split()[1])
            outcomes["tmp left"] += any(f.name.endswith(".tmp") for f in d.iterdir())
            caplog.clear()
            saved = _load(d / "peer.state")
            outcomes["torn tail"] += any("torn" in r.getMessage() for r in caplog.records)
            assert saved is not None, "nothing loads after a kill"
            assert saved.step in (last, last + 1), (saved.step, last)
            assert saved.root == versions[saved.step][1].manifest.target_root
            assert _same(saved.state, versions[saved.step][0]), "a mix of versions"
            if saved.step == len(versions) - 1:
                outcomes["finished"] += 1
                for f in d.iterdir():
                    f.unlink()
            else:
                outcomes["said" if saved.step == last else "one more"] += 1
            assert time.monotonic() - t0 < 2.0
    finally:
        proc.stdin.close()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    print(outcomes)
    assert outcomes["said"] + outcomes["one more"] >= 10, outcomes


def test_inspect_shows_the_base_and_its_journal(tmp_path: Path) -> None:
    from swarm.cli.inspect import describe_data_dir, describe_state

    versions = _versions(4, (5000,), frac=0.02)
    path = tmp_path / "peer.state"
    _save_all(StateLog(path), versions)
    lines, ok = describe_state(path)
    text = "\n".join(lines)
    assert ok and "step          3 (delta)" in text and "steps 0k, 1, 2, 3" in text
    assert "journal       3 deltas" in text and "after base step 0" in text
    other = Identity.from_seed(b"O" * 32).peer_id
    assert not describe_state(path, other)[1]
    raw = statelog.journal_path(path).read_bytes()
    statelog.journal_path(path).write_bytes(raw[:-3])  # a torn tail
    text = "\n".join(describe_data_dir(tmp_path))
    assert "step          2 (delta)" in text and "torn record" in text, text


async def test_a_peer_and_a_trainer_write_about_the_delta_per_version(tmp_path: Path) -> None:
    from swarm.demo.model import TinyModelConfig, build_model, inference_state
    from swarm.engines.torch_engine import TorchEngine
    from swarm.net.memory import ADDRESS_PREFIX, LinkProfile, MemoryNetwork
    from swarm.roles.peer import PeerConfig, RolloutPeer
    from swarm.roles.trainer import TrainerConfig, TrainerNode

    cfg = TinyModelConfig(vocab_size=64, hidden_size=128, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=64, intermediate_size=512, seed=3)
    master = build_model(cfg)
    net = MemoryNetwork(default=LinkProfile(bandwidth=200e6, latency=0.001), seed=1)
    events: list[tuple[str, dict[str, object]]] = []
    ident = Identity.from_seed(b"p" * 32)
    async with net.transport(TRAINER) as tnet, TrainerNode(
            TRAINER, tnet, TrainerConfig(run=RUN, data_dir=tmp_path / "t", piece_size=PIECE,
                                         chunk_target=1 << 14)) as trainer, \
            net.transport(ident) as pnet:
        await trainer.publish(inference_state(master))
        await pnet.connect(ADDRESS_PREFIX + TRAINER.peer_id)
        async with RolloutPeer(
                ident, pnet, PeerConfig(run=RUN, trainer=TRAINER.peer_id,
                                        data_dir=tmp_path / "p"),
                inference_state(build_model(cfg)),
                TorchEngine(build_model(cfg, dtype=torch.bfloat16)),
                status=lambda ev, f: events.append((ev, f))) as peer:
            await peer.wait_version(0)
            for step in range(1, 4):
                gen = torch.Generator().manual_seed(step)
                with torch.no_grad():
                    for p in master.parameters():
                        p.add_((torch.rand(p.shape, generator=gen) < 0.01) * 0.05)
                pub = await trainer.publish(inference_state(master))
                assert trainer._statelog.last_written < 3 * pub.payload_bytes
                await peer.wait_version(step)
    dense = layout_of(inference_state(master)).nbytes
    verified = [f for ev, f in events if ev == "verified"]
    assert [f["version"] for f in verified] == [0, 1, 2, 3]
    assert int(str(verified[0]["written"])) > dense
    for f in verified[1:]:
        written, delta = int(str(f["written"])), int(str(f["bytes"]))
        assert delta < written < 3 * delta and written < dense // 10, f
