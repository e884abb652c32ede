"""The trainer's log-prob and plausibility check of untrusted completions (torch).

For every completion of a result, :class:`LogprobCheck` runs the policy of the version the
result names over prompt + completion in one forward pass (the completions of a task are
batched) and refuses the result when:

- **log-probs**: a reported per-token log-prob (under the model's raw distribution, as
  :class:`~swarm.protocol.leases.Completion` defines it) differs from the recomputed one by
  more than :attr:`Tolerance.max_abs`, or on average by more than :attr:`Tolerance.mean_abs`.
  This catches made-up log-probs, another model and another version, as far as those move
  the log-probs more than engines of one kind disagree;
- **support**: a sampled token lies outside what the task's sampling settings allow: not
  the argmax when greedy, outside the top-k, or outside the top-p nucleus (each with a
  margin of :attr:`Tolerance.max_abs`, since engines disagree at the boundary);
- **likelihood**: the tokens are far less likely than samples of the sampling distribution
  would be: a Chernoff bound on the chance that honest sampling (temperature, top-k, top-p)
  draws a completion this surprising is below e to the :attr:`Tolerance.min_log_p`. This
  catches made-up tokens with log-probs recomputed to match, once the policy has learnt
  anything (a uniform policy makes every sequence as likely as any other). The bound holds
  for any distributions, so an honest completion is refused with at most that chance; a
  z-score of the summed log-probability, used before, refused honest ones: one rare token
  under a peaked distribution put two of some 20,000 demo completions below z = -6, and the
  trainer, re-leasing their tasks with the same seeds, stalled for good.

Tolerances depend on the pair of engines (the peer's and this recomputation) and the
dtype: :data:`TOLERANCES` holds those measured here (``swarm bench checks``).
"""

from __future__ import annotations

import copy
import math
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import blake3
import torch

from swarm.engines import RolloutEngine
from swarm.protocol.checks import Check, CheckInput
from swarm.protocol.leases import Completion, Sampling


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How far honest completions may be from the recomputation."""

    max_abs: float
    """Largest per-token |reported - recomputed| log-prob."""
    mean_abs: float
    """Largest mean per-token |reported - recomputed| over a completion."""
    min_log_p: float = -30.0
    """Least natural log of :func:`measure`'s bound on the chance of a completion as
    surprising under the sampling distribution (honest ones fall below it with at most
    that chance, ``exp(-30)`` = 1e-13, allowing ``max_abs`` per token of engine drift)."""


#: Per dtype of the published state, then per peer engine class (the result's
#: ``engine``), for the trainer's torch recomputation. Measured here (largest honest gap
#: per token / largest mean per completion): on the 1 MB demo policy (``swarm bench
#: checks``, 6 versions x 16 tasks x 4 completions) torch peers 0 in bf16 and 9.5e-7 in
#: fp32, vLLM CPU peers 0.012 / 0.005 in bf16 and 7.2e-7 in fp32; on the 25M-parameter HF
#: model of ``swarm.hf.model`` (8 x 8 tasks x 4 completions of up to 8 tokens) torch
#: 0.041 / 0.015 and vLLM 0.046 / 0.018 in bf16. The bf16 gap grows with the model (the
#: peer decodes token by token with a KV cache, the check runs one forward pass); the
#: bounds are about 5x the 25M figures. A peer one version behind is 0.49-0.51 off on
#: average on the demo policy, made-up log-probs 2-3.
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "bfloat16": {"torch": Tolerance(max_abs=0.25, mean_abs=0.08),
                 "vllm": Tolerance(max_abs=0.25, mean_abs=0.08)},
    "float32": {"torch": Tolerance(max_abs=1e-3, mean_abs=2e-4),
                "vllm": Tolerance(max_abs=1e-3, mean_abs=2e-4)},
}


def sampling_logprobs(logits: torch.Tensor, sampling: Sampling, margin: float = 0.0
                      ) -> torch.Tensor:
    """Log-probs of the distribution ``sampling`` draws from (temperature, then top-k, then
    top-p, as the engines apply them); ``-inf`` outside the allowed set, which ``margin``
    (in log-prob units) widens. ``logits`` is ``[..., vocab]`` float32."""
    if sampling.greedy:
        best = logits.max(dim=-1, keepdim=True).values
        allowed = logits >= best - margin
        return torch.where(allowed, 0.0, -math.inf) - torch.log(allowed.sum(-1, keepdim=True))
    scaled = logits / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth - margin, -math.inf)
    logq = torch.log_softmax(scaled, dim=-1)
    if sampling.top_p < 1:
        probs = logq.exp()
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        cut = torch.zeros_like(before, dtype=torch.bool).scatter_(
            -1, order, before >= min(1.0, sampling.top_p + margin))
        logq = torch.log_softmax(logq.masked_fill(cut, -math.inf), dim=-1)
    return logq


@torch.no_grad()
def recompute(model: torch.nn.Module, prompt: Sequence[int],
              completions: Sequence[Completion]) -> list[torch.Tensor]:
    """The model's float32 logits at every generated position of each completion
    (``[len(tokens), vocab]``), completions of one length in one forward pass."""
    out: list[torch.Tensor | None] = [None] * len(completions)
    by_len: dict[int, list[int]] = {}
    for i, c in enumerate(completions):
        by_len.setdefault(len(c.token_ids), []).append(i)
    device = next(model.parameters()).device
    p = len(prompt)
    for length, rows in by_len.items():
        if length == 0:
            for i in rows:
                out[i] = torch.empty(0, 0)
            continue
        ids = torch.tensor([[*prompt, *completions[i].token_ids] for i in rows],
                           dtype=torch.long, device=device)
        logits = model(input_ids=ids[:, :-1]).logits[:, p - 1:, :].float().cpu()
        for j, i in enumerate(rows):
            out[i] = logits[j]
    return [t for t in out if t is not None]


@dataclass(frozen=True, slots=True)
class Measured:
    """What the check measured on one completion (for calibration and reports)."""

    max_abs: float
    mean_abs: float
    outside: int
    """Tokens outside the sampling settings' support."""
    log_p: float
    """Natural log of a bound on the chance that sampling draws a completion as surprising
    (0: not surprising at all)."""


