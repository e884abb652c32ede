"""End-to-end runs: one distribution run per method, then the RL loop over ``steps``.

Every step's payload is the same size, so each method's distribution is simulated once
and its per-peer sync times feed every step of :func:`swarm.sim.loop.simulate_loop`: the
swarm on :class:`~swarm.sim.engine.SwarmSim` (the real exchange core on every node),
the others on the plans of :mod:`swarm.sim.baselines` over the same network.

Methods:

- ``swarm``: the sparse delta over the swarm, ``staleness`` steps off-policy at most.
- ``dense, one stream``: the trainer sends the dense bf16 state to one actor after
  another; on-policy (every actor waits for each version), as a synchronous full-weight
  broadcast (PrimeRL-Full) does.
- ``dense, multi-stream``: the same, to every actor at once.
- ``async dense``: the multi-stream broadcast, overlapped with generation within the
  staleness bound; only the newest state is sent when versions queue.
- ``relay per region``: the sparse delta to one relay per region, which forwards it
  in-region (the AuroraRL/SparrowRL scheme), overlapped within the bound.
- ``ideal (RDMA)``: zero-cost sync, priced at reserved RDMA-cluster rates (a single
  datacenter); every other method is priced at on-demand cross-cloud rates plus the bytes
  that cross regions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from swarm.sim import baselines
from swarm.sim.engine import SwarmSim
from swarm.sim.loop import LoopResult, LoopSpec, Method, simulate_loop
from swarm.sim.prices import tokens_per_usd, usd_per_hour
from swarm.sim.scenario import Population, Scenario

SWARM, DENSE1, DENSEN, ASYNC, RELAY, IDEAL = (
    "swarm", "dense, one stream", "dense, multi-stream", "async dense",
    "relay per region", "ideal (RDMA)")
METHODS = (SWARM, DENSE1, DENSEN, ASYNC, RELAY, IDEAL)
DENSE_BASELINES = (DENSE1, DENSEN, ASYNC)


@dataclass(slots=True)
class Row:
    """One method's end-to-end figures."""

    name: str
    sync_s: float
    """Slowest actor's sync of one version (from the distribution run)."""
    loop: LoopResult
    usd_h: float
    tokens_per_usd: float
    priced: str
    """``"on-demand"`` or ``"reserved RDMA"``."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self.loop)
        d.update(name=self.name, sync_s=self.sync_s, usd_per_h=self.usd_h,
                 tokens_per_usd=self.tokens_per_usd, priced=self.priced,
                 trainer_egress_gb_per_step=self.loop.egress_per_step / 1e9)
        return d


@dataclass(slots=True)
class EndToEnd:
    scenario: Scenario
    rows: list[Row]
    distribution_wall_s: float

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def to_json(self) -> dict[str, Any]:
        sc = self.scenario
        return {"scenario": sc.name, "peers": sc.peers, "steps": sc.steps,
                "payload_bytes": sc.payload_bytes, "model_bytes": sc.model_bytes,
                "distribution_wall_s": self.distribution_wall_s,
                "methods": [r.to_json() for r in self.rows]}


def _per_actor(done: dict[int, float], peers: list[int]) -> tuple[float, ...]:
    worst = max(done.values(), default=float("inf"))
    return tuple(done.get(p, worst) for p in peers)


def distributions(sc: Scenario, pop: Population,
                  progress: Callable[[float, int, int], None] | None = None
                  ) -> tuple[dict[str, Method], float]:
    """Each method's sync times and bytes for one version (one distribution run each)."""
    import time

    wall = time.perf_counter()
    peers = pop.peers
    res = SwarmSim(pop, progress=progress).run()
    k, h, sizes = sc.staleness, pop.hosts, sc.chunk_sizes()
    kw = {"concurrency": sc.upload_concurrency,
          "trainer_concurrency": sc.trainer_upload_concurrency}
    one = baselines.dense(pop.topo, peers, int(sc.model_bytes), hosts=h, streams=1)
    many = baselines.dense(pop.topo, peers, int(sc.model_bytes), hosts=h)
    rel = baselines.relay(pop.topo, peers, sizes, hosts=h, **kw)

    def of(b: baselines.BaselineResult, name: str, stale: int, dense: bool) -> Method:
        return Method(name, _per_actor(b.peer_done, peers), stale, dense,
                      b.trainer_egress, sum(b.region_in))

    methods = {
        SWARM: Method(SWARM, _per_actor(res.peer_done, peers), k, False,
                      res.trainer_egress, sum(res.region_in)),
        DENSE1: of(one, DENSE1, 0, True),
        DENSEN: of(many, DENSEN, 0, True),
        ASYNC: of(many, ASYNC, k, True),
        RELAY: of(rel, RELAY, k, False),
        IDEAL: Method(IDEAL, (0.0,) * len(peers), k),
    }
    return methods, time.perf_counter() - wall


