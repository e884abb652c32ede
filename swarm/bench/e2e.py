"""``swarm bench e2e``: the whole product on one machine, measured version by version.

The trainer runs in this process through the library (:class:`~swarm.net.node.Libp2pNode`
and :class:`~swarm.roles.trainer.TrainerNode`, its uplink shaped like ``swarm trainer
--uplink-mbps``) and trains the workload of :mod:`swarm.bench.workload` (a Qwen3-style
decoder, AdamW at lr 1e-6: about 1-1.5% of the bf16 elements change per step). It
publishes version 0, serves the run card, and starts ``--peers`` real ``swarm peer``
processes in regions (``--peer-regions``) with shaped uplinks. After every peer verified
version 0, each step is trained, published as a delta, and waited for until every peer
verified it. With ``--placement`` (written by ``swarm lab bench``) the processes run on a
kernel network lab instead, each on its own address, the kernel shaping the links.

Per version it reports the publish time (extract, encode, sign, persist: ``Published``),
when the first and the last peer verified it (from the start of ``publish``), each peer's
stages (fetch; verify = ``sync_s - fetch_s``; engine apply + save = ``installed_s -
sync_s``), bytes written to disk, bytes from the trainer and from other peers, the
trainer's egress, and two references over the same shaped links:

- ``copy1``: ``P / U_t``, the trainer's uplink sending the payload ``P`` once.
- ``bound``: a lower bound on when the last peer can hold the payload (the Kumar-Ross
  bound of one-to-many distribution with ``N`` peers, trainer uplink ``U_t``, peer uplinks
  ``U_p``, downlinks unlimited, plus the shaper's latencies)::

      bound = max(L_same + max(P / U_t, N * P / (U_t + N * U_p)), L_cross)

  Every byte leaves the trainer at least once (``P / U_t``), and ``N * P`` bytes must
  arrive in all, over at most ``U_t + N * U_p`` bytes/s of upload; the shaper holds every
  message for its one-way latency before it takes a link, so no link carries anything
  before ``L_same`` (same region, 2 ms), and no byte reaches the other region before
  ``L_cross`` (``--wan-latency-ms``). Request round trips, framing and CPU time only add
  to it.
- ``dense``: the trainer sending the dense bf16 state to every peer itself,
  ``dense_bytes * N / U_t``.

Ratios: the last peer's time against ``publish + bound + local`` (``local``: the fastest
peer's verify + apply + save), trainer egress against the payload (1.0: every byte left
the trainer once), and the payload against the dense state.

Version 0's times count from the peers' launch (their start-up, model build and a
keyframe fetch, or none when the seeded build already matches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.bench.placement import Placement, Spot, load
from swarm.bench.procs import MB, BenchError, SwarmChild, say, stop_children, workdir

if TYPE_CHECKING:
    from swarm.bench.workload import ModelShape
    from swarm.roles.trainer import Published

RUN = "bench-e2e"
#: Ports on a placement's addresses (each process has an address of its own there).
BOOTSTRAP_PORT, TRAINER_PORT, PEER_PORT, RELAY_PORT = 4001, 4002, 4003, 4011
TABLE_HEADER = ("ver kind     payload MB  dense MB  publish s  first s    all s  copy1 s  "
                "bound s  dense s  egress MB  egress/P  all/ideal")
PEER_HEADER = ("ver peer  region  kind      fetch s  verify s  apply+save s  written MB  "
               "from trainer MB  from peers MB")


def _extra_sizes() -> dict[str, ModelShape]:
    from swarm.bench.workload import ModelShape

    return {
        # a test-sized model (about 1M parameters) and the 25M of the README's tables
        "1M": ModelShape(vocab=2048, hidden=128, layers=2, intermediate=384, heads=2,
                         kv_heads=1),
        "25M": ModelShape(vocab=16000, hidden=512, layers=3, intermediate=1536, heads=8,
                          kv_heads=4),
    }


SIZE_NAMES = ("1M", "5M", "25M", "30M", "100M", "250M")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", choices=SIZE_NAMES, default="250M",
                   help="workload model size (default 250M, the issue's size; 1M for tests)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps published (default 5)")
    p.add_argument("--peers", type=int, default=4,
                   help="swarm peer processes (default 4)")
    p.add_argument("--trainer-mbps", type=float, default=100.0,
                   help="trainer uplink in Mbit/s (default 100)")
    p.add_argument("--uplink-mbps", type=float, default=200.0,
                   help="every peer's uplink in Mbit/s (default 200)")
    p.add_argument("--wan-latency-ms", type=float, default=50.0,
                   help="one-way latency between regions (default 50)")
    p.add_argument("--trainer-region", default="r0", metavar="NAME",
                   help="the trainer's region (default r0)")
    p.add_argument("--peer-regions", default="r0,r1", metavar="NAME,...",
                   help="the peers' regions, dealt round-robin (default r0,r1: half the "
                        "peers share the trainer's)")
    p.add_argument("--chunk-kib", type=int, default=256,
                   help="target size of a delta chunk in KiB (default 256)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="most seconds for every peer to verify one version (default 600)")
    p.add_argument("--seed", type=int, default=0,
                   help="workload seed (default 0: the peers' seeded build is version 0; "
                        "another seed makes them fetch version 0 as a keyframe)")
    p.add_argument("--placement", type=Path, metavar="FILE",
                   help="run on the network FILE places the processes on, links shaped by "
                        "the kernel (written by `swarm lab bench`); default: loopback, "
                        "every process shaping its own uplink")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="work in DIR and keep it (data dirs, peers' stderr); default: a "
                        "temporary dir, deleted at the end")


class PeerProc(SwarmChild):
    """One ``swarm peer --status-json`` child in a region."""

    def __init__(self, name: str, region: str, argv: list[str], workdir: Path,
                 launcher: Sequence[str] = ()) -> None:
        super().__init__(name, argv, workdir, launcher=launcher)
        self.region = region

    def check(self, version: int) -> None:
        """:raises BenchError: this peer exited, or failed to verify ``version``."""
        rc = self.proc.poll()
        if rc is not None:
            raise BenchError(f"peer {self.name} exited with status {rc} waiting for version "
                             f"{version}; its stderr ends:\n{self.stderr_tail()}")
        failed = self.of("verify_failed", version=version)
        if failed:
            raise BenchError(f"peer {self.name} failed to verify version {version}: "
                             f"{failed[0].get('error')}")


@dataclass(slots=True)
class PeerRow:
    name: str
    region: str
    kind: str
    t: float
    fetch_s: float
    verify_s: float
    apply_save_s: float
    written: int
    from_trainer: int
    from_peers: int
    bytes_up: int


@dataclass(slots=True)
class VersionRow:
    version: int
    kind: str
    payload: int
    dense: int
    publish_s: float
    first_s: float
    all_s: float
    bound_first_s: float
    bound_s: float
    dense_s: float
    egress: int
    peers: list[PeerRow] = field(default_factory=list)

    @property
    def local_s(self) -> float:
        return min((p.verify_s + p.apply_save_s for p in self.peers), default=0.0)

    @property
    def ideal_s(self) -> float:
        return self.publish_s + self.bound_s + self.local_s

    @property
    def egress_ratio(self) -> float:
        return self.egress / max(1, self.payload)

    @property
    def all_over_ideal(self) -> float:
        return self.all_s / self.ideal_s if self.ideal_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "kind": self.kind, "payload_bytes": self.payload,
            "dense_bytes": self.dense, "publish_s": self.publish_s, "first_s": self.first_s,
            "all_s": self.all_s, "bound_first_copy_s": self.bound_first_s,
            "bound_s": self.bound_s, "dense_broadcast_s": self.dense_s,
            "trainer_egress_bytes": self.egress, "egress_ratio": self.egress_ratio,
            "local_s": self.local_s, "ideal_s": self.ideal_s,
            "all_over_ideal": self.all_over_ideal,
            "peers": [{
                "name": p.name, "region": p.region, "kind": p.kind, "fetch_s": p.fetch_s,
                "verify_s": p.verify_s, "apply_save_s": p.apply_save_s,
                "written_bytes": p.written, "from_trainer_bytes": p.from_trainer,
                "from_peers_bytes": p.from_peers, "bytes_up_total": p.bytes_up,
            } for p in self.peers],
        }


@dataclass(frozen=True, slots=True)
class Links:
    trainer: float
    """Trainer uplink, bytes/s."""
    peer: float
    """Every peer's uplink, bytes/s."""
    n: int
    same_latency: float
    cross_latency: float
    """One-way seconds to the other region (0 when every peer is in the trainer's)."""

    def bound_first(self, payload: int) -> float:
        return payload / self.trainer

    def bound(self, payload: int) -> float:
        spread = self.n * payload / (self.trainer + self.n * self.peer)
        return max(self.same_latency + max(payload / self.trainer, spread), self.cross_latency)

    def dense(self, dense: int) -> float:
        return dense * self.n / self.trainer


