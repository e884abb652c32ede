"""Untrusted rollouts on real processes: a `swarm trainer`, an honest `swarm peer` and a peer
started with ``--chaos-cheat STRATEGY``. Every strategy's results are refused by the
trainer's checks (none counts), the honest peer's never are, the cheater hears why, and the
demo prints the cheater's line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from swarmproc import cluster, step_of

from swarm.engines import CHEAT_STRATEGIES

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]
STEPS = 4


def test_every_cheating_peer_is_refused_and_the_honest_one_is_not(tmp_path: Path) -> None:
    """One cheater per strategy, side by side with one honest peer, in one run; every task
    is replayed (a cherry-picker is caught only on the tasks replays pick)."""
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", str(STEPS), "--min-peers", str(1 + len(CHEAT_STRATEGIES)),
                      "--prompts", "16", "--group", "4", "--replay-fraction", "1")
        honest = c.peer("p0", region="r1")
        cheaters = {s: c.peer(f"cheat-{s}", "--chaos-cheat", s, region="r1")
                    for s in CHEAT_STRATEGIES}
        ids = {s: str(p.wait_event("ready", 60)["peer_id"]) for s, p in cheaters.items()}
        honest_id = str(honest.wait_event("ready", 60)["peer_id"])
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= STEPS, 240,
                   f"step {STEPS}")
        checks = t.wait_event("done", 60)["checks"]
        assert honest_id not in checks["rejected"], checks
        assert checks["accepted"].get(honest_id), checks
        reasons = {e["reason"] for e in t.of("rejected")}
        for strategy, peer_id in ids.items():
            counted = dict(checks["accepted"].get(peer_id, {}))
            if strategy == "stale":  # one version late is right at version 0
                counted.pop("0", None)
            assert counted == {}, f"{strategy}: cheating results counted: {checks}"
            # it did work, and was told why it was refused
            if checks["rejected"].get(peer_id):
                told = cheaters[strategy].wait_event("rejected", 30)
                assert told["reason"] in reasons
        for strategy, peer_id in ids.items():
            if peer_id in checks["banned"]:  # and a banned peer says so, once
                cheaters[strategy].wait_event("work_refused", 30, reason="banned")
        tried = [s for s, peer_id in ids.items() if checks["rejected"].get(peer_id)]
        assert len(tried) >= len(CHEAT_STRATEGIES) - 1, (tried, checks)
        honest.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= STEPS, 60,
                        f"verified {STEPS}")
        assert sorted({int(e["version"]) for e in honest.of("verified")}) == \
            list(range(STEPS + 1))


def test_the_demo_with_a_cheater_says_what_became_of_it(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "demo", "--dir", str(tmp_path), "--peers", "2",
         "--steps", "4", "--prompts", "16", "--quiet", "--cheater", "fake-logprobs",
         "--timeout", "240"],
        capture_output=True, text=True, timeout=280)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("cheater: ")), "")
    assert line, out.stdout[-3000:]
    rejected = int(line.split()[1])
    assert rejected >= 1 and ", 0 accepted, banned after " in line, line
    assert line.endswith("honest peers' results rejected: 0"), line
    assert "every live peer verified every version: True" in out.stdout
    assert "the checks held: True" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    cheater = summary["peers"]["cheater"]  # it holds the right weights, yet its results fail
    assert cheater["verified"] >= 2 and cheater["failures"] == 0, cheater


def test_a_step_whose_results_are_all_refused_ends_in_one_error_line(tmp_path: Path) -> None:
    """Only a cheater joined: none of its results counts, and when --step-timeout runs
    out the trainer says which step starved and how to go on (it said only
    ``swarm: error:  (TimeoutError)``)."""
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "2", "--min-peers", "1", "--step-timeout", "20",
                      "--prompts", "4", "--group", "2")
        c.peer("cheat", "--chaos-cheat", "random")
        assert t.wait_exit(120) == 2
        last = t.stderr.strip().splitlines()[-1]
        assert last.startswith("swarm: error: step 1 got no accepted result"), last
        assert "--step-timeout 20 s" in last and "it resumes from trainer" in last, last
        rejected = int(last.split("rejected by the checks so far: ")[1].split(")")[0])
        assert rejected >= 1, last
        assert not t.of("step"), t.of("step")
