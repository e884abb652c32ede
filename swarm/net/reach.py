"""Can others dial this node? A dial-back check, so that a node behind a NAT does not
advertise addresses nobody can reach.

A node that joined through a bootstrap node asks it on :data:`REACH_PROTOCOL`, over the
connection it dialled, with the TCP ports it listens on. The bootstrap answers with the
address it sees that connection come from (behind a NAT, the NAT's) and which of the
ports it could open **fresh** TCP connections to, at that observed address (never the
connection the question came on, so a NAT that lets replies through is not mistaken for
a reachable address; only the asker's own observed address is dialled, so the check
cannot be aimed at anyone else).

The asker is reachable (:data:`PUBLIC`) when every port answered at the observed
address; it then advertises that address (where it is not the one it listens on: a
node on ``0.0.0.0``, a NAT with a port forward of the same ports). Behind a NAT without
one, or a firewall, a port does not answer (:data:`PRIVATE`). A private node advertises
no address: it dials out, and the exchange uses those connections both ways. Where it
cannot tell (no bootstrap, an older one without the protocol, a bootstrap reached over
loopback by a node listening elsewhere) it is :data:`UNKNOWN` and advertises as before.

Wire: request ``u8 n | n x u16 port`` (n <= :data:`MAX_PORTS`); reply ``u32 length |
JSON {"observed": host, "open": [ports]}``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from swarm.errors import DecodeError
from swarm.net.blobs import read_blob

if TYPE_CHECKING:
    from libp2p.abc import INetStream

REACH_PROTOCOL = "/swarm/reach/1.0.0"
MAX_PORTS = 4
#: Seconds for one dial-back.
DIAL_BACK_TIMEOUT = 3.0
#: Dial-backs in flight at once on a serving node (others wait).
MAX_CONCURRENT = 8
MAX_REPLY = 512
_LEN = struct.Struct(">I")

PUBLIC = "public"
PRIVATE = "private"
UNKNOWN = "unknown"
UNSPECIFIED = frozenset({"", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True, slots=True)
class Reach:
    """What a bootstrap node saw: the asker's address, and the ports it could dial."""

    observed: str
    open: tuple[int, ...]

    def verdict(self, listen_host: str, ports: tuple[int, ...]) -> str:
        """:data:`PUBLIC`, :data:`PRIVATE` or :data:`UNKNOWN` for a node listening on
        ``listen_host`` at ``ports``."""
        if not ports or (_loopback(self.observed) and not _loopback(listen_host)):
            return UNKNOWN  # asked over loopback: nothing learnt about other hosts
        return PUBLIC if set(ports) <= set(self.open) else PRIVATE

    def seen_elsewhere(self, listen_host: str) -> bool:
        """Reached at another address than ``listen_host`` (``0.0.0.0``, a port
        forward): that is the address to advertise."""
        return self.observed != listen_host


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ReachServer:
    """The :data:`REACH_PROTOCOL` handler (trio)."""

    def __init__(self) -> None:
        self._limit: trio.CapacityLimiter | None = None
        self.served = 0

    async def serve(self, stream: INetStream) -> None:
        try:
            with trio.fail_after(DIAL_BACK_TIMEOUT * 3):
                ports = await _read_request(stream)
                remote = stream.get_remote_address()
                if remote is None:
                    return
                host = str(remote[0])
                if self._limit is None:
                    self._limit = trio.CapacityLimiter(MAX_CONCURRENT)
                opened: list[int] = []
                async with self._limit:

                    async def probe(port: int) -> None:
                        if await _dial_back(host, port):
                            opened.append(port)

                    async with trio.open_nursery() as nursery:  # the ports at once
                        for port in ports:
                            nursery.start_soon(probe, port)
                opened.sort()
                body = json.dumps({"observed": host, "open": opened}).encode()
                await stream.write(_LEN.pack(len(body)) + body)
                self.served += 1
        except Exception:  # a bad request, a timeout, a reset: nothing to answer
            pass
        finally:
            with contextlib.suppress(Exception):
                await stream.close()


async def _read_request(stream: INetStream) -> tuple[int, ...]:
    buf = bytearray()
    want = 1
    while len(buf) < want:
        chunk = await stream.read(want - len(buf))
        if not chunk:
            raise DecodeError("reach request cut short")
        buf += chunk
        if want == 1:
            if not 0 < buf[0] <= MAX_PORTS:
                raise DecodeError(f"reach request of {buf[0]} ports")
            want = 1 + 2 * buf[0]
    return struct.unpack(f">{buf[0]}H", bytes(buf[1:]))


async def _dial_back(host: str, port: int) -> bool:
    """A fresh TCP connection to ``host:port`` opens within the time-out (then closed)."""
    if not 0 < port < 65536:
        return False
    with trio.move_on_after(DIAL_BACK_TIMEOUT):
        try:
            conn = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        with contextlib.suppress(Exception):
            await conn.aclose()
        return True
    return False


async def ask(stream: INetStream, ports: tuple[int, ...], timeout: float) -> Reach:
    """Ask a bootstrap node over ``stream`` (trio).

    :raises DecodeError: a malformed answer.
    :raises trio.TooSlowError: none within ``timeout`` seconds.
    """
    ports = ports[:MAX_PORTS]
    with trio.fail_after(timeout):
        await stream.write(bytes([len(ports)]) + struct.pack(f">{len(ports)}H", *ports))
        body = await read_blob(stream, MAX_REPLY, timeout)
    try:
        doc = json.loads(body)
        observed = str(doc["observed"])
        opened = tuple(int(p) for p in doc["open"])[:MAX_PORTS]
    except (ValueError, KeyError, TypeError) as exc:
        raise DecodeError(f"malformed reach answer: {exc}") from None
    return Reach(observed, opened)
