"""Shared pieces of the long-running node commands (trainer, peer, bootstrap)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import SwarmError
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
                   help="print status events as JSON lines on stdout (and nothing else)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress lines on stdout (warnings and errors still go to stderr)")
    p.add_argument("--buffer-budget-mib", type=int, default=256, metavar="MIB",
                   help="memory for frames being received from all peers together "
                        "(default 256; at least 17: one largest frame)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--uplink-mbps", type=float, default=0.0,
                   help="emulate an uplink of this many Mbit/s (0: unshaped)")
    p.add_argument("--upload-mbps", type=float, default=None, metavar="MBPS",
                   help="your uplink in Mbit/s, told to other peers: one that cannot carry "
                        "a chunk in time is asked last (default: --uplink-mbps, else unknown)")
    p.add_argument("--wan-latency-ms", type=float, default=50.0,
                   help="with --uplink-mbps: one-way latency to other regions")
    p.add_argument("--no-relay", action="store_true",
                   help="behind a NAT: reserve on no relay and dial no relayed address")
    p.add_argument("--no-punch", action="store_true",
                   help="behind a NAT: try no TCP hole punch on relayed circuits")


def add_relay_arguments(p: argparse.ArgumentParser) -> None:
    """``--relay`` and its limits (a public node relaying for peers behind NATs)."""
    g = p.add_argument_group("relay (opt-in: for peers behind NATs, on a public node)")
    g.add_argument("--relay", action="store_true",
                   help="run a relay service for peers nobody can dial (advertised in this "
                        "node's metadata; the data they exchange stays sealed end to end)")
    g.add_argument("--relay-port", type=int, default=0,
                   help="TCP port of the relay service, on the --listen interface "
                        "(default 0: any free port)")
    g.add_argument("--relay-max-circuits", type=int, default=16, metavar="N",
                   help="relayed connections open at once (default 16)")
    g.add_argument("--relay-circuit-mib", type=int, default=256, metavar="MIB",
                   help="bytes one relayed connection may carry before it is cut "
                        "(default 256 MiB)")
    g.add_argument("--relay-mbps", type=float, default=32.0,
                   help="relayed Mbit/s over all circuits together (default 32)")


@contextlib.asynccontextmanager
async def shaped(node: Libp2pNode, args: argparse.Namespace) -> AsyncIterator[Network]:
    """The node itself, or wrapped in a WAN shaper when ``--uplink-mbps`` is set."""
    if not args.uplink_mbps:
        yield node
        return
    from swarm.roles.shaper import ShapedNetwork, wan

    def region_of(peer: str) -> str:
        meta = node.directory().get(peer)
        return "" if meta is None else meta.region

    cfg = wan(args.uplink_mbps * 1e6 / 8, args.wan_latency_ms / 1000)
    async with ShapedNetwork(node, cfg, args.region, region_of) as net:
        yield net


#: The largest uplink a flag takes (1 Tbit/s).
MAX_MBPS = 1e6
#: The longest emulated one-way latency a flag takes.
MAX_LATENCY_MS = 10_000.0


class UsageError(SwarmError):
    """A flag's value cannot be used (printed as one ``swarm: error: ...`` line)."""


