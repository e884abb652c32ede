"""Fault scenarios for the lease protocol: the real lease books, virtual time, no network.

A trainer and its peers exchange encoded lease messages through an in-memory wire with
fixed latency; scenarios kill peers, cut a partition, forge and replay messages, crash and
restore the trainer, or slow peers down, and report what was issued, re-issued, counted
and refused. ``python -m swarm.sim.lease_faults [seed ...]`` prints every scenario.
"""

from __future__ import annotations

import heapq
import logging
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from swarm.content.ids import domain_hash
from swarm.errors import DecodeError, LocalProtocolError, SignatureError
from swarm.identity import Identity
from swarm.protocol.leases import (
    Completion,
    Lease,
    LeaseConfig,
    LeaseStats,
    MemoryLeaseStore,
    Message,
    PeerLeases,
    Reason,
    Result,
    RolloutTask,
    Sampling,
    TaskResult,
    TrainerLeases,
    Verdict,
    decode_message,
)
from swarm.protocol.leases.messages import LEASE_ID_LEN, lease_domain, ms
from swarm.protocol.scheduling import SchedulingConfig

SCENARIOS = ("baseline", "kill", "forgery", "partition", "restart", "stragglers")


@dataclass(frozen=True, slots=True)
class ScenarioReport:
    """Figures of one fault scenario run (virtual time, in-memory network)."""

    name: str
    seed: int
    peers: int
    tasks: int
    finished: bool
    """Every task was counted before the time and event bounds."""
    tasks_issued: int
    tasks_reissued: int
    tasks_backup: int
    """Tasks handed to a second peer as backups of an overdue lease (part of re-issued)."""
    tasks_completed: int
    lost: int
    double_counted: int
    leases_issued: int
    leases_expired: int
    refused: Mapping[str, int]
    """Trainer-side refusals by reason."""
    peer_refused: Mapping[str, int]
    """Refusals by honest peers (forged leases and the like), by reason."""
    banned: int
    """Peers the trainer ended up refusing work to."""
    affected_peers: int
    """Peers killed, partitioned, slowed or malicious (depends on the scenario)."""
    virtual_s: float
    messages: int

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def summary(self) -> str:
        refused = ", ".join(f"{k}={v}" for k, v in sorted(self.refused.items())) or "none"
        peer_refused = ", ".join(f"{k}={v}" for k, v in sorted(self.peer_refused.items()))
        return (f"[{self.name}] seed={self.seed} peers={self.peers} "
                f"affected={self.affected_peers} tasks={self.tasks} "
                f"issued={self.tasks_issued} reissued={self.tasks_reissued} "
                f"backup={self.tasks_backup} "
                f"completed={self.tasks_completed} lost={self.lost} "
                f"double_counted={self.double_counted} leases={self.leases_issued} "
                f"expired={self.leases_expired} banned={self.banned} "
                f"refused({refused}) peer_refused({peer_refused or 'none'}) "
                f"virtual={self.virtual_s:.1f}s messages={self.messages} "
                f"finished={self.finished}")


_TRAINER = "trainer"


class _Sim:
    """A tiny discrete-event loop: a heap of (time, seq, action), bounded in events."""

    def __init__(self, max_events: int) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.max_events = max_events
        self.events = 0

    def at(self, t: float, fn: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))

    def run(self, until: float, done: Any) -> None:
        while self._heap and self.events < self.max_events and not done():
            t, _, fn = heapq.heappop(self._heap)
            if t > until:
                break
            self.now = t
            self.events += 1
            fn()


