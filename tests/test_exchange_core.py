"""The sans-IO exchange core and its picker, driven by hand with fixed clocks."""

from __future__ import annotations

import os

import pytest

from swarm.content import Manifest
from swarm.content.ids import chunk_id, domain_hash
from swarm.errors import LocalProtocolError
from swarm.protocol import picker
from swarm.protocol.exchange import (
    ChunkStored,
    Exchange,
    ExchangeConfig,
    ObjectComplete,
    ObjectSpec,
    PeerBanned,
    PeerTimedOut,
)
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
    encode,
)

pytestmark = pytest.mark.timeout(60)


def make_object(n: int = 12, size: int = 4096, seed: int = 0) -> tuple[ObjectSpec, list[bytes]]:
    chunks = [bytes([(seed + i) % 256]) * size + os.urandom(8) for i in range(n)]
    spec = ObjectSpec(domain_hash("test", seed.to_bytes(4, "little")),
                      tuple(chunk_id(c) for c in chunks), tuple(len(c) for c in chunks))
    return spec, chunks


class Net:
    """Instant in-memory delivery between cores, through the real codec."""

    def __init__(self) -> None:
        self.nodes: dict[str, Exchange] = {}
        self.corrupt: set[str] = set()
        self.silent: set[str] = set()
        self.sent: list[tuple[str, str, Message]] = []
        self.events: dict[str, list[object]] = {}

    def add(self, core: Exchange) -> Exchange:
        self.nodes[core.me] = core
        self.events[core.me] = []
        return core

    def link(self, a: str, b: str, now: float, *, trainer_a: bool = False,
             trainer_b: bool = False, same_region: bool = True, upload_b: float = 0.0
             ) -> None:
        ra = self.nodes[a].region
        rb = self.nodes[b].region if same_region else "elsewhere"
        self.nodes[a].connect(b, now, region=rb, rtt=0.01, trainer=trainer_b, upload=upload_b)
        self.nodes[b].connect(a, now, region=ra, rtt=0.01, trainer=trainer_a)

    def run(self, now: float, rounds: int = 500) -> None:
        for _ in range(rounds):
            moved = False
            for name, core in list(self.nodes.items()):
                for dst, msg in core.take_outgoing():
                    moved = True
                    self.sent.append((name, dst, msg))
                    if name not in self.silent and dst in self.nodes:
                        self.nodes[dst].receive_bytes(name, encode(msg), now)
                for dst in sorted(core.take_upload_ready()):
                    while (piece := core.next_upload(dst, now)) is not None:
                        moved = True
                        if name in self.silent:
                            continue
                        if name in self.corrupt:
                            piece = Piece(piece.obj, piece.index, b"\0" + piece.data[1:])
                        self.sent.append((name, dst, piece))
                        self.nodes[dst].receive(name, decode(encode(piece)), now)
                self.events[name].extend(core.take_events())
            if not moved:
                return
        raise AssertionError("exchange did not settle")


def test_two_nodes_transfer_everything_verified() -> None:
    spec, chunks = make_object()
    net = Net()
    seed = net.add(Exchange("seed", region="r", seed=1))
    leech = net.add(Exchange("leech", region="r", seed=2))
    seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    leech.add_object(spec, 0.0)
    net.link("seed", "leech", 0.0)
    net.run(0.0)
    net.run(1.0)
    seed.handle_timer(1.0)  # first re-ranking: the leech is interested, gets unchoked
    net.run(1.0)
    assert leech.is_complete(spec.obj)
    assert [leech.chunk(spec.obj, i) for i in range(len(chunks))] == chunks
    stored = [e for e in net.events["leech"] if isinstance(e, ChunkStored)]
    assert sorted(e.index for e in stored) == list(range(len(chunks)))
    assert any(isinstance(e, ObjectComplete) for e in net.events["leech"])
    # every request was answered exactly once: no duplicate pieces
    pieces = [m for s, d, m in net.sent if isinstance(m, Piece) and d == "leech"]
    assert len(pieces) == len(chunks)
    assert leech.bytes_wasted == 0


def test_choked_requests_are_rejected_and_bitfield_announced() -> None:
    spec, chunks = make_object(4)
    seed = Exchange("seed", config=ExchangeConfig(upload_slots=1))
    seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    seed.connect("a", 0.0)
    out = seed.take_outgoing()
    assert isinstance(out[0][1], Bitfield) and out[0][1].count == 4
    seed.receive("a", Request(spec.obj, 0), 0.0)
    assert ("a", Reject(spec.obj, 0)) in seed.take_outgoing()
    seed.receive("a", Bitfield(spec.obj, 4, b"\0"), 0.0)
    assert ("a", Unchoke()) in seed.take_outgoing()  # interested: a free slot is filled
    seed.receive("a", Request(spec.obj, 1), 0.0)
    assert seed.take_upload_ready() == {"a"}
    seed.receive("a", Cancel(spec.obj, 1), 0.0)
    assert seed.next_upload("a", 0.0) is None  # withdrawn before it reached the wire


def test_rarest_first_and_pipeline_depth() -> None:
    spec, _chunks = make_object(6)
    me = Exchange("me", seed=3, config=ExchangeConfig(min_pipeline=2, max_pipeline=2))
    me.add_object(spec, 0.0)
    holdings = (("a", {0, 1, 2, 3}), ("b", {0, 1, 2}), ("c", {0, 1}))
    for peer, have in holdings:
        me.connect(peer, 0.0, rtt=0.001)
        bits = bytearray(1)
        for i in have:
            bits[0] |= 1 << i
        me.receive(peer, Bitfield(spec.obj, 6, bytes(bits)), 0.0)
    assert not any(isinstance(m, Request) for _, m in me.take_outgoing())  # all choke us
    me.receive("a", Unchoke(), 0.0)
    first = [(p, m.index) for p, m in me.take_outgoing() if isinstance(m, Request)]
    # a's two rarest chunks: 3 (a alone) and 2 (a and b); depth 2 stops there
    assert sorted(first) == [("a", 2), ("a", 3)]
    me.receive("b", Unchoke(), 0.0)
    me.receive("c", Unchoke(), 0.0)
    rest = [(p, m.index) for p, m in me.take_outgoing() if isinstance(m, Request)]
    assert sorted(i for _, i in rest) == [0, 1]  # no duplicates before the endgame
    for p in "bc":
        assert sum(1 for q, _ in rest if q == p) <= 2


