"""Length-prefixed frames: the sans-IO reader shared by the data plane and libp2p streams.

A frame on the wire is a 4-byte big-endian length ``n`` followed by ``n`` bytes. The
reader refuses a length over its bound *before* allocating the body, and hands its
caller the buffer to read into (the shape of :class:`asyncio.BufferedProtocol`), so a
4 MiB frame is received into one allocation with no intermediate copies.

Usage (an I/O driver)::

    reader = FrameReader(max_frame=...)
    buf = reader.get_buffer()        # read up to len(buf) bytes into it
    reader.advance(nread)            # raises DecodeError on an oversized header
    while (frame := reader.next_frame()) is not None: ...
"""

from __future__ import annotations

import struct
from collections import deque

from swarm.errors import DecodeError

HEADER = struct.Struct(">I")
HEADER_LEN = HEADER.size
#: Absolute ceiling on any frame, whatever a caller configures.
MAX_FRAME_CEILING = 1 << 30


def encode_header(length: int) -> bytes:
    """The 4-byte prefix of a frame of ``length`` body bytes."""
    if not 0 <= length <= MAX_FRAME_CEILING:
        raise ValueError(f"frame length {length} out of range")
    return HEADER.pack(length)


def encode_frame(body: bytes) -> bytes:
    """Header and body in one buffer (small frames; large ones write the two parts)."""
    return encode_header(len(body)) + body


class FrameReader:
    """Incremental frame decoder with a hard bound on frame size.

    Small frames are parsed out of a fixed scratch buffer (many per read); the body of a
    large frame is read straight into its own allocation, sized by its validated header.
    At most one body is being filled at a time, and completed frames wait in a queue the
    caller drains with :meth:`next_frame`, so the memory held is bounded by
    ``max_frame`` + ``scratch`` plus what the caller leaves undrained.
    """

    def __init__(self, max_frame: int, *, scratch: int = 256 << 10, hold: bool = False
                 ) -> None:
        if not 0 < max_frame <= MAX_FRAME_CEILING or scratch < HEADER_LEN:
            raise ValueError("max_frame or scratch out of range")
        self.max_frame = max_frame
        #: Stop parsing after each completed frame until :meth:`resume` (handshakes: the
        #: frame may change how the next ones are bounded). What follows in the same read
        #: waits in a stash of at most two scratch buffers.
        self.hold = hold
        self._stash = bytearray()
        self._scratch = bytearray(scratch)
        self._header = bytearray(HEADER_LEN)
        self._have_header = 0
        self._body: bytearray | None = None
        self._have_body = 0
        self._direct = False
        self._done: deque[tuple[bytes, bytearray]] = deque()

    @property
    def mid_frame(self) -> bool:
        """True while a frame has started but not finished (a stall here is a timeout)."""
        return self._have_header > 0 or self._body is not None

    @property
    def pending(self) -> int:
        """Completed frames not yet taken."""
        return len(self._done)

    def get_buffer(self) -> memoryview:
        """Where the next bytes should be read to."""
        body = self._body
        if body is not None and not self._stash \
                and len(body) - self._have_body >= len(self._scratch):
            self._direct = True
            return memoryview(body)[self._have_body:]
        self._direct = False
        return memoryview(self._scratch)

    def advance(self, n: int) -> None:
        """Record that ``n`` bytes were written into the last :meth:`get_buffer`.

        :raises DecodeError: a header announces a frame over ``max_frame``.
        """
        if self._direct:
            self._have_body += n
            self._finish_body()
        else:
            self._consume(memoryview(self._scratch)[:n])

    def _finish_body(self) -> None:
        body = self._body
        if body is not None and self._have_body == len(body):
            self._done.append((bytes(self._header), body))
            self._body = None
            self._have_body = 0

    def _consume(self, view: memoryview) -> None:
        if self._stash:  # held: keep the order of the bytes
            if len(self._stash) + len(view) > 2 * len(self._scratch):
                raise DecodeError("peer sent too much before the handshake finished")
            self._stash += view
            return
        while view:
            body = self._body
            if body is None:
                take = min(HEADER_LEN - self._have_header, len(view))
                self._header[self._have_header:self._have_header + take] = view[:take]
                self._have_header += take
                view = view[take:]
                if self._have_header < HEADER_LEN:
                    return
                self._have_header = 0
                (length,) = HEADER.unpack(self._header)
                if length > self.max_frame:
                    raise DecodeError(
                        f"frame of {length} bytes is over the bound {self.max_frame}")
                if length == 0:
                    self._done.append((bytes(self._header), bytearray()))
                    if self.hold and view:
                        self._stash += view
                        return
                    continue
                self._body = bytearray(length)
                self._have_body = 0
                continue
            take = min(len(body) - self._have_body, len(view))
            body[self._have_body:self._have_body + take] = view[:take]
            self._have_body += take
            view = view[take:]
            self._finish_body()
            if self.hold and self._body is None and view:
                self._stash += view
                return

    def resume(self) -> None:
        """Parse what was held back after the last frame (under the current bound).

        :raises DecodeError: as :meth:`advance`.
        """
        stash, self._stash = self._stash, bytearray()
        self._consume(memoryview(stash))
    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in (tests, fuzzing, drivers that receive ``bytes``).

        :raises DecodeError: as :meth:`advance`.
        """
        self._consume(memoryview(data))

    def next_frame(self) -> bytearray | None:
        """The oldest completed frame body, or ``None``."""
        return self._done.popleft()[1] if self._done else None

    def next_frame_with_header(self) -> tuple[bytes, bytearray] | None:
        """The oldest completed frame as ``(header, body)`` (the header is the AEAD's AAD)."""
        return self._done.popleft() if self._done else None