class _World:
    """Trainer, peers and the wires between them, for :func:`run_scenario`."""

    def __init__(self, name: str, *, seed: int, peers: int, tasks: int) -> None:
        import random

        self.name = name
        self.rng = random.Random(seed)
        self.sim = _Sim(max_events=400_000)
        self.latency = 0.02
        self.trainer_id = Identity.from_seed(domain_hash("sim-trainer", seed.to_bytes(8, "little")))
        self.cfg = LeaseConfig(
            run=f"sim-{name}", max_staleness=1, grace_s=2.0, max_leases_per_peer=1,
            restart_grace_s=10.0,
            scheduling=SchedulingConfig(target_lease_s=20.0, default_tokens_per_task=80.0,
                                        min_timeout_s=8.0, timeout_base_s=4.0,
                                        max_lifetime_factor=3.0))
        self.store = MemoryLeaseStore()
        self.trainer: TrainerLeases | None = TrainerLeases(self.trainer_id, self.cfg,
                                                           store=self.store)
        self.epoch = 0
        self.dead_stats: list[LeaseStats] = []
        self.counted: Counter[int] = Counter()
        self.messages = 0
        self.cut: set[str] = set()
        self.trainer.publish_version(0, 0.0)
        self.n_tasks = tasks
        self.trainer.add_tasks(((f"prompt-{i}", (i % 50_000, 7)) for i in range(tasks)),
                               group_size=4, sampling=Sampling(max_tokens=32))
        self.peers: dict[str, _SimPeer] = {}
        for i in range(peers):
            ident = Identity.from_seed(domain_hash("sim-peer", seed.to_bytes(8, "little"),
                                                   i.to_bytes(4, "little")))
            speed = self.rng.uniform(20.0, 80.0)
            peer = _SimPeer(self, ident, speed)
            self.peers[peer.id] = peer
        self.sniffers: list[Any] = []
        self.version = 0
        self.step_s = 15.0
        self.crash_at: float | None = None
        """Crash the trainer right after the first result it commits from this time on."""

    # the wire --------------------------------------------------------------------------

    def send(self, src: str, dst: str, data: bytes) -> None:
        self.messages += 1
        if src in self.cut or dst in self.cut:
            return
        epoch = self.epoch
        if dst == _TRAINER:
            for sniff in self.sniffers:
                sniff(src, data)
            self.sim.at(self.sim.now + self.latency, lambda: self._to_trainer(src, data))
        else:
            self.sim.at(self.sim.now + self.latency,
                        lambda: self._to_peer(src, dst, data, epoch))

    def _to_trainer(self, src: str, data: bytes) -> None:
        if self.trainer is None or src in self.cut:
            return
        before = self.trainer.stats.results_accepted
        replies = self.trainer.handle(data, self.sim.now, sender=src)
        if (self.crash_at is not None and self.sim.now >= self.crash_at
                and self.trainer.stats.results_accepted > before):
            # Committed, but the process dies before its verdict leaves.
            self.crash_at = None
            self.crash_trainer()
            self.sim.at(self.sim.now + 5.0, self.restart_trainer)
            return
        for reply in replies:
            self.send(_TRAINER, src, reply.encode())
        self._collect()

    def _to_peer(self, src: str, dst: str, data: bytes, epoch: int) -> None:
        if (src == _TRAINER and epoch != self.epoch) or dst in self.cut:
            return
        peer = self.peers.get(dst)
        if peer is not None:
            peer.deliver(src, data)

    def _collect(self) -> None:
        if self.trainer is not None:
            for acc in self.trainer.take_accepted():
                self.counted.update(r.task_id for r in acc.results)

    # the trainer's own clock ------------------------------------------------------------

    def trainer_tick(self) -> None:
        if self.trainer is not None:
            self.trainer.tick(self.sim.now)
        self.sim.at(self.sim.now + 1.0, self.trainer_tick)

    def step(self) -> None:
        if self.trainer is not None:
            self.version += 1
            self.trainer.publish_version(self.version, self.sim.now)
            for peer in self.peers.values():
                peer.new_version(self.version)
        self.sim.at(self.sim.now + self.step_s, self.step)

    def crash_trainer(self) -> None:
        """Kill the trainer object; only what it committed to the store survives."""
        if self.trainer is not None:
            self._collect()
            self.dead_stats.append(self.trainer.stats)
            self.trainer = None
            self.epoch += 1

    def restart_trainer(self) -> None:
        self.trainer = TrainerLeases.restore(self.trainer_id, self.cfg, self.store,
                                             self.sim.now)
        self.version = self.trainer.latest_version

    def done(self) -> bool:
        return self.trainer is not None and self.trainer.outstanding == 0

    def report(self, affected: int, peer_refused: Counter[str] | None = None) -> ScenarioReport:
        self._collect()
        stats = [*self.dead_stats, *([self.trainer.stats] if self.trainer else [])]
        refused: Counter[str] = Counter()
        for s in stats:
            refused.update(s.refused)
        if peer_refused is None:
            peer_refused = Counter()
            for p in self.peers.values():
                if not p.malicious:
                    peer_refused.update(p.leases.refused)
        banned = sum(1 for pid in self.peers
                     if self.trainer is not None and self.trainer.scores.banned(pid))
        return ScenarioReport(
            name=self.name, seed=0, peers=len(self.peers), tasks=self.n_tasks,
            finished=self.done(),
            tasks_issued=sum(s.tasks_issued for s in stats),
            tasks_reissued=sum(s.tasks_reissued for s in stats),
            tasks_backup=sum(s.tasks_backup for s in stats),
            tasks_completed=len(self.store.accepted),
            lost=self.n_tasks - len(set(self.counted) | set(self.store.accepted)),
            double_counted=sum(c - 1 for c in self.counted.values() if c > 1),
            leases_issued=sum(s.leases_issued for s in stats),
            leases_expired=sum(s.leases_expired for s in stats),
            refused=dict(refused), peer_refused=dict(peer_refused), banned=banned,
            affected_peers=affected, virtual_s=self.sim.now, messages=self.messages)


