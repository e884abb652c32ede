"""Bounded queues shared by the transports: the inbound message queue and the event queue.

:class:`Inbox` serves two kinds of producers: protocol callbacks that cannot wait
(:meth:`Inbox.offer` tells them to pause reading, and :meth:`Inbox.when_space` resumes
them), and tasks that can (:meth:`Inbox.put`). A producer that was told to pause may
already have added one message over a bound, so the queue holds at most one message per
producer beyond its bounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from swarm.net.transport import Message, PeerEvent, TransportClosed

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Bounded(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._readable = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def _push(self, item: T) -> None:
        self._items.append(item)
        self._readable.set()

    async def _pop(self) -> T:
        while not self._items:
            if self._closed:
                raise TransportClosed("transport is closed")
            self._readable.clear()
            await self._readable.wait()
        return self._items.popleft()

    def close(self) -> None:
        self._closed = True
        self._readable.set()


class Inbox(_Bounded[Message]):
    """Inbound messages from every connection, bounded, with backpressure to producers.

    Three bounds: ``capacity`` messages, ``max_bytes`` of payload in all, and
    ``max_peer_bytes`` of payload from any one peer. A producer is told to pause when
    its message takes the queue to a bound, so a peer that floods the node stalls its
    own connection while the others keep flowing (a message is always admitted, so
    the queue holds at most ``max_bytes`` plus one message per producer).
    """

    def __init__(self, capacity: int, *, max_bytes: int = 128 << 20,
                 max_peer_bytes: int = 32 << 20) -> None:
        super().__init__(capacity)
        if max_bytes <= 0 or max_peer_bytes <= 0:
            raise ValueError("byte bounds must be positive")
        self.max_bytes = max_bytes
        self.max_peer_bytes = max_peer_bytes
        self._bytes = 0
        self._peer_bytes: dict[str, int] = {}
        self._resume: list[tuple[str, Callable[[], None]]] = []

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def has_room(self, peer_id: str) -> bool:
        """Whether a message from ``peer_id`` would be taken without pausing its producer."""
        return (len(self._items) < self.capacity and self._bytes < self.max_bytes
                and self._peer_bytes.get(peer_id, 0) < self.max_peer_bytes)

    def _account(self, msg: Message, sign: int) -> None:
        size = len(msg.payload) * sign
        self._bytes += size
        left = self._peer_bytes.get(msg.peer_id, 0) + size
        if left > 0:
            self._peer_bytes[msg.peer_id] = left
        else:
            self._peer_bytes.pop(msg.peer_id, None)

    def offer(self, msg: Message) -> bool:
        """Append ``msg``; returns False when its producer should pause until space."""
        if self._closed:
            return True
        self._push(msg)
        self._account(msg, 1)
        return self.has_room(msg.peer_id)

    def when_space(self, callback: Callable[[], None], peer_id: str = "") -> None:
        """Call ``callback`` once ``peer_id`` has room again (at once if it has)."""
        if self._closed or self.has_room(peer_id):
            callback()
        else:
            self._resume.append((peer_id, callback))

    async def put(self, msg: Message) -> None:
        """Append ``msg``, waiting while its peer (or the queue) is at a bound."""
        while not self._closed and not self.has_room(msg.peer_id):
            room = asyncio.Event()
            self._resume.append((msg.peer_id, room.set))
            await room.wait()
        if not self._closed:
            self._push(msg)
            self._account(msg, 1)

    async def get(self) -> Message:
        """The oldest message; :raises TransportClosed: closed and empty."""
        msg = await self._pop()
        self._account(msg, -1)
        if self._resume:
            ready = [cb for peer, cb in self._resume if self.has_room(peer)]
            if ready:
                self._resume = [(p, cb) for p, cb in self._resume if cb not in ready]
                for cb in ready:
                    cb()
        return msg

    def close(self) -> None:
        super().close()
        callbacks, self._resume = self._resume, []
        for _, cb in callbacks:
            cb()


class EventQueue(_Bounded[PeerEvent]):
    """Peer events; when full the oldest event is dropped (and logged)."""

    def push(self, event: PeerEvent) -> None:
        if self._closed:
            return
        if len(self._items) >= self.capacity:
            dropped = self._items.popleft()
            logger.warning("peer event queue full; dropped %s", dropped)
        self._push(event)

    async def get(self) -> PeerEvent:
        """The oldest event; :raises TransportClosed: closed and empty."""
        return await self._pop()

    def get_nowait(self) -> PeerEvent | None:
        """The oldest event if one is queued (``None``: none is)."""
        return self._items.popleft() if self._items else None


class ByteBudget:
    """Bytes shared by every connection's frame buffers, granted fairly to waiters.

    :meth:`try_take` succeeds only while nobody waits (a newcomer cannot overtake a
    waiting connection); :meth:`wait` queues a request under a key (the remote
    address), and :meth:`give` grants queued requests round-robin across keys, oldest
    first within one, as bytes come back: an address with many waiting connections gets
    one grant per turn like any other. The callback runs soon after, with the bytes
    already reserved for it (a caller that no longer wants them gives them back).
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("a byte budget must be positive")
        self.limit = limit
        self.used = 0
        self._waiters: dict[str, deque[tuple[int, Callable[[int], None]]]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    def try_take(self, n: int) -> bool:
        if self._waiters or self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
        self._wake()

    def wait(self, n: int, callback: Callable[[int], None], key: str = "") -> None:
        if n > self.limit:
            raise ValueError(f"{n} bytes can never fit a budget of {self.limit}")
        self._waiters.setdefault(key, deque()).append((n, callback))
        self._wake()

    def cancel(self, callback: Callable[[int], None], key: str = "") -> None:
        queue = self._waiters.get(key)
        if queue is None:
            return
        kept = deque(w for w in queue if w[1] != callback)
        if kept:
            self._waiters[key] = kept
        else:
            del self._waiters[key]
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            key = next(iter(self._waiters))
            queue = self._waiters[key]
            n, callback = queue[0]
            if self.used + n > self.limit:
                return
            queue.popleft()
            del self._waiters[key]
            if queue:
                self._waiters[key] = queue  # to the back: the next key's turn
            self.used += n
            asyncio.get_running_loop().call_soon(callback, n)
