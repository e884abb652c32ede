"""How a rollout peer finds its neighbours and the trainer again.

Two loops, driven by one :class:`Discovery`:

- the directory loop keeps up to ``max_neighbours`` other peers of the run connected,
  dialling entries of the run's signed peer directory (the trainer first), and backs off
  per peer when a dial fails (the transport dials whenever asked, so dead entries are
  backed off here);
- the reconnect loop redials the bootstrap addresses while the trainer is not connected,
  with a bounded, doubling backoff, and says when the trainer is back.

The backoff bookkeeping is :class:`Backoff`, pure and clock-driven.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarm.errors import SwarmError
from swarm.roles.common import Clock, Network

log = logging.getLogger(__name__)

#: Longest wait before dialing again a neighbour from the directory that did not answer.
DISCOVER_RETRY_MAX = 60.0


class Backoff:
    """Per-peer retry times after failed dials: ``first`` seconds, doubling up to a cap."""

    def __init__(self, first: float) -> None:
        self.first = first
        self._retry: dict[str, tuple[float, float]] = {}  # peer -> (when, the wait)

    def ready(self, peer: str, now: float) -> bool:
        retry = self._retry.get(peer)
        return retry is None or now >= retry[0]

    def failed(self, peer: str, now: float, cap: float) -> float:
        """Record a failed dial; returns the wait before the next one."""
        prev = self._retry.get(peer)
        wait = min(2 * prev[1], cap) if prev else min(self.first, cap)
        self._retry[peer] = (now + wait, wait)
        return wait

    def succeeded(self, peer: str) -> None:
        self._retry.pop(peer, None)

    def keep_only(self, peers: Iterable[str]) -> None:
        """Forget peers no longer listed (bounds the table by the directory's size)."""
        keep = set(peers)
        self._retry = {p: r for p, r in self._retry.items() if p in keep}

    def __len__(self) -> int:
        return len(self._retry)


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    trainer: str
    bootstrap: tuple[str, ...] = ()
    max_neighbours: int = 8
    interval: float = 1.0
    reconnect_min: float = 0.5
    reconnect_max: float = 2.0


class Discovery:
    """Keeps a peer connected to neighbours and to the trainer."""

    def __init__(self, net: Network, config: DiscoveryConfig, clock: Clock,
                 on_trainer_back: Callable[[], None]) -> None:
        self.net = net
        self.config = config
        self.clock = clock
        self._on_trainer_back = on_trainer_back
        self._trainer_lost = asyncio.Event()
        self.reconnects = 0
        self.backoff = Backoff(config.reconnect_min)
        #: Trainer seeders the newest manifest names: dialled first, as the trainer is,
        #: and not counted among the neighbours.
        self.seeders: frozenset[str] = frozenset()

    def trainer_lost(self) -> None:
        self._trainer_lost.set()

    def _trainer_here(self) -> bool:
        return self.config.trainer in self.net.connected_peers()

    async def run_directory(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.interval)
            connected = self.net.connected_peers()
            trainers = self.seeders | {cfg.trainer}
            others = [p for p in connected if p not in trainers]
            if len(others) >= cfg.max_neighbours and trainers <= set(connected):
                continue
            entries = self.net.directory()
            # The trainer and its seeders first (when we joined through a bootstrap node),
            # then others.
            order = sorted(entries.items(), key=lambda kv: (kv[0] != cfg.trainer,
                                                            kv[0] not in trainers, kv[0]))
            if len(self.backoff) > len(entries):
                self.backoff.keep_only(entries)
            for peer, meta in order:
                if peer not in trainers and len(others) >= cfg.max_neighbours:
                    break  # the trainer and its seeders come first in the order
                if peer in connected or peer == self.net.peer_id or not meta.addrs:
                    continue
                if not self.backoff.ready(peer, self.clock.now()):
                    continue
                try:
                    await self.net.connect(meta.addrs[0])
                except (SwarmError, OSError) as exc:
                    log.debug("dial %s: %s", peer, exc)
                    cap = cfg.reconnect_max if peer in trainers else DISCOVER_RETRY_MAX
                    self.backoff.failed(peer, self.clock.now(), cap)
                else:
                    self.backoff.succeeded(peer)
                    if peer not in trainers:
                        others.append(peer)

    async def run_reconnect(self) -> None:
        """Redial the bootstrap addresses while the trainer is away (bounded backoff)."""
        cfg = self.config
        delay = cfg.reconnect_min
        while True:
            if self._trainer_here():
                delay = cfg.reconnect_min
                self._trainer_lost.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.reconnect_max):
                        await self._trainer_lost.wait()
                continue
            for addr in cfg.bootstrap:
                try:
                    await self.net.connect(addr)
                except (SwarmError, OSError) as exc:
                    log.debug("redial %s: %s", addr, exc)
            if self._trainer_here():
                self.reconnects += 1
                log.info("trainer reachable again (reconnect %d)", self.reconnects)
                self._on_trainer_back()
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.reconnect_max)
