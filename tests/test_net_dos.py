"""Resource attacks on a real node in its own process: its memory stays within budget,
attackers are dropped, and honest newcomers keep being admitted.

The target is a :class:`~swarm.net.node.Libp2pNode` started by a small script in a
subprocess (its data plane configured through the JSON it is given); the attacks run
from this process, to loopback only. RSS is read from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from swarm.identity import Identity
from swarm.net.dataplane import DataPlaneConfig, DirectTransport
from swarm.net.handshake import TAG_LEN, ClientHandshake
from swarm.wire.frames import FrameReader, encode_frame, encode_header

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")]

MiB = 1 << 20
#: RSS allowed on top of the baseline and the configured budget (allocator slack,
#: per-connection scratch buffers, libp2p's own state).
MARGIN = 48 * MiB

NODE_SCRIPT = r"""
import asyncio, dataclasses, json, os, sys
from swarm.identity import Identity
from swarm.net.dataplane import DataPlaneConfig
from swarm.net.node import Libp2pNode, NodeConfig

async def main() -> None:
    opts = json.loads(sys.argv[1])
    names = {f.name for f in dataclasses.fields(DataPlaneConfig)}
    dp = DataPlaneConfig(**{k: v for k, v in opts.items() if k in names})
    cfg = NodeConfig(listen="/ip4/127.0.0.1/tcp/0", data_plane=dp)
    async with Libp2pNode(Identity.from_seed(bytes([7]) * 32), cfg) as node:
        print(json.dumps({"event": "ready", "pid": os.getpid(),
                          "dp_port": node.data_address[1],
                          "addr": node.listen_addresses[0],
                          "peer_id": node.peer_id}), flush=True)
        while True:
            m = await node.recv()
            print(json.dumps({"event": "msg", "from": m.peer_id, "size": len(m.payload)}),
                  flush=True)

