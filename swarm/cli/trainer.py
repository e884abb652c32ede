"""``swarm trainer``: run the built-in GRPO task as the trainer and seed of a swarm.

It trains the demo's tiny Qwen3 policy on the digit-sorting task: every step it queues
the step's prompts as rollout tasks, waits for signed results from the peers, computes
rewards, takes a GRPO step on the fp32 master and publishes the new bf16 state as a
sparse delta. For your own model and loop, use :class:`swarm.roles.trainer.TrainerNode`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from swarm.cli._node import add_node_arguments, load_identity, node_config, shaped, stop_on_signals


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps to run")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=3e-2,
                   help="AdamW learning rate (with eps 0.1: see swarm.demo.grpo.DemoConfig)")
    p.add_argument("--min-peers", type=int, default=1,
                   help="wait for this many peers before the first step")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds to wait for one step's results")
    p.add_argument("--chunk-kib", type=int, default=64,
                   help="target size of a delta chunk in KiB (the demo model is small)")
    p.add_argument("--linger", type=float, default=10.0,
                   help="seconds to keep seeding after the last step (SIGTERM ends it early)")
    p.add_argument("--addr-file", type=Path, default=None,
                   help="write this node's full multiaddr to FILE once listening")


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


async def _main(args: argparse.Namespace) -> int:
    import torch

    from swarm.demo.grpo import (
        Completion,
        DemoConfig,
        derive_seed,
        make_optimizer,
        rollout_prompts,
        train_step,
    )
    from swarm.demo.model import build_model, inference_state
    from swarm.net.node import Libp2pNode
    from swarm.protocol.leases import SamplingParams
    from swarm.roles.status import Reporter
    from swarm.roles.trainer import TrainerConfig, TrainerNode

    torch.set_num_threads(1)
    cfg = DemoConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
                     lr=args.lr, num_peers=1)
    identity = load_identity(args)
    report = Reporter("trainer", json_out=sys.stdout if args.status_json else None,
                      metrics_port=args.metrics_port)
    net_cfg = node_config(args)
    master = build_model(cfg.model)
    optimizer = make_optimizer(master, cfg.lr, cfg.weight_decay, cfg.adam_eps)
    async with stop_on_signals(), Libp2pNode(identity, net_cfg) as raw, \
            shaped(raw, args) as net, TrainerNode(identity, net, TrainerConfig(
            run=args.run, data_dir=args.data_dir, region=args.region,
            piece_size=1 << 16, chunk_target=args.chunk_kib << 10)) as node:
        addr = net.listen_addresses[0]
        if args.addr_file is not None:
            tmp = args.addr_file.with_suffix(".tmp")
            tmp.write_text(addr + "\n")
            tmp.replace(args.addr_file)
        report.emit("ready", addr=addr, peer_id=identity.peer_id)
        pub = await node.publish(inference_state(master, cfg.inference_dtype))
        report.emit("published", step=0, kind="keyframe", bytes=pub.payload_bytes,
                    dense=pub.dense_bytes, ratio=round(pub.ratio, 2))
        async with asyncio.timeout(args.step_timeout):
            while len(net.connected_peers()) < args.min_peers:
                await asyncio.sleep(0.2)
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            prompts = rollout_prompts(cfg, step)
            sampling = SamplingParams(
                temperature=cfg.temperature, top_p=1.0,
                max_new_tokens=cfg.task.completion_len,
                seed=derive_seed(cfg.seed, "rollout", step) % (1 << 62))
            tasks = node.add_tasks([(f"s{step}-{i}", p) for i, p in enumerate(prompts)],
                                   group_size=cfg.group_size, sampling=sampling)
            prompt_of = {t.task_id: tuple(t.prompt_tokens) for t in tasks}
            accepted = await node.collect(len(tasks), timeout=args.step_timeout)
            t1 = time.perf_counter()
            by_task = {r.task_id: r for a in accepted for r in a.results
                       if r.task_id in prompt_of}
            versions = sorted({a.version for a in accepted})
            order = sorted(by_task)
            groups = [[Completion(prompt_of[t], c.token_ids, c.logprobs)
                       for c in by_task[t].completions] for t in order]
            rewards = [[cfg.task.reward(c.prompt, c.tokens) for c in g] for g in groups]
            solved = sum(cfg.task.solved(c.prompt, c.tokens) for g in groups for c in g)
            metrics = await asyncio.to_thread(
                train_step, master, optimizer, [prompt_of[t] for t in order], groups,
                rewards, temperature=cfg.temperature, clip_eps=cfg.clip_eps,
                max_grad_norm=cfg.max_grad_norm)
            t2 = time.perf_counter()
            pub = await node.publish(inference_state(master, cfg.inference_dtype))
            holders = {a.holder for a in accepted}
            report.emit(
                "step", step=step, reward=round(metrics.reward_mean, 4),
                solved=round(solved / max(1, len(groups) * cfg.group_size), 4),
                rollout_s=round(t1 - t0, 3), train_s=round(t2 - t1, 3),
                publish_s=round(pub.seconds, 3), bytes=pub.payload_bytes,
                dense=pub.dense_bytes, ratio=round(pub.ratio, 2),
                chunks=len(pub.manifest.manifest.chunks), versions_used=versions,
                peers=len(holders), egress=node.driver.exchange.bytes_up,
                leases=node.leases.stats.as_dict())
        report.emit("done", steps=cfg.steps, leases=node.leases.stats.as_dict(),
                    egress=node.driver.exchange.bytes_up)
        if not args.status_json:
            print(json.dumps(node.leases.stats.as_dict(), indent=2))
        # Keep seeding so the last version reaches every peer.
        await asyncio.sleep(args.linger)
    return 0
