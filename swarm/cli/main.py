"""``swarm`` command line: a thin dispatcher; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is
imported only when that subcommand runs, so ``swarm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from swarm.errors import SwarmError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "keygen": ("swarm.cli.keys", "write a new Ed25519 identity key and print its peer id"),
    "inspect": ("swarm.cli.inspect",
                "pretty-print a signed manifest, run card, saved state, key file or data dir"),
    "demo": ("swarm.cli.demo", "run the end-to-end demo on this machine"),
    "trainer": ("swarm.cli.trainer", "run the built-in GRPO task as trainer and seed"),
    "peer": ("swarm.cli.peer", "join a swarm as a rollout peer"),
    "bootstrap": ("swarm.cli.bootstrap", "run a light bootstrap node (rendezvous, peer exchange)"),
    "simulate": ("swarm.sim.cli", "simulate a swarm distributing one or more steps"),
}

# name -> {subname: (module, help)}
GROUPS: dict[str, dict[str, tuple[str, str]]] = {
    "bench": {
        "codec": ("swarm.bench.codec", "delta codec size and speed vs baselines and memcpy"),
        "transport": ("swarm.bench.transport", "data plane vs py-libp2p streams vs raw TCP"),
        "e2e": ("swarm.bench.e2e", "trainer and peer processes over shaped links, per version"),
        "checks": ("swarm.bench.checks",
                   "the trainer's rollout checks: honest vs cheating gaps, refusals, cost"),
        "attacks": ("swarm.bench.attacks",
                    "honest peers' sync time and memory with a liar or a flooder among them"),
        "sharded": ("swarm.bench.sharded",
                    "an FSDP2 job's sharded publish vs gathering the state to one rank"),
    },
    "lab": {
        "run": ("swarm.lab.runner",
                "a swarm in a kernel network lab (namespaces, tbf uplinks, home NATs)"),
        "bench": ("swarm.lab.bench",
                  "swarm bench e2e in a kernel network lab, half of its peers behind NATs"),
        "compare": ("swarm.lab.compare",
                    "swarm bench e2e over the in-process shaper vs the kernel's tbf, side by side"),
        "cleanup": ("swarm.lab.cleanup", "remove what killed lab runs left behind"),
    },
}


def _load(module: str) -> object:
    return importlib.import_module(module)


class _Parser(argparse.ArgumentParser):
    """Bad flags are one ``swarm: error:`` line, as every other error is, not argparse's
    usage block; a flag is spelled out (``--peer 4`` is not taken for ``--peers 4``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"swarm: error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="swarm",
        description="Ship bit-exact sparse RL weight deltas peer to peer.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    argv = sys.argv[1:]
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in argv:
            _load(module).add_arguments(p)  # type: ignore[attr-defined]
    for group, members in GROUPS.items():
        if not members:
            continue
        g = sub.add_parser(group, help=f"{group} subcommands")
        gsub = g.add_subparsers(dest="subcommand", metavar="WHAT", required=True,
                                parser_class=_Parser)
        for name, (module, help_text) in members.items():
            p = gsub.add_parser(name, help=help_text, description=help_text)
            p.set_defaults(_module=module)
            if group in argv and name in argv:
                _load(module).add_arguments(p)  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = _load(args._module)
    try:
        code: int = module.run(args)  # type: ignore[attr-defined]
    except SwarmError as exc:
        print(f"swarm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swarm: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
