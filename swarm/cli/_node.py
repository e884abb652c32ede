"""Shared pieces of the long-running node commands (trainer, peer, bootstrap)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.identity import Identity

if TYPE_CHECKING:
    from swarm.net.node import Libp2pNode, NodeConfig
    from swarm.roles.common import Network


def add_node_arguments(p: argparse.ArgumentParser, *, default_port: int = 0) -> None:
    p.add_argument("--key", type=Path, default=None,
                   help="identity key file (created if missing; default: DATA_DIR/node.key)")
    p.add_argument("--data-dir", type=Path, default=Path(".swarm"),
                   help="where the node keeps its key and state (default ./.swarm)")
    p.add_argument("--listen", default=f"/ip4/127.0.0.1/tcp/{default_port}",
                   help="libp2p listen multiaddr (port 0: any free port)")
    p.add_argument("--run", default="demo", help="run name (gossip topics carry it)")
    p.add_argument("--region", default="", help="region label published to other peers")
    p.add_argument("--status-json", action="store_true",
                   help="print status events as JSON lines on stdout")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--uplink-mbps", type=float, default=0.0,
                   help="emulate an uplink of this many Mbit/s (0: unshaped)")
    p.add_argument("--wan-latency-ms", type=float, default=50.0,
                   help="with --uplink-mbps: one-way latency to other regions")


@contextlib.asynccontextmanager
async def shaped(node: Libp2pNode, args: argparse.Namespace) -> AsyncIterator[Network]:
    """The node itself, or wrapped in a WAN shaper when ``--uplink-mbps`` is set."""
    if not args.uplink_mbps:
        yield node
        return
    from swarm.roles.shaper import ShapeConfig, ShapedNetwork

    def region_of(peer: str) -> str:
        meta = node.directory().get(peer)
        return "" if meta is None else meta.region

    cfg = ShapeConfig(uplink=args.uplink_mbps * 1e6 / 8,
                      cross_region_latency=args.wan_latency_ms / 1000)
    async with ShapedNetwork(node, cfg, args.region, region_of) as net:
        yield net


def node_config(args: argparse.Namespace, **extra: Any) -> NodeConfig:
    """The libp2p node's settings from the common flags; the data plane listens on the
    same interface as libp2p (loopback by default)."""
    from swarm.net.dataplane import DataPlaneConfig
    from swarm.net.node import NodeConfig

    parts = str(args.listen).split("/")
    host = parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else "127.0.0.1"
    extra.setdefault("data_plane", DataPlaneConfig(host=host))
    return NodeConfig(listen=args.listen, run=args.run, region=args.region, **extra)


def load_identity(args: argparse.Namespace) -> Identity:
    path: Path = args.key or (args.data_dir / "node.key")
    return Identity.load_or_create(path)


def run_node(main: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
             args: argparse.Namespace) -> int:
    """Run a node's async main; Ctrl-C and SIGTERM end it cleanly with exit status 130."""
    import asyncio

    try:
        return asyncio.run(main(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


@contextlib.asynccontextmanager
async def stop_on_signals() -> AsyncIterator[None]:
    """SIGTERM ends the node like Ctrl-C does (the context managers close cleanly)."""
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is not None and sys.platform != "win32":
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        yield
    finally:
        if sys.platform != "win32":
            loop.remove_signal_handler(signal.SIGTERM)
