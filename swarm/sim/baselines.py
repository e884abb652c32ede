"""Baselines on the same flow network: fixed forwarding plans, no exchange protocol.

- ``dense``: the trainer unicasts the full bf16 state to every peer (PrimeRL-Full).
- ``unicast``: the trainer unicasts the sparse delta to every peer.
- ``relay``: the trainer sends the delta to one relay per region (the peer with the
  fastest uplink there), which forwards each chunk to the rest of its region as soon as
  it has it (the AuroraRL/SparrowRL arrangement).

Each directed connection sends one chunk at a time, in order; every sender runs at most
``concurrency`` uploads at once, round robin over its connections (as in the swarm run).
A trainer on ``hosts`` nodes (``0 .. hosts - 1``) has host ``h`` start with the ``h``-th
contiguous share of the chunks and send it along the trainer's routes.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from swarm.sim.network import FlowNetwork, Topology


@dataclass(frozen=True, slots=True)
class BaselineResult:
    name: str
    completion_s: float
    trainer_egress: float
    region_in: tuple[float, ...]
    payload: float
    """Bytes each peer had to receive under this plan."""
    peer_done: dict[int, float] = field(default_factory=dict)
    """When each peer held every chunk."""


def run_plan(name: str, topo: Topology, peers: list[int], sizes: list[int],
             routes: dict[int, list[int]], *, concurrency: int = 4,
             trainer_concurrency: int = 8, quantum: float = 0.002,
             hosts: int = 1) -> BaselineResult:
    """The trainer's hosts start with their shares of the chunks; a node forwards every
    chunk it gets along ``routes[node]``. Returns when every peer holds every chunk."""
    net = FlowNetwork(topo, quantum=quantum)
    queues: dict[tuple[int, int], deque[int]] = {}
    waiting: dict[int, deque[int]] = {}
    active: dict[int, int] = {}
    busy: dict[tuple[int, int], int] = {}
    flows: dict[int, tuple[int, int, int]] = {}
    have: dict[int, int] = {p: 0 for p in peers}
    arrivals: list[tuple[float, int, int]] = []
    done_at: dict[int, float] = {}
    now = 0.0

    def lat(a: int, b: int) -> float:
        return topo.latency[topo.region[a]][topo.region[b]]

    def enqueue(src: int, k: int) -> None:
        for dst in routes.get(src, []):
            q = queues.setdefault((src, dst), deque())
            q.append(k)
            w = waiting.setdefault(src, deque())
            if dst not in w and (src, dst) not in busy:
                w.append(dst)
        serve(src)

    def serve(src: int) -> None:
        w = waiting.get(src)
        limit = trainer_concurrency if src < hosts else concurrency
        while w and active.get(src, 0) < limit:
            dst = w.popleft()
            q = queues[(src, dst)]
            if not q or (src, dst) in busy:
                continue
            k = q.popleft()
            slot = net.start(src, dst, sizes[k])
            busy[(src, dst)] = slot
            flows[slot] = (src, dst, k)
            active[src] = active.get(src, 0) + 1

    n = len(sizes)
    for h in range(hosts):
        for k in range(h * n // hosts, (h + 1) * n // hosts):
            enqueue(h, k)
    seq = 0
    for _ in range(10 * len(sizes) * max(1, len(peers)) + 100):
        nxt = net.next_completion()
        t_arr = arrivals[0][0] if arrivals else None
        if nxt is None and t_arr is None:
            break
        if nxt is not None and (t_arr is None or nxt[0] <= t_arr):
            now = nxt[0]
            net.advance(now)
            if nxt[1] < 0:
                continue
            src, dst, k = flows.pop(nxt[1])
            net.finish(nxt[1])
            del busy[(src, dst)]
            active[src] -= 1
            seq += 1
            heapq.heappush(arrivals, (now + lat(src, dst), dst, k))
            if queues[(src, dst)]:
                waiting.setdefault(src, deque()).append(dst)
            serve(src)
        else:
            now, dst, k = heapq.heappop(arrivals)
            net.advance(now)
            have[dst] += 1
            if have[dst] == len(sizes):
                done_at[dst] = now
            enqueue(dst, k)
    r = topo.n_regions
    into = tuple(float(sum(net.region_bytes[s][d] for s in range(r) if s != d))
                 for d in range(r))
    completion = max(done_at.values()) if len(done_at) == len(peers) else float("inf")
    return BaselineResult(name, completion, float(sum(net.node_up_bytes[:hosts])), into,
                          float(sum(sizes)), dict(sorted(done_at.items())))


def _split(nbytes: int, hosts: int) -> list[int]:
    """``nbytes`` as one piece per host."""
    q, r = divmod(nbytes, hosts)
    return [q + (h < r) for h in range(hosts)]


def dense(topo: Topology, peers: list[int], dense_bytes: int, *, hosts: int = 1,
          streams: int = 0, name: str = "dense bf16 broadcast", **kw: int
          ) -> BaselineResult:
    """The full bf16 state from the trainer to every peer (per host: its shard), over
    ``streams`` transfers at once per host (0: one per peer at once; 1: one peer after
    another)."""
    return run_plan(name, topo, peers, _split(dense_bytes, hosts),
                    {h: list(peers) for h in range(hosts)},
                    trainer_concurrency=streams or max(1, len(peers)), hosts=hosts, **kw)


def unicast(topo: Topology, peers: list[int], sizes: list[int], *, hosts: int = 1,
            **kw: int) -> BaselineResult:
    """The sparse delta from the trainer to every peer, as one stream each (per host:
    its share)."""
    return run_plan("trainer-only unicast", topo, peers, _split(sum(sizes), hosts),
                    {h: list(peers) for h in range(hosts)},
                    trainer_concurrency=max(1, len(peers)), hosts=hosts, **kw)


def relay(topo: Topology, peers: list[int], sizes: list[int], *, hosts: int = 1,
          **kw: int) -> BaselineResult:
    """One relay per region (the fastest uplink there) fans each chunk out in-region."""
    by_region: dict[int, list[int]] = {}
    for p in peers:
        by_region.setdefault(topo.region[p], []).append(p)
    heads: list[int] = []
    routes: dict[int, list[int]] = {}
    for members in by_region.values():
        head = max(members, key=lambda p: (topo.up[p], -p))
        heads.append(head)
        routes[head] = [p for p in members if p != head]
    for h in range(hosts):
        routes[h] = list(heads)
    return run_plan("relay per region", topo, peers, sizes, routes, hosts=hosts, **kw)
