"""The trainer's durable lease state: SQLite in WAL mode in the trainer's data directory.

:class:`TrainerState` is the :class:`swarm.protocol.leases.LeaseStore` a real trainer uses.
Each :meth:`~TrainerState.commit` is one SQLite transaction, so a trainer killed at any
instant (even ``SIGKILL`` mid-write) restarts with either all or none of a message's
effects. ``results.task_id`` is a primary key: the database itself refuses to count a task
twice. Signed leases and results are stored as their wire bytes and decoded strictly (and
their signatures checked) on load, so a tampered file is a :class:`DecodeError` or
:class:`SignatureError`, never a crash.

Tables: ``meta`` (schema, run, trainer key, latest version), ``tasks`` (queued, leased or
done, with how often each was issued), ``leases`` (the signed lease, current expiry and
state), ``results`` (one row per counted task) and ``result_blobs`` (each signed result
once), ``scores`` (peer scores).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from swarm.errors import DecodeError, LocalProtocolError, SignatureError, StoreError
from swarm.protocol.leases import (
    AcceptResult,
    ActiveLease,
    AddTasks,
    CloseLease,
    IssueLease,
    Lease,
    LeaseState,
    PublishVersion,
    RenewLease,
    Result,
    RolloutTask,
    ScorePeer,
    StateOp,
    TrainerSnapshot,
    decode_message,
)
from swarm.wire import strict

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DB_NAME = "leases.sqlite3"
_MAX_TASK_BYTES = 1 << 20
_STATES = frozenset(s.value for s in LeaseState)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tasks (
    task_id INTEGER PRIMARY KEY,
    body BLOB NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done')),
    issues INTEGER NOT NULL DEFAULT 0,
    lease_id BLOB
);
CREATE INDEX IF NOT EXISTS tasks_state ON tasks (state, task_id);
CREATE TABLE IF NOT EXISTS leases (
    lease_id BLOB PRIMARY KEY,
    seq INTEGER NOT NULL UNIQUE,
    holder TEXT NOT NULL,
    signed BLOB NOT NULL,
    expires REAL NOT NULL,
    timeout REAL NOT NULL,
    deadline REAL NOT NULL,
    state TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state);
CREATE TABLE IF NOT EXISTS result_blobs (digest BLOB PRIMARY KEY, signed BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    task_id INTEGER PRIMARY KEY,
    lease_id BLOB NOT NULL,
    holder TEXT NOT NULL,
    version INTEGER NOT NULL,
    digest BLOB NOT NULL,
    accepted_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_lease ON results (lease_id);
CREATE TABLE IF NOT EXISTS scores (peer TEXT PRIMARY KEY, score REAL NOT NULL);
"""