class _SimPeer:
    """An honest rollout peer driven by virtual time."""

    def __init__(self, world: _World, ident: Identity, speed: float) -> None:
        self.world = world
        self.ident = ident
        self.id = ident.peer_id
        self.speed = speed
        self.claimed_speed = speed
        self.leases = PeerLeases(ident, world.trainer_id.public_key, world.cfg.run)
        self.version = 0
        self.downloading: int | None = None
        self.alive = True
        self.malicious = False
        self.waiting_claim = False
        self.working: bytes | None = None
        self.unacked: dict[bytes, bytes] = {}
        self.rows: dict[bytes, tuple[int, list[TaskResult]]] = {}
        self.rng = world.rng
        self.submit_late = False
        """Attacker: sit on each lease past its expiry plus grace, then submit anyway."""

    @property
    def now(self) -> float:
        return self.world.sim.now

    def start(self, at: float) -> None:
        self.world.sim.at(at, self.claim)

    def new_version(self, version: int) -> None:
        self.downloading = version
        delay = self.rng.uniform(1.0, 5.0)

        def installed() -> None:
            if self.downloading is not None and self.downloading <= version:
                self.downloading = None
            self.version = max(self.version, version)
        self.world.sim.at(self.now + delay, installed)

    def claim(self) -> None:
        if not self.alive or self.working is not None or self.world.done():
            return
        msg = self.leases.claim(self.now, tokens_per_s=self.claimed_speed, version=self.version,
                                want=64, downloading=self.downloading)
        self.waiting_claim = True
        self.world.send(self.id, _TRAINER, msg.encode())
        sent = self.now

        def retry() -> None:
            if self.waiting_claim and self.working is None and self.now - sent >= 4.0:
                self.claim()
        self.world.sim.at(self.now + 4.0, retry)

    def deliver(self, src: str, data: bytes) -> None:
        if not self.alive:
            return
        try:
            msg: Message | None = decode_message(data)
        except (DecodeError, SignatureError):
            msg = None
        reason = self.leases.receive(data, self.now, sender=src)
        if isinstance(msg, Lease) and reason is Reason.ACCEPTED:
            self.waiting_claim = False
            self._work(msg)
        elif isinstance(msg, Verdict) and msg.signer == self.world.trainer_id.public_key:
            if msg.subject == "claim":
                self.waiting_claim = False
                if reason is not Reason.BANNED:
                    self.world.sim.at(self.now + 2.0, self.claim)
            elif msg.subject == "result" and self.unacked.pop(msg.lease_id, None) is not None:
                held = self.leases.held.get(msg.lease_id)
                version, rows = self.rows.pop(msg.lease_id, (0, []))
                rest = [r for r in rows if held is not None and r.task_id not in held.counted]
                if rest:  # some tasks were superseded by a backup: submit the others
                    self._finish(msg.lease_id, version, rest)
                    return
                if self.working == msg.lease_id:
                    self.working = None
                self.world.sim.at(self.now + 0.01, self.claim)

    def _work(self, lease: Lease) -> None:
        self.working = lease.lease_id
        if self.submit_late:
            self._work_late(lease)
            return
        version = self.version
        results = []
        tokens = 0
        for task in lease.tasks:
            comps = []
            for _ in range(task.group_size):
                n = self.rng.randint(4, task.sampling.max_tokens)
                comps.append(Completion(tuple(range(n)), tuple(-0.5 for _ in range(n))))
                tokens += n
            results.append(TaskResult(task.task_id, tuple(comps)))
        self.world.sim.at(self.now + tokens / self.speed,
                          lambda: self._finish(lease.lease_id, version, results))
        self._heartbeat_loop(lease.lease_id)

    def _work_late(self, lease: Lease) -> None:
        rows = tuple(TaskResult(t.task_id, tuple(Completion((1,), (-1.0,))
                                                 for _ in range(t.group_size)))
                     for t in lease.tasks)
        signed = Result(self.world.cfg.run, lease.lease_id, self.version, rows,
                        ms(self.now)).sign(self.ident).encode()
        wait = (lease.expires_ms - lease.issued_ms + lease.grace_ms) / 1000 + 3.0

        def submit() -> None:
            self.unacked[lease.lease_id] = signed
            self.leases.held.pop(lease.lease_id, None)
            self.world.send(self.id, _TRAINER, signed)
        self.world.sim.at(self.now + wait, submit)

    def _heartbeat_loop(self, lease_id: bytes) -> None:
        if not self.alive or lease_id not in self.leases.held:
            return
        self.leases.tick(self.now)
        for hb in self.leases.heartbeats(self.now):
            self.world.send(self.id, _TRAINER, hb.encode())
        if lease_id in self.leases.held:
            self.world.sim.at(self.now + 1.0, lambda: self._heartbeat_loop(lease_id))
        elif self.working == lease_id and lease_id not in self.unacked:
            self.working = None
            self.world.sim.at(self.now + 0.5, self.claim)

    def _finish(self, lease_id: bytes, version: int, results: list[TaskResult]) -> None:
        if not self.alive:
            return
        self.leases.tick(self.now)
        if lease_id not in self.leases.held:
            if self.working == lease_id:
                self.working = None
                self.claim()
            return
        data = self.leases.result(lease_id, version, results, self.now).encode()
        self.unacked[lease_id] = data
        self.rows[lease_id] = (version, results)
        self._send_result(lease_id, data, attempts=12)

    def _send_result(self, lease_id: bytes, data: bytes, attempts: int) -> None:
        if not self.alive or lease_id not in self.unacked:
            return
        if attempts <= 0:
            self.unacked.pop(lease_id, None)
            if self.working == lease_id:
                self.working = None
                self.claim()
            return
        self.world.send(self.id, _TRAINER, data)
        self.world.sim.at(self.now + 4.0,
                          lambda: self._send_result(lease_id, data, attempts - 1))


