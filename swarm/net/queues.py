"""Bounded queues shared by the transports: the inbound message queue and the event queue.

:class:`Inbox` serves two kinds of producers: protocol callbacks that cannot wait
(:meth:`Inbox.offer` tells them to pause reading, and :meth:`Inbox.when_space` resumes
them), and tasks that can (:meth:`Inbox.put`). A producer that was told to pause may
already have added one message over the capacity, so the queue holds at most
``capacity + producers`` messages.
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
    """Inbound messages from every connection, bounded, with backpressure to producers."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._resume: list[Callable[[], None]] = []
        self._space = asyncio.Event()
        self._space.set()

    def offer(self, msg: Message) -> bool:
        """Append ``msg``; returns False when the producer should pause until space."""
        if self._closed:
            return True
        self._push(msg)
        if len(self._items) >= self.capacity:
            self._space.clear()
            return False
        return True

    def when_space(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the queue drops below capacity (at once if it is)."""
        if len(self._items) < self.capacity or self._closed:
            callback()
        else:
            self._resume.append(callback)

    async def put(self, msg: Message) -> None:
        """Append ``msg``, waiting while the queue is full."""
        while len(self._items) >= self.capacity and not self._closed:
            self._space.clear()
            await self._space.wait()
        if not self._closed:
            self._push(msg)

    async def get(self) -> Message:
        """The oldest message; :raises TransportClosed: closed and empty."""
        msg = await self._pop()
        if len(self._items) < self.capacity:
            self._space.set()
            if self._resume:
                callbacks, self._resume = self._resume, []
                for cb in callbacks:
                    cb()
        return msg

    def close(self) -> None:
        super().close()
        self._space.set()
        callbacks, self._resume = self._resume, []
        for cb in callbacks:
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
