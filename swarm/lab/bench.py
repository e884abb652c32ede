"""``swarm lab bench``: ``swarm bench e2e`` on a kernel network, half its peers NATed.

``swarm lab bench`` builds a lab (:mod:`swarm.lab.kernel`) of three regions: the
benchmark's trainer and a ``swarm bootstrap --relay`` public in region ``a``, the peers
dealt over regions ``b`` and ``c``, the last ``--nat-fraction`` of them each behind a home
NAT, every uplink shaped by a tbf (the trainer's to ``--trainer-mbps``, each peer's to
``--uplink-mbps``). It runs ``swarm bench e2e --placement`` inside the trainer's
namespace, so the benchmark's own tables come out, measured over the kernel's links.

``swarm lab compare`` (:mod:`swarm.lab.compare`) runs it against the in-process shaper.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from swarm.bench.placement import Placement, Spot
from swarm.bench.procs import BenchError, say, workdir
from swarm.lab.kernel import Lab, check_available
from swarm.lab.plan import Host, PlanError, Scenario, plan
from swarm.selfcmd import swarm_argv

REGIONS = ("a", "b", "c")


def add_arguments(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    p.add_argument("--params", default="5M", choices=("1M", "5M", "25M", "30M", "100M"),
                   help="the benchmark's model size (default 5M)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps published (default 3)")
    p.add_argument("--peers", type=int, default=4, help="swarm peer processes (default 4)")
    p.add_argument("--trainer-mbps", type=float, default=2.0,
                   help="the trainer's uplink in Mbit/s (default 2: a delta of the 5M model "
                        "takes about half a second to leave it, so the links, not these "
                        "cores, set the pace)")
    p.add_argument("--uplink-mbps", type=float, default=10.0,
                   help="every peer's uplink in Mbit/s (default 10)")
    p.add_argument("--chunk-kib", type=int, default=16,
                   help="delta chunk size in KiB (default 16: peers have chunks to trade)")
    if not compare:
        p.add_argument("--nat-fraction", type=float, default=0.5, metavar="F",
                       help="share of the peers behind a home NAT each (default 0.5)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="most seconds for every peer to verify one version (default 300)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="work in DIR and keep it (data dirs, every process's stderr)")


def check(args: argparse.Namespace) -> None:
    if min(args.steps, args.peers, args.chunk_kib) < 1:
        raise PlanError("--steps, --peers and --chunk-kib must be at least 1")
    if min(args.trainer_mbps, args.uplink_mbps) <= 0:
        raise PlanError("--trainer-mbps and --uplink-mbps must be positive")


def e2e_argv(args: argparse.Namespace, work: Path, out: Path) -> list[str]:
    return swarm_argv(
        "bench", "e2e", "--params", args.params, "--steps", str(args.steps),
        "--peers", str(args.peers), "--trainer-mbps", f"{args.trainer_mbps:g}",
        "--uplink-mbps", f"{args.uplink_mbps:g}", "--chunk-kib", str(args.chunk_kib),
        "--timeout", f"{args.timeout:g}", "--keep", str(work), "--json", str(out))


def _spot(lab: Lab, host: Host) -> Spot:
    return Spot(host.name, host.region, host.addr, tuple(lab.command(host, [])), host.natted)


def budget(args: argparse.Namespace) -> float:
    """Most seconds one benchmark may run: start-up, then every version's time-out."""
    return 120.0 + float(args.timeout) * (int(args.steps) + 1)


def run_e2e(argv: list[str], out: Path, what: str, timeout: float) -> dict[str, Any]:
    """Run one benchmark (its output passes through); the figures it wrote to ``out``."""
    try:
        rc = subprocess.run(argv, stdin=subprocess.DEVNULL, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: the benchmark ran past {timeout:.0f} s") from None
    if rc != 0 or not out.exists():
        raise BenchError(f"{what}: the benchmark failed (exit status {rc}; see above)")
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def in_lab(args: argparse.Namespace, work: Path, nat_fraction: float, name: str = "lab"
           ) -> dict[str, Any]:
    scenario = Scenario(peers=args.peers, nat_fraction=nat_fraction,
                        uplinks=(args.uplink_mbps,), trainer_mbps=args.trainer_mbps,
                        regions=REGIONS)
    lab_plan = plan(scenario)
    with Lab(lab_plan, say=say) as lab:
        trainer = lab_plan.host("trainer")
        placed = Placement(_spot(lab, trainer), _spot(lab, lab_plan.host("bootstrap")),
                           tuple(_spot(lab, h) for h in lab_plan.peers))
        placed.write(work / f"{name}.placement.json")
        out = work / f"{name}.json"
        argv = [*e2e_argv(args, work / name, out),
                "--placement", str(work / f"{name}.placement.json")]
        return run_e2e(lab.command(trainer, argv), out, "in the lab", budget(args))


def run(args: argparse.Namespace) -> int:
    check(args)
    plan(Scenario(peers=args.peers, nat_fraction=args.nat_fraction, regions=REGIONS))
    check_available()
    with workdir(args.keep, "swarm-lab-bench-") as work:
        figures = in_lab(args, work, args.nat_fraction)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0
