"""Trainer and rollout peers over the in-memory network: versions verified, leases done."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from swarm.cli.trainer import wait_delivered
from swarm.content.ids import chunk_id
from swarm.content.manifest import SignedManifest
from swarm.delta import EncoderConfig, encode_delta_sync
from swarm.delta.state import keyframe_manifest, piece_views, state_root_of
from swarm.demo.model import TinyModelConfig, build_model, inference_state
from swarm.engines.torch_engine import TorchEngine
from swarm.identity import Identity
from swarm.net import topics
from swarm.net.memory import LinkProfile, MemoryNetwork
from swarm.protocol.exchange import ObjectSpec
from swarm.protocol.leases import Sampling
from swarm.roles.peer import PeerConfig, RolloutPeer, StatusFn
from swarm.roles.trainer import TrainerConfig, TrainerNode

CFG = TinyModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64, seed=3)
PIECE = 1 << 14


def _nudge(model: torch.nn.Module, step: int) -> None:
    """A sparse, training-like change of the master weights."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < 0.02
            p.add_(mask * torch.randn(p.shape, generator=gen) * 1e-2)


async def test_trainer_and_three_peers_follow_versions_and_do_work(tmp_path: Path) -> None:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=1)
    trainer_id = Identity.from_seed(b"T" * 32)
    master = build_model(CFG)
    events: list[tuple[str, str, dict[str, object]]] = []
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="t", data_dir=tmp_path, piece_size=PIECE)))
        first = await trainer.publish(inference_state(master))
        assert first.manifest.manifest.kind == "keyframe"
        peers: list[RolloutPeer] = []
        for i in range(3):
            ident = Identity.from_seed(bytes([i + 1]) * 32)
            pnet = await stack.enter_async_context(net.transport(ident))
            await pnet.connect(tnet.listen_addresses[0])
            for other in peers:
                await pnet.connect(other.net.listen_addresses[0])
            name = f"peer-{i}"
            peers.append(await stack.enter_async_context(RolloutPeer(
                ident, pnet, PeerConfig(run="t", trainer=trainer_id.peer_id, want_tasks=2),
                inference_state(build_model(CFG)),
                TorchEngine(build_model(CFG, dtype=torch.bfloat16)),
                status=lambda ev, f, n=name: events.append((n, ev, f)))))
        for step in (1, 2):
            _nudge(master, step)
            pub = await trainer.publish(inference_state(master))
            assert pub.manifest.manifest.kind == "delta" and pub.ratio > 1
            tasks = trainer.add_tasks(
                [(f"p{step}-{k}", [1, 2, 3]) for k in range(4)], group_size=2,
                sampling=Sampling(temperature=1.0, max_tokens=4, seed=step))
            accepted = await trainer.collect(len(tasks), timeout=60)
            assert {r.task_id for a in accepted for r in a.results} == \
                {t.task_id for t in tasks}
        async with asyncio.timeout(30):
            for p in peers:
                await p.wait_version(2)
        want = state_root_of(inference_state(master), PIECE)
        for p in peers:
            assert p.root == want and p.verify_failures == 0
            assert state_root_of(p.state, PIECE) == want
            engine = p.engine
            assert isinstance(engine, TorchEngine)
            assert state_root_of(dict(engine.model.state_dict()), PIECE) == want
        assert sum(p.tasks_done for p in peers) == 8
        # Claims made before tasks were queued are the only refusals.
        assert set(trainer.leases.stats.refused) <= {"no_work"}
    verified = [e for e in events if e[1] == "verified"]
    assert len(verified) == 9  # 3 peers x (keyframe + 2 deltas)


