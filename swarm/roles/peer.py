"""The rollout peer: follows versions through the swarm, verifies them, does leased work.

It keeps a canonical copy of the inference state, patches it chunk by chunk as a version
arrives (while the engine keeps generating with the previous one), checks the patched
state's root against the trainer's signed manifest, and only then pushes the changed
tensors into the engine, at a rollout boundary. Work comes as leases signed by the
trainer; results go back signed by this peer.

With a ``data_dir`` it survives its own restarts: after each verified version it saves the
state with the signed manifest of that version (atomically), and keeps received chunks in
a bounded :class:`~swarm.content.store.DiskChunkStore`. A peer opened again on that
directory checks the saved state against the trainer's signature and root, resumes at its
version and catches up by deltas; chunks already on disk are not fetched again. With
``bootstrap`` addresses it survives trainer restarts: while the trainer is not connected
it redials them with a bounded backoff, then asks the trainer for what it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.content.manifest import SignedManifest
from swarm.content.store import DiskChunkStore
from swarm.delta.codec import CODEC_NAME
from swarm.delta.patch import Patcher
from swarm.delta.state import KeyframeFiller, layout_of, piece_views, state_root_of
from swarm.engines import RolloutEngine, Sampling
from swarm.errors import (
    DecodeError,
    IntegrityError,
    LocalProtocolError,
    RemoteProtocolError,
    SwarmError,
)
from swarm.identity import Identity, public_key_from_peer_id
from swarm.net import topics
from swarm.net.transport import Subscription
from swarm.protocol.exchange import ChunkStored, Event, ExchangeConfig, ObjectSpec, PeerBanned
from swarm.protocol.leases import (
    Completion,
    Lease,
    PeerLeases,
    Reason,
    TaskResult,
    decode_message,
)
from swarm.protocol.leases import Message as LeaseMessage
from swarm.roles import persist, sync
from swarm.roles.common import Network, NodeBase
from swarm.roles.mux import Channel

log = logging.getLogger(__name__)

STATE_FILE = "peer.state"
#: Manifests remembered as failed (a failed one offered again is ignored).
MAX_FAILED = 64
#: Delta manifests kept ahead of the version held (past that, the trainer is asked).
MAX_PENDING_DELTAS = 64
#: Longest wait before dialing again a neighbour from the directory that did not answer.
DISCOVER_RETRY_MAX = 60.0

StatusFn = Callable[[str, dict[str, object]], None]


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """Settings of a :class:`RolloutPeer`."""

    run: str
    trainer: str
    """The trainer's peer id: only manifests and leases signed by its key are accepted."""
    region: str = ""
    want_tasks: int = 4
    """Tasks asked for per claim."""
    max_neighbours: int = 8
    """Other peers kept connected for the exchange."""
    discover_interval: float = 1.0
    """Seconds between looks at the run's peer directory."""
    claim_retry: float = 0.5
    """Seconds to wait before claiming again after the trainer had no work."""
    keep_versions: int = 4
    """Installed versions whose chunks this peer keeps serving to others."""
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    data_dir: Path | None = None
    """Where the verified state and received chunks are kept (None: nothing is saved)."""
    bootstrap: tuple[str, ...] = ()
    """Addresses redialled while the trainer is not connected (the trainer's own, or
    bootstrap nodes it is reachable through)."""
    reconnect_min: float = 0.5
    """First wait between redials; doubles up to ``reconnect_max``."""
    reconnect_max: float = 2.0
    """Longest wait between redials: a restarted trainer is found again within about
    this long after it listens (a refused dial costs one round trip)."""
    store_budget: int = 256 << 20
    """Bytes of received chunks kept on disk (the two newest versions always stay)."""
    fetch_stall: float = 10.0
    """Seconds without a new chunk of a version being fetched after which the trainer is
    asked again, and the fetch is given up if something else is now the version to take
    (its seeders may have moved on; while it progresses, it is kept)."""

    def __post_init__(self) -> None:
        if not self.fetch_stall > 0:
            raise ValueError("fetch_stall must be positive")


