"""Fault scenarios over the in-memory network in virtual time; each prints its figures."""

from __future__ import annotations

import pytest

from swarm.errors import LocalProtocolError
from swarm.sim.lease_faults import SCENARIOS, ScenarioReport, run_scenario

pytestmark = pytest.mark.timeout(120)


def run(name: str, seed: int) -> ScenarioReport:
    report = run_scenario(name, seed=seed)
    print(report.summary())
    assert report.finished, "every task counted within the time and event bounds"
    assert report.lost == 0
    assert report.double_counted == 0
    assert report.tasks_completed == report.tasks
    return report


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_30_percent_of_peers_mid_lease(seed: int) -> None:
    r = run("kill", seed)
    assert r.affected_peers == 6
    assert r.leases_expired >= r.affected_peers  # each dead holder's lease expired ...
    assert r.tasks_reissued > 0  # ... and its tasks were handed to someone else
    assert r.tasks_issued == r.tasks + r.tasks_reissued


@pytest.mark.parametrize("seed", [1, 2])
def test_forged_leases_replays_and_late_results_are_refused_and_scored(seed: int) -> None:
    r = run("forgery", seed)
    # Honest peers refused every forged lease (half foreign-signed, half bad signatures).
    assert r.peer_refused.get("foreign_lease", 0) == 20
    assert r.peer_refused.get("bad_signature", 0) == 20
    # The trainer refused every replay: relayed as-is, or re-signed by the attacker.
    assert r.refused.get("sender_mismatch", 0) == 20
    assert r.refused.get("not_holder", 0) + r.refused.get("duplicate", 0) >= 20
    # The late submitter's result for its expired lease was refused.
    assert r.refused.get("expired", 0) >= 1
    assert r.banned >= 1  # the replayer is banned from claiming work


@pytest.mark.parametrize("seed", [1, 2])
def test_partitioned_region_leases_expire_and_late_results_are_refused(seed: int) -> None:
    r = run("partition", seed)
    assert r.leases_expired >= r.affected_peers
    assert r.tasks_reissued > 0
    assert r.refused.get("expired", 0) >= 1  # late results after healing, refused cleanly
    assert r.refused.get("duplicate", 0) == 0


@pytest.mark.parametrize("seed", [1, 2])
def test_trainer_crash_and_restart_mid_step(seed: int) -> None:
    r = run("restart", seed)
    # The result committed just before the crash lost its verdict; its resend is a duplicate.
    assert r.refused.get("duplicate", 0) >= 1


@pytest.mark.parametrize("seed", [1, 2])
def test_stragglers_are_reissued_not_waited_for(seed: int) -> None:
    r = run("stragglers", seed)
    baseline = run("baseline", seed)
    assert r.leases_expired >= 1 and r.tasks_reissued > 0
    assert r.tasks_backup > 0  # overdue leases got backups once the queue ran dry ...
    assert r.virtual_s < 1.6 * baseline.virtual_s  # ... so the tail did not wait for them
    assert baseline.leases_expired == 0 and baseline.tasks_reissued <= baseline.tasks // 50


def test_scenarios_are_deterministic_and_named() -> None:
    assert run_scenario("kill", seed=5) == run_scenario("kill", seed=5)
    with pytest.raises(LocalProtocolError):
        run_scenario("meteor")
    assert set(SCENARIOS) >= {"kill", "forgery", "partition", "restart"}
    assert "tasks=600" in run_scenario("baseline", seed=1).summary()