def test_bad_chunk_bans_the_server_and_goes_elsewhere() -> None:
    spec, chunks = make_object(8)
    net = Net()
    t = net.add(Exchange("trainer", seed=1, config=ExchangeConfig(unchoke_all=True)))
    bad = net.add(Exchange("bad", seed=2, config=ExchangeConfig(unchoke_all=True)))
    me = net.add(Exchange("me", seed=3))
    t.add_object(spec, 0.0, dict(enumerate(chunks)))
    bad.add_object(spec, 0.0, dict(enumerate(chunks)))
    me.add_object(spec, 0.0)
    net.corrupt.add("bad")
    net.link("me", "bad", 0.0)
    net.link("me", "trainer", 0.0, trainer_b=True)
    net.run(0.0)
    assert "bad" in me.banned
    assert any(isinstance(e, PeerBanned) and e.peer == "bad" for e in net.events["me"])
    # the trainer is the last resort: after the swarm stalls it serves what is left
    for k in range(1, 5):
        me.handle_timer(k * 1.0)
        net.run(k * 1.0)
    assert me.is_complete(spec.obj)
    assert all(me.chunk(spec.obj, i) == chunks[i] for i in range(8))
    # a banned peer is never re-admitted
    me.connect("bad", 9.0)
    assert "bad" not in me.neighbours


def _two_seeds_and_me(a: str, b: str, me_config: ExchangeConfig
                      ) -> tuple[Net, ObjectSpec, list[bytes], Exchange]:
    """Seeds ``a`` and ``b`` (unchoking everyone) hold a 4-chunk object that ``me``
    (configured with ``me_config``) lacks; nothing is linked yet."""
    spec, chunks = make_object(4)
    net = Net()
    for k, name in enumerate((a, b), 1):
        seed = net.add(Exchange(name, seed=k, config=ExchangeConfig(unchoke_all=True)))
        seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    me = net.add(Exchange("me", seed=3, config=me_config))
    me.add_object(spec, 0.0)
    return net, spec, chunks, me


def test_requests_to_a_silent_peer_time_out_and_go_elsewhere() -> None:
    net, spec, chunks, me = _two_seeds_and_me("a", "b", ExchangeConfig(request_timeout=1.0))
    net.silent.add("a")  # a announces nothing more and never answers
    net.nodes["me"].connect("a", 0.0, rtt=0.01)
    me.receive("a", Bitfield(spec.obj, 4, b"\x0f"), 0.0)
    me.receive("a", Unchoke(), 0.0)
    net.run(0.0)
    net.link("me", "b", 0.1)
    net.run(0.1)
    now = 0.1
    for _ in range(50):
        t = me.next_timer()
        assert t is not None and t > now
        now = t
        me.handle_timer(now)
        net.run(now)
        # a has delivered nothing: its requests run to their time-out (see below)
        if me.is_complete(spec.obj) and not me._peers["a"].out:
            break
    assert me.is_complete(spec.obj) and now < 10.0
    assert all(me.chunk(spec.obj, i) == chunks[i] for i in range(4))
    assert any(s == "me" and d == "a" and isinstance(m, Cancel) for s, d, m in net.sent)
    stored = [e for e in net.events["me"] if isinstance(e, ChunkStored)]
    assert {e.source for e in stored} == {"b"}


def test_silent_peer_is_dropped_after_strikes() -> None:
    spec, _chunks = make_object(4)
    me = Exchange("me", seed=3, config=ExchangeConfig(request_timeout=1.0, max_strikes=2))
    me.add_object(spec, 0.0)
    me.connect("ghost", 0.0, rtt=0.01)
    me.receive("ghost", Bitfield(spec.obj, 4, b"\x0f"), 0.0)
    me.receive("ghost", Unchoke(), 0.0)
    assert any(isinstance(m, Request) for _, m in me.take_outgoing())
    now = 0.0
    for _ in range(20):
        t = me.next_timer()
        assert t is not None and t > now
        now = t
        me.handle_timer(now)
        if "ghost" not in me.neighbours:
            break
    assert "ghost" not in me.neighbours
    assert any(isinstance(e, PeerTimedOut) for e in me.take_events())
    assert now < 30.0
    cancels = [m for _, m in me.take_outgoing() if isinstance(m, Cancel)]
    assert cancels


def test_a_slow_trainer_strikes_but_is_never_dropped() -> None:
    """A trainer whose uplink the swarm shares can leave requests unanswered for longer
    than any time-out (0.4 Mbit/s for three peers in tests/test_cli_liar.py): a peer that
    dropped it lost its only source of the next versions, and stalled for good."""
    spec, chunks = make_object(4)
    me = Exchange("me", seed=3, config=ExchangeConfig(request_timeout=1.0, max_strikes=2))
    me.add_object(spec, 0.0)
    me.connect("trainer", 0.0, rtt=0.01, trainer=True)
    me.receive("trainer", Bitfield(spec.obj, 4, b"\x0f"), 0.0)
    me.receive("trainer", Unchoke(), 0.0)
    me.receive("trainer", Suggest(spec.obj, 0), 0.0)
    me.take_outgoing()
    now, timeouts = 0.0, []
    for _ in range(6):
        t = me.next_timer()
        assert t is not None and t > now
        now = t
        me.handle_timer(now)
        timeouts += [e for e in me.take_events() if isinstance(e, PeerTimedOut)]
    assert "trainer" in me.neighbours and not timeouts
    assert me._peers["trainer"].strikes >= 2
    # what it sends at last is taken, and the strikes are forgiven
    asked = [m for _, m in me.take_outgoing() if isinstance(m, Request)]
    assert asked
    me.receive("trainer", Piece(spec.obj, asked[-1].index, chunks[asked[-1].index]), now)
    assert me.has(spec.obj, asked[-1].index) and me._peers["trainer"].strikes == 0


def test_a_silent_trainer_holds_a_chunk_for_at_most_the_longest_time_out() -> None:
    """Each time-out halves the trainer's rate estimate, and it is never dropped: without
    a cap, after enough strikes one request to a trainer that stays connected and silent
    would hold its chunk for hours."""
    spec, _ = make_object(4)
    cfg = ExchangeConfig(request_timeout=1.0, max_request_timeout=5.0)
    me = Exchange("me", seed=3, config=cfg)
    me.add_object(spec, 0.0)
    me.connect("trainer", 0.0, rtt=0.01, trainer=True)
    me.receive("trainer", Bitfield(spec.obj, 4, b"\x0f"), 0.0)
    me.receive("trainer", Unchoke(), 0.0)
    me.take_outgoing()
    now, cancels = 0.0, 0
    for _ in range(1000):
        t = me.next_timer()
        assert t is not None and t > now
        now = t
        if now > 600.0:
            break
        me.handle_timer(now)
        cancels += sum(isinstance(m, Cancel) for _, m in me.take_outgoing())
    assert "trainer" in me.neighbours
    # one request at a time, cancelled and asked again every 5 s: without the cap the
    # time-outs double, and it is cancelled 21 times in 10 minutes and then hardly ever
    assert cancels >= 60