class _Counters:
    """Each peer's cumulative byte counters at its last verified event."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] = {}

    def take(self, name: str, ev: dict[str, Any]) -> tuple[int, int]:
        """(bytes from the trainer, bytes from peers) since this peer's previous version."""
        down, trainer = int(ev.get("bytes_down", 0)), int(ev.get("bytes_from_trainer", 0))
        p_down, p_trainer = self.last.get(name, (0, 0))
        self.last[name] = (down, trainer)
        d_down = down - p_down if down >= p_down else down
        d_trainer = trainer - p_trainer if trainer >= p_trainer else trainer
        return d_trainer, max(0, d_down - d_trainer)


async def _wait_verified(peers: list[PeerProc], version: int, since: float, timeout: float
                         ) -> dict[str, dict[str, Any]]:
    """Every peer's ``verified`` event of ``version``; progress lines as they come."""
    deadline = time.monotonic() + timeout
    got: dict[str, dict[str, Any]] = {}
    while len(got) < len(peers):
        for p in peers:
            if p.name in got:
                continue
            seen = p.of("verified", version=version)
            if seen:
                ev = got[p.name] = seen[0]
                say(f"  version {version}: {p.name} ({p.region}) verified "
                     f"{ev.get('kind')} of {int(ev.get('bytes', 0)) / MB:.2f} MB at "
                     f"+{float(ev['t']) - since:.2f} s")
                continue
            p.check(version)
        if len(got) == len(peers):
            break
        if time.monotonic() > deadline:
            missing = [p.name for p in peers if p.name not in got]
            raise BenchError(f"version {version}: {', '.join(missing)} did not verify it "
                             f"within --timeout {timeout:g} s")
        await asyncio.sleep(0.05)
    return got


