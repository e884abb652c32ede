"""The network lab's planning and its refusals, without root: names, addresses, routes,
NATs, the scenario's checks, and the one-line reason where the lab cannot run."""

from __future__ import annotations

import ipaddress

import pytest

from swarm.lab import kernel
from swarm.lab.plan import (
    IFNAMSIZ,
    PlanError,
    Scenario,
    is_prefix,
    nat_indices,
    new_prefix,
    parse_rates,
    plan,
)
from swarm.net.reach import PRIVATE, PUBLIC, UNKNOWN, Reach

# With the lab runs in make test-long, so that `pytest -m long -k netlab` runs them all.
pytestmark = [pytest.mark.long, pytest.mark.timeout(60)]


def test_prefixes_are_fresh_and_recognised() -> None:
    seen = {new_prefix() for _ in range(50)}
    assert len(seen) > 40
    assert all(is_prefix(p) for p in seen)
    assert not is_prefix("swl12") and not is_prefix("abc12345") and not is_prefix("swlzzzzz")


def test_plan_names_addresses_and_nats() -> None:
    p = plan(Scenario(peers=6, nat_fraction=0.5), prefix="swl0abcd")
    assert all(ns.startswith("swl0abcd-") for ns in p.namespaces)
    assert len(set(p.namespaces)) == len(p.namespaces)
    names = p.interfaces()
    assert len(set(names)) == len(names)
    assert all(n.startswith("swl0abcd") and len(n) <= IFNAMSIZ for n in names)
    # Every address is in the lab's range and used once.
    addrs = [a for ln in p.links for a in (ln.a_addr, ln.b_addr)]
    assert len(set(addrs)) == len(addrs)
    assert all(ipaddress.IPv4Address(a) in ipaddress.IPv4Network("10.77.0.0/16") for a in addrs)
    boot, trainer = p.host("bootstrap"), p.host("trainer")
    assert boot.region == trainer.region == "a" and not boot.natted and not trainer.natted
    peers = p.peers
    assert [h.name for h in peers] == [f"p{i}" for i in range(6)]
    assert {h.region for h in peers} == {"b", "c"}
    natted = [h for h in peers if h.natted]
    assert [h.name for h in natted] == ["p3", "p4", "p5"]
    assert len(p.nats) == 3 and {n.ns for n in p.nats} <= set(p.forwarders)
    for h in natted:
        assert h.nat is not None
        # It listens on its home LAN; others see its NAT's WAN address.
        assert ipaddress.IPv4Address(h.addr) in ipaddress.IPv4Network(h.nat.lan_net)
        assert h.seen_as == h.nat.wan_addr != h.addr
        assert ipaddress.IPv4Address(h.addr) in ipaddress.IPv4Network("10.77.128.0/17")
    for h in peers:
        if not h.natted:
            assert h.seen_as == h.addr
    # Uplink classes dealt round-robin and shaped on the host's own side.
    assert [h.uplink_mbps for h in peers] == [100, 50, 20, 100, 50, 20]
    shaped = {ln.a_ns: ln.a_mbps for ln in p.links if ln.a_mbps}
    assert shaped[p.host("p2").ns] == 20 and shaped[trainer.ns] == 100
    # The core drops the home LANs: a dial of a private address goes nowhere.
    core = p.namespaces[0]
    assert any(r.ns == core and r.kind == "blackhole" and r.dest == "10.77.128.0/17"
               for r in p.routes)
    # Every namespace but the core has a default route.
    with_default = {r.ns for r in p.routes if r.dest == "default"}
    assert with_default == set(p.namespaces) - {core}


def test_nat_fraction_and_indices() -> None:
    assert nat_indices(4, 2) == [2, 3]
    assert nat_indices(4, 0) == [] and nat_indices(3, 3) == [0, 1, 2]
    assert Scenario(peers=4, nat_fraction=0.5).nat_count == 2
    assert Scenario(peers=5, nat_fraction=0.5).nat_count == 3
    assert not any(h.natted for h in plan(Scenario(peers=3, nat_fraction=0.0)).hosts)
    assert all(h.natted for h in plan(Scenario(peers=3, nat_fraction=1.0)).peers)


