"""A Hugging Face model end to end, as a user runs it: a 25M Qwen3 made offline with the
shipped tokenizer (warm-started on the task), ``examples/hf_trainer.py`` training it by
GRPO, and three ``swarm peer`` processes that know nothing of the model but the run card.
One has the model dir (``--base-weights``: it starts at version 0), two build the model
from the card and take one keyframe. Every version is verified on every peer, and the
peers' completions feed every step. In the vLLM venv (``make test-vllm``) the third peer
runs ``--engine vllm --check-engine``: its engine's per-tensor digests equal the verified
state's after every version."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from swarmproc import SwarmProc

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
STEPS = 3


@pytest.mark.parametrize("third", [
    pytest.param("torch", marks=pytest.mark.e2e),
    pytest.param("vllm", marks=pytest.mark.vllm),
])
def test_an_hf_model_trains_with_three_peers_built_from_its_card(tmp_path: Path, third: str
                                                                 ) -> None:
    model = tmp_path / "model"
    made = subprocess.run([sys.executable, "-m", "swarm.hf.model", str(model), "--params",
                           "25M", "--warm-start", "20"], capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert "a 25M Qwen3 with the shipped tokenizer" in made.stdout
    trainer = SwarmProc.script(EXAMPLE, ["--model-dir", str(model), "--steps", str(STEPS),
                                         "--min-peers", "3", "--listen", "/ip4/127.0.0.1/tcp/0",
                                         "--linger", "60"], tmp_path)
    peers: list[SwarmProc] = []
    try:
        join = trainer.wait_line("peers join with: swarm ", 300)
        argv = join.removeprefix("peers join with: swarm ").split()
        for i in range(3):
            extra = ["--base-weights", str(model)] if i == 0 else []
            if i == 2 and third == "vllm":
                extra = ["--engine", "vllm", "--check-engine"]
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
    lines = trainer.stdout_lines
    if third == "vllm":
        checks = peers[2].of("engine_checked")
        assert len(checks) >= 2  # at start, and after the keyframe and the deltas
        assert all(c["engine"] == c["state"] for c in checks), checks
    for i, p in enumerate(peers):
        got = sorted((e["version"], e["kind"]) for e in p.of("verified"))
        assert not p.of("verify_failed")
        if i == 2 and third == "vllm":
            # vLLM takes seconds to start after the node is up: the steps may begin
            # meanwhile, and the peer then catches up by one keyframe of the newest
            first = got[0][0]
            assert got[0][1] == "keyframe", (p.name, got)
            assert [v for v, _ in got] == list(range(first, STEPS + 1)), (p.name, got)
            continue
        assert [v for v, _ in got] == list(range(STEPS + 1)), (p.name, got)
        assert got[0] == (0, "local" if i == 0 else "keyframe"), (p.name, got)
    steps = [re.fullmatch(r"step (\d+): reward ([0-9.]+), (\d+) completions from (\d+) "
                          r"peer\(s\); delta (\d+) bytes \(([0-9.]+)x smaller than dense\); "
                          r"(\d+) result\(s\) refused by the checks so far", x)
             for x in lines if x.startswith("step ")]
    assert [int(m[1]) for m in steps if m] == list(range(1, STEPS + 1)), lines
    # every result was checked (log-probs recomputed, a tenth replayed): none refused
    assert all(int(m[7]) == 0 for m in steps if m), lines
    assert all(int(m[3]) == 16 * 4 for m in steps if m)
    assert max(int(m[4]) for m in steps if m) >= 2  # several peers fed the steps
    assert float(steps[0][2]) > 0  # the warm start left the policy some reward
    assert lines[-1] == "last version reached 3 of 3 peers"