#: The Chernoff exponents tried (the bound is taken at the best one, and pays for the
#: choice with a union bound over all of them).
_EXPONENTS = tuple(k / 10 for k in range(1, 11))


def measure(logits: torch.Tensor, comp: Completion, sampling: Sampling,
            margin: float) -> Measured:
    """Compare one completion with its recomputed ``logits``."""
    n = len(comp.token_ids)
    if n == 0:
        return Measured(0.0, 0.0, 0, 0.0)
    tokens = torch.tensor(comp.token_ids, dtype=torch.long)
    if int(tokens.max()) >= logits.shape[-1]:
        return Measured(math.inf, math.inf, n, -math.inf)
    raw = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    diff = (torch.tensor(comp.logprobs, dtype=torch.float64) - raw.double()).abs()
    logq = sampling_logprobs(logits, sampling, margin)
    picked = logq.gather(1, tokens[:, None])[:, 0].double()
    outside = int(torch.isinf(picked).sum())
    surprisal = -float(torch.where(torch.isinf(picked), 0.0, picked).sum())
    return Measured(float(diff.max()), float(diff.mean()), outside,
                    surprise_bound(logq, surprisal, margin))


def surprise_bound(logq: torch.Tensor, surprisal: float, drift: float) -> float:
    """Natural log of a bound on P(S >= ``surprisal``), S being the summed surprisal
    (-log q) of a completion drawn position by position from ``logq`` (``[n, vocab]``,
    each row normalised, -inf outside the support), when the sampler's log-probs may be
    off from these by up to ``drift`` each.

    For a fixed exponent l in (0, 1], exp(l S) over the product of the per-position
    E[q^-l] = sum q^(1-l) is a martingale of mean 1, so by Markov
    P(S >= s) <= exp(-l s + sum_i log sum_x q_i(x)^(1-l)); a sampler off by ``drift``
    multiplies each expectation by at most exp(drift). The least over
    :data:`_EXPONENTS`, times their count for the choice, is the bound."""
    n = logq.shape[0]
    inf = torch.isinf(logq)
    best = 0.0
    for lam in _EXPONENTS:
        log_z = torch.logsumexp(torch.where(inf, -math.inf, (1.0 - lam) * logq), dim=-1)
        best = min(best, -lam * surprisal + float(log_z.double().sum()))
    return min(0.0, best + n * drift + math.log(len(_EXPONENTS)))


