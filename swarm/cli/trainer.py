"""``swarm trainer``: run the built-in GRPO task as the trainer and seed of a swarm.

It trains the demo's tiny Qwen3 policy on the digit-sorting task: every step it queues
the step's prompts as rollout tasks, waits for signed results from the peers, computes
rewards, takes a GRPO step on the fp32 master and publishes the new bf16 state as a
sparse delta. For your own model and loop, use :class:`swarm.roles.trainer.TrainerNode`.

Restarts: DATA_DIR keeps the lease book, the published state with its manifests (see
:class:`~swarm.roles.trainer.TrainerNode`) and ``master.pt`` (fp32 master and optimizer,
written atomically after each step). Started again on the same DATA_DIR it continues at
the next step; peers redial it by themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.cli._node import (
    UsageError,
    add_node_arguments,
    load_identity,
    node_config,
    reporter,
    run_node,
    shaped,
    stop_on_signals,
)
from swarm.errors import SwarmError

if TYPE_CHECKING:
    from swarm.content.card import SignedCard
    from swarm.content.manifest import SignedManifest
    from swarm.identity import Identity
    from swarm.roles.common import Network
    from swarm.roles.trainer import TrainerNode

log = logging.getLogger(__name__)
MASTER_FILE = "master.pt"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps to run")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    p.add_argument("--lr", type=float, default=3e-2,
                   help="AdamW learning rate (with eps 0.1: see swarm.demo.grpo.DemoConfig)")
    p.add_argument("--bootstrap", action="append", default=[],
                   help="full multiaddr of a bootstrap node to join through (repeatable)")
    p.add_argument("--min-peers", type=int, default=1,
                   help="wait for this many peers before the first step")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds to wait for one step's results")
    p.add_argument("--chunk-kib", type=int, default=64,
                   help="target size of a delta chunk in KiB (the demo model is small)")
    p.add_argument("--linger", type=float, default=10.0,
                   help="seconds to keep seeding after the last step (SIGTERM ends it "
                        "early); says when the last version reached every connected peer")
    p.add_argument("--keep-versions", type=int, default=16, metavar="N",
                   help="deltas kept for catch-up (peers further behind get a keyframe)")
    p.add_argument("--chaos-kill-mid-publish", type=int, default=None, metavar="STEP",
                   help="chaos: SIGKILL this process once step STEP is written to DATA_DIR, "
                        "before it is announced (to test restarts)")
    p.add_argument("--no-rollout-checks", action="store_true",
                   help="count results without recomputing their log-probs or replaying "
                        "any (trusted peers only; the weight-root and copy checks stay on)")
    p.add_argument("--replay-fraction", type=float, default=0.1, metavar="F",
                   help="replay this seeded fraction of tasks with their sampling seed and "
                        "refuse results whose tokens differ (0: none)")
    p.add_argument("--addr-file", type=Path, default=None,
                   help="write this node's full multiaddr to FILE once listening")


def check_workload(args: argparse.Namespace) -> None:
    """One clear error for an unusable flag of the GRPO task (``swarm demo`` passes the
    same flags on to its trainer, and checks them with this before it starts anything)."""
    if args.steps < 0:
        raise UsageError(f"--steps {args.steps}: must be 0 or more")
    if args.prompts < 1:
        raise UsageError(f"--prompts {args.prompts}: must be at least 1")
    if args.group < 2:
        raise UsageError(f"--group {args.group}: must be at least 2 (GRPO compares the "
                         "completions of one prompt with each other)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr {args.lr:g}: must be a positive number")


def run(args: argparse.Namespace) -> int:
    check_workload(args)
    if not 0.0 <= args.replay_fraction <= 1.0:
        raise SwarmError(f"--replay-fraction must be in [0, 1], not {args.replay_fraction:g}")
    for flag, value, least in (("--min-peers", args.min_peers, 0),
                               ("--chunk-kib", args.chunk_kib, 1),
                               ("--keep-versions", args.keep_versions, 1)):
        if value < least:
            raise UsageError(f"{flag} {value}: must be at least {least}")
    if not (math.isfinite(args.step_timeout) and args.step_timeout > 0):
        raise UsageError(f"--step-timeout {args.step_timeout:g}: must be a positive number "
                         "of seconds")
    if not (math.isfinite(args.linger) and args.linger >= 0):
        raise UsageError(f"--linger {args.linger:g}: must be 0 or more seconds")
    return run_node(_main, args)


async def _main(args: argparse.Namespace) -> int:
    import torch

    from swarm.demo.grpo import (
        DemoConfig,
        Rollout,
        derive_seed,
        make_optimizer,
        rollout_prompts,
        train_step,
    )
    from swarm.demo.model import build_model, inference_state, model_from_state
    from swarm.engines.rollout_check import PolicyWindow
    from swarm.net.node import Libp2pNode
    from swarm.protocol.leases import Sampling
    from swarm.roles.status import human_bytes
    from swarm.roles.trainer import TrainerConfig, TrainerNode

    torch.set_num_threads(1)
    cfg = DemoConfig(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group,
                     lr=args.lr, num_peers=1)
    identity = load_identity(args)
    report = reporter("trainer", args)
    net_cfg = node_config(args, bootstrap=tuple(args.bootstrap))
    master = build_model(cfg.model)
    optimizer = make_optimizer(master, cfg.lr, cfg.weight_decay, cfg.adam_eps)
    # max_staleness 1: results use the latest version or the one before; one more is kept
    # for results checked while the next version is being published
    policies = PolicyWindow(lambda state: model_from_state(
        cfg.model, state, next(iter(state.values())).dtype), keep=3)
    checks = [] if args.no_rollout_checks else policies.checks(
        cfg.inference_dtype, replay_fraction=args.replay_fraction)
    async with stop_on_signals(), Libp2pNode(identity, net_cfg) as raw, \
            shaped(raw, args) as net, TrainerNode(identity, net, TrainerConfig(
            run=args.run, data_dir=args.data_dir, region=args.region,
            piece_size=1 << 16, chunk_target=args.chunk_kib << 10,
            keep_versions=args.keep_versions), checks=checks) as node:
        addr = net.listen_addresses[0]
        if args.addr_file is not None:
            tmp = args.addr_file.with_suffix(".tmp")
            tmp.write_text(addr + "\n")
            tmp.replace(args.addr_file)
        report.emit("ready", addr=addr, peer_id=identity.peer_id)
        join = args.bootstrap[0] if args.bootstrap else addr
        report.say(f"trainer {identity.peer_id}\nlistening on {addr}\npeers join with:\n"
                   f"  swarm peer --bootstrap {join} --trainer {identity.peer_id}")
        ckpt_path = args.data_dir / MASTER_FILE
        if node.step >= 0:
            ckpt_step = _load_master(ckpt_path, master, optimizer, node.step)
            if ckpt_step == node.step + 1:  # trained, not yet published when it stopped
                await node.publish(inference_state(master, cfg.inference_dtype))
            policies.add(node.step, inference_state(master, cfg.inference_dtype))
            report.emit("resumed", step=node.step, master=ckpt_step)
        else:
            pub = await node.publish(policies.add(0, inference_state(master,
                                                                    cfg.inference_dtype)))
            report.emit("published", step=0, kind="keyframe", bytes=pub.payload_bytes,
                        dense=pub.dense_bytes, ratio=round(pub.ratio, 2))
        card = _run_card(args, identity, node, master, cfg.inference_dtype)
        raw.serve_card(card.encode())
        report.emit("card", id=card.id.hex(), model_type=card.card.model_type,
                    bytes=len(card.encode()))
        first = node.step + 1
        rejected = Rejections(node)
        if first <= cfg.steps and len(_rollout_peers(net, args)) < args.min_peers:
            report.say(f"waiting for {args.min_peers} peer(s) (at most {args.step_timeout:g} s)")
        try:
            async with asyncio.timeout(args.step_timeout):
                # Bootstrap nodes are connected peers too, but do no rollout work.
                while len(net.connected_peers()) < args.min_peers + len(args.bootstrap):
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise SwarmError(
                f"{len(_rollout_peers(net, args))} of the {args.min_peers} rollout peer(s) "
                f"of --min-peers joined within --step-timeout {args.step_timeout:g} s; "
                "run this again (it resumes from "
                f"{args.data_dir}) and start them with the `swarm peer ...` line it prints, "
                "or wait longer with a larger --step-timeout") from None
        for step in range(first, cfg.steps + 1):
            t0 = time.perf_counter()
            prompts = rollout_prompts(cfg, step)
            sampling = Sampling(
                max_tokens=cfg.task.completion_len, temperature=cfg.temperature, top_p=1.0,
                seed=derive_seed(cfg.seed, "rollout", step) % (1 << 62))
            tasks = node.add_tasks([(f"s{step}-{i}", p) for i, p in enumerate(prompts)],
                                   group_size=cfg.group_size, sampling=sampling)
            prompt_of = {t.task_id: tuple(t.prompt_tokens) for t in tasks}
            try:
                accepted = await node.collect(tasks, timeout=args.step_timeout)
            except TimeoutError:
                rejections = node.leases.stats.results_rejected
                raise SwarmError(
                    f"step {step} got no accepted result for some of its {len(tasks)} "
                    f"tasks within --step-timeout {args.step_timeout:g} s (results "
                    f"rejected by the checks so far: {rejections}); run this again (it "
                    f"resumes from {args.data_dir}), with a larger --step-timeout if the "
                    "peers are slow") from None
            t1 = time.perf_counter()
            rejected.count(accepted)
            by_task = {r.task_id: r for a in accepted for r in a.results
                       if r.task_id in prompt_of}
            versions = sorted({a.version for a in accepted})
            order = sorted(by_task)
            groups = [[Rollout(prompt_of[t], c.token_ids, c.logprobs)
                       for c in by_task[t].completions] for t in order]
            rewards = [[cfg.task.reward(c.prompt, c.tokens) for c in g] for g in groups]
            solved = sum(cfg.task.solved(c.prompt, c.tokens) for g in groups for c in g)
            metrics = await asyncio.to_thread(
                train_step, master, optimizer, [prompt_of[t] for t in order], groups,
                rewards, temperature=cfg.temperature, clip_eps=cfg.clip_eps,
                max_grad_norm=cfg.max_grad_norm)
            await asyncio.to_thread(_save_master, ckpt_path, master, optimizer, step)
            t2 = time.perf_counter()
            pub = await node.publish(policies.add(step, inference_state(
                master, cfg.inference_dtype)), persisted=_chaos_kill(args.chaos_kill_mid_publish))
            holders = {a.holder for a in accepted}
            for rej in rejected.news():
                report.emit("rejected", peer=rej.holder, version=rej.version,
                            tasks=len(rej.task_ids), reason=rej.reason, banned=rej.banned)
            report.emit(
                "step", step=step, reward=round(metrics.reward_mean, 4),
                solved=round(solved / max(1, len(groups) * cfg.group_size), 4),
                rollout_s=round(t1 - t0, 3), train_s=round(t2 - t1, 3),
                publish_s=round(pub.seconds, 3), bytes=pub.payload_bytes,
                dense=pub.dense_bytes, ratio=round(pub.ratio, 2),
                chunks=len(pub.manifest.manifest.chunks), versions_used=versions,
                peers=len(holders), egress=node.driver.exchange.bytes_up,
                leases=node.leases.stats.as_dict(), checks=rejected.summary())
        node.leases.finish()  # peers holding the last version are told the run is over
        report.emit("done", steps=cfg.steps, leases=node.leases.stats.as_dict(),
                    egress=node.driver.exchange.bytes_up, checks=rejected.summary())
        if not args.status_json and not args.quiet:
            print("leases: " + json.dumps(node.leases.stats.as_dict()), flush=True)
        # Keep seeding so the last version reaches every peer; say when it has.
        t0 = time.monotonic()
        have, peers = await wait_delivered(node, _rollout_peers(net, args), args.linger)
        took = time.monotonic() - t0
        report.emit("delivered", step=node.step, peers=len(peers), have=len(have),
                    seconds=round(took, 3), egress=node.driver.exchange.bytes_up)
        short = "" if have >= peers else f" within --linger {args.linger:g} s"
        egress = human_bytes(node.driver.exchange.bytes_up)
        report.say(f"last version {node.step} reached {len(have)} of {len(peers)} connected "
                   f"peer(s){short} ({took:.1f} s; trainer egress {egress} in all so far); "
                   "seeding until --linger ends")
        await asyncio.sleep(max(0.0, args.linger - took))
    return 0


class Rejections:
    """What the trainer's checks refused, per peer: new ones for the step line, and the
    totals for the summary (results rejected, tasks re-issued, banned peers)."""

    def __init__(self, node: TrainerNode) -> None:
        self.node = node
        self._seen = node.leases.stats.results_rejected
        self.accepted: dict[str, dict[int, int]] = {}

    def count(self, accepted: list[Any]) -> None:
        """Tally the results a step used, by peer and version."""
        for a in accepted:
            mine = self.accepted.setdefault(a.holder, {})
            mine[a.version] = mine.get(a.version, 0) + 1

    def news(self) -> list[Any]:
        """Rejections since the last call (at most the node's bounded list of them)."""
        total = self.node.leases.stats.results_rejected
        fresh = list(self.node.rejected)[-(total - self._seen):] if total > self._seen else []
        self._seen = total
        return fresh

    def summary(self) -> dict[str, Any]:
        by_peer: dict[str, int] = {}
        for rej in self.node.rejected:
            by_peer[rej.holder] = by_peer.get(rej.holder, 0) + 1
        scores = self.node.leases.scores
        return {"checked": self.node.results_checked,
                "check_s": round(self.node.check_seconds, 3),
                "accepted": {p: {str(v): n for v, n in sorted(by.items())}
                             for p, by in sorted(self.accepted.items())},
                "rejected": by_peer,
                "banned": sorted(p for p in by_peer if scores.banned(p))}


def _run_card(args: argparse.Namespace, identity: Identity, node: TrainerNode, model: Any,
              dtype: str) -> SignedCard:
    """The run's card: the one kept in DATA_DIR, else made from version 0 and kept."""
    from swarm.cli._card import keep_card, load_card
    from swarm.engines.hf_model import run_card

    kept = load_card(args.data_dir, trainer=identity.public_key, run=args.run)
    if kept is not None:
        return kept
    v0 = node.manifests[0]
    if v0.manifest.step != 0:
        log.warning("no run card in %s and version 0 is no longer kept: the card names "
                    "version %d as the first", args.data_dir, v0.manifest.step)
    card = run_card(identity, args.run, model, v0, dtype=dtype)
    keep_card(args.data_dir, card)
    return card


def _rollout_peers(net: Network, args: argparse.Namespace) -> set[str]:
    """Connected peers less the bootstrap nodes named on the command line."""
    boot = {a.rsplit("/", 1)[-1] for a in args.bootstrap}
    return set(net.connected_peers()) - boot


def holders_of_latest(node: TrainerNode) -> set[str]:
    """Peers that told this trainer they hold every chunk of its latest version (of its
    delta, or of the keyframe a peer catching up fetched instead)."""
    held: set[str] = set()
    for obj in node.latest_objects():
        held.update(node.driver.exchange.holders_of(obj))
    return held


async def wait_delivered(node: TrainerNode, peers: set[str], timeout: float
                         ) -> tuple[set[str], set[str]]:
    """Wait until every one of ``peers`` holds the trainer's latest version, or
    ``timeout`` seconds; returns (the peers that hold it, ``peers``)."""
    deadline = time.monotonic() + timeout
    while True:
        have = holders_of_latest(node) & peers
        if have >= peers or time.monotonic() >= deadline:
            return have, peers
        await asyncio.sleep(0.2)


def _chaos_kill(step: int | None) -> Callable[[SignedManifest], None] | None:
    if step is None:
        return None

    def kill(sm: SignedManifest) -> None:
        if sm.manifest.step == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


def _save_master(path: Path, master: Any, optimizer: Any, step: int) -> None:
    import torch

    from swarm.roles.persist import write_atomic

    buf = io.BytesIO()
    torch.save({"step": step, "model": master.state_dict(), "optim": optimizer.state_dict()},
               buf)
    write_atomic(path, [buf.getvalue()])


def _load_master(path: Path, master: Any, optimizer: Any, published: int) -> int:
    """Load the master checkpoint if it is of step ``published`` or the one after it;
    returns its step, or -1 (the seeded weights go on from the published step)."""
    import torch

    try:
        ck = torch.load(path, weights_only=True)
        step = int(ck["step"])
        if step not in (published, published + 1):
            raise ValueError(f"checkpoint of step {step}, published step {published}")
        master.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optim"])
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        log.warning("master checkpoint %s not used (%s): training goes on from the seeded "
                    "weights after step %d", path, exc, published)
        return -1
    return step
