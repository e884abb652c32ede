"""Lower bounds on the time to give every peer ``F`` bytes held only by the trainer.

Kumar and Ross (2006): ``T >= max(F/u_s, F/d_min, N*F/(u_s + sum u_i))`` where ``u_s``
is the trainer's upload, ``d_min`` the slowest download and the last term the total
upload capacity. With shared WAN links a cut bound adds: every region without the trainer
must receive ``F`` across the links into it, so ``T >= F / sum_a wan[a][r]``.

A trainer on several hosts, each holding a share of the bytes: the source term is the
slowest host's share over its upload, every host's upload adds to the total, and a
region receives across the WAN what its own hosts do not hold.

These are fluid bounds: bytes move at once. Counting propagation as well, no byte reaches
peer ``i`` before the one-way latency ``L_i`` from the nearest host, so
``T >= max_i (L_i + F/d_i)`` too (:attr:`LowerBound.latency_s`), which splits what
physics costs from what the protocol does.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.sim.network import Topology


@dataclass(frozen=True, slots=True)
class LowerBound:
    terms: dict[str, float]
    """Each term, in seconds: ``source``, ``slowest_download``, ``total_upload``, and
    ``wan_cut:<region>`` per region."""
    latency_s: float = 0.0
    """The slowest download started after the one-way latency from the nearest host."""

    @property
    def seconds(self) -> float:
        return max(self.terms.values())

    @property
    def with_latency(self) -> float:
        """The bound counting propagation: the larger of :attr:`seconds` and
        :attr:`latency_s`."""
        return max(self.seconds, self.latency_s)

    @property
    def binding(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


def lower_bound(topo: Topology, peers: list[int], nbytes: float,
                region_names: tuple[str, ...],
                sources: dict[int, float] | None = None) -> LowerBound:
    """The bound for delivering ``nbytes`` to ``peers`` from ``sources`` (node -> the
    bytes only it holds; default: node 0, the trainer, holds all of them)."""
    if not peers:
        return LowerBound({"source": 0.0})
    shares = sources if sources is not None else {0: nbytes}
    u_s = sum(topo.up[h] for h in shares)
    terms = {
        "source": max(b / topo.up[h] for h, b in shares.items()),
        "slowest_download": nbytes / min(topo.down[i] for i in peers),
        "total_upload": len(peers) * nbytes / (u_s + sum(topo.up[i] for i in peers)),
    }
    for r in sorted({topo.region[i] for i in peers}):
        inbound = nbytes - sum(b for h, b in shares.items() if topo.region[h] == r)
        if inbound <= 0:
            continue
        cap = sum(topo.wan[a][r] for a in range(topo.n_regions) if a != r)
        terms[f"wan_cut:{region_names[r]}"] = inbound / cap
    lat = max(min(topo.latency[topo.region[h]][topo.region[i]] for h in shares)
              + nbytes / topo.down[i] for i in peers)
    return LowerBound(terms, lat)
