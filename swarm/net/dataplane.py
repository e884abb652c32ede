"""The data plane: direct, authenticated, encrypted asyncio TCP between peers.

Each connection runs the handshake of :mod:`swarm.net.handshake` (both ends prove their
Ed25519 identity over the session's X25519 keys), then carries AEAD-sealed frames
(:mod:`swarm.wire.frames`): one frame per message, up to ``max_message_bytes``. There
are no request/response round trips in the transport itself, so any number of requests
are in flight (pipelined) on one connection. The driver is a
:class:`asyncio.BufferedProtocol`: large frames are received straight into their final
buffer, and no task exists per connection (only callbacks and timers), so closing the
plane leaves nothing running.

Bad input closes the connection and scores the peer down (when its identity is known):
an oversized frame header, a frame failing authentication, a malformed or out-of-order
handshake, a handshake not done within ``handshake_timeout``, a peer stalling mid-frame
for ``stall_timeout``, a peer over ``max_connections_per_peer``.

Memory. A frame's buffer grows as its bytes arrive (never to the announced length up
front), and one byte budget per plane (``buffer_budget``) covers every frame being
received or decrypted, across all peers: a frame's announced length is reserved when
its header arrives, and a connection whose frame does not fit waits, with reading
paused (backpressure; grants go round-robin across remote addresses); a peer that
stalls mid-frame is dropped after ``stall_timeout`` and its reservation freed.
Reserving whole frames means every reserved frame can finish, so waiting
connections never deadlock on each other's partial frames. On top of the budget, a
connection holds its read scratch buffer (4 KiB during the handshake, 64 KiB after)
and the write high-water mark.

Admission. Handshakes must finish within ``handshake_timeout``. At most ``max_pending``
inbound handshakes are pending, ``max_pending_per_ip`` from one address: a new one over
the per-address bound evicts that address's oldest pending handshake, and one over the
overall bound (or over ``max_connections``) evicts the oldest pending handshake of the
address holding the most, so an address holding many open handshakes only ever pushes
out its own. Authenticated connections are bounded per peer
(``max_connections_per_peer``) and, with pending ones, per address
(``max_connections_per_ip``: over it, a new connection is refused).
"""


from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Self

from swarm.identity import Identity
from swarm.net.addresses import parse_tcp_multiaddr
from swarm.net.connection import Connection, DataPlaneConfig
from swarm.net.handshake import TAG_LEN, ClientHandshake
from swarm.net.queues import ByteBudget, EventQueue, Inbox
from swarm.net.transport import (
    Message,
    MessageTooLarge,
    Path,
    PeerEvent,
    PeerUnreachable,
    TransportClosed,
)
from swarm.protocol.scoring import PeerScores

__all__ = ["DataPlane", "DataPlaneConfig", "DirectTransport"]

logger = logging.getLogger(__name__)


