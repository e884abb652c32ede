"""Simulation scenarios: regions, link classes, payload, churn and malice; presets; TOML.

A :class:`Scenario` is a frozen description; :meth:`Scenario.build` turns it into a
deterministic population (regions and link classes drawn from the seed) and a
:class:`~swarm.sim.network.Topology`. Nodes ``0 .. trainer_hosts - 1`` are the trainer's
hosts (node 0 alone by default), the peers follow.
"""

from __future__ import annotations

import dataclasses
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import LocalProtocolError
from swarm.sim.network import Topology
from swarm.sim.prices import DEFAULT_PRICES

GBPS = 1e9 / 8
MAX_PEERS = 4096
MAX_CHUNKS = 1 << 16
MAX_TRAINER_HOSTS = 64
QWEN3_8B_BF16_BYTES = 16.4e9


@dataclass(frozen=True, slots=True)
class LinkClass:
    """A kind of rollout host: its access link in Gbit/s, its share of the population and
    how fast it generates rollouts (tokens/s, for the end-to-end loop of
    :mod:`swarm.sim.loop`)."""

    name: str
    up_gbps: float
    down_gbps: float
    weight: float
    tokens_per_s: float = 2500.0


@dataclass(frozen=True, slots=True)
class ChurnEvent:
    """At ``at`` seconds, ``count`` peers still downloading ``"crash"`` (silently) or
    ``"leave"`` (saying so), or ``count`` new peers ``"join"`` with nothing."""

    at: float
    kind: str
    count: int

    def __post_init__(self) -> None:
        if self.kind not in ("crash", "leave", "join") or self.count < 0 or self.at < 0:
            raise LocalProtocolError(f"bad churn event {self!r}")


