"""A sharded trainer's versions through a swarm: rank 0's TrainerNode and rank 1's
SeederNode each seed their own chunks, and peers reach every version bit-exactly.

The versions come from a real 2-rank FSDP2 job (tests/sharded_job.py); the swarm runs on
the in-memory network: the trainer, the seeder of rank 1 (named in every manifest), and
three peers that start at version 0 as the run card's peers do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_job import MODEL, run, seeder

from swarm.content.manifest import SignedManifest
from swarm.delta.sharded import ShardedVersion
from swarm.delta.state import state_root_of
from swarm.demo.model import build_model
from swarm.engines.torch_engine import TorchEngine
from swarm.errors import LocalProtocolError
from swarm.identity import Identity
from swarm.net.memory import LinkProfile, MemoryNetwork
from swarm.roles.peer import PeerConfig, RolloutPeer
from swarm.roles.seeder import SeederConfig, SeederNode
from swarm.roles.trainer import TrainerConfig, TrainerNode

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.long]

PIECE = 4096


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Identity]:
    out = tmp_path_factory.mktemp("sharded-job")
    assert run(2, out, steps=3, piece_size=PIECE) == [0, 0]
    rec: dict[str, Any] = torch.load(out / "record.pt", weights_only=False)
    return rec, Identity.from_seed((out / "key").read_bytes())


def _versions(rec: dict[str, Any], rank: int) -> list[ShardedVersion]:
    out = []
    for data in rec["versions"]:
        sm = SignedManifest.decode(data)
        step = sm.manifest.step
        out.append(ShardedVersion(
            step, sm.manifest.target_root, sm, rec["rank_chunks"][step][rank],
            rec["pieces"][step] if rank == 0 else (), 0, 0, 0.0,
            sm.manifest.layout_digest, sm.manifest.piece_size))
    return out


async def test_sharded_trainer_and_a_seeder_host_serve_peers_every_version(
        tmp_path: Path, job: tuple[dict[str, Any], Identity]) -> None:
    rec, key = job
    states = rec["states"]
    net = MemoryNetwork(default=LinkProfile(bandwidth=20e6, latency=0.002), seed=4)
    host = seeder(1)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(key))
        trainer = await stack.enter_async_context(TrainerNode(
            key, tnet, TrainerConfig(run="sharded-test", data_dir=tmp_path, piece_size=PIECE)))
        snet = await stack.enter_async_context(net.transport(host))
        seed_node = await stack.enter_async_context(SeederNode(
            host, snet, SeederConfig(run="sharded-test", trainer=key.peer_id)))
        root0 = state_root_of(states[0], PIECE)
        first = _versions(rec, 0)[0]
        start = dataclasses.replace(first, step=0, root=root0, manifest=None, chunks={},
                                    pieces=rec["pieces"][0])
        v0 = await trainer.publish_sharded(start)  # what the run card names as version 0
        assert v0.manifest.manifest.kind == "keyframe"
        assert v0.manifest.manifest.target_root == root0
        peers: list[RolloutPeer] = []
        for i in range(3):
            ident = Identity.from_seed(bytes([i + 1]) * 32)
            pnet = await stack.enter_async_context(net.transport(ident))
            for other in (tnet, snet, *(p.net for p in peers)):
                await pnet.connect(other.listen_addresses[0])
            peers.append(await stack.enter_async_context(RolloutPeer(
                ident, pnet, PeerConfig(run="sharded-test", trainer=key.peer_id),
                {k: v.clone() for k, v in states[0].items()},
                TorchEngine(build_model(MODEL, dtype=torch.bfloat16)), start=(0, root0))))
        for mine, theirs in zip(_versions(rec, 0), _versions(rec, 1), strict=True):
            seed_node.seed(theirs)
            pub = await trainer.publish_sharded(mine)
            assert pub.step == mine.step
            async with asyncio.timeout(60):
                for p in peers:
                    await p.wait_version(mine.step)
            want = state_root_of(states[mine.step], PIECE)
            for p in peers:
                assert p.root == want and state_root_of(p.state, PIECE) == want
        # a newcomer with other weights gets a keyframe of the newest version from the
        # peers that hold it (the sharded trainer holds no full state)
        ident = Identity.from_seed(b"L" * 32)
        lnet = await stack.enter_async_context(net.transport(ident))
        for other in (tnet, snet, *(p.net for p in peers)):
            await lnet.connect(other.listen_addresses[0])
        late = await stack.enter_async_context(RolloutPeer(
            ident, lnet, PeerConfig(run="sharded-test", trainer=key.peer_id),
            {k: torch.zeros_like(v) for k, v in states[0].items()},
            TorchEngine(build_model(MODEL, dtype=torch.bfloat16))))
        async with asyncio.timeout(60):
            await late.wait_version(3)
        assert state_root_of(late.state, PIECE) == state_root_of(states[3], PIECE)
        assert late.verified == 1
        # every peer took the seeder for the trainer's, and both hosts uploaded their own
        for p in peers:
            assert p.discovery.seeders == {host.peer_id} and p.verify_failures == 0
        rank1_bytes = sum(len(c) for v in _versions(rec, 1) for c in v.chunks.values())
        assert seed_node.bytes_up >= rank1_bytes > 0
        assert trainer.driver.exchange.bytes_up > 0
        # a version signed by another key is refused by the seeder
        first = _versions(rec, 1)[0]
        assert first.manifest is not None
        forged = dataclasses.replace(first, manifest=first.manifest.manifest.sign(host))
        with pytest.raises(LocalProtocolError, match="not signed by the trainer"):
            seed_node.seed(forged)
        # the trainer refuses a step again, and full states once it publishes sharded ones
        with pytest.raises(LocalProtocolError, match="not ahead"):
            await trainer.publish_sharded(_versions(rec, 0)[-1])
        with pytest.raises(LocalProtocolError, match="sharded"):
            await trainer.publish(states[3])