def run_scenario(name: str, *, seed: int = 0, peers: int = 20, tasks: int = 600,
                 fraction: float = 0.3, max_virtual_s: float = 3600.0) -> ScenarioReport:
    """Run one fault scenario in virtual time and return its figures.

    ``name`` is one of :data:`SCENARIOS`:

    - ``baseline``: nothing goes wrong.
    - ``kill``: ``fraction`` of the peers, each holding a lease, die 5 s into the run.
    - ``forgery``: two attackers send honest peers forged leases, replay and re-sign
      honest peers' results, and submit results for leases they let expire.
    - ``partition``: a region of ``fraction`` of the peers is cut off for 60 s; its
      leases expire and are re-issued; its late results arrive after healing.
    - ``restart``: the trainer crashes right after committing a result (its reply is
      lost) and restarts 5 s later from its store.
    - ``stragglers``: ``fraction`` of the peers claim 10x the speed they deliver.

    Bounded: at most ``max_virtual_s`` of virtual time and 400,000 events.
    """
    if name not in SCENARIOS:
        raise LocalProtocolError(f"unknown scenario {name!r}; one of {SCENARIOS}")
    world = _World(name, seed=seed, peers=peers, tasks=tasks)
    ids = list(world.peers)
    n_affected = max(1, round(fraction * peers))
    affected = set(world.rng.sample(ids, n_affected))
    for i, pid in enumerate(ids):
        world.peers[pid].start(0.05 * i)
    world.sim.at(1.0, world.trainer_tick)
    world.sim.at(world.step_s, world.step)
    extra_refused: Counter[str] | None = None
    if name == "kill":
        def kill() -> None:
            holding = [p for p in ids if world.peers[p].working is not None]
            for pid in world.rng.sample(holding, min(n_affected, len(holding))):
                world.peers[pid].alive = False
        world.sim.at(5.0, kill)
    elif name == "partition":
        def cut() -> None:
            world.cut |= affected

        def heal() -> None:
            world.cut -= affected
        world.sim.at(3.0, cut)
        world.sim.at(63.0, heal)
    elif name == "stragglers":
        for pid in affected:
            world.peers[pid].speed /= 10
    elif name == "restart":
        world.crash_at = 12.0
    elif name == "forgery":
        affected = _add_attackers(world)
        n_affected = len(affected)
    world.sim.run(max_virtual_s, world.done)
    if name == "forgery":
        extra_refused = Counter()
        for p in world.peers.values():
            if not p.malicious:
                extra_refused.update(p.leases.refused)
    report = world.report(0 if name in ("baseline", "restart") else n_affected, extra_refused)
    return replace(report, seed=seed)


