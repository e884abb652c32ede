"""``swarm bench e2e`` end to end at a test size: a trainer in the bench's process and two
``swarm peer`` processes over shaped links, every version verified by both peers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.timeout(240)]


def test_bench_e2e_reports_every_version_verified_by_every_peer(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "swarm", "bench", "e2e", "--params", "1M", "--steps", "2",
         "--peers", "2", "--timeout", "120", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    versions = {v["version"]: v for v in figures["versions"]}
    assert sorted(versions) == [0, 1, 2]
    for step in (1, 2):
        v = versions[step]
        assert v["kind"] == "delta"
        assert sorted(p["name"] for p in v["peers"]) == ["p0", "p1"]
        assert all(p["kind"] == "delta" for p in v["peers"])
        assert 0 < v["payload_bytes"] < v["dense_bytes"]
        assert 0 <= v["first_s"] <= v["all_s"]
        assert v["bound_s"] > 0 and v["egress_ratio"] > 0
    ratio = figures["ratios"]["egress_ratio"]
    assert isinstance(ratio, float) and ratio > 0
    assert set(figures["peak_rss_bytes"]) == {"trainer", "p0", "p1"}
    assert "ver kind     payload MB  dense MB  publish s" in done.stdout
    assert "ver peer  region  kind      fetch s" in done.stdout
    for line in ("all verified / (publish + bound + local):", "trainer egress / payload:",
                 "delta vs dense:", "peak RSS: trainer"):
        assert line in done.stdout