class LogprobCheck:
    """Recompute and compare, under the result's own version.

    ``model_for(version)`` returns the policy that version's peers run (the same weights and
    dtype), or ``None`` when the trainer no longer keeps it: such a result is refused when
    ``refuse_unknown`` (the default), else passed unchecked. ``tolerance`` is one for every
    peer, or one per engine class (:data:`TOLERANCES`); a result from an engine class it
    does not name is refused.
    """

    name = "logprobs"

    def __init__(self, model_for: Callable[[int], torch.nn.Module | None],
                 tolerance: Tolerance | Mapping[str, Tolerance], *,
                 refuse_unknown: bool = True) -> None:
        self.model_for = model_for
        self.tolerance = tolerance
        self.refuse_unknown = refuse_unknown
        #: Every completion's measurement, newest last (bounded): calibration reads it.
        self.seen: deque[Measured] = deque(maxlen=4096)

    def __call__(self, inp: CheckInput) -> str | None:
        res = inp.result
        model = self.model_for(res.version)
        if model is None:
            return (f"version {res.version} is not kept for checking"
                    if self.refuse_unknown else None)
        if isinstance(self.tolerance, Tolerance):
            tol = self.tolerance
        elif res.engine in self.tolerance:
            tol = self.tolerance[res.engine]
        else:
            return (f"engine {res.engine!r} has no calibrated tolerance (known: "
                    f"{', '.join(sorted(self.tolerance))})")
        for tr in res.results:
            task = inp.tasks.get(tr.task_id)
            if task is None:
                return f"task {tr.task_id} is not known"
            logits = recompute(model, task.prompt_tokens, tr.completions)
            for k, (comp, lg) in enumerate(zip(tr.completions, logits, strict=True)):
                v = measure(lg, comp, task.sampling, tol.max_abs)
                self.seen.append(v)
                where = f"task {tr.task_id} completion {k}"
                if v.max_abs > tol.max_abs or v.mean_abs > tol.mean_abs:
                    return (f"{where}: log-probs differ from version {res.version}'s by up "
                            f"to {v.max_abs:.3g} (mean {v.mean_abs:.3g}; tolerance "
                            f"{tol.max_abs:g}/{tol.mean_abs:g})")
                if v.outside:
                    return (f"{where}: {v.outside} token(s) outside what the sampling "
                            "settings allow")
                if v.log_p < tol.min_log_p:
                    return (f"{where}: tokens implausibly unlikely under the sampling "
                            f"settings (chance at most e^{v.log_p:.0f} < "
                            f"e^{tol.min_log_p:g})")
        return None


class ReplayCheck:
    """Spot checks by replay: a seeded fraction of tasks is generated again by the trainer,
    with the task's own sampling seed, on an engine of the peer's class; a deterministic
    engine (torch on one CPU kind) must give the same tokens exactly. This catches what
    log-probs cannot: completions that are plausible under the policy but not the seeded
    sample, such as the best of several draws picked for its reward.

    ``engine_for(version)`` returns such an engine holding ``version``'s weights (``None``:
    not kept, the task is not replayed); only results of engines of its class ``kind`` are
    replayed. Which tasks are replayed depends on ``seed``, which
    peers do not know. Tasks without a sampling seed cannot be replayed.
    """

    name = "replay"

    def __init__(self, engine_for: Callable[[int], RolloutEngine | None], fraction: float,
                 *, seed: int = 0, kind: str = "torch") -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction is in [0, 1]")
        self.engine_for = engine_for
        self.fraction = fraction
        self.seed = seed
        self.kind = kind
        self.replayed = 0

    def chosen(self, task_id: int) -> bool:
        h = blake3.blake3(f"{self.seed}/{task_id}".encode()).digest(8)
        return int.from_bytes(h, "little") < self.fraction * (1 << 64)

    def __call__(self, inp: CheckInput) -> str | None:
        res = inp.result
        if res.engine != self.kind:  # another class samples otherwise: log-probs only
            return None
        for tr in res.results:
            task = inp.tasks.get(tr.task_id)
            if task is None or task.sampling.seed is None or not self.chosen(tr.task_id):
                continue
            engine = self.engine_for(res.version)
            if engine is None:
                continue
            again = engine.generate([list(task.prompt_tokens)] * task.group_size,
                                    task.sampling)
            self.replayed += 1
            for k, (mine, theirs) in enumerate(zip(again, tr.completions, strict=True)):
                if mine.token_ids != theirs.token_ids:
                    return (f"task {tr.task_id} completion {k}: replayed with its seed under "
                            f"version {res.version}, the tokens differ")
        return None


