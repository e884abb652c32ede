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
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from swarm.errors import DecodeError, RemoteProtocolError
from swarm.identity import Identity
from swarm.net.addresses import parse_tcp_multiaddr
from swarm.net.handshake import (
    CIPHERS,
    MAX_HANDSHAKE_BYTES,
    TAG_LEN,
    ClientHandshake,
    HandshakeError,
    ServerHandshake,
    Session,
)
from swarm.net.queues import ByteBudget, EventQueue, Inbox
from swarm.net.transport import (
    Message,
    MessageTooLarge,
    Path,
    PeerEvent,
    PeerIdMismatch,
    PeerUnreachable,
    TransportClosed,
)
from swarm.protocol.scoring import PeerScores, ScoreConfig
from swarm.wire.frames import FrameReader, encode_frame, encode_header

logger = logging.getLogger(__name__)

_WRITE_SLICE = 1 << 20
#: Read scratch during the handshake (frames of at most 1 KiB) and after it.
_HANDSHAKE_SCRATCH = 4 << 10
_SCRATCH = 64 << 10


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    """Settings of the direct data plane."""

    #: Interface to listen on. Empty: inside a :class:`~swarm.net.node.Libp2pNode`, the
    #: interface of its libp2p listen address; standalone, 127.0.0.1.
    host: str = ""
    #: TCP port to listen on (0: any free port).
    port: int = 0
    #: Accept inbound connections (False: dial only).
    listen: bool = True
    #: AEADs offered/accepted, preferred first.
    ciphers: tuple[str, ...] = CIPHERS
    #: The largest message (frame plaintext) sent or accepted.
    max_message_bytes: int = (16 << 20) + (64 << 10)
    #: Seconds for a dial plus the whole handshake.
    handshake_timeout: float = 5.0
    #: Seconds a peer may stall in the middle of a frame before it is dropped.
    stall_timeout: float = 10.0
    #: Connections in total (inbound and outbound, including handshakes).
    max_connections: int = 256
    #: Connections from or to one peer; more is a protocol violation.
    max_connections_per_peer: int = 8
    #: Inbound connections (pending and authenticated) from one IP address; more are
    #: refused. Loopback setups with many local peers need this raised.
    max_connections_per_ip: int = 128
    #: Inbound handshakes pending at once: over it, the oldest pending handshake of the
    #: address holding the most is dropped.
    max_pending: int = 128
    #: Inbound handshakes pending at once from one address: over it, that address's
    #: oldest pending handshake is dropped.
    max_pending_per_ip: int = 32
    #: Bytes of frames being received or decrypted, over all connections (each frame's
    #: announced length is reserved when its header arrives; a frame that does not fit
    #: waits with reading paused). At least one largest frame.
    buffer_budget: int = 256 << 20
    #: Bytes queued in asyncio's write buffer before ``send`` waits (a frame is written in
    #: 1 MiB slices, so a small value costs nothing in throughput).
    write_high_water: int = 1 << 20
    #: Threads that seal and open large frames (the AEAD releases the GIL, so this
    #: overlaps crypto with socket I/O); 0 does all crypto on the event loop.
    crypto_threads: int = 2
    #: Frames at least this large go to the crypto threads.
    offload_bytes: int = 256 << 10
    #: Inbound frames decrypting at once per connection before reading pauses.
    crypto_inflight: int = 4
    #: Inbound messages queued before reading pauses (standalone :class:`DirectTransport`).
    inbox_depth: int = 256
    #: Payload bytes queued in all, and from one peer, before that reading pauses
    #: (standalone :class:`DirectTransport`): a flooding peer stalls only itself.
    inbox_bytes: int = 128 << 20
    inbox_peer_bytes: int = 32 << 20
    #: Peer events queued (standalone :class:`DirectTransport`).
    event_depth: int = 1024
    scores: ScoreConfig = field(default_factory=ScoreConfig)


def _retire(task: asyncio.Task[None]) -> None:
    """Mark a send task's outcome as seen (its caller may have been cancelled)."""
    if not task.cancelled():
        task.exception()


