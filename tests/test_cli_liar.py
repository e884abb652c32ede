"""A silent liar on real processes: a peer (``swarm peer --chaos-liar``) announces every
chunk of every version and serves none. Honest peers keep verifying every version, time
its requests out and drop it as a neighbour, and say so. The trainer's uplink is slow
(0.4 Mbit/s: a delta takes seconds to leave it), so that requests to the liar are not
simply cancelled when the trainer answers first."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarmproc import cluster, step_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]
STEPS = 6


def test_a_peer_that_announces_chunks_and_serves_none_is_dropped(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", str(STEPS), "--min-peers", "3", "--uplink-mbps", "0.4")
        liar = c.peer("liar", "--chaos-liar", region="r1")
        liar_id = str(liar.wait_event("ready", 60)["peer_id"])
        honest = [c.peer("p0", region="r1"), c.peer("p1", region="r1")]
        last = t.wait_for(lambda e: e.get("event") == "step" and step_of(e) >= STEPS, 240,
                          f"step {STEPS}")
        # The trainer's slow uplink holds its verdicts back for seconds: the honest peers'
        # heartbeats that cross them cost nothing, and both work to the last step.
        honest_ids = {str(p.wait_event("ready", 5)["peer_id"]) for p in honest}
        assert not honest_ids & set(last["checks"]["banned"])
        for peer in honest_ids:
            assert max(map(int, last["checks"]["accepted"][peer])) >= STEPS - 2, peer
        for p in honest:
            p.wait_for(lambda e: e.get("event") == "verified" and e["version"] >= STEPS, 60,
                       f"verified {STEPS}")
            assert not p.of("verify_failed")
            assert sorted({int(e["version"]) for e in p.of("verified")}) == \
                list(range(STEPS + 1))
        dropped = [e for p in honest for e in p.of("dropped") if e["peer"] == liar_id]
        assert dropped, "no honest peer dropped the liar"
        assert all("unanswered" in e["reason"] for e in dropped)
        t.wait_event("done", 60)
