"""NAT traversal of a node's data plane: relay reservations, relayed dials, hole punches.

A node the dial-back check found :data:`~swarm.net.reach.PRIVATE` asks its bootstrap
nodes for their metadata; one that runs a relay (``relay`` in its metadata) gets a
reservation (:func:`swarm.net.relay.reserve`), kept and renewed while the node runs,
and the node advertises the circuit address
``/ip4/R/tcp/P/p2p/<relay>/p2p-circuit/p2p/<self>`` instead of none.

Connecting to a circuit address opens a circuit through the relay and runs the
data-plane handshake over it as the client (the relay cannot forge it). Only a private
node dials circuits: a public one is dialled by the private peer itself (connection
reversal), which costs the relay nothing. Both ends of a new circuit then try a TCP
hole punch (:mod:`swarm.net.punch`) from the circuit's local ports; when a direct
connection opens and its handshake passes, the relayed one is put on standby (no new
sends) and closed ``standby_grace`` seconds later. What was tried and what worked is in
:attr:`Traversal.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.errors import DecodeError
from swarm.identity import Identity
from swarm.net.punch import punch
from swarm.net.relay import RelayRefused, circuit, reserve, sock_read_msg
from swarm.net.relay_msgs import Msg, circuit_address, parse_circuit, split_hostport
from swarm.net.transport import PeerIdMismatch, PeerUnreachable

if TYPE_CHECKING:
    from swarm.net.connection import Connection
    from swarm.net.dataplane import DataPlane
    from swarm.net.topics import PeerMetadata

logger = logging.getLogger(__name__)

_UNSPECIFIED = frozenset({"", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True, slots=True)
class TraversalConfig:
    """How a private node uses relays and hole punching."""

    #: Reserve on a bootstrap node's relay when private, and dial circuit addresses.
    relay: bool = True
    #: Try a hole punch on each new circuit.
    punch: bool = True
    #: Seconds a hole punch may take.
    punch_deadline: float = 4.0
    #: Seconds a relayed connection stays open (unused) after a punch replaced it.
    standby_grace: float = 10.0
    #: Seconds for a relay connection's preamble.
    timeout: float = 5.0
    #: Circuits being accepted at once (more incoming notices wait).
    max_accepting: int = 8
    #: Seconds before a lost reservation is renewed (doubling up to 30).
    retry: float = 1.0


@dataclass(slots=True)
class TraversalStats:
    reservations: int = 0
    relayed_out: int = 0
    relayed_in: int = 0
    punch_attempts: int = 0
    punch_ok: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, what: str) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"reservations": self.reservations, "relayed_out": self.relayed_out,
                "relayed_in": self.relayed_in, "punch_attempts": self.punch_attempts,
                "punch_ok": self.punch_ok, "failures": dict(self.failures)}


def relay_of(meta: PeerMetadata, dialed_host: str) -> tuple[str, int] | None:
    """The relay service a node's metadata names (its host as dialled when it listens on
    every interface), or None."""
    if not meta.relay:
        return None
    try:
        host, port = split_hostport(meta.relay)
    except DecodeError:
        return None
    return (dialed_host if host in _UNSPECIFIED else host), port


class Traversal:
    """A node's reservations and circuits; the node spawns and cancels its tasks."""

    def __init__(self, identity: Identity, config: TraversalConfig,
                 plane: Callable[[], DataPlane | None],
                 spawn: Callable[[Any, str], None], on_change: Callable[[], None]) -> None:
        self.identity = identity
        self.config = config
        self._plane = plane
        self._spawn = spawn
        self._on_change = on_change
        self.stats = TraversalStats()
        self.private = False
        #: Live reservations: relay peer id -> (host, port).
        self._live: dict[str, tuple[str, int]] = {}
        self._accepting = asyncio.Semaphore(config.max_accepting)

    def addresses(self) -> tuple[str, ...]:
        return tuple(circuit_address(h, p, r, self.identity.peer_id)
                     for r, (h, p) in sorted(self._live.items()))

    async def start(self, bootstraps: list[tuple[str, str]],
                    fetch_meta: Callable[[str], Awaitable[PeerMetadata]]) -> None:
        """Private now: reserve on the relays of the ``(peer id, dialled host)``
        bootstrap nodes that run one."""
        self.private = True
        if not self.config.relay or self._plane() is None:
            return
        for peer, host in bootstraps:
            try:
                meta = await fetch_meta(peer)
            except Exception as exc:  # an older node, a time-out
                logger.info("no metadata from bootstrap %s: %r", peer, exc)
                continue
            where = relay_of(meta, host)
            if where is None:
                continue
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._spawn(self._keep_reservation(peer, where, ready), f"relay reservation {peer}")
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.config.timeout * 2):
                    await asyncio.shield(ready)

    async def _keep_reservation(self, relay: str, where: tuple[str, int],
                                ready: asyncio.Future[None]) -> None:
        delay = self.config.retry
        while True:
            sock: socket.socket | None = None
            try:
                sock, seen = await reserve(self.identity, *where, self.config.timeout)
                logger.info("reserved on relay %s at %s:%d (seen as %s)", relay, *where, seen)
                self._live[relay] = where
                self.stats.reservations += 1
                self._on_change()
                if not ready.done():
                    ready.set_result(None)
                delay = self.config.retry
                while True:
                    msg = await sock_read_msg(sock, "incoming")
                    self._spawn(self._accept(where, msg.id), "relay accept")
            except (OSError, TimeoutError, RelayRefused, DecodeError, ConnectionError) as exc:
                logger.info("relay reservation on %s: %r; again in %.0f s", relay, exc, delay)
                self.stats.fail("reservation")
            finally:
                if sock is not None:
                    sock.close()
                if self._live.pop(relay, None) is not None:
                    self._on_change()
            if not ready.done():
                ready.set_result(None)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def _accept(self, where: tuple[str, int], cid: bytes) -> None:
        plane = self._plane()
        if plane is None:
            return
        async with self._accepting:
            try:
                sock, seen = await circuit(*where, Msg("accept", id=cid), self.config.timeout)
            except (OSError, TimeoutError, RelayRefused, DecodeError, ConnectionError) as exc:
                logger.info("accepting a circuit: %r", exc)
                self.stats.fail("accept")
                return
            local = sock.getsockname()
            try:
                relayed = await plane.adopt(sock, None)
            except PeerUnreachable as exc:
                logger.info("relayed handshake (accepting): %s", exc)
                self.stats.fail("relayed handshake")
                return
        self.stats.relayed_in += 1
        logger.info("relayed circuit from %s", relayed.peer_id)
        if self.config.punch:
            await self._punch(plane, relayed, local, seen, client=False)

    async def connect(self, address: str) -> str:
        """Connect to a circuit address through its relay (then try a hole punch).

        :raises PeerUnreachable: not a private node, the relay refused, or it failed.
        :raises PeerIdMismatch: the circuit's far end proved another key.
        """
        target = parse_circuit(address)
        plane = self._plane()
        if target is None:
            raise PeerUnreachable(f"{address!r} is not a circuit address")
        if plane is None or not self.config.relay:
            raise PeerUnreachable("no data plane, or relays are off")
        if not self.private:
            raise PeerUnreachable(f"{target.peer_id} is behind a NAT and dials public "
                                  "peers itself")
        try:
            sock, seen = await circuit(target.relay_host, target.relay_port,
                                       Msg("connect", to=target.peer_id), self.config.timeout)
        except (OSError, TimeoutError, RelayRefused, DecodeError, ConnectionError) as exc:
            self.stats.fail("connect")
            raise PeerUnreachable(f"relay {target.relay_host}:{target.relay_port} to "
                                  f"{target.peer_id}: {exc!r}") from exc
        local = sock.getsockname()
        try:
            relayed = await plane.adopt(sock, target.peer_id)
        except PeerIdMismatch:
            raise
        except PeerUnreachable:
            self.stats.fail("relayed handshake")
            raise
        self.stats.relayed_out += 1
        logger.info("relayed circuit to %s via %s:%d", target.peer_id, target.relay_host,
                    target.relay_port)
        if self.config.punch:
            self._spawn(self._punch(plane, relayed, local, seen, client=True), "hole punch")
        return target.peer_id

    async def _punch(self, plane: DataPlane, relayed: Connection, local: tuple[str, int],
                     seen: str, *, client: bool) -> None:
        try:
            remote = split_hostport(seen)
        except DecodeError:
            return
        self.stats.punch_attempts += 1
        sock = await punch((local[0], local[1]), remote, self.config.punch_deadline)
        if sock is None:
            logger.info("hole punch to %s (%s) failed; staying relayed", relayed.peer_id, seen)
            self.stats.fail("punch")
            return
        try:
            direct = await plane.adopt(sock, relayed.peer_id if client else None)
        except PeerUnreachable as exc:
            logger.info("handshake on the punched connection to %s: %s", relayed.peer_id, exc)
            self.stats.fail("punched handshake")
            return
        if direct.peer_id != relayed.peer_id:
            direct.fail("a punched connection proved another peer")
            self.stats.fail("punched peer")
            return
        self.stats.punch_ok += 1
        relayed.standby = True
        logger.info("hole punched to %s; the relayed circuit closes in %.0f s",
                    relayed.peer_id, self.config.standby_grace)
        await asyncio.sleep(self.config.standby_grace)
        relayed.reason = "replaced by a punched connection"
        relayed.abort()