def loop_spec(sc: Scenario, pop: Population) -> LoopSpec:
    rates = tuple(sc.classes[pop.klass[p]].tokens_per_s * sc.gpus_per_peer
                  for p in pop.peers)
    return LoopSpec(
        steps=sc.steps, rollout_s=sc.rollout_s, trainer_step_s=sc.trainer_step_s,
        rates=rates, down=tuple(pop.topo.down[p] for p in pop.peers),
        delta_bytes=sc.payload_bytes, state_bytes=sc.model_bytes,
        keep_versions=sc.keep_versions, churn_per_min=sc.churn_per_min, away_s=sc.away_s,
        fresh_joiners=sc.fresh_joiners, seed=sc.seed)


def price(sc: Scenario, loop: LoopResult, rdma: bool) -> tuple[float, float]:
    """(dollars an hour, tokens per dollar) of one method's run."""
    gpus = sc.peers * sc.gpus_per_peer
    if rdma:
        usd = usd_per_hour(sc.trainer_gpus, gpus, sc.usd_rdma_trainer_gpu_h,
                           sc.usd_rdma_peer_gpu_h)
    else:
        wan_gb_h = loop.wan_bytes / 1e9 / max(loop.duration_s, 1e-9) * 3600
        usd = usd_per_hour(sc.trainer_gpus, gpus, sc.usd_trainer_gpu_h, sc.usd_peer_gpu_h,
                           wan_gb_h, sc.usd_wan_gb)
    return usd, tokens_per_usd(loop.tokens_per_s, usd)


def run_end_to_end(sc: Scenario,
                   progress: Callable[[float, int, int], None] | None = None) -> EndToEnd:
    """Every method's loop over ``sc.steps`` steps of ``sc``."""
    pop = sc.build()
    methods, wall = distributions(sc, pop, progress)
    spec = loop_spec(sc, pop)
    rows = []
    for name in METHODS:
        m = methods[name]
        res = simulate_loop(spec, m)
        rdma = name == IDEAL
        usd, tpd = price(sc, res, rdma)
        rows.append(Row(name, max(m.sync_s, default=0.0), res, usd, tpd,
                        "reserved RDMA" if rdma else "on-demand"))
    return EndToEnd(sc, rows, wall)


def format_end_to_end(e: EndToEnd) -> str:
    sc = e.scenario
    head = (f"end to end, {sc.name}: {sc.steps} steps, {sc.peers} actors, trainer step "
            f"{sc.trainer_step_s:g} s, rollouts {sc.rollout_s:g} s, staleness "
            f"{sc.staleness}, {sc.trainer_gpus} trainer GPUs; figures over the last "
            f"{e.rows[0].loop.window_steps} steps")
    lines = [head,
             f"  {'method':<20} {'sync s':>8} {'tokens/s':>10} {'vs ideal':>8} "
             f"{'trainer idle':>12} {'actor idle':>10} {'exposed s/step':>14} "
             f"{'egress GB/step':>14} {'$/h':>7} {'tokens/$':>9}  priced"]
    ideal = e.row(IDEAL).loop.tokens_per_s
    for r in e.rows:
        lp = r.loop
        rel = lp.tokens_per_s / ideal if ideal > 0 else 0.0
        lines.append(
            f"  {r.name:<20} {r.sync_s:>8.2f} {lp.tokens_per_s:>10.0f} {rel:>8.3f} "
            f"{lp.trainer_idle:>12.1%} {lp.actor_idle:>10.1%} {lp.exposed_sync_s:>14.2f} "
            f"{lp.egress_per_step / 1e9:>14.3f} {r.usd_h:>7.2f} {r.tokens_per_usd:>9.0f}"
            f"  {r.priced}")
    c = e.row(SWARM).loop.catch_up
    if c:
        lines.append(
            f"  churn ({sc.churn_per_min:g}%/min, away {sc.away_s:g} s on average): "
            f"{c['leaves']:.0f} leaves, {c['returners']:.0f} returners and "
            f"{c['joiners']:.0f} fresh joiners; swarm catch-up by the follower's rule: "
            f"{c['chain']:.0f} delta chains ({c['chain_bytes'] / 1e9:.2f} GB), "
            f"{c['keyframe']:.0f} keyframes ({c['keyframe_bytes'] / 1e9:.2f} GB); "
            f"{e.row(SWARM).loop.lost_tokens / 1e6:.1f} M tokens of leases lost; every "
            "dense comeback downloads the whole state")
    return "\n".join(lines)


def plot_end_to_end(runs: list[EndToEnd], path: Any) -> None:
    """Tokens/s and tokens/$ per method, one group of bars per scenario."""
    from swarm.sim.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(METHODS)
    for k, name in enumerate(METHODS):
        xs = [i + k * width for i in range(len(runs))]
        axes[0].bar(xs, [e.row(name).loop.tokens_per_s for e in runs], width, label=name)
        axes[1].bar(xs, [e.row(name).tokens_per_usd for e in runs], width, label=name)
    for ax, title in ((axes[0], "rollout tokens/s consumed by the trainer"),
                      (axes[1], "tokens per dollar")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))],
                      [e.scenario.name for e in runs])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
