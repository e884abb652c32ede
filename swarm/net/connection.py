"""One connection of the data plane: handshake, sealed frames, budgets, back-pressure.

A :class:`Connection` is an :class:`asyncio.BufferedProtocol` (client or server side)
that runs the handshake of :mod:`swarm.net.handshake`, then reads and writes AEAD-sealed
frames; it charges the frames it receives to its plane's byte budget and tells its plane
(a :class:`PlaneSide`: :class:`~swarm.net.dataplane.DataPlane`) when it is in, admitted,
authenticated or lost. :class:`DataPlaneConfig` holds the settings both read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from swarm.errors import DecodeError, RemoteProtocolError
from swarm.identity import Identity
from swarm.net.handshake import (
    CIPHERS,
    MAX_HANDSHAKE_BYTES,
    TAG_LEN,
    ClientHandshake,
    HandshakeError,
    ServerHandshake,
    Session,
)
from swarm.net.queues import ByteBudget, Inbox
from swarm.net.transport import Message, PeerIdMismatch, PeerUnreachable
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




class PlaneSide(Protocol):
    """What a connection needs of the plane that owns it."""

    identity: Identity
    config: DataPlaneConfig
    budget: ByteBudget
    inbox: Inbox
    scores: PeerScores
    pool: ThreadPoolExecutor | None
    """Threads for the crypto of large frames (None: on the event loop)."""
    conns_all: set[Connection]

    def inbound(self, conn: Connection) -> str:
        """Take in a new inbound connection: a refusal reason or ''."""

    def admit(self, conn: Connection) -> str:
        """An authenticated connection: a refusal reason or ''."""

    def authenticated(self, conn: Connection) -> None:
        """The handshake of ``conn`` is done."""

    def connection_lost(self, conn: Connection, reason: str) -> None:
        """``conn`` closed for ``reason``."""


class Connection(asyncio.BufferedProtocol):
    """One TCP connection, client or server side; driven by asyncio callbacks."""

    def __init__(self, plane: PlaneSide, client: ClientHandshake | None, *,
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
            refusal = self.plane.inbound(self)
            if refusal:
                self.reason = refusal
                logger.info("data-plane connection from %s refused: %s", self.ip, refusal)
                self.abort()
                return
        self.plane.conns_all.add(self)
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
        self.plane.connection_lost(self, reason)
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
        pool = self.plane.pool
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
        self.plane.authenticated(self)
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
        refusal = self.plane.admit(self)
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
            pool = self.plane.pool
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


