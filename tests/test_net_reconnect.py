"""A node restarted on the same port with the same identity is found again within seconds.

Real py-libp2p nodes and data planes on loopback. While the "trainer" is down, dials to it
fail; py-libp2p then refuses to dial that peer for 60 s, and may hand a later dial its
old, closed connection: :meth:`Libp2pNode.connect` must see through both. A rollout peer's
reconnect loop (or its look at the run's directory, whichever dials first) then brings it
back to verifying versions and doing leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
import trio

from swarm.demo.model import TinyModelConfig, build_model, inference_state
from swarm.engines.torch_engine import TorchEngine
from swarm.identity import Identity
from swarm.net import topics
from swarm.net.node import META_PROTOCOL, MSG_PROTOCOL, Libp2pNode, NodeConfig
from swarm.net.transport import Path as NetPath
from swarm.net.transport import PeerUnreachable
from swarm.protocol.leases import Sampling
from swarm.roles.peer import PeerConfig, RolloutPeer
from swarm.roles.trainer import TrainerConfig, TrainerNode

pytestmark = pytest.mark.timeout(60)

TRAINER = Identity.from_seed(b"T" * 32)
PEER = Identity.from_seed(b"P" * 32)
#: How soon after the restarted node listens the other one must be back.
BACK_WITHIN = 10.0
CFG = TinyModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64, seed=3)
PIECE = 1 << 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def trainer_config(port: int, run: str | None = None) -> NodeConfig:
    return NodeConfig(listen=f"/ip4/127.0.0.1/tcp/{port}", run=run)


async def until_gone(node: Libp2pNode, peer: str) -> None:
    """Wait for ``node``'s event saying ``peer`` is disconnected."""
    while peer in node.connected_peers():
        ev = await node.next_event()
        if ev.peer_id == peer and not ev.connected:
            return


async def test_node_restarted_on_its_port_is_redialed_and_messages_flow() -> None:
    port = free_port()
    async with Libp2pNode(PEER) as peer:
        async with Libp2pNode(TRAINER, trainer_config(port)) as first:
            address = first.listen_addresses[0]
            assert await peer.connect(address) == TRAINER.peer_id
            assert peer.path(TRAINER.peer_id) is NetPath.DIRECT
        async with asyncio.timeout(10):
            await until_gone(peer, TRAINER.peer_id)
        # Dials while it is down fail, promptly (py-libp2p now remembers the failure).
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(PeerUnreachable):
                await peer.connect(address)
            assert time.monotonic() - started < 5
        async with Libp2pNode(TRAINER, trainer_config(port)) as second:
            assert second.listen_addresses[0] == address
            started = time.monotonic()
            assert await peer.connect(address) == TRAINER.peer_id
            took = time.monotonic() - started
            assert took < BACK_WITHIN, f"reconnect took {took:.1f} s"
            assert peer.path(TRAINER.peer_id) is NetPath.DIRECT
            async with asyncio.timeout(10):
                await peer.send(TRAINER.peer_id, b"to the new trainer")
                got = await second.recv()
                assert (got.peer_id, got.payload) == (PEER.peer_id, b"to the new trainer")
                await second.send(PEER.peer_id, b"to the peer")
                back = await peer.recv()
                assert (back.peer_id, back.payload) == (TRAINER.peer_id, b"to the peer")


async def test_node_without_data_plane_is_redialed_over_libp2p_streams() -> None:
    port = free_port()
    no_plane = NodeConfig(data_plane=None)
    async with Libp2pNode(PEER, no_plane) as peer:
        cfg = NodeConfig(listen=f"/ip4/127.0.0.1/tcp/{port}", data_plane=None)
        async with Libp2pNode(TRAINER, cfg) as first:
            address = first.listen_addresses[0]
            await peer.connect(address)
            assert peer.path(TRAINER.peer_id) is NetPath.LIBP2P
        async with asyncio.timeout(10):
            await until_gone(peer, TRAINER.peer_id)
        with pytest.raises(PeerUnreachable):
            await peer.connect(address)
        async with Libp2pNode(TRAINER, cfg) as second:
            started = time.monotonic()
            await peer.connect(address)
            assert time.monotonic() - started < BACK_WITHIN
            assert peer.path(TRAINER.peer_id) is NetPath.LIBP2P
            async with asyncio.timeout(10):
                await peer.send(TRAINER.peer_id, b"again")
                got = await second.recv()
            assert (got.peer_id, got.payload) == (PEER.peer_id, b"again")