async def test_late_joiner_with_other_weights_catches_up_by_keyframe(tmp_path: Path) -> None:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=2)
    trainer_id = Identity.from_seed(b"K" * 32)
    master = build_model(CFG)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="t", data_dir=tmp_path, piece_size=PIECE)))
        await trainer.publish(inference_state(master))
        for step in (1, 2, 3):
            _nudge(master, step)
            await trainer.publish(inference_state(master))
        ident = Identity.from_seed(b"L" * 32)
        pnet = await stack.enter_async_context(net.transport(ident))
        await pnet.connect(tnet.listen_addresses[0])
        other = dataclasses.replace(CFG, seed=99)  # a wrong local checkpoint
        late = await stack.enter_async_context(RolloutPeer(
            ident, pnet, PeerConfig(run="t", trainer=trainer_id.peer_id),
            inference_state(build_model(other)),
            TorchEngine(build_model(other, dtype=torch.bfloat16))))
        async with asyncio.timeout(30):
            await late.wait_version(3)
        want = state_root_of(inference_state(master), PIECE)
        assert late.root == want and state_root_of(late.state, PIECE) == want
        assert late.verified == 1  # one keyframe of version 3, no replay of old deltas
        # `swarm trainer`'s end-of-run count sees it, though it holds none of the deltas
        # (an adversarial trial: `delivered` said 2 of 3 and the trainer lingered on)
        have, _ = await wait_delivered(trainer, {ident.peer_id}, 10)
        assert have == {ident.peer_id}


class _GatedEngine(TorchEngine):
    """A real engine whose weight updates wait for a gate: a peer busy elsewhere."""

    def __init__(self, model: torch.nn.Module, gate: threading.Event) -> None:
        super().__init__(model)
        self.gate = gate

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        super().apply(tensors)


@dataclasses.dataclass
class _Swarm:
    """A trainer on an in-memory network; peers join it."""

    stack: contextlib.AsyncExitStack
    net: MemoryNetwork
    trainer_id: Identity
    tnet: Any
    trainer: TrainerNode

    async def join(self, seed: bytes, cfg: TinyModelConfig = CFG, *, connect: bool = True,
                   gate: threading.Event | None = None, status: StatusFn | None = None,
                   also: Sequence[RolloutPeer] = (), **settings: Any) -> RolloutPeer:
        """A peer whose local weights are ``cfg``'s, connected to the trainer (and to
        ``also``) unless ``connect`` is false; ``settings`` go to its config."""
        ident = Identity.from_seed(seed * 32)
        pnet = await self.stack.enter_async_context(self.net.transport(ident))
        if connect:
            await pnet.connect(self.tnet.listen_addresses[0])
        for other in also:
            await pnet.connect(other.net.listen_addresses[0])
        model = build_model(cfg, dtype=torch.bfloat16)
        engine = TorchEngine(model) if gate is None else _GatedEngine(model, gate)
        return await self.stack.enter_async_context(RolloutPeer(
            ident, pnet, PeerConfig(run="t", trainer=self.trainer_id.peer_id, **settings),
            inference_state(build_model(cfg)), engine, status=status))

    async def announce(self, signed: SignedManifest) -> None:
        await self.tnet.publish(topics.manifests("t"), signed.encode())


@contextlib.asynccontextmanager
async def _swarm(tmp_path: Path, seed: int, name: bytes) -> AsyncIterator[_Swarm]:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=seed)
    trainer_id = Identity.from_seed(name * 32)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="t", data_dir=tmp_path, piece_size=PIECE)))
        yield _Swarm(stack, net, trainer_id, tnet, trainer)


def _on_failure(event: asyncio.Event) -> StatusFn:
    return lambda ev, fields: event.set() if ev == "verify_failed" else None


