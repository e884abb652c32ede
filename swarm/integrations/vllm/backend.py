"""The ``swarm`` weight-transfer engine, built by vLLM inside each worker.

vLLM builds it in ``Worker.load_model`` once ``weight_transfer_config={"backend": "swarm"}``
names it (after :func:`swarm.integrations.vllm.register`). ``init_transfer_engine`` makes
the worker a swarm member (:class:`~swarm.integrations.vllm.member.SwarmMember`) that
fetches and verifies versions in the background; ``update_weights({"version": v})``
writes a verified version into the model in place, on vLLM's thread, through the same
apply path as the in-tree engine (:mod:`swarm.engines.vllm_views`), then checks each
written tensor's digest against the verified state's. On any error nothing stays
applied: a check that fails before writing writes nothing, and a digest mismatch after
writing restores the previous values.

With ``"auto_follow": true`` in ``init_info`` (and vLLM's prefix caching off) the worker
applies the latest verified version by itself, before the first forward pass in which no
request started under the previous weights is still running (a request boundary).

``start_weight_update`` and ``finish_weight_update`` do nothing (writes are in place).
After an update, reset vLLM's prefix cache (``llm.reset_prefix_cache()``), as after any
in-place weight change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from swarm.engines import EngineUpdateError
from swarm.engines.vllm_views import checkpoint_views, view_digests, write_tensors
from swarm.integrations.vllm.member import MemberConfig, SwarmMember, VersionUnavailable

log = logging.getLogger(__name__)


@dataclass
class SwarmInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """``init_info`` of ``init_weight_transfer_engine`` (see :class:`MemberConfig`)."""

    bootstrap: list[str]
    trainer: str
    run: str
    data_dir: str
    listen: str = "/ip4/127.0.0.1/tcp/0"
    max_staged: int = 4
    card_timeout: float = 120.0
    auto_follow: bool = False
    """Apply each verified version by itself, at the first request boundary after it
    (a forward pass with no request started before it); needs prefix caching off."""


@dataclass
class SwarmUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``update_info`` of ``update_weights``: the version to apply."""

    version: int
    root: str | None = None
    """The version's state root (hex) the caller expects, if it knows it."""
    wait: float = 0.0
    """Seconds to wait for the version to be verified (0: it must be already)."""


