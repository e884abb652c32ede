"""A Hugging Face model end to end, as a user runs it: a 25M Qwen3 made offline with the
shipped tokenizer (warm-started on the task), ``examples/hf_trainer.py`` training it by
GRPO, and three ``swarm peer`` processes that know nothing of the model but the run card.
One has the model dir (``--base-weights``: it starts at version 0), two build the model
from the card and take one keyframe. Every version is verified on every peer, and the
peers' completions feed every step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from swarmproc import ScriptProc, SwarmProc

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.e2e]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
STEPS = 3


def test_an_hf_model_trains_with_three_peers_built_from_its_card(tmp_path: Path) -> None:
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, "-m", "swarm.hf.model", str(model), "--params",
                           "25M", "--warm-start", "20"], capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert "a 25M Qwen3 with the shipped tokenizer" in made.stdout
    trainer = ScriptProc(EXAMPLE, ["--model-dir", str(model), "--steps", str(STEPS),
                                   "--min-peers", "3", "--listen", "/ip4/127.0.0.1/tcp/0",
                                   "--linger", "60"], tmp_path)
    peers: list[SwarmProc] = []
    try:
        join = trainer.wait_line("peers join with: swarm ", 300)
        argv = join.removeprefix("peers join with: swarm ").split()
        for i in range(3):
            extra = ["--base-weights", str(model)] if i == 0 else []
            peers.append(SwarmProc(f"p{i}", [*argv, "--data-dir", f"p{i}", "--name", f"p{i}",
                                             "--region", f"r{i % 2}", *extra], tmp_path))
        for p in peers:
            card = p.wait_event("card", 300)
            assert (card["model_type"], card["dtype"]) == ("qwen3", "bfloat16")
            assert card["files"]["tokenizer.json"] > 10_000
            assert card["stop_token_ids"] == [0, 2]
        for p in peers:
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= STEPS, 600,
                       f"verified {STEPS}")
        assert trainer.wait_exit(300) == 0, trainer.stderr[-2000:]
    finally:
        for p in peers:
            p.stop()
        trainer.stop()
    lines = trainer.lines
    for i, p in enumerate(peers):
        got = {(e["version"], e["kind"]) for e in p.of("verified")}
        assert {v for v, _ in got} >= set(range(STEPS + 1)), (p.name, got)
        first = "local" if i == 0 else "keyframe"
        assert (0, first) in got, (p.name, got)
        assert not p.of("verify_failed")
    steps = [re.fullmatch(r"step (\d+): reward ([0-9.]+), (\d+) completions from (\d+) "
                          r"peer\(s\); delta (\d+) bytes \(([0-9.]+)x smaller than dense\)", x)
             for x in lines if x.startswith("step ")]
    assert [int(m[1]) for m in steps if m] == list(range(1, STEPS + 1)), lines
    assert all(int(m[3]) == 16 * 4 for m in steps if m)
    assert max(int(m[4]) for m in steps if m) >= 2  # several peers fed the steps
    assert float(steps[0][2]) > 0  # the warm start left the policy some reward
    assert lines[-1] == "last version reached 3 of 3 peers"
