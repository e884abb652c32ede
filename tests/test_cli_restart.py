"""Restarts through the ``swarm`` command, as a user does them: real processes (a bootstrap
node, a trainer, peers) on loopback, stopped with signals and started again on their data
dirs. After each restart every live peer verifies each of the next versions published
after it came back (3 to 8 of them), within 10 s plus the transfer time.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from swarmproc import SwarmProc, cluster, step_of, verified

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: A version published after a peer is back must be verified this soon (the demo's deltas
#: are about 120 KB: the transfer time is negligible on loopback).
CATCH_UP_S = 10.0
#: ``--steps`` for a trainer that must outlast a restart however fast its steps go (about
#: a second each here): the test follows a window of versions after the restart and ends.
UNBOUNDED = "1000"


def _all_published_after(trainer: SwarmProc, peer: SwarmProc, since: int, last: int) -> None:
    """``peer`` verifies every version in ``since..last`` (each within CATCH_UP_S of it
    being published)."""
    for v in range(since, last + 1):
        trainer.wait_for(lambda e, v=v: e.get("event") == "step" and step_of(e) == v, 120,
                         f"step {v}")
        peer.wait_for(lambda e, v=v: e.get("event") == "verified" and e["version"] >= v,
                      CATCH_UP_S, f"verified {v}")


@pytest.mark.parametrize(("down_s", "at", "follow"), [(1.0, 4, 4), (12.0, 8, 8)])
def test_peer_sigint_then_restarted_follows_every_later_version(
        tmp_path: Path, down_s: float, at: int, follow: int) -> None:
    """The second case is the reported one: two peers, SIGINT to one at step 8, the same
    command again 12 s later (it stalled for good, 3 of 3 tries)."""
    import time

    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", UNBOUNDED, "--min-peers", "2")
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= at, 120, f"step {at}")
        p1.signal(signal.SIGINT)
        assert p1.wait_exit(30) == 130
        assert p1.stderr.splitlines()[-1].startswith(
            "swarm: stopped; the same command resumes from "), p1.stderr[-2000:]
        held = max(verified(p1))
        time.sleep(down_s)
        p1b = c.peer("p1", region="r2")
        resumed = p1b.wait_event("resumed", 60)
        assert resumed["version"] == held
        back = max(step_of(e) for e in t.of("step")) + 1
        _all_published_after(t, p1b, back, back + follow)
        _all_published_after(t, p0, back, back + follow)


def test_trainer_run_again_with_more_steps_is_followed(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "4", "--min-peers", "2", "--linger", "1")
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        t.wait_event("done", 120)
        assert t.wait_exit(60) == 0
        for p in (p0, p1):
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 4, 30,
                       "verified 4")
        t2 = c.trainer("--steps", "7", "--min-peers", "2")
        resumed = t2.wait_event("resumed", 60)
        assert resumed["step"] == 4
        for p in (p0, p1):
            _all_published_after(t2, p, 5, 7)
        t2.wait_event("done", 60)


def _corrupt_chunks(data_dir: Path) -> int:
    n = 0
    for f in sorted((data_dir / "chunks" / "chunks").rglob("*")):
        if f.is_file():
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            f.write_bytes(bytes(raw))
            n += 1
    return n


@pytest.mark.parametrize("state", ["empty", "truncated"])
def test_peer_with_corrupt_chunks_and_a_broken_state_file_recovers(tmp_path: Path,
                                                                    state: str) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", UNBOUNDED, "--min-peers", "2")
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= 3, 120, "step 3")
        p1.signal(signal.SIGINT)
        assert p1.wait_exit(30) == 130
        assert _corrupt_chunks(tmp_path / "p1") > 0
        saved = tmp_path / "p1" / "peer.state"
        raw = saved.read_bytes()
        saved.write_bytes(b"" if state == "empty" else raw[: len(raw) // 3])
        p1b = c.peer("p1", region="r2")
        refused = p1b.wait_event("resume_refused", 60)
        assert refused["error"]
        back = max(step_of(e) for e in t.of("step")) + 1
        _all_published_after(t, p1b, back, back + 3)
        _all_published_after(t, p0, back, back + 3)
        # and it does leased work again
        p1b.wait_event("result", 30)


def test_peer_back_after_longer_than_the_trainers_window_takes_a_keyframe(
        tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", UNBOUNDED, "--min-peers", "2", "--keep-versions", "2")
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= 3, 120, "step 3")
        p1.signal(signal.SIGINT)
        assert p1.wait_exit(30) == 130
        assert p1.stderr.splitlines()[-1].startswith(
            "swarm: stopped; the same command resumes from "), p1.stderr[-2000:]
        held = max(verified(p1))
        # the trainer moves past its window of kept deltas while p1 is down
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= held + 4, 120,
                   f"step {held + 4}")
        p1b = c.peer("p1", region="r2")
        assert p1b.wait_event("resumed", 60)["version"] == held
        back = max(step_of(e) for e in t.of("step")) + 1
        _all_published_after(t, p1b, back, back + 3)
        _all_published_after(t, p0, back, back + 3)
        assert any(e["kind"] == "keyframe" for e in p1b.of("verified"))


def test_trainer_sigkilled_mid_publish_then_restarted_is_followed(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "9", "--min-peers", "2", "--chaos-kill-mid-publish", "4")
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        assert t.wait_exit(180) == -signal.SIGKILL
        assert not t.of("step") or max(step_of(e) for e in t.of("step")) == 3
        t2 = c.trainer("--steps", "9", "--min-peers", "2")
        assert t2.wait_event("resumed", 60)["step"] == 4  # written before the kill
        for p in (p0, p1):
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 4, 30,
                       "verified 4 (never announced before the kill)")
            _all_published_after(t2, p, 5, 9)
        t2.wait_event("done", 60)