def _add_attackers(world: _World) -> set[str]:
    """Two attackers: a forger/replayer and a peer that submits for expired leases."""
    seed = world.rng.getrandbits(64).to_bytes(8, "little")
    forger = _SimPeer(world, Identity.from_seed(domain_hash("mallory", seed)), 50.0)
    late = _SimPeer(world, Identity.from_seed(domain_hash("late", seed)), 50.0)
    for bad in (forger, late):
        bad.malicious = True
        world.peers[bad.id] = bad
    honest = [p for p in world.peers.values() if not p.malicious]
    trainer_key = world.trainer_id.public_key
    dummy = RolloutTask(0, "forged")
    budget = {"forged": 40, "replayed": 40}

    def forge() -> None:
        if budget["forged"] <= 0 or world.done():
            return
        budget["forged"] -= 1
        victim = world.rng.choice(honest)
        now = world.sim.now
        lease = Lease(world.rng.randbytes(LEASE_ID_LEN), world.cfg.run, victim.ident.public_key,
                      (dummy,), 0, 0, 1, ms(now), ms(now + 60), 0)
        if budget["forged"] % 2:
            data = lease.sign(forger.ident).encode()
        else:
            impostor = replace(lease, signer=trainer_key)
            data = replace(impostor, signature=forger.ident.sign(
                lease_domain("lease") + impostor.body())).encode()
        world.send(forger.id, victim.id, data)
        world.sim.at(now + 1.0, forge)

    def sniff(src: str, data: bytes) -> None:
        if src == forger.id or budget["replayed"] <= 0:
            return
        try:
            msg = decode_message(data)
        except (DecodeError, SignatureError):
            return
        if not isinstance(msg, Result):
            return
        budget["replayed"] -= 1
        if budget["replayed"] % 2:
            world.send(forger.id, _TRAINER, data)
        else:
            world.send(forger.id, _TRAINER, msg.sign(forger.ident).encode())

    world.sniffers.append(sniff)
    world.sim.at(2.0, forge)

    late.submit_late = True
    late.start(0.5)
    return {forger.id, late.id}


def run_all_scenarios(seed: int = 1, **kwargs: Any) -> list[ScenarioReport]:
    """Every scenario of :data:`SCENARIOS` with one seed (the figures the README quotes)."""
    return [run_scenario(name, seed=seed, **kwargs) for name in SCENARIOS]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m swarm.sim.lease_faults [seed ...]``: print every scenario's figures."""
    seeds = [int(a) for a in (sys.argv[1:] if argv is None else argv)] or [1]
    logging.getLogger("swarm.protocol.leases").setLevel(logging.ERROR)
    ok = True
    for seed in seeds:
        for report in run_all_scenarios(seed):
            print(report.summary())
            ok &= report.finished and report.lost == 0 and report.double_counted == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
