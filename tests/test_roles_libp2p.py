"""1 trainer + 6 peers on real libp2p nodes and the real data plane, on loopback.

A multi-chunk delta spreads through the swarm while one peer serves corrupt bytes and
another is killed mid-transfer: every honest survivor verifies the signed root, and the
corrupt peer is banned by those it served.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from swarm.delta.state import state_root_of
from swarm.demo.model import TinyModelConfig, build_model, inference_state
from swarm.engines.torch_engine import TorchEngine
from swarm.identity import Identity
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.roles.peer import PeerConfig, RolloutPeer
from swarm.roles.trainer import TrainerConfig, TrainerNode

CFG = TinyModelConfig(vocab_size=32, hidden_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, intermediate_size=256, seed=5)
PIECE = 1 << 14


@pytest.mark.timeout(240)
async def test_six_peers_verify_a_multichunk_delta_despite_a_corrupt_and_a_dead_peer(
        tmp_path: Path) -> None:
    trainer_id = Identity.from_seed(b"S" * 32)
    master = build_model(CFG)
    async with contextlib.AsyncExitStack() as stack:
        tnode = await stack.enter_async_context(
            Libp2pNode(trainer_id, NodeConfig(run="six")))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnode, TrainerConfig(run="six", data_dir=tmp_path, piece_size=PIECE,
                                             chunk_target=2 << 10)))
        await trainer.publish(inference_state(master))
        peers: list[RolloutPeer] = []
        nodes: list[Libp2pNode] = []
        for i in range(6):
            ident = Identity.from_seed(bytes([0x40 + i]) * 32)
            node = Libp2pNode(ident, NodeConfig(
                run="six", bootstrap=(tnode.listen_addresses[0],), region=f"r{i % 2}",
                metadata_interval=0.5))
            await node.__aenter__()
            nodes.append(node)
            peer = RolloutPeer(ident, node, PeerConfig(run="six", trainer=trainer_id.peer_id,
                                                      region=f"r{i % 2}",
                                                      discover_interval=0.2),
                               inference_state(build_model(CFG)),
                               TorchEngine(build_model(CFG, dtype=torch.bfloat16)))
            await peer.__aenter__()
            peers.append(peer)
        try:
            async with asyncio.timeout(60):
                for p in peers:
                    await p.wait_version(0)
            corrupt, victim, honest = peers[0], peers[1], peers[2:]
            corrupt.driver.corrupt_uploads = True
            with torch.no_grad():
                gen = torch.Generator().manual_seed(0)
                for prm in master.parameters():
                    mask = torch.rand(prm.shape, generator=gen) < 0.2
                    prm.add_(mask * torch.randn(prm.shape, generator=gen) * 1e-2)
            async with asyncio.timeout(60):
                pub = await trainer.publish(inference_state(master))
            assert len(pub.manifest.manifest.chunks) >= 8
            # Kill one peer as soon as it holds part of the delta.
            obj = pub.manifest.id
            async with asyncio.timeout(60):
                while not victim.driver.has_object(obj) or \
                        victim.driver.exchange.progress(obj)[0] == 0:
                    await asyncio.sleep(0.01)
            held, total = victim.driver.exchange.progress(obj)
            assert 0 < held < total  # killed mid-transfer
            async with asyncio.timeout(90):
                await victim.__aexit__(None, None, None)
                await nodes[1].aclose()
            async with asyncio.timeout(90):
                for p in honest:
                    await p.wait_version(1)
            want = state_root_of(inference_state(master), PIECE)
            for p in honest:
                assert p.root == want and p.verify_failures == 0
                assert state_root_of(p.state, PIECE) == want
            served_by_corrupt = [p for p in honest
                                 if corrupt.net.peer_id in {b for b, _ in p.bans}]
            got_from_corrupt = corrupt.driver.exchange.bytes_up > 0
            # Whoever got a chunk from the corrupt peer detected it and banned it.
            assert not got_from_corrupt or served_by_corrupt
        finally:
            for p, node in zip(peers, nodes, strict=True):
                if p is not peers[1]:
                    await p.__aexit__(None, None, None)
                    await node.aclose()


@pytest.mark.timeout(120)
async def test_the_trainers_exchange_follows_a_peers_new_uplink(tmp_path: Path) -> None:
    """A peer measures a new uplink and says so (``update_metadata``): its next signed
    metadata on the peers topic carries it, and the trainer's exchange, connected to it
    since before, uses the new figure (the source choice and the region's import ranks
    depend on it). Before, an exchange kept what it knew at the connection."""
    trainer_id = Identity.from_seed(b"T" * 32)
    ident = Identity.from_seed(b"P" * 32)
    async with contextlib.AsyncExitStack() as stack:
        tnode = await stack.enter_async_context(
            Libp2pNode(trainer_id, NodeConfig(run="meta", region="r0")))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnode, TrainerConfig(run="meta", data_dir=tmp_path, piece_size=PIECE,
                                             chunk_target=2 << 10)))
        await trainer.publish(inference_state(build_model(CFG)))
        node = await stack.enter_async_context(Libp2pNode(ident, NodeConfig(
            run="meta", bootstrap=(tnode.listen_addresses[0],), region="r1",
            upload=5_000_000, metadata_interval=0.5)))
        peer = await stack.enter_async_context(RolloutPeer(
            ident, node, PeerConfig(run="meta", trainer=trainer_id.peer_id, region="r1",
                                    discover_interval=0.2),
            inference_state(build_model(CFG)), TorchEngine(build_model(CFG, dtype=torch.bfloat16))))
        seen = trainer.driver.exchange.neighbour
        async with asyncio.timeout(60):
            await peer.wait_version(0)
            while seen(ident.peer_id) != ("r1", 5e6):
                await asyncio.sleep(0.05)
            node.update_metadata(bandwidth=7_000_000)
            while seen(ident.peer_id) != ("r1", 7e6):
                await asyncio.sleep(0.05)
        assert peer.driver.exchange.neighbour(trainer_id.peer_id) == ("r0", 0.0)
