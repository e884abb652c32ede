"""``examples/trainer_loop.py`` as the README tells a newcomer to run it: the example
trainer, and a ``swarm peer`` pasted from what it prints, which takes its run card and
follows every version."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from swarmproc import SwarmProc

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trainer_loop.py"


def test_the_example_trainer_is_followed_by_a_pasted_swarm_peer(tmp_path: Path) -> None:
    err = (tmp_path / "trainer.stderr").open("w")
    trainer = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--listen", "/ip4/127.0.0.1/tcp/0",
         "--linger", "30"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True,
        stdin=subprocess.DEVNULL)
    lines: list[str] = []
    joined = threading.Event()

    def read() -> None:
        assert trainer.stdout is not None
        for line in trainer.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("peers join with:"):
                joined.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peer = None
    try:
        assert joined.wait(120), (tmp_path / "trainer.stderr").read_text()[-2000:]
        command = next(x for x in lines if x.startswith("peers join with:"))
        m = re.fullmatch(r"peers join with: swarm peer --bootstrap (\S+) --trainer (\S+)",
                         command)
        assert m is not None, command
        peer = SwarmProc("p0", ["peer", "--bootstrap", m[1], "--trainer", m[2],
                                "--data-dir", "p0"], tmp_path)
        card = peer.wait_event("card", 120)
        assert (card["model_type"], card["signer"]) == ("qwen3", m[2])
        peer.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= 2, 240,
                      "verified 2")
        assert trainer.wait(120) == 0
        reader.join(10)
        assert any(x.startswith("step 2: delta") for x in lines), lines
        assert lines[-1] == "last version reached 1 of 1 peers"
    finally:
        if peer is not None:
            peer.stop()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        reader.join(10)
        assert trainer.stdout is not None
        trainer.stdout.close()
        err.close()