@pytest.mark.parametrize("proven", [True, False])
def test_endgame_asks_a_second_source_and_cancels_the_loser(proven: bool) -> None:
    """A loser that has delivered before is cancelled; one on probation (nothing
    delivered over its connection yet) is not: its request runs until it delivers or
    times out, or a liar that announces every chunk would never strike out."""
    spec, chunks = make_object(2)
    before, old = make_object(1, seed=9)
    me = Exchange("me", seed=5, config=ExchangeConfig(endgame_late=1.0))
    me.add_object(before, 0.0)
    me.add_object(spec, 0.0)
    for p in ("a", "b"):
        me.connect(p, 0.0, rtt=0.01)
        if proven:
            me.receive(p, Piece(before.obj, 0, old[0]), 0.0)
        me.receive(p, Bitfield(spec.obj, 2, b"\x03"), 0.0)
        me.receive(p, Unchoke(), 0.0)
    first = [(p, m.index) for p, m in me.take_outgoing() if isinstance(m, Request)]
    assert sorted(i for _, i in first) == [0, 1]
    me.handle_timer(0.5)  # both requests are late: strict endgame duplicates them
    dups = [(p, m.index) for p, m in me.take_outgoing() if isinstance(m, Request)]
    assert dups and all(d not in first for d in dups)
    src, idx = dups[0]
    me.receive(src, Piece(spec.obj, idx, chunks[idx]), 0.6)
    out = me.take_outgoing()
    loser = next(p for p, i in first if i == idx)
    assert ((loser, Cancel(spec.obj, idx)) in out) is proven
    assert (loser, Have(spec.obj, idx)) in out
    if not proven:
        assert (spec.obj, idx) in me._peers[loser].out  # still awaited: it may deliver


def test_super_seeding_hands_out_distinct_chunks() -> None:
    spec, chunks = make_object(16)
    t = Exchange("trainer", seed=1, config=ExchangeConfig(
        unchoke_all=True, super_seed=True, suggest_depth=2, suggest_total=100))
    t.add_object(spec, 0.0, dict(enumerate(chunks)))
    for p in ("a", "b", "c", "d"):
        t.connect(p, 0.0)
        t.receive(p, Bitfield(spec.obj, 16, b"\0\0"), 0.0)
    sugg = [(p, m.index) for p, m in t.take_outgoing() if isinstance(m, Suggest)]
    for p in ("a", "b", "c", "d"):
        assert 1 <= sum(1 for q, _ in sugg if q == p) <= 2
    assert len({i for _, i in sugg}) == len(sugg)  # nobody is handed another's chunk
    # a peer that got its chunk is handed a new one
    p, i = sugg[0]
    t.receive(p, Have(spec.obj, i), 0.1)
    more = [m.index for q, m in t.take_outgoing() if isinstance(m, Suggest) and q == p]
    assert more and more[0] not in {j for _, j in sugg}


def test_import_rank_is_a_permutation_per_chunk() -> None:
    keys = [(picker.peer_key(f"peer-{i}"), 1.0 if i else 10.0) for i in range(10)]
    obj = b"o" * 32
    for idx in range(20):
        ranks = sorted(picker.import_rank(k, idx, obj, keys) for k in keys)
        assert ranks == list(range(10))
        first = next(k for k in keys if picker.import_rank(k, idx, obj, keys) == 0)
        assert picker.importer(idx, obj, keys) == first[0]
    firsts = [picker.importer(idx, obj, keys) for idx in range(400)]
    assert len(set(firsts)) > 5  # the import load spreads over the region ...
    share = firsts.count(keys[0][0]) / len(firsts)
    assert 0.35 < share < 0.7  # ... in proportion to upload capacity (10 of 19 here)


def test_pipeline_depth_follows_the_bandwidth_delay_product() -> None:
    chunk = 1 << 20
    assert picker.pipeline_depth(10e6, 0.001, chunk, 2, 16) == 2
    assert picker.pipeline_depth(125e6, 0.2, chunk, 2, 64) == 25
    assert picker.pipeline_depth(1e12, 1.0, chunk, 2, 16) == 16


def _delta(step: int, base: bytes, target: bytes, size: int) -> Manifest:
    return Manifest("run", step, "delta", base, target, b"l" * 32, "c", 1 << 12,
                    ((b"c" * 32, size),))


def test_catch_up_takes_the_cheaper_route() -> None:
    r = [bytes([i]) * 32 for i in range(6)]
    deltas = {s: _delta(s, r[s - 1], r[s], 100) for s in range(1, 6)}
    plan = picker.plan_catch_up(2, r[2], 5, deltas, state_bytes=1000)
    assert plan.kind == "chain" and plan.steps == (3, 4, 5) and plan.nbytes == 300
    plan = picker.plan_catch_up(0, r[0], 5, deltas, state_bytes=450)
    assert plan.kind == "state" and plan.nbytes == 450 and plan.chain_bytes == 500
    del deltas[4]  # a link no longer retained: the chain is broken
    plan = picker.plan_catch_up(2, r[2], 5, deltas, state_bytes=10_000)
    assert plan.kind == "state" and plan.chain_bytes is None
    wrong_base = picker.plan_catch_up(4, b"x" * 32, 5, deltas, state_bytes=10_000)
    assert wrong_base.kind == "state"
    assert picker.plan_catch_up(5, r[5], 5, deltas, 1).kind == "none"


def test_misuse_is_a_local_error() -> None:
    spec, _chunks = make_object(2)
    me = Exchange("me")
    me.add_object(spec, 0.0)
    with pytest.raises(LocalProtocolError):
        me.add_object(spec, 0.0)
    other, _ = make_object(2, seed=9)
    with pytest.raises(LocalProtocolError):
        me.add_object(other, 0.0, {0: b"short"})


def test_hostile_messages_ban_without_crashing() -> None:
    spec, _chunks = make_object(3)
    me = Exchange("me")
    me.add_object(spec, 0.0)
    for peer, raw in (("x", b"\xc1garbage"), ("y", encode(Have(spec.obj, 99))),
                      ("z", encode(Bitfield(spec.obj, 7, b"\x01")))):
        me.connect(peer, 0.0)
        me.receive_bytes(peer, raw, 0.0)
        assert peer in me.banned
    me.connect("w", 0.0)
    me.receive("w", Choke(), 0.0)  # legal: nothing happens
    me.receive("nobody", Have(spec.obj, 0), 0.0)  # not connected: ignored
    assert "w" in me.neighbours


