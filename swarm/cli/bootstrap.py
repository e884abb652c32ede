"""``swarm bootstrap``: a light, GPU-free node that peers dial first.

It runs the libp2p host with gossipsub, so newcomers learn each other's signed metadata
(addresses, region) from the run's peers topic (validated: an envelope signed by its
publisher). It holds no weights and does no rollout work.

It relays only what it can validate. With ``--trainer PEER_ID`` (repeatable) it also
subscribes to, and so relays, the run's manifests (signed by one of those trainer keys)
and leases (envelopes signed by their publisher) topics; without it, it does not
subscribe to them, and gossipsub never forwards a topic its node is not subscribed to.
A peer that forwards gossip failing a validator is scored down, and disconnected and
blacklisted after repeated offences. Messages sent to it directly are read and dropped.

With ``--relay`` (opt-in, with limits) it also runs a relay service for peers behind
NATs (:mod:`swarm.net.relay`) and reports what it relayed (``relay`` status events).

SIGTERM and Ctrl-C end it cleanly with exit status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable

from swarm.cli._node import (
    UsageError,
    add_node_arguments,
    add_relay_arguments,
    load_identity,
    node_config,
    run_node,
    stop_on_signals,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p, default_port=4001)
    add_relay_arguments(p)
    p.add_argument("--peer", action="append", default=[],
                   help="another bootstrap node's multiaddr to stay connected to")
    p.add_argument("--trainer", action="append", default=[], metavar="PEER_ID", dest="trainers",
                   help="a trainer of the run (repeatable): relay its signed manifests and "
                        "the run's lease traffic; without it neither topic is relayed")


def run(args: argparse.Namespace) -> int:
    return run_node(_main, args)


def manifest_validator(trainer_keys: list[bytes]) -> Callable[[str, bytes], bool]:
    """Accept manifests signed by any of ``trainer_keys``."""
    from swarm.net import topics

    checks = [topics.manifest_validator(k) for k in trainer_keys]

    def validate(source: str, data: bytes) -> bool:
        return any(check(source, data) for check in checks)

    return validate


async def _main(args: argparse.Namespace) -> int:
    from swarm.errors import SignatureError
    from swarm.identity import public_key_from_peer_id
    from swarm.net import topics
    from swarm.net.node import Libp2pNode
    from swarm.net.transport import Subscription, TransportClosed
    from swarm.roles.status import Reporter

    try:
        trainer_keys = [public_key_from_peer_id(t) for t in args.trainers]
    except SignatureError as exc:  # not an Ed25519 peer id
        raise UsageError(f"--trainer: {exc}") from None
    identity = load_identity(args)
    report = Reporter("bootstrap", json_out=sys.stdout if args.status_json else None,
                      metrics_port=args.metrics_port)
    cfg = node_config(args, bootstrap=tuple(args.peer), data_plane=None)
    async with stop_on_signals(), Libp2pNode(identity, cfg) as node, \
            contextlib.AsyncExitStack() as stack:
        print(f"bootstrap node for run {args.run!r} listening on:")
        for addr in node.listen_addresses:
            print(f"  {addr}")
        sys.stdout.flush()
        seen = {"manifests": 0, "leases": 0, "dropped_direct": 0}
        subs = []
        if trainer_keys:
            # Subscribing makes this node a relay of the topic (validated).
            subs = [
                ("manifests", await stack.enter_async_context(await node.subscribe(
                    topics.manifests(args.run), manifest_validator(trainer_keys)))),
                ("leases", await stack.enter_async_context(await node.subscribe(
                    topics.leases(args.run), topics.lease_validator(topics.leases(args.run))))),
            ]

        async def drain(key: str, sub: Subscription) -> None:
            while True:
                await sub.get()
                seen[key] += 1

        async def drop_direct() -> None:
            # Nothing is addressed to a bootstrap: read and drop, so that a sender's
            # stream does not stall on a full inbox.
            with contextlib.suppress(TransportClosed):
                while True:
                    await node.recv()
                    seen["dropped_direct"] += 1

        relay = "" if node.relay is None else node.relay.hostport
        if relay:
            print(f"relaying for peers behind NATs on {relay}")
        report.emit("ready", addr=node.listen_addresses[0], peer_id=identity.peer_id,
                    trainers=list(args.trainers),
                    relays=["peers", *(key for key, _ in subs)], relay=relay)

        async def relay_report() -> None:
            last: dict[str, object] = {}
            while node.relay is not None:
                now = node.relay.stats.as_dict()
                if now != last:
                    report.emit("relay", **now)
                    last = now
                await asyncio.sleep(1.0)

        async with asyncio.TaskGroup() as tg:
            for key, sub in subs:
                tg.create_task(drain(key, sub))
            tg.create_task(drop_direct())
            tg.create_task(relay_report())
            while True:
                report.emit("status", peers=len(node.connected_peers()),
                            directory=len(node.directory()), **seen)
                await asyncio.sleep(10)
    return 0
