"""The demo's toy task: prompts and a programmatic reward, in pure Python (no torch).

Sort the digits. A prompt is ``BOS d1 d2 ... dn SEP`` with n random decimal digits; the
policy answers with exactly n tokens, which should be those digits in ascending order.
The reward is in [0, 1] and gives partial credit, so a random policy scores above zero
and the group-normalised advantage has something to push on from the first step:

- half of it is the multiset overlap between the answer and the prompt's digits
  (the policy first learns to copy the prompt's digits rather than other tokens), and
- half is the fraction of positions holding the right digit of the sorted answer.

Token ids: 0 pad, 1 BOS, 2 SEP, 3..12 the digits 0..9; any other id in the model's
vocabulary is a distractor that earns nothing.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.errors import LocalProtocolError

PAD = 0
BOS = 1
SEP = 2
DIGIT0 = 3
NUM_DIGITS = 10
MIN_VOCAB = DIGIT0 + NUM_DIGITS


def digit_token(d: int) -> int:
    """Token id of the decimal digit ``d``."""
    return DIGIT0 + d


@dataclass(frozen=True, slots=True)
class SortTask:
    """Sort ``n_digits`` random digits; reward in [0, 1] with partial credit."""

    n_digits: int = 3
    """Digits per prompt, and tokens per answer."""
    overlap_weight: float = 0.5
    """Share of the reward given for using the prompt's digits in any order."""

    def __post_init__(self) -> None:
        if not 1 <= self.n_digits <= 16:
            raise LocalProtocolError("n_digits must be in 1..16")
        if not 0.0 <= self.overlap_weight <= 1.0:
            raise LocalProtocolError("overlap_weight must be in [0, 1]")

    @property
    def prompt_len(self) -> int:
        """Tokens in every prompt."""
        return self.n_digits + 2

    @property
    def completion_len(self) -> int:
        """Tokens the policy generates per prompt."""
        return self.n_digits

    def prompts(self, seed: int, count: int) -> list[tuple[int, ...]]:
        """``count`` prompts drawn from a generator seeded with ``seed``."""
        rng = random.Random(seed)
        return [
            (BOS, *(digit_token(rng.randrange(NUM_DIGITS)) for _ in range(self.n_digits)), SEP)
            for _ in range(count)
        ]

    def target(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The correct answer to ``prompt``.

        :raises LocalProtocolError: ``prompt`` is not a prompt of this task.
        """
        if (len(prompt) != self.prompt_len or prompt[0] != BOS or prompt[-1] != SEP
                or any(not DIGIT0 <= t < DIGIT0 + NUM_DIGITS for t in prompt[1:-1])):
            raise LocalProtocolError("not a prompt of this task")
        return tuple(sorted(prompt[1:-1]))

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """Score one answer: overlap credit plus positional credit, in [0, 1].

        Only the first ``completion_len`` tokens count; a short answer loses the rest.
        """
        want = self.target(prompt)
        got = tuple(completion[: self.completion_len])
        overlap = sum((Counter(got) & Counter(want)).values()) / self.n_digits
        exact = sum(g == w for g, w in zip(got, want, strict=False)) / self.n_digits
        return self.overlap_weight * overlap + (1.0 - self.overlap_weight) * exact

    def solved(self, prompt: Sequence[int], completion: Sequence[int]) -> bool:
        """Whether the answer is exactly the sorted digits."""
        return tuple(completion[: self.completion_len]) == self.target(prompt)
