"""``swarm simulate``: one step's distribution over a simulated swarm against baselines, or
with ``--steps N`` the RL loop end to end (:mod:`swarm.sim.endtoend`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from swarm.errors import LocalProtocolError
from swarm.sim.plots import plot_sweep
from swarm.sim.scenario import MAX_PEERS, PRESETS, ChurnEvent, Scenario, load_toml


def presets() -> dict[str, Scenario]:
    from swarm.sim import paper

    return {**PRESETS, "paper": paper.PRESET}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(presets()), default="wan64",
                   help="starting scenario (default: wan64: 4 regions, 0.5-1 Gbps WAN, "
                        "64 heterogeneous peers, Qwen3-8B; paper: the AuroraRL/SparrowRL "
                        "setups, 4B-14B on 2-6 H100 trainers and 4-12 A100 actors)")
    p.add_argument("--config", type=Path, help="TOML file overriding the preset's fields")
    p.add_argument("--peers", type=int, help="number of rollout peers")
    p.add_argument("--model-gb", type=float, help="dense bf16 state size in GB")
    p.add_argument("--ratio", type=float,
                   help="dense / delta size ratio of the codec (default 180)")
    p.add_argument("--chunk-mib", type=float, help="chunk size in MiB")
    p.add_argument("--rollout", type=float, help="rollout seconds per step")
    p.add_argument("--steps", type=int,
                   help="simulate the RL loop end to end over this many trainer steps "
                        "(default: one step's distribution table)")
    p.add_argument("--trainer-step", type=float, help="trainer seconds per step (loop)")
    p.add_argument("--staleness", type=int, help="most steps off-policy (loop)")
    p.add_argument("--churn-per-min", type=float,
                   help="percent of the actors leaving per minute (loop)")
    p.add_argument("--away", type=float, help="mean seconds a leaving actor stays away")
    p.add_argument("--malicious", type=float, help="fraction of peers serving corrupt chunks")
    p.add_argument("--crash", type=int, default=0, help="peers that crash silently ...")
    p.add_argument("--crash-at", type=float, default=0.5, help="... at this time (s)")
    p.add_argument("--join", type=int, default=0, help="peers that join late ...")
    p.add_argument("--join-at", type=float, default=0.5, help="... at this time (s)")
    p.add_argument("--trainer-hosts", type=int,
                   help="hosts of a sharded trainer, each seeding its ranks' share of "
                        "the chunks from the trainer's region and links (default 1)")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--sweep",
                   help="peer counts for the plot (comma-separated; empty: no sweep; "
                        "default 8,16,32,64 for the distribution table, none with --steps)")
    p.add_argument("--out", type=Path, default=Path("sim-out"),
                   help="directory for result.json and plot.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines")
    p.add_argument("--quiet", action="store_true", help="no progress display")


#: Each numeric flag: the least value it takes, whether that value is excluded, and the
#: most (None: no bound beyond the scenario's own checks).
_FLAG_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "peers": (1, False, MAX_PEERS), "model_gb": (0, True, None), "ratio": (1, False, None),
    "chunk_mib": (0.001, False, None), "rollout": (0, True, None),
    "steps": (1, False, 1000), "trainer_step": (0, False, None), "staleness": (0, False, 64),
    "churn_per_min": (0, False, 100), "away": (0, True, None), "malicious": (0, False, 0.99),
    "crash": (0, False, None), "crash_at": (0, False, None), "join": (0, False, None),
    "join_at": (0, False, None), "trainer_hosts": (1, False, None),
}


def check_flags(args: argparse.Namespace) -> None:
    """One error naming the flag, for a value out of its range (NaN included)."""
    for field, (least, open_low, most) in _FLAG_RANGES.items():
        value = getattr(args, field, None)
        if value is None:
            continue
        low_ok = value > least if open_low else value >= least
        if not (low_ok and (most is None or value <= most)):
            bound = (f"more than {least:g}" if open_low else f"at least {least:g}") + (
                "" if most is None else f" and at most {most:g}")
            raise LocalProtocolError(f"--{field.replace('_', '-')} {value:g}: must be {bound}")


def scenario_from_args(args: argparse.Namespace, base: Scenario | None = None) -> Scenario:
    check_flags(args)
    sc = base if base is not None else presets()[args.preset]
    if args.config is not None:
        sc = load_toml(args.config, sc)
    changes: dict[str, Any] = {}
    for flag, field in (("peers", "peers"), ("ratio", "delta_ratio"),
                        ("rollout", "rollout_s"), ("steps", "steps"),
                        ("malicious", "malicious"), ("seed", "seed"),
                        ("trainer_hosts", "trainer_hosts"),
                        ("trainer_step", "trainer_step_s"), ("staleness", "staleness"),
                        ("churn_per_min", "churn_per_min"), ("away", "away_s")):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    if args.model_gb is not None:
        changes["model_bytes"] = args.model_gb * 1e9
    if args.chunk_mib is not None:
        changes["chunk_bytes"] = int(args.chunk_mib * (1 << 20))
    churn = list(sc.churn)
    if args.crash:
        churn.append(ChurnEvent(args.crash_at, "crash", args.crash))
    if args.join:
        churn.append(ChurnEvent(args.join_at, "join", args.join))
    changes["churn"] = tuple(churn)
    sc = sc.with_(**changes)
    sc.check()
    return sc


class _Progress:
    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.last = 0.0

    def __call__(self, now: float, done: int, total: int) -> None:
        wall = time.perf_counter()
        if not self.enabled or wall - self.last < 0.2:
            return
        self.last = wall
        print(f"\r  {self.label}: virtual {now:6.2f} s, {done}/{total} peers done, "
              f"wall {wall - self.t0:5.1f} s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print("\r" + " " * 78 + "\r", end="", file=sys.stderr, flush=True)


def _why_relay_wins(rep: Any, peers: int, regions: int) -> list[str]:
    """A note when the relay-per-region baseline beats the swarm (few peers per region)."""
    relay = next((r for r in rep.rows if r.name == "relay per region"), None)
    swarm = rep.swarm_row
    if relay is None or relay.completion_s >= swarm.completion_s:
        return []
    per = peers / max(1, regions)
    return [
        f"  note: relay per region ({relay.completion_s:.2f} s) beats the swarm "
        f"({swarm.completion_s:.2f} s) here: with {per:.0f} peers per region the relay "
        "baseline's trainer sends one full copy into every region "
        f"(egress {relay.trainer_egress_x:.1f}x the payload, over the "
        f"{swarm.trainer_egress_x:.2f}x the swarm keeps to) and each relay fans out to only "
        f"{per - 1:.0f} peers; the swarm keeps the trainer's egress near 1x, so most "
        "chunks reach a region from other peers, a hop later. The relay's fan-out grows "
        "with the peers per region (the sweep shows where it falls behind).",
    ]


def run(args: argparse.Namespace) -> int:
    show = not args.quiet and sys.stderr.isatty()
    if not getattr(args, "verbose", 0):
        # every simulated ban would log a warning; the summary counts them instead
        logging.getLogger("swarm.protocol.exchange").setLevel(logging.ERROR)
    if args.steps is not None:
        return run_end_to_end(args, show)
    return run_distribution(args, show)


def run_end_to_end(args: argparse.Namespace, show: bool) -> int:
    """``--steps N``: every method's RL loop, per scenario (three for ``paper``)."""
    from swarm.sim import paper
    from swarm.sim.endtoend import format_end_to_end, plot_end_to_end
    from swarm.sim.endtoend import run_end_to_end as run_e2e

    bases = list(paper.SCENARIOS) if args.preset == "paper" else [None]
    scenarios = [scenario_from_args(args, b) for b in bases]
    runs = []
    for sc in scenarios:
        print(f"scenario {sc.name}: {sc.peers} actors in {len(sc.regions)} regions, model "
              f"{sc.model_bytes / 1e9:.1f} GB bf16, delta 1/{sc.delta_ratio:g} = "
              f"{sc.payload_bytes / 1e6:.1f} MB, seed {sc.seed}", flush=True)
        prog = _Progress(f"{sc.name} distribution", show)
        e = run_e2e(sc, progress=prog)
        prog.close()
        print(format_end_to_end(e), flush=True)
        runs.append(e)
    out: dict[str, Any] = {"end_to_end": [e.to_json() for e in runs],
                           "scenarios": [_scenario_json(sc) for sc in scenarios]}
    if args.preset == "paper":
        lines = paper.compare(runs)
        print("\n".join(lines))
        out["paper"] = {"figures": [list(f) for f in paper.FIGURES], "comparison": lines}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out / 'result.json'}")
    if not args.no_plot:
        path = args.out / "plot.png"
        plot_end_to_end(runs, path)
        print(f"wrote {path}")
    return 0