class SwarmWeightTransferEngine(WeightTransferEngine[SwarmInitInfo, SwarmUpdateInfo]):  # type: ignore[misc]
    """Applies versions that a swarm member inside the worker fetched and verified."""

    init_info_cls = SwarmInitInfo
    update_info_cls = SwarmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        # Raises if vLLM repacked the weights (register() keeps them plain on CPU).
        self._views = checkpoint_views(model)
        self._dtype = next(iter(self._views.values())).dtype
        self.member: SwarmMember | None = None
        self.auto_follow = False
        self._follow_failed = -1
        """The last version auto-follow could not apply (not retried)."""
        self.last_apply_s = 0.0
        self._rollback: dict[str, torch.Tensor] = {}
        """Buffers for the values an update overwrites (allocated once, on first use)."""

    # -- vLLM's API ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: SwarmInitInfo) -> None:
        if self.member is not None:
            raise RuntimeError("this worker is already a member of swarm run "
                               f"{self.member.config.run!r}")
        config = MemberConfig(
            bootstrap=tuple(init_info.bootstrap), trainer=init_info.trainer,
            run=init_info.run, data_dir=Path(init_info.data_dir), listen=init_info.listen,
            max_staged=init_info.max_staged, card_timeout=init_info.card_timeout)
        if init_info.auto_follow:
            if self.vllm_config.cache_config.enable_prefix_caching:
                raise ValueError(
                    "auto_follow needs vLLM started with enable_prefix_caching=False: the "
                    "worker cannot drop the scheduler's cached keys and values computed "
                    "with the previous weights")
            _follow_at_request_boundaries()
        member = SwarmMember(config, self._build_state)
        member.start()
        self.member = member
        self.auto_follow = init_info.auto_follow

    def start_weight_update(self) -> None:
        return None

    def finish_weight_update(self) -> None:
        return None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SwarmUpdateInfo) -> None:
        self.apply_version(update_info.version,
                           None if update_info.root is None else bytes.fromhex(update_info.root),
                           wait=update_info.wait)

    def shutdown(self) -> None:
        member, self.member = self.member, None
        if member is not None:
            member.stop()

    # -- swarm ----------------------------------------------------------------------------
    def apply_version(self, version: int, root: bytes | None = None, *,
                      wait: float = 0.0) -> int:
        """Write verified ``version`` into the model; returns how many tensors changed.

        :raises VersionUnavailable: unknown version, root mismatch, or wrong base (nothing
            is written).
        :raises EngineUpdateError: a written tensor's digest is not the verified state's
            (the previous values are restored).
        """
        import time

        member = self._member()
        if wait > 0:
            member.staged.wait(version, wait)
        plan = member.staged.plan(version, root)
        t0 = time.perf_counter()
        names = list(plan.tensors)
        previous = self._keep_previous(names)
        write_tensors(self._views, plan.tensors.items())
        got = view_digests(self._views, names)
        if got != plan.expected:
            bad = sorted(n for n in names if got[n] != plan.expected[n])
            write_tensors(self._views, previous.items())
            raise EngineUpdateError(
                f"version {version}: {len(bad)} tensors do not hold the verified values "
                f"after the write (first {bad[0]}); the previous values were restored")
        member.staged.applied(plan)
        self.last_apply_s = time.perf_counter() - t0
        log.info("applied swarm version %d (%d tensors) in %.3f s", version, len(names),
                 self.last_apply_s)
        return len(names)

    def follow(self, live_requests: int) -> int | None:
        """Auto-follow: at a request boundary (``live_requests`` 0: no request started
        before this forward pass is still running), apply the latest staged version;
        returns it, or None. A version that fails is logged, leaves nothing applied and
        is not tried again; serving goes on with the version the model holds."""
        member = self.member
        if not self.auto_follow or member is None or live_requests:
            return None
        staged = member.staged.staged()
        if not staged or staged[-1] == self._follow_failed:
            return None
        version = staged[-1]
        try:
            self.apply_version(version)
        except EngineUpdateError as exc:
            self._follow_failed = version
            log.error("auto-follow: version %d not applied: %s", version, exc)
            return None
        return version

    def _keep_previous(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the named tensors as the model holds them, to restore on a failed
        check (into buffers reused across updates: page faults are paid once)."""
        out: dict[str, torch.Tensor] = {}
        for name in names:
            view = self._views[name]
            buf = self._rollback.get(name)
            if buf is None:
                buf = self._rollback[name] = torch.empty_like(view)
            buf.copy_(view)
            out[name] = buf
        return out

    def tensor_digests(self) -> dict[str, bytes]:
        """Per-tensor digests of what the model holds, read from its parameters."""
        return view_digests(self._views)

    def status(self) -> dict[str, Any]:
        out = self._member().status()
        out["last_apply_s"] = self.last_apply_s
        return out

    def _member(self) -> SwarmMember:
        if self.member is None:
            raise VersionUnavailable("not a swarm member yet: call init_weight_transfer_engine")
        failure = self.member.failure()
        if failure is not None:
            raise VersionUnavailable(f"the swarm member stopped: {failure}")
        return self.member

    def _build_state(self, card: Any) -> dict[str, torch.Tensor]:
        """The canonical state: the model's current weights, named and ordered as the
        run's state (the card's model, built on the meta device), in the run's dtype."""
        from transformers import AutoModelForCausalLM

        from swarm.delta.state import layout_of
        from swarm.engines.hf_model import hf_config
        from swarm.engines.tensors import torch_dtype

        dtype = torch_dtype(card.dtype)
        if dtype != self._dtype:
            raise EngineUpdateError(
                f"vLLM serves {self._dtype} weights and run {card.run!r} publishes "
                f"{card.dtype}: start vLLM with dtype={card.dtype!r} to follow it bit-exactly")
        auto: Any = AutoModelForCausalLM
        with torch.device("meta"):
            skeleton = auto.from_config(hf_config(card))
        names = list(skeleton.state_dict())
        missing = [n for n in names if n not in self._views]
        if missing:
            raise EngineUpdateError(f"vLLM's model holds no tensor {missing[0]!r} of the run "
                                    f"({len(missing)} missing)")
        state = {n: self._views[n].detach().to("cpu").contiguous().clone() for n in names}
        if layout_of(state).digest != card.layout_digest:
            raise EngineUpdateError(
                f"vLLM's model has another tensor layout than run {card.run!r} (names, "
                "shapes or dtypes differ)")
        return state


def swarm_status(worker: Any) -> dict[str, Any]:
    """``llm.collective_rpc(swarm_status)``: the member's status in each worker."""
    out: dict[str, Any] = _engine(worker).status()
    return out


def swarm_digests(worker: Any) -> dict[str, bytes]:
    """``llm.collective_rpc(swarm_digests)``: per-tensor digests the model holds."""
    return _engine(worker).tensor_digests()


def _follow_at_request_boundaries() -> None:
    """Wrap vLLM's ``Worker.execute_model`` (once per process) so that a worker whose
    swarm engine auto-follows applies staged versions before a forward pass in which no
    earlier request is still running."""
    from vllm.v1.worker.gpu_worker import Worker

    current = Worker.execute_model
    if getattr(current, "_swarm_follow", False):
        return

    def execute_model(self: Any, scheduler_output: Any) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, SwarmWeightTransferEngine) and engine.auto_follow:
            held = getattr(getattr(self, "model_runner", None), "requests", {})
            finished: set[str] = getattr(scheduler_output, "finished_req_ids", None) or set()
            engine.follow(len(set(held) - set(finished)))
        return current(self, scheduler_output)

    setattr(execute_model, "_swarm_follow", True)  # noqa: B010 (a function attribute)
    Worker.execute_model = execute_model


def _engine(worker: Any) -> SwarmWeightTransferEngine:
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, SwarmWeightTransferEngine):
        raise RuntimeError("this vLLM worker does not run the swarm weight-transfer backend")
    return engine
