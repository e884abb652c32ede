"""``swarm peer``: join a swarm as a rollout peer (the built-in demo task's policy).

Joins through a bootstrap multiaddr, follows the trainer's versions (fetching chunks
from the trainer and from other peers), verifies every version against the trainer's
signed manifest, and does leased rollout work with a torch engine.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, cast

from swarm.cli._node import (
    add_node_arguments,
    load_identity,
    node_config,
    run_node,
    shaped,
    stop_on_signals,
)
from swarm.protocol.exchange import ExchangeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    p.add_argument("--bootstrap", required=True, action="append",
                   help="full multiaddr of a bootstrap node or the trainer (repeatable)")
    p.add_argument("--trainer", required=True, metavar="PEER_ID",
                   help="the trainer's peer id: only its signed manifests and leases count")
    p.add_argument("--name", default="peer", help="name shown in status output")
    p.add_argument("--tasks", type=int, default=4, help="tasks asked for per lease")
    p.add_argument("--last-resort", type=float, default=0.25, metavar="SECONDS",
                   help="wait this long for other peers before fetching a chunk from the trainer")
    p.add_argument("--corrupt", action="store_true",
                   help="chaos: serve corrupted chunks (other peers must ban this one)")


def exchange_config(args: argparse.Namespace) -> ExchangeConfig:
    """Exchange tuning for this peer's link. A delta of the demo model is a few chunks of
    64 KiB, so waiting the default second before asking the trainer for a chunk no other
    peer has yet would dominate its sync time."""
    rate = args.uplink_mbps * 1e6 / 8 if args.uplink_mbps else 100e6
    return ExchangeConfig(download_rate=max(rate, 1e6), last_resort_delay=args.last_resort)


def run(args: argparse.Namespace) -> int:
    return run_node(_main, args)


async def _main(args: argparse.Namespace) -> int:
    import torch

    from swarm.demo.grpo import DemoConfig
    from swarm.demo.model import build_model, inference_state
    from swarm.engines.torch_engine import TorchEngine
    from swarm.identity import public_key_from_peer_id
    from swarm.net.node import Libp2pNode
    from swarm.roles.peer import PeerConfig, RolloutPeer
    from swarm.roles.status import Reporter

    torch.set_num_threads(1)
    public_key_from_peer_id(args.trainer)  # a clear error for a malformed id, before dialing
    cfg = DemoConfig()
    identity = load_identity(args)
    report = Reporter(args.name, json_out=sys.stdout if args.status_json else None,
                      metrics_port=args.metrics_port)
    # The local checkpoint: the config's seeded initial weights, verified against the
    # trainer's signed keyframe before use (a mismatch fetches the pieces instead).
    state = inference_state(build_model(cfg.model), cfg.inference_dtype)
    engine = TorchEngine(cast(Any, build_model(cfg.model, dtype=torch.bfloat16)))
    net_cfg = node_config(args, bootstrap=tuple(args.bootstrap))
    async with stop_on_signals(), Libp2pNode(identity, net_cfg) as raw, \
            shaped(raw, args) as net:
        report.emit("ready", addr=raw.listen_addresses[0], peer_id=identity.peer_id,
                    region=args.region)
        # DATA_DIR keeps the last verified version and received chunks: a restarted peer
        # resumes there; the bootstrap addresses are redialled if the trainer goes away.
        peer = RolloutPeer(identity, net, PeerConfig(run=args.run, trainer=args.trainer,
                                                     region=args.region,
                                                     want_tasks=args.tasks,
                                                     data_dir=args.data_dir,
                                                     bootstrap=tuple(args.bootstrap),
                                                     exchange=exchange_config(args)),
                           state, engine, status=report)
        async with peer:
            if args.corrupt:
                peer.driver.corrupt_uploads = True
            await peer.closed.wait()
            if peer.failure is not None:
                raise peer.failure  # printed as one "swarm: error: ..." line
    return 1
