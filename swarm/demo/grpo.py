"""GRPO for the demo: rollouts a remote peer can run, and the trainer's update.

Split the way the swarm splits it:

- :func:`generate` runs on a rollout peer with its own copy of the inference state: for
  each prompt it samples a group of completions under an explicit seed and records the
  per-token log-probs of the sampled tokens. The result is plain ints and floats
  (:meth:`Rollout.to_obj`), so it crosses the network unchanged.
- :func:`train_step` runs on the trainer with the fp32 master model: rewards are
  normalised within each group, ``advantage = (r - mean) / (std + eps)``, and the loss is
  the PPO-clipped surrogate summed over completion tokens and averaged over completions.
  On fresh rollouts the ratio to the rollout log-probs is about 1, so its gradient is that
  of ``-mean(advantage * sum log-prob)``; rollouts from a stale version (a peer that has
  not patched yet) are kept from pushing the policy too far by the clip.
- :func:`run_local` drives the whole loop in one process (no network) and returns the
  reward per step together with the density of each published delta.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.demo.model import (
    INFERENCE_DTYPES,
    TinyModelConfig,
    build_model,
    delta_density,
    inference_state,
    load_state,
    model_from_state,
)
from swarm.demo.task import SortTask
from swarm.errors import DecodeError, LocalProtocolError

log = logging.getLogger(__name__)

MAX_SEQUENCE = 4096
"""Bound on prompt and completion lengths accepted from the network."""


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sampled answer as the GRPO loss takes it: its prompt, the sampled token ids and
    their log-probs (a :class:`swarm.protocol.leases.Completion` plus the prompt it
    continues)."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each sampled token under the sampling policy (at its temperature)."""

    def to_obj(self) -> dict[str, list[int] | list[float]]:
        """Plain lists, ready for msgpack."""
        return {"prompt": list(self.prompt), "tokens": list(self.tokens),
                "logprobs": list(self.logprobs)}

    @classmethod
    def from_obj(cls, obj: object, *, vocab_size: int,
                 max_len: int = MAX_SEQUENCE) -> Rollout:
        """Strictly decode :meth:`to_obj`'s form received from a peer.

        :raises DecodeError: wrong keys or types, ids outside the vocabulary, lengths over
            ``max_len`` or not matching, log-probs not finite or above 0.
        """
        if not isinstance(obj, dict) or set(obj) != {"prompt", "tokens", "logprobs"}:
            raise DecodeError("rollout: expected a map with prompt, tokens, logprobs")
        prompt, tokens, logprobs = obj["prompt"], obj["tokens"], obj["logprobs"]
        for name, seq in (("prompt", prompt), ("tokens", tokens), ("logprobs", logprobs)):
            if not isinstance(seq, list) or len(seq) > max_len:
                raise DecodeError(f"rollout: {name} must be a list of at most {max_len}")
        if not prompt:
            raise DecodeError("rollout: empty prompt")
        for name, ids in (("prompt", prompt), ("tokens", tokens)):
            if any(type(t) is not int or not 0 <= t < vocab_size for t in ids):
                raise DecodeError(f"rollout: {name} holds a non-token")
        if len(logprobs) != len(tokens):
            raise DecodeError("rollout: one log-prob per token expected")
        if any(type(x) is not float or not math.isfinite(x) or x > 0.0 for x in logprobs):
            raise DecodeError("rollout: log-probs must be finite floats <= 0")
        return cls(tuple(prompt), tuple(tokens), tuple(logprobs))


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """What one :func:`train_step` did."""

    loss: float
    reward_mean: float
    reward_std: float
    """Standard deviation of the rewards over the whole batch."""
    flat_groups: float
    """Fraction of groups whose rewards were all equal (no learning signal)."""
    grad_norm: float
    """Gradient norm before clipping."""
    clipped_frac: float
    """Fraction of completion tokens whose ratio fell outside the clip range."""
    logprob_gap: float
    """Mean |trainer log-prob - rollout log-prob| per token (inference dtype mismatch and
    staleness show up here)."""


def _as_model(model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
              config: TinyModelConfig | None) -> torch.nn.Module:
    if isinstance(model_or_state, torch.nn.Module):
        return model_or_state
    if config is None:
        raise LocalProtocolError("generate from a state needs the model config")
    return model_from_state(config, model_or_state)


