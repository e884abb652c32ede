"""A swarm node on libp2p: control plane (gossipsub) plus the direct data plane.

:class:`Libp2pNode` is a :class:`~swarm.net.transport.Transport` and a
:class:`~swarm.net.transport.Gossip`. It runs a py-libp2p host (TCP + Noise + Yamux,
identify, ping, gossipsub with strict signing) inside the asyncio program through the
trio guest run of :mod:`swarm.net.bridge`. Its libp2p key is the node's
:class:`~swarm.identity.Identity`, so its peer id is the identity's peer id. The node
composes its parts: gossip (:mod:`swarm.net.gossip`), the peer directory
(:mod:`swarm.net.directory`), the data plane (:mod:`swarm.net.dataplane`); the
py-libp2p workarounds are in :mod:`swarm.net.libp2p_compat`.

Connecting to ``/ip4/A/tcp/P/p2p/<id>``: dial libp2p (Noise proves the id; a mismatch
raises :class:`~swarm.net.transport.PeerIdMismatch`), ask the peer for its signed
metadata on ``/swarm/meta/1.0.0`` (which names its data-plane ``host:port``), and open a
direct data-plane connection there (which proves the same key again). When the peer has
no data plane, or its port does not answer, messages travel on a libp2p stream of
``/swarm/msg/1.0.0`` instead (length-prefixed frames inside Noise); callers do not see
the difference except in :attr:`~swarm.net.transport.PeerEvent.path`.

Bad input on the libp2p streams is handled as on the data plane: an oversized frame, a
peer stalling mid-frame, or more than ``max_streams_per_peer`` concurrent streams from
one peer resets the stream, scores the peer down and, when it keeps on, disconnects it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import trio

from swarm.aio import cancel_and_wait
from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import Identity
from swarm.net import libp2p_compat as compat
from swarm.net import topics
from swarm.net.addresses import bind_failure, listen_failure, parse_tcp_multiaddr
from swarm.net.blobs import CARD_PROTOCOL, BlobServer, read_blob
from swarm.net.bridge import BridgeClosed, TrioGuest, trio_guest
from swarm.net.dataplane import DataPlane, DataPlaneConfig
from swarm.net.directory import META_PROTOCOL, PeerDirectory, read_metadata
from swarm.net.gossip import GossipConfig, Libp2pGossip, Libp2pSubscription
from swarm.net.logs import route_libp2p_logging
from swarm.net.node_events import Notifee
from swarm.net.queues import EventQueue, Inbox
from swarm.net.reach import (
    DIAL_BACK_TIMEOUT,
    PRIVATE,
    PUBLIC,
    REACH_PROTOCOL,
    UNKNOWN,
    Reach,
    ReachServer,
)
from swarm.net.reach import ask as ask_reach
from swarm.net.relay import RelayConfig, RelayServer
from swarm.net.relay_msgs import parse_circuit
from swarm.net.transport import (
    Message,
    MessageTooLarge,
    Path,
    PeerEvent,
    PeerIdMismatch,
    PeerUnreachable,
    TransportClosed,
    Validator,
)
from swarm.net.traversal import Traversal, TraversalConfig
from swarm.protocol.scoring import PeerScores, ScoreConfig
from swarm.wire.frames import FrameReader, encode_header

if TYPE_CHECKING:
    from libp2p.abc import IHost, INetStream, INotifee

logger = logging.getLogger(__name__)

MSG_PROTOCOL = "/swarm/msg/1.0.0"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Settings of a :class:`Libp2pNode`."""

    #: libp2p listen multiaddr (port 0: any free port).
    listen: str = "/ip4/127.0.0.1/tcp/0"
    #: Full multiaddrs (with ``/p2p/<id>``) dialed on start; start fails if none answers.
    bootstrap: tuple[str, ...] = ()
    #: The direct data plane; ``None`` carries every message on libp2p streams.
    data_plane: DataPlaneConfig | None = field(default_factory=DataPlaneConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    #: Run name: when set, the node publishes its metadata on the run's peers topic and
    #: keeps a directory of the others (:meth:`Libp2pNode.directory`).
    run: str | None = None
    #: Data-plane ``host:port`` to advertise instead of the listening address (a port
    #: forward or NAT mapping); empty: advertise what the data plane listens on.
    data_plane_advertise: str = ""
    #: Free-form region label published in the metadata.
    region: str = ""
    #: Uplink in bytes per second published in the metadata (0: unknown): peers ask a
    #: node whose uplink cannot carry a chunk in time last.
    upload: int = 0
    #: Seconds between metadata publications (when ``run`` is set).
    metadata_interval: float = 5.0
    #: Ask the first bootstrap node that answers to dial this node back
    #: (:mod:`swarm.net.reach`); behind a NAT it then advertises no address.
    check_reach: bool = True
    #: The largest message on the libp2p fallback path (the data plane has its own).
    max_message_bytes: int = (16 << 20) + (64 << 10)
    #: Concurrent inbound message streams one peer may hold open.
    max_streams_per_peer: int = 8
    #: Seconds a peer may stall in the middle of a frame on a libp2p stream.
    stall_timeout: float = 10.0
    #: Seconds for a libp2p dial (and, separately, the metadata exchange).
    connect_timeout: float = 10.0
    #: Seconds for the first stream on a connection :meth:`Libp2pNode.connect` dialed or
    #: found open; past it (or on a stream error) that peer's libp2p connections are
    #: closed and dialed once more, with ``connect_timeout`` for the streams then.
    stream_setup_timeout: float = 5.0
    #: Inbound messages queued before readers pause.
    inbox_depth: int = 256
    #: Payload bytes queued in all, and from one peer, before that reading pauses: a
    #: flooding peer stalls only its own connection.
    inbox_bytes: int = 128 << 20
    inbox_peer_bytes: int = 32 << 20
    #: Peer events queued (the oldest dropped beyond).
    event_depth: int = 1024
    scores: ScoreConfig = field(default_factory=ScoreConfig)
    #: Run a relay service for private peers (:mod:`swarm.net.relay`; empty host: the
    #: libp2p listen interface); None runs none.
    relay: RelayConfig | None = None
    #: How this node, when private, uses relays and hole punches.
    traversal: TraversalConfig = field(default_factory=TraversalConfig)


_UNSPECIFIED = frozenset({"", "0.0.0.0", "::", "[::]"})


def _listen_host(listen: str) -> str:
    """The interface of a ``/ip4/A/tcp/P`` listen multiaddr (127.0.0.1 if unparsable)."""
    parts = listen.split("/")
    if len(parts) >= 3 and parts[1] in ("ip4", "ip6") and parts[2]:
        return parts[2]
    return "127.0.0.1"


class _StreamSetupFailed(PeerUnreachable):
    """No stream could be opened on a libp2p connection (a stale one, or a peer still
    starting): :meth:`Libp2pNode.connect` closes that peer's connections and redials once."""


class Libp2pNode:
    """A node: libp2p host, gossip, and messages over the data plane or libp2p streams.

    Use as ``async with Libp2pNode(identity, NodeConfig(...)) as node``. Leaving the
    block stops every subscription, closes every connection and the host, and stops the
    trio guest run when this was its last user.
    """

    def __init__(self, identity: Identity, config: NodeConfig | None = None) -> None:
        self.identity = identity
        self.config = config or NodeConfig()
        self._peer_id = identity.peer_id
        self._inbox = Inbox(self.config.inbox_depth, max_bytes=self.config.inbox_bytes,
                            max_peer_bytes=self.config.inbox_peer_bytes)
        self._events = EventQueue(self.config.event_depth)
        self._scores = PeerScores(self.config.scores)
        self._stack = contextlib.AsyncExitStack()
        self._guest: TrioGuest | None = None
        self._host: IHost | None = None
        self._nursery: trio.Nursery | None = None
        self.plane: DataPlane | None = None
        self._paths: dict[str, Path] = {}
        self._out_streams: dict[str, INetStream] = {}
        self._out_locks: dict[str, asyncio.Lock] = {}
        self._in_streams: dict[str, int] = {}
        self._sockets = compat.SocketTracker()
        self._gossip = Libp2pGossip(self.config.gossip, self._peer_id, self._check_open,
                                    on_invalid=self._gossip_violation)
        self._card = BlobServer()
        self._reach_server = ReachServer()
        #: What the dial-back check found: ``public``, ``private`` (advertises no
        #: address) or ``unknown`` (advertises as if public).
        self.reachability = UNKNOWN
        #: The bootstrap node's answer (the address it saw us at), if any.
        self.reach: Reach | None = None
        self._seen_addrs: tuple[str, ...] = ()
        self._seen_data: tuple[str, int] | None = None
        self._relay: RelayServer | None = None
        self.traversal = Traversal(identity, self.config.traversal, lambda: self.plane,
                                   self._spawn, lambda: self._directory.seal())
        self._directory = PeerDirectory(
            identity, region=self.config.region, advertise=self.config.data_plane_advertise,
            addresses=self._advertised_addresses, data_address=self._advertised_data,
            relay=lambda: "" if self._relay is None else self._relay.hostport)
        self._directory.update(bandwidth=self.config.upload)
        self._tasks: set[asyncio.Task[None]] = set()
        self._entered = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._entered:
            raise TransportClosed("a node is entered once")
        self._entered = True
        try:
            compat.bound_multistream_reads()  # GHSA-hmjq-g7pp-rw3x (py-libp2p 0.8.1)
            self._guest = await self._stack.enter_async_context(trio_guest())
            route_libp2p_logging()
            if self.config.data_plane is not None:
                dp_cfg = self.config.data_plane
                if not dp_cfg.host:
                    dp_cfg = dataclasses.replace(dp_cfg, host=_listen_host(self.config.listen))
                self.plane = DataPlane(self.identity, dp_cfg,
                                       inbox=self._inbox, on_event=self._on_plane_event,
                                       scores=self._scores)
                await self._stack.enter_async_context(self.plane)
            if (relay := self.config.relay) is not None:
                self._relay = RelayServer(self.identity, dataclasses.replace(
                    relay, host=relay.host or _listen_host(self.config.listen)))
                await self._stack.enter_async_context(self._relay)
            handle, ready = self._guest.start_service(self._host_main, "libp2p host")
            self._stack.push_async_callback(handle.stop)
            async with asyncio.timeout(self.config.connect_timeout):
                await asyncio.shield(ready)
            self._stack.push_async_callback(self._stop_tasks)
            self._directory.seal()
            if self.config.run is not None:
                await self._join_run(self.config.run)
            await self._bootstrap()
            await self._check_reach()
            if self.reachability == PRIVATE:
                await self.traversal.start(
                    [(a.rsplit("/", 1)[-1], _listen_host(a)) for a in self.config.bootstrap],
                    lambda p: self._check_open().run(self._fetch_meta, p, 5.0))
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._gossip.aclose()
        await self._stack.aclose()
        self._inbox.close()
        self._events.close()

    async def _stop_tasks(self) -> None:
        await cancel_and_wait(list(self._tasks), "node")

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _host_main(self, ready: Any) -> None:
        from multiaddr import Multiaddr

        if _fixed_port(self.config.listen) and (taken := bind_failure(self.config.listen)):
            raise LocalProtocolError(taken)
        host = compat.new_secure_host(self.identity.seed)
        if compat.peer_str(host.get_id()) != self._peer_id:
            raise LocalProtocolError("libp2p derived a different peer id from the identity")
        try:
            failed = ""
            async with host.run([Multiaddr(self.config.listen)]), self._gossip.running(host):
                if host.get_addrs():
                    await self._serve_host(host, ready)
                else:
                    # py-libp2p logs a failed bind and runs on, listening nowhere (raised
                    # here, past its nurseries, which would wrap the error in groups)
                    failed = listen_failure(self.config.listen)
            if failed:
                raise LocalProtocolError(failed)
        finally:
            self._nursery = None
            self._host = None
            with trio.move_on_after(5) as scope, contextlib.suppress(Exception):
                scope.shield = True
                await host.close()

    async def _serve_host(self, host: Any, ready: Any) -> None:
        from libp2p.custom_types import TProtocol

        host.set_stream_handler(TProtocol(MSG_PROTOCOL), self._msg_handler)
        host.set_stream_handler(TProtocol(META_PROTOCOL), self._directory.serve)
        host.set_stream_handler(TProtocol(CARD_PROTOCOL), self._card.serve)
        host.set_stream_handler(TProtocol(REACH_PROTOCOL), self._reach_server.serve)
        host.get_network().register_notifee(cast("INotifee", Notifee(
            self._sockets, self._scores, self._hang_up, self._on_libp2p_disconnected)))
        self._host = host
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                ready()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.move_on_after(5) as scope:
                scope.shield = True
                await compat.close_all_connections(host, self._sockets)

    async def _bootstrap(self) -> None:
        if not self.config.bootstrap:
            return
        errors = []
        for addr in self.config.bootstrap:
            try:
                await self.connect(addr)
            except (PeerUnreachable, PeerIdMismatch) as exc:
                errors.append(str(exc))  # (it names the address)
        if len(errors) == len(self.config.bootstrap):
            raise PeerUnreachable("no bootstrap node answered: " + "; ".join(errors))
        for err in errors:  # (all of them failing is the error above, said once)
            logger.warning("bootstrap: %s", err)

    async def _check_reach(self) -> None:
        """Ask a bootstrap node to dial us back (:mod:`swarm.net.reach`); behind a NAT,
        reseal our metadata without addresses."""
        if not self.config.check_reach or not self.config.bootstrap or not self.listen_addresses:
            return
        try:
            me = parse_tcp_multiaddr(self.listen_addresses[0])
        except PeerUnreachable:
            return
        ports = [me.port]
        if self.plane is not None and self.plane.address is not None \
                and not self.config.data_plane_advertise:
            ports.append(self.plane.address[1])
        guest = self._check_open()
        for addr in self.config.bootstrap:
            peer = addr.rsplit("/", 1)[-1]
            if peer not in self._paths:
                continue
            try:
                async with asyncio.timeout(self.config.connect_timeout
                                           + DIAL_BACK_TIMEOUT * 3):
                    reach = await guest.run(self._trio_ask_reach, peer, tuple(ports))
            except (BridgeClosed, TransportClosed):
                raise
            except Exception as exc:  # an older node without the protocol, a time-out
                logger.info("no reachability answer from %s: %r", peer, exc)
                continue
            self.reach = reach
            self.reachability = reach.verdict(me.host, tuple(ports))
            if self.reachability == PRIVATE:
                logger.info("not reachable at %s (seen as %s, dial-back opened %s of ports "
                            "%s): advertising no address", me.host, reach.observed,
                            list(reach.open), ports)
            elif self.reachability == PUBLIC and reach.seen_elsewhere(me.host):
                # On 0.0.0.0, or a port forward: advertise where the bootstrap reached us.
                family = "ip6" if ":" in reach.observed else "ip4"
                self._seen_addrs = (f"/{family}/{reach.observed}/tcp/{me.port}/p2p/"
                                    f"{self._peer_id}",)
                if (data := self.data_address) is not None:
                    self._seen_data = (reach.observed, data[1])
            self._directory.seal()
            return

    async def _trio_ask_reach(self, peer: str, ports: tuple[int, ...]) -> Reach:
        stream = await self._trio_new_stream(peer, REACH_PROTOCOL, self.config.connect_timeout)
        return await ask_reach(stream, ports, DIAL_BACK_TIMEOUT * 3)

    def _advertised_addresses(self) -> tuple[str, ...]:
        if self.reachability == PRIVATE:
            return self.traversal.addresses()
        return self._seen_addrs or self.listen_addresses

    def _advertised_data(self) -> tuple[str, int] | None:
        if self.reachability == PRIVATE:
            return None
        return self._seen_data or self.data_address

    # -- Transport ---------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        host = self._host
        if host is None:
            return ()
        out = []
        for a in host.get_addrs():
            text = str(a)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self._peer_id}")
        return tuple(out)

    @property
    def trio_guest(self) -> TrioGuest:
        """The trio guest run hosting libp2p (for code that drives libp2p directly)."""
        return self._check_open()

    @property
    def libp2p_host(self) -> IHost:
        """The py-libp2p host; use it only from trio code run through :attr:`trio_guest`."""
        self._check_open()
        assert self._host is not None
        return self._host

    @property
    def data_address(self) -> tuple[str, int] | None:
        """The data plane's (host, port), or None without a data plane."""
        return self.plane.address if self.plane is not None else None

    @property
    def max_message_bytes(self) -> int:
        if self.plane is not None:
            return min(self.config.max_message_bytes, self.plane.config.max_message_bytes)
        return self.config.max_message_bytes

    def _check_open(self) -> TrioGuest:
        if self._closed or self._guest is None or self._host is None:
            raise TransportClosed("node is closed")
        return self._guest

    @property
    def relay(self) -> RelayServer | None:
        """This node's relay service (its ``stats``, its ``hostport``), if it runs one."""
        return self._relay

    async def connect(self, address: str) -> str:
        self._check_open()
        if (circuit := parse_circuit(address)) is not None:
            if circuit.peer_id in self._paths:
                return circuit.peer_id
            return await self.traversal.connect(address)
        target = parse_tcp_multiaddr(address)
        peer = target.peer_id
        if peer is None:
            raise PeerUnreachable(f"{address!r}: a libp2p address needs /p2p/<peer id>")
        if peer == self._peer_id:
            raise PeerUnreachable("cannot connect to self")
        if peer in self._paths:
            return peer
        if self._scores.is_banned(peer):
            raise PeerUnreachable(f"peer {peer} is banned")
        await self._dial(address, peer, fresh=False)
        try:
            await self._establish(peer, target.host, first=True)
        except _StreamSetupFailed as exc:
            logger.info("no stream to %s on its libp2p connection (%s); redialing", peer, exc)
            await self._dial(address, peer, fresh=True)
            await self._establish(peer, target.host, first=False)
        return peer

    async def _dial(self, address: str, peer: str, *, fresh: bool) -> None:
        guest = self._check_open()
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                await guest.run(self._trio_connect, address, fresh)
        except TimeoutError as exc:
            raise PeerUnreachable(f"libp2p dial of {address} timed out") from exc
        except (BridgeClosed, TransportClosed):
            raise
        except Exception as exc:
            if compat.is_security_failure(exc):
                raise PeerIdMismatch(
                    f"the node at {address} did not prove peer id {peer} (Noise handshake "
                    f"failed: wrong peer id in the address, or not a libp2p node)") from exc
            why = ("nothing answered (no node listening there, or the address is not "
                   "reachable from here)" if compat.is_unanswered_dial(exc) else str(exc))
            raise PeerUnreachable(f"libp2p dial of {address} failed: {why}") from exc

    async def _trio_connect(self, address: str, fresh: bool) -> None:
        """Dial ``address`` (a deliberate dial: libp2p's memory of failed ones is ignored).

        ``fresh``: close the peer's libp2p connections first; otherwise only ones that
        are all closed already (py-libp2p would reuse them and fail every stream).
        """
        host = self._host
        if host is None:
            raise TransportClosed("node is closed")
        await compat.dial(host, address, fresh=fresh, sockets=self._sockets,
                          close_timeout=self.config.connect_timeout)

    async def _establish(self, peer: str, dialed_host: str, *, first: bool) -> None:
        """Pick the path to a libp2p-connected peer: data plane if possible, else streams.

        :raises _StreamSetupFailed: ``first`` and no stream opens on the connection.
        """
        guest = self._check_open()
        timeout = self.config.stream_setup_timeout if first else self.config.connect_timeout
        if self.plane is not None:
            meta = None
            try:
                async with asyncio.timeout(timeout):
                    meta = await guest.run(self._fetch_meta, peer, timeout)
                self._directory.learn(peer, meta)
            except (BridgeClosed, TransportClosed):
                raise
            except (DecodeError, SignatureError) as exc:
                logger.info("bad metadata from %s (%s); using libp2p streams", peer, exc)
            except Exception as exc:  # timeouts, libp2p stream errors
                if not compat.is_refusal(exc):
                    # No stream opens on this connection: a message stream would wait
                    # out its timeout too.
                    if peer in self._paths:  # its data plane dialed us meanwhile
                        return
                    if first:
                        raise _StreamSetupFailed(f"metadata stream: {exc!r}") from exc
                    raise PeerUnreachable(f"no stream opens to {peer}: {exc!r}") from exc
                logger.info("%s serves no metadata (%r); using libp2p streams", peer, exc)
            if meta is not None and meta.data_addr:
                host, _, port = meta.data_addr.rpartition(":")
                if host in _UNSPECIFIED:  # it listens on every interface: use the one we dialed
                    host = dialed_host
                try:
                    await self.plane.connect(host, int(port), peer)
                    return
                except PeerIdMismatch as exc:
                    self._scores.penalize(peer, f"data-plane address proved another key: {exc}")
                except (PeerUnreachable, ValueError) as exc:
                    logger.info("direct path to %s at %s failed (%s); using libp2p streams",
                                peer, meta.data_addr, exc)
        if peer in self._paths:  # the peer's data plane dialed us meanwhile
            return
        try:
            await self._open_out_stream(peer, timeout)
        except PeerUnreachable as exc:
            if first and not compat.is_refusal(exc):
                raise _StreamSetupFailed(f"message stream: {exc}") from exc
            raise
        self._set_path(peer, Path.LIBP2P)

    async def send(self, peer_id: str, payload: bytes) -> None:
        self._check_open()
        if len(payload) > self.max_message_bytes:
            raise MessageTooLarge(
                f"{len(payload)} bytes is over the bound {self.max_message_bytes}")
        path = self._paths.get(peer_id)
        if path is Path.DIRECT and self.plane is not None:
            await self.plane.send(peer_id, payload)
        elif path is Path.LIBP2P:
            await self._send_libp2p(peer_id, payload)
        else:
            raise PeerUnreachable(f"not connected to {peer_id}")

    async def recv(self) -> Message:
        return await self._inbox.get()

    async def next_event(self) -> PeerEvent:
        return await self._events.get()

    def poll_event(self) -> PeerEvent | None:
        return self._events.get_nowait()

    def connected_peers(self) -> frozenset[str]:
        return frozenset(self._paths)

    def path(self, peer_id: str) -> Path | None:
        """How messages to ``peer_id`` travel now (None: not connected)."""
        return self._paths.get(peer_id)

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        guest = self._check_open()
        if self.plane is not None:
            await self.plane.disconnect(peer_id, reason)
        with contextlib.suppress(Exception):
            await guest.run(self._trio_disconnect, peer_id)
        self._drop_path(peer_id, Path.LIBP2P, reason or "disconnected")

    async def _trio_disconnect(self, peer_id: str) -> None:
        self._out_streams.pop(peer_id, None)
        if self._host is not None:
            await self._host.disconnect(compat.id_from_str(peer_id))

    def penalize(self, peer_id: str, reason: str, *, disconnect: bool = True) -> None:
        self._scores.penalize(peer_id, reason)
        if disconnect:
            self._hang_up(peer_id, reason)

    def score(self, peer_id: str) -> float:
        return self._scores.score(peer_id)

    def _hang_up(self, peer_id: str, reason: str) -> None:
        """Drop every connection to ``peer_id`` (callable from asyncio or trio code)."""
        if self.plane is not None:
            self.plane.drop(peer_id, reason)
        self._drop_path(peer_id, Path.LIBP2P, reason)
        banned = self._scores.is_banned(peer_id)

        def in_trio() -> None:
            if self._nursery is not None:
                self._nursery.start_soon(self._trio_disconnect, peer_id)
                if banned:
                    self._gossip.blacklist(peer_id)

        if self._guest is not None:
            with contextlib.suppress(BridgeClosed):
                self._guest._soon(in_trio)

    # -- paths and events ------------------------------------------------------------
    def _set_path(self, peer: str, path: Path) -> None:
        if self._closed:
            return
        old = self._paths.get(peer)
        if old is None:
            self._paths[peer] = path
            self._events.push(PeerEvent(peer, True, path))
        elif old is Path.LIBP2P and path is Path.DIRECT:
            self._paths[peer] = path  # upgraded; already announced as connected

    def _drop_path(self, peer: str, path: Path, reason: str) -> None:
        if self._paths.get(peer) is path:
            del self._paths[peer]
            self._out_streams.pop(peer, None)
            lock = self._out_locks.get(peer)
            if lock is not None and not lock.locked():
                del self._out_locks[peer]
            self._events.push(PeerEvent(peer, False, path, reason))

    def _on_plane_event(self, ev: PeerEvent) -> None:
        if ev.connected:
            self._set_path(ev.peer_id, Path.DIRECT)
        else:
            self._drop_path(ev.peer_id, Path.DIRECT, ev.reason)

    def _on_libp2p_disconnected(self, peer: str) -> None:
        host = self._host
        if host is not None and any(not c.is_closed for c in compat.connections(host, peer)):
            return
        self._out_streams.pop(peer, None)
        self._drop_path(peer, Path.LIBP2P, "libp2p connection closed")

    # -- libp2p message streams ------------------------------------------------------
    async def _open_out_stream(self, peer: str, timeout: float | None = None) -> INetStream:
        guest = self._check_open()
        stream = self._out_streams.get(peer)
        if stream is None:
            try:
                stream = await guest.run(self._trio_new_stream, peer, MSG_PROTOCOL, timeout)
            except (BridgeClosed, TransportClosed):
                raise
            except Exception as exc:
                raise PeerUnreachable(f"cannot open a message stream to {peer}: {exc}"
                                      ) from exc
            self._out_streams[peer] = stream
        return stream

    async def _trio_new_stream(self, peer: str, protocol: str, timeout: float | None = None
                               ) -> INetStream:
        from libp2p.custom_types import TProtocol

        host = self._host
        if host is None:
            raise TransportClosed("node is closed")
        with trio.fail_after(self.config.connect_timeout if timeout is None else timeout):
            return await host.new_stream(compat.id_from_str(peer), [TProtocol(protocol)])

    async def _send_libp2p(self, peer: str, payload: bytes) -> None:
        guest = self._check_open()
        lock = self._out_locks.setdefault(peer, asyncio.Lock())
        async with lock:
            stream = await self._open_out_stream(peer)
            try:
                await guest.run(stream.write, encode_header(len(payload)) + payload)
            except (BridgeClosed, TransportClosed):
                raise
            except Exception as exc:
                self._out_streams.pop(peer, None)
                raise PeerUnreachable(f"message stream to {peer} failed: {exc}") from exc

    async def _msg_handler(self, stream: INetStream) -> None:
        peer = compat.peer_str(stream.muxed_conn.peer_id)
        count = self._in_streams.get(peer, 0)
        if self._scores.is_banned(peer) or count >= self.config.max_streams_per_peer:
            reason = "banned" if self._scores.is_banned(peer) else "too many streams"
            self._scores.penalize(peer, reason, weight=0.2)
            with contextlib.suppress(Exception):
                await stream.reset()
            if self._scores.is_banned(peer):
                self._hang_up(peer, reason)
            return
        self._in_streams[peer] = count + 1
        try:
            if self.plane is None or not self.plane.has_peer(peer):
                self._set_path(peer, Path.LIBP2P)
            await self._read_frames(peer, stream)
        finally:
            left = self._in_streams.get(peer, 1) - 1
            if left > 0:
                self._in_streams[peer] = left
            else:
                self._in_streams.pop(peer, None)
            with contextlib.suppress(Exception):
                await stream.close()

    async def _read_frames(self, peer: str, stream: INetStream) -> None:
        reader = FrameReader(self.config.max_message_bytes)
        token = trio.lowlevel.current_trio_token()
        while True:
            timeout = self.config.stall_timeout if reader.mid_frame else float("inf")
            try:
                with trio.fail_after(timeout):
                    data = await stream.read(1 << 20)
            except trio.TooSlowError:
                self._violation(peer, "stalled mid-frame on a message stream")
                return
            except Exception as exc:  # libp2p: EOF, reset, connection closed
                logger.debug("message stream from %s ended: %r", peer, exc)
                return
            if not data:
                return
            try:
                reader.feed(data)
            except DecodeError as exc:
                self._violation(peer, f"protocol violation: {exc}")
                return
            while (frame := reader.next_frame()) is not None:
                if not self._inbox.offer(Message(peer, bytes(frame))):
                    space = trio.Event()
                    self._inbox.when_space(functools.partial(_wake, token, space), peer)
                    await space.wait()

    def _gossip_violation(self, peer: str, reason: str) -> None:
        """A gossip validator rejected a message ``peer`` forwarded (trio): score it down;
        once banned, it is disconnected and its gossip blacklisted."""
        self._scores.penalize(peer, reason, weight=self.config.gossip.invalid_weight)
        if self._scores.is_banned(peer):
            self._hang_up(peer, f"banned for invalid gossip ({reason})")

    def _violation(self, peer: str, reason: str) -> None:
        logger.info("peer %s: %s", peer, reason)
        self._scores.penalize(peer, reason)
        self._hang_up(peer, reason)

    # -- peer directory --------------------------------------------------------------
    def update_metadata(self, *, bandwidth: int | None = None, region: str | None = None
                        ) -> None:
        """Change what this node says about itself (measured uplink in bytes per second,
        region label); published with the next metadata round and served on request."""
        self._directory.update(bandwidth=bandwidth, region=region)
        if self._host is not None:
            self._directory.seal()

    async def _fetch_meta(self, peer: str, timeout: float) -> topics.PeerMetadata:
        stream = await self._trio_new_stream(peer, META_PROTOCOL, timeout)
        return await read_metadata(stream, peer, timeout)

    def serve_card(self, data: bytes) -> None:
        """Serve ``data`` (a signed run card) to peers that ask for it."""
        self._card.data = data

    async def fetch_card(self, peer: str, max_bytes: int, timeout: float = 30.0) -> bytes:
        """The run card ``peer`` serves (``b""``: it holds none); unchecked.

        :raises PeerUnreachable: no stream opened, or it did not answer in time.
        :raises DecodeError: over ``max_bytes`` or cut short.
        """
        guest = self._check_open()

        async def fetch() -> bytes:
            stream = await self._trio_new_stream(peer, CARD_PROTOCOL, timeout)
            return await read_blob(stream, max_bytes, timeout)

        try:
            return await guest.run(fetch)
        except (BridgeClosed, TransportClosed, DecodeError):
            raise
        except Exception as exc:
            raise PeerUnreachable(f"no card from {peer}: {exc!r}") from exc

    def directory(self) -> dict[str, topics.PeerMetadata]:
        """Peers learned from the run's peers topic or their served metadata (latest of each)."""
        return self._directory.peers()

    async def _join_run(self, run: str) -> None:
        topic = topics.peers(run)
        sub = await self.subscribe(topic, topics.peer_metadata_validator(topic))
        self._spawn(self._directory.collect(sub), "peer metadata collector")
        self._spawn(self._directory.publish_every(self.publish, topic,
                                                  self.config.metadata_interval),
                    "peer metadata publisher")

    # -- Gossip ------------------------------------------------------------------------
    async def publish(self, topic: str, data: bytes) -> None:
        await self._gossip.publish(topic, data)

    async def subscribe(self, topic: str, validator: Validator | None = None
                        ) -> Libp2pSubscription:
        """Subscribe to ``topic``; its messages are relayed only once ``validator``
        accepts them, and a rejected one scores down the peer that forwarded it.

        Without ``validator``, a topic of this node's run gets its own
        (:func:`~swarm.net.topics.validator_for`); the run's manifests topic needs one
        (:func:`~swarm.net.topics.manifest_validator` with the trainer key).

        :raises LocalProtocolError: the run's manifests topic without a validator.
        """
        if validator is None and self.config.run is not None:
            parsed = topics.run_topic(topic)
            if parsed is not None and parsed[0] == self.config.run:
                validator = topics.validator_for(topic)
                if validator is None:
                    raise LocalProtocolError(
                        f"{topic} needs a validator (topics.manifest_validator)")
        return await self._gossip.subscribe(topic, validator)

    async def wait_for_mesh(self, topic: str, peers: int, timeout: float = 10.0) -> None:
        """Wait until ``peers`` peers are known subscribed to ``topic`` (tests, start-up).

        :raises TimeoutError: not within ``timeout`` seconds.
        """
        await self._gossip.wait_for_mesh(topic, peers, timeout)


def _wake(token: trio.lowlevel.TrioToken, event: trio.Event) -> None:
    """Set a trio event from asyncio code; a no-op once the trio run has ended (the node
    closes its inbox, waking paused readers, after its trio guest run stopped: on SIGTERM
    the bootstrap ended with ``trio.RunFinishedError`` from ``Inbox.close``)."""
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(event.set)


def _fixed_port(listen: str) -> bool:
    """Whether ``listen`` names a TCP port of its own (not 0, which the kernel picks)."""
    try:
        return parse_tcp_multiaddr(listen).port != 0
    except PeerUnreachable:
        return False