async def test_lagging_peer_follows_its_deltas_when_a_newcomer_asks_for_a_keyframe(
        tmp_path: Path) -> None:
    master = build_model(CFG)
    async with _swarm(tmp_path, 4, b"G") as sw:
        await sw.trainer.publish(inference_state(master))
        busy = threading.Event()
        busy.set()
        lagging = await sw.join(b"a", gate=busy)
        async with asyncio.timeout(30):
            await lagging.wait_version(0)
        busy.clear()  # the peer now lags: it cannot install versions 1-3
        deltas = dense = 0
        for step in (1, 2, 3):
            _nudge(master, step)
            pub = await sw.trainer.publish(inference_state(master))
            deltas, dense = deltas + pub.payload_bytes, pub.dense_bytes
        # A newcomer with other weights asks for, and gets, a keyframe of version 3; the
        # trainer announces it to every peer.
        newcomer = await sw.join(b"b", dataclasses.replace(CFG, seed=99))
        async with asyncio.timeout(30):
            await newcomer.wait_version(3)
            busy.set()
            await lagging.wait_version(3)
        want = state_root_of(inference_state(master), PIECE)
        assert lagging.root == want == newcomer.root
        assert newcomer.verified == 1
        assert lagging.verified == 4  # version 0, then every delta: no keyframe fetched
        assert lagging.driver.exchange.bytes_down < deltas + 4096 < dense


async def test_keyframes_are_served_from_the_state_itself_and_withdrawn_before_a_patch(
        tmp_path: Path) -> None:
    master = build_model(CFG)
    async with _swarm(tmp_path, 5, b"V") as sw:
        trainer = sw.trainer
        key0 = (await trainer.publish(inference_state(master))).manifest
        # The trainer seeds its keyframe from its snapshot of the state: no second copy.
        assert isinstance(trainer.driver.exchange.chunk(key0.id, 0), memoryview)
        old_peer = await sw.join(b"a")
        async with asyncio.timeout(30):
            await old_peer.wait_version(0)
        # Its local weights are version 0: it serves them as they lie in memory.
        assert isinstance(old_peer.driver.exchange.chunk(key0.id, 0), memoryview)
        _nudge(master, 1)
        await trainer.publish(inference_state(master))
        async with asyncio.timeout(30):
            await old_peer.wait_version(1)
        assert key0.id not in old_peer.driver.objects  # withdrawn before patching
        newcomer = await sw.join(b"b", dataclasses.replace(CFG, seed=99), also=[old_peer])
        async with asyncio.timeout(30):
            await newcomer.wait_version(1)  # by a keyframe of version 1, announced to all
        deltas = {m.id for m in trainer.manifests}
        seeded = old_peer.driver.objects - deltas
        assert len(seeded) == 1  # that keyframe, served from the old peer's state
        key1 = next(iter(seeded))
        assert isinstance(old_peer.driver.exchange.chunk(key1, 0), memoryview)
        # The newcomer, once filled, serves it from its state too; the received copy is gone.
        assert isinstance(newcomer.driver.exchange.chunk(key1, 0), memoryview)
        _nudge(master, 2)
        await trainer.publish(inference_state(master))
        async with asyncio.timeout(30):
            for p in (old_peer, newcomer):
                await p.wait_version(2)
        want = state_root_of(inference_state(master), PIECE)
        for p in (old_peer, newcomer):
            assert p.root == want == state_root_of(p.state, PIECE)
            assert p.bans == [] and p.verify_failures == 0
        assert not seeded & old_peer.driver.objects  # patched: the views are withdrawn
        assert trainer.driver.exchange.banned == frozenset()


