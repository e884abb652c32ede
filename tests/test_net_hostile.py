"""Hostile peers against real nodes: each is cut off and scored; others keep being served."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest
import trio

from swarm.identity import Identity
from swarm.net.dataplane import DataPlaneConfig, DirectTransport
from swarm.net.handshake import TAG_LEN, ClientHandshake, Session
from swarm.net.node import MSG_PROTOCOL, Libp2pNode, NodeConfig
from swarm.net.transport import PeerUnreachable
from swarm.wire import strict
from swarm.wire.frames import FrameReader, encode_frame, encode_header

pytestmark = pytest.mark.timeout(60)

VICTIM = Identity.from_seed(bytes([1]) * 32)
HONEST = Identity.from_seed(bytes([2]) * 32)
MALLORY = Identity.from_seed(bytes([3]) * 32)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def port_of(t: DirectTransport) -> int:
    assert t.plane.address is not None
    return t.plane.address[1]


async def closed_by_peer(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    """True when the other side closes (EOF or reset) within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


@contextlib.asynccontextmanager
async def raw(port: int):  # type: ignore[no-untyped-def]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    me: Identity) -> Session:
    hs = ClientHandshake(me, expected_peer_id=VICTIM.peer_id)
    writer.write(encode_frame(hs.hello()))
    frames = FrameReader(4096)
    while (body := frames.next_frame()) is None:
        frames.feed(await reader.read(4096))
    result = hs.receive_server(body)
    writer.write(encode_frame(result.auth))
    return result.session  # the server's welcome frame is left unread


def sealed(session: Session, payload: bytes) -> bytes:
    header = encode_header(len(payload) + TAG_LEN)
    out = bytearray(len(header) + len(payload) + TAG_LEN)
    out[:4] = header
    session.seal_into(header, payload, memoryview(out)[4:])
    return bytes(out)


async def still_serves(victim: DirectTransport, honest: DirectTransport) -> None:
    if victim.peer_id not in honest.connected_peers():
        await honest.connect(victim.listen_addresses[0])
    await honest.send(victim.peer_id, b"still there?")
    msg = await asyncio.wait_for(victim.recv(), 5)
    assert (msg.peer_id, msg.payload) == (honest.peer_id, b"still there?")


CFG = DataPlaneConfig(handshake_timeout=1.5, stall_timeout=0.5, max_connections=64,
                      max_connections_per_peer=2, max_message_bytes=1 << 20)


@pytest.mark.parametrize("garbage", [
    struct.pack(">I", 0xFFFFFFF0),                            # a 4 GiB frame announced
    encode_frame(b"\xc1\xc1\xc1"),                            # malformed msgpack
    encode_frame(strict.pack(["hello", 1])),                  # wrong type
    encode_frame(strict.pack({"t": "bogus", "v": 1})),        # unknown tag
    encode_frame(strict.pack({"t": "hello", "v": 1, "eph": 5, "nonce": b"",
                              "ciphers": []})),               # wrong field types
])
async def test_bad_handshake_bytes_close_the_connection(garbage: bytes) -> None:
    async with DirectTransport(VICTIM, CFG) as victim, DirectTransport(HONEST, CFG) as honest:
        async with raw(port_of(victim)) as (reader, writer):
            writer.write(garbage)
            assert await closed_by_peer(reader)
        await still_serves(victim, honest)


async def test_silent_connection_is_dropped_after_the_handshake_timeout() -> None:
    async with DirectTransport(VICTIM, CFG) as victim:
        async with raw(port_of(victim)) as (reader, _):
            assert await closed_by_peer(reader, within=10)
        assert len(victim.plane.conns_all) == 0


