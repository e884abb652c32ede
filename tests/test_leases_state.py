"""SQLite (WAL) trainer state: same snapshot as the in-memory store, atomic, hostile-file safe."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest

from swarm.errors import DecodeError, LocalProtocolError, RemoteProtocolError, StoreError
from swarm.identity import Identity
from swarm.protocol.leases import (
    AcceptResult,
    Completion,
    Lease,
    LeaseConfig,
    LeaseState,
    MemoryLeaseStore,
    PeerLeases,
    Reason,
    Result,
    Sampling,
    StateOp,
    TaskResult,
    TrainerLeases,
    TrainerSnapshot,
    Verdict,
)
from swarm.protocol.scheduling import SchedulingConfig
from swarm.roles.trainer_state import DB_NAME, TrainerState

pytestmark = pytest.mark.timeout(60)

TRAINER = Identity.from_seed(b"T" * 32)
PEERS = [Identity.from_seed(bytes([65 + i]) * 32) for i in range(4)]
RUN = "run-db"
CFG = LeaseConfig(run=RUN, max_staleness=1, grace_s=1.0, scheduling=SchedulingConfig(
    target_lease_s=5.0, default_tokens_per_task=20.0, min_timeout_s=3.0, timeout_base_s=1.0))


class Tee:
    """Commits to both stores, so their snapshots can be compared."""

    def __init__(self, a: MemoryLeaseStore, b: TrainerState) -> None:
        self.a, self.b = a, b

    def commit(self, ops: Sequence[StateOp]) -> None:
        self.a.commit(ops)
        self.b.commit(ops)

    def load(self) -> TrainerSnapshot:
        return self.b.load()


def results_for(lease: Lease) -> list[TaskResult]:
    return [TaskResult(t.task_id, tuple(Completion((1, 2, 3), (-0.1, -0.2, -0.3))
                                        for _ in range(t.group_size))) for t in lease.tasks]


def drive(trainer: TrainerLeases) -> dict[str, int]:
    """A busy little run: claims, partial results, a silent peer, a version step, garbage."""
    peers = [PeerLeases(p, TRAINER.public_key, RUN) for p in PEERS]
    seen: dict[str, int] = {}
    now = 1.0
    for rnd in range(6):
        for ident, peer in zip(PEERS, peers, strict=True):
            claim = peer.claim(now, tokens_per_s=8.0 + rnd, version=trainer.latest_version,
                               want=5)
            for reply in trainer.handle(claim.encode(), now, sender=ident.peer_id):
                seen[type(reply).__name__] = seen.get(type(reply).__name__, 0) + 1
                peer.receive(reply.encode(), now)
        now += 1.0
        for ident, peer in zip(PEERS[:-1], peers[:-1], strict=True):  # the last one is silent
            for lid, held in list(peer.held.items()):
                rows = results_for(held.lease)
                res = peer.result(lid, trainer.latest_version, rows, now)
                for reply in trainer.handle(res.encode(), now, sender=ident.peer_id):
                    assert isinstance(reply, Verdict)
                    seen[reply.reason.value] = seen.get(reply.reason.value, 0) + 1
                    peer.receive(reply, now)
        trainer.handle(b"garbage", now, sender=PEERS[0].peer_id)
        now += 5.0
        trainer.tick(now)
        if rnd == 2:
            trainer.publish_version(1, now)
    return seen


def test_sqlite_snapshot_matches_memory_store(tmp_path: Path) -> None:
    mem = MemoryLeaseStore()
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=Tee(mem, db))
        trainer.publish_version(0, 0.0)
        trainer.add_tasks([(f"q{i}", [i]) for i in range(40)], group_size=2,
                          sampling=Sampling(max_tokens=4))
        seen = drive(trainer)
        assert seen.get("accepted", 0) > 0 and trainer.stats.leases_expired > 0
        assert db.load() == mem.load()
        assert db.journal_mode() == "wal"
        assert db.integrity_check() == "ok"
        assert db.accepted_count() == len(trainer.done)
        assert db.accepted_task_ids() == sorted(trainer.done)
        stored = list(db.accepted_results())
        assert sum(len(r.results) for r in stored) == len(trainer.done)
        assert all(r.is_valid() for r in stored)


def test_restart_from_sqlite_resumes_exactly(tmp_path: Path) -> None:
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=db)
        trainer.publish_version(0, 0.0)
        trainer.add_tasks([(f"q{i}", [i]) for i in range(12)], group_size=1)
        pa = PeerLeases(PEERS[0], TRAINER.public_key, RUN)
        pb = PeerLeases(PEERS[1], TRAINER.public_key, RUN)
        for ident, peer in ((PEERS[0], pa), (PEERS[1], pb)):
            [lease] = trainer.handle(peer.claim(1.0, tokens_per_s=8.0, version=0,
                                                want=3).encode(), 1.0, sender=ident.peer_id)
            assert peer.receive(lease, 1.0) is Reason.ACCEPTED
        [la] = pa.held.values()
        [lb] = pb.held.values()
        ra = pa.result(la.lease.lease_id, 0, results_for(la.lease), 2.0)
        trainer.handle(ra.encode(), 2.0, sender=PEERS[0].peer_id)
        before = (trainer.done, trainer.queued, trainer.stats.tasks_issued)
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        again = TrainerLeases.restore(TRAINER, CFG, db, now=100.0)
        assert again.done == before[0] and again.queued == before[1]
        assert [lease.lease_id for lease in again.live_leases()] == [lb.lease.lease_id]
        [dup] = again.handle(ra.encode(), 100.0, sender=PEERS[0].peer_id)
        assert isinstance(dup, Verdict) and dup.reason is Reason.DUPLICATE
        rb = pb.result(lb.lease.lease_id, 0, results_for(lb.lease), 101.0)
        [ok] = again.handle(rb.encode(), 101.0, sender=PEERS[1].peer_id)
        assert isinstance(ok, Verdict) and ok.reason is Reason.ACCEPTED
        assert again.lease_state(la.lease.lease_id) is LeaseState.COMPLETED
        assert db.accepted_count() == len(la.lease.tasks) + len(lb.lease.tasks) == 4


def test_a_task_a_check_refused_is_leased_again_with_a_new_seed_across_a_restart(
        tmp_path: Path) -> None:
    """Re-leased with its old seed, every honest peer would draw the refused completions
    again: one false positive of a check would starve the step for good."""
    mem = MemoryLeaseStore()
    peer = PeerLeases(PEERS[0], TRAINER.public_key, RUN)

    def lease_of(book: TrainerLeases, now: float) -> Lease:
        [lease] = book.handle(peer.claim(now, tokens_per_s=8.0, version=0, want=2).encode(),
                              now, sender=PEERS[0].peer_id)
        assert isinstance(lease, Lease) and peer.receive(lease, now) is Reason.ACCEPTED
        return lease

    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=Tee(mem, db))
        trainer.publish_version(0, 0.0)
        trainer.add_tasks([("q0", [1]), ("q1", [2])], sampling=Sampling(seed=7))
        first = lease_of(trainer, 1.0)
        assert [t.sampling.seed for t in first.tasks] == [7, 7]
        res = peer.result(first.lease_id, 0, results_for(first), 2.0)
        trainer.reject(res, 2.0, "tokens implausibly unlikely")
        seeds = {t.task_id: trainer.task(t.task_id).sampling.seed  # type: ignore[union-attr]
                 for t in first.tasks}
        assert 7 not in seeds.values() and len(set(seeds.values())) == 2
        assert db.load() == mem.load()
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        again = TrainerLeases.restore(TRAINER, CFG, db, now=100.0)
        second = lease_of(again, 100.0)
        assert {t.task_id: t.sampling.seed for t in second.tasks} == seeds
        assert [t.sampling.max_tokens for t in second.tasks] == [256, 256]  # only the seed


def test_database_refuses_to_count_a_task_twice(tmp_path: Path) -> None:
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=db)
        trainer.add_tasks([("q", [1])])
        peer = PeerLeases(PEERS[0], TRAINER.public_key, RUN)
        [lease] = trainer.handle(peer.claim(1.0, tokens_per_s=8.0, version=0, want=1).encode(),
                                 1.0, sender=PEERS[0].peer_id)
        assert isinstance(lease, Lease)
        peer.receive(lease, 1.0)
        res = peer.result(lease.lease_id, 0, results_for(lease), 2.0)
        trainer.handle(res.encode(), 2.0, sender=PEERS[0].peer_id)
        other = Result(RUN, lease.lease_id, 0, res.results, 3000).sign(PEERS[0])
        with pytest.raises(LocalProtocolError):
            db.commit([AcceptResult(other, 3.0)])
        assert db.accepted_count() == 1
        assert len(list(db.accepted_results())) == 1


def test_wrong_run_wrong_key_and_garbage_files(tmp_path: Path) -> None:
    TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key).close()
    with pytest.raises(StoreError, match="run"):
        TrainerState(tmp_path, run="other", trainer_key=TRAINER.public_key)
    with pytest.raises(StoreError, match="trainer key"):
        TrainerState(tmp_path, run=RUN, trainer_key=PEERS[0].public_key)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / DB_NAME).write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError):
        TrainerState(junk, run=RUN, trainer_key=TRAINER.public_key)


def test_tampered_rows_are_refused_on_load(tmp_path: Path) -> None:
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=db)
        trainer.add_tasks([(f"q{i}", [i]) for i in range(4)])
        peer = PeerLeases(PEERS[0], TRAINER.public_key, RUN)
        trainer.handle(peer.claim(1.0, tokens_per_s=8.0, version=0, want=1).encode(), 1.0,
                       sender=PEERS[0].peer_id)
    raw = sqlite3.connect(tmp_path / DB_NAME)
    with raw:
        (signed,) = raw.execute("SELECT signed FROM leases").fetchone()
        raw.execute("UPDATE leases SET signed = ?", (signed[:-1] + bytes([signed[-1] ^ 1]),))
    raw.close()
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db, \
            pytest.raises(RemoteProtocolError):
        db.load()
    raw = sqlite3.connect(tmp_path / DB_NAME)
    with raw:
        raw.execute("UPDATE leases SET signed = ?", (signed,))
        raw.execute("UPDATE tasks SET body = ? WHERE state = 'queued'", (b"\x81\xa1x\x01",))
    raw.close()
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db, \
            pytest.raises(DecodeError):
        db.load()


def test_backup_leases_persist_and_resolve(tmp_path: Path) -> None:
    mem = MemoryLeaseStore()
    with TrainerState(tmp_path, run=RUN, trainer_key=TRAINER.public_key) as db:
        trainer = TrainerLeases(TRAINER, CFG, store=Tee(mem, db))
        trainer.publish_version(0, 0.0)
        trainer.add_tasks([(f"q{i}", [i]) for i in range(4)])
        pa = PeerLeases(PEERS[0], TRAINER.public_key, RUN)
        pb = PeerLeases(PEERS[1], TRAINER.public_key, RUN)
        leases = []
        for now, ident, peer in ((0.0, PEERS[0], pa), (20.0, PEERS[1], pb)):
            [lease] = trainer.handle(peer.claim(now, tokens_per_s=16.0, version=0,
                                                want=4).encode(), now, sender=ident.peer_id)
            assert isinstance(lease, Lease) and peer.receive(lease, now) is Reason.ACCEPTED
            leases.append(lease)
        la, lb = leases
        assert lb.task_ids == la.task_ids and trainer.stats.tasks_backup == 4
        rows = results_for(la)
        res = pb.result(lb.lease_id, 0, rows[:1], 21.0)
        trainer.handle(res.encode(), 21.0, sender=PEERS[1].peer_id)
        assert db.load() == mem.load()
        again = TrainerLeases.restore(TRAINER, CFG, Tee(mem, db), now=22.0)
        [v] = again.handle(pa.result(la.lease_id, 0, rows, 23.0).encode(), 23.0,
                           sender=PEERS[0].peer_id)
        assert isinstance(v, Verdict) and v.reason is Reason.SUPERSEDED
        [v] = again.handle(pa.result(la.lease_id, 0, rows[1:], 24.0).encode(), 24.0,
                           sender=PEERS[0].peer_id)
        assert isinstance(v, Verdict) and v.reason is Reason.ACCEPTED
        assert again.lease_state(lb.lease_id) is LeaseState.SUPERSEDED
        assert again.outstanding == 0
        assert db.load() == mem.load()
        assert db.accepted_task_ids() == sorted(la.task_ids)
