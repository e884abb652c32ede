"""``python -m swarm.demo``: train the demo policy locally and print its learning curve.

With ``--sweep-lr 3e-3,1e-3,3e-4`` it runs once per learning rate and prints, for each,
the reward at the start and the end and the mean delta density: the trade-off between
learning fast and shipping sparse deltas.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from swarm.demo.grpo import DemoConfig, StepRecord, run_local, summarize


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train, print; returns the exit status."""
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m swarm.demo", description=__doc__)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--adam-eps", type=float, default=d.adam_eps)
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    p.add_argument("--group", type=int, default=d.group_size, help="completions per prompt")
    p.add_argument("--peers", type=int, default=d.num_peers)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=d.inference_dtype,
                   help="dtype of the published inference state")
    p.add_argument("--staleness", type=int, default=d.staleness,
                   help="versions the peers' weights lag behind the trainer's")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 is fastest on a small shared CPU)")
    p.add_argument("--sweep-lr", default="", help="comma-separated learning rates")
    args = p.parse_args(argv)
    base = dataclasses.replace(d, steps=args.steps, lr=args.lr, adam_eps=args.adam_eps,
                               prompts_per_step=args.prompts, group_size=args.group,
                               num_peers=args.peers, inference_dtype=args.dtype,
                               staleness=args.staleness, seed=args.seed)
    torch.set_num_threads(args.threads)
    if args.sweep_lr:
        print(f"{'lr':>8} {'reward first5':>13} {'last5':>6} {'solved last5':>12} "
              f"{'density mean':>12} {'last5':>6} {'seconds':>7}")
        for lr in (float(x) for x in args.sweep_lr.split(",")):
            t0 = time.perf_counter()
            s = summarize(run_local(dataclasses.replace(base, lr=lr)))
            print(f"{lr:8.0e} {s['reward_first']:13.3f} {s['reward_last']:6.3f} "
                  f"{s['solved_last']:12.3f} {s['density_mean']:12.3f} "
                  f"{s['density_last']:6.3f} {time.perf_counter() - t0:7.1f}", flush=True)
        return 0

    def show(r: StepRecord) -> None:
        bar = "#" * round(r.reward * 40)
        print(f"{r.step:4d}  reward {r.reward:.3f}  solved {r.solved:.3f}  "
              f"delta {r.delta_density:6.1%}  rollout {r.rollout_s:5.2f}s  "
              f"train {r.train_s:5.2f}s  {bar}", flush=True)

    t0 = time.perf_counter()
    s = summarize(run_local(base, show))
    print(f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (mean of first/last 5 "
          f"steps), solved {s['solved_first']:.3f} -> {s['solved_last']:.3f}, mean delta "
          f"density {s['density_mean']:.1%}, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
