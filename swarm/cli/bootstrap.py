"""``swarm bootstrap``: a light, GPU-free node that peers dial first.

It runs the libp2p host with gossipsub on the run's topics, so newcomers learn each
other's signed metadata (addresses, region) from the peers topic, and relays gossip. It
holds no weights and does no rollout work.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from swarm.cli._node import (
    add_node_arguments,
    load_identity,
    node_config,
    run_node,
    stop_on_signals,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p, default_port=4001)
    p.add_argument("--peer", action="append", default=[],
                   help="another bootstrap node's multiaddr to stay connected to")


def run(args: argparse.Namespace) -> int:
    return run_node(_main, args)


async def _main(args: argparse.Namespace) -> int:
    from swarm.net import topics
    from swarm.net.node import Libp2pNode
    from swarm.roles.status import Reporter

    identity = load_identity(args)
    report = Reporter("bootstrap", json_out=sys.stdout if args.status_json else None,
                      metrics_port=args.metrics_port)
    cfg = node_config(args, bootstrap=tuple(args.peer), data_plane=None)
    async with stop_on_signals(), Libp2pNode(identity, cfg) as node:
        print(f"bootstrap node for run {args.run!r} listening on:")
        for addr in node.listen_addresses:
            print(f"  {addr}")
        sys.stdout.flush()
        report.emit("ready", addr=node.listen_addresses[0], peer_id=identity.peer_id)
        # Subscribing makes this node a gossip relay for the run's manifests and leases.
        seen = {"manifests": 0, "leases": 0}

        async def drain(topic: str, key: str) -> None:
            async with await node.subscribe(topic) as sub:
                while True:
                    await sub.get()
                    seen[key] += 1

        async with asyncio.TaskGroup() as tg:
            tg.create_task(drain(topics.manifests(args.run), "manifests"))
            tg.create_task(drain(topics.leases(args.run), "leases"))
            while True:
                await asyncio.sleep(10)
                report.emit("status", peers=len(node.connected_peers()),
                            directory=len(node.directory()), **seen)
    return 0