class DataPlane:
    """Direct connections to peers; an async context manager owning its server socket.

    Inbound messages go to ``inbox`` and connect/disconnect events to ``on_event``; both
    are shared with the libp2p node when the data plane is part of one.
    """

    def __init__(self, identity: Identity, config: DataPlaneConfig, *, inbox: Inbox,
                 on_event: Callable[[PeerEvent], None], scores: PeerScores) -> None:
        self.identity = identity
        self.config = config
        self.inbox = inbox
        self.on_event = on_event
        self.scores = scores
        self._server: asyncio.Server | None = None
        self.conns_all: set[Connection] = set()
        self._peers: dict[str, list[Connection]] = {}
        self._closed = False
        self._address: tuple[str, int] | None = None
        self.pool: ThreadPoolExecutor | None = None
        if config.buffer_budget < config.max_message_bytes + TAG_LEN:
            raise ValueError("buffer_budget must hold at least one largest frame "
                             f"({config.max_message_bytes + TAG_LEN} bytes)")
        self.budget = ByteBudget(config.buffer_budget)
        #: Inbound handshakes not done yet, per remote address, oldest first.
        self._pending: dict[str, dict[Connection, None]] = {}
        self._pending_count = 0
        #: Inbound connections per remote address.
        self._per_ip: dict[str, int] = {}
        #: Evicted connections whose close is under way (not counted any more).
        self._evicted: set[Connection] = set()

    async def __aenter__(self) -> Self:
        if self.config.crypto_threads > 0:
            self.pool = ThreadPoolExecutor(self.config.crypto_threads,
                                            thread_name_prefix="swarm-aead")
        if self.config.listen:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(
                self._accept, self.config.host or "127.0.0.1", self.config.port,
                reuse_address=True)
            sockname = self._server.sockets[0].getsockname()
            self._address = (str(sockname[0]), int(sockname[1]))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        conns = list(self.conns_all)
        for conn in conns:
            conn.reason = conn.reason or "closed"
            conn.abort()
        for conn in conns:
            with contextlib.suppress(asyncio.CancelledError):
                await conn.lost
            for task in list(conn._inflight):
                with contextlib.suppress(BaseException):
                    await task
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) this plane listens on, or None."""
        return self._address

    def _accept(self) -> Connection:
        refuse = ""
        if self._closed:
            refuse = "closing"
        elif len(self.conns_all) >= self.config.max_connections:
            refuse = "over max_connections"
        return Connection(self, None, refuse=refuse)

    def inbound(self, conn: Connection) -> str:
        """Take in a new inbound connection from ``conn.ip``: a refusal reason or ''.

        Makes room by evicting pending handshakes (see the module's "Admission")."""
        cfg = self.config
        ip = conn.ip
        if self._closed:
            return "closing"
        if self._per_ip.get(ip, 0) >= cfg.max_connections_per_ip:
            return "over max_connections_per_ip"
        if len(self._pending.get(ip, ())) >= cfg.max_pending_per_ip:
            self._evict_pending(ip)
        elif self._pending_count >= cfg.max_pending:
            self._evict_pending(self._most_pending(ip))
        if len(self.conns_all) - len(self._evicted) >= cfg.max_connections:
            if not self._pending:
                return "over max_connections"
            self._evict_pending(self._most_pending(ip))
        self._pending.setdefault(ip, {})[conn] = None
        self._pending_count += 1
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        return ""

    def _most_pending(self, newcomer: str) -> str:
        return max(self._pending,
                   key=lambda a: len(self._pending[a]) + (a == newcomer))

    def _evict_pending(self, ip: str) -> None:
        pending = self._pending.get(ip)
        if not pending:
            return
        oldest = next(iter(pending))
        self._unpend(oldest)
        self._evicted.add(oldest)
        oldest.fail("handshake evicted: too many pending handshakes", penalize=False)

    def _unpend(self, conn: Connection) -> None:
        pending = self._pending.get(conn.ip)
        if pending is not None and conn in pending:
            del pending[conn]
            self._pending_count -= 1
            if not pending:
                del self._pending[conn.ip]

    def authenticated(self, conn: Connection) -> None:
        """An inbound handshake finished: it no longer counts as pending."""
        self._unpend(conn)

    def admit(self, conn: Connection) -> str:
        """Register an authenticated connection; returns a refusal reason or ''."""
        peer = conn.peer_id
        assert peer is not None
        if self._closed:
            return "closing"
        if peer == self.identity.peer_id:
            return "connected to self"
        if self.scores.is_banned(peer):
            return f"peer {peer} is banned"
        conns = self._peers.setdefault(peer, [])
        if len(conns) >= self.config.max_connections_per_peer:
            self.scores.penalize(peer, "too many connections")
            return "over max_connections_per_peer"
        conns.append(conn)
        conn.registered = True
        if len(conns) == 1:
            self.on_event(PeerEvent(peer, True, Path.DIRECT))
        return ""

    def connection_lost(self, conn: Connection, reason: str) -> None:
        if conn in self.conns_all:
            self.conns_all.discard(conn)
            if conn.ip:
                self._unpend(conn)
                left = self._per_ip.get(conn.ip, 0) - 1
                if left > 0:
                    self._per_ip[conn.ip] = left
                else:
                    self._per_ip.pop(conn.ip, None)
        self._evicted.discard(conn)
        if not conn.registered or conn.peer_id is None:
            return
        conn.registered = False
        conns = self._peers.get(conn.peer_id, [])
        if conn in conns:
            conns.remove(conn)
        if not conns:
            self._peers.pop(conn.peer_id, None)
            self.on_event(PeerEvent(conn.peer_id, False, Path.DIRECT, reason))

    async def connect(self, host: str, port: int, expected_peer_id: str | None, *,
                      connections: int = 1) -> str:
        """Open ``connections`` authenticated connections to ``host:port``.

        :raises PeerIdMismatch: the server proved another key than ``expected_peer_id``.
        :raises PeerUnreachable: refused, timed out, or the handshake failed.
        """
        if self._closed:
            raise TransportClosed("data plane is closed")
        if expected_peer_id is not None and self.scores.is_banned(expected_peer_id):
            raise PeerUnreachable(f"peer {expected_peer_id} is banned")
        peer = expected_peer_id
        for _ in range(connections):
            peer = await self._dial(host, port, peer)
        assert peer is not None
        return peer

    async def _dial(self, host: str, port: int, expected: str | None) -> str:
        if len(self.conns_all) >= self.config.max_connections:
            raise PeerUnreachable("over max_connections")
        loop = asyncio.get_running_loop()
        hs = ClientHandshake(self.identity, expected_peer_id=expected,
                             ciphers=self.config.ciphers)
        conn: Connection | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                _, proto = await loop.create_connection(
                    lambda: Connection(self, hs), host, port)
                conn = proto
                return await asyncio.shield(conn.ready)
        except TimeoutError as exc:
            raise PeerUnreachable(f"data plane {host}:{port}: handshake timed out") from exc
        except OSError as exc:
            raise PeerUnreachable(f"data plane {host}:{port}: {exc}") from exc
        finally:
            if conn is not None and not (conn.ready.done() and not conn.ready.exception()):
                conn.abort()

    async def adopt(self, sock: socket.socket, expected_peer_id: str | None) -> Connection:
        """Run the handshake on a connected socket someone else opened (a relayed
        circuit, a punched hole): as the client when ``expected_peer_id`` is given,
        else as the server. Returns the connection once admitted.

        :raises PeerIdMismatch: the client side met another key than expected.
        :raises PeerUnreachable: refused, timed out, or the handshake failed.
        """
        if self._closed:
            sock.close()
            raise TransportClosed("data plane is closed")
        loop = asyncio.get_running_loop()
        conn: Connection | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                if expected_peer_id is not None:
                    if len(self.conns_all) >= self.config.max_connections:
                        raise PeerUnreachable("over max_connections")
                    hs = ClientHandshake(self.identity, expected_peer_id=expected_peer_id,
                                         ciphers=self.config.ciphers)
                    _, conn = await loop.create_connection(lambda: Connection(self, hs),
                                                           sock=sock)
                else:
                    _, conn = await loop.connect_accepted_socket(self._accept, sock)
                await asyncio.shield(conn.ready)
                return conn
        except TimeoutError as exc:
            raise PeerUnreachable("data-plane handshake on an adopted socket timed out"
                                  ) from exc
        except OSError as exc:
            raise PeerUnreachable(f"adopted socket: {exc}") from exc
        finally:
            if conn is None:
                sock.close()
            elif not (conn.ready.done() and not conn.ready.exception()):
                conn.abort()

    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    async def send(self, peer_id: str, payload: bytes | memoryview) -> None:
        """Send one message over the least-loaded connection to ``peer_id``.

        With several connections to one peer, messages may be reordered between them.
        """
        if len(payload) > self.config.max_message_bytes:
            raise MessageTooLarge(
                f"{len(payload)} bytes is over the bound {self.config.max_message_bytes}")
        conns = self._peers.get(peer_id)
        if not conns:
            raise PeerUnreachable(f"no data-plane connection to {peer_id}")
        if len(conns) > 1:
            conns = [c for c in conns if not c.standby] or conns
        conn = conns[0] if len(conns) == 1 else min(conns, key=lambda c: c.write_backlog)
        await conn.send(payload)

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        conns = list(self._peers.get(peer_id, ()))
        for conn in conns:
            conn.reason = reason or "closed"
            conn.abort()
        for conn in conns:
            await conn.lost

    def drop(self, peer_id: str, reason: str) -> None:
        """Abort every connection to ``peer_id`` now (from synchronous code)."""
        for conn in list(self._peers.get(peer_id, ())):
            conn.reason = reason
            conn.abort()


class DirectTransport:
    """A :class:`~swarm.net.transport.Transport` over the data plane alone (no libp2p).

    Addresses are ``/ip4/H/tcp/P/p2p/<peer id>``; a peer is "connected" once one
    authenticated connection exists. Used by ``swarm bench transport`` and by tests;
    the libp2p node embeds the same :class:`DataPlane`.
    """

    def __init__(self, identity: Identity, config: DataPlaneConfig | None = None) -> None:
        self.config = config or DataPlaneConfig()
        self.identity = identity
        self._inbox = Inbox(self.config.inbox_depth, max_bytes=self.config.inbox_bytes,
                            max_peer_bytes=self.config.inbox_peer_bytes)
        self._events = EventQueue(self.config.event_depth)
        self._scores = PeerScores(self.config.scores)
        self.plane = DataPlane(identity, self.config, inbox=self._inbox,
                               on_event=self._events.push, scores=self._scores)
        self._entered = False

    async def __aenter__(self) -> Self:
        if self._entered:
            raise TransportClosed("a transport is entered once")
        self._entered = True
        await self.plane.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.plane.aclose()
        self._inbox.close()
        self._events.close()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        addr = self.plane.address
        if addr is None:
            return ()
        return (f"/ip4/{addr[0]}/tcp/{addr[1]}/p2p/{self.peer_id}",)

    @property
    def max_message_bytes(self) -> int:
        return self.config.max_message_bytes

    async def connect(self, address: str, *, connections: int = 1) -> str:
        if self._inbox.closed:
            raise TransportClosed("transport is closed")
        target = parse_tcp_multiaddr(address)
        if target.peer_id is not None and self.plane.has_peer(target.peer_id) \
                and connections == 1:
            return target.peer_id
        return await self.plane.connect(target.host, target.port, target.peer_id,
                                        connections=connections)

    async def send(self, peer_id: str, payload: bytes) -> None:
        if self._inbox.closed:
            raise TransportClosed("transport is closed")
        await self.plane.send(peer_id, payload)

    async def recv(self) -> Message:
        return await self._inbox.get()

    async def next_event(self) -> PeerEvent:
        return await self._events.get()

    def poll_event(self) -> PeerEvent | None:
        return self._events.get_nowait()

    def connected_peers(self) -> frozenset[str]:
        return self.plane.peers()

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        await self.plane.disconnect(peer_id, reason)

    def penalize(self, peer_id: str, reason: str, *, disconnect: bool = True) -> None:
        self._scores.penalize(peer_id, reason)
        if disconnect:
            self.plane.drop(peer_id, reason)

    def score(self, peer_id: str) -> float:
        return self._scores.score(peer_id)
