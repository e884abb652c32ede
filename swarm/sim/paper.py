"""``--preset paper``: the AuroraRL/SparrowRL setup, and its reported figures next to ours.

The paper trains Qwen3 4B-14B with FSDP2 on 2/4/6 H100s and generates rollouts with vLLM
on 4/8/12 A100s, in up to 4 regions linked at 0.5-1 Gbit/s, with rollouts of tens of
seconds. The three setups here pair them in that order (4B on 2 H100 + 4 A100, 8B on
4 + 8, 14B on 6 + 12). What the paper does not state is assumed and written down here:

- rollout generation per A100 (vLLM, large batches): 4000, 2500 and 1500 tokens/s for
  4B, 8B and 14B;
- leases of 30 s of generation (the paper: rollouts of tens of seconds);
- the trainer's step: ``8 * params * batch_tokens`` FLOPs (forward and backward, plus the
  old-policy forward) at 35% of the H100's 989 TFLOP/s bf16 over its GPUs;
- one step off-policy at most (``staleness = 1``);
- actors spread round robin over the 4 regions of the default network (us-east, where the
  trainer is, us-west, eu, asia; 0.5-1 Gbit/s between them), every host on a 10 Gbit/s
  access link;
- the delta at 1/117 of the dense bf16 state, as ``swarm bench e2e`` measured it here
  (100M parameters, AdamW at lr 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.sim.endtoend import DENSE_BASELINES, IDEAL, SWARM, EndToEnd
from swarm.sim.scenario import LinkClass, Scenario

H100_BF16_FLOPS = 989e12
MFU = 0.35
ROLLOUT_S = 30.0
DELTA_RATIO = 117.0


@dataclass(frozen=True, slots=True)
class Setup:
    model: str
    params: float
    trainer_gpus: int
    actors: int
    tokens_per_s: float
    """Rollout tokens/s per A100."""


SETUPS = (
    Setup("Qwen3-4B", 4.02e9, 2, 4, 4000.0),
    Setup("Qwen3-8B", 8.19e9, 4, 8, 2500.0),
    Setup("Qwen3-14B", 14.77e9, 6, 12, 1500.0),
)


def trainer_step_s(s: Setup, rollout_s: float = ROLLOUT_S) -> float:
    batch_tokens = s.actors * s.tokens_per_s * rollout_s
    return 8 * s.params * batch_tokens / (s.trainer_gpus * H100_BF16_FLOPS * MFU)


def scenario(s: Setup) -> Scenario:
    return Scenario(
        name=f"paper-{s.model.split('-')[1].lower()}", peers=s.actors,
        classes=(LinkClass("a100", 10.0, 10.0, 1.0, s.tokens_per_s),),
        trainer_up_gbps=10.0, trainer_down_gbps=10.0, model_bytes=2 * s.params,
        delta_ratio=DELTA_RATIO, rollout_s=ROLLOUT_S,
        trainer_step_s=round(trainer_step_s(s), 1), staleness=1,
        trainer_gpus=s.trainer_gpus, gpus_per_peer=1, steps=5)


SCENARIOS = tuple(scenario(s) for s in SETUPS)
PRESET = SCENARIOS[1]
"""``PRESETS["paper"]``: the 8B setup (``--preset paper`` runs all three)."""

#: The paper's figures: (what, as reported).
FIGURES = (
    ("throughput vs dense-broadcast baselines", "1.3-9.5x"),
    ("throughput vs an ideal RDMA single-datacenter run", "within 8.91%"),
    ("tokens per dollar vs reserved RDMA clusters", "1.21-1.59x"),
    ("payload vs dense bf16 on Qwen3-8B", "79x smaller"),
)


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"


def compare(runs: list[EndToEnd]) -> list[str]:
    """One line per figure: the paper's, ours, and where and why they differ."""
    vs_dense = [e.row(SWARM).loop.tokens_per_s / max(e.row(b).loop.tokens_per_s, 1e-12)
                for e in runs for b in DENSE_BASELINES]
    gaps = [1 - e.row(SWARM).loop.tokens_per_s / max(e.row(IDEAL).loop.tokens_per_s, 1e-12)
            for e in runs]
    per_usd = [e.row(SWARM).tokens_per_usd / max(e.row(IDEAL).tokens_per_usd, 1e-12)
               for e in runs]
    gpu_ratio = [e.row(IDEAL).usd_h / max(e.row(SWARM).usd_h, 1e-12) for e in runs]
    ratio = runs[0].scenario.delta_ratio if runs else DELTA_RATIO
    worst = max(runs, key=lambda e: max(e.row(b).sync_s for b in DENSE_BASELINES))
    dense_sync = max(worst.row(b).sync_s for b in DENSE_BASELINES)
    ours = [_span(vs_dense), f"within {max(gaps):.2%}" if gaps else "-", _span(per_usd),
            f"{ratio:g}x smaller"]
    why = [
        "our dense baselines send the whole bf16 state from the trainer alone, so their "
        f"sync ({dense_sync:.0f} s on {worst.scenario.name}) is set by the 0.5 Gbit/s link "
        "to asia and the actors behind it; the async variant hides at most one rollout of "
        "it. The paper's dense baselines may use faster links or fewer regions: the low "
        "end of its range comes from the setups where dense sync is short next to a step.",
        "the swarm's sync (seconds) hides inside a 30 s rollout at one step off-policy; "
        "what remains is the first actors waiting on a version's tail, and the model "
        "counts no weight-load time in vLLM or any slowdown of generation by the download "
        "(the paper's gap includes both).",
        "the ratio is mostly the GPU price table: reserved RDMA capacity costs "
        f"{_span(gpu_ratio)} the on-demand cross-cloud GPUs here (prices in "
        "swarm/sim/prices.py), times the swarm's throughput against the ideal's, minus "
        "its WAN egress; other price tables move it one for one.",
        "our codec's delta on the e2e bench workload (AdamW at lr 1e-6, about 1% of the "
        "bf16 elements change per step) is 117x smaller; the paper's 79x is Qwen3-8B "
        "under its RL updates, where more elements change per step. The ratio is a "
        "scenario field (delta_ratio); the throughput figures barely move with it, since "
        "the swarm's sync stays well under a rollout.",
    ]
    lines = ["paper (AuroraRL/SparrowRL) vs this simulation:"]
    for (what, theirs), mine, reason in zip(FIGURES, ours, why, strict=True):
        lines.append(f"  {what}: paper {theirs}; here {mine}")
        lines.append(f"    where and why they differ: {reason}")
    return lines
