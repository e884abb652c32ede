"""A cheating rollout engine, for testing the trainer's checks: ``swarm peer --chaos-cheat``.

It holds verified weights like any peer (the follower's root checks pass) but returns
completions the trainer must not count. Strategies:

- ``random``: random tokens with made-up log-probs, generated with no model at all;
- ``fake-logprobs``: the model's tokens, with made-up log-probs;
- ``stale``: generates with the previous version (every update applied one version late)
  while it says the current one;
- ``other-model``: generates with other weights (a copy of the first ones plus noise, which
  no update reaches);
- ``copy``: returns completions of other prompts (as a peer copying another peer's
  answers would);
- ``cherry-pick``: draws several completions per prompt under other seeds and returns the
  most likely one, with its true log-probs: plausible under the policy, but not the
  seeded sample (only a replay shows it).

The strategies are :data:`swarm.engines.CHEAT_STRATEGIES`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Mapping, Sequence

import torch

from swarm.engines import CHEAT_STRATEGIES, Completion, RolloutEngine, Sampling
from swarm.engines.wrapper import EngineWrapper
from swarm.errors import LocalProtocolError


class CheatingEngine(EngineWrapper):
    """``inner`` (a :class:`~swarm.engines.torch_engine.TorchEngine` for ``other-model``),
    cheating by ``strategy``; seeded, so a test sees the same lies every run."""

    def __init__(self, inner: RolloutEngine, strategy: str, *, vocab_size: int,
                 seed: int = 0) -> None:
        if strategy not in CHEAT_STRATEGIES:
            raise LocalProtocolError(f"cheat strategy is one of {', '.join(CHEAT_STRATEGIES)}")
        super().__init__(inner)
        self.strategy = strategy
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._late: list[tuple[str, object]] = []
        self._answers: dict[tuple[int, ...], list[Completion]] = {}
        self._other: RolloutEngine | None = None
        if strategy == "other-model":
            model = getattr(inner, "model", None)
            if not isinstance(model, torch.nn.Module):
                raise LocalProtocolError("--chaos-cheat other-model needs --engine torch")
            from swarm.engines.torch_engine import TorchEngine

            self._other = TorchEngine(self._perturbed(model, seed))  # type: ignore[arg-type]

    @staticmethod
    def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
        """A copy of ``model`` with noise of each tensor's own scale: other weights, which
        the verified updates never reach."""
        other = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in other.parameters():
                if p.is_floating_point():
                    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                    p.add_((noise * p.float().std().clamp_min(1e-3)).to(p.dtype))
        return other

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        if self.strategy == "random":
            lp = -math.log(self.vocab_size)
            return [Completion(tuple(self._rng.randrange(self.vocab_size)
                                     for _ in range(sampling.max_tokens)),
                               (lp,) * sampling.max_tokens) for _ in prompts]
        if self.strategy == "copy":
            return [self._copied(tuple(p), sampling) for p in prompts]
        if self.strategy == "cherry-pick":
            return self._cherry_picked(prompts, sampling)
        out = (self._other or self.inner).generate(prompts, sampling)
        if self.strategy == "fake-logprobs":
            out = [Completion(c.token_ids, tuple(-self._rng.uniform(0.0, 2.0)
                                                 for _ in c.logprobs), c.finish_reason)
                   for c in out]
        return out

    def _cherry_picked(self, prompts: Sequence[Sequence[int]], sampling: Sampling
                       ) -> list[Completion]:
        draws = [self.inner.generate(prompts, sampling if j == 0 else dataclasses.replace(
            sampling, seed=((sampling.seed or 0) + 7919 * j) % (1 << 62))) for j in range(4)]
        return [max((d[i] for d in draws), key=lambda c: sum(c.logprobs))
                for i in range(len(prompts))]

    def _copied(self, prompt: tuple[int, ...], sampling: Sampling) -> Completion:
        """An answer given to another prompt: one it answered before, else an answer to a
        prompt of its own making (the same one with the last token changed)."""
        others = [k for k in self._answers if k != prompt]
        if not others:
            decoy = (*prompt[:-1], (prompt[-1] + 1) % self.vocab_size)
            self._answers[decoy] = self.inner.generate([list(decoy)], sampling)
            others = [decoy]
        answer = self._rng.choice(self._answers[self._rng.choice(others)])
        self._answers.setdefault(prompt, []).append(answer)
        return answer

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        self._late_apply("dense", {k: v.clone() for k, v in update.items()})

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._late_apply("sparse", {k: (i.clone(), v.clone()) for k, (i, v) in update.items()})

    def _late_apply(self, kind: str, update: object) -> None:
        if self.strategy != "stale":
            self._apply(kind, update)
            return
        self._late.append((kind, update))
        if len(self._late) > 1:
            self._apply(*self._late.pop(0))

    def _apply(self, kind: str, update: object) -> None:
        if kind == "dense":
            self.inner.apply(update)  # type: ignore[arg-type]
        else:
            self.inner.apply_sparse(update)  # type: ignore[arg-type]