def run_distribution(args: argparse.Namespace, show: bool) -> int:
    """One step's distribution: the swarm against the baselines, and the sweep."""
    from swarm.sim.report import format_step, run_step

    sc = scenario_from_args(args)
    print(f"scenario {sc.name}: {sc.peers} peers in {len(sc.regions)} regions "
          f"({', '.join(sc.regions)}), model {sc.model_bytes / 1e9:.1f} GB bf16, delta "
          f"1/{sc.delta_ratio:g} = {sc.payload_bytes / 1e6:.1f} MB in "
          f"{len(sc.chunk_sizes())} chunks, rollout {sc.rollout_s:g} s, malicious "
          f"{sc.malicious:.0%}, seed {sc.seed}"
          + (f", {sc.trainer_hosts} trainer hosts" if sc.trainer_hosts > 1 else ""))
    out: dict[str, Any] = {"scenario": _scenario_json(sc), "steps": [], "sweep": []}
    ok = True
    prog = _Progress("step 0", show)
    rep = run_step(sc, 0, with_baselines=not args.no_baselines, progress=prog)
    prog.close()
    print(format_step(rep, sc.regions), flush=True)
    for line in _why_relay_wins(rep, sc.peers, len(sc.regions)):
        print(line, flush=True)
    out["steps"].append(rep.to_json())
    ok = ok and rep.swarm.bit_exact
    spec = "8,16,32,64" if args.sweep is None else args.sweep
    sweep = [int(x) for x in spec.split(",") if x.strip()]
    for n in sweep:
        prog = _Progress(f"sweep {n} peers", show)
        rep = run_step(sc.with_(peers=n, churn=()), 0,
                       with_baselines=not args.no_baselines, progress=prog)
        prog.close()
        print(f"sweep {n:4d} peers: " + "; ".join(
            f"{r.name} {r.completion_s:.2f} s, egress {r.trainer_egress_x:.2f}x"
            for r in rep.rows), flush=True)
        out["sweep"].append(rep.to_json())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out / 'result.json'}")
    if sweep and not args.no_plot:
        path = args.out / "plot.png"
        plot_sweep(out["sweep"], path)
        print(f"wrote {path}")
    return 0 if ok else 1


def _scenario_json(sc: Scenario) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(sc)
    d["payload_bytes"] = sc.payload_bytes
    return d