async def test_a_signed_delta_that_does_not_decode_is_reverted_and_the_peer_goes_on(
        tmp_path: Path) -> None:
    master = build_model(CFG)
    failed = asyncio.Event()
    async with _swarm(tmp_path, 6, b"D") as sw:
        base = inference_state(master)
        await sw.trainer.publish(base)
        peer = await sw.join(b"d", status=_on_failure(failed))
        async with asyncio.timeout(30):
            await peer.wait_version(0)
        # A delta signed by the trainer whose second chunk hashes right but is garbage
        # (a trainer bug): the first chunk is applied before the second fails to decode.
        _nudge(master, 1)
        good, chunks = encode_delta_sync(
            base, inference_state(master), sw.trainer_id, "t", 1,
            config=EncoderConfig(piece_size=PIECE, segment_elems=256, chunk_target=64))
        assert len(chunks) >= 2
        garbage = b"\x93" * 40
        data = [c.data for c in chunks[:-1]] + [garbage]
        bad = dataclasses.replace(good.manifest, chunks=tuple(
            (chunk_id(d), len(d)) for d in data)).sign(sw.trainer_id)
        sw.trainer.driver.add_object(ObjectSpec.from_manifest(bad), dict(enumerate(data)))
        await sw.announce(bad)
        async with asyncio.timeout(30):
            await failed.wait()
        assert peer.version == 0 and peer.verify_failures == 1
        assert state_root_of(peer.state, PIECE) == state_root_of(base, PIECE)  # reverted
        assert ObjectSpec.from_manifest(bad).obj not in peer.driver.objects
        # Offered again, the failed version is ignored: not fetched, not tried.
        await sw.announce(bad)
        await sw.trainer.publish(inference_state(master))  # the real version 1
        async with asyncio.timeout(30):
            await peer.wait_version(1)
        assert peer.root == state_root_of(peer.state, PIECE) == \
            state_root_of(inference_state(master), PIECE)
        assert peer.verify_failures == 1 and peer.bans == []


async def test_a_keyframe_that_fills_the_wrong_state_leaves_no_version_and_is_replaced(
        tmp_path: Path) -> None:
    master = build_model(CFG)
    failed = asyncio.Event()
    async with _swarm(tmp_path, 7, b"F") as sw:
        good = (await sw.trainer.publish(inference_state(master))).manifest
        # Signed by the trainer, pieces that hash right, but they fill another state than
        # its root (a trainer bug): announced before the peer can ask for anything.
        other = inference_state(build_model(dataclasses.replace(CFG, seed=77)))
        pieces = piece_views(other, PIECE)
        bad = dataclasses.replace(good.manifest, chunks=tuple(
            (chunk_id(v), len(v)) for v in pieces.values())).sign(sw.trainer_id)
        sw.trainer.driver.add_object(ObjectSpec.from_manifest(bad), pieces)
        peer = await sw.join(b"f", dataclasses.replace(CFG, seed=55), connect=False,
                             status=_on_failure(failed))
        await sw.announce(bad)
        await peer.net.connect(sw.tnet.listen_addresses[0])
        async with asyncio.timeout(30):
            await failed.wait()
            await peer.wait_version(0)  # by the trainer's own keyframe, asked for anew
        assert peer.verify_failures == 1 and peer.bans == []
        assert peer.root == good.manifest.target_root == state_root_of(peer.state, PIECE)


async def test_a_keyframe_nobody_serves_is_dropped_for_a_newer_one(tmp_path: Path) -> None:
    master = build_model(CFG)
    async with _swarm(tmp_path, 8, b"N") as sw:
        await sw.trainer.publish(inference_state(master))
        _nudge(master, 1)
        await sw.trainer.publish(inference_state(master))
        # An older keyframe whose seeders have all moved on: nobody serves its pieces.
        gone = keyframe_manifest(inference_state(build_model(CFG)), sw.trainer_id, "t", 0,
                                 piece_size=PIECE)
        peer = await sw.join(b"n", dataclasses.replace(CFG, seed=44), connect=False,
                             fetch_stall=0.5)
        await sw.announce(gone)
        # Connected, it asks for and gets a keyframe of version 1 while still on that one;
        # no chunk of the old one comes, so it gives it up.
        await peer.net.connect(sw.tnet.listen_addresses[0])
        async with asyncio.timeout(30):
            await peer.wait_version(1)
        assert peer.root == state_root_of(inference_state(master), PIECE)
        assert ObjectSpec.from_manifest(gone).obj not in peer.driver.objects


