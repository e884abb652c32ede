"""What the trainer and the rollout peer share: a node's transport, exchange and events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from swarm.errors import NodeFailed
from swarm.net.transport import Gossip, PeerEvent, Transport
from swarm.protocol.exchange import Event, Exchange, ExchangeConfig
from swarm.roles.exchange_driver import ExchangeDriver
from swarm.roles.mux import Mux
from swarm.roles.tasks import TaskGroup

if TYPE_CHECKING:
    from swarm.net.topics import PeerMetadata

log = logging.getLogger(__name__)

T = TypeVar("T")

METADATA_FOLLOW_S = 1.0
"""How often a node passes its neighbours' newest metadata on to its exchange."""


class Network(Transport, Gossip, Protocol):
    """A transport that also gossips (the libp2p node, the in-memory network)."""

    def directory(self) -> Mapping[str, PeerMetadata]:
        """Peers learned from the run's peers topic (latest metadata of each)."""
        ...


@dataclass(frozen=True, slots=True)
class Clock:
    """Where a node reads the time (injected, so tests and simulations can drive it)."""

    now: Callable[[], float] = time.monotonic
    """Monotonic seconds: timers, the exchange, fetch stalls (the event loop's clock)."""
    wall: Callable[[], float] = time.time
    """Unix seconds: lease times, signed into messages."""


class NodeBase:
    """Owns the tasks of a node: message routing, the exchange, peer events.

    Subclasses add their own tasks with :meth:`spawn` and react to peers in
    :meth:`on_peer`. The tasks form one :class:`~swarm.roles.tasks.TaskGroup`: a failing
    task stops the node, and callers waiting on it (through :meth:`wait`) get
    :class:`~swarm.errors.NodeFailed` with the cause.
    """

    def __init__(self, net: Network, *, region: str, exchange_config: ExchangeConfig,
                 seed: int = 0, clock: Clock | None = None, name: str = "node") -> None:
        self.net = net
        self.region = region
        self.clock = clock or Clock()
        self.mux = Mux(net, before_deliver=self._take_queued_events)
        self._exchange_config = exchange_config
        self._seed = seed
        self.tasks = TaskGroup(name)
        self.driver: ExchangeDriver

    @property
    def closed(self) -> asyncio.Event:
        """Set once the node stopped (closed, or a task failed: see :attr:`failure`)."""
        return self.tasks.closed

    @property
    def failure(self) -> NodeFailed | None:
        """Why the node stopped on its own (``None``: it did not)."""
        return self.tasks.failure

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
        return self.tasks.spawn(coro, name)

    async def wait(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` while the node runs; :class:`NodeFailed` if it stops first."""
        return await self.tasks.wait(aw)

    async def start(self, on_event: Callable[[Event], None] | None = None) -> None:
        exchange = Exchange(self.net.peer_id, region=self.region, config=self._exchange_config,
                            seed=self._seed, now=self.clock.now())
        self.driver = ExchangeDriver(exchange, self.mux, on_event, clock=self.clock.now)
        await self.driver.__aenter__()
        self.spawn(self.mux.route(), "mux")
        self.spawn(self._peer_events(), "peer events")
        self.spawn(self._follow_metadata(), "metadata")
        for peer in self.net.connected_peers():
            self.on_peer(peer, True)

    async def stop(self) -> None:
        await self.tasks.close()
        if hasattr(self, "driver"):
            await self.driver.__aexit__(None, None, None)

    async def _peer_events(self) -> None:
        while True:
            self._peer_event(await self.net.next_event())

    def _take_queued_events(self) -> None:
        """Handle the peer events already queued (the mux calls this before it passes on
        a message: events and messages come through separate queues, and a message from a
        peer whose connect event is still queued would be dropped as from a stranger)."""
        while (ev := self.net.poll_event()) is not None:
            self._peer_event(ev)

    def _peer_event(self, ev: PeerEvent) -> None:
        log.debug("%s: %s %s (%s)", self.tasks.name, ev.peer_id,
                  "connected" if ev.connected else "gone", ev.reason or ev.path)
        self.on_peer(ev.peer_id, ev.connected)

    def driver_connected(self, peer: str, *, trainer: bool = False) -> None:
        """Tell the exchange ``peer`` is reachable, with the region and uplink its
        metadata advertises (none yet: no region, upload unknown; :meth:`_follow_metadata`
        passes them on once they come)."""
        meta = self.net.directory().get(peer)
        if meta is None:
            self.driver.connected(peer, trainer=trainer)
        else:
            self.driver.connected(peer, region=str(meta.region), trainer=trainer,
                                  upload=float(meta.bandwidth))

    async def _follow_metadata(self) -> None:
        """Pass the neighbours' metadata on to the exchange as it comes or changes: a
        node re-advertises a measured uplink (``update_metadata``), and a dialled node
        learns of its dialler from the peers topic only, which may come after the
        connection. (The exchange ignores what it already knows.)"""
        while True:
            await asyncio.sleep(METADATA_FOLLOW_S)
            known = self.net.directory()
            for peer in self.driver.exchange.neighbours:
                meta = known.get(peer)
                if meta is not None:
                    self.driver.described(peer, region=str(meta.region),
                                          upload=float(meta.bandwidth))

    def on_peer(self, peer: str, connected: bool) -> None:
        if connected:
            self.driver_connected(peer)
        else:
            self.driver.disconnected(peer)
