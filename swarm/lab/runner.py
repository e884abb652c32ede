"""``swarm lab run``: a swarm in the kernel network lab, half of its peers behind NATs.

It builds the lab (:mod:`swarm.lab.kernel`): region ``a`` holds a ``swarm bootstrap``
and the ``swarm trainer`` (the demo model), both public; ``--peers`` ``swarm peer``
processes sit in the other regions, the last ``--nat-fraction`` of them each behind its
own home NAT (MASQUERADE: it dials out, nobody dials in), each uplink shaped by a tbf to
its class's rate (``--uplinks``). Every process is the CLI a user runs, inside its
namespace, listening on its lab address. It prints a line per version as each peer
verifies it, then a summary (per peer: NATed or not, versions verified, bytes up and
down, sync time; the trainer's egress; sync time per version) and tears the lab down,
Ctrl-C and SIGTERM included. ``swarm lab cleanup`` removes what killed runs left.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.bench.procs import BenchError, Event, SwarmChild, say, stop_children, workdir
from swarm.lab.kernel import Lab, LabError, check_available
from swarm.lab.plan import Host, PlanError, Scenario, parse_rates, plan

RUN = "lab"
PORTS = {"bootstrap": 4001, "trainer": 4002, "peer": 4003}
RELAY_PORT = 4011


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=int, default=4, help="rollout peers (default 4)")
    p.add_argument("--nat-fraction", type=float, default=0.5, metavar="F",
                   help="share of the peers behind a home NAT each (default 0.5)")
    p.add_argument("--steps", type=int, default=3,
                   help="versions the trainer publishes after version 0 (default 3)")
    p.add_argument("--uplinks", default="100,50,20", metavar="MBPS,...",
                   help="the peer classes' uplink rates in Mbit/s, dealt round-robin "
                        "(default 100,50,20)")
    p.add_argument("--trainer-mbps", type=float, default=2.0,
                   help="the trainer's uplink in Mbit/s (default 2: a delta of the demo "
                        "model takes about a second to leave it, so peers trade chunks)")
    p.add_argument("--regions", type=int, default=3,
                   help="regions: the trainer's, then those of the peers (default 3)")
    p.add_argument("--prompts", type=int, default=8, help="the trainer's prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--chunk-kib", type=int, default=16,
                   help="the trainer's delta chunk size in KiB (default 16: peers have "
                        "chunks to trade)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="most seconds for a process to start or a version to reach a peer")
    p.add_argument("--listen-any", action="store_true",
                   help="peers listen on 0.0.0.0, as the volunteer command in the README "
                        "(default: on their lab address)")
    p.add_argument("--no-relay", action="store_true",
                   help="the bootstrap runs no relay (NATed peers then reach only public "
                        "ones)")
    p.add_argument("--symmetric-nat", action="store_true",
                   help="the home NATs give every connection a random port, as symmetric "
                        "NATs do (hole punches then fail; NATed peers trade over the relay)")
    p.add_argument("--no-punch", action="store_true",
                   help="NATed peers try no TCP hole punch (what they trade with each "
                        "other stays relayed)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="work in DIR and keep it (data dirs, every process's stderr)")


@dataclass(slots=True)
class PeerFigures:
    name: str
    region: str
    natted: bool
    addr: str
    seen_as: str
    uplink_mbps: float
    peer_id: str = ""
    reachability: str = "unknown"
    verified: list[int] = field(default_factory=list)
    failed: int = 0
    sync_s: dict[int, float] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    from_trainer: int = 0
    leases: int = 0
    #: Bytes received from each other peer (by name), at the last version.
    from_peers: dict[str, int] = field(default_factory=dict)
    traversal: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "region": self.region, "natted": self.natted,
                "addr": self.addr, "seen_as": self.seen_as, "uplink_mbps": self.uplink_mbps,
                "peer_id": self.peer_id, "reachability": self.reachability,
                "verified": self.verified, "failed": self.failed,
                "sync_s": {str(v): s for v, s in sorted(self.sync_s.items())},
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "bytes_from_trainer": self.from_trainer, "leases": self.leases,
                "bytes_from_peers": self.from_peers, "traversal": self.traversal}


@dataclass(slots=True)
class Figures:
    steps: int
    peers: list[PeerFigures]
    trainer_egress: int = 0
    payload: int = 0
    seconds: float = 0.0
    relay: dict[str, Any] = field(default_factory=dict)

    def natted_to_natted(self) -> int:
        """Bytes NATed peers received from other NATed peers."""
        natted = {p.name for p in self.peers if p.natted}
        return sum(n for p in self.peers if p.natted
                   for q, n in p.from_peers.items() if q in natted)

    def punches(self) -> tuple[int, int]:
        """(hole punches tried, succeeded), counted at both ends of each circuit."""
        return (sum(int(p.traversal.get("punch_attempts", 0)) for p in self.peers),
                sum(int(p.traversal.get("punch_ok", 0)) for p in self.peers))

    def per_version(self) -> dict[int, tuple[float, float]]:
        """version -> (median, max) sync s over the peers."""
        out = {}
        for v in range(1, self.steps + 1):
            t = [p.sync_s[v] for p in self.peers if v in p.sync_s]
            if t:
                out[v] = (statistics.median(t), max(t))
        return out

    def all_verified(self) -> bool:
        want = list(range(self.steps + 1))
        return all(p.verified == want and not p.failed for p in self.peers)

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "seconds": round(self.seconds, 1),
                "trainer_egress": self.trainer_egress, "payload": self.payload,
                "all_verified": self.all_verified(),
                "relay": self.relay, "natted_to_natted_bytes": self.natted_to_natted(),
                "punch_attempts": self.punches()[0], "punch_ok": self.punches()[1],
                "per_version": {str(v): {"median_s": m, "max_s": x}
                                for v, (m, x) in self.per_version().items()},
                "peers": [p.as_dict() for p in self.peers]}


def scenario_of(args: argparse.Namespace) -> Scenario:
    if args.regions < 2:
        raise PlanError("--regions: at least 2 (the trainer's and one of peers)")
    labels = tuple(chr(ord("a") + i) if i < 26 else f"r{i}" for i in range(args.regions))
    return Scenario(peers=args.peers, nat_fraction=args.nat_fraction,
                    symmetric_nat=args.symmetric_nat,
                    uplinks=parse_rates(args.uplinks), trainer_mbps=args.trainer_mbps,
                    regions=labels)


def run(args: argparse.Namespace) -> int:
    if min(args.steps, args.prompts, args.group, args.chunk_kib) < 1:
        raise PlanError("--steps, --prompts, --group and --chunk-kib must be at least 1")
    lab_plan = plan(scenario_of(args))  # PlanError: one line
    check_available()
    natted = sum(h.natted for h in lab_plan.peers)
    say(f"swarm lab: bootstrap and trainer ({args.trainer_mbps:g} Mbit/s) public in region "
        f"{lab_plan.scenario.regions[0]}; {len(lab_plan.peers)} peers in regions "
        f"{', '.join(lab_plan.scenario.regions[1:])}, {natted} behind a "
        f"{'symmetric NAT' if args.symmetric_nat else 'NAT'}; {args.steps} versions after "
        "version 0")
    t0 = time.monotonic()
    with workdir(args.keep, "swarm-lab-") as work, Lab(lab_plan, say=say) as lab:
        figures = _run_swarm(lab, args, work)
    figures.seconds = time.monotonic() - t0
    print_summary(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures.as_dict(), indent=2) + "\n")
    return 0 if figures.all_verified() else 1


def _run_swarm(lab: Lab, args: argparse.Namespace, work: Path) -> Figures:
    from swarm.identity import Identity

    p = lab.plan
    children: list[SwarmChild] = []

    def start(host: Host, argv: list[str]) -> SwarmChild:
        ip = "0.0.0.0" if args.listen_any and host.role == "peer" else host.addr
        listen = f"/ip4/{ip}/tcp/{PORTS[host.role]}"
        child = SwarmChild(host.name, [*argv, "--data-dir", str(work / host.name), "--run",
                                       RUN, "--listen", listen, "--status-json"], work,
                           verbose=getattr(args, "verbose", 0),
                           launcher=lab.command(host, []))
        children.append(child)
        return child

    peers = [PeerFigures(h.name, h.region, h.natted, h.addr, h.seen_as, h.uplink_mbps)
             for h in p.peers]
    out = Figures(args.steps, peers)
    try:
        trainer_id = Identity.load_or_create(work / "trainer" / "node.key").peer_id
        relay = [] if args.no_relay else ["--relay", "--relay-port", str(RELAY_PORT)]
        boot = start(p.host("bootstrap"), ["bootstrap", "--trainer", trainer_id, *relay])
        boot_addr = str(_wait(boot, "ready", args.timeout)["addr"])
        trainer = start(p.host("trainer"), [
            "trainer", "--bootstrap", boot_addr, "--steps", str(args.steps),
            "--min-peers", str(len(peers)), "--chunk-kib", str(args.chunk_kib),
            "--prompts", str(args.prompts), "--group", str(args.group),
            "--region", p.host("trainer").region, "--linger", "600"])
        _wait(trainer, "ready", args.timeout)
        say(f"bootstrap {boot_addr}")
        say(f"trainer {trainer_id} at {p.host('trainer').addr}")
        procs = {}
        for f, host in zip(peers, p.peers, strict=True):
            procs[f.name] = start(host, [
                "peer", "--bootstrap", boot_addr, "--trainer", trainer_id, "--name", f.name,
                "--region", host.region, "--card-timeout", f"{args.timeout:g}",
                *(["--no-punch"] if args.no_punch else [])])
        for f in peers:
            ready = _wait(procs[f.name], "ready", args.timeout)
            f.peer_id = str(ready["peer_id"])
            f.reachability = str(ready.get("reachability", "unknown"))
            nat = f"behind a NAT at {f.seen_as}" if f.natted else "public"
            where = f"0.0.0.0 ({f.addr})" if args.listen_any else f.addr
            say(f"{f.name}: region {f.region}, {f.uplink_mbps:g} Mbit/s up, listening on "
                f"{where} ({nat}); the dial-back check says {f.reachability}"
                + (f", seen as {ready['seen_as']}" if ready.get("seen_as") else ""))
        for version in range(args.steps + 1):
            for f in peers:
                ev = _wait_verified(procs[f.name], version, args.timeout)
                if int(ev["version"]) == version and version > 0:
                    f.sync_s[version] = float(ev["sync_s"])
                    say(f"{f.name}{' (NAT)' if f.natted else ''}: version {version} "
                        f"verified in {float(ev['sync_s']):.2f} s")
        # The trainer says when its last version reached every peer, with its egress.
        done = _wait(trainer, "delivered", args.timeout)
        out.trainer_egress = int(done.get("egress", 0))
        time.sleep(1.5)  # the relay's and the peers' once-a-second traversal counts
        out.payload = sum(int(e.get("bytes", 0)) for e in trainer.of("step"))
        for f in peers:
            child = procs[f.name]
            f.verified = sorted({int(e["version"]) for e in child.of("verified")})
            f.failed = len(child.of("verify_failed"))
            f.leases = len(child.of("lease"))
            last = child.of("verified")[-1]
            f.bytes_up = int(last.get("bytes_up", 0))
            f.bytes_down = int(last.get("bytes_down", 0))
            f.from_trainer = int(last.get("bytes_from_trainer", 0))
            names = {g.peer_id: g.name for g in peers}
            f.from_peers = {names[q]: int(n) for q, n in
                            dict(last.get("bytes_by_peer", {})).items() if q in names}
            if trav := child.of("traversal"):
                f.traversal = {k: v for k, v in trav[-1].items()
                               if k not in ("event", "t", "node")}
        if relayed := boot.of("relay"):
            out.relay = {k: v for k, v in relayed[-1].items() if k not in ("event", "t", "node")}
    finally:
        stop_children(list(reversed(children)))
    return out


def _wait(child: SwarmChild, event: str, timeout: float) -> Event:
    try:
        return child.wait_event(event, timeout)
    except BenchError as exc:
        raise LabError(_one_line(child, str(exc))) from None


def _wait_verified(child: SwarmChild, version: int, timeout: float) -> Event:
    try:
        return child.wait_for(lambda e: e.get("event") == "verified"
                              and int(e.get("version", -1)) >= version, timeout,
                              f"version {version} verified")
    except BenchError as exc:
        raise LabError(_one_line(child, str(exc))) from None


def _one_line(child: SwarmChild, message: str) -> str:
    head = message.split(";", 1)[0]
    tail = [ln for ln in child.stderr_tail().splitlines() if ln.strip()]
    return head + (f"; its stderr ends: {tail[-1].strip()[:300]}" if tail else "")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def print_summary(f: Figures) -> None:
    say("")
    say(f"summary ({f.seconds:.0f} s):")
    say("peer  region  uplink  NAT  seen as         verified  failed  up        down      "
        "from trainer  median sync s")
    want = f.steps + 1
    for p in f.peers:
        times = list(p.sync_s.values())
        med = f"{statistics.median(times):.2f}" if times else "-"
        ok = sum(1 for v in p.verified if 0 <= v <= f.steps)
        say(f"{p.name:<5} {p.region:<7} {p.uplink_mbps:>5g}M  {'yes' if p.natted else 'no':<4} "
            f"{p.seen_as:<15} {ok:>3} of {want:<3} {p.failed:>6}  {_mb(p.bytes_up):<9} "
            f"{_mb(p.bytes_down):<9} {_mb(p.from_trainer):<13} {med:>6}")
    say("version  median sync s  max sync s")
    for v, (med_s, max_s) in f.per_version().items():
        say(f"{v:>7} {med_s:>14.2f} {max_s:>11.2f}")
    ratio = f" = {f.trainer_egress / f.payload:.2f}x the deltas' payload" if f.payload else ""
    say(f"trainer egress {_mb(f.trainer_egress)}{ratio} (versions 0-{f.steps})")
    natted = [p for p in f.peers if p.natted]
    if natted:
        say(f"NATed peers uploaded {_mb(sum(p.bytes_up for p in natted))} in all; "
            f"{_mb(f.natted_to_natted())} went from NATed peers to NATed peers")
        tried, ok = f.punches()
        rate = f" = {100 * ok / tried:.0f}%" if tried else ""
        say(f"hole punches: {ok} of {tried} circuit ends{rate}")
    if f.relay:
        say(f"relay (on the bootstrap): {_mb(int(f.relay.get('relayed_bytes', 0)))} relayed "
            f"over {f.relay.get('circuits', 0)} circuits")
    say(f"result: {'PASS' if f.all_verified() else 'FAIL'} (every peer, NATed or not, "
        f"verified every version: {f.all_verified()})")
