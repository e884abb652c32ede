"""A relay for peers that nobody can dial: it splices two TCP connections.

Why not libp2p's circuit relay v2 (py-libp2p 0.8.1, ``libp2p/relay/circuit_v2``): it
relays *libp2p* connections (a Noise + Yamux connection inside a stream of another
one), and the chunk bytes of this project do not travel on libp2p but on the data plane
(:mod:`swarm.net.dataplane`), its own TCP connections with their own handshake. It also
has to be wired into the host as a transport and listener, which the host of
:mod:`swarm.net.libp2p_compat` does not do. So the relay is ours, and carries data-plane
connections: a peer ``B`` behind a NAT keeps a *reservation* (a TCP connection it
dialled) on a public node running :class:`RelayServer`; a peer ``A`` that wants ``B``
opens a TCP connection to the relay naming ``B``; the relay tells ``B``, which opens a
second connection (``accept``); the relay then copies bytes between ``A``'s and ``B``'s
connections. ``A`` and ``B`` run the data-plane handshake end to end over it (``A`` is
the client, expecting ``B``'s peer id), so the relay sees only sealed frames: it can
drop or cut a circuit, never forge or read one. Messages are in
:mod:`swarm.net.relay_msgs`.

Every resource a relay spends is bounded (:class:`RelayConfig`): reservations,
circuits (in all and per reserved peer), connections still in their preamble (and
how long they may take), bytes per circuit, the relayed rate over all circuits (a
token bucket; circuits wait on it, so the relay's uplink is shared, not flooded), a
circuit's idle time and lifetime. Relayed bytes are counted (:attr:`RelayServer.stats`).

The relay also tells each end the address it sees the other end's connection come
from (``seen``), which is what TCP hole punching (:mod:`swarm.net.punch`) needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from swarm.errors import DecodeError
from swarm.identity import Identity
from swarm.net.relay_msgs import CIRCUIT_ID_LEN, DOMAIN, MAX_MSG_BYTES, NONCE_LEN, Msg, decode
from swarm.wire.frames import HEADER, encode_frame

logger = logging.getLogger(__name__)

_COPY = 64 << 10


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Limits of a :class:`RelayServer` (the ``--relay`` options of the CLI)."""

    #: Interface and port of the relay service (port 0: any free port).
    host: str = "127.0.0.1"
    port: int = 0
    #: Peers holding a reservation at once.
    max_reservations: int = 64
    #: Circuits open at once, and to one reserved peer.
    max_circuits: int = 16
    max_circuits_per_peer: int = 4
    #: Bytes one circuit may carry (both directions together); then it is closed.
    circuit_bytes: int = 256 << 20
    #: Relayed bytes per second over all circuits (a token bucket of one second).
    rate: float = 4e6
    #: Connections still in their preamble (hello, reserve/connect/accept), and seconds
    #: each may take, including a connect waiting for the reserved peer's accept.
    max_pending: int = 64
    preamble_timeout: float = 5.0
    #: Seconds a circuit may carry nothing in either direction, and live in all.
    idle_timeout: float = 60.0
    max_circuit_seconds: float = 3600.0


@dataclass(slots=True)
class RelayStats:
    """What a relay has spent (cumulative, but ``circuits_open``/``reservations``)."""

    relayed_bytes: int = 0
    circuits: int = 0
    circuits_open: int = 0
    reservations: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    #: Relayed bytes per reserved peer id (the end the relay authenticated).
    by_peer: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def as_dict(self) -> dict[str, object]:
        return {"relayed_bytes": self.relayed_bytes, "circuits": self.circuits,
                "circuits_open": self.circuits_open, "reservations": self.reservations,
                "refused": dict(self.refused), "by_peer": dict(self.by_peer)}


