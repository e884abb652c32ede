"""A real trainer process, SIGKILLed mid-step and restarted on its SQLite state.

The trainer runs in a child process (this file run as a script) and speaks framed lease
messages over stdin/stdout; the test process plays the peers and the clock. The test
pipelines a burst of results, reads a few verdicts, then SIGKILLs the child while it is
still committing. A fresh child on the same data directory must resume: leases issued
before the kill keep their meaning, every verdict the peers saw stays true, nothing
committed is lost, and every task is counted exactly once.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from swarm.identity import Identity
from swarm.protocol.leases import (
    Completion,
    Lease,
    LeaseConfig,
    PeerLeases,
    Reason,
    Result,
    Sampling,
    TaskResult,
    TrainerLeases,
    Verdict,
    decode_message,
)
from swarm.protocol.scheduling import SchedulingConfig
from swarm.wire import strict

RUN = "run-restart"
TRAINER_SEED = b"R" * 32
N_TASKS = 48
MAX_FRAME = 1 << 22


def config() -> LeaseConfig:
    return LeaseConfig(run=RUN, max_staleness=1, grace_s=2.0, restart_grace_s=30.0,
                       scheduling=SchedulingConfig(target_lease_s=10.0,
                                                   default_tokens_per_task=40.0))


# --------------------------------------------------------------------------- framing


def write_frame(stream: Any, obj: object) -> None:
    data = strict.pack(obj)
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def read_exact(fd: int, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("trainer process did not answer in time")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("trainer process closed its output")
            out += chunk
    return out


def read_frame(fd: int, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    n = int.from_bytes(read_exact(fd, 4, deadline), "big")
    if n > MAX_FRAME:
        raise ValueError("oversized frame")
    return strict.unpack(read_exact(fd, n, deadline), max_bytes=MAX_FRAME, max_bin=MAX_FRAME,
                         max_array=1 << 12, max_str=64)


# --------------------------------------------------------------------------- child


def child_main(data_dir: str) -> int:
    from swarm.roles.trainer_state import TrainerState

    ident = Identity.from_seed(TRAINER_SEED)
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    start = read_frame(fin.fileno())
    now = start[1] / 1000
    with TrainerState(data_dir, run=RUN, trainer_key=ident.public_key) as state:
        fresh = state.load().next_task_id == 0
        if fresh:
            trainer = TrainerLeases(ident, config(), store=state, now=now)
            trainer.publish_version(0, now)
            trainer.add_tasks([(f"prompt-{i}", [i, 1]) for i in range(start[2])],
                              group_size=2, sampling=Sampling(max_tokens=16))
        else:
            trainer = TrainerLeases.restore(ident, config(), state, now)
        write_frame(fout, ["ready", fresh, len(trainer.done)])
        for _ in range(100_000):
            op, now_ms, sender, payload = read_frame(fin.fileno(), timeout=60.0)
            now = now_ms / 1000
            if op == "quit":
                break
            if op == "tick":
                trainer.tick(now)
                write_frame(fout, [])
            else:
                replies = trainer.handle(payload, now, sender=sender)
                write_frame(fout, [r.encode() for r in replies])
    return 0


# --------------------------------------------------------------------------- parent


class TrainerProcess:
    def __init__(self, data_dir: Path, now: float) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "child", str(data_dir)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        write_frame(self.stdin, ["start", int(now * 1000), N_TASKS])
        self.ready = read_frame(self.fd)

    def send(self, now: float, sender: str, payload: bytes) -> None:
        write_frame(self.stdin, ["msg", int(now * 1000), sender, payload])

    def replies(self) -> list[Any]:
        return [decode_message(r) for r in read_frame(self.fd)]

    def ask(self, now: float, sender: str, payload: bytes) -> list[Any]:
        self.send(now, sender, payload)
        return self.replies()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.close_pipes()

    def quit(self, now: float) -> None:
        write_frame(self.stdin, ["quit", int(now * 1000), "", b""])
        assert self.proc.wait(timeout=20) == 0
        self.close_pipes()

    def close_pipes(self) -> None:
        self.stdin.close()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.mark.timeout(120)
def test_trainer_killed_mid_step_resumes_without_loss_or_double_count(tmp_path: Path) -> None:
    from swarm.roles.trainer_state import TrainerState

    rng = random.Random(6)
    trainer_key = Identity.from_seed(TRAINER_SEED).public_key
    idents = [Identity.from_seed(bytes([97 + i]) * 32) for i in range(6)]
    peers = {i.peer_id: PeerLeases(i, trainer_key, RUN) for i in idents}
    now = 1000.0
    proc = TrainerProcess(tmp_path, now)
    assert proc.ready == ["ready", True, 0]
    accepted_seen: list[int] = []  # task ids whose ACCEPTED verdict a peer received
    duplicate_seen: list[int] = []  # task ids a resend found already counted

    def tally(verdict: Verdict, data: bytes) -> None:
        if verdict.reason is Reason.ACCEPTED:
            accepted_seen.extend(verdict.accepted)
        else:  # the listed tasks, or (empty list) the whole lease, were counted before
            sent_result = decode_message(data)
            assert isinstance(sent_result, Result)
            duplicate_seen.extend(verdict.accepted or sent_result.task_ids)
    kills = 0
    leases_before_kill: set[bytes] = set()
    leases_used_after: set[bytes] = set()
    for _round in range(12):
        if len(set(accepted_seen) | set(duplicate_seen)) >= N_TASKS:
            break
        now += 1.0
        for pid, peer in peers.items():
            claim = peer.claim(now, tokens_per_s=rng.uniform(4.0, 12.0), version=0, want=8)
            for reply in proc.ask(now, pid, claim.encode()):
                peer.receive(reply, now)
        now += 2.0
        # Results one task at a time, all pipelined: many commits in flight at the kill.
        pending: list[tuple[str, bytes, bytes]] = []
        for pid, peer in peers.items():
            for lid, held in list(peer.held.items()):
                for task in held.lease.tasks:
                    if task.task_id in held.counted:
                        continue
                    row = TaskResult(task.task_id, tuple(
                        Completion((task.task_id, 5, 6), (-0.5, -0.25, -1.0))
                        for _ in range(task.group_size)))
                    res = peer.result(lid, 0, [row], now)
                    pending.append((pid, lid, res.encode()))
        if not pending:
            write_frame(proc.stdin, ["tick", int(now * 1000), "", b""])
            proc.replies()
            continue
        # Before a kill, the last third is held back (the peers had not finished it yet).
        sent = len(pending) if kills >= 3 or len(pending) < 3 else 2 * len(pending) // 3
        for pid, _, data in pending[:sent]:
            proc.send(now, pid, data)
        answered = rng.randint(1, max(1, sent // 2)) if sent < len(pending) else sent
        for pid, _lid, data in pending[:answered]:
            [verdict] = proc.replies()
            assert isinstance(verdict, Verdict)
            assert verdict.reason in (Reason.ACCEPTED, Reason.DUPLICATE), verdict
            tally(verdict, data)
            peers[pid].receive(verdict, now)
        if answered == len(pending):
            continue
        proc.kill()  # mid-step: the child is still reading and committing results
        kills += 1
        leases_before_kill |= {lid for _, lid, _ in pending}
        now += 5.0  # downtime
        proc = TrainerProcess(tmp_path, now)
        assert proc.ready[0] == "ready" and proc.ready[1] is False
        assert proc.ready[2] >= len(set(accepted_seen)), "an acknowledged result was lost"
        # Peers resend every result whose verdict they never saw, on their old leases.
        for pid, lid, data in pending[answered:]:
            [verdict] = proc.ask(now, pid, data)
            assert isinstance(verdict, Verdict)
            assert verdict.reason in (Reason.ACCEPTED, Reason.DUPLICATE), verdict
            if verdict.reason is Reason.ACCEPTED:
                leases_used_after.add(lid)
            elif (pid, lid, data) in pending[sent:]:
                raise AssertionError("a result never sent before the kill was not accepted")
            tally(verdict, data)
            peers[pid].receive(verdict, now)
    proc.quit(now)
    print(f"kills={kills} accepted_verdicts={len(accepted_seen)} "
          f"duplicates={len(duplicate_seen)} "
          f"leases_resumed={len(leases_used_after)}")
    assert kills >= 2
    assert len(accepted_seen) == len(set(accepted_seen)), "a task was acknowledged twice"
    assert leases_used_after & leases_before_kill, "pre-kill leases were honoured after restart"
    with TrainerState(tmp_path, run=RUN, trainer_key=trainer_key) as state:
        assert state.integrity_check() == "ok"
        assert state.journal_mode() == "wal"
        assert state.accepted_task_ids() == list(range(N_TASKS))
        assert set(accepted_seen) <= set(range(N_TASKS))
        # Every task counted once; those whose verdict was lost in a kill came back DUPLICATE.
        assert not set(accepted_seen) & set(duplicate_seen)
        assert set(accepted_seen) | set(duplicate_seen) == set(range(N_TASKS))
        for res in state.accepted_results():
            assert res.is_valid()
            assert res.signer_peer_id in peers
        snap = state.load()
        assert snap.done == frozenset(range(N_TASKS)) and not snap.queued


def test_lease_from_decoded_frame_is_a_lease() -> None:
    """The framing helpers round-trip lease bytes unchanged (guards the child protocol)."""
    ident = Identity.from_seed(TRAINER_SEED)
    t = TrainerLeases(ident, config())
    t.add_tasks([("p", [1])])
    peer_id = Identity.from_seed(b"z" * 32)
    claim = PeerLeases(peer_id, ident.public_key, RUN).claim(1.0, tokens_per_s=5.0, version=0,
                                                              want=1)
    [lease] = t.handle(claim.encode(), 1.0, sender=peer_id.peer_id)
    r, w = os.pipe()
    with os.fdopen(w, "wb") as out:
        write_frame(out, [lease.encode()])
    try:
        [data] = read_frame(r, timeout=5.0)
    finally:
        os.close(r)
    assert isinstance(decode_message(data), Lease)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    sys.exit(child_main(sys.argv[2]))
