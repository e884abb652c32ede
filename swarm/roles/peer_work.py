"""A rollout peer's leased work: claims, the engine runs, signed results, heartbeats.

Claims are sized by the peer's measured throughput and name the version it holds; a lease
runs on the engine under the engine lock (so a version is never swapped in mid-lease);
results go back signed. Heartbeats and local expiry are timed by the lease book
(:meth:`~swarm.protocol.leases.PeerLeases.next_deadline`), not by a fixed tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from swarm.engines import RolloutEngine
from swarm.errors import SwarmError
from swarm.protocol.leases import (
    Lease,
    PeerLeases,
    Reason,
    TaskResult,
    Verdict,
    decode_message,
)
from swarm.protocol.leases import Message as LeaseMessage
from swarm.roles.common import Clock
from swarm.roles.mux import Channel, Mux

log = logging.getLogger(__name__)

StatusFn = Callable[[str, dict[str, object]], None]


@dataclass(frozen=True, slots=True)
class WorkConfig:
    trainer: str
    want_tasks: int = 4
    claim_retry: float = 0.5
    """Seconds to wait before claiming again after the trainer refused a claim (it had
    no work, or we hold enough leases)."""
    stale_wait: float = 2.0
    """After a claim refused as stale, the longest wait for a newer version before
    claiming again."""
    banned_retry: float = 30.0
    """Seconds between claims while the trainer refuses this peer as banned."""


class LeasedWork:
    """Claims and runs leases for one peer. ``ready`` is set while the peer holds a
    verified version and the trainer is connected; ``version()`` is the version held."""

    def __init__(self, leases: PeerLeases, mux: Mux, engine: RolloutEngine,
                 engine_lock: asyncio.Lock, config: WorkConfig, clock: Clock,
                 version: Callable[[], tuple[int, bytes]], status: StatusFn,
                 on_stale: Callable[[], None],
                 downloading: Callable[[], int | None] = lambda: None) -> None:
        self.leases = leases
        self.mux = mux
        self.engine = engine
        self.engine_lock = engine_lock
        self.config = config
        self.clock = clock
        self._version = version
        self._status = status
        self._on_stale = on_stale
        self._downloading = downloading
        self.ready = asyncio.Event()
        self._inbox: asyncio.Queue[Lease | Reason] = asyncio.Queue(64)
        """Answers to our claims: a lease, or why the trainer refused one."""
        self.installed = asyncio.Event()
        """Set by the peer when it installs a version (a stale claim waits on it)."""
        self._held_changed = asyncio.Event()
        self._tokens_per_s = 100.0
        self.tasks_done = 0
        self.run_over: int | None = None
        """The version this peer held when the trainer said its run finished there
        (:attr:`Reason.RUN_OVER`); ``None`` again once the trainer leases work."""
        self.banned = False
        """Whether the trainer's last answer to a claim was :attr:`Reason.BANNED`."""

    async def _send(self, data: bytes) -> None:
        with contextlib.suppress(SwarmError):
            await self.mux.send(Channel.LEASE, self.config.trainer, data)

    async def inbox(self) -> None:
        while True:
            msg = await self.mux.recv(Channel.LEASE)
            try:
                decoded: LeaseMessage | bytes = decode_message(msg.payload)
            except SwarmError:
                decoded = msg.payload  # refused, logged and scored by receive()
            verdict = self.leases.receive(decoded, self.clock.wall(), sender=msg.peer_id)
            self._held_changed.set()
            if verdict is Reason.ACCEPTED and isinstance(decoded, Lease):
                await self._inbox.put(decoded)
                continue
            if verdict is Reason.STALE_VERSION:
                self._on_stale()  # the trainer has a newer version than ours
            if isinstance(decoded, Verdict) and decoded.subject == "claim" and \
                    verdict is not Reason.ACCEPTED:
                with contextlib.suppress(asyncio.QueueFull):
                    self._inbox.put_nowait(verdict)
            elif verdict is Reason.REJECTED and isinstance(decoded, Verdict):
                # the trainer's checks refused our completions: say why, loudly (an
                # honest peer sees this only when its engine disagrees with the policy)
                self._status("rejected", {"lease": decoded.lease_id.hex()[:12],
                                          "reason": decoded.detail})

    async def heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._held_changed.clear()
            deadline = self.leases.next_deadline()
            timer = None if deadline is None else loop.call_later(
                max(0.0, deadline - self.clock.wall()), self._held_changed.set)
            try:
                await self._held_changed.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            now = self.clock.wall()
            self.leases.tick(now)
            for hb in self.leases.heartbeats(now):
                await self._send(hb.encode())

    async def claims(self) -> None:
        while True:
            await self.ready.wait()
            held = self._version()[0]
            fetching = self._downloading()
            self.installed.clear()
            claim = self.leases.claim(
                self.clock.wall(), tokens_per_s=self._tokens_per_s, version=held,
                want=self.config.want_tasks,
                downloading=fetching if fetching is not None and fetching > held else None)
            await self._send(claim.encode())
            try:
                async with asyncio.timeout(self.config.claim_retry * 4):
                    answer = await self._inbox.get()
            except TimeoutError:
                continue  # no answer (lost, or the trainer is away): claim again
            if isinstance(answer, Lease):
                if self.run_over is not None:
                    self.run_over = None
                    self._status("run_resumed", {"version": held})
                self.banned = False
                await self.run_lease(answer)
            elif answer is Reason.BANNED:
                # say so once (a restarted peer otherwise followed versions in silence,
                # leasing nothing), and ask rarely: the ban stands until the trainer's
                # operator lifts it
                if not self.banned:
                    self.banned = True
                    self._status("work_refused", {"reason": answer.value})
                await asyncio.sleep(self.config.banned_retry)
            elif answer is Reason.RUN_OVER:
                if self.run_over is None:
                    self.run_over = held
                    self._status("run_over", {"version": held})
                await asyncio.sleep(self.config.claim_retry)
            elif answer is Reason.STALE_VERSION:
                # behind the staleness bound: claim again once a newer version is in
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.stale_wait):
                        await self.installed.wait()
            else:
                # no work yet (the trainer is training), or we hold enough: ask again
                # shortly, not after the time-out for an answer that already came
                await asyncio.sleep(self.config.claim_retry)

    async def run_lease(self, lease: Lease) -> None:
        self._status("lease", {"lease": lease.lease_id.hex()[:12], "tasks": len(lease.tasks)})
        results = []
        tokens = 0
        t0 = self.clock.now()
        async with self.engine_lock:
            version, root = self._version()
            for task in lease.tasks:
                prompts = [list(task.prompt_tokens)] * task.group_size
                # the lease's settings, as signed; the engine's completions, as sent
                comps = tuple(await asyncio.to_thread(self.engine.generate, prompts,
                                                      task.sampling))
                tokens += sum(len(c.token_ids) for c in comps)
                results.append(TaskResult(task.task_id, comps))
        elapsed = max(1e-3, self.clock.now() - t0)
        self._tokens_per_s = 0.7 * self._tokens_per_s + 0.3 * tokens / elapsed
        if lease.lease_id not in self.leases.held:
            self._status("lease_lost", {"lease": lease.lease_id.hex()[:12]})
            return
        res = self.leases.result(lease.lease_id, version, results, self.clock.wall(),
                                 root=root, engine=self.engine.kind)
        await self._send(res.encode())
        self._held_changed.set()
        self.tasks_done += len(results)
        self._status("result", {"lease": lease.lease_id.hex()[:12], "tasks": len(results),
                                "version": version, "tokens_per_s": round(tokens / elapsed, 1)})