class TokenBucket:
    """``rate`` bytes per second, at most one second's worth banked; time is injected."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError("a relay rate must be positive")
        self.rate = rate
        self.clock = clock
        self._tokens = rate
        self._at = clock()

    def delay(self, n: int) -> float:
        """Take ``n`` bytes; returns how long to wait before sending them (0: now)."""
        now = self.clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class RelayRefused(ConnectionError):
    """The relay refused or failed the request (its reason in the message)."""


# -- the relay ---------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class _Reservation:
    peer: str
    writer: asyncio.StreamWriter
    circuits: int = 0


@dataclass(eq=False, slots=True)
class _Waiting:
    target: str
    seen: str
    ready: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter, str]]


async def _read_msg(reader: asyncio.StreamReader, *expected: str) -> Msg:
    header = await reader.readexactly(HEADER.size)
    (n,) = HEADER.unpack(header)
    if n > MAX_MSG_BYTES:
        raise DecodeError(f"relay: a {n}-byte message (bound {MAX_MSG_BYTES})")
    return decode(await reader.readexactly(n), *expected)


def _peer_addr(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return ""


class RelayServer:
    """The relay service; an async context manager owning its socket and circuits."""

    def __init__(self, identity: Identity, config: RelayConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = identity
        self.config = config
        self.stats = RelayStats()
        self._bucket = TokenBucket(config.rate, clock)
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._reservations: dict[str, _Reservation] = {}
        self._waiting: dict[bytes, _Waiting] = {}
        self._pending = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int] | None:
        return self._address

    @property
    def hostport(self) -> str:
        """``host:port`` of the service, as advertised in the metadata ("" before start)."""
        return "" if self._address is None else f"{self._address[0]}:{self._address[1]}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.config.host,
                                                  self.config.port, reuse_address=True)
        name = self._server.sockets[0].getsockname()
        self._address = (str(name[0]), int(name[1]))
        logger.info("relay listening on %s:%d", *self._address)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= self.config.max_pending:
            self.stats.refuse("too many pending")
            writer.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer),
                                                      name="relay connection")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        spliced = False
        self._pending += 1
        pending = True
        try:
            nonce = os.urandom(NONCE_LEN)
            writer.write(encode_frame(Msg("relay", nonce=nonce).encode()))
            async with asyncio.timeout(self.config.preamble_timeout):
                first = await _read_msg(reader, "reserve", "connect", "accept")
            if first.t == "reserve":
                first.check_reservation(nonce)
                self._pending -= 1
                pending = False
                await self._hold_reservation(first.peer_id, reader, writer)
            elif first.t == "connect":
                async with asyncio.timeout(self.config.preamble_timeout):
                    other = await self._open_circuit(first.to, writer)
                self._pending -= 1
                pending = False
                spliced = True
                await self._splice(first.to, (reader, writer), other)
            elif first.t == "accept":
                waiting = self._waiting.pop(first.id, None)
                if waiting is None:
                    raise RelayRefused("no such circuit")
                if not waiting.ready.done():
                    waiting.ready.set_result((reader, writer, _peer_addr(writer)))
                    spliced = True  # the connecting side's task owns the circuit now
                    writer.write(encode_frame(Msg("ok", seen=waiting.seen).encode()))
                    pending = False
                    self._pending -= 1
        except (RelayRefused, DecodeError) as exc:
            self.stats.refuse(str(exc)[:40])
            logger.info("relay: refused %s: %s", _peer_addr(writer), exc)
            with contextlib.suppress(Exception):
                writer.write(encode_frame(Msg("error", reason=str(exc)).encode()))
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("relay: connection from %s ended: %r", _peer_addr(writer), exc)
        finally:
            if pending:
                self._pending -= 1
            if not spliced:
                with contextlib.suppress(Exception):
                    writer.close()

    async def _hold_reservation(self, peer: str, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        old = self._reservations.get(peer)
        if old is None and len(self._reservations) >= self.config.max_reservations:
            raise RelayRefused("too many reservations")
        if old is not None:
            old.writer.transport.abort()  # the peer reconnected: the newer one wins
        mine = _Reservation(peer, writer)
        self._reservations[peer] = mine
        self.stats.reservations = len(self._reservations)
        logger.info("relay: %s reserved (from %s)", peer, _peer_addr(writer))
        try:
            writer.write(encode_frame(Msg("ok", seen=_peer_addr(writer)).encode()))
            # Nothing more is expected from the peer: any byte ends the reservation.
            await reader.read(1)
        finally:
            if self._reservations.get(peer) is mine:
                del self._reservations[peer]
            self.stats.reservations = len(self._reservations)

    async def _open_circuit(self, target: str, writer: asyncio.StreamWriter
                            ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        cfg = self.config
        res = self._reservations.get(target)
        if res is None:
            raise RelayRefused("no reservation for that peer")
        if self.stats.circuits_open + len(self._waiting) >= cfg.max_circuits:
            raise RelayRefused("too many circuits")
        if res.circuits >= cfg.max_circuits_per_peer:
            raise RelayRefused("too many circuits to that peer")
        cid = os.urandom(CIRCUIT_ID_LEN)
        fut: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter, str]] = \
            asyncio.get_running_loop().create_future()
        self._waiting[cid] = _Waiting(target, _peer_addr(writer), fut)
        try:
            res.writer.write(encode_frame(Msg("incoming", id=cid).encode()))
            other = await fut
        finally:
            self._waiting.pop(cid, None)
        writer.write(encode_frame(Msg("ok", seen=other[2]).encode()))
        return other

    async def _splice(self, target: str,
                      a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                      b: tuple[asyncio.StreamReader, asyncio.StreamWriter, str]) -> None:
        cfg = self.config
        res = self._reservations.get(target)
        if res is not None:
            res.circuits += 1
        self.stats.circuits += 1
        self.stats.circuits_open += 1
        carried = [0]
        last = [asyncio.get_running_loop().time()]
        why = "closed"

        async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                data = await reader.read(_COPY)
                if not data:
                    return
                carried[0] += len(data)
                if carried[0] > cfg.circuit_bytes:
                    raise RelayRefused("circuit byte limit")
                wait = self._bucket.delay(len(data))
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                last[0] = asyncio.get_running_loop().time()
                self.stats.relayed_bytes += len(data)
                self.stats.by_peer[target] = self.stats.by_peer.get(target, 0) + len(data)

        async def watchdog() -> None:
            loop = asyncio.get_running_loop()
            born = loop.time()
            while True:
                await asyncio.sleep(min(1.0, cfg.idle_timeout))
                if loop.time() - last[0] > cfg.idle_timeout:
                    raise RelayRefused("circuit idle")
                if loop.time() - born > cfg.max_circuit_seconds:
                    raise RelayRefused("circuit lifetime")

        try:
            async with asyncio.TaskGroup() as tg:
                ta = tg.create_task(copy(a[0], b[1]))
                tb = tg.create_task(copy(b[0], a[1]))
                tw = tg.create_task(watchdog())
                await asyncio.wait({ta, tb}, return_when=asyncio.FIRST_COMPLETED)
                for t in (ta, tb, tw):
                    t.cancel()
        except* RelayRefused as group:
            why = str(group.exceptions[0])
            self.stats.refuse(why)
        except* (OSError, asyncio.IncompleteReadError):
            why = "connection lost"
        finally:
            self.stats.circuits_open -= 1
            if res is not None:
                res.circuits -= 1
            for w in (a[1], b[1]):
                w.transport.abort()
            logger.info("relay: circuit to %s ended (%s) after %d bytes", target, why,
                        carried[0])


# -- the client side (raw sockets: the data plane adopts them) ---------------------------
def reusable_socket(family: int = socket.AF_INET) -> socket.socket:
    """A non-blocking TCP socket with SO_REUSEADDR and SO_REUSEPORT, so that a hole punch
    can later connect from the same local port (:mod:`swarm.net.punch`)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


