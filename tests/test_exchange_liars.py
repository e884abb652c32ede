"""Hostile neighbours against the sans-IO exchange core, in virtual time: a liar that
announces every chunk and serves none, and floods of have-summaries for objects that do
not exist."""

from __future__ import annotations

import heapq
import itertools
import logging
import os

import pytest

from swarm.content.ids import chunk_id, domain_hash
from swarm.content.manifest import MAX_CHUNKS
from swarm.protocol.exchange import (
    MAX_OVER_ALLOWANCE,
    MAX_UNKNOWN_BITS,
    MAX_UNKNOWN_OBJECTS,
    Exchange,
    ExchangeConfig,
    ObjectSpec,
    PeerDropped,
    PeerPenalized,
    PeerTimedOut,
)
from swarm.protocol.exchange_msgs import (
    Bitfield,
    Cancel,
    Have,
    Message,
    Piece,
    Request,
    Unchoke,
    encode,
)

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 << 10


def make_object(n: int, seed: int = 0) -> tuple[ObjectSpec, list[bytes]]:
    chunks = [bytes([(seed + i) % 256]) * CHUNK + os.urandom(8) for i in range(n)]
    spec = ObjectSpec(domain_hash("liars", seed.to_bytes(4, "little")),
                      tuple(chunk_id(c) for c in chunks), tuple(len(c) for c in chunks))
    return spec, chunks


class Links:
    """Virtual-time delivery: every directed link has a latency and a bandwidth, pieces
    queue behind each other on it. Nodes in ``liars`` announce and unchoke but never
    send a piece (their cores are not run at all: the liar is scripted)."""

    def __init__(self, latency: float = 0.02, rate: float = 8e6) -> None:
        self.latency, self.rate = latency, rate
        self.nodes: dict[str, Exchange] = {}
        self.liars: set[str] = set()
        self.free: dict[tuple[str, str], float] = {}
        self.heap: list[tuple[float, int, str, str, Message]] = []
        self.seq = itertools.count()
        self.events: list[tuple[str, object]] = []
        self.sent: list[tuple[float, str, str, Message]] = []

    def send(self, now: float, src: str, dst: str, msg: Message) -> None:
        self.sent.append((now, src, dst, msg))
        size = len(msg.data) if isinstance(msg, Piece) else 64
        start = max(now, self.free.get((src, dst), now))
        done = start + size / self.rate
        self.free[(src, dst)] = done
        heapq.heappush(self.heap, (done + self.latency, next(self.seq), src, dst, msg))

    def flush(self, now: float) -> None:
        for name, core in self.nodes.items():
            for dst, msg in core.take_outgoing():
                self.send(now, name, dst, msg)
            for dst in sorted(core.take_upload_ready()):
                # the link takes the next piece when the previous one is on the wire
                while (piece := core.next_upload(dst, now)) is not None:
                    self.send(now, name, dst, piece)
            self.events.extend((name, e) for e in core.take_events())

    def run_until(self, done: object, limit: float, now: float = 0.0) -> float:
        """Deliver messages and fire timers from ``now`` until ``done()`` or ``limit``;
        the time."""
        self.flush(now)
        while now < limit and not done():  # type: ignore[operator]
            timers = [(t, n) for n, c in self.nodes.items()
                      if (t := c.next_timer()) is not None]
            t_msg = self.heap[0][0] if self.heap else float("inf")
            t_timer, who = min(timers) if timers else (float("inf"), "")
            if t_msg <= t_timer:
                now, _, src, dst, msg = heapq.heappop(self.heap)
                if dst in self.nodes:  # what is sent to the liar is lost
                    self.nodes[dst].receive_bytes(src, encode(msg), now)
            else:
                now = max(now, t_timer)
                self.nodes[who].handle_timer(now)
            self.flush(now)
        return now


