"""The trainer side of the ``swarm`` weight-transfer backend, for stacks that drive vLLM's
four-phase API (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``) through a ``TrainerWeightTransferEngine``.

:func:`swarm.integrations.vllm.register` adds :class:`SwarmTrainerWeightTransferEngine` to
vLLM's ``WeightTransferTrainerFactory`` under ``"swarm"``, beside the receiving engine::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource

    register()
    engine = WeightTransferTrainerFactory.trainer_init(
        SwarmTrainerInitInfo(run="demo", data_dir="/var/lib/swarm-trainer",
                             model_dir="/models/qwen3", member_data_dir="/var/lib/swarm-vllm",
                             rank=0),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"), source=ModuleSource(model))
    for batch in data:
        ...                       # a training step
        engine.send_weights()     # publish the next version; vLLM applies it
    engine.shutdown()

``trainer_init`` starts a trainer node (libp2p, on a thread of its own), publishes the
source as version 0, serves the run card, and makes the vLLM workers swarm members through
``client.init_weight_transfer_engine``. Each ``send_weights`` publishes the source as the
next version (a sparse delta, signed), then drives the four phases: the workers fetch and
verify it through the swarm (from the trainer or any other member) and
``update_weights({"version": v, "root": ...})`` writes it in place and checks its digests.
Only the version and its root go over the control plane; the bytes go over the swarm, where
rollout peers (``swarm peer``) can follow the same run.

Several trainer ranks: every rank calls ``trainer_init`` and ``send_weights`` and iterates
the source (its gathers are collectives); rank 0 alone runs the node and calls the client.

This module imports vLLM (its base classes); :mod:`swarm.integrations.vllm` does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from swarm.errors import LocalProtocolError, SwarmError
from swarm.integrations._thread import NodeThread

if TYPE_CHECKING:
    from swarm.roles.trainer import Published

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class SwarmTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """``init_info`` of :meth:`SwarmTrainerWeightTransferEngine.trainer_init` (``rank`` is
    keyword-only, from vLLM's ``TrainerInitInfo``)."""

    backend: ClassVar[str] = "swarm"

    run: str
    """Run name (members and rollout peers join with it)."""
    data_dir: str
    """The trainer's key (``node.key``) and published versions: a new run's dir."""
    model_dir: str
    """An HF model dir: its ``config.json`` names the run's tensors, and its tokenizer and
    generation files go into the run card."""
    member_data_dir: str
    """The ``data_dir`` each vLLM worker's swarm member keeps its key and state in (on the
    vLLM host)."""
    dtype: str = "bfloat16"
    """The published state's dtype: vLLM must serve this dtype."""
    listen: str = "/ip4/127.0.0.1/tcp/0"
    """The trainer node's libp2p listen multiaddr (the members dial its first address)."""
    member_listen: str = "/ip4/127.0.0.1/tcp/0"
    """The members' listen multiaddr."""
    update_wait: float = 120.0
    """Seconds ``update_weights`` waits for the workers to verify a version."""
    piece_size: int = 0
    """Piece size of state roots and keyframes (0: the trainer node's default)."""
    chunk_target: int = 1 << 20
    """Encoded bytes per delta chunk."""


class SwarmTrainerWeightTransferEngine(TrainerWeightTransferEngine[SwarmTrainerInitInfo]):  # type: ignore[misc]
    """Publishes each version through a swarm trainer node and has vLLM apply it."""

    init_info_cls = SwarmTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True,
                 info: SwarmTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.names, self._ties = _layout(Path(info.model_dir))
        self.node: _TrainerThread | None = None
        #: The version vLLM holds (the last one ``send_weights`` had it apply).
        self.version = -1
        #: Seconds of each ``send_weights`` on the sender: (publish, the four phases).
        self.send_seconds: list[tuple[float, float]] = []
        #: Encoded bytes of each version published after version 0.
        self.payload_bytes: list[int] = []

    @classmethod
    def trainer_init(cls, init_info: SwarmTrainerInitInfo, *, client: Any,
                     source: Any = None) -> SwarmTrainerWeightTransferEngine:
        """Start the trainer node, publish ``source`` as version 0 and make the vLLM
        workers members of the run (rank 0; other ranks only iterate the source).

        :raises LocalProtocolError: no source, a source that lacks a tensor of the model's
            layout, or a ``data_dir`` that holds an earlier run.
        :raises SwarmError: the node could not start.
        """
        if source is None:
            raise LocalProtocolError("the swarm trainer engine publishes the whole state each "
                                     "round: give trainer_init a WeightSource (ModuleSource)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     info=init_info)
        state = engine.read_source()
        if not engine.is_sender:
            return engine
        node = _TrainerThread(init_info)
        node.start(state)
        engine.node = node
        engine.version = 0
        try:
            client.init_weight_transfer_engine({
                "bootstrap": [node.address], "trainer": node.peer_id, "run": init_info.run,
                "data_dir": init_info.member_data_dir, "listen": init_info.member_listen})
        except BaseException:
            node.stop()
            raise
        log.info("swarm trainer %s at %s: vLLM joined run %r", node.peer_id, node.address,
                 init_info.run)
        return engine

    def send_weights(self) -> None:
        """Publish the source as the next version, then have vLLM apply it: start, update
        (the workers wait up to ``update_wait`` seconds to verify it), finish with the
        version as vLLM's weight version. Called on every rank.

        When the workers could not apply the version, the client's error (naming the
        cause; over HTTP a 500) propagates: nothing of it stays applied and the update
        session is over (no finish is sent)."""
        state = self.read_source()
        if not self.is_sender:
            return
        node = self._node()
        t0 = time.perf_counter()
        pub = node.call(node.publish(state))
        t1 = time.perf_counter()
        self.client.start_weight_update()
        self.client.update_weights({"version": pub.step,
                                    "root": pub.manifest.manifest.target_root.hex(),
                                    "wait": self.info.update_wait})
        self.client.finish_weight_update(weight_version=str(pub.step))
        self.version = pub.step
        self.payload_bytes.append(pub.payload_bytes)
        self.send_seconds.append((t1 - t0, time.perf_counter() - t1))
        log.info("swarm version %d: %d bytes published in %.3f s, applied by vLLM in %.3f s",
                 pub.step, pub.payload_bytes, t1 - t0, time.perf_counter() - t1)

    def shutdown(self) -> None:
        """Stop the trainer node (idempotent; vLLM keeps the weights it holds)."""
        node, self.node = self.node, None
        if node is not None:
            node.stop()

    # -- swarm ----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The trainer node's multiaddr (rollout peers bootstrap from it)."""
        return self._node().address

    @property
    def peer_id(self) -> str:
        return self._node().peer_id

    def read_source(self) -> dict[str, torch.Tensor]:
        """One pass over the source: the run's state (the model's ``state_dict`` names and
        order from ``config.json``, in ``dtype``); a tied tensor the source yields once
        fills every name it is tied to.

        :raises LocalProtocolError: the source yields a name outside the layout or lacks
            one of it.
        """
        from swarm.demo.model import INFERENCE_DTYPES

        try:
            dtype = INFERENCE_DTYPES[self.info.dtype]
        except KeyError:
            raise LocalProtocolError(
                f"dtype must be one of {sorted(INFERENCE_DTYPES)}, not {self.info.dtype!r}"
            ) from None
        got = _collect(self.source, set(self.names))
        state: dict[str, torch.Tensor] = {}
        for name in self.names:
            tensor = got.get(name)
            if tensor is None:
                tensor = next((got[t] for t in self._ties.get(name, ()) if t in got), None)
            if tensor is None:
                raise LocalProtocolError(f"the weight source yields no tensor {name!r} of "
                                         f"{self.info.model_dir}'s layout")
            state[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous().clone()
        return state

    def _node(self) -> _TrainerThread:
        if self.node is None:
            raise SwarmError("the swarm trainer node is not running on this rank "
                             "(rank 0 runs it, until shutdown)")
        return self.node


def _collect(source: Iterable[tuple[str, torch.Tensor | None]], names: set[str]
             ) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in source:
        if name not in names:
            raise LocalProtocolError(f"the weight source yields {name!r}, which is not a "
                                     "tensor of the model's layout")
        if tensor is not None:
            out[name] = tensor
    return out


def _layout(model_dir: Path) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """The state's names (the model's ``state_dict`` order, built on the meta device from
    ``config.json``), and for each tied one the names sharing its parameter."""
    model = _skeleton(model_dir)
    names = list(model.state_dict())
    by_param: dict[int, list[str]] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(prm), []).append(name)
    ties = {n: tuple(o for o in group if o != n)
            for group in by_param.values() if len(group) > 1 for n in group}
    return names, ties


def _skeleton(model_dir: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise LocalProtocolError(f"model_dir {model_dir} holds no config.json")
    auto: Any = AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(AutoConfig.from_pretrained(model_dir))


class _TrainerThread(NodeThread):
    """A libp2p node and a :class:`~swarm.roles.trainer.TrainerNode` on an asyncio loop in
    a thread of their own; the caller's thread waits on it for each call."""

    def __init__(self, info: SwarmTrainerInitInfo) -> None:
        super().__init__("swarm-vllm-trainer")
        self.info = info
        self.peer_id = ""
        self.address = ""
        self._trainer: Any = None
        self._state: dict[str, torch.Tensor] = {}

    def start(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state
        self._launch()

    async def publish(self, state: Mapping[str, torch.Tensor]) -> Published:
        published: Published = await self._trainer.publish(state)
        return published

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._call(coro, "the swarm trainer node")

    def stop(self) -> None:
        self._halt(60.0)

    async def _main(self) -> None:
        from swarm.engines.hf_model import run_card
        from swarm.identity import Identity
        from swarm.net.dataplane import DataPlaneConfig
        from swarm.net.node import Libp2pNode, NodeConfig
        from swarm.roles.trainer import TrainerConfig, TrainerNode

        info = self.info
        stop = self._bind()
        data_dir = Path(info.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        me = Identity.load_or_create(data_dir / "node.key")
        self.peer_id = me.peer_id
        parts = info.listen.split("/")
        host = parts[2] if len(parts) > 2 else "127.0.0.1"
        config = TrainerConfig(run=info.run, data_dir=data_dir, chunk_target=info.chunk_target)
        if info.piece_size:
            config = dataclasses.replace(config, piece_size=info.piece_size)
        async with Libp2pNode(me, NodeConfig(listen=info.listen, run=info.run,
                                             data_plane=DataPlaneConfig(host=host))) as net, \
                TrainerNode(me, net, config) as node:
            if node.restored_step >= 0:
                raise LocalProtocolError(
                    f"{data_dir} holds versions up to {node.restored_step} of an earlier run: "
                    "give the swarm trainer engine a new data_dir")
            self._trainer = node
            self.address = net.listen_addresses[0]
            v0 = await node.publish(self._state)
            self._state = {}
            skeleton = await asyncio.to_thread(_skeleton, Path(info.model_dir))
            net.serve_card(run_card(me, info.run, skeleton, v0.manifest, dtype=info.dtype,
                                    model_dir=Path(info.model_dir)).encode())
            self._ready.set()
            await node.wait(stop.wait())


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (a colocated trainer):
    the four calls, and a prefix-cache reset after each finished update (the cached keys
    and values were computed with the previous weights)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)
        self.llm.reset_prefix_cache()
