"""``swarm bench e2e`` in the kernel lab (root), as a user runs it: ``swarm lab bench``
with half of the peers behind NATs, and ``swarm lab compare``, the in-process shaper
against the kernel's tbf on one scenario. Both leave no namespace behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm.lab import kernel

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("needs_lab")]
SMALL = ["--params", "1M", "--steps", "2", "--timeout", "60"]


def _swarm(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return done


def _verified_by_all(figures: dict[str, Any], peers: int) -> None:
    assert [v["version"] for v in figures["versions"]] == [0, 1, 2]
    for v in figures["versions"]:
        assert len(v["peers"]) == peers, v  # a row per peer: each verified it
        assert v["all_s"] >= v["first_s"] > 0


@pytest.mark.timeout(200)
def test_netlab_bench_e2e_with_natted_peers(tmp_path: Path) -> None:
    before = kernel.namespaces()
    out = tmp_path / "lab.json"
    done = _swarm("lab", "bench", *SMALL, "--peers", "4", "--json", str(out), timeout=180)
    assert "4 peers (2 behind a NAT) in regions b, c of a network lab" in done.stdout
    assert "uplinks shaped by the kernel" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["shaping"] == "kernel" and figures["natted_peers"] == 2
    _verified_by_all(figures, 4)
    assert kernel.namespaces() == before


@pytest.mark.timeout(300)
def test_netlab_compare_shaper_and_kernel_side_by_side(tmp_path: Path) -> None:
    before = kernel.namespaces()
    out = tmp_path / "compare.json"
    done = _swarm("lab", "compare", *SMALL, "--peers", "2", "--json", str(out), timeout=280)
    lines = done.stdout.splitlines()
    head = lines.index("run  version  to every peer, shaper s  kernel s  shaper / kernel  "
                       "publish s, shaper  kernel")
    assert [x.split()[:2] for x in lines[head + 1:head + 3]] == [["1", "1"], ["1", "2"]]
    assert [x.split()[0] for x in lines[head + 3:head + 5]] == ["mean", "median"]
    assert any(x.startswith("result: the shaper and the kernel ") for x in lines)
    figures = json.loads(out.read_text())
    [shaper], [in_lab] = figures["shaper"], figures["kernel"]
    assert shaper["shaping"] == "in-process"
    assert in_lab["shaping"] == "kernel" and in_lab["natted_peers"] == 0
    _verified_by_all(shaper, 2)
    _verified_by_all(in_lab, 2)
    c = figures["comparison"]
    assert c["ratio"] == pytest.approx(c["shaper_mean_s"] / c["kernel_mean_s"])
    assert 0 < c["shaper_after_publish_s"] < c["shaper_mean_s"]
    assert 0 < c["kernel_after_publish_s"] < c["kernel_mean_s"]
    print("\n".join(lines[head:]))
    assert kernel.namespaces() == before
