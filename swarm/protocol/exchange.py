"""The chunk exchange: a sans-IO BitTorrent-style core.

One :class:`Exchange` per node. The caller does all I/O and keeps time:

- :meth:`Exchange.connect` / :meth:`Exchange.disconnect` when a neighbour comes or goes;
- :meth:`Exchange.receive` (or :meth:`Exchange.receive_bytes`) for each inbound message;
- :meth:`Exchange.handle_timer` at :meth:`Exchange.next_timer`;
- then it drains :meth:`Exchange.take_outgoing` (control messages to send),
  :meth:`Exchange.take_upload_ready` (neighbours with pieces queued for them: call
  :meth:`Exchange.next_upload` whenever the connection to one can take another piece, so
  a cancel can still withdraw a piece not yet on the wire; with several waiting, feed
  the one of lowest :meth:`Exchange.upload_priority` first) and
  :meth:`Exchange.take_events` (stored chunks, completed objects, bans, time-outs).

What it does: rarest-first picking with a strict endgame; requests pipelined to each
neighbour's measured bandwidth-delay product; sources chosen near and fast first (same
region, then the estimated delivery time), with cross-region imports spread over the
region by rendezvous rank and the trainer as source of last resort; upload slots with
choke/unchoke and an optimistic unchoke; super-seeding on the trainer; a neighbour that
serves a chunk whose BLAKE3 id does not match is banned and its requests go elsewhere; a
neighbour that stops answering times out and, after a few strikes, is dropped.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from swarm.content.ids import chunk_id
from swarm.content.manifest import SignedManifest
from swarm.errors import LocalProtocolError, RemoteProtocolError
from swarm.protocol import picker
from swarm.protocol.exchange_msgs import (
    Bitfield,
    Cancel,
    Choke,
    Have,
    Message,
    Piece,
    Reject,
    Request,
    Suggest,
    Unchoke,
    bits_of,
    decode,
    indices_of,
)

log = logging.getLogger(__name__)

Chunk = bytes | memoryview
"""A chunk held for serving: received bytes, or a read-only view of a state held here."""
Verifier = Callable[[bytes, Chunk], bool]

#: Objects not (yet) known here whose haves one neighbour may make us remember.
MAX_UNKNOWN_OBJECTS = 8


def blake3_verifier(cid: bytes, data: Chunk) -> bool:
    """The default check: the BLAKE3 digest of ``data`` is ``cid``."""
    return chunk_id(data) == cid


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """One object to exchange: a delta's chunks, or a state's pieces (for catch-up)."""

    obj: bytes  #: 32-byte object id (the signed manifest id, for example)
    chunk_ids: tuple[bytes, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.obj) != 32 or len(self.chunk_ids) != len(self.sizes):
            raise ValueError("object id is 32 bytes; one size per chunk id")

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @classmethod
    def from_manifest(cls, signed: SignedManifest) -> ObjectSpec:
        m = signed.manifest
        return cls(signed.id, tuple(c for c, _ in m.chunks), tuple(s for _, s in m.chunks))


@dataclass(frozen=True, slots=True)
class ExchangeConfig:
    """Tuning of one node's exchange. Times in seconds, rates in bytes per second."""

    upload_slots: int = 8
    """Neighbours unchoked at once (including the optimistic one)."""
    remote_slots: int = 3
    """Of ``upload_slots``, at most this many go to neighbours in other regions (the
    in-region spread needs the rest)."""
    unchoke_all: bool = False
    """Serve every neighbour (the trainer: its load is governed by super-seeding)."""
    rechoke_interval: float = 0.5
    """How often the unchoke set is re-ranked."""
    optimistic_every: int = 3
    """Rotate the optimistic unchoke every this many re-rankings."""
    min_pipeline: int = 2
    """Fewest requests kept in flight to a neighbour that has what we need."""
    max_pipeline: int = 16
    """Most requests in flight to one neighbour."""
    max_inflight_bytes: int = 64 << 20
    """Bound on requested-but-not-received bytes over all neighbours."""
    download_rate: float = 100e6
    """This node's download capacity, as far as it knows; sizes the in-flight window."""
    upload_rate: float = 0.0
    """This node's upload capacity as it advertises it (0: unknown); weighs its share of
    imports into its region (neighbours pass theirs to :meth:`Exchange.connect`)."""
    inflight_window: float = 0.25
    """Seconds of ``download_rate`` kept requested (at least four chunks)."""
    initial_rate: float = 20e6
    """Assumed rate of a neighbour before any piece from it was timed."""
    rate_alpha: float = 0.3
    """Weight of the newest sample in the per-neighbour rate average."""
    request_timeout: float = 3.0
    """Least time to wait for a requested piece (longer when the pipeline is deep)."""
    max_strikes: int = 3
    """Time-outs after which a neighbour is dropped (the driver may find a replacement)."""
    max_queue: int = 64
    """Requests queued from one neighbour; more are rejected."""
    import_delay: float = 0.15
    """Extra wait per import rank before fetching a chunk from another region."""
    last_resort_delay: float = 1.0
    """How long the swarm must make no progress on an object before a chunk that nobody
    else offers is asked of the trainer."""
    super_seed: bool = False
    """Hand each neighbour chunks few others hold (the trainer)."""
    suggest_depth: int = 1
    """Super-seeding: suggestions outstanding per neighbour."""
    suggest_total: int = 32
    """Super-seeding: suggestions outstanding over all neighbours (about the uplink's
    bandwidth-delay product in chunks)."""
    super_seed_budget: float = 1.2
    """Super-seeding: stop re-suggesting held chunks once uploads reach this many payloads."""
    max_endgame_dups: int = 2
    """Endgame: at most this many sources asked for one chunk at once."""
    endgame_late: float = 2.0
    """Endgame: a request is late after this many times its expected delivery time."""


# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class ChunkStored:
    """A chunk arrived and verified; ``data`` is ready to persist or patch."""

    obj: bytes
    index: int
    data: bytes
    source: str


@dataclass(frozen=True, slots=True)
class ObjectComplete:
    """Every chunk of ``obj`` is held."""

    obj: bytes
    at: float


@dataclass(frozen=True, slots=True)
class PeerBanned:
    """A neighbour misbehaved (bad chunk, malformed message); drop and never re-admit it."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class PeerTimedOut:
    """A neighbour stopped answering; it was dropped and may be replaced."""

    peer: str


Event = ChunkStored | ObjectComplete | PeerBanned | PeerTimedOut


# ---------------------------------------------------------------- state


@dataclass(slots=True)
class _Obj:
    spec: ObjectSpec
    added_at: float
    have: set[int]
    data: dict[int, Chunk]
    availability: list[int]
    local: list[int]
    holders: list[set[str]]
    inflight: dict[int, dict[str, float]] = field(default_factory=dict)
    first_seen: dict[int, float] = field(default_factory=dict)
    suggested: set[int] = field(default_factory=set)
    ranks: dict[int, int] = field(default_factory=dict)
    importers: dict[tuple[str, int], int | None] = field(default_factory=dict)
    complete_at: float | None = None
    avg_size: int = 1
    last_progress: float = 0.0
    last_chunk: float = 0.0
    # super-seeding (trainer side): times each chunk was suggested, suggestions pending
    times_suggested: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    tiebreaks: list[int] = field(default_factory=list)
    """``picker.tiebreak(salt, i)`` of every chunk ``i`` (fixed per node and object)."""

    @property
    def missing(self) -> int:
        return len(self.spec.sizes) - len(self.have)


@dataclass(slots=True)
class _Peer:
    peer: str
    region: str
    rtt: float
    trainer: bool
    rate: float
    haves: dict[bytes, set[int]] = field(default_factory=dict)
    choked_us: bool = True
    we_choke: bool = True
    optimistic: bool = False
    out: dict[tuple[bytes, int], float] = field(default_factory=dict)
    queue: deque[tuple[bytes, int]] = field(default_factory=deque)
    suggested_to: dict[bytes, set[int]] = field(default_factory=dict)
    last_arrival: float = 0.0
    got_recent: int = 0
    sent_recent: int = 0
    bytes_from: int = 0
    bytes_to: int = 0
    strikes: int = 0
    key: int = 0
    tie: int = 0
    """``key`` mixed with our salt: breaks ties between equal delivery estimates."""
    depth: int = 2
    upload: float = 0.0
    download: float = 0.0


class Exchange:
    """One node's chunk exchange. See the module docstring for the calling protocol."""

    def __init__(self, me: str, *, region: str = "", config: ExchangeConfig | None = None,
                 seed: int = 0, now: float = 0.0, verifier: Verifier = blake3_verifier
                 ) -> None:
        self.me = me
        self.region = region
        self.config = config or ExchangeConfig()
        self._rng = random.Random(seed)
        self._salt = self._rng.getrandbits(32)
        self._key = picker.peer_key(me)
        self._verify = verifier
        self._objects: dict[bytes, _Obj] = {}
        self._peers: dict[str, _Peer] = {}
        self._banned: set[str] = set()
        self._out: list[tuple[str, Message]] = []
        self._ready: set[str] = set()
        self._events: list[Event] = []
        self._next_rechoke = now + self.config.rechoke_interval
        self._rechokes = 0
        self._wake: float | None = None
        self._timer_earlier = False  # see pending()
        # (earliest possible deadline, sent time, peer, obj, index) of requests in flight
        self._deadlines: list[tuple[float, float, str, bytes, int]] = []
        self._avg = 1
        self._locals: list[str] | None = None  # same-region neighbours, see _local_peers
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_wasted = 0
        self.bans: list[tuple[str, str]] = []

    # ------------------------------------------------------------ public API

    @property
    def neighbours(self) -> frozenset[str]:
        return frozenset(self._peers)

    @property
    def banned(self) -> frozenset[str]:
        return frozenset(self._banned)

    def has(self, obj: bytes, index: int) -> bool:
        o = self._objects.get(obj)
        return o is not None and index in o.have

    def chunk(self, obj: bytes, index: int) -> Chunk | None:
        o = self._objects.get(obj)
        return None if o is None else o.data.get(index)

    def is_complete(self, obj: bytes) -> bool:
        o = self._objects.get(obj)
        return o is not None and o.complete_at is not None

    def idle(self, obj: bytes, now: float) -> float:
        """Seconds since a chunk of ``obj`` last arrived (or since it was added)."""
        return now - self._objects[obj].last_chunk

    def progress(self, obj: bytes) -> tuple[int, int]:
        """(chunks held, chunks total) of ``obj``."""
        o = self._objects[obj]
        return len(o.have), len(o.spec.sizes)

    def add_object(self, spec: ObjectSpec, now: float,
                   data: Mapping[int, Chunk] | None = None) -> None:
        """Start exchanging ``spec``; ``data`` holds chunks already at hand (trusted)."""
        if spec.obj in self._objects:
            raise LocalProtocolError("object already added")
        n = len(spec.sizes)
        o = _Obj(spec, now, set(), {}, [0] * n, [0] * n, [set() for _ in range(n)],
                 times_suggested=[0] * n, pending=[0] * n, last_progress=now, last_chunk=now,
                 avg_size=max(1, spec.total_bytes // max(1, n)),
                 tiebreaks=[picker.tiebreak(self._salt, i) for i in range(n)])
        for i, d in (data or {}).items():
            if not 0 <= i < n or len(d) != spec.sizes[i]:
                raise LocalProtocolError(f"chunk {i} does not fit the object")
            o.have.add(i)
            o.data[i] = d
        if not o.missing:
            o.complete_at = now
        self._objects[spec.obj] = o
        self._avg = max(x.avg_size for x in self._objects.values())
        for q in self._peers.values():
            self._set_rate(q, q.rate)
        for p in self._peers.values():
            self._send_bitfield(p, o)
            for idx in p.haves.get(spec.obj, ()):
                self._add_holder(o, idx, p, now)
        self._update_interest(now)
        self._pick(now)
        self._super_seed(now)

    def connect(self, peer: str, now: float, *, region: str = "", rtt: float = 0.05,
                trainer: bool = False, upload: float = 0.0, download: float = 0.0) -> None:
        """A neighbour is reachable; exchange bitfields. ``region``, ``upload`` and
        ``download`` (bytes per second, 0 if unknown) are what it advertises in its peer
        metadata."""
        if peer in self._banned or peer in self._peers or peer == self.me:
            return
        p = _Peer(peer, region, max(rtt, 1e-4), trainer, self.config.initial_rate,
                  key=picker.peer_key(peer), upload=max(0.0, upload),
                  download=max(0.0, download))
        p.tie = (p.key ^ self._salt) * 0x9E3779B1 & 0xFFFFFFFF
        self._peers[peer] = p
        self._locals = None
        self._set_rate(p, p.rate)
        for ob in self._objects.values():
            ob.importers.clear()
            if self._is_local(p):
                ob.ranks.clear()
        for o in self._objects.values():
            self._send_bitfield(p, o)
        if self.config.unchoke_all:
            p.we_choke = False
            self._out.append((peer, Unchoke()))
        self._update_interest(now)

    def disconnect(self, peer: str, now: float) -> None:
        """A neighbour is gone; its requests go elsewhere."""
        p = self._peers.pop(peer, None)
        if p is None:
            return
        self._locals = None
        for ob in self._objects.values():
            ob.importers.clear()
            if self._is_local(p):
                ob.ranks.clear()
        self._ready.discard(peer)
        for obj, idxs in p.haves.items():
            o = self._objects.get(obj)
            if o is None:
                continue
            for idx in idxs:
                o.holders[idx].discard(peer)
                o.availability[idx] -= 1
                if self._is_local(p):
                    o.local[idx] -= 1
        for obj, idx in p.out:
            o = self._objects.get(obj)
            if o is not None:
                self._drop_inflight(o, idx, peer)
        for obj, idxs in p.suggested_to.items():
            o = self._objects.get(obj)
            if o is not None:
                for idx in idxs:
                    o.pending[idx] -= 1
        self._update_interest(now)
        self._pick(now)
        self._super_seed(now)

    def receive_bytes(self, peer: str, data: bytes, now: float) -> None:
        """Decode and handle one message; a malformed one bans its sender."""
        try:
            msg = decode(data)
        except RemoteProtocolError as exc:
            self._ban(peer, f"malformed message: {exc}", now)
            return
        self.receive(peer, msg, now)

    def receive(self, peer: str, msg: Message, now: float) -> None:
        """Handle one message from a connected neighbour."""
        p = self._peers.get(peer)
        if p is None:
            return
        try:
            self._dispatch(p, msg, now)
        except RemoteProtocolError as exc:
            self._ban(peer, str(exc), now)

    def _live_deadline(self, entry: tuple[float, float, str, bytes, int]) -> bool:
        _, sent, peer, obj, idx = entry
        p = self._peers.get(peer)
        return p is not None and p.out.get((obj, idx)) == sent

    def pending(self) -> bool:
        """Whether the last calls may have left work for the driver: messages, upload-ready
        neighbours or events to take, or a timer earlier than :meth:`next_timer` said when
        last asked. (A driver that calls everything after every input needs no such check;
        a simulator delivering a million small messages saves most of that work.)"""
        return bool(self._out or self._ready or self._events or self._timer_earlier)

    def next_timer(self) -> float | None:
        """When :meth:`handle_timer` should next run."""
        self._timer_earlier = False
        t = self._next_rechoke
        dl = self._deadlines
        while dl and not self._live_deadline(dl[0]):
            heapq.heappop(dl)
        if dl and dl[0][0] < t:
            t = dl[0][0]
        wake = self._wake
        if wake is not None and wake < t:
            t = wake
        return t

    def handle_timer(self, now: float) -> None:
        late: dict[str, list[tuple[bytes, int]]] = {}
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            entry = heapq.heappop(dl)
            if not self._live_deadline(entry):
                continue
            _, sent, peer, obj, idx = entry
            limit = sent + self._timeout(self._peers[peer])
            if now >= limit:
                late.setdefault(peer, []).append((obj, idx))
            else:
                heapq.heappush(dl, (limit, sent, peer, obj, idx))
        for peer, expired in late.items():
            p = self._peers.get(peer)
            if p is None:
                continue
            for obj, idx in expired:
                del p.out[(obj, idx)]
                self._out.append((p.peer, Cancel(obj, idx)))
                o = self._objects.get(obj)
                if o is not None:
                    self._drop_inflight(o, idx, p.peer)
            p.strikes += 1
            self._set_rate(p, p.rate / 2)
            if p.strikes >= self.config.max_strikes:
                log.info("%s: neighbour %s timed out", self.me, p.peer)
                self._events.append(PeerTimedOut(p.peer))
                self.disconnect(p.peer, now)
        if now >= self._next_rechoke:
            self._rechoke(now)
            self._next_rechoke = now + self.config.rechoke_interval
        if self._wake is not None and now >= self._wake:
            self._wake = None
        self._pick(now)
        self._super_seed(now)

    def take_outgoing(self) -> list[tuple[str, Message]]:
        out, self._out = self._out, []
        return out

    def take_upload_ready(self) -> set[str]:
        ready, self._ready = self._ready, set()
        return ready

    def replace_data(self, obj: bytes, data: Mapping[int, Chunk]) -> None:
        """Hold the chunks of complete object ``obj`` as ``data`` from now on: the same
        bytes kept elsewhere (views of a state filled from them), so the received copies
        can be freed. Peers' haves and queued uploads are kept."""
        o = self._objects.get(obj)
        if o is None or o.complete_at is None:
            raise LocalProtocolError("only a complete object's chunks can be replaced")
        if set(data) != o.have or any(len(d) != o.spec.sizes[i] for i, d in data.items()):
            raise LocalProtocolError("the replacement chunks do not fit the object")
        o.data = dict(data)

    def take_events(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    def next_upload(self, peer: str, now: float) -> Piece | None:
        """The next piece queued for ``peer``, or ``None``; call when its link is free."""
        p = self._peers.get(peer)
        if p is None:
            return None
        while p.queue:
            obj, idx = p.queue.popleft()
            o = self._objects.get(obj)
            if o is None or idx not in o.have:
                continue
            data = o.data[idx]
            p.bytes_to += len(data)
            p.sent_recent += len(data)
            self.bytes_up += len(data)
            return Piece(obj, idx, data)
        return None

    def upload_priority(self, peer: str) -> int:
        """Which connection a driver should feed first when several have pieces queued:
        the neighbour holding the fewest chunks (lowest value). The most-behind peer
        decides when everybody is done, so it is served first. (Ranking by download time
        left instead, which favours slow links, measured worse: it starves the fast peers
        that spread chunks through their regions.)"""
        p = self._peers.get(peer)
        if p is None:
            return 1 << 62
        return sum(len(p.haves.get(obj, ())) for obj in self._objects)

    def upload_queued(self, peer: str) -> int:
        p = self._peers.get(peer)
        return 0 if p is None else len(p.queue)

    def remove_object(self, obj: bytes) -> None:
        """Stop exchanging ``obj`` and free its chunks (a version nobody needs any more).

        Requests for it in flight are forgotten; pieces of it queued for upload are not
        sent; later messages about it are treated like those about any unknown object.
        """
        if self._objects.pop(obj, None) is None:
            return
        for p in self._peers.values():
            p.haves.pop(obj, None)
            p.suggested_to.pop(obj, None)
            for key in [k for k in p.out if k[0] == obj]:
                del p.out[key]
            if any(o == obj for o, _ in p.queue):
                p.queue = deque(item for item in p.queue if item[0] != obj)
        self._avg = max((x.avg_size for x in self._objects.values()), default=1)

    def _may_track(self, p: _Peer, obj: bytes) -> bool:
        """Whether to remember a neighbour's haves of an object we do not exchange (yet):
        its manifest may still be on its way, but a neighbour cannot make us remember
        more than :data:`MAX_UNKNOWN_OBJECTS` such objects."""
        if obj in p.haves:
            return True
        unknown = sum(1 for x in p.haves if x not in self._objects)
        return unknown < MAX_UNKNOWN_OBJECTS

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, p: _Peer, msg: Message, now: float) -> None:
        if isinstance(msg, Have):  # the most frequent message by far
            self._on_have(p, msg, now)
        elif isinstance(msg, Piece):
            self._on_piece(p, msg, now)
        elif isinstance(msg, Bitfield):
            o = self._objects.get(msg.obj)
            if o is not None and msg.count != len(o.spec.sizes):
                raise RemoteProtocolError("bitfield: wrong chunk count")
            if o is None and not self._may_track(p, msg.obj):
                return
            idxs = indices_of(msg.bits, msg.count)
            old = p.haves.get(msg.obj, set())
            p.haves[msg.obj] = old | idxs
            if o is not None:
                for idx in idxs - old:
                    self._add_holder(o, idx, p, now)
                if self.config.super_seed:
                    self._suggest_to(p, o)
            self._update_interest(now)
            self._pick(now)
        elif isinstance(msg, Request):
            self._on_request(p, msg, now)
        elif isinstance(msg, Cancel):
            with contextlib.suppress(ValueError):
                p.queue.remove((msg.obj, msg.index))
        elif isinstance(msg, Reject):
            key = (msg.obj, msg.index)
            if key in p.out:
                del p.out[key]
                o = self._objects.get(msg.obj)
                if o is not None:
                    self._drop_inflight(o, msg.index, p.peer)
                    if not p.trainer:
                        self._drop_holder(o, msg.index, p)
                self._pick(now)
        elif isinstance(msg, Suggest):
            o = self._objects.get(msg.obj)
            if o is not None:
                self._check_index(o, msg.index)
                if msg.index not in o.have:
                    o.suggested.add(msg.index)
                    self._pick(now)
        elif isinstance(msg, Choke):
            # no new requests to p; it rejects those it had queued (each Reject frees the
            # chunk for another source) and the piece already on the wire still arrives
            p.choked_us = True
        elif isinstance(msg, Unchoke):
            p.choked_us = False
            self._pick(now)

    def _on_have(self, p: _Peer, msg: Have, now: float) -> None:
        obj, idx = msg.obj, msg.index
        o = self._objects.get(obj)
        if o is not None:
            if idx >= len(o.spec.sizes):  # _check_index, inlined: haves are most messages
                raise RemoteProtocolError("chunk index past the object's end")
        elif not self._may_track(p, obj):
            return
        s = p.haves.get(obj)
        if s is None:
            s = p.haves[obj] = set()
        elif idx in s:
            return
        s.add(idx)
        if o is None:
            return
        holders = o.holders[idx]
        if p.peer not in holders:  # _add_holder, inlined
            holders.add(p.peer)
            o.availability[idx] += 1
            if not p.trainer:
                if p.region == self.region:
                    o.local[idx] += 1
                o.first_seen.setdefault(idx, now)
                o.last_progress = now
        if (o.complete_at is None and not p.trainer and idx not in o.have
                and idx not in o.inflight):
            self._pick_one(o, idx, p, now)
        if self.config.super_seed:
            self._suggest_to(p, o)

    @staticmethod
    def _check_index(o: _Obj, index: int) -> None:
        if index >= len(o.spec.sizes):
            raise RemoteProtocolError("chunk index past the object's end")

    def _on_request(self, p: _Peer, msg: Request, now: float) -> None:
        o = self._objects.get(msg.obj)
        if (o is None or msg.index not in o.have or p.we_choke
                or len(p.queue) >= self.config.max_queue):
            self._out.append((p.peer, Reject(msg.obj, msg.index)))
            return
        if (msg.obj, msg.index) in p.queue:
            return
        p.queue.append((msg.obj, msg.index))
        self._ready.add(p.peer)

    def _on_piece(self, p: _Peer, msg: Piece, now: float) -> None:
        o = self._objects.get(msg.obj)
        key = (msg.obj, msg.index)
        requested = p.out.pop(key, None)
        if o is None or msg.index >= len(o.spec.sizes):
            raise RemoteProtocolError("piece of an unknown object or index")
        cid, size = o.spec.chunk_ids[msg.index], o.spec.sizes[msg.index]
        if len(msg.data) != size or not self._verify(cid, msg.data):
            self._drop_inflight(o, msg.index, p.peer)
            self._ban(p.peer, f"chunk {msg.index} does not match its BLAKE3 id", now)
            return
        self.bytes_down += size
        p.bytes_from += size
        p.got_recent += size
        p.strikes = 0
        start = max(requested if requested is not None else now, p.last_arrival)
        p.last_arrival = now
        if now > start:
            sample = size / (now - start)
            self._set_rate(p, p.rate + self.config.rate_alpha * (sample - p.rate))
        if msg.index in o.have:
            self.bytes_wasted += size
            self._drop_inflight(o, msg.index, p.peer)
            self._pick(now)
            return
        o.have.add(msg.index)
        data = o.data[msg.index] = bytes(msg.data)  # received: bytes already, not copied
        o.last_progress = o.last_chunk = now
        o.suggested.discard(msg.index)
        for other in o.inflight.pop(msg.index, {}):
            if other != p.peer:
                q = self._peers.get(other)
                if q is not None and q.out.pop(key, None) is not None:
                    self._out.append((other, Cancel(msg.obj, msg.index)))
        have = Have(msg.obj, msg.index)
        self._out.extend((q, have) for q in self._peers)
        self._events.append(ChunkStored(msg.obj, msg.index, data, p.peer))
        if not o.missing:
            o.complete_at = now
            self._events.append(ObjectComplete(msg.obj, now))
            log.debug("%s: object %s complete at %.3f", self.me[:8], msg.obj.hex()[:8], now)
        self._update_interest(now)
        self._pick(now)

    def _ban(self, peer: str, reason: str, now: float) -> None:
        if peer in self._banned:
            return
        log.warning("%s: banning %s: %s", self.me, peer, reason)
        self._banned.add(peer)
        self.bans.append((peer, reason))
        self._events.append(PeerBanned(peer, reason))
        self.disconnect(peer, now)

    # ------------------------------------------------------------ bookkeeping

    def _send_bitfield(self, p: _Peer, o: _Obj) -> None:
        n = len(o.spec.sizes)
        self._out.append((p.peer, Bitfield(o.spec.obj, n, bits_of(o.have, n))))

    def _add_holder(self, o: _Obj, idx: int, p: _Peer, now: float) -> None:
        holders = o.holders[idx]
        if p.peer in holders:
            return
        holders.add(p.peer)
        o.availability[idx] += 1
        if p.region == self.region and not p.trainer:  # _is_local
            o.local[idx] += 1
        if not p.trainer:
            o.first_seen.setdefault(idx, now)
            o.last_progress = now

    def _drop_holder(self, o: _Obj, idx: int, p: _Peer) -> None:
        """``p`` refused a chunk it announced (it dropped the object, say: a peer stops
        serving a keyframe of its state before patching it): ask others, or the trainer,
        until ``p`` announces the chunk again. Without this a peer kept asking a neighbour
        that refuses, and never the trainer, while that neighbour counted as a holder."""
        if p.peer not in o.holders[idx]:
            return
        o.holders[idx].discard(p.peer)
        o.availability[idx] -= 1
        if self._is_local(p):
            o.local[idx] -= 1
        theirs = p.haves.get(o.spec.obj)
        if theirs is not None:
            theirs.discard(idx)
        o.ranks.pop(idx, None)

    def _is_local(self, p: _Peer) -> bool:
        return p.region == self.region and not p.trainer

    def _drop_inflight(self, o: _Obj, idx: int, peer: str) -> None:
        srcs = o.inflight.get(idx)
        if srcs is not None:
            srcs.pop(peer, None)
            if not srcs:
                del o.inflight[idx]

    def _timeout(self, p: _Peer) -> float:
        expect = p.rtt + (len(p.out) + 1) * self._avg / max(p.rate, 1.0)
        return max(self.config.request_timeout, 4.0 * expect)

    def _inflight_bytes(self) -> int:
        total = 0
        for o in self._objects.values():
            total += len(o.inflight) * o.avg_size
        return total

    # ------------------------------------------------------------ download side

    def _room(self, p: _Peer) -> int:
        """Requests we may still send to ``p`` (its pipeline depth less those in flight)."""
        return 0 if p.choked_us else p.depth - len(p.out)

    def _set_rate(self, p: _Peer, rate: float) -> None:
        p.rate = rate
        p.depth = picker.pipeline_depth(rate, p.rtt, self._avg, self.config.min_pipeline,
                                        self.config.max_pipeline)

    def _budget(self) -> int:
        """Bytes we may still request: the in-flight window less what is in flight."""
        cfg = self.config
        window = min(cfg.max_inflight_bytes,
                     max(4 * self._avg, int(cfg.download_rate * cfg.inflight_window)))
        return window - self._inflight_bytes()

    def _local_peers(self) -> list[str]:
        """Same-region neighbours other than the trainer (cached until one comes or goes;
        callers must not modify the list)."""
        if self._locals is None:
            self._locals = [p.peer for p in self._peers.values()
                            if p.region == self.region and not p.trainer]
        return self._locals

    def _pick_one(self, o: _Obj, idx: int, p: _Peer, now: float) -> None:
        """``p`` announced ``idx``: request it if ``p`` can take a request and budget is
        left (a busy ``p`` is reconsidered by the next full pick, when a slot frees)."""
        if o.complete_at is not None or p.trainer or self._room(p) <= 0:
            return
        if self._budget() <= 0:
            return
        src = self._choose_source(o, idx, self._local_peers(), now, ())
        if src is not None:
            self._request(o, idx, src, now)

    def _pick(self, now: float) -> None:
        """Issue requests, rarest first, until the in-flight window is full."""
        cfg = self.config
        roomy = {p.peer for p in self._peers.values()
                 if not p.choked_us and p.depth > len(p.out)}  # _room(p) > 0
        if not roomy:
            return
        peers, region, import_delay = self._peers, self.region, cfg.import_delay
        roomy_local = {h for h in roomy if peers[h].region == region and not peers[h].trainer}
        local_peers = self._local_peers()
        for o in self._objects.values():
            # super-seeded chunks go first and outside the window: they are few, and
            # the trainer's upload must not wait on a busy downloader
            for idx in sorted(o.suggested):
                if idx not in o.have and idx not in o.inflight:
                    src = self._choose_source(o, idx, local_peers, now, ())
                    if src is not None:
                        self._request(o, idx, src, now)
        budget = self._budget()
        if budget <= 0:
            return
        for o in self._objects.values():
            if o.complete_at is not None:
                continue
            wanted = [i for i in range(len(o.spec.sizes))
                      if i not in o.have and i not in o.inflight]
            # only chunks some neighbour with a free slot holds can be asked for now
            # (the others wait for a slot: a piece arrival or a reject calls this again)
            ready = [i for i in wanted if not o.holders[i].isdisjoint(roomy)]
            order = picker.rarest_first(ready, o.local, o.availability, self._salt,
                                        o.suggested, o.tiebreaks)
            for idx in order:
                if budget <= 0 or not roomy:
                    return
                holders = o.holders[idx]
                if holders.isdisjoint(roomy):
                    continue
                if idx not in o.suggested:
                    # shortcuts where _choose_source would return None with no effect
                    if o.local[idx]:
                        if holders.isdisjoint(roomy_local):
                            continue  # in the region, every holder here busy: wait
                    else:
                        rank = o.ranks.get(idx)
                        if rank is not None:
                            # an import whose turn comes at ``early`` or later, with a
                            # wake-up already set no later than that
                            early = o.first_seen.get(idx, o.added_at) + rank * import_delay
                            wake = self._wake
                            if now < early and wake is not None and wake <= early:
                                continue
                src = self._choose_source(o, idx, local_peers, now, ())
                if src is not None:
                    self._request(o, idx, src, now)
                    budget -= o.spec.sizes[idx]
                    if self._room(self._peers[src]) <= 0:
                        roomy.discard(src)
                        roomy_local.discard(src)
            if wanted or not o.inflight:
                continue
            # strict endgame: every missing chunk is requested; ask a second source for
            # those whose source is late (cancelled at the other when one arrives)
            for idx in sorted(o.inflight, key=o.tiebreaks.__getitem__):
                if budget <= 0:
                    return
                asked = o.inflight[idx]
                if len(asked) >= cfg.max_endgame_dups:
                    continue
                late_at = min(sent + cfg.endgame_late * self._eta(self._peers[q], self._avg)
                              for q, sent in asked.items())
                if now < late_at:
                    self._set_wake(late_at)
                    continue
                src = self._choose_source(o, idx, local_peers, now, tuple(asked))
                if src is not None:
                    self._request(o, idx, src, now)
                    budget -= o.spec.sizes[idx]

    def _request(self, o: _Obj, idx: int, src: str, now: float) -> None:
        p = self._peers[src]
        p.out[(o.spec.obj, idx)] = now
        heapq.heappush(self._deadlines, (now + self.config.request_timeout, now, src,
                                         o.spec.obj, idx))
        o.inflight.setdefault(idx, {})[src] = now
        self._out.append((src, Request(o.spec.obj, idx)))

    def _eta(self, p: _Peer, size: int) -> float:
        return p.rtt + (len(p.out) + 1) * size / max(p.rate, 1.0)

    def _choose_source(self, o: _Obj, idx: int, local_peers: list[str], now: float,
                       exclude: tuple[str, ...]) -> str | None:
        """The best free holder of ``idx``: a same-region peer by estimated delivery time;
        else, when my import rank's turn has come, a peer in another region; the trainer
        only for chunks it suggested to me, or when the swarm has stalled without them."""
        cfg = self.config
        size = o.spec.sizes[idx]
        peers, region = self._peers, self.region
        best_local: _Peer | None = None
        best_remote: _Peer | None = None
        local_key = remote_key = (float("inf"), 0, "")
        trainer: _Peer | None = None
        any_local = any_other = False
        for h in o.holders[idx]:
            p = peers[h]
            # usable: not excluded and room for a request (see _room)
            usable = not p.choked_us and p.depth > len(p.out) and h not in exclude
            if p.trainer:
                if usable:
                    if idx in o.suggested:
                        return h
                    trainer = p
                continue
            any_other = True
            is_local = p.region == region
            if not usable:
                any_local = any_local or is_local
                continue
            if is_local:
                any_local = True
            elif best_local is not None:
                continue  # a local source wins over any remote one
            # ties (equal estimates) go by a per-node hash: deterministic, and spread
            key = (p.rtt + (len(p.out) + 1) * size / max(p.rate, 1.0), p.tie, h)
            if is_local:
                if key < local_key:
                    best_local, local_key = p, key
            elif key < remote_key:
                best_remote, remote_key = p, key
        if best_local is not None:
            return best_local.peer
        if any_local:
            return None  # it is in the region already: wait for a local source to free up
        if best_remote is None and (trainer is None or any_other):
            return None
        # an import into the region: rendezvous rank decides who goes first
        rank = o.ranks.get(idx)
        if rank is None:
            # no local neighbour holds idx here, so this set only changes with neighbours
            lacking = [(self._peers[q].key, self._peers[q].upload or 1.0) for q in local_peers]
            rank = o.ranks[idx] = picker.import_rank(
                (self._key, self.config.upload_rate or 1.0), idx, o.spec.obj, lacking)
        if best_remote is not None:
            # give the previous rank time to ask, queue and receive it
            wait = max(cfg.import_delay,
                       4 * best_remote.rtt + 2 * size / max(best_remote.rate, 1.0))
        else:
            wait = cfg.import_delay
        ready = o.first_seen.get(idx, o.added_at) + rank * wait
        if best_remote is not None:
            if now >= ready:
                return best_remote.peer
            self._set_wake(ready)
            return None
        assert trainer is not None
        ready = max(ready, o.last_progress + cfg.last_resort_delay)
        if now >= ready:
            return trainer.peer
        self._set_wake(ready)
        return None

    def _set_wake(self, t: float) -> None:
        if self._wake is None or t < self._wake:
            self._wake = t
            self._timer_earlier = True

    # ------------------------------------------------------------ upload side

    def _interested(self, p: _Peer) -> bool:
        """Does ``p`` lack something we hold?"""
        for obj, o in self._objects.items():
            theirs = p.haves.get(obj)
            if theirs is None:
                continue  # not announced yet: they do not know the object
            if len(o.have) > len(theirs) or not o.have <= theirs:
                return True
        return False

    def _update_interest(self, now: float) -> None:
        """Fill free upload slots at once (the periodic re-ranking is in _rechoke)."""
        if self.config.unchoke_all:
            return
        unchoked = [p for p in self._peers.values() if not p.we_choke]
        for p in unchoked:
            if not self._interested(p) and not p.queue:
                self._set_choke(p, True)
        used = [p for p in self._peers.values() if not p.we_choke]
        room = self.config.upload_slots - len(used)
        if room <= 0:
            return
        remote_used = sum(1 for p in used if p.region != self.region)
        candidates = [p for p in self._peers.values() if p.we_choke and self._interested(p)]
        self._rng.shuffle(candidates)
        candidates.sort(key=lambda p: -p.got_recent)
        remote_room = max(0, self.config.remote_slots - remote_used)
        for p in candidates:
            if room <= 0:
                break
            if p.region != self.region:
                if remote_room <= 0:
                    continue
                remote_room -= 1
            self._set_choke(p, False)
            room -= 1

    def _set_choke(self, p: _Peer, choke: bool) -> None:
        if p.we_choke == choke:
            return
        p.we_choke = choke
        if choke:
            p.optimistic = False
            self._out.append((p.peer, Choke()))
            for obj, idx in p.queue:
                self._out.append((p.peer, Reject(obj, idx)))
            p.queue.clear()
        else:
            self._out.append((p.peer, Unchoke()))

    def _rechoke(self, now: float) -> None:
        """Re-rank: keep the neighbours that serve us best (or that we serve fastest when
        we hold everything), one optimistic unchoke rotating among the rest."""
        self._rechokes += 1
        if self.config.unchoke_all:
            for p in self._peers.values():
                p.got_recent = p.sent_recent = 0
            return
        seeding = all(o.complete_at is not None for o in self._objects.values())
        interested = [p for p in self._peers.values() if self._interested(p)]
        self._rng.shuffle(interested)
        interested.sort(key=lambda p: -(p.sent_recent if seeding else p.got_recent))
        slots = max(1, self.config.upload_slots - 1)
        remote_cap = self.config.remote_slots
        keep: set[str] = set()
        n_remote = 0
        for p in interested:
            if len(keep) >= slots:
                break
            if p.region != self.region:
                if n_remote >= remote_cap:
                    continue
                n_remote += 1
            keep.add(p.peer)
        rotate = self._rechokes % self.config.optimistic_every == 1
        current_opt = [p for p in self._peers.values() if p.optimistic and not p.we_choke]
        rest = [p for p in interested if p.peer not in keep]
        if current_opt and not rotate and current_opt[0] in rest:
            keep.add(current_opt[0].peer)
        elif rest:
            opt = self._rng.choice(rest)
            keep.add(opt.peer)
            for p in self._peers.values():
                p.optimistic = False
            opt.optimistic = True
        for p in self._peers.values():
            self._set_choke(p, p.peer not in keep)
            p.got_recent = p.sent_recent = 0
        self._update_interest(now)

    def _importer(self, o: _Obj, p: _Peer, idx: int) -> int | None:
        key = (p.region, idx)
        if key not in o.importers:
            members = [(q.key, q.upload or 1.0) for q in self._peers.values()
                       if q.region == p.region and not q.trainer]
            o.importers[key] = picker.importer(idx, o.spec.obj, members)
        return o.importers[key]

    def _super_seed(self, now: float) -> None:
        """Trainer: keep neighbours busy with chunks that few others hold."""
        if not self.config.super_seed:
            return
        for o in self._objects.values():
            if o.missing:
                continue
            peers = list(self._peers.values())
            self._rng.shuffle(peers)
            # far neighbours first: their requests take longest to come back
            peers.sort(key=lambda p: (len(p.suggested_to.get(o.spec.obj, ())), -p.rtt))
            for p in peers:
                if sum(o.pending) >= self.config.suggest_total:
                    break
                self._suggest_to(p, o)

    def _suggest_to(self, p: _Peer, o: _Obj) -> None:
        """Top up ``p``'s suggestions: chunks never handed out first, then (within the
        upload budget) chunks held by at most one neighbour."""
        cfg = self.config
        theirs = p.haves.get(o.spec.obj)
        n = len(o.spec.sizes)
        if o.missing or theirs is None or len(theirs) >= n or p.we_choke:
            return
        outstanding = p.suggested_to.setdefault(o.spec.obj, set())
        for i in outstanding & theirs:
            o.pending[i] -= 1
        outstanding -= theirs
        # one suggestion each at least (far neighbours announce themselves last), more
        # while the total stays under suggest_total
        want = min(cfg.suggest_depth - len(outstanding),
                   max(1 - len(outstanding), cfg.suggest_total - sum(o.pending)))
        if want <= 0:
            return
        owed = self.bytes_up + sum(o.pending) * o.avg_size
        budget_left = owed < cfg.super_seed_budget * o.spec.total_bytes
        # A first copy goes to the peer its region would pick to import the chunk (the
        # rendezvous rank the peers compute), so the trainer's copy doubles as that
        # region's import and no region-mate also fetches it over the WAN.
        fresh = [i for i in range(n) if o.times_suggested[i] == 0 and i not in theirs]
        cands = [i for i in fresh if self._importer(o, p, i) == p.key]
        if not cands and budget_left:
            cands = [i for i in range(n) if i not in theirs and i not in outstanding
                     and o.pending[i] == 0 and o.availability[i] <= 1]
        if not cands and not outstanding:
            cands = fresh  # keep it busy with anything not handed out yet
        cands.sort(key=lambda i: (o.times_suggested[i], o.availability[i],
                                  o.tiebreaks[i]))
        for i in cands[:want]:
            outstanding.add(i)
            o.times_suggested[i] += 1
            o.pending[i] += 1
            self._out.append((p.peer, Suggest(o.spec.obj, i)))
