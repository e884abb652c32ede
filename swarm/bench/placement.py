"""Where ``swarm bench e2e`` runs its processes when it does not run them on loopback.

By default the benchmark's trainer and peers listen on ``127.0.0.1`` and shape their own
uplinks (:mod:`swarm.roles.shaper`). A placement file (``--placement FILE``, written by
``swarm lab bench``) puts them on a real network instead: the trainer on the address of
the namespace the benchmark runs in, a ``swarm bootstrap`` and each ``swarm peer`` behind
a command prefix (``ip netns exec NS ...``) on its own address, links shaped by the
kernel. The file is JSON::

    {"trainer": {"addr": "10.77.10.6", "region": "a"},
     "bootstrap": {"addr": "10.77.10.2", "launcher": ["ip", "netns", "exec", "..."]},
     "peers": [{"name": "p0", "region": "b", "addr": "10.77.11.2", "natted": false,
                "launcher": [...]}, ...]}
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import SwarmError

MAX_PLACEMENT_BYTES = 1 << 20
MAX_PEERS = 1024


class PlacementError(SwarmError, ValueError):
    """A placement file that cannot be used."""


@dataclass(frozen=True, slots=True)
class Spot:
    name: str
    region: str
    addr: str
    launcher: tuple[str, ...] = ()
    natted: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    trainer: Spot
    bootstrap: Spot
    peers: tuple[Spot, ...]

    def as_dict(self) -> dict[str, Any]:
        def spot(s: Spot) -> dict[str, Any]:
            return {"name": s.name, "region": s.region, "addr": s.addr,
                    "launcher": list(s.launcher), "natted": s.natted}

        return {"trainer": spot(self.trainer), "bootstrap": spot(self.bootstrap),
                "peers": [spot(p) for p in self.peers]}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")


def _spot(raw: object, where: str, default_name: str) -> Spot:
    if not isinstance(raw, dict):
        raise PlacementError(f"{where}: expected an object")
    name = raw.get("name", default_name)
    region = raw.get("region", "")
    addr = raw.get("addr")
    launcher = raw.get("launcher", [])
    natted = raw.get("natted", False)
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 32:
        raise PlacementError(f"{where}: bad name {name!r}")
    if not isinstance(region, str) or len(region) > 16:
        raise PlacementError(f"{where}: bad region {region!r}")
    try:
        if not isinstance(addr, str):
            raise ValueError(addr)
        ipaddress.IPv4Address(addr)
    except ValueError:
        raise PlacementError(f"{where}: addr {addr!r} is not an IPv4 address") from None
    if not isinstance(launcher, list) or not all(isinstance(a, str) for a in launcher):
        raise PlacementError(f"{where}: launcher must be a list of strings")
    if not isinstance(natted, bool):
        raise PlacementError(f"{where}: natted must be true or false")
    return Spot(name, region, addr, tuple(launcher), natted)


def load(path: Path) -> Placement:
    """:raises PlacementError: unreadable, too large, or not a placement."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PLACEMENT_BYTES + 1)
    except OSError as exc:
        raise PlacementError(f"cannot read placement {path}: {exc.strerror}") from None
    if len(data) > MAX_PLACEMENT_BYTES:
        raise PlacementError(f"placement {path} is over {MAX_PLACEMENT_BYTES} bytes")
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlacementError(f"placement {path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PlacementError(f"placement {path}: expected an object")
    peers = raw.get("peers")
    if not isinstance(peers, list) or not 1 <= len(peers) <= MAX_PEERS:
        raise PlacementError(f"placement {path}: peers must be a list of 1-{MAX_PEERS}")
    out = Placement(_spot(raw.get("trainer"), "trainer", "trainer"),
                    _spot(raw.get("bootstrap"), "bootstrap", "bootstrap"),
                    tuple(_spot(p, f"peers[{i}]", f"p{i}") for i, p in enumerate(peers)))
    names = [p.name for p in out.peers]
    if len(set(names)) != len(names):
        raise PlacementError(f"placement {path}: peer names repeat")
    return out
