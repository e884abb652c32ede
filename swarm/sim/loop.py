"""The RL loop in virtual time: trainer steps, rollout leases, bounded staleness, syncs.

One trainer and ``n`` rollout peers (actors). Each step the trainer consumes one batch:
one lease from every actor, sized by the actor's throughput (``tokens_per_s *
rollout_s`` tokens, so every lease takes ``rollout_s``). Batch ``j`` feeds trainer step
``j``, which takes ``trainer_step_s`` and publishes version ``j + 1``; version 0 is held by
every actor at the start. An actor starts its lease of batch ``j`` once it finished its
previous lease and holds a version of at least ``j - staleness``; it generates with the
newest version it holds, and goes on generating on the old one while a new one downloads
(it switches when the new one is verified). With ``staleness = 0`` the loop is on-policy:
every actor waits for each new version.

Syncs come from one distribution run per method (:mod:`swarm.sim.endtoend`): ``sync_s[i]``
is when actor ``i`` holds a version after its distribution starts. The network carries one
version at a time: the next starts when the last one reached every actor. A delta method
sends every version in order (a chain); a dense method sends only the newest version
published by then (a state supersedes older ones).

Churn: each online actor leaves at ``churn_per_min`` percent a minute (its lease is lost)
and comes back after an exponential time of mean ``away_s``, either as a returner with the
version it left with or as a fresh joiner holding version 0 (the base checkpoint). It then
catches up before its next lease: a dense method sends the newest state; a delta method
takes the route the follower takes (:func:`swarm.protocol.picker.plan_catch_up`, as in
:mod:`swarm.protocol.follow`): the chain of retained deltas, or a keyframe (the dense state)
when the chain is gone (past ``keep_versions``) or costs more. Catch-up time is its bytes
over the actor's downlink. No version is lost: every published version stays reachable
through a retained chain or a keyframe. Once caught up, an actor generates for the batch
after the one under way (the trainer does not wait a whole rollout for an actor that came
back after its batch started), and the trainer stops waiting for an actor that left.

Figures are taken over a steady window, the second half of the steps (from the end of
trainer step ``steps // 2 - 1`` to the end of the last one; the whole run for one step).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from swarm.content.manifest import Manifest
from swarm.protocol.picker import plan_catch_up

MAX_EVENTS = 5_000_000

_TRAIN, _LEASE, _DELIVER, _NET_FREE, _LEAVE, _BACK, _CAUGHT = range(7)


class LoopError(Exception):
    """The loop model could not finish (its event budget ran out)."""


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """What every method shares: the workload and the actors."""

    steps: int
    rollout_s: float
    trainer_step_s: float
    rates: tuple[float, ...]
    """Each actor's rollout tokens/s."""
    down: tuple[float, ...] = ()
    """Each actor's downlink in bytes/s (for catch-up; empty: no churn)."""
    delta_bytes: float = 0.0
    state_bytes: float = 0.0
    keep_versions: int = 8
    churn_per_min: float = 0.0
    away_s: float = 120.0
    fresh_joiners: float = 0.5
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Method:
    """How one method syncs: per-actor sync times of one version, its staleness bound,
    whether it sends states (newest only) or deltas (in order), and the bytes one version's
    distribution costs."""

    name: str
    sync_s: tuple[float, ...]
    staleness: int
    dense: bool = False
    egress_bytes: float = 0.0
    """Bytes the trainer sends per version distributed."""
    wan_bytes: float = 0.0
    """Bytes that cross regions per version distributed."""