def test_random_message_sequences_never_crash_the_core() -> None:
    """Whatever a neighbour sends (in any order, any index), the core bans or ignores it
    and keeps serving the others; it never raises."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    spec, chunks = make_object(5)
    idx = st.integers(0, 9)
    obj = st.sampled_from([spec.obj, b"z" * 32])
    msgs = st.lists(st.one_of(
        st.builds(Have, obj, idx), st.builds(Request, obj, idx),
        st.builds(Cancel, obj, idx), st.builds(Reject, obj, idx),
        st.builds(Suggest, obj, idx), st.builds(Want, obj, idx), st.just(Choke()),
        st.just(Unchoke()),
        st.builds(Piece, obj, idx, st.sampled_from([chunks[0], chunks[1], b"junk"])),
        st.builds(Bitfield, obj, st.just(5), st.binary(min_size=1, max_size=1)),
    ), max_size=40)

    @settings(max_examples=60, deadline=None)
    @given(msgs, st.booleans())
    def run(seq: list[Message], seeding: bool) -> None:
        me = Exchange("me", seed=1, config=ExchangeConfig(super_seed=seeding,
                                                          unchoke_all=seeding))
        me.add_object(spec, 0.0, dict(enumerate(chunks)) if seeding else None)
        me.connect("evil", 0.0)
        me.connect("good", 0.0)
        for k, m in enumerate(seq):
            me.receive("evil", m, 0.01 * k)
            me.handle_timer(0.01 * k + 0.005)
            for _ in range(3):
                if me.next_upload("evil", 0.01 * k) is None:
                    break
            me.take_outgoing()
            me.take_events()
        assert "good" in me.neighbours
        assert all(me.chunk(spec.obj, i) in (None, chunks[i]) for i in range(5))

    run()


def test_relabelled_neighbours_keep_the_books_right() -> None:
    """Metadata may change a neighbour's region, uplink or trainer flag at any point
    between its messages: the core never raises, and its count of region-mates holding
    each chunk stays the count of its local holders."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    spec, chunks = make_object(5)
    idx = st.integers(0, 4)
    msgs = st.one_of(
        st.builds(Have, st.just(spec.obj), idx), st.builds(Request, st.just(spec.obj), idx),
        st.builds(Reject, st.just(spec.obj), idx), st.just(Unchoke()),
        st.builds(Piece, st.just(spec.obj), idx, st.sampled_from(chunks[:2])))
    labels = st.tuples(st.sampled_from(["", "eu", "us"]), st.sampled_from([0.0, 1e3, 1e9]),
                       st.booleans())
    steps = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.one_of(msgs, labels)),
                     max_size=40)

    @settings(max_examples=60, deadline=None)
    @given(steps)
    def run(seq: list[tuple[str, Message | tuple[str, float, bool]]]) -> None:
        me = Exchange("me", region="eu", seed=1)
        me.add_object(spec, 0.0)
        me.connect("a", 0.0, region="eu")
        me.connect("b", 0.0)
        for k, (peer, step) in enumerate(seq):
            now = 0.01 * k
            if isinstance(step, tuple):
                region, upload, trainer = step
                me.describe(peer, now, region=region, upload=upload)
                me.set_trainer(peer, trainer, now)
                assert me.neighbour(peer) in (None, (region, upload))
            else:
                me.receive(peer, step, now)
            me.handle_timer(now + 0.005)
            me.take_outgoing()
            me.take_events()
            o = me._objects[spec.obj]
            for i in range(5):
                assert o.local[i] == sum(1 for h in o.holders[i]
                                         if me._is_local(me._peers[h]))

    run()


def _queue_requests(seed: Exchange, leech: Exchange) -> None:
    """Hand the leech's first messages to the seed, unchoke it, and queue its requests
    at the seed (uploads not yet sent)."""
    for _, msg in leech.take_outgoing():
        seed.receive("leech", msg, 0.0)
    seed.handle_timer(1.0)
    for _, msg in seed.take_outgoing():
        leech.receive("seed", msg, 1.0)
    for _, msg in leech.take_outgoing():
        seed.receive("leech", msg, 1.0)
    assert seed.upload_queued("leech") > 0


def test_removed_object_frees_its_chunks_and_stops_uploads() -> None:
    spec, chunks = make_object()
    net = Net()
    seed = net.add(Exchange("seed", region="r", seed=1))
    leech = net.add(Exchange("leech", region="r", seed=2))
    seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    leech.add_object(spec, 0.0)
    net.link("seed", "leech", 0.0)
    # The leech's requests are queued at the seed, then the seed drops the object.
    _queue_requests(seed, leech)
    seed.remove_object(spec.obj)
    seed.remove_object(spec.obj)  # removing twice is harmless
    assert seed.chunk(spec.obj, 0) is None and not seed.has(spec.obj, 0)
    assert seed.next_upload("leech", 1.0) is None
    net.run(1.0)
    assert not leech.is_complete(spec.obj)
    # The leech gets everything once another holder appears.
    other = net.add(Exchange("other", region="r", seed=3))
    other.add_object(spec, 1.0, dict(enumerate(chunks)))
    net.link("other", "leech", 1.0)
    for t in (2.0, 3.0, 8.0, 14.0, 20.0):
        for core in net.nodes.values():
            core.handle_timer(t)
        net.run(t)
    assert leech.is_complete(spec.obj)
    assert [leech.chunk(spec.obj, i) for i in range(len(chunks))] == chunks


def test_replaced_chunks_serve_queued_uploads_and_must_fit() -> None:
    spec, chunks = make_object()
    net = Net()
    seed = net.add(Exchange("seed", region="r", seed=1))
    leech = net.add(Exchange("leech", region="r", seed=2))
    partial = net.add(Exchange("partial", region="r", seed=3))
    seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    partial.add_object(spec, 0.0, {0: chunks[0]})
    with pytest.raises(LocalProtocolError):
        partial.replace_data(spec.obj, {0: memoryview(chunks[0])})  # not complete
    leech.add_object(spec, 0.0)
    net.link("seed", "leech", 0.0)
    _queue_requests(seed, leech)
    # The same bytes, held elsewhere (read-only views): queued uploads are served from them.
    held = {i: memoryview(bytes(c)).toreadonly() for i, c in enumerate(chunks)}
    seed.replace_data(spec.obj, held)
    assert seed.chunk(spec.obj, 3) is held[3] and seed.upload_queued("leech") > 0
    for t in (1.0, 2.0, 3.0, 8.0):
        seed.handle_timer(t)
        net.run(t)
    assert leech.is_complete(spec.obj) and leech.banned == frozenset()
    assert [leech.chunk(spec.obj, i) for i in range(len(chunks))] == chunks
    with pytest.raises(LocalProtocolError):
        seed.replace_data(spec.obj, {i: held[i] for i in range(3)})
    with pytest.raises(LocalProtocolError):
        seed.replace_data(spec.obj, {**held, 0: held[0][1:]})


