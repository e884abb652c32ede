"""A have-summary flood on real processes: a peer (``swarm peer --chaos-flood-haves``)
sends every neighbour, twice a second, summaries of 8 made-up objects of 2^18 chunks with
every bit set. Honest peers keep verifying every version, keep none of it, score the
flooder and drop it as a neighbour, and say so."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarmproc import cluster, step_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
STEPS = 4


def test_a_peer_that_floods_have_summaries_is_scored_and_dropped(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", str(STEPS), "--min-peers", "2", "--uplink-mbps", "0.4")
        flooder = c.peer("flooder", "--chaos-flood-haves", region="r1")
        flooder_id = str(flooder.wait_event("ready", 60)["peer_id"])
        honest = [c.peer("p0", region="r1"), c.peer("p1", region="r1")]
        t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= STEPS, 240,
                   f"step {STEPS}")
        for p in honest:
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= STEPS, 60,
                       f"verified {STEPS}")
            assert not p.of("verify_failed")
            assert sorted({int(e["version"]) for e in p.of("verified")}) == \
                list(range(STEPS + 1))
        dropped = [e for p in honest for e in p.of("dropped") if e["peer"] == flooder_id]
        assert {e["node"] for e in dropped} == {"p0", "p1"}, dropped
        assert all("past the allowance" in e["reason"] for e in dropped)
        t.wait_event("done", 60)