def _row(pub: Published, since: float, links: Links, egress: int,
         events: dict[str, dict[str, Any]], peers: list[PeerProc], counters: _Counters,
         publish_s: float) -> VersionRow:
    ts = [float(ev["t"]) - since for ev in events.values()]
    row = VersionRow(
        version=pub.step, kind=pub.manifest.manifest.kind, payload=pub.payload_bytes,
        dense=pub.dense_bytes, publish_s=publish_s, first_s=min(ts), all_s=max(ts),
        bound_first_s=links.bound_first(pub.payload_bytes), bound_s=links.bound(pub.payload_bytes),
        dense_s=links.dense(pub.dense_bytes), egress=egress)
    for p in peers:
        ev = events[p.name]
        fetch, sync, inst = (float(ev.get(k, 0.0)) for k in ("fetch_s", "sync_s", "installed_s"))
        from_trainer, from_peers = counters.take(p.name, ev)
        row.peers.append(PeerRow(
            name=p.name, region=p.region, kind=str(ev.get("kind")), t=float(ev["t"]) - since,
            fetch_s=fetch, verify_s=max(0.0, sync - fetch), apply_save_s=max(0.0, inst - sync),
            written=int(ev.get("written", 0)), from_trainer=from_trainer, from_peers=from_peers,
            bytes_up=int(ev.get("bytes_up", 0))))
    return row


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summary(rows: list[VersionRow]) -> dict[str, float]:
    """Ratios over the delta versions (all versions when there is none)."""
    deltas = [r for r in rows if r.kind == "delta"] or rows
    return {
        "all_over_ideal": _mean([r.all_over_ideal for r in deltas]),
        "egress_ratio": _mean([r.egress_ratio for r in deltas]),
        "payload_over_dense": _mean([r.payload / max(1, r.dense) for r in deltas]),
        "dense_over_payload": _mean([r.dense / max(1, r.payload) for r in deltas]),
        "all_s": _mean([r.all_s for r in deltas]),
        "dense_s": _mean([r.dense_s for r in deltas]),
    }