async def _sock_read_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < n:
        data = await loop.sock_recv(sock, n - len(out))
        if not data:
            raise ConnectionError("the relay closed the connection")
        out += data
    return bytes(out)


async def sock_read_msg(sock: socket.socket, *expected: str) -> Msg:
    """One relay message, reading exactly its bytes (what follows is not consumed).

    :raises RelayRefused: the relay sent an ``error``.
    :raises DecodeError: malformed or unexpected.
    """
    (n,) = HEADER.unpack(await _sock_read_exactly(sock, HEADER.size))
    if n > MAX_MSG_BYTES:
        raise DecodeError(f"relay: a {n}-byte message (bound {MAX_MSG_BYTES})")
    msg = decode(await _sock_read_exactly(sock, n), *expected)
    if msg.t == "error":
        raise RelayRefused(f"relay refused: {msg.reason}")
    return msg


async def sock_send_msg(sock: socket.socket, msg: Msg) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, encode_frame(msg.encode()))


async def open_to_relay(host: str, port: int, timeout: float) -> tuple[socket.socket, bytes]:
    """A connection to the relay, and the nonce of its hello.

    :raises OSError, TimeoutError, RelayRefused, DecodeError: it failed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = reusable_socket(family)
    try:
        async with asyncio.timeout(timeout):
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
            hello = await sock_read_msg(sock, "relay")
    except BaseException:
        sock.close()
        raise
    return sock, hello.nonce


async def _preamble(host: str, port: int, first: Callable[[bytes], Msg], timeout: float
                    ) -> tuple[socket.socket, Msg]:
    """A connection to the relay that sent ``first(nonce)`` and got its ``ok``."""
    sock, nonce = await open_to_relay(host, port, timeout)
    try:
        async with asyncio.timeout(timeout):
            await sock_send_msg(sock, first(nonce))
            ok = await sock_read_msg(sock, "ok")
    except BaseException:
        sock.close()
        raise
    return sock, ok


async def reserve(identity: Identity, host: str, port: int, timeout: float
                  ) -> tuple[socket.socket, str]:
    """Hold a reservation: the control connection, and the address the relay sees."""
    sock, ok = await _preamble(
        host, port, lambda nonce: Msg("reserve", key=identity.public_key,
                                      sig=identity.sign(DOMAIN + nonce)), timeout)
    return sock, ok.seen


async def circuit(host: str, port: int, first: Msg, timeout: float
                  ) -> tuple[socket.socket, str]:
    """Open one end of a circuit (``first`` a ``connect`` or an ``accept``): the
    connection, ready to carry the data-plane handshake, and the other end's address
    as the relay sees it."""
    sock, ok = await _preamble(host, port, lambda _nonce: first, timeout)
    return sock, ok.seen
