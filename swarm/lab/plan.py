"""What a network lab is made of, planned without touching the kernel.

A :class:`Scenario` says what to build: regions, how many peers, which share of them sit
behind a home NAT, the uplink rates of the peer classes. :func:`plan` turns it into a
:class:`Plan`: every namespace, veth link (with its addresses and its tbf rates), route
and NAT, all named with the run's prefix, so that :mod:`swarm.lab.kernel` only has to
apply it.

Topology (addresses are carved from the scenario's ``base`` /16, ``10.77.0.0/16`` by
default)::

    core ── region router r0 ── bootstrap, trainer           (region a, public)
        ├── region router r1 ── public peers, home NATs ── NATed peers   (region b)
        └── region router r2 ── ...                                      (region c)

- core <-> router of region i: ``B.0.(4i+1)`` / ``B.0.(4i+2)``, a /30;
- in region i, host j (a public node or a home NAT's WAN side) on its own /30 to its
  router: ``B.(10+i).(4j+1)`` (router) and ``B.(10+i).(4j+2)`` (host);
- home LAN k: ``B.(128+k).0/24``, the NAT at ``.1`` and the peer behind it at ``.2``.

The core routes each region's /24 to its router and blackholes the home LANs (``B.128.0.0
/17``): a dial of a NATed peer's private address times out, as on the internet, and
nothing outside can dial into a home LAN. Each host's uplink is shaped by a tbf on its
side of its link (egress); its downlink is unshaped.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
from dataclasses import dataclass, field

from swarm.errors import SwarmError

#: Every lab's prefix starts with this, then 5 hex digits (``cleanup`` finds them).
ROOT = "swl"
PREFIX_LEN = len(ROOT) + 5
#: Linux limits interface names to 15 characters.
IFNAMSIZ = 15
MAX_HOSTS_PER_REGION = 63
MAX_NATS = 127


class PlanError(SwarmError, ValueError):
    """A scenario that cannot be built (too many peers, a bad rate, a bad range)."""


def new_prefix() -> str:
    """A fresh per-run prefix, such as ``swl3f9a2``."""
    return ROOT + secrets.token_hex(3)[:5]


def is_prefix(text: str) -> bool:
    tail = text[len(ROOT):]
    return (text.startswith(ROOT) and len(text) == PREFIX_LEN
            and all(c in "0123456789abcdef" for c in tail))


@dataclass(frozen=True, slots=True)
class Scenario:
    """What to build. Region 0 (``regions[0]``) holds the bootstrap and the trainer;
    peers are dealt round-robin over the other regions, and round-robin over the
    ``uplinks`` classes; the last ``round(peers * nat_fraction)`` peers (:func:`nat_indices`) sit
    behind a home NAT each."""

    peers: int = 4
    nat_fraction: float = 0.5
    uplinks: tuple[float, ...] = (100.0, 50.0, 20.0)
    trainer_mbps: float = 100.0
    bootstrap_mbps: float = 100.0
    regions: tuple[str, ...] = ("a", "b", "c")
    base: str = "10.77.0.0/16"
    symmetric_nat: bool = False
    """The NATs map every new connection to a fresh random port (MASQUERADE
    ``--random-fully``), as symmetric and carrier-grade NATs do: a hole punch cannot guess
    the port, so NATed peers reach each other only through a relay."""

    def check(self) -> None:
        if self.peers < 1:
            raise PlanError("a lab needs at least 1 peer")
        if not 0.0 <= self.nat_fraction <= 1.0:
            raise PlanError(f"the NAT fraction must be in [0, 1], not {self.nat_fraction:g}")
        rates = (*self.uplinks, self.trainer_mbps, self.bootstrap_mbps)
        if not self.uplinks or any(not math.isfinite(r) or r <= 0 for r in rates):
            raise PlanError("uplink rates must be positive Mbit/s")
        if len(self.regions) < 2 or len(set(self.regions)) != len(self.regions):
            raise PlanError("regions: at least 2 distinct labels (the first is the "
                            "trainer's)")
        if any(not r or len(r) > 16 or not r.replace("-", "").isalnum() for r in self.regions):
            raise PlanError("region labels are 1-16 letters, digits or dashes")
        _base(self.base)
        if len(self.regions) > 64:
            raise PlanError("at most 64 regions")
        nats = self.nat_count
        if nats > MAX_NATS:
            raise PlanError(f"at most {MAX_NATS} NATed peers")
        peer_regions = len(self.regions) - 1
        if math.ceil(self.peers / peer_regions) > MAX_HOSTS_PER_REGION:
            raise PlanError(f"at most {MAX_HOSTS_PER_REGION} peers per region")

    @property
    def nat_count(self) -> int:
        return math.floor(self.peers * self.nat_fraction + 0.5)


def _base(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text)
    except ValueError as exc:
        raise PlanError(f"bad address range {text!r}: {exc}") from None
    if net.prefixlen != 16 or not net.is_private:
        raise PlanError(f"the lab's range must be a private /16, not {text}")
    return net


def nat_indices(peers: int, nats: int) -> list[int]:
    """Which peers (by index) sit behind a NAT: the last ``nats`` (peers are dealt to
    regions round-robin, so each region gets public and NATed ones alike)."""
    return list(range(peers - max(0, min(nats, peers)), peers))


@dataclass(frozen=True, slots=True)
class Link:
    """A veth pair: end ``a`` in namespace ``a_ns``, end ``b`` in ``b_ns``; each end's
    address (with its prefix length) and the tbf rate on its egress (0: unshaped)."""

    a_ns: str
    a_if: str
    a_addr: str
    b_ns: str
    b_if: str
    b_addr: str
    prefixlen: int
    a_mbps: float = 0.0
    b_mbps: float = 0.0


@dataclass(frozen=True, slots=True)
class Route:
    ns: str
    dest: str  # "default", a CIDR
    via: str = ""  # empty with kind "blackhole"
    kind: str = ""  # "" or "blackhole"


@dataclass(frozen=True, slots=True)
class Nat:
    """A home router: MASQUERADE out of ``wan_if``; new connections in from it dropped."""

    ns: str
    wan_if: str
    lan_if: str
    wan_addr: str
    lan_net: str
    symmetric: bool = False


@dataclass(frozen=True, slots=True)
class Host:
    """A node of the lab: where it runs and which address it listens on."""

    name: str  # "bootstrap", "trainer", "p0", ...
    role: str  # "bootstrap", "trainer", "peer"
    region: str
    ns: str
    addr: str
    """The address it listens on (a private one behind a NAT)."""
    seen_as: str
    """The address others see its connections come from (its NAT's, or ``addr``)."""
    uplink_mbps: float
    nat: Nat | None = None

    @property
    def natted(self) -> bool:
        return self.nat is not None


@dataclass(slots=True)
class Plan:
    prefix: str
    scenario: Scenario
    namespaces: list[str] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    nats: list[Nat] = field(default_factory=list)
    hosts: list[Host] = field(default_factory=list)
    forwarders: list[str] = field(default_factory=list)
    """Namespaces that forward packets (the core, region routers, NATs)."""

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def peers(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "peer"]

    def interfaces(self) -> list[str]:
        return [name for link in self.links for name in (link.a_if, link.b_if)]


def plan(scenario: Scenario, prefix: str | None = None) -> Plan:
    """Lay out ``scenario``'s namespaces, links, addresses, routes and NATs.

    :raises PlanError: the scenario cannot be built.
    """
    scenario.check()
    prefix = prefix or new_prefix()
    if not is_prefix(prefix):
        raise PlanError(f"bad lab prefix {prefix!r} (expected {ROOT} and 5 hex digits)")
    b = _base(scenario.base).network_address.packed[:2]
    b0, b1 = b[0], b[1]

    def ip(third: int, fourth: int) -> str:
        return f"{b0}.{b1}.{third}.{fourth}"

    out = Plan(prefix, scenario)
    counter = iter(range(10_000))

    def link(a_ns: str, a_addr: str, b_ns: str, b_addr: str, prefixlen: int,
             a_mbps: float = 0.0, b_mbps: float = 0.0) -> Link:
        n = next(counter)
        made = Link(a_ns, f"{prefix}l{n}a", a_addr, b_ns, f"{prefix}l{n}b", b_addr,
                    prefixlen, a_mbps, b_mbps)
        assert len(made.a_if) <= IFNAMSIZ and len(made.b_if) <= IFNAMSIZ
        out.links.append(made)
        return made

    def ns(name: str) -> str:
        full = f"{prefix}-{name}"
        out.namespaces.append(full)
        return full

    core = ns("core")
    out.forwarders.append(core)
    out.routes.append(Route(core, f"{b0}.{b1}.128.0/17", kind="blackhole"))
    routers: list[str] = []
    for i in range(len(scenario.regions)):
        router = ns(f"r{i}")
        routers.append(router)
        out.forwarders.append(router)
        link(core, ip(0, 4 * i + 1), router, ip(0, 4 * i + 2), 30)
        out.routes.append(Route(core, f"{ip(10 + i, 0)}/24", ip(0, 4 * i + 2)))
        out.routes.append(Route(router, "default", ip(0, 4 * i + 1)))
    slots = [0] * len(scenario.regions)

    def attach(region: int, ns_name: str, mbps: float) -> Link:
        """A /30 from region ``region``'s router to ``ns_name`` (end ``a``)."""
        j = slots[region]
        slots[region] += 1
        made = link(ns_name, ip(10 + region, 4 * j + 2), routers[region],
                    ip(10 + region, 4 * j + 1), 30, a_mbps=mbps)
        out.routes.append(Route(ns_name, "default", made.b_addr))
        return made

    region0 = scenario.regions[0]
    for name, mbps in (("bootstrap", scenario.bootstrap_mbps),
                       ("trainer", scenario.trainer_mbps)):
        space = ns(name)
        addr = attach(0, space, mbps).a_addr
        out.hosts.append(Host(name, name, region0, space, addr, addr, mbps))
    natted = set(nat_indices(scenario.peers, scenario.nat_count))
    k = 0
    for p in range(scenario.peers):
        region = 1 + p % (len(scenario.regions) - 1)
        mbps = scenario.uplinks[p % len(scenario.uplinks)]
        name = f"p{p}"
        space = ns(name)
        if p not in natted:
            addr = attach(region, space, mbps).a_addr
            out.hosts.append(Host(name, "peer", scenario.regions[region], space, addr, addr,
                                  mbps))
            continue
        home = ns(f"nat{k}")
        out.forwarders.append(home)
        wan = attach(region, home, 0.0)
        lan = link(space, ip(128 + k, 2), home, ip(128 + k, 1), 24, a_mbps=mbps)
        out.routes.append(Route(space, "default", ip(128 + k, 1)))
        nat = Nat(home, wan.a_if, lan.b_if, wan.a_addr, f"{ip(128 + k, 0)}/24",
                  scenario.symmetric_nat)
        out.nats.append(nat)
        out.hosts.append(Host(name, "peer", scenario.regions[region], space, lan.a_addr,
                              wan.a_addr, mbps, nat))
        k += 1
    return out


def parse_rates(text: str) -> tuple[float, ...]:
    """``"100,50,20"`` -> ``(100.0, 50.0, 20.0)``.

    :raises PlanError: not a comma-separated list of positive numbers.
    """
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"--uplinks {text!r}: expected Mbit/s rates such as 100,50,20"
                        ) from None
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise PlanError(f"--uplinks {text!r}: expected positive Mbit/s rates such as 100,50,20")
    return rates