def print_tables(rows: list[VersionRow], ratios: dict[str, float], rss: dict[str, int]) -> None:
    say("")
    say(TABLE_HEADER)
    for r in rows:
        say(f"{r.version:>3} {r.kind:<8} {r.payload / MB:>10.2f} {r.dense / MB:>9.1f} "
             f"{r.publish_s:>10.2f} {r.first_s:>8.2f} {r.all_s:>8.2f} {r.bound_first_s:>8.2f} "
             f"{r.bound_s:>8.2f} "
             f"{r.dense_s:>8.2f} {r.egress / MB:>10.2f} {r.egress_ratio:>9.2f} "
             f"{'-' if r.version == 0 else f'{r.all_over_ideal:.2f}':>10}")
    say("")
    say(PEER_HEADER)
    for r in rows:
        for p in r.peers:
            say(f"{r.version:>3} {p.name:<5} {p.region:<7} {p.kind:<8} {p.fetch_s:>8.2f} "
                 f"{p.verify_s:>9.2f} {p.apply_save_s:>13.2f} {p.written / MB:>11.2f} "
                 f"{p.from_trainer / MB:>16.2f} {p.from_peers / MB:>14.2f}")
    say("")
    n = len([r for r in rows if r.kind == "delta"])
    over = f"mean of {n} delta version(s)" if n else "no delta versions"
    say(f"ratios ({over}):")
    say(f"  all verified / (publish + bound + local): {ratios['all_over_ideal']:.2f}x")
    say(f"  trainer egress / payload: {ratios['egress_ratio']:.2f}x")
    say(f"  delta vs dense: {100 * ratios['payload_over_dense']:.2f}% of the dense bf16 "
         f"state ({ratios['dense_over_payload']:.1f}x smaller); all verified in "
         f"{ratios['all_s']:.2f} s vs {ratios['dense_s']:.2f} s for a dense broadcast")
    say("peak RSS: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in rss.items()))


def _bootstrap(spot: Spot, trainer: str, work: Path) -> SwarmChild:
    """The placement's ``swarm bootstrap``, relaying for the peers behind NATs."""
    return SwarmChild("bootstrap", [
        "bootstrap", "--trainer", trainer, "--relay", "--relay-port", str(RELAY_PORT),
        "--listen", f"/ip4/{spot.addr}/tcp/{BOOTSTRAP_PORT}", "--run", RUN,
        "--data-dir", str(work / "bootstrap"), "--status-json"], work, launcher=spot.launcher)


async def _bench(args: argparse.Namespace, work: Path,
                 placed: Placement | None = None) -> dict[str, Any]:
    from swarm.bench.workload import PRESETS, Workload, WorkloadConfig
    from swarm.demo.model import inference_state
    from swarm.engines.hf_model import run_card
    from swarm.identity import Identity
    from swarm.net.dataplane import DataPlaneConfig
    from swarm.net.node import Libp2pNode, NodeConfig
    from swarm.roles.shaper import ShapedNetwork, wan
    from swarm.roles.trainer import TrainerConfig, TrainerNode

    shape = {**PRESETS, **_extra_sizes()}[args.params]
    shape_cfg = wan(args.trainer_mbps * 1e6 / 8, args.wan_latency_ms / 1000)
    peer_regions = [r for r in args.peer_regions.split(",") if r]
    if placed is None:
        regions = set(peer_regions[:args.peers]) | {args.trainer_region}
        same = shape_cfg.same_region_latency
        cross = shape_cfg.cross_region_latency if len(regions) > 1 else 0.0
        where = (f"{args.peers} peers in regions {', '.join(peer_regions[:args.peers])}, "
                 f"the trainer in {args.trainer_region}; trainer uplink "
                 f"{args.trainer_mbps:g} Mbit/s, peers {args.uplink_mbps:g} Mbit/s, "
                 f"{args.wan_latency_ms:g} ms between regions")
    else:
        same = cross = 0.0  # the kernel shapes the links (tbf rates); it adds no latency
        natted = sum(p.natted for p in placed.peers)
        where = (f"{args.peers} peers ({natted} behind a NAT) in regions "
                 f"{', '.join(sorted({p.region for p in placed.peers}))} of a network lab, "
                 f"the trainer in {placed.trainer.region}; uplinks shaped by the kernel: "
                 f"trainer {args.trainer_mbps:g} Mbit/s, peers {args.uplink_mbps:g} Mbit/s")
    links = Links(trainer=shape_cfg.uplink, peer=args.uplink_mbps * 1e6 / 8, n=args.peers,
                  same_latency=same, cross_latency=cross)
    say(f"swarm bench e2e: Qwen3-style {shape.params / 1e6:.1f}M params, AdamW lr 1e-6, "
        f"{args.steps} steps, {where}; work dir {work}")
    t0 = time.perf_counter()
    workload = await asyncio.to_thread(Workload, WorkloadConfig(shape, seed=args.seed))
    say(f"built the workload in {time.perf_counter() - t0:.1f} s")
    me = Identity.load_or_create(work / "trainer" / "node.key")
    host = "127.0.0.1" if placed is None else placed.trainer.addr
    region0 = args.trainer_region if placed is None else placed.trainer.region
    peers: list[PeerProc] = []
    children: list[SwarmChild] = []
    rows: list[VersionRow] = []
    counters = _Counters()
    try:
        boot: tuple[str, ...] = ()
        if placed is not None:
            children.append(_bootstrap(placed.bootstrap, me.peer_id, work))
            ready = await asyncio.to_thread(children[0].wait_event, "ready", args.timeout)
            boot = (str(ready["addr"]),)
        node_cfg = NodeConfig(listen=f"/ip4/{host}/tcp/{0 if placed is None else TRAINER_PORT}",
                              bootstrap=boot, run=RUN, region=region0,
                              data_plane=DataPlaneConfig(host=host))
        async with Libp2pNode(me, node_cfg) as raw, AsyncExitStack() as stack:
            def region_of(peer: str) -> str:
                meta = raw.directory().get(peer)
                return "" if meta is None else meta.region

            net = raw if placed is not None else await stack.enter_async_context(
                ShapedNetwork(raw, shape_cfg, region0, region_of))
            node = await stack.enter_async_context(TrainerNode(
                me, net, TrainerConfig(run=RUN, data_dir=work / "trainer", region=region0,
                                       chunk_target=args.chunk_kib << 10)))
            state = await asyncio.to_thread(inference_state, workload.model)
            t_pub = time.perf_counter()
            v0 = await node.publish(state)
            publish_s = time.perf_counter() - t_pub
            raw.serve_card(run_card(me, RUN, workload.model, v0.manifest).encode())
            say(f"published version 0: keyframe of {v0.payload_bytes / MB:.1f} MB in "
                f"{publish_s:.2f} s; starting {args.peers} peers")
            addr = boot[0] if boot else raw.listen_addresses[0]
            since, egress0 = time.time(), node.driver.exchange.bytes_up
            for i in range(args.peers):
                common = ["peer", "--bootstrap", addr, "--trainer", me.peer_id, "--run", RUN,
                          "--card-timeout", f"{args.timeout:g}", "--status-json"]
                if placed is None:
                    name, region = f"p{i}", peer_regions[i % len(peer_regions)]
                    peers.append(PeerProc(name, region, [
                        *common, "--data-dir", str(work / name), "--name", name,
                        "--region", region, "--listen", "/ip4/127.0.0.1/tcp/0",
                        "--uplink-mbps", f"{args.uplink_mbps:g}",
                        "--wan-latency-ms", f"{args.wan_latency_ms:g}"], work))
                    continue
                spot = placed.peers[i]
                peers.append(PeerProc(spot.name, spot.region, [
                    *common, "--data-dir", str(work / spot.name), "--name", spot.name,
                    "--region", spot.region, "--listen", f"/ip4/{spot.addr}/tcp/{PEER_PORT}"],
                    work, launcher=spot.launcher))
            children.extend(peers)
            events = await _wait_verified(peers, 0, since, args.timeout)
            rows.append(_row(v0, since, links, node.driver.exchange.bytes_up - egress0,
                             events, peers, counters, publish_s))
            for step in range(1, args.steps + 1):
                t_step = time.perf_counter()
                loss = await asyncio.to_thread(workload.step)
                state = await asyncio.to_thread(inference_state, workload.model)
                say(f"step {step}: trained in {time.perf_counter() - t_step:.2f} s "
                    f"(loss {loss:.4f}); publishing")
                egress0 = node.driver.exchange.bytes_up
                since, t_pub = time.time(), time.perf_counter()
                pub = await node.publish(state)
                publish_s = time.perf_counter() - t_pub
                say(f"  version {step}: {pub.manifest.manifest.kind} of "
                    f"{pub.payload_bytes / MB:.2f} MB ({pub.ratio:.1f}x smaller than "
                    f"dense), {len(pub.manifest.manifest.chunks)} chunks, published in "
                    f"{publish_s:.2f} s")
                events = await _wait_verified(peers, step, since, args.timeout)
                rows.append(_row(pub, since, links, node.driver.exchange.bytes_up - egress0,
                                 events, peers, counters, publish_s))
            rss = {"trainer": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            rss.update({p.name: p.peak_rss() for p in peers})
            say("done; stopping the trainer and the peers")
    finally:
        # The trainer's node closes first: it does not redial the peers as they exit.
        await asyncio.to_thread(stop_children, list(reversed(children)))
    ratios = summary(rows)
    print_tables(rows, ratios, rss)
    return {
        "params": args.params, "param_count": shape.params, "steps": args.steps,
        "peers": args.peers, "trainer_mbps": args.trainer_mbps, "peer_mbps": args.uplink_mbps,
        "wan_latency_ms": 0.0 if placed else args.wan_latency_ms, "chunk_kib": args.chunk_kib,
        "shaping": "kernel" if placed else "in-process",
        "natted_peers": sum(p.natted for p in placed.peers) if placed else 0,
        "versions": [r.as_dict() for r in rows], "ratios": ratios, "peak_rss_bytes": rss,
    }


def run(args: argparse.Namespace) -> int:
    placed = None if args.placement is None else load(args.placement)  # one line
    if placed is not None:
        args.peers = len(placed.peers)
    if args.peers < 1 or args.steps < 0:
        raise BenchError("--peers must be at least 1 and --steps at least 0")
    names = [args.trainer_region, *args.peer_regions.split(",")]
    if not all(n and len(n) <= 16 and n.replace("-", "").isalnum() for n in names):
        raise BenchError("--trainer-region and --peer-regions: labels of 1-16 letters, digits "
                         "or dashes, comma-separated")
    if min(args.trainer_mbps, args.uplink_mbps) <= 0 or args.chunk_kib <= 0:
        raise BenchError("--trainer-mbps, --uplink-mbps and --chunk-kib must be positive")
    with workdir(args.keep, "swarm-bench-e2e-") as work:
        figures = asyncio.run(_bench(args, work, placed))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        say(f"figures written to {args.json}")
    return 0
