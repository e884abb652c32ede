"""Node lifecycles: a node's tasks live and die together, and callers hear about it.

A background task that fails stops the node and reaches whoever waits on it
(``collect()``, ``wait_version()`` raise :class:`NodeFailed` with the cause); a failure in
``__aenter__`` leaves no task of the node running.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from swarm.aio import cancel_and_wait
from swarm.demo.model import TinyModelConfig, build_model, inference_state
from swarm.engines.torch_engine import TorchEngine
from swarm.errors import NodeFailed
from swarm.identity import Identity
from swarm.net.memory import LinkProfile, MemoryNetwork
from swarm.protocol.leases import PeerLeases, Reason
from swarm.roles.common import Clock
from swarm.roles.mux import Mux
from swarm.roles.peer import PeerConfig, RolloutPeer
from swarm.roles.peer_work import LeasedWork, WorkConfig
from swarm.roles.tasks import TaskGroup
from swarm.roles.trainer import TrainerConfig, TrainerNode

pytestmark = pytest.mark.timeout(30)

CFG = TinyModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=64, seed=3)
TRAINER = Identity.from_seed(b"L" * 32)


async def test_a_failing_task_cancels_the_others_and_reaches_waiters() -> None:
    group = TaskGroup("node")
    other_cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            other_cancelled.set()

    async def boom() -> None:
        raise ValueError("disk on fire")

    group.spawn(forever(), "forever")
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(group.wait(asyncio.Event().wait()))
    group.spawn(boom(), "boom")
    with pytest.raises(NodeFailed, match="boom: disk on fire") as info:
        await waiter
    assert isinstance(info.value.__cause__, ValueError)
    await asyncio.wait_for(other_cancelled.wait(), 5)
    with pytest.raises(NodeFailed):  # later waits fail at once
        await group.wait(asyncio.sleep(10))
    assert group.spawn(forever(), "late") is None  # a stopped group runs nothing new
    await group.close()


async def test_trainer_collect_raises_when_a_task_of_the_node_fails(tmp_path: Path) -> None:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=1)
    async with net.transport(TRAINER) as tnet, TrainerNode(
            TRAINER, tnet, TrainerConfig(run="t", data_dir=tmp_path)) as trainer:
        await trainer.publish(inference_state(build_model(CFG)))

        async def crash() -> None:
            raise RuntimeError("lease book corrupted")

        trainer.spawn(crash(), "leases")
        with pytest.raises(NodeFailed, match="lease book corrupted"):
            await trainer.collect(1, timeout=10)
        assert trainer.failure is not None and trainer.closed.is_set()


async def test_peer_whose_start_fails_leaves_nothing_running(tmp_path: Path) -> None:
    net = MemoryNetwork(default=LinkProfile(bandwidth=50e6, latency=0.002), seed=1)
    me = Identity.from_seed(b"p" * 32)
    before = set(asyncio.all_tasks())

    class BrokenNet:
        """A transport whose gossip subscription fails (after the node started tasks)."""

        def __init__(self, inner: object) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

        async def subscribe(self, *args: object, **kwargs: object) -> object:
            raise OSError("subscription refused")

    async with net.transport(me) as pnet:
        peer = RolloutPeer(me, BrokenNet(pnet),  # type: ignore[arg-type]
                           PeerConfig(run="t", trainer=TRAINER.peer_id),
                           inference_state(build_model(CFG)),
                           TorchEngine(build_model(CFG, dtype=torch.bfloat16)))
        with pytest.raises(OSError, match="subscription refused"):
            await peer.__aenter__()
        await asyncio.sleep(0)
        left = {t for t in asyncio.all_tasks() - before if not t.done()}
        assert {t.get_name() for t in left} <= {asyncio.current_task().get_name()}  # type: ignore[union-attr]
        with pytest.raises(NodeFailed):
            await peer.wait_version(0)


@pytest.mark.parametrize("answer", [Reason.NO_WORK, Reason.STALE_VERSION])
async def test_a_peer_stopped_as_an_answer_to_its_claim_comes_stops(answer: Reason) -> None:
    """The claim loop stops when it is cancelled in the very step an answer arrives.
    Python 3.11's ``asyncio.wait_for`` returned the answer there and swallowed the
    cancellation: the loop claimed on, and the peer's stop waited on it for ever."""
    net = MemoryNetwork(seed=2)
    ident = Identity.from_seed(b"C" * 32)
    async with net.transport(TRAINER) as trainer, net.transport(ident) as t:
        await t.connect(trainer.listen_addresses[0])
        work = LeasedWork(PeerLeases(ident, TRAINER.public_key, "run"), Mux(t),
                          TorchEngine(build_model(CFG, dtype=torch.bfloat16)), asyncio.Lock(),
                          WorkConfig(trainer=TRAINER.peer_id), Clock(),
                          version=lambda: (0, b"\0" * 32), status=lambda *_: None,
                          on_stale=lambda: None)
        work.ready.set()
        claims = asyncio.create_task(work.claims())
        await asyncio.wait_for(trainer.recv(), 5)  # the claim: the loop now awaits its answer
        work._inbox.put_nowait(answer)
        claims.cancel()
        done, _ = await asyncio.wait({claims}, timeout=5)
        assert claims in done and claims.cancelled()


async def test_a_task_that_swallows_its_cancel_does_not_hold_up_a_stop_for_ever(
        caplog: pytest.LogCaptureFixture) -> None:
    group = TaskGroup("node")
    release = asyncio.Event()
    started = asyncio.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # swallowed: goes on until released

    task = group.spawn(stubborn(), "stubborn")
    assert task is not None
    await started.wait()
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait([task], "node", grace=0.2)
    assert not task.done()
    assert "node: task stubborn did not stop within 0.2 s of being cancelled" in caplog.text
    release.set()
    await group.close()
    assert task.done()


async def test_a_stop_cancelled_itself_is_cancelled() -> None:
    """Waiting for cancelled tasks does not swallow a cancellation of the one waiting."""
    gate = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await gate.wait()
            raise

    inner = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait([inner], "node"))
    await asyncio.sleep(0)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await inner
