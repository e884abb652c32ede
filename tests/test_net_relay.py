"""The relay on loopback: two private nodes (listening on 127.0.0.2/3, seen from
127.0.0.1, as behind a NAT) reserve on a bootstrap's relay, advertise circuit addresses,
and trade messages both ways through it, end-to-end authenticated; the relay's limits
hold against hostile or greedy input."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from swarm.errors import DecodeError
from swarm.identity import Identity
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.net.relay import (
    RelayConfig,
    RelayRefused,
    RelayServer,
    TokenBucket,
    circuit,
    open_to_relay,
    reserve,
    sock_read_msg,
    sock_send_msg,
)
from swarm.net.relay_msgs import Msg, circuit_address, decode, parse_circuit
from swarm.net.transport import Path, PeerUnreachable
from swarm.net.traversal import TraversalConfig
from swarm.wire.frames import encode_header

pytestmark = pytest.mark.timeout(90)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([0x40 + i]) * 32)


async def _recv_from(node: Libp2pNode, peer: str, timeout: float = 10.0) -> bytes:
    async with asyncio.timeout(timeout):
        while True:
            msg = await node.recv()
            if msg.peer_id == peer:
                return msg.payload


def test_circuit_addresses_round_trip() -> None:
    a = ident(1).peer_id
    r = ident(2).peer_id
    addr = circuit_address("10.0.0.1", 4011, r, a)
    c = parse_circuit(addr)
    assert c is not None and (c.relay_host, c.relay_port, c.relay_id, c.peer_id) == \
        ("10.0.0.1", 4011, r, a)
    assert parse_circuit(f"/ip4/10.0.0.1/tcp/4001/p2p/{a}") is None
    assert parse_circuit(addr.replace("4011", "99999")) is None


def test_messages_are_strict() -> None:
    m = Msg("connect", to="x" * 10)
    assert decode(m.encode(), "connect") == m
    with pytest.raises(DecodeError):
        decode(m.encode(), "accept")
    with pytest.raises(DecodeError):
        decode(Msg("connect", to="x" * 65).encode(), "connect")
    with pytest.raises(DecodeError):
        decode(b"\x81\xa1t\xa3bad", "connect")


def test_token_bucket_paces() -> None:
    now = [0.0]
    b = TokenBucket(1000.0, clock=lambda: now[0])
    assert b.delay(1000) == 0.0
    assert b.delay(500) == pytest.approx(0.5)
    now[0] = 2.0
    assert b.delay(400) == 0.0  # refilled to one second's worth at most


async def test_two_private_nodes_trade_through_the_relay() -> None:
    boot_cfg = NodeConfig(run="relay", data_plane=None, relay=RelayConfig(host=""))
    async with Libp2pNode(ident(0), boot_cfg) as boot:
        assert boot._directory.metadata().relay.startswith("127.0.0.1:")
        addr = boot.listen_addresses[0]
        trav = TraversalConfig(punch=False)

        def private(i: int) -> NodeConfig:
            return NodeConfig(listen=f"/ip4/127.0.0.{i + 1}/tcp/0", run="relay",
                              bootstrap=(addr,), traversal=trav)

        async with Libp2pNode(ident(1), private(1)) as a, \
                Libp2pNode(ident(2), private(2)) as b:
            assert a.reachability == b.reachability == "private"
            (b_addr,) = b._directory.metadata().addrs
            assert "/p2p-circuit/" in b_addr and b_addr.endswith(b.peer_id)
            assert await a.connect(b_addr) == b.peer_id
            assert a.path(b.peer_id) is Path.DIRECT
            await a.send(b.peer_id, b"over the relay")
            assert await _recv_from(b, a.peer_id) == b"over the relay"
            big = bytes(range(256)) * 4096  # 1 MiB back the other way
            await b.send(a.peer_id, big)
            assert await _recv_from(a, b.peer_id) == big
            assert boot.relay is not None
            stats = boot.relay.stats
            assert stats.circuits == 1
            assert stats.relayed_bytes > len(big)
            assert stats.by_peer[b.peer_id] == stats.relayed_bytes
            assert a.traversal.stats.relayed_out == 1
            assert b.traversal.stats.relayed_in == 1
            # A public node does not dial circuits (the private peer dials it).
            cfg = NodeConfig(run="relay", bootstrap=(addr,))
            async with Libp2pNode(ident(3), cfg) as pub:
                assert pub.reachability == "public"
                with pytest.raises(PeerUnreachable, match="dials public peers"):
                    await pub.connect(b_addr)


async def test_private_nodes_punch_or_stay_relayed() -> None:
    """With hole punching on, the two still trade (a loopback punch may or may not win
    its race; the lab measures it behind real NATs)."""
    boot_cfg = NodeConfig(run="relay", data_plane=None, relay=RelayConfig(host=""))
    async with Libp2pNode(ident(0), boot_cfg) as boot:
        addr = boot.listen_addresses[0]
        trav = TraversalConfig(punch_deadline=2.0, standby_grace=0.5)

        def private(i: int) -> NodeConfig:
            return NodeConfig(listen=f"/ip4/127.0.0.{i + 1}/tcp/0", run="relay",
                              bootstrap=(addr,), traversal=trav)

        async with Libp2pNode(ident(1), private(1)) as a, \
                Libp2pNode(ident(2), private(2)) as b:
            await a.connect(b._directory.metadata().addrs[0])
            await asyncio.sleep(3.0)
            for i in range(5):
                await a.send(b.peer_id, b"ping %d" % i)
                assert await _recv_from(b, a.peer_id) == b"ping %d" % i
            assert a.traversal.stats.punch_attempts == 1


async def test_relay_limits_hold() -> None:
    owner = ident(5)
    cfg = RelayConfig(max_reservations=1, max_circuits=1, circuit_bytes=64 << 10,
                      rate=1e9, preamble_timeout=1.0, max_pending=4)
    async with RelayServer(ident(6), cfg) as relay:
        assert relay.address is not None
        host, port = relay.address
        # A forged reservation (someone else's key, a signature over nothing) is refused.
        sock, _nonce = await open_to_relay(host, port, 2.0)
        with contextlib.closing(sock):
            await sock_send_msg(sock, Msg("reserve", key=owner.public_key, sig=bytes(64)))
            with pytest.raises(RelayRefused, match="signature"):
                await sock_read_msg(sock, "ok")
        # An oversized frame header is refused before anything is read into memory.
        sock, _nonce = await open_to_relay(host, port, 2.0)
        with contextlib.closing(sock):
            await asyncio.get_running_loop().sock_sendall(sock, encode_header(1 << 30))
            with pytest.raises((RelayRefused, ConnectionError)):
                await sock_read_msg(sock, "ok")
        # A connect to nobody, and a silent connection, are refused or timed out.
        with pytest.raises(RelayRefused, match="no reservation"):
            await circuit(host, port, Msg("connect", to=owner.peer_id), 2.0)
        silent = socket.create_connection((host, port))
        ctl, _seen = await reserve(owner, host, port, 2.0)
        with pytest.raises(RelayRefused, match="too many reservations"):
            await reserve(ident(7), host, port, 2.0)

        async def accept_all() -> None:
            while True:
                msg = await sock_read_msg(ctl, "incoming")
                s, _ = await circuit(host, port, Msg("accept", id=msg.id), 2.0)
                accepted.append(s)

        accepted: list[socket.socket] = []
        task = asyncio.create_task(accept_all())
        try:
            a, _ = await circuit(host, port, Msg("connect", to=owner.peer_id), 2.0)
            with pytest.raises(RelayRefused, match="too many circuits"):
                await circuit(host, port, Msg("connect", to=owner.peer_id), 2.0)
            # Over its byte limit, the circuit is cut.
            loop = asyncio.get_running_loop()
            with contextlib.suppress(OSError):
                for _ in range(32):
                    await loop.sock_sendall(a, bytes(16 << 10))
            await asyncio.sleep(0.3)
            assert relay.stats.relayed_bytes <= cfg.circuit_bytes
            assert relay.stats.refused.get("circuit byte limit") == 1
            assert relay.stats.circuits_open == 0
            a.close()
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            for s in accepted:
                s.close()
            ctl.close()
            await asyncio.sleep(1.2)
            silent.close()
        assert relay._pending == 0