def test_idle_time_counts_from_the_last_chunk_received() -> None:
    spec, chunks = make_object()
    net = Net()
    seed = net.add(Exchange("seed", region="r", seed=1))
    leech = net.add(Exchange("leech", region="r", seed=2))
    leech.add_object(spec, 0.0)
    assert leech.idle(spec.obj, 5.0) == 5.0  # nothing yet: idle since it was added
    seed.add_object(spec, 5.0, dict(enumerate(chunks)))
    net.link("seed", "leech", 5.0)
    net.run(5.0)  # every chunk arrives at 5.0
    assert leech.is_complete(spec.obj) and leech.idle(spec.obj, 9.0) == 4.0


def test_a_neighbour_cannot_make_us_track_unbounded_unknown_objects() -> None:
    core = Exchange("me", region="r")
    core.connect("them", 0.0, region="r")
    for i in range(100):
        obj = domain_hash("unknown", i.to_bytes(4, "little"))
        core.receive_bytes("them", encode(Have(obj, 5)), 0.0)
        core.receive_bytes("them", encode(Bitfield(obj, 8, b"\xff")), 0.0)
    assert "them" not in core.banned
    from swarm.protocol.exchange import MAX_UNKNOWN_OBJECTS

    tracked = core._peers["them"].haves
    assert len(tracked) == MAX_UNKNOWN_OBJECTS
    # Haves of an object we do exchange are always kept.
    spec, _ = make_object()
    core.add_object(spec, 0.0)
    core.receive_bytes("them", encode(Have(spec.obj, 1)), 0.0)
    assert 1 in core._peers["them"].haves[spec.obj]


def test_a_peer_told_of_more_versions_than_it_tracks_still_fetches_a_late_one() -> None:
    """The restart stall: a peer back from a restart connects to a trainer that keeps a
    dozen versions. The trainer's bitfields all arrive before the peer has any manifest,
    and those past the peer's allowance for unknown objects are dropped. When the peer
    then takes up one of the later versions, it still learns who holds it, and gets it."""
    from swarm.protocol.exchange import MAX_UNKNOWN_OBJECTS

    kept = [make_object(4, seed=s) for s in range(MAX_UNKNOWN_OBJECTS + 4)]
    net = Net()
    trainer = net.add(Exchange("trainer", seed=1, config=ExchangeConfig(unchoke_all=True)))
    me = net.add(Exchange("me", seed=3))
    for spec, chunks in kept:
        trainer.add_object(spec, 0.0, dict(enumerate(chunks)))
    net.link("me", "trainer", 0.0, trainer_b=True)
    net.run(0.0)  # every bitfield is in; the newest ones were past the allowance
    late, chunks = kept[-1]
    me.add_object(late, 0.0)
    now = _run_until_complete(net, me, late.obj, rounds=20)
    assert me.is_complete(late.obj) and now < 5.0
    assert [me.chunk(late.obj, i) for i in range(4)] == chunks
    resent = [m for s, d, m in net.sent if s == "trainer" and isinstance(m, Bitfield)
              and m.obj == late.obj]
    assert len(resent) == 2  # at connect, and once more when the peer took it up


def _run_until_complete(net: Net, me: Exchange, obj: bytes, rounds: int) -> float:
    """Deliver messages and fire ``me``'s timers until it holds ``obj`` (or ``rounds``
    timers passed); returns the virtual time reached."""
    now = 0.0
    for _ in range(rounds):
        net.run(now)
        if me.is_complete(obj):
            break
        t = me.next_timer()
        assert t is not None
        now = max(t, now + 0.01)
        me.handle_timer(now)
    return now


def test_a_neighbour_that_refuses_an_announced_chunk_is_not_asked_again() -> None:
    """A peer that withdrew an object (it patched the state its keyframe views) rejects
    requests for chunks it announced; the leech then takes them from the trainer instead
    of asking the same neighbour for ever."""
    net, spec, chunks, me = _two_seeds_and_me("trainer", "other",
                                              ExchangeConfig(last_resort_delay=0.5))
    other = net.nodes["other"]
    net.link("me", "trainer", 0.0, trainer_b=True)
    net.link("me", "other", 0.0)
    other.remove_object(spec.obj)  # after it announced every chunk to me
    now = _run_until_complete(net, me, spec.obj, rounds=50)
    assert me.is_complete(spec.obj) and now < 5.0
    assert [me.chunk(spec.obj, i) for i in range(4)] == chunks
    asked_other = [m for s, d, m in net.sent if s == "me" and d == "other"
                   and isinstance(m, Request)]
    assert len(asked_other) <= 4  # each chunk asked of it once at most


def test_dropping_an_object_refuses_its_queued_requests() -> None:
    spec, chunks = make_object()
    seed = Exchange("seed", region="r", seed=1)
    leech = Exchange("leech", region="r", seed=2)
    seed.add_object(spec, 0.0, dict(enumerate(chunks)))
    leech.add_object(spec, 0.0)
    seed.connect("leech", 0.0)
    leech.connect("seed", 0.0)
    _queue_requests(seed, leech)
    queued = seed.upload_queued("leech")
    seed.remove_object(spec.obj)
    rejects = [m for _, m in seed.take_outgoing() if isinstance(m, Reject)]
    assert len(rejects) == queued  # refused at once, not left to time out


def test_a_neighbour_whose_request_timed_out_does_not_hold_back_the_trainer() -> None:
    """A neighbour that dropped an object without answering (or lies) costs one time-out;
    the chunk then comes from the trainer, not after the neighbour strikes out."""
    spec, chunks = make_object(4)
    net = Net()
    trainer = net.add(Exchange("trainer", seed=1, config=ExchangeConfig(unchoke_all=True)))
    net.add(Exchange("ghost", seed=2, config=ExchangeConfig(unchoke_all=True)))
    me = net.add(Exchange("me", seed=3, config=ExchangeConfig(request_timeout=1.0,
                                                              last_resort_delay=0.5)))
    trainer.add_object(spec, 0.0, dict(enumerate(chunks)))
    me.add_object(spec, 0.0)
    net.silent.add("ghost")
    me.connect("ghost", 0.0, rtt=0.01)
    me.receive("ghost", Bitfield(spec.obj, 4, b"\x0f"), 0.0)
    me.receive("ghost", Unchoke(), 0.0)
    net.link("me", "trainer", 0.0, trainer_b=True)
    now = _run_until_complete(net, me, spec.obj, rounds=100)
    assert me.is_complete(spec.obj)
    assert now < 2.5  # one 1 s time-out, then the trainer (3 strikes would be > 3 s)
    stored = [e for e in net.events["me"] if isinstance(e, ChunkStored)]
    assert {e.source for e in stored} == {"trainer"}


