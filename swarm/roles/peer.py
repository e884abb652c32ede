"""The rollout peer: follows versions through the swarm, verifies them, does leased work.

It keeps a canonical copy of the inference state, patches it chunk by chunk as a version
arrives (while the engine keeps generating with the previous one), checks the patched
state's root against the trainer's signed manifest, and only then pushes the changed
tensors into the engine, at a rollout boundary. Work comes as leases signed by the
trainer; results go back signed by this peer.

The peer is a composition: a :class:`~swarm.protocol.follow.Follower` decides which
version to fetch and install next (this module carries out its actions),
:class:`~swarm.roles.peer_work.LeasedWork` claims and runs leases, and
:class:`~swarm.roles.discovery.Discovery` keeps neighbours and the trainer connected.

With a ``data_dir`` it survives its own restarts: after each verified version it saves the
state with the signed manifest of that version (atomically), and keeps received chunks in
a bounded :class:`~swarm.content.store.DiskChunkStore`. A peer opened again on that
directory checks the saved state against the trainer's signature and root, resumes at its
version, asks the trainer what followed and catches up by the cheaper route; chunks
already on disk are not fetched again. A saved state that is refused (empty, truncated,
not signed by the trainer) is moved aside and the peer starts from a keyframe. With
``bootstrap`` addresses it survives trainer restarts: while the trainer is not connected
it redials them with a bounded backoff, then asks the trainer for what it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.content.manifest import SignedManifest
from swarm.content.store import DiskChunkStore
from swarm.delta.codec import CODEC_NAME
from swarm.delta.patch import Patcher
from swarm.delta.state import KeyframeFiller, layout_of, piece_views, state_root_of
from swarm.engines import RolloutEngine
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
from swarm.protocol.exchange import (
    ChunkStored,
    Event,
    ExchangeConfig,
    ObjectSpec,
    PeerBanned,
    PeerDropped,
    PeerTimedOut,
)
from swarm.protocol.follow import (
    Action,
    AskTrainer,
    Drop,
    Fetch,
    FollowConfig,
    Follower,
    Install,
    Stop,
)
from swarm.protocol.leases import NO_ROOT, PeerLeases
from swarm.roles import statelog, sync
from swarm.roles.common import Clock, Network, NodeBase
from swarm.roles.discovery import Discovery, DiscoveryConfig
from swarm.roles.mux import Channel
from swarm.roles.peer_work import LeasedWork, WorkConfig

log = logging.getLogger(__name__)

STATE_FILE = "peer.state"

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
    """Seconds without a new chunk of a version being fetched (or, while behind with
    nothing that leads on, since the last ask) after which the trainer is asked again;
    a stalled fetch is given up when another route exists."""

    work: bool = True
    """Claim and run leased rollout work (False: only follow and verify versions, as the
    ``swarm`` weight-transfer backend inside vLLM does; the engine never generates)."""

    def __post_init__(self) -> None:
        if not self.fetch_stall > 0:
            raise ValueError("fetch_stall must be positive")


class RolloutPeer(NodeBase):
    """A volunteer node. An async context manager owning its tasks."""

    def __init__(self, identity: Identity, net: Network, config: PeerConfig,
                 state: dict[str, torch.Tensor], engine: RolloutEngine,
                 status: StatusFn | None = None, seed: int = 0,
                 clock: Clock | None = None, start: tuple[int, bytes] | None = None) -> None:
        """``start``: (version, root) that ``state`` already holds, verified by the caller
        against a root the trainer signed (the run card's version 0); a saved state in
        ``data_dir`` takes precedence."""
        super().__init__(net, region=config.region, exchange_config=config.exchange,
                         seed=seed, clock=clock, name="peer")
        self._start = start
        self.identity = identity
        self.config = config
        self.trainer_key = public_key_from_peer_id(config.trainer)
        self.state = state
        self.engine = engine
        self.version = -1
        self.root: bytes | None = None
        self._status = status or (lambda event, fields: None)
        self._layout_digest = layout_of(state).digest
        self.follower = self._new_follower()
        self._wake = asyncio.Event()
        """Set when the follower has news (an offer, a fetch done, the trainer back)."""
        self._fetches: dict[bytes, tuple[SignedManifest, float, asyncio.Task[None] | None]] = {}
        """Objects being fetched: their manifest, when the fetch began, its watcher."""
        self._views_served: set[bytes] = set()
        """Objects whose chunks are views of ``state`` (keyframes of the version held)."""
        self._writing = False
        """``state`` is being written: it matches no version until the write ends."""
        self._installed: deque[SignedManifest] = deque(maxlen=config.keep_versions)
        self._engine_lock = asyncio.Lock()
        self._version_changed = asyncio.Condition()
        self.verified = 0
        self.verify_failures = 0
        self.bans: list[tuple[str, str]] = []
        #: Who else signed valid manifests on the run's topic (a wrong --trainer?).
        self.other_signers = topics.OtherSigners()
        #: The version restored from ``data_dir`` at start (-1: none).
        self.resumed_version = -1
        self.leases = PeerLeases(identity, self.trainer_key, config.run)
        self.work = LeasedWork(
            self.leases, self.mux, engine, self._engine_lock,
            WorkConfig(config.trainer, config.want_tasks, config.claim_retry), self.clock,
            version=lambda: (self.version, self.root or NO_ROOT), status=self._status,
            on_stale=self._stale, downloading=self._downloading)
        self.discovery = Discovery(
            net, DiscoveryConfig(config.trainer, config.bootstrap, config.max_neighbours,
                                 config.discover_interval, config.reconnect_min,
                                 config.reconnect_max),
            self.clock, on_trainer_back=self._trainer_back)
        self._store: DiskChunkStore | None = None
        self._state_path: Path | None = None
        self._to_store: asyncio.Queue[tuple[bytes, bytes, int]] = asyncio.Queue(256)
        if config.data_dir is not None:
            self._state_path = config.data_dir / STATE_FILE
            self._store = DiskChunkStore(config.data_dir / "chunks",
                                         budget_bytes=config.store_budget)

    def _new_follower(self) -> Follower:
        return Follower(run=self.config.run, codec=CODEC_NAME,
                        layout_digest=self._layout_digest,
                        config=FollowConfig(stall=self.config.fetch_stall),
                        version=self.version, root=self.root, now=self.clock.now())

    async def __aenter__(self) -> RolloutPeer:
        try:
            await self._resume()
            if self.version < 0 and self._start is not None:
                self.version, self.root = self._start
                self.verified += 1
                self._status("verified", {
                    "version": self.version, "kind": "local", "bytes": 0, "fetch_s": 0.0,
                    "sync_s": 0.0, "installed_s": 0.0, "tensors": len(self.state),
                    "bytes_up": 0, "bytes_down": 0, "bytes_from_trainer": 0})
            self.follower = self._new_follower()
            await self.start(self._on_exchange_event)
            sub = await self.net.subscribe(topics.manifests(self.config.run),
                                           topics.manifest_validator(
                                               self.trainer_key, others=self.other_signers))
            self.spawn(self._manifest_feed(sub), "manifest feed")
            self.spawn(self._sync_inbox(), "sync inbox")
            self.spawn(self._follow(), "follow versions")
            if self.config.work:
                self.spawn(self.work.inbox(), "lease inbox")
                self.spawn(self.work.claims(), "work")
                self.spawn(self.work.heartbeats(), "heartbeats")
            self.spawn(self.discovery.run_directory(), "discover")
            if self._store is not None:
                self.spawn(self._store_chunks(self._store), "chunk store")
            if self.config.bootstrap:
                self.spawn(self.discovery.run_reconnect(), "reconnect")
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def tasks_done(self) -> int:
        return self.work.tasks_done

    @property
    def run_over(self) -> int | None:
        """The version at which the trainer said its run finished, once this peer has
        verified it (its line said so), or ``None`` while the run goes on."""
        over = self.work.run_over
        return over if over is not None and self.follower.version >= over else None

    @property
    def reconnects(self) -> int:
        return self.discovery.reconnects

    def on_peer(self, peer: str, connected: bool) -> None:
        if connected:
            self.driver_connected(peer, trainer=peer == self.config.trainer
                                  or peer in self.discovery.seeders)
            if peer == self.config.trainer:
                self.follower.trainer_connected(self.clock.now())
                self._wake.set()
        else:
            self.driver.disconnected(peer)
            if peer == self.config.trainer:
                self.discovery.trainer_lost()
        self._update_ready()

    def _update_ready(self) -> None:
        if self.version >= 0 and self.config.trainer in self.net.connected_peers():
            self.work.ready.set()
        else:
            self.work.ready.clear()

    def _trainer_back(self) -> None:
        self._status("reconnected", {"version": self.version})
        self.follower.trainer_connected(self.clock.now())
        self._wake.set()

    def _downloading(self) -> int | None:
        """The newest version being fetched, if any (a claim says so while catching up)."""
        return max((sm.manifest.step for sm, _, _ in self._fetches.values()), default=None)

    def _stale(self) -> None:
        self.follower.behind(self.version + 1, self.clock.now())
        self._wake.set()

    def _on_exchange_event(self, ev: Event) -> None:
        if isinstance(ev, ChunkStored):
            fetch = self._fetches.get(ev.obj)
            if fetch is None:
                return
            sm = fetch[0]
            self.follower.chunk_arrived(sm, self.clock.now())
            if self._store is not None:
                try:
                    self._to_store.put_nowait((sm.manifest.chunk_ids[ev.index], ev.data,
                                               sm.manifest.step))
                except asyncio.QueueFull:
                    log.debug("chunk store busy: chunk %d of step %d kept in memory only",
                              ev.index, sm.manifest.step)
        elif isinstance(ev, PeerBanned):
            self.bans.append((ev.peer, ev.reason))
            self._status("banned", {"peer": ev.peer, "reason": ev.reason})
        elif isinstance(ev, PeerTimedOut | PeerDropped):
            self._status("dropped", {"peer": ev.peer, "reason": ev.reason})

    # -- restarts ----------------------------------------------------------------------
    async def _resume(self) -> None:
        """Load the state saved in ``data_dir`` (its base and journal); a refused one is
        moved aside."""
        path = self._state_path
        self._written = 0  # bytes the last save wrote
        self._statelog = None if path is None else statelog.StateLog(path)
        if self._statelog is None:
            return
        try:
            saved = await asyncio.to_thread(
                self._statelog.load, trusted_signer=self.trainer_key, run=self.config.run,
                layout=layout_of(self.state))
        except SwarmError as exc:
            self._statelog.discard(str(exc))
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
        """Save the version just taken: a delta that follows the saved one is appended to
        the journal (its chunks, still held by the exchange), anything else is a new base."""
        self._written = 0
        if self._statelog is None:
            return
        chunks: list[bytes | memoryview] | None = None
        if sm.manifest.kind == "delta":
            obj = ObjectSpec.from_manifest(sm).obj
            held = [self.driver.exchange.chunk(obj, i) for i in range(len(sm.manifest.chunks))]
            chunks = [c for c in held if c is not None]
            if len(chunks) != len(held):
                chunks = None
        try:
            self._written = await asyncio.to_thread(self._statelog.save, self.state, [sm],
                                                    chunks)
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
        """Chunks of ``spec`` already in the chunk store (verified on read: a corrupt one
        is dropped from the store and fetched again)."""
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

    # -- versions ----------------------------------------------------------------------
    async def _ask_sync(self, after: int) -> None:
        """Ask the trainer for what follows step ``after`` (-1: a keyframe of its newest)."""
        with contextlib.suppress(SwarmError):
            await self.mux.send(Channel.SYNC, self.config.trainer,
                                sync.encode(sync.SyncRequest(after)))

    def _seeders_named(self, sm: SignedManifest) -> None:
        """The trainer seeders the newest manifest names (the other ranks of a sharded
        trainer): dialled like the trainer, and the trainer's peers in the exchange."""
        if sm.manifest.step < self.follower.head or sm.manifest.kind != "delta":
            return
        named = frozenset(sm.manifest.seeder_peer_ids) - {self.net.peer_id,
                                                           self.config.trainer}
        if named == self.discovery.seeders:
            return
        changed = named ^ self.discovery.seeders
        self.discovery.seeders = named
        for peer in changed & set(self.net.connected_peers()):
            self.driver.set_trainer(peer, peer in named)

    def _offer(self, data: bytes) -> None:
        try:
            sm = SignedManifest.decode(data, trusted_signer=self.trainer_key)
        except SwarmError as exc:
            log.warning("dropped a manifest: %s", exc)
            return
        self._seeders_named(sm)
        offered = self.follower.offer(sm, self.clock.now())
        if self.driver.lie_about_chunks and sm.manifest.chunks and \
                not self.driver.has_object(sm.id):
            self.driver.add_object(ObjectSpec.from_manifest(sm))  # chaos: claim it all
        if offered.kind == "held":
            # A keyframe of the version we hold: seed its pieces for newcomers (not while
            # the state is being written: then it holds no version).
            if not self._writing:
                self._serve_state(sm)
        elif offered.reason.startswith("codec"):
            log.warning("dropped step %d: %s", sm.manifest.step, offered.reason)
        self._wake.set()

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

    async def _follow(self) -> None:
        """Carry out the follower's actions; sleep until it has news or a deadline."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            actions = self.follower.poll(self.clock.now())
            for action in actions:
                await self._act(action)
            if actions:
                continue
            wake = self.follower.wake_at()
            timer = None if wake is None else loop.call_later(
                max(0.0, wake - self.clock.now()), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    async def _act(self, action: Action) -> None:
        log.debug("follow: %s", action)
        if isinstance(action, Fetch):
            await self._fetch(action.manifest)
        elif isinstance(action, Drop):
            self._end_fetch(action.manifest, drop=True)
        elif isinstance(action, AskTrainer):
            self.spawn(self._ask_sync(action.after), "sync request")
        elif isinstance(action, Install):
            await self._install_version(action.manifest)
        elif isinstance(action, Stop):
            raise LocalProtocolError(action.reason)

    async def _fetch(self, sm: SignedManifest) -> None:
        spec = ObjectSpec.from_manifest(sm)
        now = self.clock.now()
        if not spec.chunk_ids or (sm.manifest.kind == "keyframe"
                                  and await self._local_matches(sm)):
            if spec.chunk_ids:
                self._serve_state(sm)
            self.follower.fetched(sm, now)
            return
        if not self.driver.has_object(spec.obj):
            self.driver.add_object(spec, await self._stored(spec))

        async def watch() -> None:
            await self.driver.wait_complete(spec.obj)
            self.follower.fetched(sm, self.clock.now())
            self._wake.set()

        self._fetches[spec.obj] = (sm, now, self.spawn(watch(), "fetch watcher"))

    def _end_fetch(self, sm: SignedManifest, *, drop: bool) -> None:
        fetch = self._fetches.pop(sm.id, None)
        if fetch is not None and fetch[2] is not None:
            fetch[2].cancel()
        if drop and sm.id not in self._views_served:
            self.driver.drop({sm.id})

    async def _install_version(self, sm: SignedManifest) -> None:
        fetch = self._fetches.get(sm.id)
        t0 = fetch[1] if fetch is not None else self.clock.now()
        fetched = self.clock.now() - t0
        spec = ObjectSpec.from_manifest(sm)
        try:
            changed, verified_at = await self._install(sm, spec)
        except SwarmError as exc:
            self.verify_failures += 1
            log.error("step %d failed verification: %s", sm.manifest.step, exc)
            self._status("verify_failed", {"version": sm.manifest.step, "error": str(exc)})
            # Content that is wrong however often it is fetched: never again.
            bad = isinstance(exc, RemoteProtocolError)
            self._end_fetch(sm, drop=bad)
            self.follower.install_failed(sm, bad_content=bad, version=self.version,
                                         root=self.root, now=self.clock.now())
            self._update_ready()
            return
        self._end_fetch(sm, drop=False)
        assert self.root is not None
        self.follower.installed(sm, self.root, self.clock.now())
        self.verified += 1
        self._installed.append(sm)
        self._update_ready()
        # Keep serving the last few versions to laggards; free older chunks.
        keep = {m.id for m in self._installed} | {m.id for m in self.follower.pending()}
        self.driver.retain(keep | self._views_served | set(self._fetches))
        self._status("verified", {
            "version": self.version, "kind": sm.manifest.kind,
            "bytes": sm.manifest.total_bytes, "fetch_s": round(fetched, 3),
            "sync_s": round(verified_at - t0, 3),
            "installed_s": round(self.clock.now() - t0, 3), "tensors": len(changed),
            "written": self._written,
            "bytes_up": self.driver.exchange.bytes_up,
            "bytes_down": self.driver.exchange.bytes_down,
            # bytes from the trainer (and the hosts seeding for it) over their current
            # connections (the CLI's progress line)
            "bytes_from_trainer": sum(self.driver.exchange.bytes_from(p) for p in
                                      {self.config.trainer, *self.discovery.seeders}),
            # bytes from each connected peer (at most 32), over their current connections
            "bytes_by_peer": dict(sorted(
                ((p, self.driver.exchange.bytes_from(p)) for p in self.net.connected_peers()),
                key=lambda kv: -kv[1])[:32]),
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

        Returns the changed tensor names and when verification finished (``clock.now``).
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
            # Decoding and patching run off the event loop: the exchange keeps serving
            # and the engine keeps generating meanwhile.
            if sm.manifest.kind == "keyframe":
                def fill() -> bytes:
                    for i, data in enumerate(chunks):
                        filler.put_piece(i, data)
                    return filler.finish()

                root = await asyncio.to_thread(fill)
                changed = frozenset(self.state)
                # Serve the pieces from the state from now on; free the received copy.
                del chunks
                ex.replace_data(spec.obj, piece_views(self.state, sm.manifest.piece_size))
                self._views_served.add(spec.obj)
            else:
                def patch() -> None:
                    for cid, data in zip(spec.chunk_ids, chunks, strict=True):
                        patcher.apply(cid, data)

                try:
                    await asyncio.to_thread(patch)
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
                self.follower.state_lost(self.clock.now())
            self._writing = False

    async def _take_version(self, sm: SignedManifest, root: bytes, changed: frozenset[str]
                            ) -> tuple[frozenset[str], float]:
        """The canonical state now holds version ``sm``: update the engine at a rollout
        boundary, then save."""
        verified_at = self.clock.now()
        async with self._engine_lock:
            if changed:
                try:
                    await asyncio.to_thread(self.engine.apply,
                                            {n: self.state[n] for n in changed})
                except SwarmError as exc:  # the engine's fault, not the version's: fatal
                    raise RuntimeError(f"the engine could not take step "
                                       f"{sm.manifest.step}: {exc}") from exc
            self.version, self.root = sm.manifest.step, root
        self.work.installed.set()
        # a stop while the verified version is being written waits for the write: a
        # restart then resumes at this version rather than fetching it again
        save = asyncio.ensure_future(self._save(sm))
        try:
            await asyncio.shield(save)
        except asyncio.CancelledError:
            await save
            raise
        async with self._version_changed:
            self._version_changed.notify_all()
        return changed, verified_at

    async def wait_version(self, version: int) -> None:
        """Return once this peer has installed and verified ``version`` (or a later one).

        :raises NodeFailed: the peer stopped first.
        """
        async def reached() -> None:
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: self.version >= version)

        await self.wait(reached())