@dataclass(slots=True)
class LoopResult:
    """One method's run of the loop."""

    name: str
    steps: int
    duration_s: float
    """Until the last trainer step ended."""
    window_s: float
    window_steps: int
    tokens_per_s: float
    """Rollout tokens the trainer consumed per second over the window."""
    trainer_idle: float
    actor_idle: float
    """Fraction of the actors' online GPU time not spent generating, over the window."""
    exposed_sync_s: float
    """Seconds per actor per step an actor waited for a version already published (or
    caught up after churn), over the window."""
    catch_up_s: float
    """The part of ``exposed_sync_s`` spent catching up after churn."""
    mean_lag: float
    """Mean off-policy lag (steps) of the rollouts consumed."""
    versions_sent: int
    egress_bytes: float
    """Trainer egress over the run (syncs; catch-up is served by the swarm or counted in
    ``catch_up``)."""
    wan_bytes: float
    lost_tokens: float = 0.0
    catch_up: dict[str, float] = field(default_factory=dict)
    """Churn: ``leaves``, ``returners``, ``joiners``, ``chain`` and ``keyframe`` counts,
    ``chain_bytes``, ``keyframe_bytes``, ``dense_bytes``."""

    @property
    def egress_per_step(self) -> float:
        return self.egress_bytes / max(1, self.steps)