def test_a_chunk_sent_corrupt_is_asked_of_the_trainer_without_waiting_for_a_stall() -> None:
    """The neighbour that sent a chunk corrupt may have been its only holder (a region's
    first importer): that chunk comes from the trainer at once, not after
    ``last_resort_delay`` without progress; the other chunks still wait for it."""
    net, spec, chunks, me = _two_seeds_and_me("trainer", "liar",
                                              ExchangeConfig(last_resort_delay=5.0))
    net.corrupt.add("liar")
    net.link("me", "trainer", 0.0, trainer_b=True)
    net.link("me", "liar", 0.0)
    now = 0.0
    for _ in range(20):
        net.run(now)
        t = me.next_timer()
        if t is None or t >= 1.0:
            break
        now = max(t, now + 0.01)
        me.handle_timer(now)
    assert any(isinstance(e, PeerBanned) and e.peer == "liar" for e in net.events["me"])
    # the first corrupt piece got the liar banned; the pieces behind it were dropped
    first = next(m.index for s, _, m in net.sent if s == "liar" and isinstance(m, Piece))
    stored = {e.index: e.source for e in net.events["me"] if isinstance(e, ChunkStored)}
    assert stored == {first: "trainer"}
    assert me.chunk(spec.obj, first) == chunks[first]


@pytest.mark.parametrize(("upload", "trainer_upload", "source"), [
    (1_000.0, 1e8, "trainer"), (1e6, 1e8, "mate"), (1_000.0, 0.0, "mate"),
    (1_000.0, 2_000.0, "mate")])
def test_chunks_only_a_mate_that_can_hardly_upload_holds_come_from_the_trainer(
        upload: float, trainer_upload: float, source: str) -> None:
    """A region-mate advertising 1 kB/s could not deliver one 4 kB chunk within
    ``last_resort_delay``, and a trainer advertising 100 MB/s serves each of the two
    peers here far faster: the mate's chunks are asked of the trainer at once, not
    after the swarm stalls (5 s here). A mate advertising 1 MB/s is asked as usual, and
    so is the slow one when the trainer's uplink is unknown or no faster per peer."""
    net, spec, chunks, me = _two_seeds_and_me("trainer", "mate",
                                              ExchangeConfig(last_resort_delay=1.0))
    net.link("me", "trainer", 0.0, trainer_b=True, upload_b=trainer_upload)
    me.connect("mate", 0.0, rtt=0.01, upload=upload)
    net.nodes["mate"].connect("me", 0.0, rtt=0.01)
    now = 0.0
    for _ in range(20):
        net.run(now)
        if me.is_complete(spec.obj):
            break
        t = me.next_timer()
        assert t is not None
        now = max(t, now + 0.01)
        me.handle_timer(now)
    assert me.is_complete(spec.obj) and now < 0.5
    stored = {e.source for e in net.events["me"] if isinstance(e, ChunkStored)}
    assert stored == {source}
    assert all(me.chunk(spec.obj, i) == chunks[i] for i in range(4))


@pytest.mark.parametrize("by_upload", [False, True])
def test_a_mate_claiming_a_huge_upload_does_not_take_every_import(by_upload: bool) -> None:
    """Real nodes rank region-mates alike (an advertised upload is unchecked): a mate
    claiming 1 TB/s does not become every chunk's first importer, so I import about half
    of the chunks at once. Weighed by upload (the simulator's setting, where uploads are
    true) it would rank first for them all, and I would wait on it for each."""
    spec, chunks = make_object(16)
    net = Net()
    far = net.add(Exchange("far", region="far", seed=1, config=ExchangeConfig(unchoke_all=True)))
    far.add_object(spec, 0.0, dict(enumerate(chunks)))
    me = net.add(Exchange("me", seed=2, config=ExchangeConfig(rank_by_upload=by_upload)))
    me.add_object(spec, 0.0)
    net.add(Exchange("liar", seed=3)).add_object(spec, 0.0)
    me.connect("liar", 0.0, rtt=0.01, upload=1e12)
    net.nodes["liar"].connect("me", 0.0, rtt=0.01)
    net.link("me", "far", 0.0, same_region=False)
    net.run(0.0)
    asked = {m.index for src, dst, m in net.sent
             if src == "me" and dst == "far" and isinstance(m, Request)}
    if by_upload:
        assert not asked
    else:
        assert 4 <= len(asked) <= 12


@pytest.mark.parametrize("described", [False, True])
def test_a_mate_whose_region_comes_after_the_connection_shares_the_imports(
        described: bool) -> None:
    """A neighbour's region may come after the connection (a dialled node learns of its
    dialler from the peers topic). Told then (``describe``), I count it as a
    region-mate: it imports about half of the chunks, so I ask the far seed for the
    others only. Left without a region, it looks remote and I import every chunk."""
    spec, chunks = make_object(16)
    net = Net()
    far = net.add(Exchange("far", region="far", seed=1, config=ExchangeConfig(unchoke_all=True)))
    far.add_object(spec, 0.0, dict(enumerate(chunks)))
    me = net.add(Exchange("me", region="eu", seed=2))
    me.add_object(spec, 0.0)
    net.add(Exchange("mate", region="eu", seed=3)).add_object(spec, 0.0)
    me.connect("mate", 0.0, rtt=0.01)
    net.nodes["mate"].connect("me", 0.0, region="eu", rtt=0.01)
    assert me.neighbour("mate") == ("", 0.0)
    if described:
        assert me.describe("mate", 0.0, region="eu", upload=5e6)
        assert not me.describe("mate", 0.0, region="eu", upload=5e6)  # nothing new
        assert me.neighbour("mate") == ("eu", 5e6)
    net.link("me", "far", 0.0, same_region=False)
    net.run(0.0)
    asked = {m.index for src, dst, m in net.sent
             if src == "me" and dst == "far" and isinstance(m, Request)}
    if described:
        assert 4 <= len(asked) <= 12
    else:
        assert asked == set(range(16))


def _importer_here(spec: ObjectSpec, remote: Exchange) -> Exchange:
    """``remote`` holds nothing yet; return a peer in region asia that imports every chunk
    into its region first (a directory's ranks), linked to it and to the trainer."""
    far = Exchange("far", region="asia", seed=2, config=ExchangeConfig(unchoke_remote=True))
    far.add_object(spec, 0.0)
    far.use_directory(lambda obj, idx: 0,
                      lambda region, obj, idx: picker.peer_key(
                          {"us": remote.me, "asia": "far"}[region]))
    far.connect("t", 0.0, region="us", rtt=0.18, trainer=True)
    n = len(spec.sizes)
    far.receive("t", Bitfield(spec.obj, n, bits_of(set(range(n)), n)), 0.0)
    return far