def _multiaddr(flag: str, value: str, *, example: str) -> list[str]:
    """The protocol names of multiaddr ``value``, which must be IP and TCP."""
    from multiaddr import Multiaddr

    try:
        names = [proto.name for proto in Multiaddr(value).protocols()]
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{flag} {value!r} is not a valid multiaddr ({exc}); "
                         f"expected e.g. {example}") from None
    if not names or names[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or "tcp" not in names:
        raise UsageError(f"{flag} {value!r} is not an IP/TCP multiaddr; expected e.g. {example}")
    return names


def check_listen(value: str) -> None:
    names = _multiaddr("--listen", value, example="/ip4/0.0.0.0/tcp/4002")
    if "p2p" in names:
        raise UsageError(f"--listen {value!r}: a listen address has no /p2p/ part")


def check_bootstrap(values: list[str]) -> None:
    for value in values:
        names = _multiaddr("--bootstrap", value,
                           example="/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW...")
        if names[-1] != "p2p":
            raise UsageError(f"--bootstrap {value!r} does not end in /p2p/PEER_ID (the full "
                             "address a bootstrap node or trainer prints at start)")
        check_peer_id("--bootstrap", value.rsplit("/", 1)[-1])


def check_peer_id(flag: str, value: str) -> None:
    from swarm.identity import public_key_from_peer_id

    try:
        public_key_from_peer_id(value)
    except SwarmError:
        raise UsageError(f"{flag} {value!r} is not a peer id (an Ed25519 id starts with "
                         "12D3KooW; the trainer prints its own at start)") from None


def check_data_dir(path: Path) -> None:
    """``path`` is, or can be made, a writable directory."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--data-dir {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--data-dir {path} cannot be created: {exc.strerror or exc}") from None
    probe = path / f".write-test.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--data-dir {path} is not writable: {exc.strerror or exc}") from None


#: Files that only a node of that role writes in its data directory.
ROLE_FILES = {"trainer": ("published.state", "leases.sqlite3", "master.pt"),
              "peer": ("peer.state", "peer.state.journal")}


def check_data_dir_role(path: Path, role: str) -> None:
    """``path`` holds no other role's state: a node takes the ``node.key`` it finds as its
    own identity, so a trainer started on a peer's directory (an adversarial trial did
    it) signed as that peer and wrote its lease book beside the peer's state."""
    for other, names in ROLE_FILES.items():
        if other == role:
            continue
        found = next((n for n in names if (path / n).exists()), None)
        if found is not None:
            raise UsageError(f"--data-dir {path} holds a {other}'s state ({found}); a "
                             f"{role} there would take that {other}'s identity as its own: "
                             f"give the {role} a --data-dir of its own")