def _check_prompts(prompts: Sequence[Sequence[int]]) -> int:
    if not prompts:
        raise LocalProtocolError("no prompts")
    length = len(prompts[0])
    if length == 0 or any(len(p) != length for p in prompts):
        raise LocalProtocolError("prompts must be non-empty and of equal length")
    return length


@torch.no_grad()
def generate(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor],
    prompts: Sequence[Sequence[int]],
    group_size: int,
    seed: int,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    config: TinyModelConfig | None = None,
) -> list[list[Rollout]]:
    """Sample ``group_size`` completions of ``max_new_tokens`` tokens for each prompt.

    ``model_or_state`` is a model, or an inference state plus its ``config`` (a model is
    then built for this call; a peer that keeps its model and patches it in place passes
    the model). Same weights, prompts and seed give the same completions. Returns one
    group per prompt, in prompt order.

    :raises LocalProtocolError: no prompts, prompts of unequal length, bad settings.
    """
    if group_size < 1 or max_new_tokens < 1 or not temperature > 0:
        raise LocalProtocolError("group_size, max_new_tokens and temperature must be positive")
    _check_prompts(prompts)
    model = _as_model(model_or_state, config)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    ids = ids.repeat_interleave(group_size, dim=0)
    sampled: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids.to(_device(model))).logits[:, -1, :]
        logp = torch.log_softmax(logits.float().cpu() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        sampled.append(tok[:, 0])
        logps.append(logp.gather(1, tok)[:, 0])
        ids = torch.cat([ids, tok], dim=1)
    tokens = torch.stack(sampled, dim=1).tolist()
    lps = torch.stack(logps, dim=1).tolist()
    return [
        [Rollout(tuple(p), tuple(tokens[i * group_size + j]),
                    tuple(lps[i * group_size + j]))
         for j in range(group_size)]
        for i, p in enumerate(prompts)
    ]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group (sample std; 0 for a group of one)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    return [(r - mean) / (std + eps) for r in rewards]


def train_step(
    master_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[Rollout]],
    rewards: Sequence[Sequence[float]],
    *,
    temperature: float = 1.0,
    clip_eps: float = 0.2,
    max_grad_norm: float = 1.0,
    adv_eps: float = 1e-4,
) -> StepMetrics:
    """One GRPO update of ``master_model`` from grouped completions and their rewards.

    ``completions[i]`` and ``rewards[i]`` are the group sampled for ``prompts[i]``; every
    completion in the batch must have the same length.

    :raises LocalProtocolError: the three sequences do not line up.
    """
    if not (len(prompts) == len(completions) == len(rewards)) or not prompts:
        raise LocalProtocolError("prompts, completions and rewards must align and be non-empty")
    prompt_len = _check_prompts(prompts)
    seqs: list[list[int]] = []
    old: list[tuple[float, ...]] = []
    adv: list[float] = []
    flat = 0
    all_rewards: list[float] = []
    for prompt, group, rs in zip(prompts, completions, rewards, strict=True):
        if len(group) != len(rs) or not group:
            raise LocalProtocolError("each group needs one reward per completion")
        a = group_advantages(rs, adv_eps)
        flat += all(x == 0.0 for x in a)
        for c, adv_c in zip(group, a, strict=True):
            if c.prompt != tuple(prompt):
                raise LocalProtocolError("a completion does not belong to its prompt")
            seqs.append([*c.prompt, *c.tokens])
            old.append(c.logprobs)
            adv.append(adv_c)
        all_rewards.extend(rs)
    comp_len = len(old[0])
    if comp_len == 0 or any(len(o) != comp_len for o in old):
        raise LocalProtocolError("completions must be non-empty and of equal length")

    device = _device(master_model)
    ids = torch.tensor(seqs, dtype=torch.long, device=device)
    old_lp = torch.tensor(old, dtype=torch.float32, device=device)
    advantage = torch.tensor(adv, dtype=torch.float32, device=device)[:, None]

    logits = master_model(input_ids=ids).logits[:, prompt_len - 1:-1, :].float()
    new_lp = torch.log_softmax(logits / temperature, dim=-1).gather(
        2, ids[:, prompt_len:, None])[:, :, 0]
    ratio = torch.exp(new_lp - old_lp)
    surrogate = torch.minimum(ratio * advantage,
                              ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage)
    loss = -surrogate.sum(dim=1).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    grad_norm = torch.nn.utils.clip_grad_norm_(master_model.parameters(), max_grad_norm)
    optimizer.step()

    n = len(all_rewards)
    mean = sum(all_rewards) / n
    return StepMetrics(
        loss=float(loss.detach()),
        reward_mean=mean,
        reward_std=math.sqrt(sum((r - mean) ** 2 for r in all_rewards) / n),
        flat_groups=flat / len(prompts),
        grad_norm=float(grad_norm),
        clipped_frac=float(((ratio - 1.0).abs() > clip_eps).float().mean()),
        logprob_gap=float((new_lp.detach() - old_lp).abs().mean()),
    )


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                   eps: float = 1e-8) -> torch.optim.Optimizer:
    """The trainer's AdamW."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=eps,
                             weight_decay=weight_decay)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (run seed, step, peer...), the same in every process."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The whole local GRPO loop; defaults are the demo's."""

    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    """The policy's shape and initial seed."""
    task: SortTask = field(default_factory=SortTask)
    """The task and its reward."""
    steps: int = 40
    """Optimizer steps (published versions after the base)."""
    prompts_per_step: int = 64
    """Prompts per step, split evenly over the peers."""
    group_size: int = 8
    """Completions sampled per prompt (the GRPO group)."""
    num_peers: int = 4
    """Rollout peers the prompts are split over."""
    lr: float = 3e-2
    """AdamW learning rate of the fp32 master. With ``adam_eps`` 0.1 the step of a weight
    is about ``lr / adam_eps`` times its (clipped) gradient: the effective rate is 0.3."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_eps: float = 0.1
    """AdamW epsilon, far above the default 1e-8 on purpose: Adam's normalised step moves
    every weight with any gradient by about ``lr``, which at a rate that learns in 40
    steps flips the bf16 bits of 90% of the elements each step. An epsilon above the
    typical gradient makes small-gradient weights move in proportion to their gradient,
    so most stay within half a bf16 ULP and the published delta is 30-40% dense at the
    same learning speed (see the report in ``python -m swarm.demo --sweep-lr``)."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs are taken at this temperature)."""
    clip_eps: float = 0.2
    """PPO clip range of the per-token ratio."""
    max_grad_norm: float = 1.0
    """Gradient norm clip."""
    inference_dtype: str = "bfloat16"
    """dtype of the published state peers generate with: bfloat16 or float32."""
    staleness: int = 0
    """Versions the peers' weights lag behind the trainer's (0: on-policy). A swarm peer
    keeps generating with ``v - 1`` while it fetches ``v``, so 1 is the realistic case."""
    seed: int = 0
    """Seed of prompts and sampling."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.prompts_per_step < 1 or self.group_size < 2:
            raise LocalProtocolError("steps >= 0, prompts_per_step >= 1, group_size >= 2")
        if self.staleness < 0:
            raise LocalProtocolError("staleness must be >= 0")
        if self.num_peers < 1 or self.prompts_per_step % self.num_peers:
            raise LocalProtocolError("prompts_per_step must be a multiple of num_peers")
        if self.inference_dtype not in INFERENCE_DTYPES:
            raise LocalProtocolError(f"inference_dtype must be one of {sorted(INFERENCE_DTYPES)}")
        if self.model.vocab_size < 13:
            raise LocalProtocolError("the task needs a vocabulary of at least 13 tokens")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of :func:`run_local`."""

    step: int
    """Version trained by this step (1 = first update)."""
    reward: float
    """Mean reward of this step's rollouts (sampled from version
    ``step - 1 - staleness``, or the base)."""
    solved: float
    """Fraction of this step's rollouts that were exactly right."""
    delta_density: float
    """Fraction of inference-state elements whose bits changed from ``step - 1``."""
    rollout_s: float
    """Seconds spent generating (all peers, one after another)."""
    train_s: float
    """Seconds of the trainer's update and of casting and diffing the new state."""
    metrics: StepMetrics