class PolicyWindow:
    """The policies of the last ``keep`` published versions as peers run them (the
    published state's values and dtype): what :class:`LogprobCheck` recomputes with and
    :class:`ReplayCheck` replays on.

    ``build(state)`` makes a model holding ``state`` (for a transformers model:
    :func:`policy_builder`). Publish through :meth:`add`, which keeps the version::

        window = PolicyWindow(policy_builder(model))
        node = TrainerNode(identity, net, config, checks=window.checks("bfloat16"))
        await node.publish(window.add(step, inference_state(model)))
    """

    def __init__(self, build: Callable[[Mapping[str, torch.Tensor]], torch.nn.Module],
                 keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep at least one version")
        self.build = build
        self.keep = keep
        self._models: dict[int, torch.nn.Module] = {}
        self._engines: dict[int, RolloutEngine] = {}

    def add(self, version: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep ``version``'s policy, forget the oldest past ``keep``; returns ``state``."""
        self._models[version] = self.build(state).eval()
        self._engines.pop(version, None)
        for old in sorted(self._models)[:-self.keep]:
            del self._models[old]
            self._engines.pop(old, None)
        return state

    def model_for(self, version: int) -> torch.nn.Module | None:
        return self._models.get(version)

    def engine_for(self, version: int) -> RolloutEngine | None:
        """A torch engine over ``version``'s policy, as a torch peer runs it."""
        from swarm.engines.torch_engine import TorchEngine

        model = self._models.get(version)
        if model is not None and version not in self._engines:
            self._engines[version] = TorchEngine(model)  # type: ignore[arg-type]
        return self._engines.get(version)

    def checks(self, dtype: str, *, replay_fraction: float = 0.1,
               seed: int | None = None) -> list[Check]:
        """The log-prob check with the measured tolerances of ``dtype``, and replays of
        ``replay_fraction`` of the tasks (chosen by ``seed``, random when ``None``)."""
        if dtype not in TOLERANCES:
            raise ValueError(f"no tolerances for {dtype!r}: {', '.join(TOLERANCES)}")
        pick = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        return [LogprobCheck(self.model_for, TOLERANCES[dtype]),
                ReplayCheck(self.engine_for, replay_fraction, seed=pick)]


def policy_builder(model: torch.nn.Module) -> Callable[[Mapping[str, torch.Tensor]],
                                                       torch.nn.Module]:
    """``build`` for :class:`PolicyWindow` from a transformers model: per version, a model
    of its config in the state's dtype holding the state (keys as ``model.state_dict()``'s,
    which is what ``swarm.inference_state`` publishes).

    The policy is built as a peer builds the run card's model
    (:func:`~swarm.engines.hf_model.like_a_peer`), not copied from ``model``: a
    training framework patches its model (accelerate wraps ``forward`` to run in float32
    and closes over the original module), and a copy would run the live training weights.
    The first version pays one initialisation; later ones copy the previous policy.

    :raises TypeError: ``model`` is not a transformers model (it has no config to build
        from; build the policy yourself, as :func:`swarm.demo.model.model_from_state` does).
    """
    if not callable(getattr(getattr(model, "config", None), "to_json_string", None)):
        raise TypeError(f"policy_builder needs a transformers model (with a config), not a "
                        f"{type(model).__name__}")
    last: dict[torch.dtype, torch.nn.Module] = {}  # the policy built last, by its dtype

    def build(state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        from swarm.engines.hf_model import like_a_peer

        dtype = next(iter(state.values())).dtype
        before = last.get(dtype)
        policy = copy.deepcopy(before) if before is not None else like_a_peer(model, dtype)
        policy.load_state_dict(dict(state))
        last.clear()
        last[dtype] = policy
        return policy.eval()

    return build
