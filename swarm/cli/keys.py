"""``swarm keygen``: write a new identity key."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.identity import Identity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", type=Path, default=Path("swarm.key"),
                   help="where to write the PEM key (mode 0600); default ./swarm.key")
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")


def run(args: argparse.Namespace) -> int:
    ident = Identity.generate()
    path = ident.save(args.out, overwrite=args.force)
    print(f"wrote {path}")
    print(f"peer id: {ident.peer_id}")
    return 0
