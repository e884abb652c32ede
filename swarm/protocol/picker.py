"""Piece picking: rarest-first order, import ranks, and catch-up planning (pure functions).

Nothing here keeps time or does I/O; :mod:`swarm.protocol.exchange` calls these with its
own state and clock.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarm.content.manifest import Manifest


def tiebreak(salt: int, index: int) -> int:
    """A deterministic per-node pseudo-random key for ``index`` (spreads equal rarities)."""
    return zlib.crc32(index.to_bytes(4, "little"), salt & 0xFFFFFFFF)


def rarest_first(missing: Iterable[int], local: Sequence[int], availability: Sequence[int],
                 salt: int, suggested: frozenset[int] | set[int] = frozenset(),
                 tiebreaks: Sequence[int] | None = None) -> list[int]:
    """Missing chunk indices in the order to fetch them.

    Suggested ones first; then fewest holders in my own region (a chunk the region lacks
    must be imported, and the region's designated importer should start at once); then
    fewest holders overall. Chunks nobody offers come last, so a caller can still ask the
    source of last resort for them. Ties are broken by a per-node hash so that
    neighbours with the same view do not all ask for the same chunk; ``tiebreaks[i]``,
    when given, must be ``tiebreak(salt, i)`` (precomputed by a caller that sorts often).
    """
    if tiebreaks is None:
        return sorted(missing, key=lambda i: (i not in suggested, availability[i] == 0,
                                              local[i], availability[i], tiebreak(salt, i)))
    tb = tiebreaks
    # keys built in one pass and sorted in place (the position keeps the sort stable):
    # cheaper than a key function called per chunk, and the same order
    keyed = [(i not in suggested, availability[i] == 0, local[i], availability[i], tb[i],
              pos, i) for pos, i in enumerate(missing)]
    keyed.sort()
    return [k[-1] for k in keyed]


def peer_key(peer: str) -> int:
    """A stable 32-bit key of a peer id, for :func:`import_rank`."""
    return zlib.crc32(peer.encode())


def _rank_salt(index: int, obj: bytes) -> int:
    return zlib.crc32(obj[:8] + index.to_bytes(4, "little"))


def _mix(k: int, salt: int) -> int:
    x = (k ^ salt) * 0x9E3779B1 & 0xFFFFFFFF
    x ^= x >> 15
    return x * 0x85EBCA77 & 0xFFFFFFFF


def _score(key: int, weight: float, salt: int) -> float:
    # weighted rendezvous hashing: -w / ln(u), u uniform in (0, 1)
    u = (_mix(key, salt) + 0.5) / 4294967296.0
    return -max(weight, 1e-9) / math.log(u)


def import_rank(me: tuple[int, float], index: int, obj: bytes,
                local_peers: Iterable[tuple[int, float]]) -> int:
    """My rank among ``local_peers`` ((key, weight) of my same-region neighbours).

    Weighted rendezvous hashing: every peer of a region computes the same order over the
    region's members for each chunk, so the rank-0 peer imports the chunk across the WAN
    at once and the others wait for it to appear in the region (each rank waits a little
    longer), which keeps cross-region bytes near one copy per region. The weight is a
    peer's upload capacity: the first holder in a region must serve the rest, so fast
    peers import proportionally more. Keys come from :func:`peer_key`.
    """
    salt = _rank_salt(index, obj)
    mine = (_score(me[0], me[1], salt), me[0])
    return sum(1 for k, w in local_peers if k != me[0] and (_score(k, w, salt), k) >= mine)


def importer(index: int, obj: bytes, members: Iterable[tuple[int, float]]) -> int | None:
    """The key of the rank-0 importer of chunk ``index`` among a region's ``members``."""
    salt = _rank_salt(index, obj)
    best = max(members, key=lambda m: (_score(m[0], m[1], salt), m[0]), default=None)
    return None if best is None else best[0]


def rendezvous_order(index: int, obj: bytes, members: Sequence[tuple[int, float]]
                     ) -> list[int]:
    """Positions in ``members`` ((key, weight)) in import-rank order for chunk ``index``:
    the ``k``-th is that of the member whose :func:`import_rank` among them is ``k``."""
    salt = _rank_salt(index, obj)
    scored = sorted(((_score(k, w, salt), k, pos) for pos, (k, w) in enumerate(members)),
                    reverse=True)
    return [pos for _, _, pos in scored]


def pipeline_depth(rate: float, rtt: float, chunk_bytes: int, lo: int, hi: int) -> int:
    """Requests to keep in flight to one neighbour: its bandwidth-delay product in chunks,
    plus one so the link never idles while the next request travels."""
    if chunk_bytes <= 0:
        return lo
    bdp = rate * (rtt + chunk_bytes / max(rate, 1.0)) / chunk_bytes
    return max(lo, min(hi, int(bdp) + 1))


@dataclass(frozen=True, slots=True)
class CatchUpPlan:
    """How a node behind the head reaches ``target_step``.

    ``kind`` is ``"chain"`` (apply ``steps`` deltas in order), ``"state"`` (fetch the
    pieces of the current state) or ``"none"`` (already there). ``nbytes`` is what it
    must download; ``chain_bytes`` is ``None`` when the chain is broken or not retained.
    """

    kind: str
    steps: tuple[int, ...]
    nbytes: int
    chain_bytes: int | None
    state_bytes: int


def plan_catch_up(local_step: int, local_root: bytes, target_step: int,
                  deltas: Mapping[int, Manifest], state_bytes: int) -> CatchUpPlan:
    """Choose the cheaper of the delta chain ``local_step -> target_step`` and the state.

    ``deltas[s]`` is the manifest of the delta ``s-1 -> s`` where one is retained; the
    chain counts only when every link is present and each base root is the previous
    target root (starting at ``local_root``).
    """
    if local_step == target_step:
        return CatchUpPlan("none", (), 0, 0, state_bytes)
    if local_step > target_step:
        raise ValueError("local step is ahead of the target")
    chain: int | None = 0
    root = local_root
    steps = tuple(range(local_step + 1, target_step + 1))
    for s in steps:
        m = deltas.get(s)
        if m is None or m.kind != "delta" or m.base_root != root or m.step != s:
            chain = None
            break
        assert chain is not None
        chain += m.total_bytes
        root = m.target_root
    if chain is not None and chain <= state_bytes:
        return CatchUpPlan("chain", steps, chain, chain, state_bytes)
    return CatchUpPlan("state", (target_step,), state_bytes, chain, state_bytes)
