"""The mux: messages routed by channel tag, and each one passed on only after the peer
events queued ahead of it (a newcomer's first message is never taken for a stranger's)."""

from __future__ import annotations

import asyncio

import pytest

from swarm.identity import Identity
from swarm.net.memory import MemoryNetwork
from swarm.net.transport import PeerEvent
from swarm.roles.mux import Channel, Mux

pytestmark = pytest.mark.timeout(20)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


async def test_queued_peer_events_are_taken_before_a_message_is_passed_on() -> None:
    net = MemoryNetwork()
    async with net.transport(ident(1)) as a, net.transport(ident(2)) as b:
        seen: list[PeerEvent] = []
        at_delivery: list[list[str]] = []

        def take() -> None:
            while (ev := a.poll_event()) is not None:
                seen.append(ev)
            at_delivery.append([e.peer_id for e in seen if e.connected])

        mux = Mux(a, before_deliver=take)
        router = asyncio.create_task(mux.route())
        try:
            await b.connect(a.listen_addresses[0])
            await b.send(a.peer_id, bytes([Channel.EXCHANGE]) + b"bitfield")
            msg = await asyncio.wait_for(mux.recv(Channel.EXCHANGE), 5)
        finally:
            router.cancel()
        assert (msg.peer_id, msg.payload) == (b.peer_id, b"bitfield")
        assert at_delivery == [[b.peer_id]]


async def test_an_unknown_channel_drops_the_sender_and_is_not_passed_on() -> None:
    net = MemoryNetwork()
    async with net.transport(ident(1)) as a, net.transport(ident(2)) as b:
        mux = Mux(a)
        router = asyncio.create_task(mux.route())
        try:
            await b.connect(a.listen_addresses[0])
            assert (await asyncio.wait_for(a.next_event(), 5)).connected
            await b.send(a.peer_id, bytes([99]) + b"x")
            gone = await asyncio.wait_for(a.next_event(), 5)
        finally:
            router.cancel()
        assert (gone.peer_id, gone.connected) == (b.peer_id, False)
        assert "unknown channel 99" in gone.reason
        assert a.score(b.peer_id) < 0
        assert all(q.empty() for q in mux.queues.values())
