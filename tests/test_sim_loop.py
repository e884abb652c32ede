"""The end-to-end loop model against closed forms, and ``swarm simulate --steps`` as a user
runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.sim.loop import LoopSpec, Method, simulate_loop
from swarm.sim.prices import tokens_per_usd, usd_per_hour

pytestmark = pytest.mark.timeout(60)

R, T, N = 10.0, 4.0, 3


def _run(staleness: int, sync: float, steps: int = 40):
    spec = LoopSpec(steps=steps, rollout_s=R, trainer_step_s=T, rates=(100.0,) * N)
    return simulate_loop(spec, Method("m", (sync,) * N, staleness))


def test_ideal_sync_leaves_no_actor_idle_when_generation_binds() -> None:
    res = _run(1, 0.0)
    assert res.actor_idle == pytest.approx(0.0, abs=1e-9)
    assert res.trainer_idle == pytest.approx(1 - T / R)
    assert res.tokens_per_s == pytest.approx(N * 100.0)
    assert res.exposed_sync_s == pytest.approx(0.0, abs=1e-9)


def test_on_policy_exposes_the_whole_sync() -> None:
    res = _run(0, 8.0)
    assert res.exposed_sync_s == pytest.approx(8.0)
    assert res.window_s / res.window_steps == pytest.approx(R + T + 8.0)


def test_one_step_off_policy_hides_a_rollout_of_the_sync() -> None:
    # two versions in flight: each step exposes half of (trainer step + sync - rollout)
    res = _run(1, 8.0)
    assert res.exposed_sync_s == pytest.approx((T + 8.0 - R) / 2)


def test_sync_longer_than_a_step_exposes_the_difference() -> None:
    # the network carries one version at a time: a step lasts one sync
    res = _run(1, 20.0)
    assert res.exposed_sync_s == pytest.approx(20.0 - R)
    assert res.tokens_per_s == pytest.approx(N * 100.0 * R / 20.0)


def _churned(per_min: float, seed: int):
    n = 24
    spec = LoopSpec(steps=60, rollout_s=R, trainer_step_s=T, rates=(100.0,) * n,
                    down=(1e12,) * n, delta_bytes=1e6, state_bytes=1e9,
                    churn_per_min=per_min, away_s=20.0, seed=seed)
    return simulate_loop(spec, Method("ideal", (0.0,) * n, 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_churn_costs_the_leases_lost_and_never_holds_the_trainer_back(seed: int) -> None:
    # actors leave every 100 s on average (their leases are lost) and are back 20 s later;
    # the trainer still steps once a rollout: it waits neither for one that left nor for
    # one that came back after its batch was under way (before: 78% idle, not 60%)
    res = _churned(60.0, seed)
    calm = _churned(0.0, seed)
    assert calm.trainer_idle == pytest.approx(1 - T / R)
    assert res.catch_up["leaves"] > 50 and res.lost_tokens > 0
    assert res.trainer_idle == pytest.approx(1 - T / R, abs=0.01)
    assert res.tokens_per_s < calm.tokens_per_s
    # what is generated is consumed: only the leavers' unfinished leases are missing
    assert res.tokens_per_s * res.window_s > 0.6 * calm.tokens_per_s * calm.window_s


def test_tokens_per_dollar() -> None:
    usd = usd_per_hour(4, 8, 2.0, 1.0, wan_gb_per_h=10.0, wan_gb=0.1)
    assert usd == pytest.approx(17.0)
    assert tokens_per_usd(1000.0, usd) == pytest.approx(3.6e6 / 17.0)


def test_simulate_paper_steps_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swarm", "simulate", "--preset", "paper", "--steps", "3",
         "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for name in ("swarm", "dense, one stream", "dense, multi-stream", "async dense",
                 "relay per region", "ideal (RDMA)"):
        assert name in text
    assert "tokens/$" in text and "paper 1.3-9.5x" in text and "within 8.91%" in text
    doc = json.loads((out / "result.json").read_text())
    assert [e["scenario"] for e in doc["end_to_end"]] == ["paper-4b", "paper-8b",
                                                           "paper-14b"]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_steps_with_churn_reports_catch_up_and_keeps_the_trainer_busy(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swarm", "simulate", "--peers", "16", "--steps", "12",
         "--churn-per-min", "20", "--away", "30", "--no-plot", "--quiet", "--out", str(out)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "churn (20%/min, away 30 s on average)" in proc.stdout
    assert "delta chains" in proc.stdout and "keyframes" in proc.stdout
    (run,) = json.loads((out / "result.json").read_text())["end_to_end"]
    swarm = next(m for m in run["methods"] if m["name"] == "swarm")
    churn = swarm["catch_up"]
    assert churn["leaves"] > 0 and churn["chain"] + churn["keyframe"] > 0
    # the trainer (20 s steps, 30 s rollouts) is idle only while the rollouts run
    assert swarm["trainer_idle"] == pytest.approx(1 / 3, abs=0.01)
