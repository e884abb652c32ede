"""The trainer as the seed of the swarm: publishes versions, grants leases, collects results.

Library use (any torch model; ``inference_state`` is the state peers run, e.g. bf16)::

    async with TrainerNode(identity, net, TrainerConfig(run="my-run", data_dir=d)) as node:
        await node.publish(inference_state)           # version 0: a keyframe
        for step in range(1, n):
            tasks = node.add_tasks(prompts, group_size=8)
            batch = await node.collect(tasks)         # accepted, signed, checked
            train(batch)
            await node.publish(inference_state)       # version step: a sparse delta

Restarts: every published version is written to ``data_dir`` before it is announced (the
state with the kept signed manifests in one atomic file, the delta chunks in a
:class:`~swarm.content.store.DiskChunkStore`), and the lease book lives there in SQLite.
A :class:`TrainerNode` opened again on the same ``data_dir`` with the same identity
resumes: ``step`` continues, catch-up requests are answered from the restored chain, and
the next :meth:`TrainerNode.publish` is a delta from the restored state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.content.manifest import SignedManifest
from swarm.content.pieces import DEFAULT_PIECE_SIZE
from swarm.content.store import DiskChunkStore
from swarm.delta.pipeline import EncoderConfig, encode_delta
from swarm.delta.sharded import ShardedVersion
from swarm.delta.state import (
    keyframe_manifest,
    layout_of,
    piece_views,
    pieces_keyframe,
    state_root_of,
)
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError, SwarmError
from swarm.identity import Identity
from swarm.net import topics
from swarm.protocol.checks import Check, CheckInput, CopyCheck, RootCheck
from swarm.protocol.exchange import Chunk, ExchangeConfig, ObjectSpec
from swarm.protocol.follow import catch_up_reply
from swarm.protocol.leases import (
    Accepted,
    LeaseConfig,
    Rejected,
    Result,
    RolloutTask,
    Sampling,
    TrainerLeases,
    decode_message,
)
from swarm.protocol.leases import Message as LeaseMessage
from swarm.roles import statelog, sync
from swarm.roles.common import Clock, Network, NodeBase
from swarm.roles.mux import Channel
from swarm.roles.trainer_state import TrainerState

log = logging.getLogger(__name__)

STATE_FILE = "published.state"
#: Results waiting for their checks; past it, the lease loop waits (each needs a live lease).
MAX_PENDING_CHECKS = 256


def _first_failure(checks: Sequence[Check], inp: CheckInput) -> str | None:
    """The first check's reason for refusing ``inp``; a check that raises refuses it."""
    for check in checks:
        try:
            failed = check(inp)
        except Exception as exc:
            name = getattr(check, "name", type(check).__name__)
            log.exception("check %s failed on a result", name)
            return f"check {name} raised {type(exc).__name__}: {exc}"
        if failed is not None:
            return failed
    return None


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """Settings of a :class:`TrainerNode`."""

    run: str
    """Run name: gossip topics and every signed message carry it."""
    data_dir: Path
    """Lease book (SQLite, WAL), the latest published state with its kept manifests, and
    the kept delta chunks live here; a restarted trainer resumes from them."""
    region: str = ""
    piece_size: int = DEFAULT_PIECE_SIZE
    """Piece size of state roots and keyframes."""
    max_staleness: int = 1
    """Results may use any version ``>= latest - max_staleness``."""
    leases: LeaseConfig | None = None
    """The lease policy (grace, leases per peer, claim window, bans, queue bound, backups,
    scheduling). None: :class:`~swarm.protocol.leases.LeaseConfig`'s defaults for this
    ``run`` and ``max_staleness``; one given must name the same ``run`` and
    ``max_staleness``. :attr:`lease_config` is the policy in force."""
    chunk_target: int = 2 << 20
    """Encoded bytes per delta chunk (1-4 MiB on real models; smaller for toy ones)."""
    keep_versions: int = 16
    """Delta objects kept for catch-up (older peers refetch the state pieces)."""
    exchange: ExchangeConfig = field(default_factory=lambda: ExchangeConfig(
        unchoke_all=True, super_seed=True, fetch=False))
    """The trainer serves and fetches nothing (of a sharded version it holds only its
    own rank's chunks)."""
    extract_on: str = "host"
    """``"host"``: diff the host copies of the versions (C kernels). ``"device"``: keep the
    previous version where the published tensors live (one more copy of the state on the
    GPU) and diff there with torch ops, so only changes cross to the host for coding. The
    host copy is still made, for roots, keyframes and the saved state."""

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError("keep_versions must be at least 1")
        if self.extract_on not in ("host", "device"):
            raise ValueError("extract_on must be 'host' or 'device'")
        if self.leases is not None and (self.leases.run != self.run
                                        or self.leases.max_staleness != self.max_staleness):
            raise ValueError(f"leases names run {self.leases.run!r} and max_staleness "
                             f"{self.leases.max_staleness}; this config {self.run!r} and "
                             f"{self.max_staleness}")

    @property
    def lease_config(self) -> LeaseConfig:
        """The lease policy the trainer runs: ``leases``, or the defaults for this run."""
        if self.leases is not None:
            return self.leases
        return LeaseConfig(run=self.run, max_staleness=self.max_staleness)