@contextlib.contextmanager
def data_dir_lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock while the node runs: a second node on one data directory
    would share its key, its journal and (a trainer's) lease book. The lock is the
    kernel's (``flock``), so a node that crashed leaves none behind; the file names the
    holder's process id."""
    import fcntl

    fd = os.open(path / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise UsageError(f"--data-dir {path} is in use by another swarm node (process "
                             f"{holder}); stop it, or give this one a --data-dir of its "
                             "own") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def check_link_flags(args: argparse.Namespace, *mbps_flags: str) -> None:
    """The emulated WAN's flags: each of ``mbps_flags`` (attribute names) 0 to
    :data:`MAX_MBPS`, and ``--wan-latency-ms`` 0 to :data:`MAX_LATENCY_MS` (NaN refused)."""
    for flag in mbps_flags:
        value = getattr(args, flag, None)
        if value is not None and not 0 <= value <= MAX_MBPS:
            raise UsageError(f"--{flag.replace('_', '-')} {value:g}: must be 0 to {MAX_MBPS:g} "
                             "Mbit/s")
    latency = getattr(args, "wan_latency_ms", 0.0)
    if not 0 <= latency <= MAX_LATENCY_MS:
        raise UsageError(f"--wan-latency-ms {latency:g}: must be 0 to {MAX_LATENCY_MS:g} ms")


def check_node_args(args: argparse.Namespace) -> None:
    """One clear error for each unusable common flag, before anything heavy starts (and
    before the data directory is made)."""
    check_listen(str(args.listen))
    check_bootstrap(list(getattr(args, "bootstrap", None) or []))
    if getattr(args, "trainer", None) is not None:
        check_peer_id("--trainer", str(args.trainer))
    budget = getattr(args, "buffer_budget_mib", 256)
    if not 17 <= budget <= 1 << 20:
        raise UsageError(f"--buffer-budget-mib {budget}: must be 17 to 1048576 (it holds at "
                         "least one largest frame, 16 MiB)")
    check_link_flags(args, "uplink_mbps", "upload_mbps")
    if args.key is not None and args.key.exists() and not args.key.is_file():
        raise UsageError(f"--key {args.key} is not a file")
    if getattr(args, "relay", False):
        if not 0 <= args.relay_port < 65536:
            raise UsageError(f"--relay-port {args.relay_port}: must be 0 to 65535")
        if args.relay_max_circuits < 1 or args.relay_circuit_mib < 1 or \
                not args.relay_mbps > 0:
            raise UsageError("--relay-max-circuits, --relay-circuit-mib and --relay-mbps "
                             "must be positive")
    if getattr(args, "command", None) in ("trainer", "peer", "bootstrap"):
        check_data_dir_role(args.data_dir, str(args.command))
    check_data_dir(args.data_dir)  # last: it creates the directory


def reporter(name: str, args: argparse.Namespace) -> Any:
    """The node's status reporter: JSON lines with ``--status-json``, else progress lines
    on stdout unless ``--quiet``."""
    from swarm.roles.status import Reporter

    return Reporter(name, json_out=sys.stdout if args.status_json else None,
                    human_out=None if args.quiet else sys.stdout,
                    metrics_port=args.metrics_port)


def node_config(args: argparse.Namespace, **extra: Any) -> NodeConfig:
    """The libp2p node's settings from the common flags; the data plane listens on the
    same interface as libp2p (loopback by default)."""
    from swarm.net.dataplane import DataPlaneConfig
    from swarm.net.node import NodeConfig
    from swarm.net.relay import RelayConfig
    from swarm.net.traversal import TraversalConfig

    parts = str(args.listen).split("/")
    host = parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else "127.0.0.1"
    extra.setdefault("data_plane", DataPlaneConfig(
        host=host, buffer_budget=getattr(args, "buffer_budget_mib", 256) << 20))
    extra.setdefault("traversal", TraversalConfig(relay=not getattr(args, "no_relay", False),
                                                  punch=not getattr(args, "no_punch", False)))
    if getattr(args, "relay", False):
        extra.setdefault("relay", RelayConfig(
            host="", port=args.relay_port, max_circuits=args.relay_max_circuits,
            circuit_bytes=args.relay_circuit_mib << 20, rate=args.relay_mbps * 1e6 / 8))
    told: float | None = getattr(args, "upload_mbps", None)
    mbps = float(getattr(args, "uplink_mbps", 0.0)) if told is None else told
    return NodeConfig(listen=args.listen, run=args.run, region=args.region,
                      upload=int(mbps * 1e6 / 8), **extra)


def load_identity(args: argparse.Namespace) -> Identity:
    path: Path = args.key or (args.data_dir / "node.key")
    return Identity.load_or_create(path)


def run_node(main: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
             args: argparse.Namespace) -> int:
    """Run a node's async main; Ctrl-C and SIGTERM end it cleanly with exit status 130.

    The flags are checked first (:func:`check_node_args`); an OS error while the node
    starts (a port in use, an address not on this machine) is one ``swarm: error:`` line.
    """
    import asyncio

    check_node_args(args)
    with data_dir_lock(args.data_dir):
        try:
            return asyncio.run(main(args))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print(f"swarm: stopped; the same command resumes from {args.data_dir}",
                  file=sys.stderr)
            return 130
        except OSError as exc:
            raise UsageError(f"{exc.strerror or exc} ({exc.__class__.__name__})") from None


#: Seconds a node may take to close after Ctrl-C or SIGTERM before the process exits
#: anyway (what it keeps on disk is written atomically, so nothing is half-written).
SHUTDOWN_GRACE = 10.0


def _exit_after(grace: float) -> None:
    """Exit with status 130 in ``grace`` seconds unless the process has ended by then: a
    stop must not hang on a connection that does not close."""
    import faulthandler
    import os
    import threading

    def force() -> None:
        print(f"swarm: warning: still closing after {grace:g} s; exiting now",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr)  # where it was stuck, for a report
        os._exit(130)

    timer = threading.Timer(grace, force)
    timer.daemon = True
    timer.start()


@contextlib.asynccontextmanager
async def stop_on_signals(grace: float = SHUTDOWN_GRACE) -> AsyncIterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM end the node: the context managers close cleanly, and
    the process exits with status 130 at most ``grace`` seconds after the signal."""
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    signals = (signal.SIGINT, signal.SIGTERM)

    def stop() -> None:
        _exit_after(grace)
        if task is not None:
            task.cancel()

    if task is not None and sys.platform != "win32":
        for sig in signals:
            loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        if sys.platform != "win32":
            for sig in signals:
                loop.remove_signal_handler(sig)
