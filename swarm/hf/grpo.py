"""GRPO for Hugging Face causal LMs on real text: prompts and completions of any length.

Each sequence is its prompt then its completion, right-padded to the batch's longest;
the loss covers completion tokens only. Log-probs are at temperature 1 (the engines
report them so), against the ones the peers reported while sampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from swarm.demo.grpo import Rollout, StepMetrics, group_advantages
from swarm.errors import LocalProtocolError


def grpo_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              groups: Sequence[Sequence[Rollout]], rewards: Sequence[Sequence[float]], *,
              pad_id: int, clip_eps: float = 0.2, max_grad_norm: float = 1.0,
              adv_eps: float = 1e-4) -> StepMetrics:
    """One clipped policy-gradient update from groups of completions of one prompt each.

    :raises LocalProtocolError: groups and rewards do not line up, an empty prompt, or a
        completion whose log-probs do not match its tokens.
    """
    if len(groups) != len(rewards) or not groups:
        raise LocalProtocolError("groups and rewards must align and be non-empty")
    rows: list[tuple[Rollout, float]] = []
    flat = 0
    every: list[float] = []
    for group, rs in zip(groups, rewards, strict=True):
        if len(group) != len(rs) or not group:
            raise LocalProtocolError("each group needs one reward per completion")
        adv = group_advantages(rs, adv_eps)
        flat += all(a == 0.0 for a in adv)
        rows += [(c, a) for c, a in zip(group, adv, strict=True) if c.tokens]
        every.extend(rs)
    if any(not c.prompt or len(c.logprobs) != len(c.tokens) for c, _ in rows):
        raise LocalProtocolError("a completion without a prompt, or log-probs that do not "
                                 "match its tokens")
    mean = sum(every) / len(every)
    std = math.sqrt(sum((r - mean) ** 2 for r in every) / len(every))
    if not rows:  # every completion ended at once: nothing to learn from
        return StepMetrics(0.0, mean, std, flat / len(groups), 0.0, 0.0, 0.0)
    device = next(model.parameters()).device
    width = max(len(c.prompt) + len(c.tokens) for c, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    old = torch.zeros((len(rows), width - 1))
    mask = torch.zeros((len(rows), width - 1))
    for i, (c, _) in enumerate(rows):
        p, n = len(c.prompt), len(c.prompt) + len(c.tokens)
        ids[i, :n] = torch.tensor([*c.prompt, *c.tokens])
        attention[i, :n] = 1
        # position t predicts token t + 1: the completion's tokens are predicted from p - 1
        old[i, p - 1:n - 1] = torch.tensor(c.logprobs)
        mask[i, p - 1:n - 1] = 1.0
    ids, attention, old, mask = (t.to(device) for t in (ids, attention, old, mask))
    advantage = torch.tensor([a for _, a in rows], device=device)[:, None]

    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1, :].float()
    new = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None])[:, :, 0]
    ratio = torch.exp((new - old) * mask)
    surrogate = torch.minimum(ratio * advantage,
                              ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage)
    tokens = mask.sum()
    loss = -(surrogate * mask).sum() / tokens
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    clipped = (((ratio - 1.0).abs() > clip_eps).float() * mask).sum() / tokens
    gap = ((new.detach() - old).abs() * mask).sum() / tokens
    return StepMetrics(loss=float(loss.detach()), reward_mean=mean, reward_std=std,
                       flat_groups=flat / len(groups), grad_norm=float(grad_norm),
                       clipped_frac=float(clipped), logprob_gap=float(gap))
