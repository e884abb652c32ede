"""An engine wrapper that proves every update landed: ``swarm peer --check-engine``.

After every ``apply`` (and once at start) it reads the engine's per-tensor digests and
compares them with digests of the canonical state the peer verified against the trainer's
signed root. A mismatch (an engine that repacked, cast, dropped or misplaced a write) is
an :class:`~swarm.engines.EngineUpdateError`, which the peer treats as fatal; every check
is reported, with both digests, through ``report``.

Reading and hashing every tensor costs about one pass over the weights per update: this
is an operator's check, not the default.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from swarm.engines import EngineUpdateError, RolloutEngine, weights_digest
from swarm.engines.tensors import digest_of
from swarm.engines.wrapper import EngineWrapper

#: ``report(fields)``: called after every check with what it found.
Report = Callable[[dict[str, object]], None]


class CheckedEngine(EngineWrapper):
    """``inner``, checked against ``state`` (the peer's canonical state, which it patches
    in place) after every update."""

    def __init__(self, inner: RolloutEngine, state: Mapping[str, torch.Tensor],
                 report: Report) -> None:
        super().__init__(inner)
        self._state = state
        self._report = report
        self.checks = 0

    def check(self, applied: int = 0, apply_s: float = 0.0) -> None:
        """Compare every tensor of the state with the engine's copy.

        :raises EngineUpdateError: the engine lacks a tensor or holds other bytes.
        """
        t0 = time.perf_counter()
        names = list(self._state)
        want = {n: digest_of(self._state[n]) for n in names}
        got = self.inner.tensor_digests(names)
        bad = sorted(n for n in names if got.get(n) != want[n])
        self.checks += 1
        self._report({
            "ok": not bad, "tensors": len(names), "applied": applied,
            "engine": weights_digest(got).hex(), "state": weights_digest(want).hex(),
            "mismatched": bad[:8], "apply_s": round(apply_s, 4),
            "check_s": round(time.perf_counter() - t0, 4)})
        if bad:
            raise EngineUpdateError(
                f"the engine's weights differ from the verified state in {len(bad)} of "
                f"{len(names)} tensors (first: {bad[0]})")

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        self.inner.apply(update)
        self.check(len(update), time.perf_counter() - t0)

    def apply_sparse(self, update: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        self.inner.apply_sparse(update)
        self.check(len(update), time.perf_counter() - t0)
