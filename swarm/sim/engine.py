"""Discrete-event simulation of one step: the real exchange core on every node, virtual time.

Control messages arrive after the one-way latency of their region pair. Pieces are flows
in a :class:`~swarm.sim.network.FlowNetwork`; each directed connection sends one piece at
a time (as a TCP stream would) and pulls the next from the sender's core when the last
one has left, so cancels still withdraw queued pieces. Malicious nodes run the honest
core but corrupt every piece they send; crashed nodes go silent; leaving nodes say so.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from swarm.content.ids import chunk_id, domain_hash
from swarm.protocol.exchange import (
    Chunk,
    Event,
    Exchange,
    ExchangeConfig,
    ObjectComplete,
    ObjectSpec,
    PeerBanned,
    PeerDropped,
    PeerTimedOut,
)
from swarm.protocol.exchange_msgs import Have, Message, Piece
from swarm.sim.directory import Directory
from swarm.sim.scenario import Population

log = logging.getLogger(__name__)

_MSG, _PIECE, _TIMER, _CHURN, _GONE = range(5)
MAX_EVENTS = 20_000_000
#: ``ExchangeConfig.advertised_share`` of the peers with a directory's ranks. Against
#: ``initial_rate`` for every neighbour: 1.12-1.16x the bound instead of 1.13-1.18x at 64
#: peers and 1.15x instead of 1.17x at 256 (means over seeds 0-3), 1.22x instead of 1.24x
#: at 1024 (seed 0), with fewer bytes into each region. Shares of 1/12 to 1/32 measured
#: alike; 1/8 1.16x at 256, 1/64 1.23x at 1024. With ranks over neighbours it measured
#: worse on the small preset (1.28 s against 1.13 s, mean over seeds 0-7) and alike at
#: 256 peers, so it is left off there.
ADVERTISED_SHARE = 1 / 16


@dataclass(slots=True)
class SwarmResult:
    """What one simulated step measured."""

    completion_s: float | None
    """Time until every honest peer present at the end holds the version (None: never)."""
    peer_done: dict[int, float]
    trainer_egress: float
    """Bytes all trainer hosts sent."""
    region_in: list[float]
    """Bytes that crossed WAN links into each region."""
    bans: list[tuple[str, str, str]]
    """(banning peer, banned peer, reason)."""
    bit_exact: bool
    honest_done: int
    honest_total: int
    timeouts: int
    wasted_bytes: int
    events: int
    wall_s: float
    flows_recomputed: int
    per_region_done: dict[int, float] = field(default_factory=dict)
    host_egress: list[float] = field(default_factory=list)
    """Bytes each trainer host sent."""
    host_stray: int = 0
    """Pieces trainer hosts sent of chunks outside their own share (none, by design)."""


def peer_name(i: int, hosts: int = 1) -> str:
    if i < hosts:
        return "trainer" if hosts == 1 else f"trainer-{i}"
    return f"peer-{i:04d}"


def make_payload(sizes: list[int], seed: int, real: bool) -> tuple[ObjectSpec, list[bytes]]:
    """Deterministic chunk bytes and their object spec."""
    rng = np.random.default_rng(seed)
    chunks = []
    for i, n in enumerate(sizes):
        if real:
            chunks.append(rng.bytes(n))
        else:
            chunks.append(i.to_bytes(4, "little") * (n // 4) + b"\0" * (n % 4))
    ids = tuple(chunk_id(c) for c in chunks)
    obj = domain_hash("swarm/sim/object", seed.to_bytes(8, "little"), b"".join(ids))
    return ObjectSpec(obj, ids, tuple(sizes)), chunks


class SwarmSim:
    """One step of one population. Call :meth:`run` once."""

    def __init__(self, pop: Population, *, step: int = 0,
                 config: ExchangeConfig | None = None,
                 trainer_config: ExchangeConfig | None = None,
                 progress: Callable[[float, int, int], None] | None = None,
                 max_time: float | None = None, pump_always: bool = False) -> None:
        sc = pop.scenario
        self.pop = pop
        self.topo = pop.topo
        self.seed = sc.seed * 1_000_003 + step
        self.rng = random.Random(self.seed)
        self.progress = progress
        self.max_time = max_time if max_time is not None else max(600.0, 20 * sc.rollout_s)
        from swarm.sim.network import FlowNetwork

        self.net = FlowNetwork(self.topo, quantum=sc.rate_quantum)
        self.spec, self.truth = make_payload(sc.chunk_sizes(), self.seed, sc.chunk_payload)
        self._truth_by_id = dict(zip(self.spec.chunk_ids, self.truth, strict=True))
        self.config = config or ExchangeConfig()
        # a trainer host keeps about 48 suggestions out (its uplink's bandwidth-delay
        # product in chunks), spread over its neighbours: one each in a large swarm, more
        # in a small one (with one suggestion per neighbour a lone peer would fetch its
        # chunks stop-and-wait, at two round trips per chunk)
        suggest_total = 48
        self.trainer_config = trainer_config or ExchangeConfig(
            unchoke_all=True, super_seed=True, max_queue=256,
            suggest_depth=max(1, suggest_total // max(1, pop.initial)),
            suggest_total=suggest_total)
        self.scale_slots = True
        self.pump_always = pump_always
        """Collect a node's output after every message, not only when it says it has some
        (:meth:`Exchange.pending`): slower, the same results (a test checks that)."""
        self.n_total = self.topo.n_nodes
        self.cores: dict[int, Exchange] = {}
        self.alive: set[int] = set()
        self.links: dict[int, set[int]] = {}
        self._nbr: dict[int, dict[str, tuple[int, int]]] = {}
        """Per node: each neighbour's name -> (index, region), to route its output."""
        self._fan: dict[int, dict[int, dict[int, None]]] = {}
        """Per node: region -> its neighbours there (in link order), for the haves it
        sends to every neighbour at once (``broadcast_haves``)."""
        self.busy: dict[tuple[int, int], int] = {}
        self.up_active: dict[int, int] = {}
        self.up_wait: dict[int, deque[int]] = {}
        self.up_conc = max(1, sc.upload_concurrency)
        self.up_conc_trainer = max(1, sc.trainer_upload_concurrency)
        self.hosts = pop.hosts
        self._shares = [sc.host_chunks(h) for h in range(self.hosts)]
        self.host_stray = 0
        self.flow_of: dict[int, tuple[int, int, Piece]] = {}
        self.timer_at: dict[int, float] = {}
        self.heap: list[tuple[float, int, int, int, int, object]] = []
        self.seq = 0
        self.done: dict[int, float] = {}
        self.bans: list[tuple[str, str, str]] = []
        self.timeouts = 0
        self.now = 0.0
        self.events = 0
        self._changed = False
        self._names = [peer_name(i, self.hosts) for i in range(self.n_total)]
        self._index = {name: i for i, name in enumerate(self._names)}
        self.directory: Directory | None = None
        if sc.import_ranks == "directory":
            others = len({self.topo.region[i] for i in range(self.hosts, self.n_total)}) - 1
            self.directory = Directory(self.topo, self._names, sc.regions, self.hosts,
                                       max(1, sc.max_remote // max(1, others)))

    # ------------------------------------------------------------ plumbing

    def _verify(self, cid: bytes, data: Chunk) -> bool:
        # The simulator knows the true bytes: the same object is trivially right; any
        # other bytes (a malicious copy) are hashed for real.
        truth = self._truth_by_id.get(cid)
        return data is truth or chunk_id(data) == cid

    def _push(self, t: float, kind: int, a: int, b: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, payload))

    def _lat(self, a: int, b: int) -> float:
        r = self.topo.region
        return self.topo.latency[r[a]][r[b]]

    def _add_node(self, i: int) -> None:
        if i < self.hosts:
            # a host seeds its own share and fetches no other: a sharded trainer's hosts
            # need none of each other's chunks, so they are not linked to each other
            cfg = dataclasses.replace(self.trainer_config, fetch=False, broadcast_haves=True,
                                      rank_by_upload=True)
        else:
            # a node knows its own link: it sizes its in-flight window by its download and
            # its upload slots by its upload (about 12.5 MB/s per slot)
            slots = self.config.upload_slots
            if self.scale_slots:
                slots = max(2, min(slots, round(self.topo.up[i] / 12.5e6)))
            cfg = dataclasses.replace(
                self.config, download_rate=self.topo.down[i], upload_rate=self.topo.up[i],
                upload_slots=slots,
                remote_slots=max(1, min(self.config.remote_slots, slots // 3)),
                unchoke_remote=self.directory is not None, broadcast_haves=True,
                rank_by_upload=True,
                advertised_share=ADVERTISED_SHARE if self.directory is not None else 0.0)
        region = self.pop.scenario.regions[self.topo.region[i]]
        core = Exchange(self._names[i], region=region, config=cfg, seed=self.seed + i,
                        now=self.now, verifier=self._verify)
        d = self.directory
        if d is not None:
            core.use_directory(lambda obj, idx: d.rank(i, obj, idx), d.first_importer)
        self.cores[i] = core
        self.alive.add(i)
        self.links[i] = set()
        self._nbr[i] = {}
        self._fan[i] = {}
        self.up_active[i] = 0
        self.up_wait[i] = deque()
        if i < self.hosts:
            core.add_object(self.spec, self.now, {k: self.truth[k] for k in self._shares[i]})
        else:
            core.add_object(self.spec, self.now)

    def _link(self, a: int, b: int) -> None:
        if b in self.links[a]:
            return
        self.links[a].add(b)
        self.links[b].add(a)
        rtt = 2 * self._lat(a, b)
        ra, rb = self.topo.region[a], self.topo.region[b]
        self._nbr[a][self._names[b]] = (b, rb)
        self._nbr[b][self._names[a]] = (a, ra)
        self._fan[a].setdefault(rb, {})[b] = None
        self._fan[b].setdefault(ra, {})[a] = None
        names = self.pop.scenario.regions
        self.cores[a].connect(self._names[b], self.now, region=names[rb], rtt=rtt,
                              trainer=b < self.hosts, upload=self.topo.up[b],
                              download=self.topo.down[b])
        self.cores[b].connect(self._names[a], self.now, region=names[ra], rtt=rtt,
                              trainer=a < self.hosts, upload=self.topo.up[a],
                              download=self.topo.down[a])

    def _choose_neighbours(self, i: int, candidates: list[int]) -> None:
        sc = self.pop.scenario
        r = self.topo.region[i]
        if self.directory is not None:
            region = self.topo.region
            local = [j for j in candidates
                     if j != i and region[j] == r and j not in self.links[i]]
            self.rng.shuffle(local)
            have = sum(1 for j in self.links[i] if j >= self.hosts and region[j] == r)
            for j in local[: max(0, sc.max_local - have)]:
                self._link(i, j)
            present = set(candidates)
            for j in self.directory.remote_neighbours(i):
                if j in present:
                    self._link(i, j)
            return
        local = [j for j in candidates if j != i and self.topo.region[j] == r]
        remote = [j for j in candidates if j != i and self.topo.region[j] != r]
        self.rng.shuffle(local)
        self.rng.shuffle(remote)
        for j in local[: sc.max_local]:
            self._link(i, j)
        for j in remote[: sc.max_remote]:
            self._link(i, j)

    def _unlink(self, a: int, b: int) -> None:
        if b not in self.links.get(a, set()):
            return
        self.links[a].discard(b)
        self.links.get(b, set()).discard(a)
        self._nbr[a].pop(self._names[b], None)
        self._nbr.get(b, {}).pop(self._names[a], None)
        self._fan[a].get(self.topo.region[b], {}).pop(b, None)
        self._fan.get(b, {}).get(self.topo.region[a], {}).pop(a, None)
        for src, dst in ((a, b), (b, a)):
            slot = self.busy.pop((src, dst), None)
            if slot is not None:
                self.net.advance(self.now)
                self.net.cancel(slot)
                self.flow_of.pop(slot, None)
                self.up_active[src] -= 1
                if src in self.alive:
                    self._serve(src)

    def _pump(self, i: int) -> None:
        core = self.cores[i]
        out = core.take_outgoing()
        if out:
            # one heap entry per destination region: the messages a node sends in one go
            # reach a region after the same latency, so they are delivered together, in
            # order (messages to nodes it is no longer linked with are dropped)
            # (a have to every neighbour is one entry per region, with its receivers)
            nbr = self._nbr[i]
            batches: dict[int, list[tuple[int, Message, tuple[int, ...] | None]]] = {}
            for name, msg in out:
                if not name:
                    for reg, fan in self._fan[i].items():
                        if fan:
                            batch = batches.get(reg)
                            if batch is None:
                                batches[reg] = batch = []
                            batch.append((-1, msg, tuple(fan)))
                    continue
                e = nbr.get(name)
                if e is not None:
                    batch = batches.get(e[1])
                    if batch is None:
                        batches[e[1]] = batch = []
                    batch.append((e[0], msg, None))
            lat = self.topo.latency[self.topo.region[i]]
            for reg, batch in batches.items():
                self._push(self.now + lat[reg], _MSG, i, 0, batch)
        ready = core.take_upload_ready()
        if ready:
            wait = self.up_wait[i]
            for name in sorted(ready):
                j = self._index[name]
                if j not in wait:
                    wait.append(j)
            self._serve(i)
        events = core.take_events()
        if events:
            self._on_events(i, events)
        t = core.next_timer()
        if t is not None:
            soonest = self.now + 1e-6
            if t < soonest:
                t = soonest
            cur = self.timer_at.get(i)
            if cur is None or t < cur:
                self.timer_at[i] = t
                self.seq += 1
                heapq.heappush(self.heap, (t, self.seq, _TIMER, i, i, t))

    def _on_events(self, i: int, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, ObjectComplete):
                self.done.setdefault(i, ev.at)
                self._changed = True
            elif isinstance(ev, PeerBanned):
                self.bans.append((self._names[i], ev.peer, ev.reason))
                self._drop_link(i, self._index[ev.peer])
            elif isinstance(ev, PeerTimedOut):
                self.timeouts += 1
                self._drop_link(i, self._index[ev.peer])
            elif isinstance(ev, PeerDropped):
                self._drop_link(i, self._index[ev.peer])

    def _drop_link(self, i: int, j: int) -> None:
        """``i`` dropped ``j``: close the connection; ``j`` notices after the latency."""
        if j in self.links[i]:
            self._unlink(i, j)
            if j in self.alive:
                self._push(self.now + self._lat(i, j), _GONE, i, j, None)

    def _serve(self, i: int) -> None:
        """Start uploads from ``i`` while it has fewer than ``upload_concurrency`` going:
        an application-level upload scheduler that sends a few pieces at a time at full
        speed (to the connection the core ranks first, see ``upload_priority``) instead
        of splitting the uplink over every request at once."""
        core = self.cores[i]
        wait = self.up_wait[i]
        limit = self.up_conc_trainer if i < self.hosts else self.up_conc
        while self.up_active[i] < limit and wait:
            j = min(wait, key=lambda k: (core.upload_priority(self._names[k]), k))
            wait.remove(j)
            if j not in self.links[i] or (i, j) in self.busy:
                continue
            piece = core.next_upload(self._names[j], self.now)
            if piece is None:
                continue
            if i < self.hosts and piece.index not in self._shares[i]:
                self.host_stray += 1
            if i in self.pop.malicious:
                bad = bytearray(piece.data)
                bad[len(bad) // 2] ^= 0x5A
                piece = Piece(piece.obj, piece.index, bytes(bad))
            self.net.advance(self.now)
            slot = self.net.start(i, j, len(piece.data) + 48)
            self.busy[(i, j)] = slot
            self.flow_of[slot] = (i, j, piece)
            self.up_active[i] += 1

    # ------------------------------------------------------------ run

    def run(self) -> SwarmResult:
        wall0 = time.perf_counter()
        sc = self.pop.scenario
        hosts = range(self.hosts)
        peers = self.pop.peers
        for i in [*hosts, *peers]:
            self._add_node(i)
        for i in peers:
            for h in hosts:
                self._link(h, i)
        for i in peers:
            self._choose_neighbours(i, peers)
        next_join = self.hosts + self.pop.initial
        for ev in sc.churn:
            if ev.kind == "join":
                for _ in range(ev.count):
                    self._push(ev.at, _CHURN, next_join, 0, "join")
                    next_join += 1
            else:
                self._push(ev.at, _CHURN, 0, ev.count, ev.kind)
        for i in [*hosts, *peers]:
            self._pump(i)
        honest = self._honest()
        last_report = -1.0
        while self.events < MAX_EVENTS:
            nxt = self.net.next_completion()
            t_heap = self.heap[0][0] if self.heap else None
            if nxt is None and t_heap is None:
                break
            if nxt is not None and (t_heap is None or nxt[0] <= t_heap):
                t = nxt[0]
                if t > self.max_time:
                    break
                self.net.advance(t)
                self.now = t
                if nxt[1] >= 0:
                    self._flow_done(nxt[1])
            else:
                assert t_heap is not None
                if t_heap > self.max_time:
                    break
                t, _, kind, a, b, payload = heapq.heappop(self.heap)
                self.now = t  # the network catches up lazily, when a flow changes
                self._handle(kind, a, b, payload)
            self.events += 1
            if self.progress is not None and self.now - last_report >= 0.05:
                last_report = self.now
                self.progress(self.now, len(self.done.keys() & honest), len(honest))
            if self._changed:
                self._changed = False
                honest = self._honest()
                if honest and honest <= self.done.keys() and not self._pending_churn():
                    break
        return self._result(wall0)

    def _pending_churn(self) -> bool:
        return any(kind == _CHURN for _, _, kind, _, _, _ in self.heap)

    def _honest(self) -> set[int]:
        return {i for i in self.alive if i >= self.hosts and i not in self.pop.malicious}

    def _flow_done(self, slot: int) -> None:
        i, j, piece = self.flow_of.pop(slot)
        self.net.finish(slot)
        del self.busy[(i, j)]
        self.up_active[i] -= 1
        self._push(self.now + self._lat(i, j), _PIECE, i, j, piece)
        if (j in self.links[i] and self.cores[i].upload_queued(self._names[j])
                and j not in self.up_wait[i]):
            self.up_wait[i].append(j)
        self._serve(i)

    def _handle(self, kind: int, a: int, b: int, payload: object) -> None:
        if kind == _TIMER:
            if self.timer_at.get(a) != payload or a not in self.alive:
                return
            del self.timer_at[a]
            self.cores[a].handle_timer(self.now)
            self._pump(a)
        elif kind == _MSG:
            assert isinstance(payload, list)
            name = self._names[a]
            alive, links, cores, now = self.alive, self.links, self.cores, self.now
            always = self.pump_always
            prev = -1
            core: Exchange | None = None
            dirty = False
            for j, msg, fan in payload:
                if fan is not None:
                    # one have to each of these: handle it and pump at once
                    if dirty:
                        self._pump(prev)
                        dirty = False
                    prev = -1
                    core = None
                    have = cast(Have, msg)
                    for k in fan:
                        if k in alive and a in links[k] and (
                                cores[k].receive_have(name, have, now) or always):
                            self._pump(k)
                    continue
                if j != prev:
                    # several messages to one node in a row: handle them all, then pump
                    # (pumping may drop links, so each run checks its link again)
                    if dirty:
                        self._pump(prev)
                        dirty = False
                    prev = j
                    core = cores[j] if j in alive and a in links[j] else None
                if core is not None:
                    core.receive(name, msg, now)
                    # most messages are haves that only update the receiver's books; what
                    # pending() reports stays until it is taken, so one yes is enough
                    if not dirty and (always or core.pending()):
                        dirty = True
            if dirty:
                self._pump(prev)
        elif kind == _PIECE:
            if b not in self.alive or a not in self.links[b]:
                return
            assert isinstance(payload, Message)
            self.cores[b].receive(self._names[a], payload, self.now)
            self._pump(b)
        elif kind == _GONE:
            if b in self.alive:
                self._unlink(b, a)
                self.cores[b].disconnect(self._names[a], self.now)
                self._pump(b)
        elif kind == _CHURN:
            self._churn(a, b, str(payload))

    def _churn(self, a: int, b: int, what: str) -> None:
        self._changed = True
        if what == "join":
            self._add_node(a)
            for h in range(self.hosts):
                self._link(h, a)
            present = sorted(i for i in self.alive if i >= self.hosts and i != a)
            self._choose_neighbours(a, present)
            self._pump(a)
            for j in self.links[a]:
                self._pump(j)
            return
        victims = sorted(i for i in self.alive if i >= self.hosts and i not in self.done)
        self.rng.shuffle(victims)
        for v in victims[:b]:
            self.alive.discard(v)
            self.timer_at.pop(v, None)
            for j in list(self.links[v]):
                self._unlink(v, j)
                if what == "leave":
                    self._push(self.now + self._lat(v, j), _GONE, v, j, None)

    def _result(self, wall0: float) -> SwarmResult:
        self.net.advance(max(self.now, self.net.now))
        honest = self._honest()
        complete = honest <= self.done.keys()
        completion = max((self.done[i] for i in honest), default=0.0) if complete else None
        exact = complete
        if exact:
            for i in honest:
                core = self.cores[i]
                for k, cid in enumerate(self.spec.chunk_ids):
                    data = core.chunk(self.spec.obj, k)
                    if data is None or not self._verify(cid, data):
                        exact = False
                        break
        up = self.net.node_up_bytes
        r = self.topo.n_regions
        into = [float(sum(self.net.region_bytes[s][d] for s in range(r) if s != d))
                for d in range(r)]
        per_region: dict[int, float] = {}
        for i in honest & self.done.keys():
            reg = self.topo.region[i]
            per_region[reg] = max(per_region.get(reg, 0.0), self.done[i])
        return SwarmResult(
            completion_s=completion,
            peer_done={i: self.done[i] for i in sorted(self.done)},
            trainer_egress=float(sum(up[:self.hosts])),
            region_in=into,
            bans=self.bans,
            bit_exact=exact,
            honest_done=len(honest & self.done.keys()),
            honest_total=len(honest),
            timeouts=self.timeouts,
            wasted_bytes=sum(c.bytes_wasted for c in self.cores.values()),
            events=self.events,
            wall_s=time.perf_counter() - wall0,
            flows_recomputed=self.net.recomputes,
            per_region_done=per_region,
            host_egress=[float(x) for x in up[:self.hosts]],
            host_stray=self.host_stray,
        )