def next_manifest(version: int, deltas: Mapping[int, SignedManifest],
                  keyframe: SignedManifest | None) -> SignedManifest | None:
    """The version to install next, from ``version``: the delta after it, or a keyframe
    ahead of it when that costs fewer bytes than the deltas up to the keyframe's step, or
    when some of those deltas are unknown.

    A keyframe of the newest version is published whenever a newcomer asks for one; a
    peer a few deltas behind keeps following its deltas rather than fetch the dense state.
    """
    if keyframe is not None and keyframe.manifest.step > version:
        if version < 0:
            return keyframe
        chain = [deltas.get(s) for s in range(version + 1, keyframe.manifest.step + 1)]
        if any(m is None for m in chain) or \
                sum(m.manifest.total_bytes for m in chain if m) >= keyframe.manifest.total_bytes:
            return keyframe
    return None if version < 0 else deltas.get(version + 1)


class RolloutPeer(NodeBase):
    """A volunteer node. An async context manager owning its tasks."""

    def __init__(self, identity: Identity, net: Network, config: PeerConfig,
                 state: dict[str, torch.Tensor], engine: RolloutEngine,
                 status: StatusFn | None = None, seed: int = 0) -> None:
        super().__init__(net, region=config.region, exchange_config=config.exchange, seed=seed)
        self.identity = identity
        self.config = config
        self.trainer_key = public_key_from_peer_id(config.trainer)
        self.state = state
        self.engine = engine
        self.version = -1
        self.root: bytes | None = None
        self.leases = PeerLeases(identity, self.trainer_key, config.run)
        self._status = status or (lambda event, fields: None)
        self._deltas: dict[int, SignedManifest] = {}
        """Delta manifests ahead of ``version``, by step."""
        self._keyframe: SignedManifest | None = None
        """The newest keyframe ahead of ``version``."""
        self._views_served: set[bytes] = set()
        """Objects whose chunks are views of ``state`` (keyframes of the version held)."""
        self._writing = False
        """``state`` is being written: it matches no version until the write ends."""
        self._layout_digest = layout_of(state).digest
        self._asked_after = -1
        """The newest version whose announcement made this peer ask for a sync."""
        self._failed: deque[bytes] = deque(maxlen=MAX_FAILED)
        """Manifests whose content failed to install: offered again, they are ignored."""
        self._installed: deque[SignedManifest] = deque(maxlen=config.keep_versions)
        self._new_manifest = asyncio.Event()
        self._engine_lock = asyncio.Lock()
        self._version_changed = asyncio.Condition()
        self._lease_inbox: asyncio.Queue[Lease] = asyncio.Queue(64)
        self._tokens_per_s = 100.0
        self.verified = 0
        self.verify_failures = 0
        self.tasks_done = 0
        self.bans: list[tuple[str, str]] = []
        #: The version restored from ``data_dir`` at start (-1: none).
        self.resumed_version = -1
        self.reconnects = 0
        self._trainer_lost = asyncio.Event()
        self._store: DiskChunkStore | None = None
        self._state_path: Path | None = None
        self._fetching: dict[bytes, tuple[int, tuple[bytes, ...]]] = {}
        self._to_store: asyncio.Queue[tuple[bytes, bytes, int]] = asyncio.Queue(256)
        if config.data_dir is not None:
            self._state_path = config.data_dir / STATE_FILE
            self._store = DiskChunkStore(config.data_dir / "chunks",
                                         budget_bytes=config.store_budget)

    async def __aenter__(self) -> RolloutPeer:
        await self._resume()
        await self.start(self._on_exchange_event)
        sub = await self.net.subscribe(topics.manifests(self.config.run),
                                       topics.manifest_validator(self.trainer_key))
        self.spawn(self._manifest_feed(sub), "manifest feed")
        self.spawn(self._sync_inbox(), "sync inbox")
        self.spawn(self._follow(), "follow versions")
        self.spawn(self._lease_inbox_loop(), "lease inbox")
        self.spawn(self._work(), "work")
        self.spawn(self._heartbeats(), "heartbeats")
        self.spawn(self._discover(), "discover")
        if self._store is not None:
            self.spawn(self._store_chunks(self._store), "chunk store")
        if self.config.bootstrap:
            self.spawn(self._reconnect(), "reconnect")
        if self.config.trainer in self.net.connected_peers():
            await self._ask_sync()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def on_peer(self, peer: str, connected: bool) -> None:
        if connected:
            self.driver.connected(peer, region=self.region_of(peer),
                                  trainer=peer == self.config.trainer)
            if peer == self.config.trainer and hasattr(self, "_tasks") and self._tasks:
                self.spawn(self._ask_sync(), "sync request")
        else:
            self.driver.disconnected(peer)
            if peer == self.config.trainer:
                self._trainer_lost.set()

    def _on_exchange_event(self, ev: Event) -> None:
        if isinstance(ev, ChunkStored):
            fetching = self._fetching.get(ev.obj)
            if fetching is not None:
                version, ids = fetching
                try:
                    self._to_store.put_nowait((ids[ev.index], ev.data, version))
                except asyncio.QueueFull:
                    log.debug("chunk store busy: chunk %d of step %d kept in memory only",
                              ev.index, version)
        elif isinstance(ev, PeerBanned):
            self.bans.append((ev.peer, ev.reason))
            self._status("banned", {"peer": ev.peer, "reason": ev.reason})

    # -- restarts ----------------------------------------------------------------------
    async def _resume(self) -> None:
        """Load the state saved in ``data_dir``; a refused one is moved aside."""
        path = self._state_path
        if path is None:
            return
        try:
            saved = await asyncio.to_thread(
                persist.load_state, path, trusted_signer=self.trainer_key, run=self.config.run,
                layout=layout_of(self.state))
        except SwarmError as exc:
            persist.discard(path, str(exc))
            self._status("resume_refused", {"error": str(exc)})
            return
        if saved is None:
            return
        with torch.no_grad():
            for name, tensor in saved.state.items():
                self.state[name].copy_(tensor)
        await asyncio.to_thread(self.engine.apply, dict(self.state))
        self.version, self.root = saved.step, saved.root
        self.resumed_version = saved.step
        log.info("resumed at step %d from %s", saved.step, path)
        self._status("resumed", {"version": saved.step})

    async def _save(self, sm: SignedManifest) -> None:
        if self._state_path is None:
            return
        try:
            await asyncio.to_thread(persist.save_state, self._state_path, self.state, [sm])
        except SwarmError as exc:
            log.error("could not save step %d: %s", sm.manifest.step, exc)

    async def _store_chunks(self, store: DiskChunkStore) -> None:
        while True:
            cid, data, version = await self._to_store.get()
            try:
                await asyncio.to_thread(store.put, cid, data, version)
            except SwarmError as exc:
                log.error("could not store a chunk of step %d: %s", version, exc)

    async def _stored(self, spec: ObjectSpec) -> dict[int, bytes]:
        """Chunks of ``spec`` already in the chunk store (verified on read)."""
        store = self._store
        if store is None:
            return {}

        def read() -> dict[int, bytes]:
            out = {}
            for i, cid in enumerate(spec.chunk_ids):
                if store.has(cid) and (data := store.get(cid)) is not None:
                    out[i] = data
            return out

        return await asyncio.to_thread(read)

    async def _reconnect(self) -> None:
        """Redial the bootstrap addresses while the trainer is away (bounded backoff)."""
        delay = self.config.reconnect_min
        while True:
            if self.config.trainer in self.net.connected_peers():
                delay = self.config.reconnect_min
                self._trainer_lost.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.reconnect_max):
                        await self._trainer_lost.wait()
                continue
            for addr in self.config.bootstrap:
                try:
                    await self.net.connect(addr)
                except (SwarmError, OSError) as exc:
                    log.debug("redial %s: %s", addr, exc)
            if self.config.trainer in self.net.connected_peers():
                self.reconnects += 1
                log.info("trainer reachable again (reconnect %d)", self.reconnects)
                self._status("reconnected", {"version": self.version})
                await self._ask_sync()
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.reconnect_max)

    # -- versions ----------------------------------------------------------------------
    async def _ask_sync(self, after: int | None = None) -> None:
        """Ask the trainer for what follows version ``after`` (default: the version held;
        -1: a keyframe of its newest version)."""
        with contextlib.suppress(SwarmError):
            await self.mux.send(Channel.SYNC, self.config.trainer, sync.encode(
                sync.SyncRequest(self.version if after is None else after)))

    def _offer(self, data: bytes) -> None:
        try:
            sm = SignedManifest.decode(data, trusted_signer=self.trainer_key)
        except SwarmError as exc:
            log.warning("dropped a manifest: %s", exc)
            return
        m = sm.manifest
        if m.run != self.config.run or (self._failed and sm.id in self._failed):
            return
        if m.kind == "delta" and m.codec != CODEC_NAME:
            log.warning("dropped step %d: codec %r, this peer decodes %r", m.step, m.codec,
                        CODEC_NAME)
            return
        if m.kind == "keyframe" and m.step == self.version and m.target_root == self.root:
            # A keyframe of the version we hold: seed its pieces for newcomers (not while
            # the state is being written: then it holds no version).
            if not self._writing:
                self._serve_state(sm)
            return
        if m.step <= self.version:
            return
        if m.kind == "keyframe":
            held = self._keyframe
            if held is None or m.step > held.manifest.step or \
                    (m.step == held.manifest.step and sm.id != held.id):
                self._keyframe = sm  # the newest; of one step, the last announced
        else:
            if len(self._deltas) < MAX_PENDING_DELTAS:
                self._deltas.setdefault(m.step, sm)
            if self._next_manifest() is None and m.step > self._asked_after:
                # A newer version, and nothing held leads to it (a lost announcement, a
                # version that failed): ask the trainer, once per version, what to take.
                self._asked_after = m.step
                self.spawn(self._ask_sync(), "sync request")
        self._new_manifest.set()

    async def _manifest_feed(self, sub: Subscription) -> None:
        async with sub:
            while True:
                msg = await sub.get()
                self._offer(msg.data)

    async def _sync_inbox(self) -> None:
        while True:
            msg = await self.mux.recv(Channel.SYNC)
            if msg.peer_id != self.config.trainer:
                self.net.penalize(msg.peer_id, "sync reply from a non-trainer")
                continue
            try:
                reply = sync.decode(msg.payload)
            except DecodeError as exc:
                self.net.penalize(msg.peer_id, f"bad sync message: {exc}")
                continue
            if isinstance(reply, sync.SyncReply):
                for data in reply.manifests:
                    self._offer(data)

    def _next_manifest(self) -> SignedManifest | None:
        return next_manifest(self.version, self._deltas, self._keyframe)

    async def _fetched(self, sm: SignedManifest, spec: ObjectSpec) -> bool:
        """Wait for every chunk of ``spec``. While none comes for ``fetch_stall`` seconds,
        ask the trainer again, once a stall; then give up (False) if another version is now
        the one to take: its seeders move on (the trainer seeds only its newest keyframe
        and the versions it keeps, peers the keyframe of the version they hold), so it may
        never complete."""
        done = asyncio.ensure_future(self.driver.wait_complete(spec.obj))
        stall = self.config.fetch_stall
        asked = self.driver.now()
        try:
            while not done.done():
                now = self.driver.now()
                if self.driver.exchange.idle(spec.obj, now) >= stall:
                    ahead = self._keyframe
                    if sm.manifest.kind == "delta" and ahead is not None \
                            and self._deltas.get(sm.manifest.step) is sm:
                        # Nobody serves it, and a keyframe ahead is known: take that.
                        del self._deltas[sm.manifest.step]
                    if self._next_manifest() is not sm:
                        return False
                    if now - asked >= stall:
                        asked = now
                        await self._ask_sync(-1 if sm.manifest.kind == "keyframe" else None)
                await asyncio.wait({done}, timeout=stall / 4)
            return True
        finally:
            done.cancel()

    def _forget_through(self, step: int) -> None:
        """Drop the manifests of versions up to ``step``."""
        for s in [s for s in self._deltas if s <= step]:
            del self._deltas[s]
        if self._keyframe is not None and self._keyframe.manifest.step <= step:
            self._keyframe = None

    async def _follow(self) -> None:
        while True:
            sm = self._next_manifest()
            if sm is None:
                self._new_manifest.clear()
                if self._next_manifest() is None:
                    await self._new_manifest.wait()
                continue
            t0 = time.perf_counter()
            if sm.manifest.layout_digest != self._layout_digest:
                raise RuntimeError(
                    f"step {sm.manifest.step} is for another model (layout digest "
                    f"{sm.manifest.layout_digest.hex()[:16]}, this peer's state has "
                    f"{self._layout_digest.hex()[:16]}): this peer cannot follow the run")
            spec = ObjectSpec.from_manifest(sm)
            if spec.chunk_ids:
                if sm.manifest.kind == "keyframe" and await self._local_matches(sm):
                    self._serve_state(sm)
                elif not self.driver.has_object(spec.obj):
                    if self._store is not None:
                        self._fetching[spec.obj] = (sm.manifest.step, spec.chunk_ids)
                    self.driver.add_object(spec, await self._stored(spec))
                fetched_all = await self._fetched(sm, spec)
                self._fetching.pop(spec.obj, None)
                if not fetched_all:
                    self.driver.drop({spec.obj})
                    continue
            fetched = time.perf_counter() - t0
            try:
                changed, verified_at = await self._install(sm, spec)
            except SwarmError as exc:
                self.verify_failures += 1
                log.error("step %d failed verification: %s", sm.manifest.step, exc)
                self._status("verify_failed", {"version": sm.manifest.step, "error": str(exc)})
                if sm.manifest.kind == "keyframe":
                    if self._keyframe is sm:
                        self._keyframe = None
                elif self._deltas.get(sm.manifest.step) is sm:
                    del self._deltas[sm.manifest.step]
                bad = isinstance(exc, RemoteProtocolError)
                if bad:  # its content is wrong however often it is fetched: never again
                    self._failed.append(sm.id)
                    self.driver.drop({spec.obj})
                await self._ask_sync(-1 if bad else None)
                continue
            self.verified += 1
            self._forget_through(self.version)
            self._installed.append(sm)
            # Keep serving the last few versions to laggards; free older chunks.
            ahead = [*self._deltas.values(), *([self._keyframe] if self._keyframe else [])]
            self.driver.retain({m.id for m in self._installed} | {m.id for m in ahead})
            self._status("verified", {
                "version": self.version, "kind": sm.manifest.kind,
                "bytes": sm.manifest.total_bytes, "fetch_s": round(fetched, 3),
                "sync_s": round(verified_at - t0, 3),
                "installed_s": round(time.perf_counter() - t0, 3), "tensors": len(changed),
                "bytes_up": self.driver.exchange.bytes_up,
                "bytes_down": self.driver.exchange.bytes_down,
            })

    async def _local_matches(self, sm: SignedManifest) -> bool:
        root = await asyncio.to_thread(state_root_of, self.state, sm.manifest.piece_size)
        return root == sm.manifest.target_root

    def _serve_state(self, sm: SignedManifest) -> None:
        """Seed keyframe ``sm``, which the canonical state matches, from views of the state
        itself (no copy of it). :meth:`_install` withdraws them before writing."""
        spec = ObjectSpec.from_manifest(sm)
        if self.driver.has_object(spec.obj):
            return
        self.driver.add_object(spec, piece_views(self.state, sm.manifest.piece_size))
        self._views_served.add(spec.obj)

    def _withdraw_views(self) -> None:
        """Stop serving chunks that are views of the state: it is about to change."""
        self._writing = True
        if self._views_served:
            self.driver.drop(self._views_served)
            self._views_served.clear()

    async def _install(self, sm: SignedManifest, spec: ObjectSpec
                       ) -> tuple[frozenset[str], float]:
        """Patch (or fill) the canonical state and verify its root while the engine keeps
        generating; then, at a rollout boundary, update the engine.

        Returns the changed tensor names and when verification finished
        (``time.perf_counter()``).
        """
        if spec.obj in self._views_served:  # a keyframe of exactly the state held here
            return await self._take_version(sm, sm.manifest.target_root, frozenset(self.state))
        ex = self.driver.exchange
        chunks = []
        for i in range(len(spec.chunk_ids)):
            data = ex.chunk(spec.obj, i)
            if data is None:
                raise LocalProtocolError(f"chunk {i} vanished before install")
            chunks.append(data)
        if sm.manifest.kind == "keyframe":
            filler = KeyframeFiller(self.state, sm)  # checks the layout before any write
        else:
            patcher = Patcher(self.state, sm, current_root=self.root)  # and the base root
        self._withdraw_views()
        settled = False  # ``version`` and ``root`` describe the state again
        try:
            if sm.manifest.kind == "keyframe":
                for i, data in enumerate(chunks):
                    filler.put_piece(i, data)
                root = await asyncio.to_thread(filler.finish)
                changed = frozenset(self.state)
                # Serve the pieces from the state from now on; free the received copy.
                del chunks
                ex.replace_data(spec.obj, piece_views(self.state, sm.manifest.piece_size))
                self._views_served.add(spec.obj)
            else:
                try:
                    for cid, data in zip(spec.chunk_ids, chunks, strict=True):
                        patcher.apply(cid, data)
                except SwarmError:
                    patcher.revert()  # back to the base version, exactly
                    settled = True
                    raise
                try:
                    changed = await asyncio.to_thread(patcher.finish)
                except IntegrityError:
                    settled = True  # finish reverted to the base version
                    raise
                root = sm.manifest.target_root
            out = await self._take_version(sm, root, changed)
            settled = True
            return out
        finally:
            if not settled:
                # Partly written (or written, but the engine could not take it): the state
                # matches no known version. Sync from scratch.
                self.version, self.root = -1, None
            self._writing = False

    async def _take_version(self, sm: SignedManifest, root: bytes, changed: frozenset[str]
                            ) -> tuple[frozenset[str], float]:
        """The canonical state now holds version ``sm``: update the engine at a rollout
        boundary, then save."""
        verified_at = time.perf_counter()
        async with self._engine_lock:
            if changed:
                try:
                    await asyncio.to_thread(self.engine.apply,
                                            {n: self.state[n] for n in changed})
                except SwarmError as exc:  # the engine's fault, not the version's: fatal
                    raise RuntimeError(f"the engine could not take step "
                                       f"{sm.manifest.step}: {exc}") from exc
            self.version, self.root = sm.manifest.step, root
        await self._save(sm)
        async with self._version_changed:
            self._version_changed.notify_all()
        return changed, verified_at

    async def wait_version(self, version: int) -> None:
        """Return once this peer has installed and verified ``version`` (or a later one)."""
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.version >= version)

    # -- peers ---------------------------------------------------------------------------
    async def _discover(self) -> None:
        directory = getattr(self.net, "directory", None)
        if directory is None:
            return
        loop = asyncio.get_running_loop()
        # Peers whose dial failed: (when to try again, the wait that gave). The transport
        # dials whenever asked, so dead entries of the directory are backed off here.
        failed: dict[str, tuple[float, float]] = {}
        while True:
            await asyncio.sleep(self.config.discover_interval)
            connected = self.net.connected_peers()
            others = [p for p in connected if p != self.config.trainer]
            if len(others) >= self.config.max_neighbours and self.config.trainer in connected:
                continue
            entries: Mapping[str, topics.PeerMetadata] = directory()
            # The trainer first (when we joined through a bootstrap node), then others.
            order = sorted(entries.items(), key=lambda kv: (kv[0] != self.config.trainer, kv[0]))
            if len(failed) > len(entries):
                failed = {p: f for p, f in failed.items() if p in entries}
            for peer, meta in order:
                if peer in connected or peer == self.net.peer_id or not meta.addrs:
                    continue
                retry = failed.get(peer)
                if retry is not None and loop.time() < retry[0]:
                    continue
                try:
                    await self.net.connect(meta.addrs[0])
                except (SwarmError, OSError) as exc:
                    log.debug("dial %s: %s", peer, exc)
                    cap = (self.config.reconnect_max if peer == self.config.trainer
                           else DISCOVER_RETRY_MAX)
                    wait = min(2 * retry[1], cap) if retry else self.config.reconnect_min
                    failed[peer] = (loop.time() + wait, wait)
                else:
                    failed.pop(peer, None)
                    others.append(peer)
                if len(others) >= self.config.max_neighbours:
                    break

    # -- leased work ---------------------------------------------------------------------
    async def _lease_inbox_loop(self) -> None:
        while True:
            msg = await self.mux.recv(Channel.LEASE)
            try:
                decoded: LeaseMessage | bytes = decode_message(msg.payload)
            except SwarmError:
                decoded = msg.payload  # refused, logged and scored by receive()
            verdict = self.leases.receive(decoded, time.time(), sender=msg.peer_id)
            if verdict is Reason.ACCEPTED and isinstance(decoded, Lease):
                await self._lease_inbox.put(decoded)

    async def _send_lease_msg(self, data: bytes) -> None:
        with contextlib.suppress(SwarmError):
            await self.mux.send(Channel.LEASE, self.config.trainer, data)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            self.leases.tick(now)
            for hb in self.leases.heartbeats(now):
                await self._send_lease_msg(hb.encode())

    async def _work(self) -> None:
        while True:
            if self.version < 0 or self.config.trainer not in self.net.connected_peers():
                await asyncio.sleep(self.config.claim_retry)
                continue
            claim = self.leases.claim(time.time(), tokens_per_s=self._tokens_per_s,
                                      version=self.version, want=self.config.want_tasks)
            await self._send_lease_msg(claim.encode())
            try:
                lease = await asyncio.wait_for(self._lease_inbox.get(),
                                               timeout=self.config.claim_retry * 4)
            except TimeoutError:
                continue
            await self._run_lease(lease)

    async def _run_lease(self, lease: Lease) -> None:
        self._status("lease", {"lease": lease.lease_id.hex()[:12], "tasks": len(lease.tasks)})
        results = []
        tokens = 0
        t0 = time.perf_counter()
        async with self._engine_lock:
            version = self.version
            for task in lease.tasks:
                sampling: Sampling = task.sampling  # the lease's settings, as signed
                prompts = [list(task.prompt_tokens)] * task.group_size
                outs = await asyncio.to_thread(self.engine.generate, prompts, sampling)
                comps: tuple[Completion, ...] = tuple(outs)  # the engine's, as sent
                tokens += sum(len(c.token_ids) for c in comps)
                results.append(TaskResult(task.task_id, comps))
        elapsed = max(1e-3, time.perf_counter() - t0)
        self._tokens_per_s = 0.7 * self._tokens_per_s + 0.3 * tokens / elapsed
        if lease.lease_id not in self.leases.held:
            self._status("lease_lost", {"lease": lease.lease_id.hex()[:12]})
            return
        res = self.leases.result(lease.lease_id, version, results, time.time())
        await self._send_lease_msg(res.encode())
        self.tasks_done += len(results)
        self._status("result", {"lease": lease.lease_id.hex()[:12], "tasks": len(results),
                                "version": version, "tokens_per_s": round(tokens / elapsed, 1)})

