"""The direct data plane: authenticated encrypted transfer, identity pinning, bad peers."""

from __future__ import annotations

import asyncio
import random

import blake3
import pytest

from swarm.identity import Identity
from swarm.net.dataplane import DataPlaneConfig, DirectTransport
from swarm.net.transport import (
    MessageTooLarge,
    Path,
    PeerIdMismatch,
    PeerUnreachable,
    Transport,
)

pytestmark = pytest.mark.timeout(30)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


@pytest.mark.parametrize("cipher", ["aes-256-gcm", "chacha20-poly1305"])
async def test_chunks_transfer_verified_in_order(cipher: str) -> None:
    rng = random.Random(1)
    chunks = [rng.randbytes(rng.choice([10, 70_000, 1 << 20, 4 << 20])) for _ in range(12)]
    cfg = DataPlaneConfig(ciphers=(cipher,))
    async with DirectTransport(ident(1), cfg) as a, DirectTransport(ident(2), cfg) as b:
        assert isinstance(a, Transport)
        assert await a.connect(b.listen_addresses[0]) == b.peer_id
        ev = await b.next_event()
        assert (ev.peer_id, ev.connected, ev.path) == (a.peer_id, True, Path.DIRECT)

        async def pump() -> None:
            for c in chunks:  # pipelined: no waiting for replies
                await a.send(b.peer_id, c)

        sender = asyncio.create_task(pump())
        got = [await b.recv() for _ in chunks]
        await sender
        assert [blake3.blake3(m.payload).digest() for m in got] == \
            [blake3.blake3(c).digest() for c in chunks]
        assert {m.peer_id for m in got} == {a.peer_id}
        await b.send(a.peer_id, b"reply")
        assert (await a.recv()).payload == b"reply"


async def test_dialing_a_pinned_address_with_the_wrong_peer_id_fails_clearly() -> None:
    async with DirectTransport(ident(1)) as a, DirectTransport(ident(2)) as b:
        host_port = b.listen_addresses[0].rsplit("/p2p/", 1)[0]
        with pytest.raises(PeerIdMismatch, match=ident(3).peer_id):
            await a.connect(f"{host_port}/p2p/{ident(3).peer_id}")
        assert a.connected_peers() == frozenset()
        assert await a.connect(host_port) == b.peer_id  # unpinned: learns the id


async def test_closed_port_is_unreachable_and_oversized_send_refused() -> None:
    async with DirectTransport(ident(1)) as a:
        async with DirectTransport(ident(2)) as b:
            addr = b.listen_addresses[0]
        with pytest.raises(PeerUnreachable):
            await a.connect(addr)
        with pytest.raises(MessageTooLarge):
            await a.send(ident(2).peer_id, bytes(a.max_message_bytes + 1))


async def test_backpressure_bounds_the_receiver_queue() -> None:
    cfg = DataPlaneConfig(inbox_depth=4)
    async with DirectTransport(ident(1), cfg) as a, DirectTransport(ident(2), cfg) as b:
        await a.connect(b.listen_addresses[0])
        sent = 0

        async def pump() -> None:
            nonlocal sent
            for _ in range(64):
                await a.send(b.peer_id, bytes(1 << 20))
                sent += 1

        task = asyncio.create_task(pump())
        await asyncio.sleep(0.5)
        # 64 MiB cannot all be buffered: socket buffers + 8 MiB write high water + 4 queued.
        assert sent < 64
        assert len(b._inbox) <= 4 + 1
        for _ in range(64):
            await b.recv()
        await asyncio.wait_for(task, 10)
