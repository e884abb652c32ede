"""The demo's tiny policy: a random-init ``Qwen3ForCausalLM`` built from a small config.

Nothing is downloaded: the architecture is transformers' Qwen3, the weights are drawn from
N(0, ``init_std``) under a fixed seed, so every process that builds the same config gets
bit-identical weights. The trainer keeps an fp32 master copy; peers hold the inference
state (:func:`inference_state`), by default bf16, and compute in fp32 on bf16-valued
weights (CPU bf16 matmuls are slow without AMX, and fp32 compute keeps sampling stable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.errors import LocalProtocolError

INFERENCE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """Shape of the demo policy (a Qwen3 decoder)."""

    vocab_size: int = 32
    """Token ids 0..vocab_size-1; the task uses the first few, the rest are distractors."""
    hidden_size: int = 128
    """Residual width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Query heads per layer."""
    num_kv_heads: int = 2
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int = 32
    """Width of one head."""
    intermediate_size: int = 512
    """MLP hidden width."""
    max_positions: int = 64
    """Longest prompt + completion the rotary tables cover."""
    init_std: float = 0.02
    """Standard deviation of the random initialisation."""
    seed: int = 0
    """Seed of the initial weights: same config, same weights, in every process."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise LocalProtocolError(f"TinyModelConfig.{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise LocalProtocolError("num_heads must be a multiple of num_kv_heads")
        if not self.init_std > 0:
            raise LocalProtocolError("init_std must be positive")


def build_model(cfg: TinyModelConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A fresh model with the config's seeded random weights, in eval mode.

    The global torch RNG is left as it was.
    """
    from swarm.engines.torch_engine import random_qwen3

    model: torch.nn.Module = random_qwen3(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_positions=cfg.max_positions, tie_word_embeddings=False, init_std=cfg.init_std,
        seed=cfg.seed, dtype=dtype, use_cache=False)
    return model


def inference_state(model: torch.nn.Module, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """The published state: every parameter cast to ``dtype``, detached, contiguous, on CPU.

    Keys and order are the model's ``state_dict`` order (the layout the delta codec uses).
    """
    try:
        dt = INFERENCE_DTYPES[dtype]
    except KeyError:
        raise LocalProtocolError(f"inference dtype must be one of {sorted(INFERENCE_DTYPES)}") \
            from None
    return {
        name: t.detach().to(device="cpu", dtype=dt).contiguous().clone()
        for name, t in model.state_dict().items()
    }


def load_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place (casting to the model's dtype).

    :raises LocalProtocolError: the names or shapes do not match the model.
    """
    own = model.state_dict()
    if list(own) != list(state):
        raise LocalProtocolError("state names do not match the model's parameters")
    with torch.no_grad():
        for name, dst in own.items():
            src = state[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise LocalProtocolError(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)


def model_from_state(cfg: TinyModelConfig, state: Mapping[str, torch.Tensor],
                     compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A model of shape ``cfg`` holding ``state``'s values, computing in ``compute_dtype``."""
    model = build_model(cfg, compute_dtype)
    load_state(model, state)
    return model


def delta_density(prev: Mapping[str, torch.Tensor], cur: Mapping[str, torch.Tensor]) -> float:
    """Fraction of elements whose raw bits differ between two states of the same layout.

    Bits, not values: -0.0 vs +0.0 and NaN payloads count as changes.
    """
    changed = 0
    total = 0
    for name, a in prev.items():
        b = cur[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise LocalProtocolError(f"{name}: dtype or shape differs between the states")
        int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        changed += int(torch.count_nonzero(a.view(int_dtype) != b.view(int_dtype)))
        total += a.numel()
    return changed / total if total else 0.0