async def test_authenticated_peer_sending_an_oversized_frame_is_dropped_and_scored() -> None:
    async with DirectTransport(VICTIM, CFG) as victim, DirectTransport(HONEST, CFG) as honest:
        async with raw(port_of(victim)) as (reader, writer):
            await handshake(reader, writer, MALLORY)
            writer.write(struct.pack(">I", (1 << 20) + TAG_LEN + 1))
            assert await closed_by_peer(reader)
        assert victim.score(MALLORY.peer_id) < 0
        await still_serves(victim, honest)


async def test_frame_failing_authentication_is_dropped_and_scored() -> None:
    async with DirectTransport(VICTIM, CFG) as victim:
        async with raw(port_of(victim)) as (reader, writer):
            session = await handshake(reader, writer, MALLORY)
            frame = bytearray(sealed(session, b"x" * 100))
            frame[10] ^= 1
            writer.write(bytes(frame))
            assert await closed_by_peer(reader)
        assert victim.score(MALLORY.peer_id) < 0
        assert MALLORY.peer_id not in victim.connected_peers()


async def test_peer_stalling_mid_frame_times_out_and_is_scored() -> None:
    async with DirectTransport(VICTIM, CFG) as victim, DirectTransport(HONEST, CFG) as honest:
        async with raw(port_of(victim)) as (reader, writer):
            session = await handshake(reader, writer, MALLORY)
            frame = sealed(session, b"y" * 1000)
            writer.write(frame[:100])  # then nothing
            assert await closed_by_peer(reader, within=10)
        assert victim.score(MALLORY.peer_id) < 0
        await still_serves(victim, honest)


async def test_repeat_offender_is_banned() -> None:
    async with DirectTransport(VICTIM, CFG) as victim:
        for _ in range(3):
            async with raw(port_of(victim)) as (reader, writer):
                await handshake(reader, writer, MALLORY)
                writer.write(struct.pack(">I", 0xFFFFFFF0))
                assert await closed_by_peer(reader)
        async with raw(port_of(victim)) as (reader, writer):
            await handshake(reader, writer, MALLORY)
            assert await closed_by_peer(reader)  # refused after authenticating
        async with DirectTransport(MALLORY, CFG) as mallory:
            with pytest.raises(PeerUnreachable):
                await mallory.connect(victim.listen_addresses[0])


async def test_hundreds_of_connections_are_bounded_and_others_are_served() -> None:
    async with DirectTransport(VICTIM, CFG) as victim, DirectTransport(HONEST, CFG) as honest:
        await honest.connect(victim.listen_addresses[0])
        async with contextlib.AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(raw(port_of(victim)))
                     for _ in range(200)]
            await asyncio.sleep(0.1)
            assert len(victim.plane.conns_all) <= CFG.max_connections
            await still_serves(victim, honest)
            closed = await asyncio.gather(*(closed_by_peer(r, within=10) for r, _ in conns))
            assert all(closed)
        assert victim.plane.peers() == frozenset({honest.peer_id})


async def test_too_many_connections_from_one_peer_are_refused() -> None:
    async with DirectTransport(VICTIM, CFG) as victim, DirectTransport(MALLORY, CFG) as m:
        await m.connect(victim.listen_addresses[0], connections=2)
        with pytest.raises(PeerUnreachable):  # the server closes: over its per-peer limit
            await m.plane.connect("127.0.0.1", port_of(victim), VICTIM.peer_id)
        assert victim.score(MALLORY.peer_id) < 0


