"""Real py-libp2p nodes on loopback, hosted in asyncio through the trio guest run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket

import blake3
import pytest

from swarm.content.manifest import Manifest
from swarm.identity import Identity
from swarm.net import topics
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.net.transport import Path, PeerIdMismatch, Transport

pytestmark = pytest.mark.timeout(90)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def manifest(step: int, signer: Identity, run: str = "r1") -> bytes:
    chunks = tuple((blake3.blake3(bytes([i])).digest(), 1000 + i) for i in range(4))
    m = Manifest(run=run, step=step, kind="keyframe", base_root=None,
                 target_root=bytes(32), layout_digest=bytes(32), codec="raw",
                 piece_size=4 << 20, chunks=chunks)
    return m.sign(signer).encode()


async def transfer_and_verify(src: Transport, dst: Transport, seed: int) -> None:
    rng = random.Random(seed)
    chunks = [rng.randbytes(rng.choice([100, 300_000, 4 << 20])) for _ in range(6)]

    async def pump() -> None:
        for c in chunks:
            await src.send(dst.peer_id, c)

    sender = asyncio.create_task(pump())
    got = [await asyncio.wait_for(dst.recv(), 30) for _ in chunks]
    await sender
    assert [m.peer_id for m in got] == [src.peer_id] * len(chunks)
    assert [blake3.blake3(m.payload).digest() for m in got] == \
        [blake3.blake3(c).digest() for c in chunks]


async def two_node_session() -> None:
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(Libp2pNode(ident(1)))
        b = await stack.enter_async_context(
            Libp2pNode(ident(2), NodeConfig(bootstrap=a.listen_addresses)))
        c = await stack.enter_async_context(Libp2pNode(
            ident(3), NodeConfig(data_plane=None, bootstrap=a.listen_addresses)))
        assert b.path(a.peer_id) is Path.DIRECT
        assert c.path(a.peer_id) is Path.LIBP2P
        await transfer_and_verify(b, a, 1)
        await transfer_and_verify(a, b, 2)
        await transfer_and_verify(c, a, 3)
        topic = topics.have("fd")
        sub = await stack.enter_async_context(await c.subscribe(topic))
        await b.wait_for_mesh(topic, 0)
        await a.wait_for_mesh(topic, 1)
        await a.publish(topic, b"hello")
        assert (await asyncio.wait_for(sub.get(), 10)).data == b"hello"


async def test_two_nodes_direct_transfer_and_no_leaked_descriptors() -> None:
    await two_node_session()  # warm up: imports, lazily created process-wide state
    before = open_fds()
    await two_node_session()
    assert open_fds() == before


async def test_node_prints_full_multiaddr_and_peer_id_is_the_identity() -> None:
    async with Libp2pNode(ident(1), NodeConfig(data_plane=None)) as a:
        (addr,) = a.listen_addresses
        assert addr.startswith("/ip4/127.0.0.1/tcp/")
        assert addr.endswith(f"/p2p/{ident(1).peer_id}")
        assert isinstance(a, Transport)


async def test_dialing_an_address_with_the_wrong_peer_id_fails_clearly() -> None:
    async with Libp2pNode(ident(1)) as a, Libp2pNode(ident(2)) as b:
        wrong = a.listen_addresses[0].rsplit("/p2p/", 1)[0] + f"/p2p/{ident(9).peer_id}"
        with pytest.raises(PeerIdMismatch, match=ident(9).peer_id):
            await b.connect(wrong)
        assert b.connected_peers() == frozenset()
        assert await b.connect(a.listen_addresses[0]) == a.peer_id


async def test_a_dialed_peers_region_and_uplink_are_known_once_connected() -> None:
    """With no run (no peers topic), the dialer learns what a peer advertises from the
    signed metadata it fetches to connect: the exchange then knows that neighbour's
    region and uplink (a thin one is asked last) from its first message on."""
    async with Libp2pNode(ident(1), NodeConfig(region="eu", upload=1_250_000)) as a, \
            Libp2pNode(ident(2)) as b:
        assert await b.connect(a.listen_addresses[0]) == a.peer_id
        meta = b.directory()[a.peer_id]
        assert (meta.region, meta.bandwidth) == ("eu", 1_250_000)


async def test_fallback_to_libp2p_streams_when_the_direct_port_is_closed() -> None:
    dead = f"127.0.0.1:{closed_port()}"
    async with (
        Libp2pNode(ident(1), NodeConfig(data_plane_advertise=dead)) as a,
        Libp2pNode(ident(2), NodeConfig(bootstrap=())) as b,
    ):
        assert await b.connect(a.listen_addresses[0]) == a.peer_id
        assert b.path(a.peer_id) is Path.LIBP2P
        ev = await asyncio.wait_for(a.next_event(), 10)
        assert (ev.peer_id, ev.path) == (b.peer_id, Path.LIBP2P)
        await transfer_and_verify(b, a, 3)
        await transfer_and_verify(a, b, 4)


async def test_libp2p_only_nodes_exchange_messages() -> None:
    cfg = NodeConfig(data_plane=None)
    async with Libp2pNode(ident(1), cfg) as a:
        async with Libp2pNode(ident(2), NodeConfig(data_plane=None,
                                                   bootstrap=a.listen_addresses)) as b:
            assert b.path(a.peer_id) is Path.LIBP2P
            await transfer_and_verify(b, a, 5)
        ev = await asyncio.wait_for(a.next_event(), 10)
        assert ev.connected
        ev = await asyncio.wait_for(a.next_event(), 10)
        assert not ev.connected and ev.peer_id == ident(2).peer_id


async def test_five_nodes_join_gossip_reject_forgeries_and_transfer() -> None:
    run = "r1"
    trainer = ident(11)
    cfg = NodeConfig(run=run, metadata_interval=0.5)
    async with contextlib.AsyncExitStack() as stack:
        boot = await stack.enter_async_context(Libp2pNode(ident(10), cfg))
        join = NodeConfig(run=run, metadata_interval=0.5, bootstrap=boot.listen_addresses)
        others = [await stack.enter_async_context(Libp2pNode(ident(11 + i), join))
                  for i in range(4)]
        nodes = [boot, *others]
        assert all(boot.peer_id in n.connected_peers() for n in others)

        topic = topics.manifests(run)
        subs = [await stack.enter_async_context(
            await n.subscribe(topic, topics.manifest_validator(trainer.public_key)))
            for n in nodes]
        for n in nodes:
            await n.wait_for_mesh(topic, 1 if n is not boot else 4)

        forger = others[2]
        good = manifest(1, trainer)
        forged = manifest(1, ident(13))  # a validly signed manifest by the wrong key
        tampered = bytearray(good)
        tampered[-1] ^= 1  # the trainer's manifest with a broken signature
        await forger.publish(topic, forged)
        await forger.publish(topic, bytes(tampered))
        await others[0].publish(topic, good)  # others[0] is the trainer's node
        for n, sub in zip(nodes, subs, strict=True):
            if n is others[0]:
                continue
            msg = await asyncio.wait_for(sub.get(), 15)
            assert msg.data == good and msg.source == trainer.peer_id
        await asyncio.sleep(0.5)
        assert all(sub.queue.empty() for sub in subs)  # the forgeries never arrived

        # Peers that only know the bootstrap node find each other via peer metadata.
        a, b = others[1], others[3]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while b.peer_id not in a.directory():
            assert loop.time() < deadline, "peer metadata did not propagate"
            await asyncio.sleep(0.1)
        b.update_metadata(bandwidth=12_500_000, region="eu")
        while a.directory()[b.peer_id].region != "eu":
            assert loop.time() < deadline, "updated metadata did not propagate"
            await asyncio.sleep(0.1)
        assert a.directory()[b.peer_id].bandwidth == 12_500_000
        addr = a.directory()[b.peer_id].addrs[0]
        assert await a.connect(addr) == b.peer_id
        assert a.path(b.peer_id) is Path.DIRECT
        await transfer_and_verify(a, b, 6)


async def test_gossip_burst_is_delivered_whole() -> None:
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(Libp2pNode(ident(1), NodeConfig(data_plane=None)))
        b = await stack.enter_async_context(Libp2pNode(
            ident(2), NodeConfig(data_plane=None, bootstrap=a.listen_addresses)))
        topic = topics.have("burst")
        sub = await stack.enter_async_context(await b.subscribe(topic))
        await a.wait_for_mesh(topic, 1)
        n = 300  # py-libp2p's defaults deliver about 200 of these (32-deep queues)
        for i in range(n):
            await a.publish(topic, i.to_bytes(4, "big") * 64)
        got = [await asyncio.wait_for(sub.get(), 10) for _ in range(n)]
        assert sorted(int.from_bytes(m.data[:4], "big") for m in got) == list(range(n))
        assert sub.dropped == 0


async def test_closing_a_node_wakes_its_waiting_consumers() -> None:
    from swarm.net.transport import TransportClosed

    node = Libp2pNode(ident(1), NodeConfig(data_plane=None))
    async with node:
        waiting = asyncio.create_task(node.recv())
        events = asyncio.create_task(node.next_event())
        await asyncio.sleep(0.05)
    with pytest.raises(TransportClosed):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(TransportClosed):
        await asyncio.wait_for(events, 5)
    with pytest.raises(TransportClosed):
        await node.send(ident(2).peer_id, b"late")


@pytest.mark.parametrize("direct", [True, False])
async def test_a_connect_event_is_queued_before_the_connections_first_message(
        direct: bool) -> None:
    """What a node's mux relies on to never drop a newcomer's first message (its bitfield,
    its interest) as coming from a stranger: by the time the message can be received,
    the event announcing its sender is already queued (``poll_event``)."""
    cfg = NodeConfig() if direct else NodeConfig(data_plane=None)
    async with Libp2pNode(ident(1), cfg) as a:
        assert a.poll_event() is None
        async with Libp2pNode(ident(2), NodeConfig(bootstrap=())) as b:
            await b.connect(a.listen_addresses[0])
            await b.send(a.peer_id, b"first")
            msg = await asyncio.wait_for(a.recv(), 10)
            assert (msg.peer_id, msg.payload) == (b.peer_id, b"first")
            ev = a.poll_event()
            assert ev is not None and (ev.peer_id, ev.connected) == (b.peer_id, True)
            assert ev.path is (Path.DIRECT if direct else Path.LIBP2P)


async def test_a_card_is_served_on_request_and_bounded_by_the_reader() -> None:
    from swarm.errors import DecodeError

    async with Libp2pNode(ident(1)) as a, \
            Libp2pNode(ident(2), NodeConfig(bootstrap=a.listen_addresses)) as b:
        assert await b.fetch_card(a.peer_id, 1 << 20) == b""  # holds none yet
        card = random.Random(1).randbytes(300_000)
        a.serve_card(card)
        assert await b.fetch_card(a.peer_id, 1 << 20) == card
        with pytest.raises(DecodeError, match="bound is 1000"):
            await b.fetch_card(a.peer_id, 1000)
