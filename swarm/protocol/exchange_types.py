"""The exchange's vocabulary: what it exchanges (:class:`ObjectSpec`), how it is tuned
(:class:`ExchangeConfig`) and what it reports (the events). Pure data, no logic beyond
validation; :mod:`swarm.protocol.exchange` re-exports every name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.content.ids import chunk_id
from swarm.content.manifest import SignedManifest

Chunk = bytes | memoryview
"""A chunk held for serving: received bytes, or a read-only view of a state held here."""
Verifier = Callable[[bytes, Chunk], bool]
ImportRank = Callable[[bytes, int], int]
"""(object, chunk index) -> this node's import rank for that chunk in its region."""
Importer = Callable[[str, bytes, int], "int | None"]
"""(region, object, chunk index) -> the :func:`~swarm.protocol.picker.peer_key` of that
region's first importer of the chunk (``None``: nobody known there)."""

#: Objects not (yet) known here whose haves one neighbour may make us remember.
MAX_UNKNOWN_OBJECTS = 8
#: Chunks of such objects one neighbour may make us remember, over all of them (a set
#: entry costs about 60 bytes: at most about 4 MB a neighbour). Each one's count is
#: bounded by the decoder (``MAX_CHUNKS_PER_OBJECT``, the manifest's ``MAX_CHUNKS``); a
#: real delta of 1 MiB chunks has this many chunks only at 64 GiB.
MAX_UNKNOWN_BITS = 1 << 16
#: Messages past that allowance (summaries or haves of unknown objects) after which a
#: neighbour is dropped (the first one scores it; an honest node sends none: it announces
#: only versions it holds, and those fit).
MAX_OVER_ALLOWANCE = 3


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
    imports into its region with ``rank_by_upload`` (neighbours pass theirs to
    :meth:`Exchange.connect`)."""
    rank_by_upload: bool = False
    """Weigh import ranks (and the trainer's choice of each region's first importer) by
    advertised uploads. For the simulator, where every node's upload is known and true;
    real nodes rank every region-mate alike, since an advertised upload is unchecked: one
    claiming a large one, or the one advertising any among region-mates that advertise
    none, would rank first for nearly every chunk and have its region wait on it."""
    inflight_window: float = 0.25
    """Seconds of ``download_rate`` kept requested (at least four chunks)."""
    initial_rate: float = 20e6
    """Assumed rate of a neighbour before any piece from it was timed."""
    advertised_share: float = 0.0
    """Of a neighbour that advertises its uplink, the rate assumed before any piece from it
    was timed is this share of that uplink (at most ``initial_rate``): an uplink split
    over its upload slots, erring low, so that a host that can hardly upload is not asked
    for first copies as if it were fast (0: ``initial_rate`` for every neighbour). For the
    simulator with a directory's ranks, where uploads are true (see ``rank_by_upload``);
    real nodes leave it off, as an advertised upload is unchecked."""
    rate_alpha: float = 0.3
    """Weight of the newest sample in the per-neighbour rate average."""
    request_timeout: float = 3.0
    """Least time to wait for a requested piece (longer when the pipeline is deep)."""
    max_request_timeout: float = 60.0
    """Most time to wait for a requested piece, however slow the neighbour has been (each
    time-out halves its rate estimate, and the trainer is never dropped for them)."""
    max_strikes: int = 3
    """Time-outs after which a neighbour is dropped (the driver may find a replacement)."""
    max_queue: int = 64
    """Requests queued from one neighbour; more are rejected."""
    import_delay: float = 0.15
    """Extra wait per import rank before fetching a chunk from another region."""
    last_resort_delay: float = 1.0
    """How long the swarm must make no progress on an object before a chunk that nobody
    else offers is asked of the trainer."""
    choked_wait: float = 5.0
    """How long a holder that chokes us is waited for. Past that it is no reason not to
    turn to the trainer: it may have dropped the object since it announced it (a peer
    keeps a few versions; a peer back from a restart asks for older ones), and a
    dropped object is not announced."""
    super_seed: bool = False
    """Hand each neighbour chunks few others hold (the trainer)."""
    fetch: bool = True
    """Request chunks this node lacks (False: it seeds only its own share of an object,
    as one host of a sharded trainer does; with ``super_seed`` it suggests from that
    share)."""
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
    unchoke_remote: bool = False
    """Never choke neighbours in other regions, and keep the upload slots for those in
    this one (with import ranks from a directory a node's remote neighbours are the few
    peers that import its group's chunks into their regions, and their regions wait on
    them); the slots go round the same-region neighbours, those served least lately
    first, instead of to those that serve us best."""
    broadcast_haves: bool = False
    """Queue the have of each stored chunk once, addressed to every neighbour (peer name
    ``""`` in :meth:`~swarm.protocol.exchange.Exchange.take_outgoing`), instead of once
    per neighbour: for a driver that fans it out itself (the simulator)."""


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
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PeerDropped:
    """A neighbour kept breaking a bound of the exchange (haves of unknown objects past
    the allowance, :data:`MAX_OVER_ALLOWANCE` times): it was dropped, and the driver
    hangs up on it and scores it down (reconnecting and doing it again gets it banned)."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class PeerPenalized:
    """A neighbour misbehaved in a way that costs it score but not (yet) its connection:
    haves past an allowance, requests it advertised and never served. The driver scores
    it down (a transport bans a peer whose score falls low enough)."""

    peer: str
    reason: str


Event = (ChunkStored | ObjectComplete | PeerBanned | PeerTimedOut | PeerDropped
         | PeerPenalized)