asyncio.run(main())
"""


class Target:
    """The node under attack: a subprocess printing JSON lines."""

    def __init__(self, **dp: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE_SCRIPT, json.dumps(dp)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.wait(lambda e: e["event"] == "ready", 30)
        self.dp_port = int(ready["dp_port"])
        self.addr = str(ready["addr"])
        self.peer_id = str(ready["peer_id"])
        self.peak = 0
        self._sampling = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError), self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()

    def wait(self, pred: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"target: no such event in {timeout} s "
                                         f"(exit {self.proc.poll()})")
                self._cond.wait(min(left, 0.5))

    async def await_event(self, pred: Any, timeout: float) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait, pred, timeout)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Track the peak RSS (every 20 ms) while the block runs."""
        self._sampling = True

        def loop() -> None:
            while self._sampling and self.proc.poll() is None:
                with contextlib.suppress(OSError, AssertionError):
                    self.peak = max(self.peak, self.rss())
                time.sleep(0.02)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            yield
        finally:
            self._sampling = False
            t.join(2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def target_factory() -> Iterator[Any]:
    started: list[Target] = []

    def make(**dp: Any) -> Target:
        t = Target(**dp)
        started.append(t)
        return t

    yield make
    for t in started:
        t.stop()


def fresh() -> Identity:
    return Identity.from_seed(os.urandom(32))


async def honest_send(target: Target, size: int, timeout: float = 5.0) -> float:
    """Connect a fresh identity to the target's data plane and send one message; the
    seconds until the target received it."""
    me = fresh()
    t0 = time.monotonic()
    async with DirectTransport(me, DataPlaneConfig(listen=False)) as t:
        await asyncio.wait_for(
            t.connect(f"/ip4/127.0.0.1/tcp/{target.dp_port}/p2p/{target.peer_id}"), timeout)
        await t.send(target.peer_id, b"h" * size)
        await target.await_event(lambda e: e["event"] == "msg" and e["from"] == me.peer_id,
                                 timeout)
    return time.monotonic() - t0


async def logged_in(port: int, target_id: str, source: str = "127.0.0.1"
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """A valid data-plane login by a fresh identity (the welcome frame is read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    hs = ClientHandshake(fresh(), expected_peer_id=target_id)
    writer.write(encode_frame(hs.hello()))
    frames = FrameReader(4096)
    while (body := frames.next_frame()) is None:
        data = await reader.read(4096)
        if not data:
            raise ConnectionError("closed during handshake")
        frames.feed(data)
    result = hs.receive_server(body)
    writer.write(encode_frame(result.auth))
    while frames.next_frame() is None:  # the welcome
        data = await reader.read(4096)
        if not data:
            raise ConnectionError("refused")
        frames.feed(data)
    return reader, writer, result.session


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


def report(name: str, target: Target, base: int, budget: int) -> None:
    print(f"\n[{name}] baseline {base / MiB:.0f} MiB, peak {target.peak / MiB:.0f} MiB "
          f"(+{(target.peak - base) / MiB:.0f} MiB; budget {budget / MiB:.0f} MiB "
          f"+ margin {MARGIN / MiB:.0f} MiB)")


async def test_stalled_frames_from_many_identities_stay_within_budget(
        target_factory: Any) -> None:
    budget = 64 * MiB
    # The attackers log in from 127.0.0.2-9, the newcomer from 127.0.0.1.
    target = target_factory(buffer_budget=budget, stall_timeout=2.0)
    await honest_send(target, 4 * MiB)  # warm: threads, first large frame
    base = target.rss()
    frame = 16 * MiB + TAG_LEN
    body = b"\0" * (2 * MiB)
    conns = []
    with target.sampling():
        for i in range(24):  # identities, each with 4 connections (under the 8 per peer)
            for _ in range(4):
                reader, writer, _session = await logged_in(target.dp_port, target.peer_id,
                                                           f"127.0.0.{2 + i % 8}")
                writer.write(encode_header(frame))
                writer.write(body)  # then stall: the other 14 MiB never come
                conns.append((reader, writer))
        # It waits its turn (round-robin across addresses) behind reservations that
        # stall: a few stall timeouts at most.
        took = await honest_send(target, 1 * MiB, timeout=15.0)
        dropped = await asyncio.gather(*(closed_within(r, 0.5) for r, _ in conns))
    for _, w in conns:
        w.close()
    report("stalled frames", target, base, budget)
    print(f"honest message delivered after {took:.2f} s; "
          f"{sum(dropped)}/{len(conns)} stalled connections dropped")
    assert target.alive()
    assert target.peak < base + budget + MARGIN
    assert took < 12.0
    assert sum(dropped) >= 8  # those that were given budget and stalled; the others wait
    assert await honest_send(target, 4 * MiB) < 3.0


async def test_held_open_handshakes_do_not_lock_out_newcomers(target_factory: Any) -> None:
    # The attackers come from 127.0.0.2-9, the newcomers from 127.0.0.1 (all loopback):
    # the default per-address bounds apply as they would between machines.
    target = target_factory(handshake_timeout=5.0)
    await honest_send(target, 1024)
    base = target.rss()
    stop = asyncio.Event()
    opened = 0

    async def hold_one(source: str) -> None:
        nonlocal opened
        while not stop.is_set():  # reconnect as soon as the target drops us
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", target.dp_port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.01)
                continue
            opened += 1
            writer.write(encode_header(200))  # a hello that never comes
            with contextlib.suppress(ConnectionError):
                while not stop.is_set() and await reader.read(4096):
                    pass
            writer.close()

    with target.sampling():
        holders = [asyncio.create_task(hold_one(f"127.0.0.{2 + i % 8}")) for i in range(320)]
        await asyncio.sleep(1.0)
        times = []
        for _ in range(10):
            times.append(await honest_send(target, 1024, timeout=5.0))
        stop.set()
        await asyncio.gather(*holders, return_exceptions=True)
    report("held-open handshakes", target, base, 0)
    print(f"honest newcomers admitted in {max(times):.2f} s at most "
          f"({opened} attacker connections opened)")
    assert target.alive()
    assert max(times) < 3.0
    assert target.peak < base + MARGIN


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


async def test_endless_multistream_read_is_bounded(target_factory: Any) -> None:
    target = target_factory()
    await honest_send(target, 1024)
    host, port = target.addr.split("/")[2], int(target.addr.split("/")[4])
    base = target.rss()
    chunk = b"x" * MiB
    writers = []

    async def flood() -> int:
        _reader, writer = await asyncio.open_connection(host, port)
        writers.append(writer)
        proto = b"/multistream/1.0.0\n"
        writer.write(_varint(len(proto)) + proto)
        writer.write(_varint(1 << 30))  # a "protocol name" of 1 GiB, sent for ever
        sent = 0
        deadline = time.monotonic() + 6.0
        try:
            while time.monotonic() < deadline:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 1.0)
                sent += len(chunk)
        except (ConnectionError, TimeoutError):
            pass
        return sent

    with target.sampling():
        sent = await asyncio.gather(*(flood() for _ in range(4)))
        took = await honest_send(target, 1024)
        # libp2p itself keeps serving: a real node dials it and exchanges a message
        from swarm.net.node import Libp2pNode, NodeConfig
        async with Libp2pNode(fresh(), NodeConfig(data_plane=None)) as other:
            await other.connect(target.addr)
            await other.send(target.peer_id, b"over libp2p")
            await target.await_event(
                lambda e: e["event"] == "msg" and e["from"] == other.peer_id, 10)
    for w in writers:
        w.close()
    report("endless multistream", target, base, 0)
    print(f"attackers sent {sum(sent) / MiB:.0f} MiB before being cut off; "
          f"honest data-plane message after {took:.2f} s")
    assert target.alive()
    assert target.peak < base + MARGIN
    assert sum(sent) < 64 * MiB
