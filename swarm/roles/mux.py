"""One transport, several protocols: a one-byte channel tag in front of every message.

Inbound messages are routed by tag to a bounded queue per channel; an unknown tag or an
empty message is a protocol violation and scores the sender down. Before a message is
queued, ``before_deliver`` runs: the node takes the peer events queued ahead of it, so a
protocol never sees a message from a peer it has not been told is connected.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from swarm.net.transport import Message, TransportClosed
from swarm.net.transport import Transport as _Transport

log = logging.getLogger(__name__)


class Channel(enum.IntEnum):
    """What a message on the transport carries."""

    EXCHANGE = 1  #: chunk exchange (bitfield, have, request, piece, ...)
    LEASE = 2     #: lease traffic (claim, lease, heartbeat, result, verdict)
    SYNC = 3      #: catch-up: signed manifests a newcomer asked for


class Mux:
    """Routes a transport's inbound messages to per-channel queues."""

    def __init__(self, transport: _Transport, depth: int = 1024,
                 before_deliver: Callable[[], None] | None = None) -> None:
        self.transport = transport
        self.before_deliver = before_deliver
        # Bounded: when a consumer falls behind, the router waits, and so do senders.
        self.queues: dict[Channel, asyncio.Queue[Message]] = {
            c: asyncio.Queue(depth) for c in Channel
        }

    async def send(self, channel: Channel, peer_id: str, payload: bytes) -> None:
        await self.transport.send(peer_id, bytes([channel]) + payload)

    async def recv(self, channel: Channel) -> Message:
        return await self.queues[channel].get()

    async def route(self) -> None:
        """Run until the transport closes."""
        while True:
            try:
                msg = await self.transport.recv()
            except TransportClosed:
                return
            tag = msg.payload[0] if msg.payload else -1
            try:
                channel = Channel(tag)
            except ValueError:
                log.warning("peer %s sent a message on unknown channel %d", msg.peer_id, tag)
                self.transport.penalize(msg.peer_id, f"unknown channel {tag}")
                continue
            if self.before_deliver is not None:
                self.before_deliver()
            await self.queues[channel].put(Message(msg.peer_id, msg.payload[1:]))