@dataclass(frozen=True, slots=True)
class Scenario:
    """One simulated deployment. Bandwidths in Gbit/s, latencies in milliseconds."""

    name: str = "custom"
    peers: int = 64
    regions: tuple[str, ...] = ("us-east", "us-west", "eu", "asia")
    latency_ms: tuple[tuple[float, ...], ...] = (
        (2, 35, 40, 90), (35, 2, 70, 60), (40, 70, 2, 110), (90, 60, 110, 2))
    """One-way latency between regions (diagonal: inside a region)."""
    wan_gbps: tuple[tuple[float, ...], ...] = (
        (0, 1, 1, 0.5), (1, 0, 1, 0.5), (1, 1, 0, 0.5), (0.5, 0.5, 0.5, 0))
    """Capacity of the shared link from region ``a`` to region ``b`` (diagonal unused)."""
    classes: tuple[LinkClass, ...] = (
        LinkClass("datacenter", 1.0, 1.0, 0.4),
        LinkClass("cloud", 0.5, 0.5, 0.4),
        LinkClass("edge", 0.1, 0.3, 0.2),
    )
    trainer_region: int = 0
    trainer_up_gbps: float = 1.0
    trainer_down_gbps: float = 1.0
    trainer_hosts: int = 1
    """Hosts of a sharded trainer, each with the trainer's links and exchange config in
    the trainer region; host ``h`` seeds the ``h``-th contiguous share of the chunks (its
    ranks' chunks, in the manifest's rank order)."""
    model_bytes: float = QWEN3_8B_BF16_BYTES
    """Dense bf16 state (the full-broadcast baseline sends this)."""
    delta_ratio: float = 180.0
    """Dense bytes / delta bytes, as measured for the codec."""
    chunk_bytes: int = 1 << 20
    rollout_s: float = 30.0
    steps: int = 1
    malicious: float = 0.0
    """Fraction of peers that serve corrupt chunks."""
    churn: tuple[ChurnEvent, ...] = ()
    max_local: int = 32
    """Same-region neighbours per peer."""
    max_remote: int = 12
    """Other-region neighbours per peer."""
    import_ranks: str = "directory"
    """``"directory"``: chunks are imported into a region in rank order over all of its
    members, with remote neighbours by group (:mod:`swarm.sim.directory`), and a peer
    dials region-mates only until it has ``max_local`` (counting those that dialled it,
    as the discovery loop does); ``"neighbours"``: ranks over a peer's own region-mates
    among its neighbours (the exchange core's default), random remote neighbours, and
    ``max_local`` and ``max_remote`` dialled by every peer."""
    upload_concurrency: int = 4
    """Pieces each peer sends at once (its upload scheduler); the rest wait their turn."""
    trainer_upload_concurrency: int = 4
    """Pieces the trainer sends at once."""
    rate_quantum: float = 0.002
    """Fair shares are recomputed at most once per this many seconds (0: on every
    change); in between, new flows wait, so results err on the slow side."""
    seed: int = 0
    chunk_payload: bool = True
    """Carry real random chunk bytes (hashed with BLAKE3 on arrival)."""
    trainer_step_s: float = 20.0
    """End-to-end loop: seconds the trainer takes for one optimizer step on a batch."""
    staleness: int = 1
    """End-to-end loop: most steps a rollout's version may lag the step that consumes it
    (0: on-policy)."""
    trainer_gpus: int = 1
    """End-to-end loop: GPUs the trainer rents (priced per GPU-hour)."""
    gpus_per_peer: int = 1
    """End-to-end loop: GPUs each rollout peer rents."""
    usd_trainer_gpu_h: float = DEFAULT_PRICES.trainer_gpu_h
    """On-demand cross-cloud price of one trainer GPU-hour (see :mod:`swarm.sim.prices`)."""
    usd_peer_gpu_h: float = DEFAULT_PRICES.peer_gpu_h
    """On-demand cross-cloud price of one rollout GPU-hour."""
    usd_rdma_trainer_gpu_h: float = DEFAULT_PRICES.rdma_trainer_gpu_h
    """Reserved RDMA-cluster price of one trainer GPU-hour (the ideal run's)."""
    usd_rdma_peer_gpu_h: float = DEFAULT_PRICES.rdma_peer_gpu_h
    """Reserved RDMA-cluster price of one rollout GPU-hour."""
    usd_wan_gb: float = DEFAULT_PRICES.wan_gb
    """Price of one GB crossing regions (internet egress)."""
    churn_per_min: float = 0.0
    """End-to-end loop: percent of the online peers that leave per minute."""
    away_s: float = 120.0
    """End-to-end loop: mean seconds a leaving peer stays away."""
    fresh_joiners: float = 0.5
    """End-to-end loop: fraction of the peers coming back that are new (holding only
    version 0, the base checkpoint) rather than returning with the version they left with."""
    keep_versions: int = 8
    """Deltas the trainer keeps for catch-up (the manifests' ``keep_versions``)."""

    @property
    def payload_bytes(self) -> int:
        return int(self.model_bytes / self.delta_ratio)

    def chunk_sizes(self) -> list[int]:
        total = self.payload_bytes
        full, rest = divmod(total, self.chunk_bytes)
        return [self.chunk_bytes] * full + ([rest] if rest else [])

    def host_chunks(self, h: int) -> range:
        """The chunk indices trainer host ``h`` holds at the start."""
        n, hosts = len(self.chunk_sizes()), self.trainer_hosts
        return range(h * n // hosts, (h + 1) * n // hosts)

    def with_(self, **changes: Any) -> Scenario:
        return dataclasses.replace(self, **changes)

    def check(self) -> None:
        r = len(self.regions)
        if self.peers < 1 or r < 1 or not 0 <= self.trainer_region < r:
            raise LocalProtocolError("need at least one peer, one region, a trainer region")
        for m, what in ((self.latency_ms, "latency_ms"), (self.wan_gbps, "wan_gbps")):
            if len(m) != r or any(len(row) != r for row in m):
                raise LocalProtocolError(f"{what} must be {r}x{r}")
        if r > 1 and any(self.wan_gbps[a][b] <= 0 for a in range(r) for b in range(r)
                         if a != b):
            raise LocalProtocolError("every WAN link needs a positive capacity")
        if not self.classes or any(c.up_gbps <= 0 or c.down_gbps <= 0 or c.weight < 0
                                   for c in self.classes):
            raise LocalProtocolError("link classes need positive capacities")
        if not 0 <= self.malicious < 1 or self.delta_ratio < 1 or self.chunk_bytes < 1024:
            raise LocalProtocolError("malicious in [0, 1), delta_ratio >= 1, chunks >= 1 KiB")
        if self.peers + sum(e.count for e in self.churn) > MAX_PEERS:
            raise LocalProtocolError(f"at most {MAX_PEERS} peers")
        if len(self.chunk_sizes()) > MAX_CHUNKS or self.steps < 1 or self.steps > 1000:
            raise LocalProtocolError(f"at most {MAX_CHUNKS} chunks and 1..1000 steps")
        if (self.upload_concurrency < 1 or self.trainer_upload_concurrency < 1
                or self.rate_quantum < 0 or self.max_local < 0 or self.max_remote < 0
                or self.rollout_s < 0):
            raise LocalProtocolError("concurrency >= 1; quantum, neighbours, rollout >= 0")
        self._check_loop()
        if self.import_ranks not in ("directory", "neighbours"):
            raise LocalProtocolError("import_ranks is 'directory' or 'neighbours'")
        hosts = self.trainer_hosts
        if (not isinstance(hosts, int) or isinstance(hosts, bool)
                or not 1 <= hosts <= min(MAX_TRAINER_HOSTS, len(self.chunk_sizes()))):
            raise LocalProtocolError(
                f"trainer_hosts must be an integer from 1 to {MAX_TRAINER_HOSTS} and at most "
                f"the number of chunks ({len(self.chunk_sizes())}), not {hosts!r}")

    def _check_loop(self) -> None:
        if any(not c.tokens_per_s > 0 for c in self.classes):
            raise LocalProtocolError("every link class needs tokens_per_s > 0")
        ints = (self.staleness, self.trainer_gpus, self.gpus_per_peer, self.keep_versions)
        if any(not isinstance(x, int) or isinstance(x, bool) for x in ints):
            raise LocalProtocolError("staleness, trainer_gpus, gpus_per_peer and "
                                     "keep_versions must be integers")
        if not (0 <= self.staleness <= 64 and 0 <= self.trainer_gpus <= 4096
                and 0 <= self.gpus_per_peer <= 64 and 1 <= self.keep_versions <= 1 << 20):
            raise LocalProtocolError("staleness in 0..64, GPUs in 0..4096 and 0..64 per "
                                     "peer, keep_versions >= 1")
        prices = (self.usd_trainer_gpu_h, self.usd_peer_gpu_h, self.usd_rdma_trainer_gpu_h,
                  self.usd_rdma_peer_gpu_h, self.usd_wan_gb)
        if not self.trainer_step_s >= 0 or any(not p >= 0 for p in prices):
            raise LocalProtocolError("trainer_step_s and prices must be >= 0")
        if not (0 <= self.churn_per_min <= 100 and self.away_s > 0
                and 0 <= self.fresh_joiners <= 1):
            raise LocalProtocolError("churn_per_min in [0, 100], away_s > 0, "
                                     "fresh_joiners in [0, 1]")

    def build(self) -> Population:
        """Assign regions and link classes (deterministic from the seed)."""
        self.check()
        rng = random.Random(self.seed)
        joins = sum(e.count for e in self.churn if e.kind == "join")
        total = self.peers + joins
        hosts = self.trainer_hosts
        regions = [self.trainer_region] * hosts + [i % len(self.regions)
                                                   for i in range(total)]
        weights = [c.weight for c in self.classes]
        # stratified: the class mix of each region follows the weights
        klass = [-1] * hosts
        per_region: dict[int, list[int]] = {}
        for i in range(total):
            per_region.setdefault(i % len(self.regions), []).append(i + hosts)
        assigned: dict[int, int] = {}
        for members in per_region.values():
            counts = _apportion(weights, len(members))
            kinds = [k for k, c in enumerate(counts) for _ in range(c)]
            rng.shuffle(kinds)
            for node, k in zip(members, kinds, strict=True):
                assigned[node] = k
        klass += [assigned[i + hosts] for i in range(total)]
        up = [self.trainer_up_gbps * GBPS] * hosts + [self.classes[k].up_gbps * GBPS
                                                      for k in klass[hosts:]]
        down = [self.trainer_down_gbps * GBPS] * hosts + [self.classes[k].down_gbps * GBPS
                                                          for k in klass[hosts:]]
        honest = list(range(hosts, self.peers + hosts))
        n_bad = round(self.malicious * self.peers)
        bad = set(rng.sample(honest, n_bad)) if n_bad else set()
        topo = Topology(
            up=tuple(up), down=tuple(down), region=tuple(regions),
            wan=tuple(tuple(g * GBPS for g in row) for row in self.wan_gbps),
            latency=tuple(tuple(ms / 1000 for ms in row) for row in self.latency_ms),
        )
        return Population(self, topo, tuple(klass), frozenset(bad), self.peers, hosts)


def _apportion(weights: list[float], n: int) -> list[int]:
    total = sum(weights) or 1.0
    raw = [w / total * n for w in weights]
    counts = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda k: -(raw[k] - counts[k]))
    for k in order[: n - sum(counts)]:
        counts[k] += 1
    return counts


