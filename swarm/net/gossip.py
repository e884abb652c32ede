"""Gossip on libp2p: gossipsub topics with validators, bridged to asyncio.

:class:`Libp2pGossip` is the :class:`~swarm.net.transport.Gossip` half of a
:class:`~swarm.net.node.Libp2pNode`. It runs a strictly signing gossipsub router on the
node's host (:meth:`Libp2pGossip.running`, trio) and hands each subscription's
validated messages to asyncio code (:class:`Libp2pSubscription`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import trio

from swarm.errors import LocalProtocolError
from swarm.net import libp2p_compat as compat
from swarm.net import topics
from swarm.net.bridge import ServiceHandle, TrioGuest
from swarm.net.transport import GossipMessage, MessageTooLarge, TransportClosed, Validator

if TYPE_CHECKING:
    from libp2p.abc import IHost
    from libp2p.pubsub.pubsub import Pubsub

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """gossipsub settings (py-libp2p's defaults drop bursts: 10 msg/s/topic/peer)."""

    #: Mesh degree and its bounds.
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    #: Seconds between gossipsub heartbeats (mesh maintenance, gossip emission).
    heartbeat_interval: int = 1
    #: Messages per second per topic per peer before spam protection drops them.
    max_messages_per_topic_per_second: float = 1000.0
    #: The largest gossip payload published or accepted.
    max_message_bytes: int = topics.MAX_GOSSIP_BYTES
    #: RPCs queued per peer for sending; py-libp2p's default of 32 silently drops bursts.
    outbound_queue_depth: int = 4096
    #: Validated messages queued per subscription; beyond it the newest are dropped.
    queue_depth: int = 1024
    #: Seconds a message id is remembered (duplicates dropped). It only deduplicates
    #: (it delivers nothing); it must outlast the message cache below.
    seen_ttl: int = 120
    #: Heartbeats of messages advertised (IHAVE) and replayed to a peer that subscribes
    #: (py-libp2p's ``send_recent_messages`` hands a new subscriber the whole window).
    gossip_window: int = 3
    #: Heartbeats of messages kept to answer IWANT; also the age past which messages
    #: queued for a peer that has not subscribed yet are dropped. A newcomer is handed
    #: nothing older than ``gossip_history * heartbeat_interval`` seconds
    #: (:attr:`max_replay_age`).
    gossip_history: int = 5
    #: Score penalties (in units of ``ScoreConfig.penalty``) per rejected message charged
    #: to the peer that forwarded it.
    invalid_weight: float = 1.0

    @property
    def max_replay_age(self) -> float:
        """Seconds: the oldest message gossipsub hands a newcomer (replay, IWANT, or the
        queue of a peer not subscribed yet)."""
        return float(self.gossip_history * self.heartbeat_interval)

    def __post_init__(self) -> None:
        if not 1 <= self.gossip_window <= self.gossip_history:
            raise ValueError("need 1 <= gossip_window <= gossip_history")
        if self.seen_ttl < self.max_replay_age:
            raise ValueError("seen_ttl must outlast the message cache")


class Libp2pSubscription:
    """One gossip topic's validated messages; stops its pump on exit."""

    def __init__(self, gossip: Libp2pGossip, topic: str, validator: Validator | None
                 ) -> None:
        self.gossip = gossip
        self._topic = topic
        self.validator = validator
        self.queue: asyncio.Queue[GossipMessage] = asyncio.Queue(gossip.config.queue_depth)
        self.dropped = 0
        self.rejected = 0
        self.handle: ServiceHandle | None = None
        self.closed = False
        self._closed_event = asyncio.Event()

    @property
    def topic(self) -> str:
        return self._topic

    def _validate(self, forwarder: Any, msg: Any) -> bool:
        """py-libp2p's sync topic validator: ``forwarder`` is the peer that sent us the
        message (``Pubsub.push_msg``), ``msg`` the signed pubsub message. py-libp2p runs
        it once per message id (its ``ValidationCache``), also on our own publications."""
        reason = ""
        if len(msg.data) > self.gossip.config.max_message_bytes:
            reason = f"gossip on {self._topic}: {len(msg.data)} bytes over the bound"
        elif list(msg.topicIDs) != [self._topic]:
            # A message on several topics is forwarded on all of them after passing one
            # validator: it could carry a valid peers envelope onto the manifests topic
            # and get this node scored down by the manifests' receivers.
            reason = f"gossip on several topics {list(msg.topicIDs)!r}"
        elif self.validator is not None:
            try:
                source = compat.peer_str(compat.id_from_bytes(msg.from_id))
                if not self.validator(source, bytes(msg.data)):
                    reason = f"invalid gossip on {self._topic} from {source}"
            except Exception:  # a validator that raises rejects the message (our bug)
                logger.exception("gossip validator for %s raised", self._topic)
                self.rejected += 1
                return False
        if not reason:
            return True
        self.rejected += 1
        self.gossip.invalid(compat.peer_str(forwarder), reason)
        return False

    async def _pump(self, ready: Any) -> None:
        pubsub = self.gossip.pubsub
        assert pubsub is not None
        pubsub.set_topic_validator(self._topic, self._validate, False)
        sub = await pubsub.subscribe(self._topic)
        try:
            ready()
            me = self.gossip.peer_id
            # libp2p's own subscription channel holds 32 messages and drops beyond:
            # it is drained at once into this subscription's deeper queue.
            while True:
                m = await sub.get()
                source = compat.peer_str(compat.id_from_bytes(m.from_id))
                if source == me:
                    continue
                try:
                    self.queue.put_nowait(GossipMessage(self._topic, source, bytes(m.data)))
                except asyncio.QueueFull:
                    self.dropped += 1
                    logger.warning("gossip queue for %s full (%d); dropped a message",
                                   self._topic, self.queue.maxsize)
        finally:
            with trio.move_on_after(2) as scope, contextlib.suppress(Exception):
                scope.shield = True
                await pubsub.unsubscribe(self._topic)
            pubsub.remove_topic_validator(self._topic)

    async def get(self) -> GossipMessage:
        if self.closed and self.queue.empty():
            raise TransportClosed("subscription closed")
        getter = asyncio.ensure_future(self.queue.get())
        closer = asyncio.ensure_future(self._closed_event.wait())
        try:
            await asyncio.wait({getter, closer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closer.cancel()
            if not getter.done():
                getter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closer
        if getter.done() and not getter.cancelled():
            return getter.result()
        with contextlib.suppress(asyncio.CancelledError):
            await getter
        raise TransportClosed("subscription closed")

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._closed_event.set()
        self.gossip._subs.pop(self._topic, None)
        if self.handle is not None:
            await self.handle.stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class Libp2pGossip:
    """Publish and subscribe on a node's gossipsub router.

    ``check_open`` returns the node's trio guest run, or raises
    :class:`~swarm.net.transport.TransportClosed` once the node is closed.
    """

    def __init__(self, config: GossipConfig, peer_id: str,
                 check_open: Callable[[], TrioGuest],
                 on_invalid: Callable[[str, str], None] | None = None) -> None:
        self.config = config
        self.peer_id = peer_id
        self._check_open = check_open
        self._on_invalid = on_invalid
        #: Rejected messages by the peer that forwarded them.
        self.invalid_from: dict[str, int] = {}
        self.pubsub: Pubsub | None = None
        self._subs: dict[str, Libp2pSubscription] = {}

    @contextlib.asynccontextmanager
    async def running(self, host: IHost) -> AsyncIterator[None]:
        """Run gossipsub on ``host`` for the block (trio)."""
        from libp2p.tools.anyio_service.context import background_trio_service

        pubsub, router = compat.new_pubsub(host, self.config)
        try:
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                self.pubsub = pubsub
                yield
        finally:
            self.pubsub = None

    def invalid(self, forwarder: str, reason: str) -> None:
        """A validator rejected a message ``forwarder`` sent us: report it (trio)."""
        if forwarder == self.peer_id:  # our own publication
            logger.warning("refused to publish: %s", reason)
            return
        if len(self.invalid_from) < 4096 or forwarder in self.invalid_from:
            self.invalid_from[forwarder] = self.invalid_from.get(forwarder, 0) + 1
        if self._on_invalid is not None:
            try:
                self._on_invalid(forwarder, reason)
            except Exception:
                logger.exception("gossip penalty callback raised")

    def blacklist(self, peer_id: str) -> None:
        """Drop ``peer_id``'s gossip from now on (trio)."""
        if self.pubsub is not None:
            self.pubsub.add_to_blacklist(compat.id_from_str(peer_id))

    async def aclose(self) -> None:
        """Stop every subscription."""
        for sub in list(self._subs.values()):
            await sub.aclose()

    async def publish(self, topic: str, data: bytes) -> None:
        guest = self._check_open()
        if len(data) > self.config.max_message_bytes:
            raise MessageTooLarge(f"{len(data)} bytes is over the gossip bound "
                                  f"{self.config.max_message_bytes}")
        pubsub = self.pubsub
        assert pubsub is not None
        await guest.run(pubsub.publish, topic, bytes(data))

    async def subscribe(self, topic: str, validator: Validator | None = None
                        ) -> Libp2pSubscription:
        guest = self._check_open()
        if topic in self._subs:
            raise LocalProtocolError(f"already subscribed to {topic}")
        sub = Libp2pSubscription(self, topic, validator)
        self._subs[topic] = sub
        handle, ready = guest.start_service(sub._pump, f"gossip {topic}")
        sub.handle = handle
        try:
            await asyncio.shield(ready)
        except BaseException:
            await sub.aclose()
            raise
        return sub

    async def wait_for_mesh(self, topic: str, peers: int, timeout: float = 10.0) -> None:
        """Wait until ``peers`` peers are known subscribed to ``topic`` (tests, start-up).

        :raises TimeoutError: not within ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            pubsub = self.pubsub
            have = len(pubsub.peer_topics.get(topic, ())) if pubsub is not None else 0
            if have >= peers:
                return
            if loop.time() > deadline:
                raise TimeoutError(f"{topic}: {have} of {peers} peers after {timeout} s")
            await asyncio.sleep(0.05)
