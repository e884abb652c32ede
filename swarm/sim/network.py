"""A fluid network model: nodes with up/down capacities in regions joined by shared WAN links.

Transfers are flows. Every flow crosses its sender's uplink, its receiver's downlink and,
between regions, the directed WAN link of that region pair; concurrent flows share those
capacities max-min fairly (progressive filling, vectorised with numpy; resources whose
fair shares lie within ``tolerance`` of the bottleneck are frozen together, which errs
slightly on the slow side). Rates are recomputed whenever the set of flows changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Topology:
    """Capacities in bytes per second, one-way latencies in seconds."""

    up: tuple[float, ...]
    down: tuple[float, ...]
    region: tuple[int, ...]
    wan: tuple[tuple[float, ...], ...]
    """``wan[a][b]``: capacity of the directed link from region ``a`` to region ``b``."""
    latency: tuple[tuple[float, ...], ...]
    """``latency[a][b]``: one-way delay between regions (``latency[a][a]`` inside one)."""

    @property
    def n_nodes(self) -> int:
        return len(self.up)

    @property
    def n_regions(self) -> int:
        return len(self.wan)


class FlowNetwork:
    """Active flows, their fair rates, and byte counters per node and region pair.

    Draining is lazy: between two recomputations every rate is fixed, so the remaining
    bytes are stored as of the last recomputation (``_t0``) and only brought forward
    when rates change; :meth:`advance` just moves the clock, and a flow's bytes are
    credited to the counters when it finishes or is cancelled (the counters add the
    partial bytes of the flows still going when read).
    """

    def __init__(self, topo: Topology, tolerance: float = 0.02, quantum: float = 0.0) -> None:
        self.topo = topo
        self.tolerance = tolerance
        self.quantum = quantum
        self._last_recompute = -1.0
        n, r = topo.n_nodes, topo.n_regions
        self._n, self._r = n, r
        wan = np.array(topo.wan, dtype=np.float64).reshape(r * r)
        self._cap = np.concatenate([np.array(topo.up, np.float64),
                                    np.array(topo.down, np.float64), wan])
        self._region = np.array(topo.region, dtype=np.int64)
        self._region_of = topo.region
        size = 64
        self._src = np.zeros(size, np.int64)
        self._dst = np.zeros(size, np.int64)
        self._rem = np.zeros(size, np.float64)
        self._rate = np.zeros(size, np.float64)
        self._active = np.zeros(size, bool)
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._n_active = 0
        self._dirty = False
        self._stale = False
        self._next: tuple[float, int] | None = None
        self.now = 0.0
        self._t0 = 0.0
        """Time at which ``_rem`` is exact (the last recomputation)."""
        self._up = np.zeros(n, np.float64)
        self._down = np.zeros(n, np.float64)
        self._pairs = np.zeros((r, r), np.float64)
        self.recomputes = 0

    # ------------------------------------------------------------ flows

    def start(self, src: int, dst: int, nbytes: int) -> int:
        """Start a flow; returns its slot id (valid until it completes or is cancelled).

        It runs at rate 0 until the next recomputation, so it cannot be the next to
        finish: the cached next completion stays valid."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._src[slot], self._dst[slot] = src, dst
        self._rem[slot] = float(max(nbytes, 1))
        self._rate[slot] = 0.0
        self._active[slot] = True
        self._n_active += 1
        self._dirty = True
        return slot

    def cancel(self, slot: int) -> None:
        """Stop a flow early (a node crashed): the bytes already sent stay counted."""
        if self._active[slot]:
            self._retire(slot)

    def _retire(self, slot: int) -> tuple[int, int]:
        src, dst = int(self._src[slot]), int(self._dst[slot])
        rate = float(self._rate[slot])
        if rate > 0.0:
            sent = min(rate * (self.now - self._t0), float(self._rem[slot]))
            if sent > 0.0:
                self._up[src] += sent
                self._down[dst] += sent
                reg = self._region_of
                self._pairs[reg[src], reg[dst]] += sent
        self._active[slot] = False
        self._rate[slot] = 0.0
        self._free.append(slot)
        self._n_active -= 1
        self._dirty = True
        nxt = self._next
        if nxt is not None and nxt[1] == slot:
            self._stale = True
        return src, dst

    def _grow(self) -> None:
        old = len(self._src)
        new = old * 2
        for name in ("_src", "_dst", "_rem", "_rate", "_active"):
            arr = getattr(self, name)
            grown = np.zeros(new, arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        self._free.extend(range(new - 1, old - 1, -1))

    @property
    def n_active(self) -> int:
        return self._n_active

    def advance(self, t: float) -> None:
        """Move time to ``t`` (flows drain at their current rates, see the class)."""
        if t < self.now:
            raise ValueError("time runs forward")
        self.now = t

    def _moved(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, bytes each active flow sent since ``_t0``)."""
        idx = np.flatnonzero(self._active)
        dt = self.now - self._t0
        if not len(idx) or dt <= 0:
            return idx, np.zeros(len(idx))
        return idx, np.minimum(self._rate[idx] * dt, self._rem[idx])

    def _drain(self) -> None:
        """Bring ``_rem`` and the counters forward to ``now``."""
        idx, moved = self._moved()
        if len(idx) and moved.any():
            self._rem[idx] -= moved
            self._credit(idx, moved, self._up, self._down, self._pairs)
        self._t0 = self.now

    def _credit(self, idx: np.ndarray, moved: np.ndarray, up: np.ndarray, down: np.ndarray,
                pairs: np.ndarray) -> None:
        src, dst = self._src[idx], self._dst[idx]
        n, r = self._n, self._r
        up += np.bincount(src, moved, minlength=n)
        down += np.bincount(dst, moved, minlength=n)
        pair = self._region[src] * r + self._region[dst]
        pairs += np.bincount(pair, moved, minlength=r * r).reshape(r, r)

    def _counters(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        up, down, pairs = self._up.copy(), self._down.copy(), self._pairs.copy()
        idx, moved = self._moved()
        if len(idx):
            self._credit(idx, moved, up, down, pairs)
        return up, down, pairs

    @property
    def node_up_bytes(self) -> np.ndarray:
        """Bytes each node has sent, up to ``now``."""
        return self._counters()[0]

    @property
    def node_down_bytes(self) -> np.ndarray:
        """Bytes each node has received, up to ``now``."""
        return self._counters()[1]

    @property
    def region_bytes(self) -> np.ndarray:
        """``region_bytes[a][b]``: bytes sent from region ``a`` to region ``b``."""
        return self._counters()[2]

    def next_completion(self) -> tuple[float, int] | None:
        """(time, slot) of the flow that finishes first at current rates.

        With a ``quantum``, rates are recomputed at most once per quantum of time: in
        between, new flows wait at rate 0 and the others keep their rates (always
        feasible, slightly slow). Slot ``-1`` then marks a tick with no completion: the
        caller advances to it and asks again.
        """
        if self._dirty and self.now >= self._last_recompute + self.quantum:
            self._last_recompute = self.now
            self._drain()
            self._recompute()
            self._stale = True
        if self._stale:
            # fixed rates keep the order of finishing: cache until a rate changes or the
            # cached flow leaves
            self._stale = False
            idx = np.flatnonzero(self._rate > 0)
            if len(idx):
                eta = self._rem[idx] / self._rate[idx]
                k = int(np.argmin(eta))
                self._next = (self._t0 + float(eta[k]), int(idx[k]))
            else:
                self._next = None
        if self._dirty:
            due = self._last_recompute + self.quantum
            if self._next is None or self._next[0] > due:
                return due, -1
        return self._next

    def finish(self, slot: int) -> tuple[int, int]:
        """Retire a completed flow; returns (src, dst)."""
        return self._retire(slot)

    # ------------------------------------------------------------ fair sharing

    def _recompute(self) -> None:
        self._dirty = False
        self.recomputes += 1
        idx = np.flatnonzero(self._active)
        if not len(idx):
            return
        n, r = self._n, self._r
        src, dst = self._src[idx], self._dst[idx]
        rs, rd = self._region[src], self._region[dst]
        cross = rs != rd
        f = len(idx)
        pos = np.arange(f)
        fr = np.concatenate([pos, pos, pos[cross]])
        rr = np.concatenate([src, n + dst, 2 * n + rs[cross] * r + rd[cross]])
        # only the resources some flow crosses, renumbered: the others never bind
        uniq, rr = np.unique(rr, return_inverse=True)
        cap = self._cap[uniq]
        nres = len(uniq)
        rate = np.zeros(f)
        frozen = np.zeros(f, bool)
        share = np.empty(nres)
        slack = 1 + self.tolerance
        level_sum = 0.0
        # (fr, rr) keep only the entries of flows not frozen yet, so each round is cheaper;
        # a flow's rate is the sum of the levels up to the round that froze it
        for _ in range(nres + 1):
            if not len(fr):
                break
            cnt = np.bincount(rr, minlength=nres)
            used = cnt > 0
            share.fill(np.inf)
            np.divide(np.maximum(cap, 0.0), cnt, out=share, where=used)
            level = float(share.min())
            level_sum += level
            cap -= level * cnt
            tight = share <= level * slack + 1e-9
            tight &= used
            hit = fr[tight[rr]]
            frozen[hit] = True
            rate[hit] = level_sum
            live = ~frozen[fr]
            fr, rr = fr[live], rr[live]
        self._rate[idx] = rate
