"""The asyncio driver of the sans-IO chunk exchange over a :class:`~swarm.roles.mux.Mux`.

One task runs the core: it feeds inbound messages and timers in, then sends what comes
out. Each neighbour has its own sender task, so a slow link delays only itself: control
messages go first, then the next queued piece (asked for only when the link can take it,
so a cancel can still withdraw a piece not yet on the wire).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping

from swarm.aio import cancel_and_wait
from swarm.content.ids import DIGEST_LEN
from swarm.net.transport import Message, PeerUnreachable, TransportClosed
from swarm.protocol.exchange import (
    Chunk,
    Event,
    Exchange,
    ObjectComplete,
    ObjectSpec,
    PeerBanned,
    PeerDropped,
    PeerPenalized,
    PeerTimedOut,
)
from swarm.protocol.exchange_msgs import MAX_CHUNKS_PER_OBJECT, Bitfield, Piece, Reject, encode
from swarm.protocol.exchange_msgs import Message as ExchangeMessage
from swarm.roles.mux import Channel, Mux

log = logging.getLogger(__name__)

# Control messages queued for one neighbour before the core loop waits for its sender.
MAX_CONTROL_BACKLOG = 4096
#: Chaos (``flood_haves``): made-up objects summarised to every neighbour each round,
#: each of the most chunks a summary can name, every bit set (32 KiB a summary).
FLOOD_OBJECTS = 8
#: Chaos: seconds between two rounds of the flood.
FLOOD_PERIOD = 0.5


class _Link:
    def __init__(self) -> None:
        self.control: deque[ExchangeMessage] = deque()
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class ExchangeDriver:
    """Runs an :class:`Exchange` on real time and a real (or in-memory) transport."""

    def __init__(self, exchange: Exchange, mux: Mux,
                 on_event: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.exchange = exchange
        self.mux = mux
        self._on_event = on_event
        self._clock = clock or asyncio.get_running_loop().time
        self._kick = asyncio.Event()
        self._links: dict[str, _Link] = {}
        self._complete: dict[bytes, asyncio.Event] = {}
        self._objects: set[bytes] = set()
        self._tasks: list[asyncio.Task[None]] = []
        #: Chaos switch for demos and tests: flip one byte of every piece we upload.
        self.corrupt_uploads = False
        #: Chaos switch: announce every chunk of every object, serve none, refuse nothing
        #: (a silent liar: neighbours must time it out and drop it).
        self.lie_about_chunks = False

    def now(self) -> float:
        return self._clock()

    async def __aenter__(self) -> ExchangeDriver:
        self._tasks = [
            asyncio.create_task(self._core(), name="exchange core"),
            asyncio.create_task(self._inbound(), name="exchange inbound"),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._tasks + [lk.task for lk in self._links.values() if lk.task],
                              "exchange")
        self._links.clear()

    def flood_haves(self, period: float = FLOOD_PERIOD) -> None:
        """Chaos switch for demos and tests: every ``period`` seconds, for as long as the
        driver runs, send every neighbour summaries of :data:`FLOOD_OBJECTS` made-up
        objects (new ones each round) of ``MAX_CHUNKS_PER_OBJECT`` chunks, every bit set
        (a have-summary flood: neighbours must bound what they keep, score this node and
        drop it). A round is skipped for a neighbour whose link has not sent the last."""
        self._tasks.append(asyncio.create_task(self._flood(period), name="chaos flood"))

    async def _flood(self, period: float) -> None:
        bits = _all_set(MAX_CHUNKS_PER_OBJECT)
        while True:
            fakes = [Bitfield(os.urandom(DIGEST_LEN), MAX_CHUNKS_PER_OBJECT, bits)
                     for _ in range(FLOOD_OBJECTS)]
            for link in self._links.values():
                if len(link.control) < FLOOD_OBJECTS:
                    link.control.extend(fakes)
                    link.wake.set()
            await asyncio.sleep(period)

    # -- what the role calls -----------------------------------------------------------
    @property
    def objects(self) -> frozenset[bytes]:
        """Objects being exchanged (each holds its chunks in memory)."""
        return frozenset(self._objects)

    def has_object(self, obj: bytes) -> bool:
        return obj in self._objects

    def add_object(self, spec: ObjectSpec, data: Mapping[int, Chunk] | None = None) -> None:
        self._objects.add(spec.obj)
        self._complete.setdefault(spec.obj, asyncio.Event())
        self.exchange.add_object(spec, self.now(), data)
        self._pump()

    def retain(self, keep: set[bytes]) -> None:
        """Stop exchanging, and free, every object not in ``keep`` (old versions)."""
        self.drop(self._objects - keep)

    def drop(self, objs: set[bytes] | frozenset[bytes]) -> None:
        """Stop exchanging, and free, the objects ``objs`` (those not held are ignored)."""
        for obj in objs & self._objects:
            self._objects.discard(obj)
            self._complete.pop(obj, None)
            self.exchange.remove_object(obj)
        self._pump()

    def connected(self, peer: str, *, region: str = "", rtt: float = 0.05,
                  trainer: bool = False, upload: float = 0.0) -> None:
        """``peer`` is reachable: ``region`` and ``upload`` (bytes per second, 0 if
        unknown) are what its metadata advertises."""
        if peer in self._links:
            return
        link = _Link()
        self._links[peer] = link
        link.task = asyncio.create_task(self._sender(peer, link), name=f"send {peer[-6:]}")
        self.exchange.connect(peer, self.now(), region=region, rtt=rtt, trainer=trainer,
                              upload=upload)
        self._pump()

    def described(self, peer: str, *, region: str, upload: float) -> None:
        """``peer``'s metadata (now) advertises ``region`` and ``upload``."""
        if self.exchange.describe(peer, self.now(), region=region, upload=upload):
            self._pump()

    def set_trainer(self, peer: str, trainer: bool) -> None:
        self.exchange.set_trainer(peer, trainer, self.now())
        self._pump()

    def disconnected(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        if link is not None and link.task is not None:
            link.task.cancel()
        self.exchange.disconnect(peer, self.now())
        self._pump()

    async def wait_complete(self, obj: bytes) -> None:
        ev = self._complete.setdefault(obj, asyncio.Event())
        if self.exchange.is_complete(obj):
            return
        await ev.wait()

    # -- internals ---------------------------------------------------------------------
    def _pump(self) -> None:
        """Move what the core produced to the senders and report events."""
        for peer, msg in self.exchange.take_outgoing():
            link = self._links.get(peer)
            if link is not None and len(link.control) < MAX_CONTROL_BACKLOG:
                link.control.append(msg)
                link.wake.set()
        for peer in self.exchange.take_upload_ready():
            link = self._links.get(peer)
            if link is not None:
                link.wake.set()
        for ev in self.exchange.take_events():
            self._event(ev)
        self._kick.set()

    def _event(self, ev: Event) -> None:
        if isinstance(ev, ObjectComplete):
            self._complete.setdefault(ev.obj, asyncio.Event()).set()
        elif isinstance(ev, PeerBanned):
            log.warning("banned %s: %s", ev.peer, ev.reason)
            self.mux.transport.penalize(ev.peer, ev.reason)
        elif isinstance(ev, PeerPenalized):
            # scored, not dropped: the core keeps or drops it; a low score bans it
            self.mux.transport.penalize(ev.peer, ev.reason, disconnect=False)
        elif isinstance(ev, PeerDropped):
            # hung up on and scored: one that reconnects and does it again gets banned
            log.info("dropped %s: %s", ev.peer, ev.reason)
            self.mux.transport.penalize(ev.peer, ev.reason)
        elif isinstance(ev, PeerTimedOut):
            log.info("neighbour %s timed out", ev.peer)
        if self._on_event is not None:
            self._on_event(ev)

    async def _inbound(self) -> None:
        while True:
            msg: Message = await self.mux.recv(Channel.EXCHANGE)
            if msg.peer_id not in self._links:
                log.debug("dropped an exchange message from %s: not connected", msg.peer_id)
                continue
            self.exchange.receive_bytes(msg.peer_id, msg.payload, self.now())
            self._pump()

    async def _core(self) -> None:
        while True:
            self._kick.clear()
            deadline = self.exchange.next_timer()
            # A timer sets the event rather than wait_for cancelling the wait: on Python
            # 3.11 wait_for racing with __aexit__'s cancel can swallow the cancel.
            loop = asyncio.get_running_loop()
            alarm = None if deadline is None else \
                loop.call_later(max(0.0, deadline - self.now()), self._kick.set)
            try:
                await self._kick.wait()
            finally:
                if alarm is not None:
                    alarm.cancel()
            timer = self.exchange.next_timer()
            if timer is not None and timer <= self.now():
                self.exchange.handle_timer(self.now())
                self._pump()
                self._kick.clear()

    async def _sender(self, peer: str, link: _Link) -> None:
        try:
            while True:
                await link.wake.wait()
                link.wake.clear()
                while True:
                    if link.control:
                        msg: ExchangeMessage | None = link.control.popleft()
                    else:
                        msg = self.exchange.next_upload(peer, self.now())
                    if msg is None:
                        break
                    if self.corrupt_uploads and isinstance(msg, Piece) and msg.data:
                        msg = Piece(msg.obj, msg.index, bytes([msg.data[0] ^ 0xFF]) + msg.data[1:])
                    if self.lie_about_chunks:
                        if isinstance(msg, Piece | Reject):
                            continue
                        if isinstance(msg, Bitfield):
                            msg = Bitfield(msg.obj, msg.count, _all_set(msg.count))
                    await self.mux.send(Channel.EXCHANGE, peer, encode(msg))
                    self._pump()
        except (PeerUnreachable, TransportClosed) as exc:
            log.info("lost %s while sending: %s", peer, exc)
            self._links.pop(peer, None)
            self.exchange.disconnect(peer, self.now())
            self._pump()


def _all_set(count: int) -> bytes:
    """A bitfield of ``count`` chunks, all held (LSB first; bits past the end clear)."""
    full = bytearray(b"\xff" * ((count + 7) // 8))
    if count % 8:
        full[-1] = (1 << (count % 8)) - 1
    return bytes(full)
