"""The exchange's state: one :class:`ObjectState` per object, one :class:`PeerState` per
neighbour, and :class:`ExchangeState`, the fields and small helpers that the download side
(:mod:`swarm.protocol.exchange_download`), the upload side
(:mod:`swarm.protocol.exchange_upload`) and the core (:class:`swarm.protocol.exchange.Exchange`,
which initialises them) share."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from swarm.protocol.exchange_msgs import Message
from swarm.protocol.exchange_types import (
    Chunk,
    Event,
    ExchangeConfig,
    Importer,
    ImportRank,
    ObjectSpec,
    Verifier,
)


@dataclass(slots=True)
class ObjectState:
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
    poisoned: set[int] = field(default_factory=set)
    """Chunks a neighbour sent me corrupt (and was banned for): asked of the trainer
    without waiting for the swarm to stall, as the peer that should have passed them on
    may have been the only holder."""
    ranks: dict[int, int] = field(default_factory=dict)
    firsts: frozenset[int] | None = None
    """With import ranks from a directory: the chunks I am my region's first importer
    of (``None``: not computed yet)."""
    importers: dict[tuple[str, int], int | None] = field(default_factory=dict)
    complete_at: float | None = None
    avg_size: int = 1
    last_progress: float = 0.0
    last_chunk: float = 0.0
    last_new: float = 0.0
    """When a neighbour other than the trainer last announced a chunk nobody had
    announced to me before."""
    # super-seeding (trainer side): times each chunk was suggested, suggestions pending
    times_suggested: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    wanted: dict[int, str] = field(default_factory=dict)
    """Chunks I asked a neighbour to send once it holds them (:class:`Want`): whom."""
    wanted_by: dict[int, list[str]] = field(default_factory=dict)
    """Chunks not held yet that neighbours want from me, and who."""
    tiebreaks: list[int] = field(default_factory=list)
    """``picker.tiebreak(salt, i)`` of every chunk ``i`` (fixed per node and object)."""

    @property
    def missing(self) -> int:
        return len(self.spec.sizes) - len(self.have)


@dataclass(slots=True)
class PeerState:
    peer: str
    region: str
    rtt: float
    trainer: bool
    rate: float
    haves: dict[bytes, set[int]] = field(default_factory=dict)
    common: dict[bytes, int] = field(default_factory=dict)
    """Per known object: chunks it announced that we hold too (``_interested`` compares
    this with what we hold)."""
    choked_us: bool = True
    choked_since: float = 0.0
    """When it last choked us (or connected: a neighbour starts choked)."""
    we_choke: bool = True
    optimistic: bool = False
    always: bool = False
    """Never choked (``unchoke_remote``), and not counted in the upload slots."""
    out: dict[tuple[bytes, int], float] = field(default_factory=dict)
    queue: deque[tuple[bytes, int]] = field(default_factory=deque)
    suggested_to: dict[bytes, set[int]] = field(default_factory=dict)
    last_arrival: float = 0.0
    got_recent: int = 0
    sent_recent: int = 0
    bytes_from: int = 0
    bytes_to: int = 0
    wants: int = 0
    """Chunks it wants from us that we do not hold yet."""
    strikes: int = 0
    """Time-outs since it last delivered a piece; while above 0 it is snubbed: one
    request in flight at most, and the last choice of source."""
    unanswered: int = 0
    """Requests it let time out since it last delivered a piece."""
    unknown_bits: int = 0
    """Chunk indices remembered from it for objects not known here (MAX_UNKNOWN_BITS)."""
    over_allowance: int = 0
    """Messages of it past that allowance (scored at the first, dropped at
    MAX_OVER_ALLOWANCE)."""
    key: int = 0
    tie: int = 0
    """``key`` mixed with our salt: breaks ties between equal delivery estimates."""
    depth: int = 2
    upload: float = 0.0
    download: float = 0.0

class ExchangeState:
    """The state of one node's exchange (set up by :class:`~swarm.protocol.exchange.Exchange`)."""

    me: str
    region: str
    config: ExchangeConfig
    _rng: random.Random
    _salt: int
    _key: int
    _verify: Verifier
    _objects: dict[bytes, ObjectState]
    _peers: dict[str, PeerState]
    _banned: set[str]
    _out: list[tuple[str, Message]]
    """Control messages to send, as (neighbour, message)."""
    _ready: set[str]
    """Neighbours with pieces queued for upload since the driver last asked."""
    _events: list[Event]
    _next_rechoke: float
    _rechokes: int
    _wake: float | None
    _timer_earlier: bool
    """A timer earlier than :meth:`next_timer` last said was set (see ``pending``)."""
    _deadlines: list[tuple[float, float, str, bytes, int]]
    """(earliest possible deadline, sent time, peer, obj, index) of requests in flight."""
    _avg: int
    _locals: list[str] | None
    """Same-region neighbours (see ``_local_peers``); ``None`` until computed."""
    _slow_locals: frozenset[str]
    """Those of them that can hardly upload (computed with ``_locals``)."""
    _remotes: list[PeerState]
    """Neighbours in other regions other than the trainer (computed with ``_locals``)."""
    _slowest: frozenset[str]
    """Same-region neighbours whose advertised download is within 25% of the slowest
    among them (computed with ``_locals``)."""
    _import_s: float
    """Average time from request to arrival of the chunks this node imported from other
    regions (0: none yet): how long the next import rank should give the one before."""
    _rank_of: ImportRank | None
    """Import ranks over the region's members from a directory (``use_directory``);
    ``None``: over my same-region neighbours."""
    _importer_of: Importer | None
    _unchokers: dict[str, PeerState]
    """The neighbours that unchoke us (``choked_us`` false), in the order they did."""
    _keys: dict[int, PeerState] | None
    """The neighbours by peer key (see ``_neighbour_keys``); ``None`` until computed."""
    _regions: list[str]
    """The regions of the neighbours other than the trainer, sorted (computed with
    ``_keys``)."""
    bytes_up: int
    bytes_down: int
    bytes_wasted: int
    bans: list[tuple[str, str]]

    def _neighbour_keys(self) -> dict[int, PeerState]:
        """The neighbours by peer key (and ``_regions``, theirs), cached until one comes
        or goes."""
        if self._keys is None:
            self._keys = {q.key: q for q in self._peers.values()}
            self._regions = sorted({q.region for q in self._peers.values() if not q.trainer})
        return self._keys

    def _local_peers(self) -> list[str]:
        """Same-region neighbours other than the trainer (cached until one comes or goes,
        with ``_slow_locals``, ``_remotes`` and ``_slowest``; callers must not modify the
        list)."""
        if self._locals is None:
            self._locals = [p.peer for p in self._peers.values()
                            if p.region == self.region and not p.trainer]
            # the trainer's advertised uplink shared by every peer of the region
            share = max((p.upload for p in self._peers.values() if p.trainer),
                        default=0.0) / (len(self._locals) + 1)
            self._slow_locals = frozenset(
                h for h in self._locals
                if self._hardly_uploads(self._peers[h], self._avg, share))
            self._remotes = [p for p in self._peers.values()
                             if p.region != self.region and not p.trainer]
            downs = {h: self._peers[h].download for h in self._locals}
            floor = min((d for d in downs.values() if d > 0), default=0.0)
            self._slowest = frozenset(h for h, d in downs.items() if 0 < d <= 1.25 * floor)
        return self._locals

    def _hardly_uploads(self, p: PeerState, size: int, share: float) -> bool:
        """``p`` advertises an upload too slow to deliver a chunk of ``size`` bytes
        within ``last_resort_delay`` even with no other request queued, and slower than
        ``share``, the trainer's advertised uplink split over every peer of the region
        (so the trainer serves each of them faster, even if all ask it): ``p`` is the
        last choice of source. (Advertised capacities, not measured rates: those also
        count the time requests wait in a queue, and a busy fast neighbour is no reason
        to go to the trainer; nor is a thin uplink when the trainer's is as thin.)"""
        return 0 < p.upload < share and \
            p.rtt + size / p.upload > self.config.last_resort_delay

    def _is_local(self, p: PeerState) -> bool:
        return p.region == self.region and not p.trainer

    def _rank_weight(self, upload: float) -> float:
        """A node's weight in import ranks (see ``ExchangeConfig.rank_by_upload``)."""
        return (upload or 1.0) if self.config.rank_by_upload else 1.0

    def _drop_holder(self, o: ObjectState, idx: int, p: PeerState) -> None:
        """``p`` refused, or did not serve in time, a chunk it announced (it dropped the
        object, say: a peer stops serving old versions as it moves on): ask others, or the
        trainer, until ``p`` announces the chunk again. Without this a peer kept asking a
        neighbour that refuses, and never the trainer, while that neighbour counted as a
        holder."""
        if p.peer not in o.holders[idx]:
            return
        o.holders[idx].discard(p.peer)
        if idx in o.have:
            p.common[o.spec.obj] -= 1
        o.availability[idx] -= 1
        if self._is_local(p):
            o.local[idx] -= 1
        theirs = p.haves.get(o.spec.obj)
        if theirs is not None:
            theirs.discard(idx)
        o.ranks.pop(idx, None)

    def _drop_inflight(self, o: ObjectState, idx: int, peer: str) -> None:
        srcs = o.inflight.get(idx)
        if srcs is not None:
            srcs.pop(peer, None)
            if not srcs:
                del o.inflight[idx]
