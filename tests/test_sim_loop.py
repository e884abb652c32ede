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