def _sealed_frame(session: Session, payload: bytes | memoryview) -> bytearray:
    size = len(payload) + TAG_LEN
    header = encode_header(size)
    out = bytearray(4 + size)
    out[:4] = header
    session.seal_into(header, payload, memoryview(out)[4:])
    return out


class _Charge:
    """One connection's share of the plane's byte budget (all given back on close)."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0
        self.closed = False

    def take(self, n: int) -> bool:
        if self.closed or not self.budget.try_take(n):
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        n = min(n, self.held)
        if n > 0:
            self.held -= n
            self.budget.give(n)

    def close(self) -> None:
        self.closed = True
        self.give(self.held)


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection, client or server side; driven by asyncio callbacks."""

    def __init__(self, plane: DataPlane, client: ClientHandshake | None, *,
                 refuse: str = "") -> None:
        self.plane = plane
        self.refuse = refuse
        self._hello_done = False
        self._awaiting_welcome = False
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.server = None if client else ServerHandshake(plane.identity,
                                                          ciphers=plane.config.ciphers)
        self.charge = _Charge(plane.budget)
        # Handshake frames (at most 1 KiB) are outside the budget: waiting for it must
        # never hold up a login.
        self.reader = FrameReader(MAX_HANDSHAKE_BYTES, scratch=_HANDSHAKE_SCRATCH, hold=True)
        #: The remote address of an inbound connection ("" for dialed ones).
        self.ip = ""
        self._budget_wait = False
        self.session: Session | None = None
        self.peer_id: str | None = client.expected_peer_id if client else None
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[str] = self.loop.create_future()
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.registered = False
        self.closing = False
        #: Kept open but not chosen for sends while another connection to the peer is
        #: (a relayed circuit once a hole punch replaced it).
        self.standby = False
        self.reason = ""
        self._write_ok = asyncio.Event()
        self._write_ok.set()
        # Outbound frames: nonces and write turns are handed out in the same order.
        self._next_ticket = 0
        self._turn = 0
        self._turn_changed = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        # Inbound frames being decrypted (futures) or decrypted (bytes), in order.
        self._decrypting: deque[asyncio.Future[bytes] | bytes] = deque()
        self._inbox_blocked = False
        self._reading_paused = False
        self._last_progress = self.loop.time()
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.refuse:
            self.reason = self.refuse
            self.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=self.plane.config.write_high_water)
        if self.client is None:
            peer = transport.get_extra_info("peername")
            self.ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            refusal = self.plane._inbound(self)
            if refusal:
                self.reason = refusal
                logger.info("data-plane connection from %s refused: %s", self.ip, refusal)
                self.abort()
                return
        self.plane._conns_all.add(self)
        self._timer = self.loop.call_later(self.plane.config.handshake_timeout,
                                           self._handshake_expired)
        if self.client is not None:
            transport.write(encode_frame(self.client.hello()))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._last_progress = self.loop.time()
        try:
            self.reader.advance(nbytes)
        except DecodeError as exc:
            self.fail(f"protocol violation: {exc}")
            return
        self._process()

    def eof_received(self) -> bool:
        if self.reader.mid_frame:
            self.reason = self.reason or "peer closed mid-frame"
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.closing = True
        self._write_ok.set()
        self._wake_writers()
        for item in self._decrypting:
            if isinstance(item, asyncio.Future) and item.done() and not item.cancelled():
                item.exception()
        self._decrypting.clear()
        if self._budget_wait:
            self._budget_wait = False
            self.plane.budget.cancel(self._on_grant, self.ip)
        self.charge.close()
        reason = self.reason or (f"connection lost: {exc}" if exc else "closed by peer")
        if not self.ready.done():
            self.ready.set_exception(PeerUnreachable(f"data-plane handshake failed: {reason}"))
            self.ready.exception()  # retrieved here; the dialer gets it too if it awaits
        self.plane._on_lost(self, reason)
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self._write_ok.clear()

    def resume_writing(self) -> None:
        self._write_ok.set()

    # -- frames ----------------------------------------------------------------------
    def _process(self) -> None:
        limit = self.plane.config.crypto_inflight
        while not self.closing and not self._inbox_blocked and len(self._decrypting) < limit:
            item = self.reader.next_frame_with_header()
            if item is None:
                break
            header, body = item
            size = len(body)
            offloaded = False
            try:
                if self.session is None:
                    self._handshake(body)
                    self.reader.resume()  # bytes after it, under the updated bound
                elif self._awaiting_welcome:
                    if self.session.open(header, body):
                        raise HandshakeError("the server's first frame was not a welcome")
                    self._admit_or_refuse()
                else:
                    offloaded = self._decrypt(self.session, header, body)
            except PeerIdMismatch as exc:
                self.fail(str(exc), penalize=False, error=exc)
            except RemoteProtocolError as exc:
                self.fail(f"protocol violation: {exc}")
            finally:
                if not offloaded:
                    self.charge.give(size)
        self._flush()
        self._update_reading()
        if not self.closing and self.reader.mid_frame and self._timer is None:
            self._timer = self.loop.call_later(self.plane.config.stall_timeout,
                                               self._check_stall)

    def _decrypt(self, session: Session, header: bytes, body: bytearray) -> bool:
        """Open one frame now, or hand it to the crypto threads (True: its budget is
        given back when they are done)."""
        nonce = session.reserve_recv()
        pool = self.plane._pool
        if pool is not None and len(body) >= self.plane.config.offload_bytes:
            fut = self.loop.run_in_executor(pool, session.open_with, nonce, header, body)
            size = len(body)
            fut.add_done_callback(lambda _f: self.charge.give(size))
            fut.add_done_callback(self._on_decrypted)
            self._decrypting.append(fut)
            return True
        if self._decrypting:
            self._decrypting.append(session.open_with(nonce, header, body))
        else:
            self._deliver(session.open_with(nonce, header, body))
        return False

    def _on_decrypted(self, fut: asyncio.Future[bytes]) -> None:
        if self.closing:
            if not fut.cancelled():
                fut.exception()  # retrieved: the connection is gone
            return
        self._process()

    def _flush(self) -> None:
        """Deliver decrypted frames in order, up to the first still being decrypted."""
        while self._decrypting and not self._inbox_blocked and not self.closing:
            head = self._decrypting[0]
            if isinstance(head, asyncio.Future) and not head.done():
                return
            self._decrypting.popleft()
            if isinstance(head, bytes):
                self._deliver(head)
                continue
            try:
                payload = head.result()
            except DecodeError as exc:
                self.fail(f"protocol violation: {exc}")
                return
            self._deliver(payload)

    def _deliver(self, payload: bytes) -> None:
        assert self.peer_id is not None
        if not self.plane.inbox.offer(Message(self.peer_id, payload)):
            self._inbox_blocked = True
            self.plane.inbox.when_space(self._on_space, self.peer_id)

    def _on_space(self) -> None:
        self._inbox_blocked = False
        if not self.closing:
            self._process()

    def _update_reading(self) -> None:
        """Pause reading while the inbox is full, enough frames are being decrypted, or
        the next frame waits for the byte budget."""
        if self.transport is None or self.closing:
            return
        if self.reader.blocked and not self._budget_wait:
            self._budget_wait = True
            self.plane.budget.wait(self.reader.blocked, self._on_grant, self.ip)
        blocked = self._inbox_blocked or self._budget_wait or \
            len(self._decrypting) >= self.plane.config.crypto_inflight
        if blocked and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        elif not blocked and self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    def _on_grant(self, n: int) -> None:
        """The byte budget reserved the frame the reader waits on."""
        if self.closing or not self._budget_wait:
            self.plane.budget.give(n)
            return
        self._budget_wait = False
        self.charge.held += n
        self.reader.grant(n)
        try:
            self.reader.resume()
        except DecodeError as exc:
            self.fail(f"protocol violation: {exc}")
            return
        self._process()

    def _handshake(self, body: bytearray) -> None:
        assert self.transport is not None
        if self.client is not None:
            result = self.client.receive_server(body)
            self.transport.write(encode_frame(result.auth))
            self._established(result.session)
        else:
            assert self.server is not None
            if not self._hello_done:
                self.transport.write(encode_frame(self.server.receive_hello(body)))
                self._hello_done = True
            else:
                self._established(self.server.receive_auth(body))

    def _established(self, session: Session) -> None:
        self.session = session
        self.peer_id = session.peer_id
        self.reader.max_frame = self.plane.config.max_message_bytes + TAG_LEN
        self.reader.hold = False
        self.reader.set_scratch(_SCRATCH)
        self.reader.allowance = self.charge
        self.plane._authenticated(self)
        if self.client is not None:
            # The dial succeeds only once the server admits us: its first frame is an
            # empty sealed "welcome" (a refusal is a close), so ``connect`` can tell.
            self._awaiting_welcome = True
            return
        if self._admit_or_refuse():
            assert self.transport is not None
            self.transport.write(_sealed_frame(session, b""))

    def _admit_or_refuse(self) -> bool:
        assert self.session is not None
        self._awaiting_welcome = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        refusal = self.plane._admit(self)
        if refusal:
            self.fail(refusal, penalize=False,
                      error=PeerUnreachable(f"{self.peer_id}: {refusal}"))
            return False
        if not self.ready.done():
            self.ready.set_result(self.session.peer_id)
        return True

    # -- timers ----------------------------------------------------------------------
    def _handshake_expired(self) -> None:
        self._timer = None
        if self.session is None:
            self.fail("handshake timed out")

    def _check_stall(self) -> None:
        self._timer = None
        if self.closing or not self.reader.mid_frame or self._reading_paused:
            return
        idle = self.loop.time() - self._last_progress
        if idle >= self.plane.config.stall_timeout:
            self.fail(f"stalled mid-frame for {idle:.1f} s")
        else:
            self._timer = self.loop.call_later(self.plane.config.stall_timeout - idle,
                                               self._check_stall)

    # -- actions ---------------------------------------------------------------------
    def fail(self, reason: str, *, penalize: bool = True, error: Exception | None = None
             ) -> None:
        """Drop the connection at once; score the peer down when ``penalize``.

        A dial still waiting on this connection fails with ``error`` when given.
        """
        if self.closing:
            return
        self.reason = reason
        if error is not None and not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()
        logger.info("data-plane connection to %s dropped: %s", self.peer_id or "?", reason)
        if penalize and self.peer_id is not None:
            self.plane.scores.penalize(self.peer_id, reason)
        self.abort()

    def abort(self) -> None:
        self.closing = True
        self._write_ok.set()
        self._wake_writers()
        if self.transport is not None:
            self.transport.abort()

    async def send(self, payload: bytes | memoryview) -> None:
        """Seal and write one frame; waits while the socket's buffer is full.

        Cancelling the caller is safe: once a frame has its nonce it is completed by a
        task the connection owns (and awaits or cancels on close).
        """
        while not self._write_ok.is_set() and not self.closing:
            await self._write_ok.wait()
        if self.closing or self.session is None or self.transport is None:
            raise PeerUnreachable(f"connection to {self.peer_id} is closed")
        task = self.loop.create_task(self._seal_and_write(self.session, payload))
        self._inflight.add(task)
        task.add_done_callback(_retire)
        task.add_done_callback(self._inflight.discard)
        await asyncio.shield(task)

    async def _seal_and_write(self, session: Session, payload: bytes | memoryview) -> None:
        nonce = session.reserve_send()  # tasks start in creation order: nonces in order
        ticket = self._next_ticket
        self._next_ticket += 1
        try:
            size = len(payload) + TAG_LEN
            header = encode_header(size)
            out = bytearray(4 + size)
            out[:4] = header
            body = memoryview(out)[4:]
            pool = self.plane._pool
            if pool is not None and len(payload) >= self.plane.config.offload_bytes:
                await self.loop.run_in_executor(pool, session.seal_with, nonce, header,
                                                payload, body)
            else:
                session.seal_with(nonce, header, payload, body)
            while self._turn != ticket:
                if self.closing:
                    raise PeerUnreachable(f"connection to {self.peer_id} closed")
                await self._turn_changed.wait()
            # Large frames go out in slices, waiting for the socket between them: asyncio
            # copies whatever a write cannot send at once into its buffer and compacts
            # that buffer on every send, so small backlogs are much cheaper than big ones.
            view = memoryview(out)
            for start in range(0, len(out), _WRITE_SLICE):
                while not self._write_ok.is_set() and not self.closing:
                    await self._write_ok.wait()
                if self.closing or self.transport is None:
                    raise PeerUnreachable(f"connection to {self.peer_id} closed mid-frame")
                self.transport.write(view[start:start + _WRITE_SLICE])
        except BaseException:
            if not self.closing:
                self.fail("a frame could not be completed", penalize=False)
            raise
        finally:
            if self._turn == ticket:
                self._advance_turn()

    def _advance_turn(self) -> None:
        self._turn += 1
        self._wake_writers()

    def _wake_writers(self) -> None:
        event, self._turn_changed = self._turn_changed, asyncio.Event()
        event.set()

    @property
    def write_backlog(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport else 0


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
        self._conns_all: set[_Connection] = set()
        self._peers: dict[str, list[_Connection]] = {}
        self._closed = False
        self._address: tuple[str, int] | None = None
        self._pool: ThreadPoolExecutor | None = None
        if config.buffer_budget < config.max_message_bytes + TAG_LEN:
            raise ValueError("buffer_budget must hold at least one largest frame "
                             f"({config.max_message_bytes + TAG_LEN} bytes)")
        self.budget = ByteBudget(config.buffer_budget)
        #: Inbound handshakes not done yet, per remote address, oldest first.
        self._pending: dict[str, dict[_Connection, None]] = {}
        self._pending_count = 0
        #: Inbound connections per remote address.
        self._per_ip: dict[str, int] = {}
        #: Evicted connections whose close is under way (not counted any more).
        self._evicted: set[_Connection] = set()

    async def __aenter__(self) -> Self:
        if self.config.crypto_threads > 0:
            self._pool = ThreadPoolExecutor(self.config.crypto_threads,
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
        conns = list(self._conns_all)
        for conn in conns:
            conn.reason = conn.reason or "closed"
            conn.abort()
        for conn in conns:
            with contextlib.suppress(asyncio.CancelledError):
                await conn.lost
            for task in list(conn._inflight):
                with contextlib.suppress(BaseException):
                    await task
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) this plane listens on, or None."""
        return self._address

    def _accept(self) -> _Connection:
        refuse = ""
        if self._closed:
            refuse = "closing"
        elif len(self._conns_all) >= self.config.max_connections:
            refuse = "over max_connections"
        return _Connection(self, None, refuse=refuse)

    def _inbound(self, conn: _Connection) -> str:
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
        if len(self._conns_all) - len(self._evicted) >= cfg.max_connections:
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

    def _unpend(self, conn: _Connection) -> None:
        pending = self._pending.get(conn.ip)
        if pending is not None and conn in pending:
            del pending[conn]
            self._pending_count -= 1
            if not pending:
                del self._pending[conn.ip]

    def _authenticated(self, conn: _Connection) -> None:
        """An inbound handshake finished: it no longer counts as pending."""
        self._unpend(conn)

    def _admit(self, conn: _Connection) -> str:
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

    def _on_lost(self, conn: _Connection, reason: str) -> None:
        if conn in self._conns_all:
            self._conns_all.discard(conn)
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
        if len(self._conns_all) >= self.config.max_connections:
            raise PeerUnreachable("over max_connections")
        loop = asyncio.get_running_loop()
        hs = ClientHandshake(self.identity, expected_peer_id=expected,
                             ciphers=self.config.ciphers)
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                _, proto = await loop.create_connection(
                    lambda: _Connection(self, hs), host, port)
                conn = proto
                return await asyncio.shield(conn.ready)
        except TimeoutError as exc:
            raise PeerUnreachable(f"data plane {host}:{port}: handshake timed out") from exc
        except OSError as exc:
            raise PeerUnreachable(f"data plane {host}:{port}: {exc}") from exc
        finally:
            if conn is not None and not (conn.ready.done() and not conn.ready.exception()):
                conn.abort()

    async def adopt(self, sock: socket.socket, expected_peer_id: str | None) -> _Connection:
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
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                if expected_peer_id is not None:
                    if len(self._conns_all) >= self.config.max_connections:
                        raise PeerUnreachable("over max_connections")
                    hs = ClientHandshake(self.identity, expected_peer_id=expected_peer_id,
                                         ciphers=self.config.ciphers)
                    _, conn = await loop.create_connection(lambda: _Connection(self, hs),
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
