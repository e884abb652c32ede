"""``swarm lab compare``: the in-process shaper against the kernel, on one scenario.

It runs ``swarm bench e2e`` twice, side by side: on loopback, every process shaping its
own uplink (:mod:`swarm.roles.shaper`, with no WAN latency: the lab has none; the
trainer in region ``a``, the peers in ``b`` and ``c``, as in the lab), then in a
lab whose peers are all public and whose uplinks are shaped by tbf (``swarm lab bench
--nat-fraction 0``). It prints, per delta version, when the last peer verified it under
each, and their ratio; they agree when the means differ by at most 20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from swarm.bench.procs import say, workdir
from swarm.lab.bench import REGIONS, check, e2e_argv, in_lab, run_e2e
from swarm.lab.bench import add_arguments as _bench_arguments
from swarm.lab.kernel import LabError, check_available
from swarm.lab.plan import Scenario, plan

#: The shaper and the kernel agree when the mean time to every peer differs by at most this.
AGREE = 0.20


def add_arguments(p: argparse.ArgumentParser) -> None:
    _bench_arguments(p, compare=True)


def run(args: argparse.Namespace) -> int:
    check(args)
    plan(Scenario(peers=args.peers, nat_fraction=0.0, regions=REGIONS))
    check_available()
    with workdir(args.keep, "swarm-lab-compare-") as work:
        t0 = time.monotonic()
        say("1 of 2: swarm bench e2e on loopback, every process shaping its own uplink")
        budget = 120 + args.timeout * (args.steps + 1)
        shaper = run_e2e([*e2e_argv(args, work / "shaper", work / "shaper.json"),
                          "--wan-latency-ms", "0", "--trainer-region", REGIONS[0],
                          "--peer-regions", ",".join(REGIONS[1:])],
                         "with the in-process shaper", budget)
        say("2 of 2: the same benchmark in a lab, every peer public, uplinks shaped by tbf")
        kernel = in_lab(args, work, 0.0)
        c = comparison(shaper, kernel)
        say(f"both runs took {time.monotonic() - t0:.0f} s")
    print_comparison(c)
    if args.json is not None:
        args.json.write_text(json.dumps({"comparison": c, "shaper": shaper,
                                         "kernel": kernel}, indent=2) + "\n")
    return 0


def _all_s(figures: dict[str, Any]) -> dict[int, float]:
    return {int(v["version"]): float(v["all_s"]) for v in figures["versions"]
            if int(v["version"]) > 0}


def comparison(shaper: dict[str, Any], kernel: dict[str, Any]) -> dict[str, Any]:
    """Per delta version, when the last peer verified it under each; the means' ratio."""
    a, b = _all_s(shaper), _all_s(kernel)
    both = sorted(set(a) & set(b))
    if not both:
        raise LabError("the two runs have no delta version in common")
    mean_a = statistics.fmean(a[v] for v in both)
    mean_b = statistics.fmean(b[v] for v in both)
    ratio = mean_a / mean_b if mean_b > 0 else 0.0
    return {"versions": {str(v): {"shaper_s": a[v], "kernel_s": b[v]} for v in both},
            "shaper_mean_s": mean_a, "kernel_mean_s": mean_b, "ratio": ratio,
            "agree": abs(ratio - 1.0) <= AGREE,
            "shaper_egress_ratio": shaper["ratios"].get("egress_ratio"),
            "kernel_egress_ratio": kernel["ratios"].get("egress_ratio")}


def print_comparison(c: dict[str, Any]) -> None:
    say("")
    say("version  to every peer, shaper s  kernel s  shaper / kernel")
    for v, row in c["versions"].items():
        r = row["shaper_s"] / row["kernel_s"] if row["kernel_s"] > 0 else 0.0
        say(f"{v:>7} {row['shaper_s']:>24.2f} {row['kernel_s']:>9.2f} {r:>16.2f}")
    say(f"{'mean':>7} {c['shaper_mean_s']:>24.2f} {c['kernel_mean_s']:>9.2f} "
        f"{c['ratio']:>16.2f}")
    eg_s, eg_k = c["shaper_egress_ratio"], c["kernel_egress_ratio"]
    if eg_s is not None and eg_k is not None:
        say(f"trainer egress / payload: shaper {eg_s:.2f}x, kernel {eg_k:.2f}x")
    verdict = "agree" if c["agree"] else "DISAGREE"
    say(f"result: the shaper and the kernel {verdict} within {AGREE:.0%} "
        f"(shaper / kernel = {c['ratio']:.2f})")
