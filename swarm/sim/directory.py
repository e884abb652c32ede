"""Import ranks over whole regions, from the swarm's directory, and remote links by group.

Ranked over a peer's own same-region neighbours, as the exchange core does by default,
each chunk has about one first importer per neighbourhood: a region of 256 peers, each
with 32 to 64 region-mates as neighbours, imported each chunk 4 to 8 times across the WAN
(2.2-3.7x the payload into each region at 1024 peers). Ranked over the whole region (the
directory lists every member and its region), each chunk has one first importer per
region, but that peer seldom has a neighbour elsewhere that holds the chunk early, and the
next rank waits its turn.

Here both sides agree on groups: each region's members are dealt round robin (in key
order) into ``G`` groups, ``G`` the smallest region's size over the group size (the
remote neighbours a peer keeps per other region), and chunk ``i`` belongs to group
``hash(i) mod G``. A peer's remote neighbours are its group-mates in every other region;
in each region the chunk's group ranks first for it (weighted rendezvous by upload, as
:func:`~swarm.protocol.picker.import_rank`), the other members after them. So the first
importer of a chunk in a region is linked to its first importer in every other region,
and to the trainer's first copy (super-seeding hands a chunk's first copy to a region's
first importer).
"""

from __future__ import annotations

import zlib

from swarm.protocol import picker
from swarm.sim.network import Topology


class Directory:
    """Groups, remote neighbours and import ranks of the peers ``first ..`` of ``topo``."""

    def __init__(self, topo: Topology, names: list[str], region_names: tuple[str, ...],
                 first: int, per_group: int) -> None:
        self.topo = topo
        self.names = names
        self._region_index = {name: r for r, name in enumerate(region_names)}
        self.keys = [picker.peer_key(n) for n in names]
        members: dict[int, list[int]] = {}
        for i in range(first, topo.n_nodes):
            members.setdefault(topo.region[i], []).append(i)
        self.members = {r: sorted(m, key=lambda i: (self.keys[i], i))
                        for r, m in members.items()}
        smallest = min((len(m) for m in self.members.values()), default=1)
        self.groups = max(1, smallest // max(1, per_group))
        self.group_of: dict[int, int] = {}
        self.by_group: dict[tuple[int, int], list[int]] = {}
        for r, m in self.members.items():
            for pos, i in enumerate(m):
                g = pos % self.groups
                self.group_of[i] = g
                self.by_group.setdefault((r, g), []).append(i)
        self._ranks: dict[tuple[int, bytes, int], dict[int, int]] = {}
        self._first: dict[tuple[int, bytes, int], int | None] = {}

    def chunk_group(self, obj: bytes, index: int) -> int:
        return zlib.crc32(b"group" + obj[:8] + index.to_bytes(4, "little")) % self.groups

    def remote_neighbours(self, i: int) -> list[int]:
        """``i``'s group-mates in the other regions."""
        g, r = self.group_of[i], self.topo.region[i]
        return [j for (rr, gg), js in sorted(self.by_group.items()) if gg == g and rr != r
                for j in js]

    def _order(self, r: int, obj: bytes, index: int) -> dict[int, int]:
        key = (r, obj, index)
        ranks = self._ranks.get(key)
        if ranks is None:
            g = self.chunk_group(obj, index)
            mine = self.by_group.get((r, g), [])
            rest = [i for i in self.members.get(r, []) if self.group_of[i] != g]
            order: list[int] = []
            for part in (mine, rest):
                keyed = [(self.keys[i], self.topo.up[i]) for i in part]
                order += [part[k] for k in picker.rendezvous_order(index, obj, keyed)]
            ranks = self._ranks[key] = {i: k for k, i in enumerate(order)}
            self._first[key] = order[0] if order else None
        return ranks

    def rank(self, i: int, obj: bytes, index: int) -> int:
        return self._order(self.topo.region[i], obj, index).get(i, 0)

    def first_importer(self, region: str, obj: bytes, index: int) -> int | None:
        """The key of ``region``'s first importer of the chunk."""
        r = self._region_index.get(region)
        if r is None:
            return None
        self._order(r, obj, index)
        first = self._first[(r, obj, index)]
        return None if first is None else self.keys[first]