@pytest.mark.parametrize("bad", [
    Scenario(peers=0), Scenario(nat_fraction=1.5), Scenario(uplinks=(10.0, -1.0)),
    Scenario(uplinks=()), Scenario(trainer_mbps=0.0), Scenario(regions=("a",)),
    Scenario(regions=("a", "a")), Scenario(base="8.8.0.0/16"), Scenario(base="10.77.0.0/24"),
    Scenario(peers=200, regions=("a", "b")), Scenario(peers=300, nat_fraction=1.0),
])
def test_unbuildable_scenarios_are_refused(bad: Scenario) -> None:
    with pytest.raises(PlanError):
        plan(bad)


def test_parse_rates() -> None:
    assert parse_rates("100,50,20") == (100.0, 50.0, 20.0)
    for bad in ("", "fast", "10,-5", "nan"):
        with pytest.raises(PlanError):
            parse_rates(bad)


def test_reach_verdicts() -> None:
    assert Reach("10.77.11.2", (4003, 5000)).verdict("10.77.11.2", (4003, 5000)) == PUBLIC
    assert not Reach("10.77.11.2", ()).seen_elsewhere("10.77.11.2")
    # Behind a NAT: seen as the NAT's address, where the ports do not answer.
    assert Reach("10.77.11.6", ()).verdict("10.77.128.2", (4003, 5000)) == PRIVATE
    # A firewall: the address is right but a port did not answer the dial-back.
    assert Reach("10.77.11.2", (4003,)).verdict("10.77.11.2", (4003, 5000)) == PRIVATE
    # Listening on every interface, or a port forward: reachable where it is seen.
    assert Reach("10.77.11.2", (4003,)).verdict("0.0.0.0", (4003,)) == PUBLIC
    assert Reach("10.77.11.2", (4003,)).seen_elsewhere("0.0.0.0")
    assert Reach("10.77.11.6", (4003,)).verdict("10.77.128.2", (4003,)) == PUBLIC
    assert Reach("10.77.11.6", ()).verdict("0.0.0.0", (4003,)) == PRIVATE
    assert Reach("10.77.11.2", ()).verdict("10.77.11.2", ()) == UNKNOWN
    # A bootstrap on the same host, reached over loopback, says nothing about others.
    assert Reach("127.0.0.1", ()).verdict("10.77.11.2", (4003,)) == UNKNOWN
    assert Reach("127.0.0.1", (4003,)).verdict("0.0.0.0", (4003,)) == UNKNOWN
    assert Reach("127.0.0.1", ()).verdict("127.0.0.2", (4003,)) == PRIVATE


def test_not_root_is_one_clear_line(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(kernel.os, "geteuid", lambda: 1000)
    with pytest.raises(kernel.LabUnavailable, match="needs root"):
        kernel.check_available()
    from swarm.cli.main import main

    assert main(["lab", "run", "--peers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("swarm: error: the network lab needs root")
    assert main(["lab", "cleanup"]) == 2


def test_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel.os, "geteuid", lambda: 0)
    real = kernel.shutil.which
    monkeypatch.setattr(kernel.shutil, "which",
                        lambda name: None if name == "iptables" else real(name))
    if any(real(t) is None for t in ("ip", "tc", "setpriv")):
        pytest.skip("ip, tc or setpriv missing here")
    with pytest.raises(kernel.LabUnavailable, match=r"iptables.*apt-get install iptables"):
        kernel.check_available()


def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from swarm.cli.main import main

    assert main(["lab", "run", "--uplinks", "fast"]) == 2
    assert main(["lab", "run", "--nat-fraction", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("swarm: error: ") for e in err)


@pytest.mark.parametrize("argv, message", [
    (["lab", "compare", "--runs", "0"], "--runs must be 1-20"),
    (["lab", "bench", "--peers", "0"], "--steps, --peers and --chunk-kib must be at least 1"),
    (["bench", "e2e", "--placement", "/nonexistent/p.json"], "cannot read placement"),
    (["bench", "e2e", "--peer-regions", "a b"], "--trainer-region and --peer-regions"),
])
def test_the_lab_benchmarks_refuse_bad_input_in_one_line(argv: list[str], message: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.stdout, done.stderr)
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("swarm: error: ") and message in err[0], err
