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
neighbour that stops answering times out and, after a few strikes, is dropped (until it
has delivered, its requests are not withdrawn when another source is faster, so one that
announces and never serves does strike out), the trainer never, however slow its uplink;
one that keeps sending haves of unknown objects past a small allowance is dropped.

The parts: :mod:`~swarm.protocol.exchange_types` (specs, config, events),
:mod:`~swarm.protocol.exchange_state` (per-object and per-neighbour state),
:mod:`~swarm.protocol.exchange_download` (picking, requests, time-outs, endgame, imports)
and :mod:`~swarm.protocol.exchange_upload` (choking, upload queues, super-seeding); this
module holds the calling protocol, message dispatch and the holder bookkeeping.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
from collections import deque
from collections.abc import Mapping

from swarm.errors import LocalProtocolError, RemoteProtocolError
from swarm.protocol import picker
from swarm.protocol.exchange_download import DownloadSide
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
    Want,
    bits_of,
    decode,
    indices_of,
)
from swarm.protocol.exchange_state import ObjectState, PeerState
from swarm.protocol.exchange_types import (
    MAX_OVER_ALLOWANCE,
    MAX_UNKNOWN_BITS,
    MAX_UNKNOWN_OBJECTS,
    Chunk,
    ChunkStored,
    Event,
    ExchangeConfig,
    Importer,
    ImportRank,
    ObjectComplete,
    ObjectSpec,
    PeerBanned,
    PeerDropped,
    PeerPenalized,
    PeerTimedOut,
    Verifier,
    blake3_verifier,
)
from swarm.protocol.exchange_upload import UploadSide

__all__ = [
    "MAX_OVER_ALLOWANCE",
    "MAX_UNKNOWN_BITS",
    "MAX_UNKNOWN_OBJECTS",
    "Chunk",
    "ChunkStored",
    "Event",
    "Exchange",
    "ExchangeConfig",
    "ObjectComplete",
    "ObjectSpec",
    "PeerBanned",
    "PeerDropped",
    "PeerPenalized",
    "PeerTimedOut",
    "Verifier",
    "blake3_verifier",
]

log = logging.getLogger(__name__)