class TrainerState:
    """SQLite (WAL) store of one trainer's queue, leases, counted results and version.

    Use as a context manager, or call :meth:`close`. ``synchronous`` is SQLite's pragma:
    ``FULL`` (default) survives power loss; ``NORMAL`` still survives a killed process.

    :raises StoreError: the file is not a database, or belongs to another run or trainer.
    """

    def __init__(self, data_dir: str | Path, *, run: str, trainer_key: bytes,
                 synchronous: str = "FULL") -> None:
        if synchronous not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError("synchronous is FULL, NORMAL or EXTRA")
        self.path = Path(data_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._run = run
        self._trainer_key = trainer_key
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=True)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            self._check_meta()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not a usable trainer state database: {exc}") from exc

    def _check_meta(self) -> None:
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not meta:
            with self._tx():
                self._db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [
                    ("schema", SCHEMA_VERSION), ("run", self._run),
                    ("trainer", self._trainer_key), ("latest", 0)])
            return
        if meta.get("schema") != SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema {meta.get('schema')!r}, "
                             f"expected {SCHEMA_VERSION}")
        if meta.get("run") != self._run:
            raise StoreError(f"{self.path} belongs to run {meta.get('run')!r}, not {self._run!r}")
        if meta.get("trainer") != self._trainer_key:
            raise StoreError(f"{self.path} belongs to another trainer key")

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)

    # ------------------------------------------------------------------ LeaseStore

    def commit(self, ops: Sequence[StateOp]) -> None:
        """Apply ``ops`` in one transaction.

        :raises LocalProtocolError: an op would count a task twice (nothing is applied).
        :raises StoreError: SQLite failed (disk full, I/O error).
        """
        try:
            with self._tx():
                for op in ops:
                    self._apply(op)
        except sqlite3.IntegrityError as exc:
            raise LocalProtocolError(f"state change refused by the database: {exc}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc

    def _apply(self, op: StateOp) -> None:
        db = self._db
        if isinstance(op, AddTasks):
            db.executemany("INSERT INTO tasks (task_id, body, state) VALUES (?, ?, 'queued')",
                           [(t.task_id, strict.pack(t.to_wire())) for t in op.tasks])
        elif isinstance(op, IssueLease):
            lease = op.lease
            (seq,) = db.execute("SELECT COUNT(*) FROM leases").fetchone()
            db.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, 'active')",
                       (lease.lease_id, seq, lease.holder_peer_id, lease.encode(), op.expires,
                        op.timeout_s, op.deadline))
            if op.backup:  # the tasks stay with their first lease too
                cur = db.executemany(
                    "UPDATE tasks SET issues = issues + 1 WHERE task_id = ? AND state = 'leased'",
                    [(t,) for t in lease.task_ids])
            else:
                cur = db.executemany(
                    "UPDATE tasks SET state = 'leased', lease_id = ?, issues = issues + 1 "
                    "WHERE task_id = ? AND state = 'queued'",
                    [(lease.lease_id, t) for t in lease.task_ids])
            if cur.rowcount != len(lease.task_ids):
                raise sqlite3.IntegrityError("lease names tasks that are not available")
        elif isinstance(op, RenewLease):
            db.execute("UPDATE leases SET expires = ? WHERE lease_id = ?",
                       (op.expires, op.lease_id))
        elif isinstance(op, AcceptResult):
            res = op.result
            digest, holder = res.digest, res.signer_peer_id
            db.execute("INSERT OR IGNORE INTO result_blobs VALUES (?, ?)",
                       (digest, res.encode()))
            db.executemany("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?)", [
                (t, res.lease_id, holder, res.version, digest, op.time)
                for t in res.task_ids])
            db.executemany("UPDATE tasks SET state = 'done' WHERE task_id = ?",
                           [(t,) for t in res.task_ids])
        elif isinstance(op, CloseLease):
            db.execute("UPDATE leases SET state = ? WHERE lease_id = ?",
                       (op.state.value, op.lease_id))
            db.executemany(
                "UPDATE tasks SET state = 'queued', lease_id = NULL "
                "WHERE task_id = ? AND state = 'leased'", [(t,) for t in op.requeued])
            db.executemany("UPDATE tasks SET body = ? WHERE task_id = ? AND state = 'queued'",
                           [(strict.pack(t.to_wire()), t.task_id) for t in op.reseeded])
        elif isinstance(op, PublishVersion):
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [
                ("latest", op.version), ("last_publish", op.time),
                ("step_interval", op.step_interval_s)])
        elif isinstance(op, ScorePeer):
            db.execute("INSERT OR REPLACE INTO scores VALUES (?, ?)", (op.peer, op.score))
        else:
            raise LocalProtocolError(f"unknown state change {op!r:.80}")

    def load(self) -> TrainerSnapshot:
        """Read the committed state back.

        :raises DecodeError: a stored task, lease or value is malformed.
        :raises SignatureError: a stored lease is not validly signed by this trainer.
        """
        db = self._db
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        latest = meta.get("latest", 0)
        last_publish = meta.get("last_publish")
        interval = meta.get("step_interval")
        if (type(latest) is not int or latest < 0
                or not all(v is None or isinstance(v, float | int)
                           for v in (last_publish, interval))):
            raise DecodeError(f"{self.path}: malformed version metadata")
        queued = tuple(
            (_decode_task(body), issues) for body, issues in db.execute(
                "SELECT body, issues FROM tasks WHERE state = 'queued' ORDER BY task_id"))
        active = []
        closed: dict[bytes, LeaseState] = {}
        for lease_id, signed, expires, timeout, deadline, state in db.execute(
                "SELECT lease_id, signed, expires, timeout, deadline, state FROM leases"):
            if state not in _STATES:
                raise DecodeError(f"{self.path}: lease state {state!r}")
            if state != LeaseState.ACTIVE.value:
                closed[bytes(lease_id)] = LeaseState(state)
                continue
            lease = self._decode_lease(signed)
            accepted = frozenset(t for (t,) in db.execute(
                "SELECT task_id FROM results WHERE lease_id = ?", (lease_id,)))
            active.append(ActiveLease(lease, float(expires), float(timeout), float(deadline),
                                      accepted))
        done = frozenset(t for (t,) in db.execute("SELECT task_id FROM results"))
        (next_task,) = db.execute("SELECT COALESCE(MAX(task_id), -1) + 1 FROM tasks").fetchone()
        (lease_seq,) = db.execute("SELECT COUNT(*) FROM leases").fetchone()
        scores = {str(p): float(s) for p, s in db.execute("SELECT peer, score FROM scores")}
        return TrainerSnapshot(
            latest_version=latest,
            last_publish=None if last_publish is None else float(last_publish),
            step_interval_s=None if interval is None else float(interval),
            queued=queued, active=tuple(active), closed=closed, done=done,
            next_task_id=int(next_task), lease_seq=int(lease_seq), scores=scores)

    def _decode_lease(self, signed: object) -> Lease:
        if type(signed) is not bytes:
            raise DecodeError(f"{self.path}: a stored lease is not a blob")
        lease = decode_message(signed)
        if not isinstance(lease, Lease):
            raise DecodeError(f"{self.path}: a stored lease decodes as a {lease.TAG}")
        if lease.signer != self._trainer_key:
            raise SignatureError(f"{self.path}: a stored lease is signed by another key")
        return lease

    # ------------------------------------------------------------------ queries

    def accepted_count(self) -> int:
        (n,) = self._db.execute("SELECT COUNT(*) FROM results").fetchone()
        return int(n)

    def accepted_task_ids(self) -> list[int]:
        return [t for (t,) in self._db.execute("SELECT task_id FROM results ORDER BY task_id")]

    def accepted_results(self) -> Iterator[Result]:
        """Every counted signed result, in the order they were counted (signatures checked).

        :raises DecodeError: a stored result is malformed.
        :raises SignatureError: a stored result's signature does not verify.
        """
        rows = self._db.execute(
            "SELECT b.signed FROM result_blobs b JOIN results r ON r.digest = b.digest "
            "GROUP BY b.digest ORDER BY MIN(r.rowid)")
        for (signed,) in rows:
            if type(signed) is not bytes:
                raise DecodeError(f"{self.path}: a stored result is not a blob")
            msg = decode_message(signed)
            if not isinstance(msg, Result):
                raise DecodeError(f"{self.path}: a stored result decodes as a {msg.TAG}")
            yield msg

    def integrity_check(self) -> str:
        (status,) = self._db.execute("PRAGMA integrity_check").fetchone()
        return str(status)

    def journal_mode(self) -> str:
        (mode,) = self._db.execute("PRAGMA journal_mode").fetchone()
        return str(mode)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> TrainerState:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` on any exception."""

    __slots__ = ("_db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self._db.execute("COMMIT")
        else:
            self._db.execute("ROLLBACK")


def _decode_task(body: object) -> RolloutTask:
    if type(body) is not bytes:
        raise DecodeError("a stored task is not a blob")
    obj = strict.unpack(body, max_bytes=_MAX_TASK_BYTES, max_bin=_MAX_TASK_BYTES, max_map=8,
                        max_str=256)
    return RolloutTask.from_wire(obj)