@dataclass(frozen=True, slots=True)
class Population:
    """The built scenario: nodes ``0 .. hosts - 1`` are the trainer's hosts, the next
    ``initial`` peers are present at the start, later ids join by churn."""

    scenario: Scenario
    topo: Topology
    klass: tuple[int, ...]
    malicious: frozenset[int]
    initial: int
    hosts: int = 1

    @property
    def peers(self) -> list[int]:
        """The peers present at the start."""
        return list(range(self.hosts, self.hosts + self.initial))


PRESETS: dict[str, Scenario] = {
    "wan64": Scenario(name="wan64"),
    "paper-2r": Scenario(
        name="paper-2r", regions=("us", "eu"), latency_ms=((2, 40), (40, 2)),
        wan_gbps=((0, 0.5), (0.5, 0)),
    ),
    "paper-3r": Scenario(
        name="paper-3r", regions=("us", "eu", "asia"),
        latency_ms=((2, 40, 90), (40, 2, 110), (90, 110, 2)),
        wan_gbps=((0, 1, 0.5), (1, 0, 0.5), (0.5, 0.5, 0)),
    ),
    "homogeneous": Scenario(
        name="homogeneous", classes=(LinkClass("cloud", 1.0, 1.0, 1.0),),
    ),
    "small": Scenario(name="small", peers=16, delta_ratio=1000.0),
}