def swarm(n: int, liar: bool, seed: int = 0) -> tuple[Links, ObjectSpec, list[bytes]]:
    spec, chunks = make_object(n, seed)
    net = Links()
    honest = Exchange("honest", seed=1, config=ExchangeConfig(unchoke_all=True))
    me = Exchange("me", seed=2, config=ExchangeConfig(request_timeout=1.0))
    net.nodes = {"honest": honest, "me": me}
    honest.add_object(spec, 0.0, dict(enumerate(chunks)))
    me.add_object(spec, 0.0)
    me.connect("honest", 0.0, rtt=2 * net.latency)
    honest.connect("me", 0.0, rtt=2 * net.latency)
    if liar:
        net.liars.add("liar")
        me.connect("liar", 0.0, rtt=2 * net.latency)
        # it claims every chunk, faster than the honest holder, and serves none
        me.receive("liar", Bitfield(spec.obj, n, b"\xff" * (n // 8)), 0.0)
        me.receive("liar", Unchoke(), 0.0)
    return net, spec, chunks


def test_a_liar_that_serves_nothing_is_snubbed_scored_and_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    n = 512  # 32 MiB over an 8 MB/s link: about 4.2 s from the honest holder alone
    clean, spec, _ = swarm(n, liar=False)
    t_clean = clean.run_until(lambda: clean.nodes["me"].is_complete(spec.obj), 60.0)
    assert clean.nodes["me"].is_complete(spec.obj)

    caplog.set_level(logging.INFO, logger="swarm.protocol")
    net, spec, chunks = swarm(n, liar=True)
    me = net.nodes["me"]
    t_done = net.run_until(lambda: me.is_complete(spec.obj), 60.0)
    assert me.is_complete(spec.obj)
    assert [me.chunk(spec.obj, i) for i in range(n)] == chunks
    # the liar costs at most one time-out's worth, not a 5-10x slowdown
    timeout = me.config.request_timeout
    assert t_done <= t_clean + timeout, (t_clean, t_done)
    # while it was pending it got at most one request at a time after its first time-out
    cancels = [t for t, s, d, m in net.sent if s == "me" and d == "liar"
               and isinstance(m, Cancel)]
    first_timeout = min(cancels, default=t_done)
    later = [m for t, s, d, m in net.sent
             if s == "me" and d == "liar" and isinstance(m, Request) and t > first_timeout]
    assert len(later) <= me.config.max_strikes
    # it was dropped after max_strikes time-outs, before the honest holder was done
    assert "liar" not in me.neighbours
    events = [e for who, e in net.events if who == "me"]
    assert [e.peer for e in events if isinstance(e, PeerTimedOut)] == ["liar"]
    assert any("unanswered" in e.reason for e in events if isinstance(e, PeerTimedOut))
    assert [e.peer for e in events if isinstance(e, PeerPenalized)] == ["liar"]
    # logged once, at INFO, with the peer and how many requests it left unanswered
    lines = [r for r in caplog.records if "liar" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "unanswered" in lines[0].getMessage()


def test_a_liar_beaten_by_a_faster_source_still_strikes_out() -> None:
    """The honest holder delivers every chunk before a request to the liar times out:
    cancelled then (as a loser in the endgame), the liar's requests never timed out and it
    stayed a neighbour forever. On probation until it delivers, its requests run to their
    time-out instead: dropped within a few versions, each as fast as without it."""
    net = Links(rate=4e6)
    honest = Exchange("honest", seed=1, config=ExchangeConfig(unchoke_all=True))
    me = Exchange("me", seed=2, config=ExchangeConfig(request_timeout=1.0))
    net.nodes = {"honest": honest, "me": me}
    net.liars.add("liar")
    for a, b in (("me", "honest"), ("honest", "me"), ("me", "liar")):
        net.nodes[a].connect(b, 0.0, rtt=2 * net.latency)
    me.receive("liar", Unchoke(), 0.0)
    now, took = 0.0, []
    for version in range(8):
        spec, chunks = make_object(32, seed=10 + version)  # 2 MiB: 0.5 s from honest
        honest.add_object(spec, now, dict(enumerate(chunks)))
        me.add_object(spec, now)
        if "liar" in me.neighbours:
            me.receive("liar", Bitfield(spec.obj, 32, b"\xff" * 4), now)
        start = now
        now = net.run_until(lambda s=spec: me.is_complete(s.obj), now + 30.0, now)
        assert [me.chunk(spec.obj, i) for i in range(32)] == chunks
        took.append(now - start)
    events = [e for who, e in net.events if who == "me"]
    assert [e.peer for e in events if isinstance(e, PeerTimedOut)] == ["liar"]
    assert "liar" not in me.neighbours
    assert max(took) < 1.0, took  # never a time-out's wait: the honest holder was asked


def test_huge_have_summaries_for_unknown_objects_are_bounded_scored_and_dropped() -> None:
    core = Exchange("me", region="r")
    core.connect("them", 0.0, region="r")
    full = Bitfield(b"", MAX_CHUNKS, b"\xff" * (MAX_CHUNKS // 8))

    def fake(i: int) -> bytes:
        return domain_hash("fake", i.to_bytes(4, "little"))

    core.receive_bytes("them", encode(Bitfield(fake(0), full.count, full.bits)), 0.0)
    core.receive_bytes("them", encode(Have(fake(0), MAX_CHUNKS - 1)), 0.0)
    # the first message past the allowance: nothing of it kept, scored, still a neighbour
    p = core._peers["them"]
    assert sum(len(s) for s in p.haves.values()) <= MAX_UNKNOWN_BITS  # was 8 * 2^18 ints
    assert "them" in core.neighbours
    assert [(type(e), e.peer) for e in core.take_events()] == [(PeerPenalized, "them")]
    for rep in range(3):  # the rest of the flood, repeated, as in the attack
        for i in range(MAX_UNKNOWN_OBJECTS):
            obj = fake(rep * 100 + i + 1)
            core.receive_bytes("them", encode(Bitfield(obj, full.count, full.bits)), 0.0)
    # the MAX_OVER_ALLOWANCE-th: dropped, not banned (its transport scores it; one that
    # reconnects starts a new count)
    assert MAX_OVER_ALLOWANCE == 3
    assert "them" not in core.neighbours and "them" not in core.banned
    events = core.take_events()
    assert [(type(e), e.peer) for e in events] == [(PeerDropped, "them")]
    assert "3 have messages past the allowance" in events[0].reason
    core.connect("them", 1.0, region="r")
    assert core._peers["them"].over_allowance == 0


def test_the_trainer_is_not_scored_for_haves_of_versions_not_known_here() -> None:
    core = Exchange("me", region="r")
    core.connect("trainer", 0.0, region="r", trainer=True)
    for i in range(2 * MAX_OVER_ALLOWANCE):
        obj = domain_hash("kept", i.to_bytes(4, "little"))
        core.receive_bytes("trainer", encode(Bitfield(obj, MAX_CHUNKS,
                                                      b"\xff" * (MAX_CHUNKS // 8))), 0.0)
    assert "trainer" in core.neighbours and not core.take_events()


def test_small_haves_of_unknown_objects_are_kept_and_not_scored() -> None:
    """The manifest may still be on its way: honest announcements within the allowance
    are remembered and count once the object is added."""
    core = Exchange("me", region="r")
    core.connect("them", 0.0, region="r")
    spec, _ = make_object(16, seed=7)
    core.receive_bytes("them", encode(Bitfield(spec.obj, 16, b"\x0f\x00")), 0.0)
    core.receive_bytes("them", encode(Have(spec.obj, 9)), 0.0)
    core.add_object(spec, 0.0)
    assert core._peers["them"].haves[spec.obj] == {0, 1, 2, 3, 9}
    assert not [e for e in core.take_events() if isinstance(e, PeerPenalized)]


def test_haves_past_the_end_of_an_object_learnt_later_are_dropped_and_scored() -> None:
    """Announced before the manifest arrived, then shown false by it: before, adding the
    object raised IndexError out of the core."""
    core = Exchange("me", region="r")
    core.connect("them", 0.0, region="r")
    spec, _ = make_object(4, seed=8)
    core.receive_bytes("them", encode(Have(spec.obj, 1)), 0.0)
    core.receive_bytes("them", encode(Have(spec.obj, 1000)), 0.0)
    core.add_object(spec, 0.0)
    assert core._peers["them"].haves[spec.obj] == {1}
    penalties = [e for e in core.take_events() if isinstance(e, PeerPenalized)]
    assert [e.peer for e in penalties] == ["them"]


def test_a_bitfield_of_a_known_object_must_have_its_chunk_count() -> None:
    core = Exchange("me", region="r")
    spec, _ = make_object(16, seed=9)
    core.add_object(spec, 0.0)
    core.connect("them", 0.0, region="r")
    core.receive_bytes("them", encode(Bitfield(spec.obj, MAX_CHUNKS,
                                               b"\xff" * (MAX_CHUNKS // 8))), 0.0)
    assert "them" in core.banned
