"""An in-memory network of :class:`~swarm.net.transport.Transport` s with shaped links.

Each directed link ``a -> b`` has a :class:`LinkProfile`: bandwidth (bytes per second;
messages are serialized one after another, so a busy link queues), one-way latency, and
loss (the probability that a whole message is dropped, drawn from a seeded RNG: the
exchange above must re-request, as over a real link that dies). ``send`` waits while
more than ``LinkProfile.queue_bytes`` are in flight on the link (backpressure), and the
receiver's inbox is bounded, so a slow consumer slows its senders.

Gossip on the memory network is delivered to every other subscribed transport (after
its validator) without shaping: it models the control plane, not the data plane.

Time is the asyncio loop's clock, so a test that wants virtual time runs this on a loop
with a virtual clock; the tests here run in real time with small figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Self

from swarm.identity import Identity
from swarm.net.queues import EventQueue, Inbox
from swarm.net.transport import (
    GossipMessage,
    Message,
    MessageTooLarge,
    Path,
    PeerEvent,
    PeerIdMismatch,
    PeerUnreachable,
    TransportClosed,
    Validator,
)
from swarm.protocol.scoring import PeerScores, ScoreConfig

if TYPE_CHECKING:
    from swarm.net.topics import PeerMetadata

logger = logging.getLogger(__name__)

ADDRESS_PREFIX = "/memory/"


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """Shape of one direction of a link."""

    #: Bytes per second; ``None`` means unlimited.
    bandwidth: float | None = None
    #: One-way delay in seconds added to every message.
    latency: float = 0.0
    #: Probability in [0, 1) that a message is dropped whole.
    loss: float = 0.0
    #: ``send`` waits while more than this many bytes are queued or in flight.
    queue_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError("bandwidth must be positive or None")
        if self.latency < 0 or not 0.0 <= self.loss < 1.0 or self.queue_bytes <= 0:
            raise ValueError("latency >= 0, 0 <= loss < 1, queue_bytes > 0")


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """Per-transport settings on the memory network."""

    #: The largest message accepted.
    max_message_bytes: int = (16 << 20) + (64 << 10)
    #: Inbound messages queued before senders wait.
    inbox_depth: int = 256
    #: Payload bytes queued in all, and from one peer, before delivery waits.
    inbox_bytes: int = 128 << 20
    inbox_peer_bytes: int = 32 << 20
    #: Connect/disconnect events queued; the oldest are dropped beyond this.
    event_depth: int = 1024
    #: Gossip messages queued per subscription; beyond it the newest are dropped (logged).
    gossip_depth: int = 1024
    scores: ScoreConfig = field(default_factory=ScoreConfig)


class MemoryNetwork:
    """A registry of memory transports and the profiles of the links between them."""

    def __init__(self, *, default: LinkProfile | None = None, seed: int = 0) -> None:
        self.default = default or LinkProfile()
        self._profiles: dict[tuple[str, str], LinkProfile] = {}
        self._nodes: dict[str, MemoryTransport] = {}
        self._rng = random.Random(seed)

    def set_link(self, a: str, b: str, profile: LinkProfile, *, symmetric: bool = True) -> None:
        """Shape the link from peer ``a`` to peer ``b`` (and back when ``symmetric``)."""
        self._profiles[(a, b)] = profile
        if symmetric:
            self._profiles[(b, a)] = profile

    def profile(self, a: str, b: str) -> LinkProfile:
        return self._profiles.get((a, b), self.default)

    def transport(self, identity: Identity, config: MemoryConfig | None = None
                  ) -> MemoryTransport:
        """A transport for ``identity``; it joins the network on ``async with``."""
        return MemoryTransport(self, identity, config or MemoryConfig())

    def _seed(self) -> int:
        return self._rng.getrandbits(64)

    def _register(self, node: MemoryTransport) -> None:
        if node.peer_id in self._nodes:
            raise PeerIdMismatch(f"peer {node.peer_id} is already on this memory network")
        self._nodes[node.peer_id] = node

    def _unregister(self, node: MemoryTransport) -> None:
        if self._nodes.get(node.peer_id) is node:
            del self._nodes[node.peer_id]

    def _lookup(self, peer_id: str) -> MemoryTransport | None:
        return self._nodes.get(peer_id)

    def _subscribers(self, topic: str) -> list[MemoryTransport]:
        return [n for n in self._nodes.values() if topic in n._subs]


class _Link:
    """One direction of a connection: a byte-bounded queue drained at the link's rate."""

    def __init__(self, src: MemoryTransport, dst: MemoryTransport, profile: LinkProfile,
                 seed: int) -> None:
        self.src = src
        self.dst = dst
        self.profile = profile
        self.rng = random.Random(seed)
        self.queued = 0
        self.wire: asyncio.Queue[bytes] = asyncio.Queue()  # bounded by ``queued`` bytes
        self.space = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def put(self, payload: bytes) -> None:
        size = max(len(payload), 1)
        async with self.space:
            await self.space.wait_for(
                lambda: self.queued == 0 or self.queued + size <= self.profile.queue_bytes)
            self.queued += size
        self.wire.put_nowait(payload)

    async def _release(self, size: int) -> None:
        async with self.space:
            self.queued -= size
            self.space.notify_all()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        in_flight: deque[tuple[float, bytes]] = deque()
        arrived = asyncio.Event()
        deliver_task = asyncio.create_task(self._deliver(in_flight, arrived))
        try:
            busy_until = loop.time()
            while True:
                payload = await self.wire.get()
                size = max(len(payload), 1)
                if self.profile.bandwidth is not None:
                    busy_until = max(busy_until, loop.time()) + size / self.profile.bandwidth
                    await asyncio.sleep(max(0.0, busy_until - loop.time()))
                if self.profile.loss and self.rng.random() < self.profile.loss:
                    await self._release(size)
                    continue
                in_flight.append((loop.time() + self.profile.latency, payload))
                arrived.set()
        finally:
            deliver_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await deliver_task

    async def _deliver(self, in_flight: deque[tuple[float, bytes]], arrived: asyncio.Event
                       ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not in_flight:
                arrived.clear()
                await arrived.wait()
                continue
            due, payload = in_flight[0]
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            in_flight.popleft()
            await self.dst._inbox_put(Message(self.src.peer_id, payload))
            await self._release(max(len(payload), 1))


class _MemorySubscription:
    def __init__(self, node: MemoryTransport, topic: str, validator: Validator | None) -> None:
        self.node = node
        self._topic = topic
        self.validator = validator
        self.queue: asyncio.Queue[GossipMessage | None] = asyncio.Queue(node.config.gossip_depth)
        self.closed = False

    @property
    def topic(self) -> str:
        return self._topic

    def offer(self, msg: GossipMessage) -> None:
        if self.closed:
            return
        if self.validator is not None:
            try:
                ok = self.validator(msg.source, msg.data)
            except Exception:  # a validator that raises rejects the message
                logger.exception("gossip validator for %s raised", self._topic)
                ok = False
            if not ok:
                logger.debug("gossip on %s from %s rejected", self._topic, msg.source)
                return
        try:
            self.queue.put_nowait(msg)
        except asyncio.QueueFull:
            logger.warning("gossip queue for %s full; dropping a message", self._topic)

    async def get(self) -> GossipMessage:
        if self.closed and self.queue.empty():
            raise TransportClosed("subscription closed")
        msg = await self.queue.get()
        if msg is None:
            raise TransportClosed("subscription closed")
        return msg

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.node._subs.get(self._topic, set()).discard(self)
            if not self.node._subs.get(self._topic):
                self.node._subs.pop(self._topic, None)
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class MemoryTransport:
    """A :class:`~swarm.net.transport.Transport` and :class:`~swarm.net.transport.Gossip`
    on a :class:`MemoryNetwork`. Use as ``async with network.transport(identity) as t``.
    """

    def __init__(self, network: MemoryNetwork, identity: Identity, config: MemoryConfig
                 ) -> None:
        self.network = network
        self.identity = identity
        self.config = config
        self._peer_id = identity.peer_id
        self._links: dict[str, _Link] = {}
        self._inbox = Inbox(config.inbox_depth, max_bytes=config.inbox_bytes,
                            max_peer_bytes=config.inbox_peer_bytes)
        self._events = EventQueue(config.event_depth)
        self._subs: dict[str, set[_MemorySubscription]] = {}
        self._scores = PeerScores(config.scores)
        self._open = False
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._open or self._closed:
            raise TransportClosed("a memory transport is entered once")
        self.network._register(self)
        self._open = True
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.network._unregister(self)
        for peer in list(self._links):
            await self._drop(peer, "closed", notify_remote=True)
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.close()
        self._inbox.close()
        self._events.close()

    # -- Transport ---------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        return (ADDRESS_PREFIX + self._peer_id,)

    @property
    def max_message_bytes(self) -> int:
        return self.config.max_message_bytes

    def _check_open(self) -> None:
        if not self._open or self._closed:
            raise TransportClosed("transport is closed")

    async def connect(self, address: str) -> str:
        self._check_open()
        if not address.startswith(ADDRESS_PREFIX):
            raise PeerUnreachable(f"not a memory address: {address!r}")
        peer_id = address[len(ADDRESS_PREFIX):]
        if peer_id in self._links:
            return peer_id
        if peer_id == self._peer_id:
            raise PeerUnreachable("cannot connect to self")
        if self._scores.is_banned(peer_id):
            raise PeerUnreachable(f"peer {peer_id} is banned")
        other = self.network._lookup(peer_id)
        if other is None or other._closed:
            raise PeerUnreachable(f"no memory node {peer_id}")
        if other._scores.is_banned(self._peer_id):
            raise PeerUnreachable(f"peer {peer_id} refused the connection")
        self._attach(other)
        other._attach(self)
        return peer_id

    def _attach(self, other: MemoryTransport) -> None:
        link = _Link(self, other, self.network.profile(self._peer_id, other.peer_id),
                     self.network._seed())
        link.task = asyncio.create_task(link.run(), name=f"memlink {self._peer_id[-6:]}")
        self._links[other.peer_id] = link
        self._event(PeerEvent(other.peer_id, True, Path.MEMORY))

    def _event(self, event: PeerEvent) -> None:
        if not self._closed:
            self._events.push(event)

    def _drop_now(self, peer_id: str, reason: str, *, notify_remote: bool
                  ) -> asyncio.Task[None] | None:
        """Forget the link to ``peer_id`` and cancel its task (returned, to be awaited)."""
        link = self._links.pop(peer_id, None)
        if link is None:
            return None
        if link.task is not None:
            link.task.cancel()
        self._event(PeerEvent(peer_id, False, Path.MEMORY, reason))
        if notify_remote:
            remote = link.dst._drop_now(
                self._peer_id, f"closed by peer: {reason}" if reason else "closed by peer",
                notify_remote=False)
            if remote is not None and not remote.done():
                remote.cancel()
        return link.task

    async def _drop(self, peer_id: str, reason: str, *, notify_remote: bool) -> None:
        task = self._drop_now(peer_id, reason, notify_remote=notify_remote)
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def send(self, peer_id: str, payload: bytes) -> None:
        self._check_open()
        if len(payload) > self.config.max_message_bytes:
            raise MessageTooLarge(
                f"{len(payload)} bytes is over the bound {self.config.max_message_bytes}")
        link = self._links.get(peer_id)
        if link is None:
            raise PeerUnreachable(f"not connected to {peer_id}")
        await link.put(bytes(payload))

    async def _inbox_put(self, msg: Message) -> None:
        if not self._closed:
            await self._inbox.put(msg)

    async def recv(self) -> Message:
        return await self._inbox.get()

    async def next_event(self) -> PeerEvent:
        return await self._events.get()

    def poll_event(self) -> PeerEvent | None:
        return self._events.get_nowait()

    def connected_peers(self) -> frozenset[str]:
        return frozenset(self._links)

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        await self._drop(peer_id, reason, notify_remote=True)

    def penalize(self, peer_id: str, reason: str, *, disconnect: bool = True) -> None:
        self._scores.penalize(peer_id, reason)
        if disconnect:
            self._drop_now(peer_id, reason, notify_remote=True)

    def score(self, peer_id: str) -> float:
        return self._scores.score(peer_id)

    # -- Gossip ------------------------------------------------------------------------
    async def publish(self, topic: str, data: bytes) -> None:
        self._check_open()
        if len(data) > self.config.max_message_bytes:
            raise MessageTooLarge(f"{len(data)} bytes is over the gossip bound")
        msg = GossipMessage(topic, self._peer_id, bytes(data))
        for node in self.network._subscribers(topic):
            if node is not self:
                for sub in list(node._subs.get(topic, ())):
                    sub.offer(msg)

    async def subscribe(self, topic: str, validator: Validator | None = None
                        ) -> _MemorySubscription:
        self._check_open()
        sub = _MemorySubscription(self, topic, validator)
        self._subs.setdefault(topic, set()).add(sub)
        return sub

    def directory(self) -> dict[str, PeerMetadata]:
        """No peers: the in-memory network publishes no peer metadata."""
        return {}
