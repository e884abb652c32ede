"""One signed blob served on request over a libp2p stream: the run card.

A node that holds the run's card serves it on :data:`CARD_PROTOCOL`: the responder
writes ``u32 length | bytes`` (length 0: it holds none) and closes. The reader bounds the
length before reading and the whole exchange by a timeout; what it gets is still checked
(signature, run) by the caller. Any node may serve it: the card is content-addressed and
signed by the trainer, so a newcomer can take it from whichever neighbour has it.
"""

from __future__ import annotations

import contextlib
import struct
from typing import TYPE_CHECKING

import trio

from swarm.errors import DecodeError

if TYPE_CHECKING:
    from libp2p.abc import INetStream

CARD_PROTOCOL = "/swarm/card/1.0.0"
_LEN = struct.Struct(">I")


class BlobServer:
    """Serves the blob it was last given (trio handler; set from any thread)."""

    def __init__(self) -> None:
        self.data = b""

    async def serve(self, stream: INetStream) -> None:
        with contextlib.suppress(Exception):
            data = self.data
            await stream.write(_LEN.pack(len(data)) + data)
        with contextlib.suppress(Exception):
            await stream.close()


async def read_blob(stream: INetStream, max_bytes: int, timeout: float) -> bytes:
    """Read one blob (trio); ``b""`` when the responder holds none.

    :raises DecodeError: over ``max_bytes``, or cut short.
    :raises trio.TooSlowError: not within ``timeout`` seconds.
    """
    buf = bytearray()
    try:
        with trio.fail_after(timeout):
            want = _LEN.size
            while len(buf) < want:
                try:
                    chunk = await stream.read(min(want - len(buf), 1 << 20))
                except Exception:  # EOF
                    break
                if not chunk:
                    break
                buf += chunk
                if want == _LEN.size and len(buf) >= _LEN.size:
                    (n,) = _LEN.unpack_from(buf)
                    if n > max_bytes:
                        raise DecodeError(f"blob of {n} bytes, bound is {max_bytes}")
                    want = _LEN.size + n
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    if len(buf) < _LEN.size or len(buf) != _LEN.size + _LEN.unpack_from(buf)[0]:
        raise DecodeError(f"blob cut short after {len(buf)} bytes")
    return bytes(buf[_LEN.size:])
