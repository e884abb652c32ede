"""The dial-back reachability check on loopback: a node the bootstrap can dial back at
the address it listens on advertises it; one seen at another address (as behind a NAT)
advertises none, and the directory's dialers skip it."""

from __future__ import annotations

import asyncio

import pytest

from swarm.identity import Identity
from swarm.net.node import Libp2pNode, NodeConfig

pytestmark = pytest.mark.timeout(90)


def ident(i: int) -> Identity:
    return Identity.from_seed(bytes([0x70 + i]) * 32)


async def test_reachable_node_advertises_and_unreachable_one_does_not() -> None:
    async with Libp2pNode(ident(0), NodeConfig(run="reach")) as boot:
        addr = boot.listen_addresses[0]
        async with Libp2pNode(ident(1), NodeConfig(run="reach", bootstrap=(addr,))) as a:
            assert a.reachability == "public"
            assert a.reach is not None and a.reach.observed == "127.0.0.1"
            assert a.data_address is not None
            assert set(a.reach.open) == {int(a.listen_addresses[0].split("/")[4]),
                                         a.data_address[1]}
            meta = a._directory.metadata()
            assert meta.addrs == a.listen_addresses and meta.data_addr
        # Listening on 127.0.0.2, its connections come from 127.0.0.1: the bootstrap
        # sees it at an address it does not listen on, as a NAT would show it.
        cfg = NodeConfig(listen="/ip4/127.0.0.2/tcp/0", run="reach", bootstrap=(addr,))
        async with Libp2pNode(ident(2), cfg) as b:
            assert b.reachability == "private"
            assert b.reach is not None and b.reach.observed == "127.0.0.1"
            meta = b._directory.metadata()
            assert meta.addrs == () and meta.data_addr == ""
            # It still reaches out, and the connection it dialled carries messages
            # both ways.
            assert boot.peer_id in b.connected_peers()
            assert b.peer_id in boot.connected_peers()
            await boot.send(b.peer_id, b"to the dialler")
            got = await asyncio.wait_for(b.recv(), 10)
            assert (got.peer_id, got.payload) == (boot.peer_id, b"to the dialler")
            await b.send(boot.peer_id, b"from it")
            got = await asyncio.wait_for(boot.recv(), 10)
            assert (got.peer_id, got.payload) == (b.peer_id, b"from it")
        # On every interface, with the bootstrap reached over loopback: nothing learnt
        # about other hosts (the lab's --listen-any run checks the address advertised).
        cfg = NodeConfig(listen="/ip4/0.0.0.0/tcp/0", run="reach", bootstrap=(addr,))
        async with Libp2pNode(ident(5), cfg) as c:
            assert c.reachability == "unknown"
            assert c._directory.metadata().addrs == c.listen_addresses
        assert boot._reach_server.served == 3


async def test_no_check_without_bootstrap_or_when_off() -> None:
    async with Libp2pNode(ident(3), NodeConfig(run="reach")) as boot:
        assert boot.reachability == "unknown" and boot.reach is None
        cfg = NodeConfig(run="reach", bootstrap=(boot.listen_addresses[0],), check_reach=False)
        async with Libp2pNode(ident(4), cfg) as a:
            assert a.reachability == "unknown"
            assert a._directory.metadata().addrs == a.listen_addresses
