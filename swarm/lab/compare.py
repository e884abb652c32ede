"""``swarm lab compare``: the in-process shaper against the kernel, on one scenario.

It runs ``swarm bench e2e`` twice, side by side: on loopback, every process shaping its
own uplink (:mod:`swarm.roles.shaper`, with no WAN latency: the lab has none; the
trainer in region ``a``, the peers in ``b`` and ``c``, as in the lab), then in a
lab whose peers are all public and whose uplinks are shaped by tbf (``swarm lab bench
--nat-fraction 0``). It prints, per delta version, when the last peer verified it under
each, and their ratio; they agree when the means differ by at most 20%. With ``--runs
N`` it alternates N pairs of runs (so a drift in the machine's load hits both alike) and
compares the times of every delta version of every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from swarm.bench.procs import say, workdir
from swarm.lab.bench import REGIONS, budget, check, e2e_argv, in_lab, run_e2e
from swarm.lab.bench import add_arguments as _bench_arguments
from swarm.lab.kernel import LabError, check_available
from swarm.lab.plan import Scenario, plan

#: The shaper and the kernel agree when the mean time to every peer differs by at most this.
AGREE = 0.20
MAX_RUNS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    _bench_arguments(p, compare=True)
    p.add_argument("--runs", type=int, default=1,
                   help=f"pairs of runs, alternated (default 1, at most {MAX_RUNS})")


def run(args: argparse.Namespace) -> int:
    check(args)
    if not 1 <= args.runs <= MAX_RUNS:
        raise LabError(f"--runs must be 1-{MAX_RUNS}")
    plan(Scenario(peers=args.peers, nat_fraction=0.0, regions=REGIONS))
    check_available()
    shaper: list[dict[str, Any]] = []
    kernel: list[dict[str, Any]] = []
    with workdir(args.keep, "swarm-lab-compare-") as work:
        t0 = time.monotonic()
        for i in range(args.runs):
            of = f" (pair {i + 1} of {args.runs})" if args.runs > 1 else ""
            say(f"shaper{of}: swarm bench e2e on loopback, every process shaping its own "
                "uplink")
            out = work / f"shaper{i}.json"
            shaper.append(run_e2e([
                *e2e_argv(args, work / f"shaper{i}", out), "--wan-latency-ms", "0",
                "--trainer-region", REGIONS[0], "--peer-regions", ",".join(REGIONS[1:])],
                out, "with the in-process shaper", budget(args)))
            say(f"kernel{of}: the same benchmark in a lab, every peer public, uplinks shaped "
                "by tbf")
            kernel.append(in_lab(args, work, 0.0, f"kernel{i}"))
        c = comparison(shaper, kernel)
        say(f"{2 * args.runs} runs took {time.monotonic() - t0:.0f} s")
    print_comparison(c)
    if args.json is not None:
        args.json.write_text(json.dumps({"comparison": c, "shaper": shaper,
                                         "kernel": kernel}, indent=2) + "\n")
    return 0


def _all_s(figures: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """Delta version -> (to every peer, of which publishing) in s."""
    return {int(v["version"]): (float(v["all_s"]), float(v["publish_s"]))
            for v in figures["versions"] if int(v["version"]) > 0}


def _egress(figures: dict[str, Any]) -> float:
    return float(figures["ratios"].get("egress_ratio", 0.0))


def comparison(shaper: list[dict[str, Any]], kernel: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run and delta version, when the last peer verified it under each; the ratios of
    their means and medians over every version of every run."""
    rows = []
    for run_i, (a, b) in enumerate(zip(map(_all_s, shaper), map(_all_s, kernel),
                                       strict=True)):
        rows += [{"run": run_i + 1, "version": v, "shaper_s": a[v][0], "kernel_s": b[v][0],
                  "shaper_publish_s": a[v][1], "kernel_publish_s": b[v][1]}
                 for v in sorted(set(a) & set(b))]
    if not rows:
        raise LabError("the runs have no delta version in common")
    xs, ys = [r["shaper_s"] for r in rows], [r["kernel_s"] for r in rows]
    mean_a, mean_b = statistics.fmean(xs), statistics.fmean(ys)
    med_a, med_b = statistics.median(xs), statistics.median(ys)
    ratio = mean_a / mean_b if mean_b > 0 else 0.0
    # after the publish: the links' part (the publish runs on the trainer's CPU alone)
    net_a = statistics.fmean(r["shaper_s"] - r["shaper_publish_s"] for r in rows)
    net_b = statistics.fmean(r["kernel_s"] - r["kernel_publish_s"] for r in rows)
    return {"versions": rows, "shaper_mean_s": mean_a, "kernel_mean_s": mean_b,
            "shaper_after_publish_s": net_a, "kernel_after_publish_s": net_b,
            "after_publish_ratio": net_a / net_b if net_b > 0 else 0.0,
            "ratio": ratio, "shaper_median_s": med_a, "kernel_median_s": med_b,
            "median_ratio": med_a / med_b if med_b > 0 else 0.0,
            "agree": abs(ratio - 1.0) <= AGREE,
            "shaper_egress_ratio": statistics.fmean(map(_egress, shaper)),
            "kernel_egress_ratio": statistics.fmean(map(_egress, kernel))}


def print_comparison(c: dict[str, Any]) -> None:
    say("")
    say("run  version  to every peer, shaper s  kernel s  shaper / kernel  "
        "publish s, shaper  kernel")
    for row in c["versions"]:
        r = row["shaper_s"] / row["kernel_s"] if row["kernel_s"] > 0 else 0.0
        say(f"{row['run']:>3} {row['version']:>8} {row['shaper_s']:>24.2f} "
            f"{row['kernel_s']:>9.2f} {r:>16.2f}  {row['shaper_publish_s']:>17.2f} "
            f"{row['kernel_publish_s']:>7.2f}")
    say(f"{'mean':>12} {c['shaper_mean_s']:>24.2f} {c['kernel_mean_s']:>9.2f} "
        f"{c['ratio']:>16.2f}")
    say(f"{'median':>12} {c['shaper_median_s']:>24.2f} {c['kernel_median_s']:>9.2f} "
        f"{c['median_ratio']:>16.2f}")
    say(f"{'after the publish':>12}: shaper {c['shaper_after_publish_s']:.2f} s, kernel "
        f"{c['kernel_after_publish_s']:.2f} s, shaper / kernel {c['after_publish_ratio']:.2f}")
    say(f"trainer egress / payload: shaper {c['shaper_egress_ratio']:.2f}x, kernel "
        f"{c['kernel_egress_ratio']:.2f}x")
    verdict = "agree" if c["agree"] else "DISAGREE"
    say(f"result: the shaper and the kernel {verdict} within {AGREE:.0%} "
        f"(mean shaper / kernel = {c['ratio']:.2f})")
