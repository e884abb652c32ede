"""Run a scenario step by step (swarm and baselines) and summarise it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from swarm.protocol.exchange import ExchangeConfig
from swarm.sim import baselines
from swarm.sim.bounds import LowerBound, lower_bound
from swarm.sim.engine import SwarmResult, SwarmSim
from swarm.sim.scenario import Scenario

#: Goals on the default preset: issue 20's at 1024 peers (issue 5 asked 1.3x the bound at
#: 64 peers).
GOAL_RATIO = 1.2
GOAL_EGRESS = 1.5
GOAL_REGION_IN = 1.5


@dataclass(frozen=True, slots=True)
class MethodRow:
    """One method's figures for one step, relative to its own payload where noted."""

    name: str
    completion_s: float
    ratio_to_bound: float
    trainer_egress_x: float
    region_in_x: tuple[float, ...]
    exposed_s: float
    trainer_egress_gb: float


@dataclass(slots=True)
class StepReport:
    step: int
    peers: int
    payload_bytes: int
    bound: LowerBound
    swarm: SwarmResult
    rows: list[MethodRow]

    @property
    def swarm_row(self) -> MethodRow:
        return self.rows[0]

    @property
    def host_egress_x(self) -> list[float]:
        """Each trainer host's egress in payloads."""
        return [b / self.payload_bytes for b in self.swarm.host_egress]

    @property
    def ratio_to_latency_bound(self) -> float:
        """The swarm's time over the bound counting one-way latency (0: no bound)."""
        b = self.bound.with_latency
        return self.swarm_row.completion_s / b if b else 0.0

    def goals(self) -> dict[str, bool]:
        row = self.swarm_row
        return {
            f"completion <= {GOAL_RATIO}x lower bound": row.ratio_to_bound <= GOAL_RATIO,
            f"trainer egress <= {GOAL_EGRESS}x payload": row.trainer_egress_x <= GOAL_EGRESS,
            f"cross-region bytes into each region <= {GOAL_REGION_IN}x payload":
                max(row.region_in_x, default=0.0) <= GOAL_REGION_IN,
            "every honest peer bit-exact": self.swarm.bit_exact,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "peers": self.peers,
            "payload_bytes": self.payload_bytes,
            "lower_bound_s": self.bound.seconds,
            "lower_bound_binds": self.bound.binding,
            "lower_bound_terms": self.bound.terms,
            "latency_bound_s": self.bound.with_latency,
            "trainer_hosts": len(self.swarm.host_egress),
            "trainer_egress_bytes": self.swarm.trainer_egress,
            "host_egress_bytes": self.swarm.host_egress,
            "host_egress_x": self.host_egress_x,
            "methods": [asdict(r) for r in self.rows],
            "swarm": {
                "completion_s": self.swarm.completion_s,
                "ratio_to_latency_bound": self.ratio_to_latency_bound,
                "bit_exact": self.swarm.bit_exact,
                "honest_done": self.swarm.honest_done,
                "honest_total": self.swarm.honest_total,
                "bans": [list(b) for b in self.swarm.bans],
                "timeouts": self.swarm.timeouts,
                "wasted_bytes": self.swarm.wasted_bytes,
                "events": self.swarm.events,
                "wall_s": self.swarm.wall_s,
                "per_region_done_s": {str(k): v for k, v in
                                      self.swarm.per_region_done.items()},
            },
            "goals": self.goals(),
        }


def run_step(sc: Scenario, step: int = 0, *, with_baselines: bool = True,
             config: ExchangeConfig | None = None,
             progress: Callable[[float, int, int], None] | None = None) -> StepReport:
    """Simulate one step of ``sc``: the swarm, then each baseline on the same network."""
    pop = sc.build()
    sim = SwarmSim(pop, step=step, config=config, progress=progress)
    res = sim.run()
    peers = pop.peers
    payload = sc.payload_bytes
    sizes = sc.chunk_sizes()
    shares = {h: float(sum(sizes[k] for k in sc.host_chunks(h)))
              for h in range(pop.hosts)}
    bound = lower_bound(pop.topo, peers, payload, sc.regions, shares)
    comp = res.completion_s if res.completion_s is not None else float("inf")

    def row(name: str, t: float, egress: float, into: tuple[float, ...] | list[float],
            own_payload: float) -> MethodRow:
        return MethodRow(name, t, t / bound.seconds if bound.seconds else 0.0,
                         egress / own_payload, tuple(x / own_payload for x in into),
                         max(0.0, t - sc.rollout_s), egress / 1e9)

    rows = [row("swarm", comp, res.trainer_egress, res.region_in, payload)]
    if with_baselines:
        kw = {"concurrency": sc.upload_concurrency,
              "trainer_concurrency": sc.trainer_upload_concurrency}
        h = pop.hosts
        for b in (baselines.dense(pop.topo, peers, int(sc.model_bytes), hosts=h),
                  baselines.unicast(pop.topo, peers, sizes, hosts=h),
                  baselines.relay(pop.topo, peers, sizes, hosts=h, **kw)):
            rows.append(row(b.name, b.completion_s, b.trainer_egress, b.region_in,
                            b.payload))
    return StepReport(step, sc.peers, payload, bound, res, rows)


def format_step(rep: StepReport, regions: tuple[str, ...]) -> str:
    """A human-readable table of one step."""
    lines = [
        f"step {rep.step}: {rep.peers} peers, payload {rep.payload_bytes / 1e6:.1f} MB; "
        f"lower bound {rep.bound.seconds:.3f} s (binds: {rep.bound.binding}; "
        + ", ".join(f"{k} {v:.3f}" for k, v in rep.bound.terms.items())
        + f"); counting one-way latency {rep.bound.with_latency:.3f} s",
        f"  {'method':<22} {'time s':>9} {'x bound':>8} {'egress/payload':>15} "
        f"{'exposed s':>10}  cross-region in / payload ("
        + ", ".join(regions) + ")",
    ]
    for r in rep.rows:
        into = ", ".join(f"{x:.2f}" for x in r.region_in_x)
        lines.append(f"  {r.name:<22} {r.completion_s:>9.3f} {r.ratio_to_bound:>8.2f} "
                     f"{r.trainer_egress_x:>15.2f} {r.exposed_s:>10.2f}  {into}")
    s = rep.swarm
    if len(s.host_egress) > 1:
        lines.append(f"  swarm: {len(s.host_egress)} trainer hosts, egress per host "
                     + ", ".join(f"{b / 1e6:.1f} MB ({x:.2f}x)"
                                 for b, x in zip(s.host_egress, rep.host_egress_x,
                                                 strict=True))
                     + f"; total {s.trainer_egress / 1e6:.1f} MB "
                     f"({rep.swarm_row.trainer_egress_x:.2f}x payload)")
    lines.append(f"  swarm: {s.honest_done}/{s.honest_total} honest peers done, bit-exact "
                 f"{s.bit_exact}, bans {len(s.bans)}, time-outs {s.timeouts}, duplicate "
                 f"bytes {s.wasted_bytes / 1e6:.1f} MB, {s.events} events in "
                 f"{s.wall_s:.1f} s wall")
    if rep.ratio_to_latency_bound:
        lines.append(f"  swarm: {rep.ratio_to_latency_bound:.2f}x "
                     "the bound counting one-way latency (the rest is the protocol's)")
    for goal, ok in rep.goals().items():
        lines.append(f"  goal {'MET ' if ok else 'MISS'}  {goal}")
    return "\n".join(lines)