def load_toml(path: Path, base: Scenario) -> Scenario:
    """Override ``base`` with the keys of a TOML file (same names as the fields).

    Classes are ``[[classes]]`` tables (name, up_gbps, down_gbps, weight); churn events
    ``[[churn]]`` tables (at, kind, count).

    :raises LocalProtocolError: unknown keys or bad values.
    """
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LocalProtocolError(f"{path}: {exc}") from exc
    return from_mapping(doc, base)


def from_mapping(doc: dict[str, Any], base: Scenario) -> Scenario:
    names = {f.name for f in dataclasses.fields(Scenario)}
    unknown = set(doc) - names
    if unknown:
        raise LocalProtocolError(f"unknown scenario keys: {sorted(unknown)}")
    changes: dict[str, Any] = {}
    try:
        for key, value in doc.items():
            if key == "classes":
                changes[key] = tuple(LinkClass(**c) for c in value)
            elif key == "churn":
                changes[key] = tuple(ChurnEvent(**c) for c in value)
            elif key in ("latency_ms", "wan_gbps"):
                changes[key] = tuple(tuple(float(x) for x in row) for row in value)
            elif key == "regions":
                changes[key] = tuple(str(x) for x in value)
            else:
                changes[key] = value
        sc = base.with_(**changes)
    except TypeError as exc:
        raise LocalProtocolError(f"bad scenario value: {exc}") from exc
    sc.check()
    return sc
