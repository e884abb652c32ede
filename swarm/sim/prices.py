"""Prices for the end-to-end loop's tokens per dollar, and the arithmetic.

Defaults are public list prices, written down here (nothing is fetched at run time);
override them per scenario (``usd_*`` fields in a ``--config`` TOML):

- On-demand cross-cloud GPUs: H100 SXM 80GB $2.99 and A100 SXM 80GB $1.79 per GPU-hour,
  Lambda's on-demand list prices (lambda.ai/pricing, 2025), inside the "typical
  on-demand" ranges of early 2026 ($2.49-3.99 and $1.49-2.49 across Lambda, CoreWeave,
  RunPod and others; pricegpu.pages.dev, "H100 vs A100 cloud pricing", 2026).
- Reserved RDMA clusters: AWS EC2 Capacity Blocks for ML (reserved ahead, EFA RDMA):
  p5.48xlarge (8x H100, 3200 Gbit/s EFA) $39.33 an instance-hour = $4.916 per H100-hour,
  p4d.24xlarge (8x A100, 400 Gbit/s EFA) $14.75 = $1.844 per A100-hour, us-east
  (aws.amazon.com/ec2/capacityblocks/pricing, rates posted for 2024 until 2025-01-01).
- Bytes between regions: $0.09 per GB, AWS's data transfer out to the internet (first
  10 TB a month; aws.amazon.com/ec2/pricing/on-demand, 2024), as a cross-cloud transfer
  pays egress. Many GPU clouds charge no egress; set ``usd_wan_gb = 0`` for them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prices:
    """US dollars per GPU-hour (trainer and rollout GPUs, on demand across clouds and in a
    reserved RDMA cluster) and per GB between regions."""

    trainer_gpu_h: float = 2.99
    peer_gpu_h: float = 1.79
    rdma_trainer_gpu_h: float = 4.916
    rdma_peer_gpu_h: float = 1.844
    wan_gb: float = 0.09


DEFAULT_PRICES = Prices()


def usd_per_hour(trainer_gpus: int, peer_gpus: float, trainer_gpu_h: float,
                 peer_gpu_h: float, wan_gb_per_h: float = 0.0, wan_gb: float = 0.0) -> float:
    """Dollars an hour of the run costs: its GPUs plus the bytes it moves between regions."""
    return trainer_gpus * trainer_gpu_h + peer_gpus * peer_gpu_h + wan_gb_per_h * wan_gb


def tokens_per_usd(tokens_per_s: float, usd_h: float) -> float:
    """Rollout tokens the trainer consumes per dollar (0 when the run costs nothing)."""
    return tokens_per_s * 3600.0 / usd_h if usd_h > 0 else 0.0
