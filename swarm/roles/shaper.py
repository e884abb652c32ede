"""A link shaper for the real transport: emulate WAN regions on one machine.

``tc netem`` is not available here, and tests send only to loopback, so the local demo
shapes its own traffic: every message waits for its one-way latency (by region pair,
pipelined: messages do not wait for each other) and then for tokens of this node's
uplink bucket (shared by all destinations, as an access link is).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Self

from swarm.aio import cancel_and_wait
from swarm.net.transport import (
    Message,
    PeerEvent,
    PeerUnreachable,
    Subscription,
    TransportClosed,
    Validator,
)
from swarm.roles.common import Network

if TYPE_CHECKING:
    from swarm.net.topics import PeerMetadata

MAX_QUEUED_PER_PEER = 64
SAME_REGION_LATENCY = 0.002


@dataclass(frozen=True, slots=True)
class ShapeConfig:
    """How this node's outbound traffic is shaped."""

    uplink: float
    """Bytes per second of this node's upload (all destinations together)."""
    same_region_latency: float = SAME_REGION_LATENCY
    """One-way seconds to a peer in the same region."""
    cross_region_latency: float = 0.05
    """One-way seconds to a peer in another region."""


def wan(uplink: float, cross_region_latency: float) -> ShapeConfig:
    """An uplink of ``uplink`` bytes/s, ``cross_region_latency`` s to other regions, and
    the default latency inside the region, or less when other regions are nearer."""
    same = min(SAME_REGION_LATENCY, cross_region_latency)
    return ShapeConfig(uplink=uplink, same_region_latency=same,
                       cross_region_latency=cross_region_latency)


class _Bucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            loop = asyncio.get_running_loop()
            start = max(loop.time(), self.free_at)
            self.free_at = start + n / self.rate
            delay = self.free_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


class ShapedNetwork:
    """Wraps a :class:`~swarm.roles.common.Network`; only ``send`` behaves differently."""

    def __init__(self, inner: Network, config: ShapeConfig, my_region: str,
                 region_of: Callable[[str], str]) -> None:
        self.inner = inner
        self.config = config
        self.my_region = my_region
        self.region_of = region_of
        self._bucket = _Bucket(config.uplink)
        self._queues: dict[str, asyncio.Queue[tuple[float, bytes]]] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._errors: dict[str, BaseException] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await cancel_and_wait(list(self._pumps.values()), "shaper")

    def _latency(self, peer: str) -> float:
        same = self.region_of(peer) == self.my_region
        return self.config.same_region_latency if same else self.config.cross_region_latency

    async def send(self, peer_id: str, payload: bytes) -> None:
        err = self._errors.pop(peer_id, None)
        if err is not None:
            raise PeerUnreachable(f"earlier send to {peer_id} failed: {err}")
        if peer_id not in self.inner.connected_peers():
            raise PeerUnreachable(f"not connected to {peer_id}")
        q = self._queues.get(peer_id)
        if q is None:
            q = self._queues[peer_id] = asyncio.Queue(MAX_QUEUED_PER_PEER)
            self._pumps[peer_id] = asyncio.create_task(self._pump(peer_id, q))
        loop = asyncio.get_running_loop()
        await q.put((loop.time() + self._latency(peer_id), payload))

    async def _pump(self, peer_id: str, q: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, payload = await q.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._bucket.take(len(payload))
            try:
                await self.inner.send(peer_id, payload)
            except (PeerUnreachable, TransportClosed) as exc:
                self._errors[peer_id] = exc
                while not q.empty():
                    q.get_nowait()

    # -- plain delegation ----------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        return self.inner.listen_addresses

    @property
    def max_message_bytes(self) -> int:
        return self.inner.max_message_bytes

    async def connect(self, address: str) -> str:
        return await self.inner.connect(address)

    async def recv(self) -> Message:
        return await self.inner.recv()

    async def next_event(self) -> PeerEvent:
        return await self.inner.next_event()

    def poll_event(self) -> PeerEvent | None:
        return self.inner.poll_event()

    def connected_peers(self) -> frozenset[str]:
        return self.inner.connected_peers()

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        await self.inner.disconnect(peer_id, reason)

    def penalize(self, peer_id: str, reason: str, *, disconnect: bool = True) -> None:
        self.inner.penalize(peer_id, reason, disconnect=disconnect)

    def score(self, peer_id: str) -> float:
        return self.inner.score(peer_id)

    async def publish(self, topic: str, data: bytes) -> None:
        await self.inner.publish(topic, data)

    async def subscribe(self, topic: str, validator: Validator | None = None) -> Subscription:
        return await self.inner.subscribe(topic, validator)

    def directory(self) -> Mapping[str, PeerMetadata]:
        return self.inner.directory()
