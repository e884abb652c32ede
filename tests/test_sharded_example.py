"""``examples/sharded_trainer.py`` as the README tells a user to run it: an FSDP2 job of 2
CPU processes, rank 0 the trainer and rank 1 a seeder host, and two ``swarm peer``
commands pasted from what it prints. Each peer verifies every version, and takes its chunks
from both hosts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from swarmproc import SwarmProc

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.long]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sharded_trainer.py"


def test_sharded_trainer_example_is_followed_by_pasted_swarm_peers(tmp_path: Path) -> None:
    job = SwarmProc.script(EXAMPLE, ["--ranks", "2", "--steps", "3", "--min-peers", "2",
                                     "--linger", "60"], tmp_path)
    peers: list[SwarmProc] = []
    try:
        command = job.wait_line("peers join with:", 180)
        m = re.fullmatch(r"peers join with: swarm peer --run sharded --bootstrap (\S+) "
                         r"--trainer (\S+)", command)
        assert m is not None, command
        for name in ("p0", "p1"):
            peers.append(SwarmProc(name, ["peer", "--run", "sharded", "--bootstrap", m[1],
                                          "--trainer", m[2], "--data-dir", name], tmp_path))
        for p in peers:
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 3, 240,
                       "verified 3")
            assert p.wait_event("verified", 10, version=0)["kind"] == "local"
            assert not p.of("verify_failed")
        assert job.wait_exit(120) == 0
        lines = job.stdout_lines
        for step in (1, 2, 3):
            assert any(x.startswith(f"step {step}: delta") and "1 of 2 chunks seeded here"
                       in x for x in lines), lines
        assert "last version reached 2 of 2 peers" in lines
        uploaded = {int(r[1]): int(r[2]) for x in lines
                    if (r := re.fullmatch(r"rank (\d) \(\S+\) uploaded (\d+) bytes", x))}
        assert set(uploaded) == {0, 1} and min(uploaded.values()) > 0, lines
        # the peers took their deltas from the trainer's hosts
        for p in peers:
            last = [e for e in p.of("verified") if e["version"] >= 1]
            assert all(e["bytes_from_trainer"] > 0 for e in last)
    finally:
        for p in peers:
            p.stop()
        job.stop()
