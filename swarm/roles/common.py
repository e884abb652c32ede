"""What the trainer and the rollout peer share: a node's transport, exchange and events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from swarm.net.transport import Gossip, PeerEvent, Transport, TransportClosed
from swarm.protocol.exchange import Event, Exchange, ExchangeConfig
from swarm.roles.exchange_driver import ExchangeDriver
from swarm.roles.mux import Mux

if TYPE_CHECKING:
    from swarm.net.topics import PeerMetadata

log = logging.getLogger(__name__)


class Network(Transport, Gossip, Protocol):
    """A transport that also gossips (the libp2p node, the in-memory network)."""

    def directory(self) -> Mapping[str, PeerMetadata]:
        """Peers learned from the run's peers topic (latest metadata of each)."""
        ...


class NodeBase:
    """Owns the tasks of a node: message routing, the exchange, peer events.

    Subclasses add their own tasks with :meth:`spawn` and react to peers in
    :meth:`on_peer`.
    """

    def __init__(self, net: Network, *, region: str, exchange_config: ExchangeConfig,
                 seed: int = 0) -> None:
        self.net = net
        self.region = region
        self.mux = Mux(net)
        self._exchange_config = exchange_config
        self._seed = seed
        self._tasks: dict[asyncio.Task[None], Coroutine[Any, Any, None]] = {}
        """Running tasks and their coroutines (a finished task leaves on its own)."""
        self.driver: ExchangeDriver
        self.closed = asyncio.Event()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(self._guard(coro, name), name=name)
        self._tasks[task] = coro
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled():
            task.exception()  # retrieved: :meth:`_guard` logged it and closed the node

    async def _guard(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await coro
        except (asyncio.CancelledError, TransportClosed):
            raise
        except Exception:
            log.exception("task %s failed", name)
            self.closed.set()
            raise

    async def start(self, on_event: Callable[[Event], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        exchange = Exchange(self.net.peer_id, region=self.region, config=self._exchange_config,
                            seed=self._seed, now=loop.time())
        self.driver = ExchangeDriver(exchange, self.mux, on_event)
        await self.driver.__aenter__()
        self.spawn(self.mux.route(), "mux")
        self.spawn(self._peer_events(), "peer events")
        for peer in self.net.connected_peers():
            self.on_peer(peer, True)

    async def stop(self) -> None:
        tasks = dict(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for coro in tasks.values():
            coro.close()  # a task cancelled before it ran never started its coroutine
        self._tasks.clear()
        await self.driver.__aexit__(None, None, None)

    async def _peer_events(self) -> None:
        while True:
            ev: PeerEvent = await self.net.next_event()
            self.on_peer(ev.peer_id, ev.connected)

    def region_of(self, peer: str) -> str:
        directory = getattr(self.net, "directory", None)
        if directory is None:
            return ""
        meta = directory().get(peer)
        return "" if meta is None else str(meta.region)

    def on_peer(self, peer: str, connected: bool) -> None:
        if connected:
            self.driver.connected(peer, region=self.region_of(peer))
        else:
            self.driver.disconnected(peer)
