"""Lower bounds on the time to give every peer ``F`` bytes held only by the trainer.

Kumar and Ross (2006): ``T >= max(F/u_s, F/d_min, N*F/(u_s + sum u_i))`` where ``u_s``
is the trainer's upload, ``d_min`` the slowest download and the last term the total
upload capacity. With shared WAN links a cut bound adds: every region without the trainer
must receive ``F`` across the links into it, so ``T >= F / sum_a wan[a][r]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.sim.network import Topology


@dataclass(frozen=True, slots=True)
class LowerBound:
    terms: dict[str, float]
    """Each term, in seconds: ``source``, ``slowest_download``, ``total_upload``, and
    ``wan_cut:<region>`` per region."""

    @property
    def seconds(self) -> float:
        return max(self.terms.values())

    @property
    def binding(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


def lower_bound(topo: Topology, peers: list[int], nbytes: float,
                region_names: tuple[str, ...]) -> LowerBound:
    """The bound for delivering ``nbytes`` from node 0 (the trainer) to ``peers``."""
    if not peers:
        return LowerBound({"source": 0.0})
    u_s = topo.up[0]
    terms = {
        "source": nbytes / u_s,
        "slowest_download": nbytes / min(topo.down[i] for i in peers),
        "total_upload": len(peers) * nbytes / (u_s + sum(topo.up[i] for i in peers)),
    }
    t_region = topo.region[0]
    for r in sorted({topo.region[i] for i in peers}):
        if r == t_region:
            continue
        cap = sum(topo.wan[a][r] for a in range(topo.n_regions) if a != r)
        terms[f"wan_cut:{region_names[r]}"] = nbytes / cap
    return LowerBound(terms)
