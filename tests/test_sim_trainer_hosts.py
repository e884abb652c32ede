"""The simulator with a sharded trainer: several trainer hosts, each seeding its share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.errors import LocalProtocolError
from swarm.sim import baselines
from swarm.sim.bounds import lower_bound
from swarm.sim.engine import SwarmResult, SwarmSim
from swarm.sim.report import run_step
from swarm.sim.scenario import PRESETS, Scenario, from_mapping

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("quiet_exchange_bans")]




def _run(sc: Scenario) -> tuple[SwarmSim, SwarmResult]:
    sim = SwarmSim(sc.build())
    return sim, sim.run()


def test_shares_are_contiguous_in_rank_order_and_cover_every_chunk() -> None:
    sc = PRESETS["small"].with_(trainer_hosts=3)
    n = len(sc.chunk_sizes())
    shares = [sc.host_chunks(h) for h in range(3)]
    assert [k for s in shares for k in s] == list(range(n))
    assert all(n // 3 <= len(s) <= n // 3 + 1 for s in shares)
    pop = sc.build()
    assert pop.hosts == 3 and pop.peers == list(range(3, 3 + sc.peers))
    assert pop.topo.up[:3] == (pop.topo.up[0],) * 3
    assert pop.topo.region[:3] == (sc.trainer_region,) * 3


@pytest.mark.parametrize("seed", [0, 1])
def test_two_hosts_each_seed_about_half_and_only_their_own_chunks(seed: int) -> None:
    sc = PRESETS["small"].with_(trainer_hosts=2, seed=seed)
    sim, res = _run(sc)
    assert res.completion_s is not None and res.bit_exact
    assert res.honest_done == res.honest_total == sc.peers
    assert len(res.host_egress) == 2
    assert sum(res.host_egress) == pytest.approx(res.trainer_egress)
    for b in res.host_egress:
        assert 0.25 * res.trainer_egress <= b <= 0.75 * res.trainer_egress
    assert res.host_stray == 0
    for h in range(2):
        # a host fetches nothing: it ends with its own share and no other chunk
        share = set(sc.host_chunks(h))
        held = {k for k in range(len(sim.spec.chunk_ids))
                if sim.cores[h].chunk(sim.spec.obj, k) is not None}
        assert held == share
    single = _run(sc.with_(trainer_hosts=1))[1]
    for b in res.host_egress:
        assert 0.25 * single.trainer_egress <= b <= 0.75 * single.trainer_egress


def test_four_hosts_reach_every_peer_and_split_the_egress() -> None:
    rep = run_step(PRESETS["small"].with_(trainer_hosts=4), 0)
    assert rep.swarm.bit_exact and rep.swarm.honest_done == rep.peers
    assert rep.swarm.host_stray == 0
    assert all(0.1 <= x / sum(rep.host_egress_x) <= 0.4 for x in rep.host_egress_x)
    unicast = next(r for r in rep.rows if r.name == "trainer-only unicast")
    assert unicast.trainer_egress_x == pytest.approx(rep.peers, rel=1e-6)


def test_one_host_gives_the_single_trainer_figures_exactly() -> None:
    # measured on the small preset before the simulator had trainer hosts (and import
    # ranks from a directory: with ranks over neighbours, as then)
    rep = run_step(PRESETS["small"].with_(import_ranks="neighbours"), 0)
    assert rep.swarm.completion_s == 1.080021229250933
    assert rep.swarm.trainer_egress == 21643887.999999996
    assert rep.swarm.host_egress == [21643887.999999996]
    assert rep.swarm.events == 2175
    assert rep.swarm.peer_done[8] == 1.080021229250933
    assert rep.swarm.peer_done[2] == 0.7132256924057407
    assert rep.bound.seconds == 0.43733333333333335
    assert [r.completion_s for r in rep.rows[1:]] == [
        2099.2900000000004, 2.1892, 0.6485561173333334]
    assert rep.to_json()["trainer_hosts"] == 1


def test_lower_bound_counts_every_host() -> None:
    sc = PRESETS["homogeneous"].with_(peers=8, trainer_up_gbps=0.25)
    payload = sc.payload_bytes
    one = sc.build()
    four = sc.with_(trainer_hosts=4).build()
    lb1 = lower_bound(one.topo, one.peers, payload, sc.regions)
    shares = {h: payload / 4 for h in range(4)}
    lb4 = lower_bound(four.topo, four.peers, payload, sc.regions, shares)
    assert lb4.terms["source"] == pytest.approx(lb1.terms["source"] / 4)
    assert lb4.terms["total_upload"] < lb1.terms["total_upload"]
    assert {k: v for k, v in lb4.terms.items() if k.startswith("wan_cut")} == {
        k: v for k, v in lb1.terms.items() if k.startswith("wan_cut")}


def test_baselines_send_each_share_from_its_host() -> None:
    pop = PRESETS["small"].with_(trainer_hosts=2).build()
    sizes = pop.scenario.chunk_sizes()
    b = baselines.unicast(pop.topo, pop.peers, sizes, hosts=2)
    assert b.trainer_egress == pytest.approx(len(pop.peers) * sum(sizes), rel=1e-6)
    assert b.completion_s < baselines.unicast(pop.topo, pop.peers, sizes).completion_s


@pytest.mark.parametrize("bad", [0, -1, 65, 2.5, True, "2"])
def test_bad_host_counts_are_refused(bad: object) -> None:
    with pytest.raises(LocalProtocolError, match="trainer_hosts"):
        from_mapping({"trainer_hosts": bad}, PRESETS["wan64"])


def test_more_hosts_than_chunks_are_refused() -> None:
    sc = PRESETS["small"]
    with pytest.raises(LocalProtocolError, match="number of chunks"):
        sc.with_(trainer_hosts=len(sc.chunk_sizes()) + 1).check()


def test_cli_reports_egress_per_host(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--preset", "small", "--peers", "6", "--trainer-hosts", "2",
               "--sweep", "", "--no-plot", "--no-baselines", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 trainer hosts" in text and "egress per host" in text
    step = json.loads((tmp_path / "result.json").read_text())["steps"][0]
    assert step["trainer_hosts"] == 2
    assert len(step["host_egress_bytes"]) == len(step["host_egress_x"]) == 2
    assert sum(step["host_egress_bytes"]) == pytest.approx(step["trainer_egress_bytes"])


def test_cli_refuses_a_bad_host_count(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--preset", "small", "--trainer-hosts", "0", "--quiet",
               "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["swarm: error: --trainer-hosts 0: must be at least 1"]