async def test_a_node_whose_streams_hang_is_unreachable_within_bounded_time() -> None:
    from libp2p.custom_types import TProtocol

    async def hang(stream: object) -> None:
        await trio.sleep_forever()

    quick = NodeConfig(stream_setup_timeout=0.5, connect_timeout=2.0)
    async with Libp2pNode(TRAINER) as stuck, Libp2pNode(PEER, quick) as peer:
        for protocol in (META_PROTOCOL, MSG_PROTOCOL):
            stuck.libp2p_host.set_stream_handler(TProtocol(protocol), hang)
        started = time.monotonic()
        with pytest.raises(PeerUnreachable):
            await peer.connect(stuck.listen_addresses[0])
        took = time.monotonic() - started
        # One short try on the first connection, one full one on a redialed connection.
        assert took < 0.5 + 2.0 + 2 * 2.0, f"took {took:.1f} s"
        assert TRAINER.peer_id not in peer.connected_peers()


async def test_a_node_serving_no_metadata_is_reached_over_libp2p_streams() -> None:
    from libp2p.custom_types import TProtocol

    async with Libp2pNode(TRAINER) as other, Libp2pNode(PEER) as peer:
        other.libp2p_host.remove_stream_handler(TProtocol(META_PROTOCOL))
        await peer.connect(other.listen_addresses[0])
        assert peer.path(TRAINER.peer_id) is NetPath.LIBP2P
        async with asyncio.timeout(10):
            await peer.send(TRAINER.peer_id, b"no metadata")
            got = await other.recv()
        assert (got.peer_id, got.payload) == (PEER.peer_id, b"no metadata")


@contextlib.asynccontextmanager
async def running_trainer(port: int, data_dir: Path
                          ) -> AsyncIterator[tuple[Libp2pNode, TrainerNode]]:
    async with Libp2pNode(TRAINER, trainer_config(port, "rc")) as node, TrainerNode(
            TRAINER, node, TrainerConfig(run="rc", data_dir=data_dir, piece_size=PIECE,
                                         chunk_target=1 << 10)) as trainer:
        yield node, trainer


def nudge(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < 0.02
            p.add_(mask * torch.randn(p.shape, generator=gen) * 1e-2)


class _Redials(logging.Handler):
    """Sets an event when the peer's reconnect loop logs a refused libp2p dial (the one
    py-libp2p remembers, refusing later dials to that peer for a minute)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("redial ") and "libp2p dial of" in text:
            self.failed.set()


async def test_rollout_peer_is_back_within_seconds_of_the_trainer_restarting(
        tmp_path: Path) -> None:
    port = free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{TRAINER.peer_id}"
    master = build_model(CFG)
    events: list[tuple[str, dict[str, object]]] = []
    redials = _Redials()
    peer_log = logging.getLogger("swarm.roles.discovery")
    old_level = peer_log.level
    peer_log.setLevel(logging.DEBUG)
    peer_log.addHandler(redials)
    try:
        async with contextlib.AsyncExitStack() as stack:
            async with running_trainer(port, tmp_path / "t") as (_, trainer):
                await trainer.publish(inference_state(master))
                pnode = await stack.enter_async_context(
                    Libp2pNode(PEER, NodeConfig(run="rc", bootstrap=(address,))))
                peer = await stack.enter_async_context(RolloutPeer(
                    PEER, pnode, PeerConfig(run="rc", trainer=TRAINER.peer_id, want_tasks=2,
                                            bootstrap=(address,)),
                    inference_state(build_model(CFG)),
                    TorchEngine(build_model(CFG, dtype=torch.bfloat16)),
                    status=lambda ev, f: events.append((ev, f))))
                nudge(master, 1)
                await trainer.publish(inference_state(master))
                async with asyncio.timeout(30):
                    await peer.wait_version(1)
            # The trainer is gone: the peer notices and its redials fail for a while.
            async with asyncio.timeout(20):
                await redials.failed.wait()
            assert TRAINER.peer_id not in pnode.connected_peers()
            async with running_trainer(port, tmp_path / "t") as (tnode, trainer):
                listening = time.monotonic()
                assert trainer.step == 1
                async with asyncio.timeout(BACK_WITHIN):
                    while TRAINER.peer_id not in pnode.connected_peers():
                        await asyncio.sleep(0.02)
                back = time.monotonic() - listening
                # As a trainer waits for its peers: the next announcement must reach them.
                await tnode.wait_for_mesh(topics.manifests("rc"), 1, timeout=BACK_WITHIN)
                nudge(master, 2)
                await trainer.publish(inference_state(master))
                tasks = trainer.add_tasks([("after", [1, 2, 3])], group_size=2,
                                          sampling=Sampling(max_tokens=3, seed=1))
                async with asyncio.timeout(BACK_WITHIN):
                    await peer.wait_version(2)
                accepted = await trainer.collect(len(tasks), timeout=BACK_WITHIN)
                working = time.monotonic() - listening
                assert {r.task_id for a in accepted for r in a.results} == \
                    {t.task_id for t in tasks}
                assert working < 2 * BACK_WITHIN, f"back in {back:.1f} s, working {working:.1f} s"
    finally:
        peer_log.removeHandler(redials)
        peer_log.setLevel(old_level)
    assert [f["version"] for ev, f in events if ev == "verified"] == [0, 1, 2]
