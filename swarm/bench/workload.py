"""The issue's measurement workload: a Qwen3-style decoder trained by AdamW at lr 1e-6 with
a policy-gradient loss on random tokens; deltas are taken between consecutive bf16 copies.

Imports torch and transformers; only ``swarm bench`` (and tests that ask for it) import it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Qwen3-style decoder shape (separate input embedding and LM head, as
    ``Qwen3Config`` defaults to)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 64

    @property
    def params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + 2 * self.head_dim
        return 2 * self.vocab * self.hidden + self.layers * (attn + mlp + norms) + self.hidden


PRESETS: dict[str, ModelShape] = {
    "5M": ModelShape(vocab=4096, hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2),
    "30M": ModelShape(vocab=16000, hidden=512, layers=6, intermediate=1536, heads=8,
                      kv_heads=4),
    "100M": ModelShape(vocab=32000, hidden=768, layers=8, intermediate=2048, heads=12,
                       kv_heads=4),
    "250M": ModelShape(vocab=32000, hidden=1024, layers=15, intermediate=3072, heads=16,
                       kv_heads=8),
}


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Training settings of the workload (the issue's defaults)."""

    shape: ModelShape
    lr: float = 1e-6
    weight_decay: float = 0.01
    batch: int = 4
    seq: int = 64
    seed: int = 0


class Workload:
    """A model, its AdamW optimizer and a seeded stream of random policy-gradient batches."""

    def __init__(self, config: WorkloadConfig) -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        s = config.shape
        self.config = config
        torch.manual_seed(config.seed)
        self._gen = torch.Generator().manual_seed(config.seed + 1)
        hf = Qwen3Config(
            vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
            intermediate_size=s.intermediate, num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads, head_dim=s.head_dim, initializer_range=0.02,
            tie_word_embeddings=False, max_position_embeddings=max(4 * config.seq, 256),
        )
        self.model = Qwen3ForCausalLM(hf)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                     betas=(0.9, 0.999), weight_decay=config.weight_decay)
        self.steps = 0

    def step(self) -> float:
        """One optimizer step: -(advantage * log p(sampled token)) on a random batch."""
        c = self.config
        tokens = torch.randint(0, c.shape.vocab, (c.batch, c.seq + 1), generator=self._gen)
        adv = torch.randn(c.batch, 1, generator=self._gen)
        logits = self.model(input_ids=tokens[:, :-1]).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        taken = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(adv * taken).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.steps += 1
        return loss.item()

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The bf16 inference copy, in state_dict order (shared tensors appear once)."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            out[name] = t.detach().to(torch.bfloat16).contiguous().clone()
        return out


def delta_pair(config: WorkloadConfig, warmup: int,
               progress: Callable[[str], None] | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 states after ``warmup`` and ``warmup + 1`` optimizer steps."""
    w = Workload(config)
    t0 = time.perf_counter()
    for _ in range(warmup):
        w.step()
    old = w.bf16_state()
    w.step()
    new = w.bf16_state()
    if progress is not None:
        progress(f"workload: {warmup + 1} steps of {config.shape.params / 1e6:.0f}M params in "
                 f"{time.perf_counter() - t0:.1f}s")
    return old, new