def _clip(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


class _Manifests:
    """Stand-in manifests of the run's versions, for the follower's route rule."""

    def __init__(self, delta_bytes: float, state_bytes: float) -> None:
        self.delta = max(1, int(delta_bytes))
        self.state = max(1, int(state_bytes))
        self.cache: dict[int, Manifest] = {}

    @staticmethod
    def root(v: int) -> bytes:
        return v.to_bytes(4, "big") * 8

    def delta_to(self, v: int) -> Manifest:
        m = self.cache.get(v)
        if m is None:
            m = self.cache[v] = Manifest(
                run="sim", step=v, kind="delta", base_root=self.root(v - 1),
                target_root=self.root(v), layout_digest=b"\0" * 32, codec="sim",
                piece_size=1 << 20, chunks=((self.root(v), self.delta),))
        return m

    def catch_up(self, held: int, head: int, keep: int) -> tuple[str, int]:
        """``("chain" | "keyframe", bytes)`` from ``held`` to ``head``."""
        kept = {s: self.delta_to(s) for s in range(max(1, head - keep + 1), head + 1)}
        plan = plan_catch_up(held, self.root(held), head, kept, self.state)
        return ("chain" if plan.kind == "chain" else "keyframe"), plan.nbytes


@dataclass(slots=True)
class _Actor:
    online: bool = True
    held: int = 0
    next_j: int = 0
    busy: tuple[int, float, int] | None = None
    """(batch, start, version) of the lease being generated."""
    catching: bool = False
    epoch: int = 0
    wait_since: float | None = None
    online_since: float = 0.0
    online_iv: list[tuple[float, float]] = field(default_factory=list)
    busy_iv: list[tuple[float, float]] = field(default_factory=list)
    sync_iv: list[tuple[float, float]] = field(default_factory=list)
    catch_iv: list[tuple[float, float]] = field(default_factory=list)
    rng: random.Random | None = None


class _Loop:
    def __init__(self, spec: LoopSpec, m: Method) -> None:
        if len(m.sync_s) != len(spec.rates):
            raise ValueError("one sync time per actor")
        if spec.steps < 1 or spec.rollout_s <= 0 or spec.trainer_step_s < 0:
            raise ValueError("steps >= 1, rollout_s > 0, trainer_step_s >= 0")
        self.spec, self.m = spec, m
        self.k = m.staleness
        self.actors = [_Actor() for _ in spec.rates]
        self.heap: list[tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.published = [0.0]
        self.tokens = [0.0] * spec.steps
        self.lags: list[tuple[int, float]] = []
        self.next_step = 0
        self.training = False
        self.ends: list[float] = []
        self.net_busy = False
        self.last_sent = 0
        self.versions_sent = 0
        self.lost = 0.0
        self.counts = {"leaves": 0.0, "returners": 0.0, "joiners": 0.0, "chain": 0.0,
                       "keyframe": 0.0, "dense": 0.0, "chain_bytes": 0.0,
                       "keyframe_bytes": 0.0, "dense_bytes": 0.0}
        self.manifests = _Manifests(spec.delta_bytes, spec.state_bytes)
        self.leave_rate = spec.churn_per_min / 100.0 / 60.0
        if self.leave_rate > 0:
            if len(spec.down) != len(spec.rates):
                raise ValueError("churn needs each actor's downlink")
            for i, a in enumerate(self.actors):
                a.rng = random.Random(f"{spec.seed}:{i}")
                self._push(a.rng.expovariate(self.leave_rate), _LEAVE, i, 0, 0)

    def _push(self, t: float, kind: int, a: int, b: int, epoch: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, epoch))

    # ---------------------------------------------------------------- actors
    def _try_start(self, i: int) -> None:
        a = self.actors[i]
        if not a.online or a.catching or a.busy is not None:
            return
        j = a.next_j
        if j >= self.spec.steps + self.k + 1:
            return
        if a.held < max(0, j - self.k):
            if a.wait_since is None:
                a.wait_since = self.now
            return
        self._end_wait(a, j)
        a.busy = (j, self.now, a.held)
        self._push(self.now + self.spec.rollout_s, _LEASE, i, j, a.epoch)

    def _end_wait(self, a: _Actor, j: int) -> None:
        """Close a wait: the part after the needed version was published is sync."""
        if a.wait_since is None:
            return
        need = max(0, j - self.k)
        if need < len(self.published):
            t0 = max(a.wait_since, self.published[need])
            if self.now > t0:
                a.sync_iv.append((t0, self.now))
        a.wait_since = None

    def _lease_done(self, i: int, j: int) -> None:
        a = self.actors[i]
        assert a.busy is not None
        _, start, version = a.busy
        a.busy = None
        a.busy_iv.append((start, self.now))
        if j < self.spec.steps:
            self.tokens[j] += self.spec.rates[i] * self.spec.rollout_s
            self.lags.append((j, j - version))
        a.next_j = j + 1
        self._try_start(i)

    def _leave(self, i: int) -> None:
        a = self.actors[i]
        a.epoch += 1
        if a.busy is not None:
            _, start, _ = a.busy
            a.busy_iv.append((start, self.now))
            self.lost += self.spec.rates[i] * (self.now - start)
            a.busy = None
        if a.catching:
            a.catching = False
            start, _ = a.catch_iv[-1]
            a.catch_iv[-1] = (start, self.now)
        elif a.wait_since is not None:
            self._end_wait(a, a.next_j)
        a.online = False
        a.online_iv.append((a.online_since, self.now))
        self.counts["leaves"] += 1
        assert a.rng is not None
        self._push(self.now + a.rng.expovariate(1.0 / self.spec.away_s), _BACK, i, 0, 0)

    def _back(self, i: int) -> None:
        a = self.actors[i]
        assert a.rng is not None
        fresh = a.rng.random() < self.spec.fresh_joiners
        self.counts["joiners" if fresh else "returners"] += 1
        if fresh:
            a.held = 0
        a.online, a.online_since = True, self.now
        head = len(self.published) - 1
        nbytes = 0.0
        if a.held < head:
            if self.m.dense:
                kind, nbytes = "dense", self.spec.state_bytes
            else:
                kind, n = self.manifests.catch_up(a.held, head, self.spec.keep_versions)
                nbytes = float(n)
            self.counts[kind] += 1
            self.counts[f"{kind}_bytes"] += nbytes
        a.catching = True
        t = nbytes / self.spec.down[i] if nbytes else 0.0
        a.catch_iv.append((self.now, self.now + t))
        self._push(self.now + t, _CAUGHT, i, 0, a.epoch)
        self._push(self.now + a.rng.expovariate(self.leave_rate), _LEAVE, i, 0, 0)

    def _caught_up(self, i: int) -> None:
        a = self.actors[i]
        a.catching = False
        a.held = max(a.held, len(self.published) - 1)
        # the batch after the one under way (see the module's docstring)
        j = self.next_step
        started = j < self.spec.steps and (self.tokens[j] > 0 or any(
            b.busy is not None and b.busy[0] == j for b in self.actors))
        a.next_j = max(a.next_j, j + 1 if started else j)
        self._try_start(i)
        self._try_train()

    # ---------------------------------------------------------------- trainer, net
    def _try_train(self) -> None:
        if self.training or self.next_step >= self.spec.steps:
            return
        j = self.next_step
        owed = any(a.online and not a.catching and a.next_j <= j for a in self.actors)
        if owed or self.tokens[j] <= 0:
            return
        self.training = True
        self.next_step += 1
        self._push(self.now + self.spec.trainer_step_s, _TRAIN, 0, j, 0)

    def _trained(self, j: int) -> None:
        self.training = False
        self.ends.append(self.now)
        self.published.append(self.now)
        self._try_send()
        self._try_train()

    def _try_send(self) -> None:
        head = len(self.published) - 1
        if self.net_busy or head <= self.last_sent:
            return
        v = head if self.m.dense else self.last_sent + 1
        self.last_sent = v
        self.versions_sent += 1
        self.net_busy = True
        for i, a in enumerate(self.actors):
            if a.online:
                self._push(self.now + self.m.sync_s[i], _DELIVER, i, v, a.epoch)
        self._push(self.now + max(self.m.sync_s, default=0.0), _NET_FREE, 0, 0, 0)

    def run(self) -> LoopResult:
        for i in range(len(self.actors)):
            self._try_start(i)
        for _ in range(MAX_EVENTS):
            if len(self.ends) == self.spec.steps or not self.heap:
                break
            t, _, kind, i, b, epoch = heapq.heappop(self.heap)
            self.now = t
            a = self.actors[i]
            if kind == _TRAIN:
                self._trained(b)
            elif kind == _NET_FREE:
                self.net_busy = False
                self._try_send()
            elif kind == _LEAVE:
                if a.online:
                    self._leave(i)
                    self._try_train()  # it may have been the last one owing a lease
            elif kind == _BACK:
                self._back(i)
            elif epoch != a.epoch:
                continue
            elif kind == _LEASE:
                self._lease_done(i, b)
                self._try_train()
            elif kind == _DELIVER:
                a.held = max(a.held, b)
                self._try_start(i)
            elif kind == _CAUGHT:
                self._caught_up(i)
        if len(self.ends) < self.spec.steps:
            raise LoopError(f"{self.m.name}: the loop did not finish {self.spec.steps} steps")
        return self._result()

    def _result(self) -> LoopResult:
        n = self.spec.steps
        w = n // 2 if n >= 2 else 0
        t0 = self.ends[w - 1] if w else 0.0
        t1 = self.ends[-1]
        span = max(t1 - t0, 1e-12)
        steps_in = n - w
        online = busy = sync = catch = 0.0
        for a in self.actors:
            ivs = a.online_iv + ([(a.online_since, t1)] if a.online else [])
            online += _clip(ivs, t0, t1)
            running = [(a.busy[1], t1)] if a.busy is not None else []
            busy += _clip(a.busy_iv + running, t0, t1)
            waiting = []
            if a.wait_since is not None:
                need = max(0, a.next_j - self.k)
                if need < len(self.published):
                    waiting = [(max(a.wait_since, self.published[need]), t1)]
            sync += _clip(a.sync_iv + waiting, t0, t1)
            catch += _clip(a.catch_iv, t0, t1)
        n_act = max(1, len(self.actors))
        lags = [lag for j, lag in self.lags if j >= w]
        return LoopResult(
            name=self.m.name, steps=n, duration_s=t1, window_s=span, window_steps=steps_in,
            tokens_per_s=sum(self.tokens[w:]) / span,
            trainer_idle=max(0.0, 1.0 - steps_in * self.spec.trainer_step_s / span),
            actor_idle=max(0.0, 1.0 - busy / online) if online > 0 else 1.0,
            exposed_sync_s=(sync + catch) / n_act / steps_in,
            catch_up_s=catch / n_act / steps_in,
            mean_lag=sum(lags) / len(lags) if lags else 0.0,
            versions_sent=self.versions_sent,
            egress_bytes=self.versions_sent * self.m.egress_bytes,
            wan_bytes=self.versions_sent * self.m.wan_bytes,
            lost_tokens=self.lost,
            catch_up=dict(self.counts) if self.leave_rate > 0 else {},
        )


def simulate_loop(spec: LoopSpec, method: Method) -> LoopResult:
    """Run ``spec.steps`` trainer steps of the loop with ``method``'s syncs.

    :raises LoopError: the event budget ran out first.
    """
    return _Loop(spec, method).run()
