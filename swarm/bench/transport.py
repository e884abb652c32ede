"""``swarm bench transport``: data plane vs py-libp2p streams vs raw asyncio TCP.

All three move the same bytes over loopback inside this one process (sender and
receiver share the CPU), in 4 MiB messages, over 1 and 4 connections:

- raw TCP: asyncio ``StreamWriter.write`` into a ``BufferedProtocol`` that discards; no
  framing, no crypto: the ceiling for Python on this machine;
- data plane: :class:`swarm.net.dataplane.DirectTransport` (signed handshake, AEAD
  frames, messages delivered whole to ``recv()``);
- libp2p: py-libp2p streams (TCP + Noise + Yamux) of one connection, written from trio
  (4 "connections" = 4 concurrent streams), hosted through the trio guest run.

CPU-seconds per GB count both ends (``time.process_time``, all threads of the process).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from swarm.errors import SwarmError

MESSAGE = 4 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=256,
                        help="MiB moved per measurement (default 256)")
    parser.add_argument("--libp2p-size", type=int, default=None,
                        help="MiB for the py-libp2p measurements (default: --size)")
    parser.add_argument("--connections", default="1,4",
                        help="comma-separated connection counts (default 1,4)")
    parser.add_argument("--cipher", default="aes-256-gcm",
                        choices=["aes-256-gcm", "chacha20-poly1305"],
                        help="data-plane AEAD (default aes-256-gcm)")
    parser.add_argument("--crypto-threads", type=int, default=None,
                        help="data-plane AEAD threads (default: DataPlaneConfig's, 2; "
                             "0 = on the event loop)")
    parser.add_argument("--skip-libp2p", action="store_true",
                        help="measure only raw TCP and the data plane")


@dataclass(frozen=True, slots=True)
class Result:
    mode: str
    connections: int
    nbytes: int
    seconds: float
    cpu_seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e6

    @property
    def cpu_per_gb(self) -> float:
        return self.cpu_seconds / (self.nbytes / 1e9)


async def _measure(mode: str, connections: int, nbytes: int,
                   body: Callable[[], Awaitable[None]]) -> Result:
    t0, c0 = time.perf_counter(), time.process_time()
    await body()
    return Result(mode, connections, nbytes, time.perf_counter() - t0,
                  time.process_time() - c0)


def _split(nbytes: int, parts: int) -> list[int]:
    """Messages per connection: ``nbytes`` of 4 MiB messages spread over ``parts``."""
    total = max(1, nbytes // MESSAGE)
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# -- raw asyncio TCP -------------------------------------------------------------------
class _Sink(asyncio.BufferedProtocol):
    def __init__(self, done: Callable[[int], None]) -> None:
        self.buf = bytearray(256 << 10)
        self.got = 0
        self.done = done

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        self.done(nbytes)


async def bench_raw(nbytes: int, connections: int) -> Result:
    loop = asyncio.get_running_loop()
    counts = _split(nbytes, connections)
    expected = sum(counts) * MESSAGE
    received = 0
    finished = asyncio.Event()

    def on_bytes(n: int) -> None:
        nonlocal received
        received += n
        if received >= expected:
            finished.set()

    server = await loop.create_server(lambda: _Sink(on_bytes), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payload = bytes(MESSAGE)
    writers = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in counts]

    async def send(writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(n):
            writer.write(payload)
            await writer.drain()

    async def body() -> None:
        await asyncio.gather(*(send(w, n) for w, n in zip(writers, counts, strict=True)))
        await finished.wait()

    try:
        return await _measure("raw asyncio TCP", connections, expected, body)
    finally:
        for w in writers:
            w.close()
            await w.wait_closed()
        server.close()
        await server.wait_closed()


# -- data plane ------------------------------------------------------------------------
async def bench_dataplane(nbytes: int, connections: int, cipher: str,
                          crypto_threads: int | None = None) -> Result:
    from swarm.identity import Identity
    from swarm.net.dataplane import DataPlaneConfig, DirectTransport

    cfg = DataPlaneConfig(ciphers=(cipher,))
    if crypto_threads is not None:
        cfg = dataclasses.replace(cfg, crypto_threads=crypto_threads)
    counts = _split(nbytes, connections)
    total = sum(counts)
    payload = bytes(MESSAGE)
    async with DirectTransport(Identity.generate(), cfg) as a, \
            DirectTransport(Identity.generate(), cfg) as b:
        peer = await a.connect(b.listen_addresses[0], connections=connections)

        async def send(n: int) -> None:
            for _ in range(n):
                await a.send(peer, payload)

        async def body() -> None:
            senders = [asyncio.create_task(send(n)) for n in counts]
            got = 0
            for _ in range(total):
                got += len((await b.recv()).payload)
            await asyncio.gather(*senders)
            if got != total * MESSAGE:
                raise RuntimeError("data plane lost bytes")

        label = f"data plane ({cipher}, {cfg.crypto_threads} thr)"
        return await _measure(label, connections, total * MESSAGE, body)


# -- py-libp2p streams -----------------------------------------------------------------
async def bench_libp2p(nbytes: int, connections: int) -> Result:
    import trio
    from libp2p.custom_types import TProtocol

    from swarm.identity import Identity
    from swarm.net.node import Libp2pNode, NodeConfig

    proto = TProtocol("/swarm/bench/1.0.0")
    counts = _split(nbytes, connections)
    expected = sum(counts) * MESSAGE
    cfg = NodeConfig(data_plane=None)
    async with Libp2pNode(Identity.generate(), cfg) as a, \
            Libp2pNode(Identity.generate(), cfg) as b:
        guest, host_a, host_b = a.trio_guest, a.libp2p_host, b.libp2p_host
        received = [0]
        all_in = trio.Event()

        async def sink(stream: Any) -> None:
            while True:
                data = await stream.read(1 << 20)
                if not data:
                    break
                received[0] += len(data)
                if received[0] >= expected:
                    all_in.set()

        host_a.set_stream_handler(proto, sink)
        await b.connect(a.listen_addresses[0])

        async def run_trio() -> None:
            payload = bytes(MESSAGE)
            streams = [await host_b.new_stream(host_a.get_id(), [proto]) for _ in counts]

            async def send(stream: Any, n: int) -> None:
                for _ in range(n):
                    await stream.write(payload)

            async with trio.open_nursery() as nursery:
                for s, n in zip(streams, counts, strict=True):
                    nursery.start_soon(send, s, n)
            await all_in.wait()
            for s in streams:
                await s.close()

        async def body() -> None:
            await guest.run(run_trio)

        return await _measure("py-libp2p streams", connections, expected, body)


def _print(results: list[Result]) -> None:
    print(f"{'mode':40} {'conns':>5} {'MiB':>6} {'MB/s':>9} {'CPU-s/GB':>9}")
    for r in results:
        print(f"{r.mode:40} {r.connections:>5} {r.nbytes >> 20:>6} {r.mb_per_s:>9.1f} "
              f"{r.cpu_per_gb:>9.2f}")
    by = {(r.mode.split(" (")[0], r.connections): r for r in results}
    for n in sorted({r.connections for r in results}):
        dp, raw, lp = by.get(("data plane", n)), by.get(("raw asyncio TCP", n)), \
            by.get(("py-libp2p streams", n))
        if dp is None:
            continue
        parts = [f"{n} connection(s):"]
        if lp is not None:
            ratio = dp.mb_per_s / lp.mb_per_s
            parts.append(f"data plane / libp2p = {ratio:.1f}x (goal >= 5x)")
        if raw is not None:
            ratio = dp.mb_per_s / raw.mb_per_s
            parts.append(f"data plane / raw TCP = {ratio:.2f}x (goal >= 0.4x)")
        print("  ".join(parts))


async def _main(args: argparse.Namespace) -> list[Result]:
    size = args.size << 20
    lp_size = (args.libp2p_size if args.libp2p_size is not None else args.size) << 20
    results = []
    for n in [int(x) for x in args.connections.split(",") if x.strip()]:
        results.append(await bench_raw(size, n))
        results.append(await bench_dataplane(size, n, args.cipher, args.crypto_threads))
        if not args.skip_libp2p:
            results.append(await bench_libp2p(lp_size, n))
    return results


def run(args: argparse.Namespace) -> int:
    if args.size <= 0:
        raise SwarmError(f"--size {args.size}: must be positive")
    print(f"swarm bench transport: loopback, {MESSAGE >> 20} MiB messages, sender and "
          f"receiver in one process (CPU covers both ends; py-libp2p's N connections are "
          f"N concurrent streams on one connection)")
    _print(asyncio.run(_main(args)))
    return 0