async def test_a_peer_with_another_model_stops_before_fetching_and_foreign_codecs_are_skipped(
        tmp_path: Path) -> None:
    master = build_model(CFG)
    async with _swarm(tmp_path, 9, b"L") as sw:
        base = inference_state(master)
        await sw.trainer.publish(base)
        other = await sw.join(b"o", dataclasses.replace(CFG, hidden_size=16, head_dim=8))
        async with asyncio.timeout(30):
            await other.closed.wait()  # it can never follow this run: it says so and stops
        assert other.version == -1 and other.driver.exchange.bytes_down == 0
        peer = await sw.join(b"p")
        async with asyncio.timeout(30):
            await peer.wait_version(0)
        # A delta in a codec this peer does not decode is not fetched or tried.
        _nudge(master, 1)
        good, _ = encode_delta_sync(base, inference_state(master), sw.trainer_id, "t", 1,
                                    config=EncoderConfig(piece_size=PIECE))
        foreign = dataclasses.replace(good.manifest, codec="other-codec").sign(sw.trainer_id)
        await sw.announce(foreign)
        await sw.trainer.publish(inference_state(master))
        async with asyncio.timeout(30):
            await peer.wait_version(1)
        assert peer.verify_failures == 0
        assert ObjectSpec.from_manifest(foreign).obj not in peer.driver.objects


async def test_old_versions_are_freed_on_trainer_and_peers(tmp_path: Path) -> None:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.001), seed=3)
    trainer_id = Identity.from_seed(b"R" * 32)
    master = build_model(CFG)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="t", data_dir=tmp_path, piece_size=PIECE,
                                            keep_versions=2)))
        await trainer.publish(inference_state(master))
        ident = Identity.from_seed(b"r" * 32)
        pnet = await stack.enter_async_context(net.transport(ident))
        await pnet.connect(tnet.listen_addresses[0])
        peer = await stack.enter_async_context(RolloutPeer(
            ident, pnet, PeerConfig(run="t", trainer=trainer_id.peer_id, keep_versions=2),
            inference_state(build_model(CFG)),
            TorchEngine(build_model(CFG, dtype=torch.bfloat16))))
        for step in range(1, 7):
            _nudge(master, step)
            await trainer.publish(inference_state(master))
            async with asyncio.timeout(30):
                await peer.wait_version(step)
        kept = {m.id for m in trainer.manifests}
        assert len(trainer.manifests) == 3 and trainer.driver.objects <= kept
        assert len(peer.driver.objects) <= 2
        assert peer.root == state_root_of(inference_state(master), PIECE)


async def test_trainer_diffing_on_the_device_publishes_the_host_trainers_chunks(
        tmp_path: Path) -> None:
    """``extract_on="device"`` (torch ops where the tensors live; CPU tensors here) gives
    the same chunks and roots as the host path, also across a restart."""
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.001), seed=4)
    master = build_model(CFG)
    states = [inference_state(master)]
    for step in (1, 2, 3):
        _nudge(master, step)
        states.append(inference_state(master))

    async def publish_all(mode: str, d: Path, upto: int, start: int = 0
                          ) -> list[tuple[bytes | None, list[bytes]]]:
        ident = Identity.from_seed(mode[:1].encode() * 32)
        async with net.transport(ident) as tnet, TrainerNode(
                ident, tnet, TrainerConfig(run="t", data_dir=d, piece_size=PIECE,
                                           extract_on=mode)) as trainer:
            out = []
            for s in states[start:upto]:
                m = (await trainer.publish(s)).manifest.manifest
                out.append((m.target_root, [cid for cid, _ in m.chunks]))
            return out

    host = await publish_all("host", tmp_path / "h", 4)
    device = await publish_all("device", tmp_path / "d", 3)
    device += await publish_all("device", tmp_path / "d", 4, start=3)  # restarted
    assert device == host
    assert all(chunks for _, chunks in host)


