"""A text task for GRPO with a programmatic reward: add two decimal numbers.

A prompt is one ChatML user turn and the opening of the assistant's, the way Qwen's chat
template lays them out::

    <|im_start|>user
    17+25=<|im_end|>
    <|im_start|>assistant

(with a newline after ``assistant``). The right completion is the sum in canonical decimal
(``42``) followed by ``<|im_end|>`` (or the tokenizer's eos). :meth:`TextTask.reward` scores
what the policy wrote before its first end marker, in [0, 1]:

- 1.0 for the exact sum (surrounding whitespace ignored),
- otherwise, for a plain ASCII decimal number (digits only): 0.2 for being a number, and if
  it has as many digits as the sum another 0.2 plus 0.4 times the fraction of digit
  positions that match, which stays below 0.8 for any wrong answer,
- 0.0 for anything else (no digits, other characters, a prompt that is not this task's).

This module is pure Python: the tokenizer helpers take any object with the few methods of a
``transformers`` tokenizer that they call (:class:`TokenizerLike`), so importing it imports
neither ``transformers`` nor ``tokenizers``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from swarm.errors import LocalProtocolError

EOS = "<|endoftext|>"
"""End of text: the tokenizer's eos and pad token."""
IM_START = "<|im_start|>"
"""Opens a ChatML turn."""
IM_END = "<|im_end|>"
"""Closes a ChatML turn; the policy's answer ends with it."""
SPECIAL_TOKENS = (EOS, IM_START, IM_END)
"""The special tokens, in the order of their ids (0, 1, 2 in the shipped tokenizer)."""

_END_MARKERS = (IM_END, EOS)
_NUMBER = re.compile(r"[0-9]+", re.ASCII)


class TokenizerLike(Protocol):
    """What :func:`encode_prompts`, :func:`decode_completion` and :func:`stop_token_ids` call
    on a tokenizer (a ``transformers`` fast tokenizer has all of it)."""

    @property
    def eos_token_id(self) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               **kwargs: Any) -> str | list[str]: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...


def format_prompt(question: str) -> str:
    """The ChatML text of one user turn holding ``question``, then the assistant's opening."""
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"


@dataclass(frozen=True, slots=True)
class TextTask:
    """Add two random numbers of up to ``max_digits`` digits each; reward in [0, 1]."""

    seed: int = 0
    """Seeds the prompts: the same (seed, step, n) gives the same prompts in any process."""
    max_digits: int = 2
    """Each operand is drawn uniformly from 0 .. 10**max_digits - 1."""
    max_new_tokens: int = 8
    """Tokens a rollout may generate per prompt (the sum's digits and the end marker fit)."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise LocalProtocolError("seed must be a non-negative int")
        if isinstance(self.max_digits, bool) or not isinstance(self.max_digits, int) \
                or not 1 <= self.max_digits <= 9:
            raise LocalProtocolError("max_digits must be an int in 1..9")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < self.max_digits + 2:
            raise LocalProtocolError("max_new_tokens must be an int >= max_digits + 2 "
                                     "(the sum's digits, one per token, and the end marker)")

    @property
    def _prompt_re(self) -> re.Pattern[str]:
        operand = f"([0-9]{{1,{self.max_digits}}})"
        return re.compile(re.escape(f"{IM_START}user\n") + operand + r"\+" + operand + "="
                          + re.escape(f"{IM_END}\n{IM_START}assistant\n"), re.ASCII)

    def prompts(self, step: int, n: int) -> list[str]:
        """The ``n`` prompts of training step ``step``; a function of (seed, step, n) only."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise LocalProtocolError("step must be a non-negative int")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise LocalProtocolError("n must be a non-negative int")
        # A str seed is hashed with SHA-512 by random.seed: stable across processes/versions.
        rng = random.Random(f"swarm.hf.TextTask:{self.seed}:{self.max_digits}:{step}")
        hi = 10 ** self.max_digits
        return [format_prompt(f"{rng.randrange(hi)}+{rng.randrange(hi)}=") for _ in range(n)]

    def answer(self, prompt: str) -> str | None:
        """The correct answer to ``prompt`` (the sum in canonical decimal), or None if
        ``prompt`` is not a prompt of this task."""
        if not isinstance(prompt, str):
            return None
        m = self._prompt_re.fullmatch(prompt)
        if m is None:
            return None
        return str(int(m.group(1)) + int(m.group(2)))

    def reference_completion(self, prompt: str) -> str:
        """The text a perfect policy writes after ``prompt``: the answer, then ``<|im_end|>``.

        :raises LocalProtocolError: ``prompt`` is not a prompt of this task.
        """
        target = self.answer(prompt)
        if target is None:
            raise LocalProtocolError("not a prompt of this task")
        return target + IM_END

    def reward(self, prompt: str, completion: str) -> float:
        """The reward in [0, 1] of ``completion`` (decoded text) as the answer to ``prompt``.

        Only the text before the first ``<|im_end|>`` or ``<|endoftext|>`` counts (none
        there when it came from :func:`decode_completion`). Never raises: a prompt that is
        not this task's, or a completion that is not a str, scores 0.0.
        """
        target = self.answer(prompt)
        if target is None or not isinstance(completion, str):
            return 0.0
        for marker in _END_MARKERS:
            completion = completion.split(marker, 1)[0]
        text = completion.strip()
        if text == target:
            return 1.0
        if _NUMBER.fullmatch(text) is None:
            return 0.0
        score = 0.2
        if len(text) == len(target):
            same = sum(a == b for a, b in zip(text, target, strict=True))
            score += 0.2 + 0.4 * same / len(target)
        return score


def encode_prompts(tokenizer: TokenizerLike, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt; the special tokens in the text map to their ids and nothing
    is added (no bos)."""
    return [list(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]


def stop_token_ids(tokenizer: TokenizerLike) -> tuple[int, ...]:
    """The ids that end a completion: eos, then ``<|im_end|>`` (once each).

    :raises LocalProtocolError: the tokenizer lacks an eos or ``<|im_end|>``.
    """
    eos = tokenizer.eos_token_id
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    ids: list[int] = []
    for tid in (eos, im_end):
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise LocalProtocolError("tokenizer has no eos or no <|im_end|> token")
        if tid not in ids:
            ids.append(tid)
    if tokenizer.decode([ids[-1]], skip_special_tokens=False) != IM_END:
        raise LocalProtocolError("tokenizer has no <|im_end|> token")
    return tuple(ids)


def decode_completion(tokenizer: TokenizerLike, token_ids: Sequence[int]) -> str:
    """The text of a generated completion: the ids before the first stop id (eos or
    ``<|im_end|>``), decoded with special tokens skipped and spaces left as they are."""
    stops = set(stop_token_ids(tokenizer))
    ids: list[int] = []
    for tid in token_ids:
        t = int(tid)
        if t in stops:
            break
        ids.append(t)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not isinstance(text, str):
        raise LocalProtocolError("tokenizer.decode of one sequence did not return a str")
    return text
