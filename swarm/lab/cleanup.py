"""``swarm lab cleanup``: delete what killed lab runs left (namespaces, veths, the NAT
rules inside them, owner files), found by the labs' common prefix. Labs whose process is
still running are kept unless ``--all``."""

from __future__ import annotations

import argparse

from swarm.bench.procs import say
from swarm.lab.kernel import cleanup


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true",
                   help="also remove labs whose process is still running")


def run(args: argparse.Namespace) -> int:
    removed = cleanup(every=args.all)
    if not removed:
        say("no lab leftovers")
    for prefix, what in removed.items():
        spaces = [w for w in what if w.startswith(prefix + "-")]
        say(f"lab {prefix}: removed {len(spaces)} namespace(s)"
            + (f" and {len(what) - len(spaces)} interface(s)" if len(what) > len(spaces) else ""))
    return 0
