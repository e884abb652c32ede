"""``examples/trainer_loop.py`` as the README tells a newcomer to run it: the example
trainer, and a ``swarm peer`` pasted from what it prints, which takes its run card and
follows every version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from swarmproc import SwarmProc

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trainer_loop.py"


def test_the_example_trainer_is_followed_by_a_pasted_swarm_peer(tmp_path: Path) -> None:
    trainer = SwarmProc.script(EXAMPLE, ["--steps", "2", "--listen", "/ip4/127.0.0.1/tcp/0",
                                         "--linger", "30"], tmp_path)
    peer = None
    try:
        command = trainer.wait_line("peers join with:", 120)
        m = re.fullmatch(r"peers join with: swarm peer --bootstrap (\S+) --trainer (\S+)",
                         command)
        assert m is not None, command
        peer = SwarmProc("p0", ["peer", "--bootstrap", m[1], "--trainer", m[2],
                                "--data-dir", "p0"], tmp_path)
        card = peer.wait_event("card", 120)
        assert (card["model_type"], card["signer"]) == ("qwen3", m[2])
        peer.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 2, 240,
                      "verified 2")
        assert trainer.wait_exit(120) == 0
        lines = trainer.stdout_lines
        assert any(x.startswith("step 2: delta") for x in lines), lines
        assert lines[-1] == "last version reached 1 of 1 peers"
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()
