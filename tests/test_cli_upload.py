"""An advertised thin uplink, through the CLI: ``swarm peer --upload-mbps``.

Two peers in one region follow the demo trainer. One of them tells the others an uplink
that could not carry one of the demo's chunks within ``--last-resort`` (1 kbit/s), while
the trainer tells 100 Mbit/s: its region-mate asks the trainer, never it, for every chunk.
The control case, with nothing advertised, shows that the mate is otherwise a source.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from swarmproc import cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]

STEPS = 4


@pytest.mark.parametrize("thin", [True, False])
def test_a_mate_advertising_a_thin_uplink_is_not_asked(tmp_path: Path, thin: bool) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", str(STEPS), "--min-peers", "2", "--upload-mbps", "100")
        mate = c.peer("mate", *(["--upload-mbps", "0.001"] if thin else []), region="r1")
        other = c.peer("other", region="r1")
        mate_id = str(mate.wait_event("ready", 60)["peer_id"])
        assert mate.of("ready")[0]["upload_bps"] == (125 if thin else 0)
        for p in (mate, other):
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= STEPS, 120,
                       f"verified {STEPS}")
        t.wait_event("done", 60)
        got = [e for e in other.of("verified") if e["version"] >= 1]
        assert len(got) >= STEPS - 1
        from_mate = sum(e["bytes_by_peer"].get(mate_id, 0) for e in got)
        assert all(e["bytes_from_trainer"] > 0 for e in got)
        if thin:
            assert from_mate == 0, got
        else:
            assert from_mate > 0, got