def _linked(spec: ObjectSpec) -> tuple[Net, Exchange, Exchange]:
    """``mid`` in us, which holds nothing yet and gets its chunks from its trainer, and
    ``far`` (see ``_importer_here``), linked and past their bitfields."""
    net = Net()
    mid = net.add(Exchange("mid", region="us", seed=1,
                           config=ExchangeConfig(unchoke_remote=True)))
    mid.add_object(spec, 0.0)
    mid.connect("t", 0.0, region="us", trainer=True)
    far = net.add(_importer_here(spec, mid))
    far.connect("mid", 0.0, region="us", rtt=0.18)
    mid.connect("far", 0.0, region="asia", rtt=0.18)
    net.run(0.0)
    return net, mid, far


def test_a_first_importer_wants_its_chunks_ahead_and_gets_them_with_no_request() -> None:
    """A region's first importer of a chunk that only the trainer holds asks a remote
    first importer for it ahead (``Want``): that one sends it the moment it lands there,
    one one-way latency later, instead of have, request and piece."""
    spec, chunks = make_object(6)
    net, mid, far = _linked(spec)
    wanted = {m.index for src, dst, m in net.sent if src == "far" and isinstance(m, Want)}
    assert wanted == set(range(6))
    assert not any(isinstance(m, Reject) for src, _, m in net.sent if src == "mid")
    for i, c in enumerate(chunks):  # the chunks land at mid (from its trainer)
        mid.receive("t", Piece(spec.obj, i, c), 0.1)
        net.run(0.1)
    assert far.is_complete(spec.obj)
    assert not any(isinstance(m, Request) for src, _, m in net.sent if src == "far")
    assert len([m for _, dst, m in net.sent if dst == "far" and isinstance(m, Piece)]) == 6
    assert far.bytes_wasted == 0


def test_a_want_gives_way_to_a_holder_that_announces_the_chunk_first() -> None:
    """Another neighbour announcing a wanted chunk first serves it; the want is
    cancelled, so the remote first importer does not send a second copy."""
    spec, chunks = make_object(2)
    net, mid, far = _linked(spec)
    other = net.add(Exchange("other", region="eu", seed=3,
                             config=ExchangeConfig(unchoke_remote=True)))
    other.add_object(spec, 0.0, {0: chunks[0]})
    far.connect("other", 0.0, region="eu", rtt=0.01)
    other.connect("far", 0.0, region="asia", rtt=0.01)
    net.run(0.0)
    assert (far.me, "mid", Cancel(spec.obj, 0)) in net.sent
    assert far.has(spec.obj, 0)
    mid.receive("t", Piece(spec.obj, 0, chunks[0]), 0.1)
    net.run(0.1)
    assert far.bytes_wasted == 0
    assert not any(isinstance(m, Piece) for src, dst, m in net.sent
                   if src == "mid" and dst == "far")


def test_wants_are_bounded_and_refused_when_they_cannot_be_kept() -> None:
    """A neighbour keeps at most ``max_queue`` requests and wants with us; a want of an
    unknown object, from a choked neighbour or past the bound is refused, and dropping
    the object refuses those kept."""
    spec, _ = make_object(4)
    mid = Exchange("mid", region="us", config=ExchangeConfig(unchoke_remote=True, max_queue=2))
    mid.add_object(spec, 0.0)
    mid.connect("far", 0.0, region="asia")
    mid.connect("mate", 0.0, region="us")
    mid.take_outgoing()
    for i in range(3):
        mid.receive("far", Want(spec.obj, i), 0.0)
    mid.receive("far", Want(bytes(32), 0), 0.0)
    mid.receive("mate", Want(spec.obj, 0), 0.0)
    assert mid.take_outgoing() == [("far", Reject(spec.obj, 2)), ("far", Reject(bytes(32), 0)),
                                   ("mate", Reject(spec.obj, 0))]
    mid.receive("far", Cancel(spec.obj, 1), 0.0)
    mid.receive("far", Want(spec.obj, 3), 0.0)  # room again
    mid.remove_object(spec.obj)
    refused = [m for _, m in mid.take_outgoing() if isinstance(m, Reject)]
    assert sorted(m.index for m in refused) == [0, 3]


@pytest.mark.parametrize("seed", range(6))
def test_a_re_ranking_keeps_serving_the_slowest_download_it_is_serving(seed: int) -> None:
    """With slots going round the region-mates (``unchoke_remote``), the one served most
    lately is next to be choked; but the slowest downloads decide when the region is
    done, so one of them with requests waiting here keeps its slot."""
    spec, chunks = make_object(6)
    h = Exchange("h", region="r", seed=seed,
                 config=ExchangeConfig(unchoke_remote=True, upload_slots=2))
    h.add_object(spec, 0.0, dict(enumerate(chunks)))
    h.connect("slow", 0.0, region="r", download=0.3e9 / 8)
    h.receive("slow", Bitfield(spec.obj, 6, bits_of(set(), 6)), 0.0)
    h.receive("slow", Request(spec.obj, 0), 0.0)
    h.receive("slow", Request(spec.obj, 1), 0.0)
    assert h.next_upload("slow", 0.0) == Piece(spec.obj, 0, chunks[0])
    for name in ("fast1", "fast2", "fast3"):
        h.connect(name, 0.0, region="r", download=1e9 / 8)
        h.receive(name, Bitfield(spec.obj, 6, bits_of(set(), 6)), 0.0)
    h.take_outgoing()
    h.handle_timer(1.0)  # a re-ranking
    assert not [m for dst, m in h.take_outgoing() if dst == "slow"]
    assert h.next_upload("slow", 1.0) == Piece(spec.obj, 1, chunks[1])


def test_a_chunk_nobody_announces_is_asked_of_the_trainer_once_no_new_chunk_turns_up(
        ) -> None:
    """The trainer's only copy of a chunk went to a peer that its neighbours banned: no
    neighbour will ever announce it, and the rest of the swarm moving on never looks
    like a stall. Once no chunk new to a peer has been announced for
    ``last_resort_delay`` (the trainer has handed out every first copy), the peer asks
    the trainer for it (its import rank first), while other chunks still arrive."""
    spec, chunks = make_object(6)
    me = Exchange("me", region="r", seed=1)
    me.add_object(spec, 0.0)
    me.connect("t", 0.0, region="r", trainer=True)
    me.receive("t", Bitfield(spec.obj, 6, bits_of(set(range(6)), 6)), 0.0)
    me.receive("t", Unchoke(), 0.0)
    me.connect("mate", 0.0, region="r")
    me.receive("mate", Unchoke(), 0.0)
    for i in range(5):  # the mate announces its chunks one by one, the last at 0.4 s
        me.receive("mate", Have(spec.obj, i), 0.1 * i)
    for i, t in enumerate((0.5, 0.8, 1.1, 1.3)):
        me.receive("mate", Piece(spec.obj, i, chunks[i]), t)
        assert ("t", Request(spec.obj, 5)) not in me.take_outgoing()
    me.handle_timer(1.6)  # 0.4 s + last_resort_delay + at most one import rank's wait
    assert ("t", Request(spec.obj, 5)) in me.take_outgoing()


