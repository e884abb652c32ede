"""Throughput-aware lease sizing and adaptive lease timeouts (pure functions and small tables).

A lease should last about ``target_lease_s``: the number of tasks it carries is the peer's
speed (tokens/s) times that duration divided by the tokens one task costs. A peer's speed is
what the trainer observed from its accepted results when it has seen any (a claimed speed is
trusted only up to ``claim_trust`` times the observed one); before that, the claim. The
timeout is ``slack * expected + base``, clamped, so fast peers get short leases and
stragglers are cut off and their tasks re-issued instead of waited for. Heartbeats renew a
lease but never beyond ``max_lifetime_factor * expected + base`` after issue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """How leases are sized and timed."""

    target_lease_s: float = 30.0
    """Wall time one lease should take at the peer's speed."""
    min_tasks: int = 1
    """Fewest tasks in a lease (when the queue has that many)."""
    max_tasks: int = 256
    """Most tasks in one lease, whatever the speed."""
    default_tokens_per_task: float = 512.0
    """Tokens one task (a whole group) costs before any result has been observed."""
    timeout_slack: float = 2.0
    """Timeout is ``slack`` times the expected duration ..."""
    timeout_base_s: float = 5.0
    """... plus this fixed allowance (network, engine warm-up)."""
    min_timeout_s: float = 10.0
    """Shortest timeout a lease gets."""
    max_timeout_s: float = 600.0
    """Longest timeout a lease gets (and heartbeats renew by)."""
    max_lifetime_factor: float = 4.0
    """Heartbeats never keep a lease beyond ``factor * expected + base`` after its issue."""
    ewma_alpha: float = 0.3
    """Weight of the newest observation in the speed and cost averages."""
    claim_trust: float = 2.0
    """Once a peer's speed is observed, its claim counts up to this multiple of it."""
    staleness_margin: float = 0.75
    """A lease is sized to end within this fraction of the time its version stays usable."""

    def __post_init__(self) -> None:
        if not 0 < self.min_tasks <= self.max_tasks:
            raise ValueError("need 0 < min_tasks <= max_tasks")
        if self.target_lease_s <= 0 or self.default_tokens_per_task <= 0:
            raise ValueError("target_lease_s and default_tokens_per_task are positive")
        if not 0 < self.min_timeout_s <= self.max_timeout_s:
            raise ValueError("need 0 < min_timeout_s <= max_timeout_s")
        if not 0 < self.ewma_alpha <= 1 or not 0 < self.staleness_margin <= 1:
            raise ValueError("ewma_alpha and staleness_margin are in (0, 1]")


@dataclass(frozen=True, slots=True)
class LeasePlan:
    """How many tasks to hand out and for how long."""

    n_tasks: int
    expected_s: float
    timeout_s: float
    max_lifetime_s: float


def ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class SpeedTable:
    """Observed tokens/s per peer and the average cost of a task, as exponential averages.

    Holds one float per peer that ever delivered a result (bounded by the peer population).
    """

    __slots__ = ("_alpha", "_speeds", "_tokens_per_task", "_trust")

    def __init__(self, config: SchedulingConfig) -> None:
        self._alpha = config.ewma_alpha
        self._trust = config.claim_trust
        self._speeds: dict[str, float] = {}
        self._tokens_per_task: float = config.default_tokens_per_task

    def observe(self, peer: str, tokens: int, tasks: int, seconds: float) -> None:
        """Record that ``peer`` produced ``tokens`` over ``tasks`` tasks in ``seconds``."""
        if tasks > 0 and tokens > 0:
            self._tokens_per_task = ewma(self._tokens_per_task, tokens / tasks, self._alpha)
        if seconds > 0 and tokens > 0:
            self._speeds[peer] = ewma(self._speeds.get(peer), tokens / seconds, self._alpha)

    def timed_out(self, peer: str, planned_speed: float) -> None:
        """A lease planned at ``planned_speed`` expired: plan the next one at half of it."""
        if planned_speed > 0:
            self._speeds[peer] = planned_speed / (2 * self._trust)

    def observed(self, peer: str) -> float | None:
        return self._speeds.get(peer)

    def effective(self, peer: str, claimed: float) -> float:
        """The speed to plan with: the claim, capped by what was observed."""
        seen = self._speeds.get(peer)
        if seen is None:
            return claimed
        return min(claimed, seen * self._trust) if claimed > 0 else seen

    @property
    def tokens_per_task(self) -> float:
        return self._tokens_per_task


def plan_lease(config: SchedulingConfig, *, speed: float, tokens_per_task: float, want: int,
               available: int, headroom_s: float | None = None) -> LeasePlan:
    """Size a lease for a peer running at ``speed`` tokens/s.

    ``headroom_s`` is how long the peer's current version stays within the staleness bound
    (``None``: no known limit); the lease is shrunk to fit inside it, but never below
    ``min_tasks``.
    """
    duration = config.target_lease_s
    if headroom_s is not None:
        duration = max(0.0, min(duration, config.staleness_margin * headroom_s))
    per_task = max(tokens_per_task, 1.0)
    ideal = math.floor(speed * duration / per_task) if speed > 0 else 0
    n = max(config.min_tasks, min(ideal, config.max_tasks))
    n = max(0, min(n, want, available))
    expected = n * per_task / speed if speed > 0 else config.target_lease_s
    timeout = config.timeout_slack * expected + config.timeout_base_s
    timeout = min(max(timeout, config.min_timeout_s), config.max_timeout_s)
    lifetime = max(timeout, config.max_lifetime_factor * expected + config.timeout_base_s)
    return LeasePlan(n, expected, timeout, lifetime)


def staleness_headroom(*, peer_version: int, latest: int, max_staleness: int,
                       step_interval_s: float | None, since_publish_s: float) -> float | None:
    """Seconds until ``peer_version`` falls out of the bound ``version >= latest - k``.

    Estimated from the trainer's observed step interval; ``None`` when no interval is known.
    An overdue step counts as imminent, but later steps still take a whole interval each
    (a trainer that waits for rollouts must not shrink every lease to nothing).
    """
    if step_interval_s is None:
        return None
    steps_left = peer_version - (latest - max_staleness) + 1
    elapsed = min(since_publish_s, step_interval_s)
    return max(0.0, steps_left * step_interval_s - elapsed)