def rollout_prompts(cfg: DemoConfig, step: int) -> list[tuple[int, ...]]:
    """The prompts of ``step`` (1-based), the same in every process."""
    return cfg.task.prompts(derive_seed(cfg.seed, "prompts", step), cfg.prompts_per_step)


def peer_share(cfg: DemoConfig, prompts: Sequence[tuple[int, ...]],
               peer: int) -> list[tuple[int, ...]]:
    """The contiguous slice of ``prompts`` that rollout peer ``peer`` generates for."""
    per = len(prompts) // cfg.num_peers
    return list(prompts[peer * per:(peer + 1) * per])


def run_local(
    cfg: DemoConfig,
    on_step: Callable[[StepRecord], None] | None = None,
    on_publish: Callable[[int, Mapping[str, torch.Tensor]], None] | None = None,
) -> list[StepRecord]:
    """Train for ``cfg.steps`` steps in this process, peers and trainer alike.

    ``on_publish(version, state)`` sees every published inference state, the base
    (version 0) included, for example to measure what the delta codec makes of it.

    The trainer keeps the fp32 master and publishes the inference state after every step;
    each simulated peer holds its own model, loaded from a published state
    (``cfg.staleness`` versions old), and generates its share (1/num_peers) of the prompts
    with its own seed. Rewards are computed by the trainer.
    """
    log.debug("run_local: %d steps on %d torch threads", cfg.steps, torch.get_num_threads())
    master = build_model(cfg.model)
    optimizer = make_optimizer(master, cfg.lr, cfg.weight_decay, cfg.adam_eps)
    state = inference_state(master, cfg.inference_dtype)
    peers = [model_from_state(cfg.model, state) for _ in range(cfg.num_peers)]
    published = deque([state], maxlen=cfg.staleness + 1)
    if on_publish is not None:
        on_publish(0, state)
    records: list[StepRecord] = []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        for peer in peers:
            load_state(peer, published[0])
        prompts = rollout_prompts(cfg, step)
        groups: list[list[Rollout]] = []
        for i, peer in enumerate(peers):
            groups += generate(peer, peer_share(cfg, prompts, i), cfg.group_size,
                               derive_seed(cfg.seed, "rollout", step, i),
                               max_new_tokens=cfg.task.completion_len,
                               temperature=cfg.temperature)
        rewards = [[cfg.task.reward(c.prompt, c.tokens) for c in g] for g in groups]
        solved = sum(cfg.task.solved(c.prompt, c.tokens) for g in groups for c in g)
        t1 = time.perf_counter()
        metrics = train_step(master, optimizer, prompts, groups, rewards,
                             temperature=cfg.temperature, clip_eps=cfg.clip_eps,
                             max_grad_norm=cfg.max_grad_norm)
        new_state = inference_state(master, cfg.inference_dtype)
        density = delta_density(state, new_state)
        state = new_state
        published.append(state)
        t2 = time.perf_counter()
        if on_publish is not None:
            on_publish(step, state)
        rec = StepRecord(step=step, reward=metrics.reward_mean,
                         solved=solved / (len(groups) * cfg.group_size),
                         delta_density=density, rollout_s=t1 - t0, train_s=t2 - t1,
                         metrics=metrics)
        records.append(rec)
        log.info("step %d reward %.3f solved %.3f density %.4f", step, rec.reward,
                 rec.solved, density)
        if on_step is not None:
            on_step(rec)
    return records


def summarize(records: Sequence[StepRecord], window: int = 5) -> dict[str, Any]:
    """First/last-window mean reward, mean delta density and times, for reports."""
    if not records:
        return {}
    w = min(window, len(records))
    return {
        "steps": len(records),
        "reward_first": sum(r.reward for r in records[:w]) / w,
        "reward_last": sum(r.reward for r in records[-w:]) / w,
        "solved_first": sum(r.solved for r in records[:w]) / w,
        "solved_last": sum(r.solved for r in records[-w:]) / w,
        "density_mean": sum(r.delta_density for r in records) / len(records),
        "density_last": sum(r.delta_density for r in records[-w:]) / w,
        "rollout_s": sum(r.rollout_s for r in records),
        "train_s": sum(r.train_s for r in records),
    }