def test_the_trainer_hands_out_again_a_first_copy_that_does_not_spread() -> None:
    """A first copy held by one peer for longer than a stall takes is not spreading (its
    holder may be a corrupt peer that everyone else banned): the trainer suggests the
    chunk to another peer even past its upload budget."""
    spec, chunks = make_object(2)
    t = Exchange("t", region="r", seed=1, config=ExchangeConfig(
        unchoke_all=True, super_seed=True, super_seed_budget=0.0))
    t.add_object(spec, 0.0, dict(enumerate(chunks)))
    for name in ("a", "b"):
        t.connect(name, 0.0, region="r")
        t.receive(name, Bitfield(spec.obj, 2, bits_of(set(), 2)), 0.0)
    suggested = [(dst, m.index) for dst, m in t.take_outgoing() if isinstance(m, Suggest)]
    assert sorted(i for _, i in suggested) == [0, 1]  # one first copy each
    holder, idx = suggested[0]
    other = "b" if holder == "a" else "a"
    t.receive(holder, Have(spec.obj, idx), 0.1)
    t.receive(other, Have(spec.obj, 1 - idx), 0.1)
    t.receive(other, Have(spec.obj, 1 - idx), 0.5)
    assert (other, Suggest(spec.obj, idx)) not in t.take_outgoing()  # over budget
    t.handle_timer(1.2)
    assert (other, Suggest(spec.obj, idx)) in t.take_outgoing()


@pytest.mark.parametrize("seed", range(1, 9))
def test_a_chunk_two_untimed_mates_hold_is_asked_of_the_one_advertising_the_faster_uplink(
        seed: int) -> None:
    """With ``advertised_share`` (the simulator's peers with a directory's ranks), a
    neighbour not timed yet is assumed to serve at that share of its advertised uplink:
    a first chunk is asked of the mate on 1 Gbit/s, not of the one on 0.1 Gbit/s (a
    piece there takes ten times as long). At ``initial_rate`` for both, the tie's hash
    chose either."""
    spec, chunks = make_object(1, seed=seed)
    net = Net()
    for k, name in enumerate(("slow", "fast"), 1):
        mate = net.add(Exchange(name, seed=k, config=ExchangeConfig(unchoke_all=True)))
        mate.add_object(spec, 0.0, dict(enumerate(chunks)))
    me = net.add(Exchange("me", seed=seed, config=ExchangeConfig(advertised_share=1 / 16)))
    me.connect("slow", 0.0, rtt=0.002, upload=12.5e6)
    me.connect("fast", 0.0, rtt=0.002, upload=125e6)
    for name in ("slow", "fast"):  # both announce and unchoke before I know the object
        me.receive(name, Bitfield(spec.obj, 1, b"\x01"), 0.0)
        me.receive(name, Unchoke(), 0.0)
    me.take_outgoing()
    me.add_object(spec, 0.0)
    asked = [dst for dst, m in me.take_outgoing() if isinstance(m, Request)]
    assert asked == ["fast"]


def test_neighbours_holding_everything_are_known_from_haves_of_chunks_held_here() -> None:
    """A have of a chunk this node holds updates only what that neighbour lacks (the
    simulator spends most of its time on these): the trainer still learns who holds a
    whole version, and a neighbour that leaves is no longer counted."""
    spec, chunks = make_object(3)
    me = Exchange("me", seed=1)
    me.add_object(spec, 0.0, dict(enumerate(chunks)))
    for name in ("a", "b"):
        me.connect(name, 0.0, rtt=0.01)
        me.receive(name, Bitfield(spec.obj, 3, b"\x00"), 0.0)
    for idx in range(3):
        me.receive("a", Have(spec.obj, idx), 1.0)
    me.receive("b", Have(spec.obj, 0), 1.0)
    assert me.holders_of(spec.obj) == {"a"}
    me.disconnect("a", 2.0)
    assert me.holders_of(spec.obj) == frozenset()
    me.connect("a", 3.0, rtt=0.01)
    me.receive("a", Bitfield(spec.obj, 3, b"\x07"), 3.0)
    assert me.holders_of(spec.obj) == {"a"}


def test_a_peer_back_from_a_restart_is_handed_a_chunk_another_peer_took_last() -> None:
    """The trainer's count of suggestions still pending is freed once the peer announces
    them, also by its last announcement (that one used to be left counted: the chunk then
    counted as handed out for ever, and a peer catching up on that version after a
    restart was never handed it, while the one holder had moved on and dropped it)."""
    spec, chunks = make_object(2)
    t = Exchange("t", region="r", seed=1, config=ExchangeConfig(
        unchoke_all=True, super_seed=True, super_seed_budget=0.0))
    t.add_object(spec, 0.0, dict(enumerate(chunks)))
    t.connect("a", 0.0, region="r")
    t.receive("a", Bitfield(spec.obj, 2, bits_of(set(), 2)), 0.0)
    for step in range(2):
        (idx,) = [m.index for dst, m in t.take_outgoing() if isinstance(m, Suggest)]
        t.receive("a", Have(spec.obj, idx), 0.1 * (step + 1))
    t.connect("b", 5.0, region="r")
    t.receive("b", Bitfield(spec.obj, 2, bits_of(set(), 2)), 5.0)
    handed = set()
    for step in range(2):
        t.handle_timer(5.0 + step)
        for dst, m in t.take_outgoing():
            if isinstance(m, Suggest) and dst == "b":
                handed.add(m.index)
                t.receive("b", Have(spec.obj, m.index), 5.0 + step)
    assert handed == {0, 1}


def test_a_holder_that_keeps_choking_us_is_not_waited_for_for_ever() -> None:
    """A neighbour announced a chunk and never unchokes us (it may have dropped that
    version since: dropping is not announced). Past ``choked_wait`` the trainer, which
    holds it too, is asked; before, the peer waited on that neighbour for good."""
    spec, _ = make_object(2)
    me = Exchange("me", region="r", seed=1)
    me.add_object(spec, 0.0)
    me.connect("t", 0.0, region="r", trainer=True)
    me.receive("t", Bitfield(spec.obj, 2, bits_of({0, 1}, 2)), 0.0)
    me.receive("t", Unchoke(), 0.0)
    me.connect("p0", 0.0, region="far")
    me.receive("p0", Bitfield(spec.obj, 2, bits_of({0, 1}, 2)), 0.0)
    me.handle_timer(2.0)
    assert not [m for dst, m in me.take_outgoing() if isinstance(m, Request)]
    wait = ExchangeConfig().choked_wait
    me.handle_timer(wait + 0.1)
    asked = [(dst, m.index) for dst, m in me.take_outgoing() if isinstance(m, Request)]
    assert sorted(asked) == [("t", 0), ("t", 1)]
