"""A trainer seeder: the node of one rank (or host) of a sharded trainer, seeding its chunks.

A sharded trainer's versions come out of
:class:`~swarm.delta.sharded.ShardedPublisher`: one manifest, signed on the root rank by
the run's key, listing every rank's chunks, and naming the other ranks' nodes as seeders.
The root rank's :class:`~swarm.roles.trainer.TrainerNode` seeds its own chunks and runs
everything else (announcements, catch-up, leases). Every other rank runs a
:class:`SeederNode` on its own host and uplink: it holds that rank's chunks of the kept
versions and serves them as the trainer does (peers treat the nodes a manifest names as
the trainer in the exchange), so the trainer's upload capacity adds up across hosts.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from swarm.delta.sharded import ShardedVersion
from swarm.errors import LocalProtocolError
from swarm.identity import Identity, public_key_from_peer_id
from swarm.protocol.exchange import ExchangeConfig, ObjectSpec
from swarm.roles.common import Clock, Network, NodeBase

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeederConfig:
    run: str
    trainer: str
    """The trainer's peer id: the manifests seeded here must be signed by its key."""
    region: str = ""
    keep_versions: int = 16
    """Versions whose chunks stay served (the trainer's own ``keep_versions``)."""
    exchange: ExchangeConfig = field(default_factory=lambda: ExchangeConfig(
        unchoke_all=True, super_seed=True, fetch=False))
    """As the trainer's: it serves, and fetches nothing (the other ranks' chunks are
    theirs to seed)."""


class SeederNode(NodeBase):
    """Seeds one rank's chunks of a sharded trainer's versions. An async context manager."""

    def __init__(self, identity: Identity, net: Network, config: SeederConfig,
                 clock: Clock | None = None) -> None:
        super().__init__(net, region=config.region, exchange_config=config.exchange,
                         clock=clock, name="seeder")
        if config.keep_versions < 1:
            raise LocalProtocolError("keep_versions must be at least 1")
        self.identity = identity
        self.config = config
        self.trainer_key = public_key_from_peer_id(config.trainer)
        self._kept: deque[bytes] = deque()
        self.step = -1

    async def __aenter__(self) -> SeederNode:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def seed(self, version: ShardedVersion) -> None:
        """Serve this rank's chunks of ``version`` (and of the last ``keep_versions``).

        :raises LocalProtocolError: not a delta the trainer signed that names this node
            as a seeder, or chunks that are not the manifest's.
        """
        sm = version.manifest
        if sm is None:
            raise LocalProtocolError("a started version has no chunks to seed")
        m = sm.manifest
        if m.signer != self.trainer_key or m.run != self.config.run or not sm.verify():
            raise LocalProtocolError(f"step {m.step} is not signed by the trainer "
                                     f"{self.config.trainer} for run {self.config.run!r}")
        if self.identity.public_key not in m.seeders and version.chunks:
            raise LocalProtocolError(f"step {m.step} does not name this node "
                                     f"({self.identity.peer_id}) as a seeder")
        if any(not 0 <= i < len(m.chunks) or len(data) != m.chunks[i][1]
               for i, data in version.chunks.items()):
            raise LocalProtocolError(f"step {m.step}: chunks that are not the manifest's")
        spec = ObjectSpec.from_manifest(sm)
        if version.chunks and not self.driver.has_object(spec.obj):
            self.driver.add_object(spec, version.chunks)
            self._kept.append(spec.obj)
        while len(self._kept) > self.config.keep_versions:
            self.driver.drop({self._kept.popleft()})
        self.step = m.step
        log.info("seeding %d of %d chunks of step %d", len(version.chunks), len(m.chunks),
                 m.step)

    @property
    def bytes_up(self) -> int:
        return self.driver.exchange.bytes_up
