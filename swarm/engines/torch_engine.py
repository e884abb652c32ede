"""A rollout engine over a transformers causal LM (CPU or GPU), generating with a KV cache.

Prompts of the same length are decoded together, up to ``max_batch`` rows, with no padding
(a GRPO group repeats one prompt); prompt i of a call samples with its own seeded
generator, so its tokens do not depend on which other prompts share its batch, up to
floating-point differences between batched and single-row matrix products.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from swarm.engines import EngineUpdateError, request_seed
from swarm.engines.tensors import check_sparse, check_update, digest_of
from swarm.errors import LocalProtocolError
from swarm.protocol.leases import Completion, Sampling

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def random_qwen3(
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    max_positions: int = 256,
    tie_word_embeddings: bool = True,
    init_std: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    use_cache: bool = True,
) -> PreTrainedModel:
    """A randomly initialised ``Qwen3ForCausalLM`` built from a config (no download).

    The global torch RNG is left as it was.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        use_cache=use_cache,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen3ForCausalLM(config)
    out: PreTrainedModel = model.to(dtype=dtype).eval()
    return out


class TorchEngine:
    """Generates with a transformers causal LM and applies updates to its parameters in place.

    The engine holds the model it is given; the caller must not train that same object.
    Not thread-safe: run generate and apply one at a time (a peer swaps weights at a
    rollout boundary).
    """

    kind = "torch"

    def __init__(self, model: PreTrainedModel, *, max_batch: int = 16) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._max_batch = max_batch
        self._model: Any = cast(Any, model)
        self._model.eval()
        self._tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        first = next(iter(self._tensors.values()))
        self._device = first.device
        config = model.config
        self._vocab_size = int(config.vocab_size)
        self._max_positions = int(getattr(config, "max_position_embeddings", 0)) or None
        # transformers renamed forward's ``past_key_values`` to ``cache`` (5.2x).
        params = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._closed = False

    @property
    def model(self) -> PreTrainedModel:
        self._check_open()
        out: PreTrainedModel = self._model
        return out

    @property
    def device(self) -> torch.device:
        return self._device

    def tensor_names(self) -> list[str]:
        self._check_open()
        return list(self._tensors)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """One completion per prompt; see ``RolloutEngine.generate``.

        :raises LocalProtocolError: an empty prompt, a token outside the vocabulary, or a
            prompt plus max_tokens longer than the model's context.
        """
        self._check_open()
        for prompt in prompts:
            self._check_prompt(prompt, sampling)
        out: list[Completion | None] = [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        for group in by_length.values():
            for at in range(0, len(group), self._max_batch):
                part = group[at : at + self._max_batch]
                done = self._generate_batch([prompts[i] for i in part], sampling,
                                            [request_seed(sampling, i) for i in part])
                for i, completion in zip(part, done, strict=True):
                    out[i] = completion
        return [c for c in out if c is not None]

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        """Copy each tensor into the parameter or buffer of that name, in place.

        :raises EngineUpdateError: unknown name, wrong shape or dtype (nothing is written).
        """
        self._check_open()
        for name, value in update.items():
            target = self._tensors.get(name)
            if target is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            check_update(name, target.shape, target.dtype, value)
        with torch.no_grad():
            for name, value in update.items():
                self._tensors[name].copy_(value)
        log.debug("applied %d tensors", len(update))

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write values at flat positions of each named tensor, in place.

        :raises EngineUpdateError: unknown name, bad indices or values (nothing is written).
        """
        self._check_open()
        for name, (indices, values) in update.items():
            target = self._tensors.get(name)
            if target is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            if not target.is_contiguous():
                raise EngineUpdateError(f"{name} is not contiguous in this engine")
            check_sparse(name, target.numel(), target.dtype, indices, values)
        with torch.no_grad():
            for name, (indices, values) in update.items():
                flat = self._tensors[name].view(-1)
                flat.index_copy_(0, indices.to(flat.device), values.to(flat.device))
        log.debug("applied sparse values to %d tensors", len(update))

    def tensor_digests(self, names: Iterable[str] | None = None) -> dict[str, bytes]:
        """``swarm.engines.tensor_digest`` per tensor, in state_dict naming.

        :raises EngineUpdateError: an unknown name.
        """
        self._check_open()
        wanted = list(self._tensors) if names is None else list(names)
        out: dict[str, bytes] = {}
        for name in wanted:
            target = self._tensors.get(name)
            if target is None:
                raise EngineUpdateError(f"engine holds no tensor named {name!r}")
            out[name] = digest_of(target)
        return out

    def close(self) -> None:
        self._closed = True
        self._tensors = {}

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("engine is closed")

    def _check_prompt(self, prompt: Sequence[int], sampling: Sampling) -> None:
        if len(prompt) == 0:
            raise LocalProtocolError("empty prompt")
        if any(type(t) is not int or not 0 <= t < self._vocab_size for t in prompt):
            raise LocalProtocolError(f"prompt token outside the vocabulary of {self._vocab_size}")
        if self._max_positions is not None and len(prompt) + sampling.max_tokens > (
            self._max_positions
        ):
            raise LocalProtocolError(
                f"prompt of {len(prompt)} tokens plus max_tokens={sampling.max_tokens} "
                f"exceeds the context of {self._max_positions}"
            )

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seeds: Sequence[int | None]
    ) -> list[Completion]:
        """Prompts of one length, decoded together (no padding); row i samples with seeds[i]."""
        from transformers import DynamicCache

        rows = len(prompts)
        generators: list[torch.Generator | None] = []
        for seed in seeds:
            if sampling.greedy:
                generators.append(None)
                continue
            gen = torch.Generator(device=self._device)
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed)
            generators.append(gen)
        stop = frozenset(sampling.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        done = [False] * rows
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=self._device)
        cache = {self._cache_kwarg: DynamicCache(config=self._model.config)}
        with torch.inference_mode():
            for _ in range(sampling.max_tokens):
                out = self._model(input_ids=ids, use_cache=True, **cache)
                logits = out.logits[:, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                picked = [0] * rows
                for r in range(rows):
                    if done[r]:
                        continue
                    token = _pick(logits[r], sampling, generators[r])
                    picked[r] = token
                    tokens[r].append(token)
                    logprobs[r].append(float(logp[r, token]))
                    done[r] = token in stop
                if all(done):
                    break
                ids = torch.tensor(picked, dtype=torch.long, device=self._device).view(rows, 1)
        return [
            Completion(tuple(t), tuple(lp), "stop" if t[-1] in stop else "length")
            for t, lp in zip(tokens, logprobs, strict=True)
        ]


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token: argmax when greedy, else a seeded draw after temperature/top-k/top-p."""
    if sampling.greedy or generator is None:
        return int(torch.argmax(logits))
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.numel():
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