@dataclass(frozen=True, slots=True)
class Published:
    """What one :meth:`TrainerNode.publish` did."""

    step: int
    manifest: SignedManifest
    payload_bytes: int
    dense_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(1, self.payload_bytes)


class TrainerNode(NodeBase):
    """Seeds versions and runs the lease book. An async context manager owning its tasks."""

    def __init__(self, identity: Identity, net: Network, config: TrainerConfig,
                 clock: Clock | None = None, *, checks: Sequence[Check] = ()) -> None:
        super().__init__(net, region=config.region, exchange_config=config.exchange,
                         clock=clock, name="trainer")
        self.identity = identity
        self.config = config
        self.state_db = TrainerState(config.data_dir, run=config.run,
                                     trainer_key=identity.public_key)
        book = self.state_db.load()
        #: Whether the lease book saw a version published (by an earlier run of this node).
        self._book_published = book.last_publish is not None
        self.leases = TrainerLeases(
            identity, config.lease_config, store=self.state_db, snapshot=book,
            now=self.clock.wall())
        self.manifests: deque[SignedManifest] = deque(maxlen=config.keep_versions + 1)
        self._state: dict[str, torch.Tensor] | None = None
        #: The last published version on its own device (``extract_on="device"``).
        self._device_state: dict[str, torch.Tensor] | None = None
        self._root: bytes | None = None
        self._keyframe: SignedManifest | None = None
        #: A sharded trainer's newest version as pieces (id, size): no state is held here.
        self._pieces: tuple[tuple[bytes, int], ...] = ()
        self._accepted: asyncio.Queue[Accepted] = asyncio.Queue()
        #: Accepted results a collect() for other tasks passed over, oldest first.
        self._stray: deque[Accepted] = deque(maxlen=4096)
        #: Checks every result passes before it counts (:mod:`swarm.protocol.checks`), the
        #: cheap ones first: the weight root, copies, then the caller's (e.g. log-probs).
        self.checks: list[Check] = [RootCheck(), CopyCheck(), *checks]
        #: Results the checks refused, newest last (bounded); :meth:`collect` never
        #: returns them.
        self.rejected: deque[Rejected] = deque(maxlen=1024)
        #: Seconds spent in checks, and results checked.
        self.check_seconds = 0.0
        self.results_checked = 0
        self._to_check: asyncio.Queue[tuple[Result, str]] = asyncio.Queue(MAX_PENDING_CHECKS)
        self._checking: set[bytes] = set()
        self._lease_wake = asyncio.Event()
        self._state_path = config.data_dir / STATE_FILE
        self._chunks = DiskChunkStore(config.data_dir / "chunks")
        #: Versions restored from ``data_dir`` when this node opened (-1: none).
        self.restored_step = -1

    async def __aenter__(self) -> TrainerNode:
        try:
            await self.start()
            await self._restore()
            self.spawn(self._lease_loop(), "leases")
            self.spawn(self._check_loop(), "checks")
            self.spawn(self._lease_timer(), "lease timer")
            self.spawn(self._sync_loop(), "sync")
        except BaseException:
            await self.stop()
            self.state_db.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        self.state_db.close()

    @property
    def step(self) -> int:
        return self.manifests[-1].manifest.step if self.manifests else -1

    def latest_objects(self) -> list[bytes]:
        """The objects that carry the newest version: its manifest's, and the keyframe of
        it made for peers catching up (which then hold that, not the delta's chunks)."""
        if not self.manifests:
            return []
        newest, kf = self.manifests[-1], self._keyframe
        ids = [newest.id]
        if kf is not None and kf.manifest.step == newest.manifest.step and kf.id != newest.id:
            ids.append(kf.id)
        return ids

    # -- restarts ----------------------------------------------------------------------
    async def _restore(self) -> None:
        """Resume from ``data_dir``: the published state (base and journal), its manifests,
        their chunks."""
        self._statelog = statelog.StateLog(self._state_path)
        try:
            saved = await asyncio.to_thread(
                self._statelog.load, trusted_signer=self.identity.public_key,
                run=self.config.run)
        except SwarmError as exc:
            self._statelog.discard(str(exc))
            return
        if saved is None:
            return
        kept: list[SignedManifest] = []
        objects: list[tuple[ObjectSpec, Mapping[int, Chunk]]] = []
        for sm in reversed(saved.manifests):
            if sm.manifest.kind == "keyframe":
                if sm is saved.manifest:
                    objects.append((ObjectSpec.from_manifest(sm),
                                    piece_views(saved.state, sm.manifest.piece_size)))
                kept.append(sm)
                continue
            data = await asyncio.to_thread(self._stored_chunks, sm)
            if data is None:
                # past the deltas kept for catch-up they were pruned, as they should be
                level = logging.INFO if len(kept) > self.config.keep_versions \
                    else logging.WARNING
                log.log(level, "restore: chunks of step %d are gone; peers behind it get a "
                        "keyframe", sm.manifest.step)
                break
            objects.append((ObjectSpec.from_manifest(sm), data))
            kept.append(sm)
        kept.reverse()
        self.manifests.extend(kept[-(self.config.keep_versions + 1):])
        self._state, self._root = saved.state, saved.root
        for spec, held in objects:
            self.driver.add_object(spec, held)
        if self.leases.latest_version < saved.step:
            self.leases.publish_version(saved.step, self.clock.wall())
        self.restored_step = saved.step
        log.info("restored step %d (%d manifests kept) from %s", saved.step,
                 len(self.manifests), self.config.data_dir)

    def _stored_chunks(self, sm: SignedManifest) -> dict[int, bytes] | None:
        data = {}
        for i, (cid, _) in enumerate(sm.manifest.chunks):
            chunk = self._chunks.get(cid)
            if chunk is None:
                return None
            data[i] = chunk
        return data

    def _persist(self, sm: SignedManifest, data: Mapping[int, Chunk],
                 snapshot: Mapping[str, torch.Tensor]) -> None:
        """Write a version before it is announced (runs in a worker thread)."""
        step = sm.manifest.step
        if sm.manifest.kind == "delta":
            for i, (cid, _) in enumerate(sm.manifest.chunks):
                self._chunks.put(cid, bytes(data[i]), step)  # delta chunks: bytes, no copy
        kept = [*list(self.manifests)[-self.config.keep_versions:], sm]
        chunks = [data[i] for i in range(len(sm.manifest.chunks))] \
            if sm.manifest.kind == "delta" else None
        written = self._statelog.save(snapshot, kept, chunks)  # a delta: appended
        log.debug("step %d: %d bytes of state written", step, written)
        first = kept[0].manifest.step
        for v in self._chunks.versions():
            if v < first:
                self._chunks.drop_version(v)

    # -- publishing --------------------------------------------------------------------
    async def publish(self, state: Mapping[str, torch.Tensor], *,
                      persisted: Callable[[SignedManifest], None] | None = None
                      ) -> Published:
        """Extract, encode, sign and seed the next version; returns when it is announced.

        ``persisted`` is called once the version is on disk in ``data_dir`` and before it
        is announced (a restart from here on resumes at this version).
        """
        if self._pieces:
            raise LocalProtocolError("this trainer publishes sharded versions "
                                     "(publish_sharded): it holds no full state to diff")
        t0 = self.clock.now()
        step = self.step + 1
        if self._state is None and self._book_published:
            # The saved state was lost or refused but the lease book lives on: versions
            # keep rising, so peers holding an older version take this one.
            step = self.leases.latest_version + 1
        snapshot = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        on_device = None
        if self.config.extract_on == "device":
            on_device = {k: v.detach().contiguous().clone() for k, v in state.items()}
        dense = layout_of(snapshot).nbytes
        now_ms = int(self.clock.wall() * 1000)
        data: Mapping[int, Chunk]
        if self._state is None:
            sm = await asyncio.to_thread(keyframe_manifest, snapshot, self.identity,
                                         self.config.run, step,
                                         piece_size=self.config.piece_size, time_ms=now_ms)
            data = piece_views(snapshot, self.config.piece_size)
            root = sm.manifest.target_root
        else:
            root = await asyncio.to_thread(state_root_of, snapshot, self.config.piece_size)
            # the previous version on the device is missing after a restart: diff on the host
            old, new, engine = ((self._device_state, on_device, "torch")
                                if on_device is not None and self._device_state is not None
                                else (self._state, snapshot, "auto"))
            sm, chunks = await encode_delta(
                old, new, self.identity, self.config.run, step,
                config=EncoderConfig(piece_size=self.config.piece_size,
                                     chunk_target=self.config.chunk_target, engine=engine),
                base_root=self._root, target_root=root, time_ms=now_ms)
            data = {i: c.data for i, c in enumerate(chunks)}
        await asyncio.to_thread(self._persist, sm, data, snapshot)
        if persisted is not None:
            persisted(sm)
        self._state, self._root, self._device_state = snapshot, root, on_device
        self.manifests.append(sm)
        self._retain()
        if sm.manifest.chunks:
            self.driver.add_object(ObjectSpec.from_manifest(sm), data)
        self.leases.publish_version(step, self.clock.wall())
        await self.net.publish(topics.manifests(self.config.run), sm.encode())
        self._lease_wake.set()
        payload = sm.manifest.total_bytes
        log.info("published step %d: %s, %d chunks, %d bytes (%.1fx)", step, sm.manifest.kind,
                 len(sm.manifest.chunks), payload, dense / max(1, payload))
        return Published(step, sm, payload, dense, self.clock.now() - t0)

    async def publish_sharded(self, version: ShardedVersion) -> Published:
        """Announce a version of a sharded trainer, from the root rank's
        :class:`~swarm.delta.sharded.ShardedPublisher` (which signs with this node's key).

        The first is the publisher's ``start()``: the version peers hold (version 0, the
        run card's; or the one a restarted job resumes from), announced as a keyframe of
        its pieces, which peers holding it serve (this node holds no full state). Each
        later one is a delta: this node seeds this rank's chunks, and the other ranks'
        seeder nodes (:class:`~swarm.roles.seeder.SeederNode`), which the manifest names,
        seed theirs. Leases and :meth:`collect` work as with :meth:`publish`. Versions
        are not saved for restarts: a restarted job starts its publisher again from its
        checkpoint.

        :raises LocalProtocolError: not the root rank's version, not signed by this
            node's key for this run, a node that published full states, or a step that
            is not ahead.
        :raises IntegrityError: the version does not follow the last one announced.
        """
        t0 = self.clock.now()
        if not version.pieces:
            raise LocalProtocolError("publish_sharded takes the root rank's versions (the "
                                     "rank that signs)")
        if self._state is not None:
            raise LocalProtocolError("this trainer publishes full states (publish): a "
                                     "sharded trainer publishes with publish_sharded only")
        sm = version.manifest
        dense = sum(n for _, n in version.pieces)
        if sm is None:
            if self.manifests:
                raise LocalProtocolError("a publisher's start() is announced first, once")
            self._root, self._pieces = version.root, version.pieces
            sm = self._pieces_keyframe(version.step, version.layout_digest,
                                       version.piece_size)
            self._keyframe = sm
            data: dict[int, bytes] = {}
        else:
            m = sm.manifest
            if m.signer != self.identity.public_key or m.run != self.config.run:
                raise LocalProtocolError(f"step {m.step} is not signed by this trainer for "
                                         f"run {self.config.run!r}")
            if m.step <= self.step:
                raise LocalProtocolError(f"step {m.step} is not ahead of step {self.step}")
            if self._root is not None and m.base_root != self._root:
                raise IntegrityError(f"step {m.step} does not follow step {self.step}")
            data = dict(version.chunks)
            await asyncio.to_thread(self._store_chunks, sm, data)
            self._root, self._pieces = m.target_root, version.pieces
        self.manifests.append(sm)
        self._retain()
        if data:
            self.driver.add_object(ObjectSpec.from_manifest(sm), data)
        m = sm.manifest
        self.leases.publish_version(m.step, self.clock.wall())
        await self.net.publish(topics.manifests(self.config.run), sm.encode())
        self._lease_wake.set()
        log.info("published step %d (sharded): %s, %d chunks, %d here, %d bytes", m.step,
                 m.kind, len(m.chunks), len(data), m.total_bytes)
        payload = m.total_bytes if m.kind == "delta" else 0
        return Published(m.step, sm, payload, dense, self.clock.now() - t0)

    def _pieces_keyframe(self, step: int, layout_digest: bytes, piece_size: int
                         ) -> SignedManifest:
        """A keyframe of a sharded trainer's version ``step``: its pieces, which peers
        holding that version serve."""
        assert self._root is not None
        return pieces_keyframe(self._pieces, self._root, layout_digest, self.identity,
                               self.config.run, step, piece_size=piece_size,
                               time_ms=int(self.clock.wall() * 1000),
                               keep_versions=self.config.keep_versions)

    def _store_chunks(self, sm: SignedManifest, data: Mapping[int, Chunk]) -> None:
        for i, chunk in data.items():
            self._chunks.put(sm.manifest.chunks[i][0], bytes(chunk), sm.manifest.step)
        first = self.manifests[0].manifest.step if self.manifests else sm.manifest.step
        for v in self._chunks.versions():
            if v < first:
                self._chunks.drop_version(v)

    # -- rollout work ------------------------------------------------------------------
    def add_tasks(self, prompts: Sequence[tuple[str, Sequence[int]]], *, group_size: int,
                  sampling: Sampling | None = None) -> list[RolloutTask]:
        tasks = self.leases.add_tasks(prompts, group_size=group_size, sampling=sampling)
        self._lease_wake.set()
        return tasks

    async def collect(self, tasks: int | Sequence[RolloutTask],
                      timeout: float | None = None) -> list[Accepted]:
        """Wait for accepted results (signed, counted once, passed the checks).

        ``tasks``: the tasks :meth:`add_tasks` returned: wait until each has its result,
        and return only theirs (results of other tasks, such as an earlier step's that
        passed their checks late, wait for the call that names them). Or a count: the
        next results covering that many tasks, whichever they are.

        :raises TimeoutError: ``timeout`` seconds passed first.
        :raises NodeFailed: the node stopped first (a task of it failed: the cause is
            chained).
        """
        if isinstance(tasks, int):
            return await self._collect_any(tasks, timeout)
        want = {t.task_id for t in tasks}
        out: list[Accepted] = []

        def take(acc: Accepted) -> None:
            mine = tuple(r for r in acc.results if r.task_id in want)
            rest = tuple(r for r in acc.results if r.task_id not in want)
            if mine:
                out.append(dataclasses.replace(acc, results=mine))
                want.difference_update(r.task_id for r in mine)
            if rest:
                self._keep_stray(dataclasses.replace(acc, results=rest))

        for _ in range(len(self._stray)):  # those passed over before, once each
            take(self._stray.popleft())
        async with asyncio.timeout(timeout):
            while want:
                take(await self.wait(self._accepted.get()))
        return out

    async def _collect_any(self, n_tasks: int, timeout: float | None) -> list[Accepted]:
        out: list[Accepted] = []
        got = 0
        async with asyncio.timeout(timeout):
            while got < n_tasks:
                acc = self._stray.popleft() if self._stray else \
                    await self.wait(self._accepted.get())
                out.append(acc)
                got += len(acc.results)
        return out

    def _keep_stray(self, acc: Accepted) -> None:
        if len(self._stray) == self._stray.maxlen:
            log.warning("dropping %d accepted result(s) no collect() asked for",
                        len(self._stray[0].results))
        self._stray.append(acc)

    async def _lease_loop(self) -> None:
        while True:
            msg = await self.mux.recv(Channel.LEASE)
            now = self.clock.wall()
            try:  # which kind it is; admissible() or the book verifies the signature
                decoded: LeaseMessage | bytes = decode_message(msg.payload,
                                                               check_signature=False)
            except SwarmError:
                decoded = msg.payload  # the book refuses it and scores the sender
            if isinstance(decoded, Result) and self.leases.admissible(
                    decoded, now, sender=msg.peer_id):
                if decoded.commitment not in self._checking:  # a resent copy: checked once
                    self._checking.add(decoded.commitment)
                    await self._to_check.put((decoded, msg.peer_id))
                continue
            # the wire bytes: the book decodes and verifies them (once)
            await self._answer(msg.peer_id, self.leases.handle(msg.payload, now,
                                                               sender=msg.peer_id))

    async def _answer(self, peer: str, replies: Sequence[LeaseMessage]) -> None:
        for acc in self.leases.take_accepted():
            self._accepted.put_nowait(acc)
        for reply in replies:
            try:
                await self.mux.send(Channel.LEASE, peer, reply.encode())
            except Exception as exc:  # the peer left; its lease will expire
                log.info("could not answer %s: %s", peer, exc)
        self._lease_wake.set()

    async def _check_loop(self) -> None:
        """Run the checks on admissible results, one at a time off the event loop; a
        result that passes goes to the lease book, one that fails is rejected."""
        while True:
            res, peer = await self._to_check.get()
            try:
                if not self.leases.admissible(res, self.clock.wall(), sender=peer):
                    # counted meanwhile through a backup lease, or expired: the book says
                    # which, without a check
                    await self._answer(peer, self.leases.handle(res, self.clock.wall(),
                                                                sender=peer))
                    continue
                inp = CheckInput(res, {t: task for t in res.task_ids
                                       if (task := self.leases.task(t)) is not None},
                                 self._root_of(res.version))
                t0 = asyncio.get_running_loop().time()
                failed = await asyncio.to_thread(_first_failure, self.checks, inp)
                self.check_seconds += asyncio.get_running_loop().time() - t0
                self.results_checked += 1
                now = self.clock.wall()
                if failed is None:
                    await self._answer(peer, self.leases.handle(res, now, sender=peer))
                    continue
                log.warning("rejected result of %s (lease %s, version %d): %s", peer,
                            res.lease_id.hex()[:12], res.version, failed)
                verdict = self.leases.reject(res, now, failed)
                self.rejected.extend(self.leases.take_rejected())
                await self._answer(peer, [verdict])
            finally:
                self._checking.discard(res.commitment)

    def _root_of(self, version: int) -> bytes | None:
        for sm in self.manifests:
            if sm.manifest.step == version:
                return sm.manifest.target_root
        return None

    async def _lease_timer(self) -> None:
        while True:
            self._lease_wake.clear()
            deadline = self.leases.next_deadline()
            delay = 1.0 if deadline is None else min(1.0, max(0.01, deadline - self.clock.wall()))
            # A timer sets the event rather than a timeout cancelling the wait: on Python
            # 3.11 a timeout racing with stop()'s cancel can swallow the cancel.
            timer = asyncio.get_running_loop().call_later(delay, self._lease_wake.set)
            try:
                await self._lease_wake.wait()
            finally:
                timer.cancel()
            self.leases.tick(self.clock.wall())

    # -- catch-up ----------------------------------------------------------------------
    async def _sync_loop(self) -> None:
        while True:
            msg = await self.mux.recv(Channel.SYNC)
            try:
                req = sync.decode(msg.payload)
            except DecodeError as exc:
                self.net.penalize(msg.peer_id, f"bad sync message: {exc}")
                continue
            if not isinstance(req, sync.SyncRequest):
                self.net.penalize(msg.peer_id, "sync: a trainer takes requests only")
                continue
            chain = await self._chain_after(req.after_step)
            log.debug("sync from %s after step %d: %s", msg.peer_id, req.after_step,
                      [(m.manifest.kind, m.manifest.step) for m in chain])
            try:
                await self.mux.send(Channel.SYNC, msg.peer_id,
                                    sync.encode(sync.SyncReply(tuple(m.encode() for m in chain))))
            except Exception as exc:
                log.info("could not answer sync of %s: %s", msg.peer_id, exc)

    async def _chain_after(self, after_step: int) -> list[SignedManifest]:
        """What a peer at ``after_step`` needs: the cheaper of the delta chain from its
        version or a keyframe of the current state (whose pieces any peer at the current
        version can serve too); the rule is the followers' own
        (:func:`~swarm.protocol.follow.catch_up_reply`)."""
        kind, chain = catch_up_reply(after_step, list(self.manifests), self._state_bytes())
        if kind == "chain":
            return chain[:sync.MAX_MANIFESTS_PER_REPLY]
        if kind == "keyframe":
            return [await self._current_keyframe()]
        return []

    def _state_bytes(self) -> int:
        if self._pieces:
            return sum(n for _, n in self._pieces)
        return 0 if self._state is None else layout_of(self._state).nbytes

    def _retain(self) -> None:
        """Keep seeding the kept versions (and the newest keyframe); free the rest."""
        keep = {m.id for m in self.manifests}
        if self._keyframe is not None:
            keep.add(self._keyframe.id)
        self.driver.retain(keep)

    async def _current_keyframe(self) -> SignedManifest:
        """A keyframe of the newest version (made once per version, then seeded)."""
        newest = self.manifests[-1]
        if newest.manifest.kind == "keyframe":
            return newest
        step = newest.manifest.step
        if self._keyframe is not None and self._keyframe.manifest.step == step:
            return self._keyframe
        if self._pieces:  # sharded: pieces that peers at the version serve, not this node
            self._keyframe = self._pieces_keyframe(step, newest.manifest.layout_digest,
                                                   newest.manifest.piece_size)
            await self.net.publish(topics.manifests(self.config.run), self._keyframe.encode())
            return self._keyframe
        assert self._state is not None
        state = self._state
        sm = await asyncio.to_thread(keyframe_manifest, state, self.identity, self.config.run,
                                     step, piece_size=self.config.piece_size,
                                     time_ms=int(self.clock.wall() * 1000))
        self.driver.add_object(ObjectSpec.from_manifest(sm),
                               piece_views(state, self.config.piece_size))
        await self.net.publish(topics.manifests(self.config.run), sm.encode())
        self._keyframe = sm
        return sm