async def test_a_peer_told_there_is_no_work_asks_again_after_claim_retry(
        tmp_path: Path) -> None:
    """Between steps the trainer has no tasks and refuses claims (``no_work``). The
    refusal is the answer: the peer claims again ``claim_retry`` (0.5 s) later, not after
    the 2 s it waits for an answer that never comes, which left every peer idle for most
    of 2 s at each step (the demo's steps took 5.6 s here, 1.2 s after)."""
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=4)
    trainer_id = Identity.from_seed(b"N" * 32)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="n", data_dir=tmp_path, piece_size=PIECE)))
        await trainer.publish(inference_state(build_model(CFG)))
        ident = Identity.from_seed(b"n" * 32)
        pnet = await stack.enter_async_context(net.transport(ident))
        await pnet.connect(tnet.listen_addresses[0])
        peer = await stack.enter_async_context(RolloutPeer(
            ident, pnet, PeerConfig(run="n", trainer=trainer_id.peer_id),
            inference_state(build_model(CFG)), TorchEngine(build_model(CFG, dtype=torch.bfloat16))))
        refused = trainer.leases.stats.refused
        async with asyncio.timeout(30):
            await peer.wait_version(0)
            while not refused.get("no_work"):
                await asyncio.sleep(0.05)
        first = refused["no_work"]
        async with asyncio.timeout(6):  # 5 more at 0.5 s; 10 s at the old 2 s
            while refused["no_work"] < first + 5:
                await asyncio.sleep(0.05)
        tasks = trainer.add_tasks([("late", [1, 2, 3])], group_size=2,
                                  sampling=Sampling(temperature=1.0, max_tokens=4, seed=0))
        accepted = await trainer.collect(len(tasks), timeout=10)
        assert [r.task_id for a in accepted for r in a.results] == [tasks[0].task_id]


async def test_a_peer_two_versions_behind_catches_up_without_losing_score(
        tmp_path: Path, caplog: Any) -> None:
    """A peer more than ``max_staleness`` behind is refused work until it catches up. Its
    claims say which version it is fetching, so the refusals cost it nothing: at 0.5 s a
    claim, a peer that took 20 s to catch up would otherwise be banned from leases."""
    # a slow link (5 KB/s): each version below changes every weight and takes the peer
    # seconds to fetch, longer than it waits for one after a stale refusal (2 s)
    net = MemoryNetwork(default=LinkProfile(bandwidth=5e3, latency=0.1), seed=5)
    trainer_id = Identity.from_seed(b"B" * 32)
    master = build_model(CFG)
    async with contextlib.AsyncExitStack() as stack:
        tnet = await stack.enter_async_context(net.transport(trainer_id))
        trainer = await stack.enter_async_context(TrainerNode(
            trainer_id, tnet, TrainerConfig(run="b", data_dir=tmp_path, piece_size=PIECE)))
        await trainer.publish(inference_state(master))
        ident = Identity.from_seed(b"b" * 32)
        pnet = await stack.enter_async_context(net.transport(ident))
        await pnet.connect(tnet.listen_addresses[0])
        peer = await stack.enter_async_context(RolloutPeer(
            ident, pnet, PeerConfig(run="b", trainer=trainer_id.peer_id),
            inference_state(build_model(CFG)), TorchEngine(build_model(CFG, dtype=torch.bfloat16))))
        async with asyncio.timeout(60):
            await peer.wait_version(0)
        with torch.no_grad():
            for step in (1, 2):
                for p in master.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
                           * 1e-2)
                await trainer.publish(inference_state(master))
        tasks = trainer.add_tasks([("behind", [1, 2, 3])], group_size=2,
                                  sampling=Sampling(temperature=1.0, max_tokens=4, seed=0))
        caplog.set_level("WARNING", logger="swarm.protocol.leases.trainer_book")
        accepted = await trainer.collect(len(tasks), timeout=60)
        assert [a.version >= 1 for a in accepted] == [True]  # inside the bound
        refused = trainer.leases.stats.refused["stale_version"]
        penalised = [r for r in caplog.records if "refused claim" in r.getMessage()]
        assert refused >= 3
        # the claim it sent before it heard of the new versions, at most
        assert len(penalised) <= 1