class Exchange(DownloadSide, UploadSide):
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
        self._objects: dict[bytes, ObjectState] = {}
        self._peers: dict[str, PeerState] = {}
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
        self._slow_locals: frozenset[str] = frozenset()
        self._remotes: list[PeerState] = []
        self._slowest: frozenset[str] = frozenset()
        self._import_s = 0.0
        self._keys: dict[int, PeerState] | None = None
        self._regions: list[str] = []
        self._unchokers: dict[str, PeerState] = {}
        self._rank_of: ImportRank | None = None
        self._importer_of: Importer | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.bytes_wasted = 0
        self.bans: list[tuple[str, str]] = []

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

    def holders_of(self, obj: bytes) -> frozenset[str]:
        """Neighbours that announced every chunk of ``obj`` (none if it is not exchanged
        or has no chunks)."""
        o = self._objects.get(obj)
        n = 0 if o is None else len(o.spec.sizes)
        if not n:
            return frozenset()
        return frozenset(q for q, p in self._peers.items() if len(p.haves.get(obj, ())) == n)

    def bytes_from(self, peer: str) -> int:
        """Bytes of verified pieces received from ``peer`` over its current connection."""
        p = self._peers.get(peer)
        return 0 if p is None else p.bytes_from

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
        o = ObjectState(spec, now, set(), {}, [0] * n, [0] * n, [set() for _ in range(n)],
                 times_suggested=[0] * n, pending=[0] * n, last_progress=now, last_chunk=now,
                 last_new=now,
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
        self._locals = None  # which region-mates hardly upload depends on _avg
        for q in self._peers.values():
            self._set_rate(q, q.rate)
        for p in self._peers.values():
            self._send_bitfield(p, o)
            theirs = p.haves.get(spec.obj)
            if theirs is None:
                continue
            p.unknown_bits -= len(theirs)
            past = [idx for idx in theirs if idx >= n]
            if past:  # announced before the manifest came, and shown false by it
                theirs.difference_update(past)
                self._penalize(p, f"{len(past)} haves past the end of an object")
            for idx in theirs:
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
        p = PeerState(peer, region, max(rtt, 1e-4), trainer, self._assumed_rate(upload),
                  key=picker.peer_key(peer), upload=max(0.0, upload),
                  download=max(0.0, download))
        p.tie = (p.key ^ self._salt) * 0x9E3779B1 & 0xFFFFFFFF
        p.choked_since = now
        self._peers[peer] = p
        self._locals = None
        self._keys = None
        self._set_rate(p, p.rate)
        for ob in self._objects.values():
            ob.importers.clear()
            if self._is_local(p):
                ob.ranks.clear()
        for o in self._objects.values():
            self._send_bitfield(p, o)
        p.always = self._always_unchoked(region, trainer)
        if self.config.unchoke_all or p.always:
            p.we_choke = False
            self._out.append((peer, Unchoke()))
        self._update_interest(now)

    def _assumed_rate(self, upload: float) -> float:
        """A neighbour's rate to us before any piece from it was timed (see
        ``advertised_share``)."""
        cfg = self.config
        if upload <= 0 or cfg.advertised_share <= 0:
            return cfg.initial_rate
        return min(cfg.initial_rate, max(1.0, upload * cfg.advertised_share))

    def use_directory(self, rank: ImportRank, importer: Importer) -> None:
        """Rank imports over every member of a region, as a directory of the swarm lists
        them (``rank``: mine for a chunk; ``importer``: a region's first importer of a
        chunk, for super-seeding), instead of over my own neighbours: each chunk then has
        one first importer per region however many members it has."""
        self._rank_of = rank
        self._importer_of = importer
        for ob in self._objects.values():
            ob.importers.clear()
            ob.ranks.clear()
            ob.firsts = None

    def set_trainer(self, peer: str, trainer: bool, now: float) -> None:
        """A neighbour turned out to seed for the trainer (a manifest named it), or no
        longer does: what it holds counts as the trainer's from now on (or no longer)."""
        p = self._peers.get(peer)
        if p is not None and p.trainer != trainer:
            self._relabel(p, now, p.region, trainer, p.upload)

    def describe(self, peer: str, now: float, *, region: str, upload: float) -> bool:
        """A neighbour's metadata says ``region`` and ``upload`` (bytes per second, 0 if
        unknown) now: it changed, or came after the connection (a dialled node learns of
        its dialler from the peers topic only). Whether anything changed."""
        p = self._peers.get(peer)
        upload = max(0.0, upload)
        if p is None or (p.region, p.upload) == (region, upload):
            return False
        self._relabel(p, now, region, p.trainer, upload)
        return True

    def neighbour(self, peer: str) -> tuple[str, float] | None:
        """The region and uplink (bytes per second) known of a neighbour (None: not one)."""
        p = self._peers.get(peer)
        return None if p is None else (p.region, p.upload)

    def _always_unchoked(self, region: str, trainer: bool) -> bool:
        """A neighbour in another region (not the trainer) is never choked with
        ``unchoke_remote``."""
        return self.config.unchoke_remote and region != self.region and not trainer

    def _relabel(self, p: PeerState, now: float, region: str, trainer: bool,
                 upload: float) -> None:
        """Give ``p`` a new region, trainer flag or uplink, and redo what depends on them:
        which chunks region-mates hold, the import ranks, the remote neighbours kept
        unchoked."""
        was_local = self._is_local(p)
        if upload != p.upload and not p.bytes_from:
            self._set_rate(p, self._assumed_rate(upload))  # nothing timed yet
        p.region, p.trainer, p.upload = region, trainer, upload
        if self._is_local(p) != was_local:
            step = -1 if was_local else 1
            for obj, idxs in p.haves.items():
                o = self._objects.get(obj)
                if o is not None:
                    for idx in idxs:
                        if p.peer in o.holders[idx]:
                            o.local[idx] += step
        always = self._always_unchoked(region, trainer)
        if always and not p.always and p.we_choke:
            p.we_choke = False
            self._out.append((p.peer, Unchoke()))
        p.always = always
        self._locals = None
        self._keys = None
        for ob in self._objects.values():
            ob.importers.clear()
            ob.ranks.clear()
        self._update_interest(now)
        self._pick(now)

    def disconnect(self, peer: str, now: float) -> None:
        """A neighbour is gone; its requests go elsewhere."""
        p = self._peers.pop(peer, None)
        if p is None:
            return
        self._locals = None
        self._keys = None
        for ob in self._objects.values():
            ob.importers.clear()
            if self._is_local(p):
                ob.ranks.clear()
        self._ready.discard(peer)
        self._unchokers.pop(peer, None)
        for obj, idxs in p.haves.items():
            o = self._objects.get(obj)
            if o is None:
                continue
            local = self._is_local(p)
            for idx in idxs:
                holders = o.holders[idx]
                if peer in holders:  # (not counted: announced after it was held here)
                    holders.discard(peer)
                    o.availability[idx] -= 1
                    if local:
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
        for o in self._objects.values():
            for idx in [i for i, q in o.wanted.items() if q == peer]:
                del o.wanted[idx]
            for idx in [i for i, who in o.wanted_by.items() if peer in who]:
                o.wanted_by[idx].remove(peer)
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

    def receive_have(self, peer: str, msg: Have, now: float) -> bool:
        """:meth:`receive` for a :class:`Have` (most messages), then :meth:`pending`."""
        p = self._peers.get(peer)
        if p is not None:
            try:
                self._on_have(p, msg, now)
            except RemoteProtocolError as exc:
                self._ban(peer, str(exc), now)
        return bool(self._out or self._ready or self._events or self._timer_earlier)

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
        for p in self._expire_requests(now):
            reason = f"{p.unanswered} requests unanswered over {p.strikes} time-outs"
            log.info("%s: dropping neighbour %s: %s", self.me, p.peer, reason)
            self._events.append(PeerPenalized(p.peer, reason))
            self._events.append(PeerTimedOut(p.peer, reason))
            self.disconnect(p.peer, now)
        if now >= self._next_rechoke:
            self._rechoke(now)
            self._next_rechoke = now + self.config.rechoke_interval
        if self._wake is not None and now >= self._wake:
            self._wake = None
        self._pick(now)
        self._super_seed(now)

    def take_outgoing(self) -> list[tuple[str, Message]]:
        """Control messages to send, as (neighbour, message); with
        ``config.broadcast_haves`` a have named ``""`` goes to every neighbour."""
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

    def remove_object(self, obj: bytes) -> None:
        """Stop exchanging ``obj`` and free its chunks (a version nobody needs any more).

        Requests for it in flight are forgotten; requests of it queued for upload are
        refused (``Reject``); later messages about it are treated like those about any
        unknown object.
        """
        gone = self._objects.pop(obj, None)
        if gone is None:
            return
        for idx, who in gone.wanted_by.items():
            for peer in who:
                self._peers[peer].wants -= 1
                self._out.append((peer, Reject(obj, idx)))
        for p in self._peers.values():
            p.haves.pop(obj, None)
            p.common.pop(obj, None)
            p.suggested_to.pop(obj, None)
            for key in [k for k in p.out if k[0] == obj]:
                del p.out[key]
            if any(o == obj for o, _ in p.queue):
                # refused, not left to time out: the asker turns to another holder
                for o, idx in p.queue:
                    if o == obj:
                        self._out.append((p.peer, Reject(obj, idx)))
                p.queue = deque(item for item in p.queue if item[0] != obj)
        self._avg = max((x.avg_size for x in self._objects.values()), default=1)
        self._locals = None

    def _may_track(self, p: PeerState, obj: bytes) -> bool:
        """Whether to remember a neighbour's haves of an object we do not exchange (yet):
        its manifest may still be on its way, but a neighbour cannot make us remember
        more than :data:`MAX_UNKNOWN_OBJECTS` such objects."""
        if obj in p.haves:
            return True
        unknown = sum(1 for x in p.haves if x not in self._objects)
        return unknown < MAX_UNKNOWN_OBJECTS

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, p: PeerState, msg: Message, now: float) -> None:
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
            old = p.haves.get(msg.obj, set())
            if o is None:
                # an object not known here: within the allowance only (counted before
                # the bits are unpacked: a full summary of 2^18 bits is 16 MB of set)
                room = MAX_UNKNOWN_BITS - p.unknown_bits + len(old)
                if int.from_bytes(msg.bits, "little").bit_count() > room:
                    self._over_allowance(p, now)
                    return
                idxs = indices_of(msg.bits, msg.count)
                new = old | idxs
                if len(new) > room:
                    self._over_allowance(p, now)
                    return
                p.unknown_bits += len(new) - len(old)
                p.haves[msg.obj] = new
                return
            first = msg.obj not in p.haves
            idxs = indices_of(msg.bits, msg.count)
            p.haves[msg.obj] = old | idxs
            for idx in idxs - old:
                self._add_holder(o, idx, p, now)
            if first and not o.have <= idxs:
                # Our own bitfield may have reached p before p knew the object, and been
                # dropped past its allowance for unknown objects (a peer back from a
                # restart is told of every kept version at once): once more, now that p
                # exchanges it. Once per object and connection, so never a ping-pong.
                self._send_bitfield(p, o)
            if self.config.super_seed:
                self._suggest_to(p, o, now)
            self._update_interest(now)
            self._pick(now)
        elif isinstance(msg, Request):
            self._on_request(p, msg, now)
        elif isinstance(msg, Cancel):
            with contextlib.suppress(ValueError):
                p.queue.remove((msg.obj, msg.index))
            self._drop_want(p, msg.obj, msg.index)
        elif isinstance(msg, Want):
            self._on_want(p, msg, now)
        elif isinstance(msg, Reject):
            key = (msg.obj, msg.index)
            o = self._objects.get(msg.obj)
            if o is not None and o.wanted.get(msg.index) == p.peer:
                del o.wanted[msg.index]  # a want refused: the usual picking takes over
                self._pick(now)
            if key in p.out:
                del p.out[key]
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
            if not p.choked_us:
                p.choked_us = True
                p.choked_since = now
            self._unchokers.pop(p.peer, None)
        elif isinstance(msg, Unchoke):
            p.choked_us = False
            self._unchokers[p.peer] = p
            self._pick(now)

    def _on_have(self, p: PeerState, msg: Have, now: float) -> None:
        obj, idx = msg.obj, msg.index
        o = self._objects.get(obj)
        if o is not None:
            if idx >= len(o.spec.sizes):  # _check_index, inlined: haves are most messages
                raise RemoteProtocolError("chunk index past the object's end")
        elif not self._may_track(p, obj):
            return
        elif p.unknown_bits >= MAX_UNKNOWN_BITS:
            if idx not in p.haves.get(obj, ()):
                self._over_allowance(p, now)
            return
        s = p.haves.get(obj)
        if s is None:
            s = p.haves[obj] = set()
        elif idx in s:
            return
        s.add(idx)
        if o is None:
            p.unknown_bits += 1
            return
        if idx in o.have and not self.config.super_seed:
            # held here (most haves, late in a transfer): only what the neighbour lacks
            # changes; who else holds a chunk matters to fetching it, over for this one
            p.common[obj] = p.common.get(obj, 0) + 1
            if not p.trainer:
                o.last_progress = now
            return
        holders = o.holders[idx]
        if p.peer not in holders:  # _add_holder, inlined
            holders.add(p.peer)
            o.availability[idx] += 1
            if idx in o.have:
                p.common[obj] = p.common.get(obj, 0) + 1
            if not p.trainer:
                if p.region == self.region:
                    o.local[idx] += 1
                if idx not in o.first_seen:
                    o.first_seen[idx] = now
                    if idx not in o.have:
                        o.last_new = now
                o.last_progress = now
        if o.wanted and o.wanted.get(idx) == p.peer:
            # it holds what I asked it for ahead: the piece is on its way
            del o.wanted[idx]
            if idx not in o.have:
                self._track(o, idx, p, now)
        if (o.complete_at is None and not p.trainer and idx not in o.have
                and idx not in o.inflight):
            self._pick_one(o, idx, p, now)
        if self.config.super_seed:
            self._suggest_to(p, o, now)

    @staticmethod
    def _check_index(o: ObjectState, index: int) -> None:
        if index >= len(o.spec.sizes):
            raise RemoteProtocolError("chunk index past the object's end")

    def _on_piece(self, p: PeerState, msg: Piece, now: float) -> None:
        o = self._objects.get(msg.obj)
        key = (msg.obj, msg.index)
        requested = p.out.pop(key, None)
        if o is None or msg.index >= len(o.spec.sizes):
            raise RemoteProtocolError("piece of an unknown object or index")
        cid, size = o.spec.chunk_ids[msg.index], o.spec.sizes[msg.index]
        if len(msg.data) != size or not self._verify(cid, msg.data):
            self._drop_inflight(o, msg.index, p.peer)
            o.poisoned.add(msg.index)
            self._ban(p.peer, f"chunk {msg.index} does not match its BLAKE3 id", now)
            return
        self.bytes_down += size
        p.bytes_from += size
        p.got_recent += size
        if p.strikes:
            p.strikes = p.unanswered = 0
            self._set_rate(p, p.rate)  # no longer snubbed: its full pipeline again
        start = max(requested if requested is not None else now, p.last_arrival)
        p.last_arrival = now
        if now > start:
            sample = size / (now - start)
            self._set_rate(p, p.rate + self.config.rate_alpha * (sample - p.rate))
        if requested is not None and p.region != self.region and not p.trainer:
            took = now - requested
            self._import_s = took if not self._import_s else (
                self._import_s + self.config.rate_alpha * (took - self._import_s))
        if msg.index in o.have:
            self.bytes_wasted += size
            self._drop_inflight(o, msg.index, p.peer)
            self._pick(now)
            return
        o.have.add(msg.index)
        peers = self._peers
        for h in o.holders[msg.index]:
            c = peers[h].common
            c[msg.obj] = c.get(msg.obj, 0) + 1
        data = o.data[msg.index] = bytes(msg.data)  # received: bytes already, not copied
        o.last_progress = o.last_chunk = now
        o.suggested.discard(msg.index)
        o.wanted.pop(msg.index, None)
        self._serve_wants(o, msg.index)
        for other in o.inflight.pop(msg.index, {}):
            if other != p.peer:
                q = self._peers.get(other)
                if q is not None and not self._on_probation(q) \
                        and q.out.pop(key, None) is not None:
                    self._out.append((other, Cancel(msg.obj, msg.index)))
        have = Have(msg.obj, msg.index)
        if self.config.broadcast_haves:
            self._out.append(("", have))
        else:
            self._out.extend((q, have) for q in self._peers)
        self._events.append(ChunkStored(msg.obj, msg.index, data, p.peer))
        if not o.missing:
            o.complete_at = now
            self._events.append(ObjectComplete(msg.obj, now))
            log.debug("%s: object %s complete at %.3f", self.me[:8], msg.obj.hex()[:8], now)
        self._update_interest(now)
        self._pick(now)

    @staticmethod
    def _on_probation(q: PeerState) -> bool:
        """Whether ``q`` has yet to show it serves what it announces: nothing delivered
        over this connection, or nothing since a request of it timed out (never the
        trainer). Its requests are not cancelled when another source delivers first:
        they run until delivered (wasting one piece of an honest, slow neighbour's
        upload, once) or timed out (a strike). Cancelled whenever another source was
        faster, a neighbour that announces every chunk and serves none would never strike
        out."""
        return not q.trainer and (not q.bytes_from or q.strikes > 0)

    def _penalize(self, p: PeerState, reason: str) -> None:
        """Score ``p`` down (the driver carries it out) but keep it."""
        log.info("%s: penalizing %s: %s", self.me, p.peer, reason)
        self._events.append(PeerPenalized(p.peer, reason))

    def _over_allowance(self, p: PeerState, now: float) -> None:
        """``p`` announced more chunks of objects unknown here than we remember: they are
        not kept; the first time in a connection it is scored, the
        :data:`MAX_OVER_ALLOWANCE`-th it is dropped (not the trainer: it keeps many
        versions and is trusted)."""
        if p.trainer:
            return
        p.over_allowance += 1
        if p.over_allowance == 1:
            self._penalize(p, f"haves of unknown objects past {MAX_UNKNOWN_BITS} chunks")
        elif p.over_allowance >= MAX_OVER_ALLOWANCE:
            reason = (f"{p.over_allowance} have messages past the allowance of "
                      f"{MAX_UNKNOWN_BITS} chunks of unknown objects")
            log.info("%s: dropping neighbour %s: %s", self.me, p.peer, reason)
            self._events.append(PeerDropped(p.peer, reason))
            self.disconnect(p.peer, now)

    def _ban(self, peer: str, reason: str, now: float) -> None:
        if peer in self._banned:
            return
        log.warning("%s: banning %s: %s", self.me, peer, reason)
        self._banned.add(peer)
        self.bans.append((peer, reason))
        self._events.append(PeerBanned(peer, reason))
        self.disconnect(peer, now)

    # ------------------------------------------------------------ holder bookkeeping

    def _send_bitfield(self, p: PeerState, o: ObjectState) -> None:
        n = len(o.spec.sizes)
        self._out.append((p.peer, Bitfield(o.spec.obj, n, bits_of(o.have, n))))

    def _add_holder(self, o: ObjectState, idx: int, p: PeerState, now: float) -> None:
        holders = o.holders[idx]
        if p.peer in holders:
            return
        holders.add(p.peer)
        o.availability[idx] += 1
        if idx in o.have:
            p.common[o.spec.obj] = p.common.get(o.spec.obj, 0) + 1
        if p.region == self.region and not p.trainer:  # _is_local
            o.local[idx] += 1
        if not p.trainer:
            if idx not in o.first_seen:
                o.first_seen[idx] = now
                if idx not in o.have:
                    o.last_new = now
            o.last_progress = now

