"""Checks of untrusted rollouts: what the trainer runs on a result before any of it counts.

Bit-exact weights prove what a peer *holds*, not what it *returns*. A result the lease book
would count (signed by the lease's holder, live lease, version in the window, right shape:
:meth:`~swarm.protocol.leases.TrainerLeases.admissible`) goes through the trainer's checks
first, one result at a time, off the event loop. A check is any callable taking a
:class:`CheckInput` and returning ``None`` (passed) or a one-line reason (failed). A failed
result never reaches :meth:`~swarm.roles.trainer.TrainerNode.collect`: its lease closes,
its tasks are re-issued to other peers and its signer is scored (banned after repeated
failures); the peer gets a signed verdict naming the result's commitment and the reason.

Checks here need no model: :class:`RootCheck` (the result names the weights of its
version) and :class:`CopyCheck` (no completion is one already seen for another task). The
log-prob and plausibility checks that run the policy are
:class:`swarm.engines.rollout_check.LogprobCheck`.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import blake3

from swarm.protocol.leases import Result, RolloutTask


@dataclass(frozen=True, slots=True)
class CheckInput:
    """What a check sees: the result, the tasks it answers, and the state root the trainer
    published for the result's version (``None`` when that version is no longer kept)."""

    result: Result
    tasks: Mapping[int, RolloutTask]
    root: bytes | None


Check = Callable[[CheckInput], str | None]
"""A check: ``None`` when the result passes, else why it fails (one line)."""


class RootCheck:
    """The result names the weight root the trainer published for its version: a peer that
    generated with other weights and says so is refused without a forward pass."""

    name = "root"

    def __call__(self, inp: CheckInput) -> str | None:
        if inp.root is None:
            return f"version {inp.result.version} is no longer kept for checking"
        if inp.result.root != inp.root:
            return (f"generated with weights of root {inp.result.root.hex()[:12]}, not "
                    f"version {inp.result.version}'s {inp.root.hex()[:12]}")
        return None


class CopyCheck:
    """No completion may repeat, token for token *and* log-prob for log-prob, one already
    returned for another prompt: a peer copying completions (its own earlier ones, or
    another peer's) instead of generating. Log-probs depend on the prompt, so an honest
    engine gives another prompt other log-probs even when it samples the same tokens (a
    converged policy, or one seed shared by many tasks, does that); the same prompt again
    (a backup lease, a repeated prompt) is not a copy. Completions shorter than
    ``min_tokens`` are not compared. Every completion checked is remembered, whatever the
    later checks say (a copy of a refused result is a copy too); at most ``capacity``."""

    name = "copy"

    def __init__(self, *, min_tokens: int = 4, capacity: int = 1 << 16) -> None:
        self.min_tokens = min_tokens
        self.capacity = capacity
        self._seen: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()

    def __call__(self, inp: CheckInput) -> str | None:
        failed: str | None = None
        for tr in inp.result.results:
            task = inp.tasks.get(tr.task_id)
            if task is None:
                continue
            prompt = blake3.blake3(array.array("I", task.prompt_tokens).tobytes()).digest()
            for comp in tr.completions:
                if len(comp.token_ids) < self.min_tokens:
                    continue
                h = blake3.blake3(array.array("I", comp.token_ids).tobytes())
                h.update(array.array("d", comp.logprobs).tobytes())
                task_id, seen_prompt = self._seen.setdefault(h.digest(), (tr.task_id, prompt))
                self._seen.move_to_end(h.digest())
                if seen_prompt != prompt and failed is None:
                    failed = f"task {tr.task_id}: a completion copied from task {task_id}"
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return failed
