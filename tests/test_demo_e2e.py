"""The README's demo, shortened: a bootstrap node, a trainer, 2 peers and a corrupt peer,
as real processes that find each other through the bootstrap node."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.long
@pytest.mark.timeout(600)
def test_demo_runs_verifies_every_version_and_bans_the_corrupt_peer(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "demo", "--dir", str(tmp_path), "--peers", "2",
         "--steps", "4", "--prompts", "16", "--quiet", "--corrupt-peer", "--bootstrap-node",
         "--timeout", "500"],
        capture_output=True, text=True, timeout=560)
    assert "every live peer verified every version: True" in out.stdout, out.stdout[-3000:]
    assert "corrupt peer banned by others: yes" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["steps"]) == 4
    for name, peer in summary["peers"].items():
        if not peer["corrupt"]:
            assert peer["verified"] == 5 and peer["failures"] == 0, name
    assert (tmp_path / "demo.png").stat().st_size > 10_000