async def test_libp2p_peer_opening_hundreds_of_streams_is_cut_off() -> None:
    cfg = NodeConfig(data_plane=None)
    async with (
        Libp2pNode(ident(1), cfg) as victim,
        Libp2pNode(ident(2), NodeConfig(data_plane=None,
                                        bootstrap=victim.listen_addresses)) as honest,
        Libp2pNode(ident(3), NodeConfig(data_plane=None,
                                        bootstrap=victim.listen_addresses)) as mallory,
    ):
        from libp2p.custom_types import TProtocol

        host, target = mallory.libp2p_host, victim.libp2p_host.get_id()
        opened = 0

        async def flood() -> None:
            nonlocal opened
            with trio.move_on_after(15):
                for _ in range(300):
                    with contextlib.suppress(Exception):
                        await host.new_stream(target, [TProtocol(MSG_PROTOCOL)])
                        opened += 1
                    if victim.score(mallory.peer_id) <= victim._scores.config.ban_below:
                        return

        await mallory.trio_guest.run(flood)
        assert victim.score(mallory.peer_id) <= victim._scores.config.ban_below
        assert opened < 300
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while mallory.peer_id in victim.connected_peers():
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        await honest.send(victim.peer_id, b"served")
        drained = []
        while True:
            msg = await asyncio.wait_for(victim.recv(), 10)
            drained.append(msg.peer_id)
            if msg.payload == b"served":
                break
        assert drained[-1] == honest.peer_id
        with pytest.raises(PeerUnreachable):
            await victim.connect(mallory.listen_addresses[0])


async def test_libp2p_oversized_frame_drops_the_peer() -> None:
    async with (
        Libp2pNode(ident(1), NodeConfig(data_plane=None, max_message_bytes=1 << 16)) as victim,
        Libp2pNode(ident(3), NodeConfig(data_plane=None,
                                        bootstrap=victim.listen_addresses)) as mallory,
    ):
        from libp2p.custom_types import TProtocol

        host, target = mallory.libp2p_host, victim.libp2p_host.get_id()

        async def send_huge_header() -> None:
            stream = await host.new_stream(target, [TProtocol(MSG_PROTOCOL)])
            await stream.write(struct.pack(">I", 1 << 30))

        await mallory.trio_guest.run(send_huge_header)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while victim.score(mallory.peer_id) >= 0:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        assert victim.score(mallory.peer_id) < 0


async def test_plaintext_libp2p_peer_cannot_connect_under_a_claimed_identity() -> None:
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from multiaddr import Multiaddr

    async with Libp2pNode(ident(1), NodeConfig(data_plane=None)) as victim:
        guest = victim.trio_guest
        key_pair = create_new_key_pair(ident(5).seed)
        attacker = new_host(key_pair=key_pair, sec_opt={
            TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(key_pair)})

        async def try_plaintext() -> str:
            async with attacker.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                try:
                    with trio.fail_after(10):
                        await attacker.connect(info_from_p2p_addr(
                            Multiaddr(victim.listen_addresses[0])))
                except Exception as exc:
                    return f"refused: {type(exc).__name__}"
                finally:
                    for peer in attacker.get_connected_peers():
                        await attacker.disconnect(peer)
            return "connected"

        assert (await guest.run(try_plaintext)).startswith("refused")
        assert victim.connected_peers() == frozenset()


async def test_a_flooding_peer_stalls_only_its_own_connection() -> None:
    cfg = DataPlaneConfig(inbox_bytes=8 << 20, inbox_peer_bytes=1 << 20, crypto_threads=0)
    async with (
        DirectTransport(VICTIM, cfg) as victim,
        DirectTransport(MALLORY, cfg) as mallory,
        DirectTransport(HONEST, cfg) as honest,
    ):
        await mallory.connect(victim.listen_addresses[0])
        await honest.connect(victim.listen_addresses[0])

        async def flood() -> None:
            for _ in range(200):
                await mallory.send(VICTIM.peer_id, bytes(256 << 10))

        flooder = asyncio.create_task(flood())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while victim._inbox.queued_bytes < 1 << 20:  # mallory reached its share
            assert loop.time() < deadline
            await asyncio.sleep(0.01)
        await honest.send(VICTIM.peer_id, b"me too")
        # Whatever mallory queued stays bounded, and the honest message gets in anyway.
        got = [await asyncio.wait_for(victim.recv(), 5) for _ in range(8)]
        assert b"me too" in [m.payload for m in got]
        assert victim._inbox.queued_bytes <= (1 << 20) + (512 << 10)
        flooder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flooder
