"""Length-prefixed frames: the sans-IO reader shared by the data plane and libp2p streams.

A frame on the wire is a 4-byte big-endian length ``n`` followed by ``n`` bytes. The
reader refuses a length over its bound before anything else, and hands its caller the
buffer to read into (the shape of :class:`asyncio.BufferedProtocol`), so most of a
4 MiB frame is received straight into its final allocation.

A body buffer grows as its bytes arrive (doubling, from 64 KiB), never to the announced
length up front: a peer that announces 16 MiB and stalls costs what it sent, at most
twice over. With an :class:`Allowance`, the announced length is also reserved from a
shared byte budget when the header arrives; a refusal blocks the reader (``blocked``)
until :meth:`FrameReader.grant`, so every reserved frame can always finish (no two
readers wait on each other's partial frames).

Usage (an I/O driver)::

    reader = FrameReader(max_frame=...)
    buf = reader.get_buffer()        # read up to len(buf) bytes into it
    reader.advance(nread)            # raises DecodeError on an oversized header
    while (frame := reader.next_frame()) is not None: ...
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Protocol

from swarm.errors import DecodeError

HEADER = struct.Struct(">I")
HEADER_LEN = HEADER.size
#: Absolute ceiling on any frame, whatever a caller configures.
MAX_FRAME_CEILING = 1 << 30
#: The first allocation of a body larger than this; it doubles from there.
MIN_GROW = 64 << 10


class Allowance(Protocol):
    """A byte budget a reader reserves each frame's announced length from."""

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes now if they are free (never blocks)."""
        ...


def _grow(body: bytearray, size: int) -> bytearray:
    """``body`` extended (zero-filled) to ``size`` bytes; a copy if it is exported."""
    try:
        body.extend(bytes(size - len(body)))
        return body
    except BufferError:  # a memoryview of it is still alive: move to a new buffer
        out = bytearray(size)
        out[:len(body)] = body
        return out


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
    large frame is read straight into its own allocation, grown as bytes arrive. At most
    one body is being filled at a time, and completed frames wait in a queue the caller
    drains with :meth:`next_frame`, so the memory held is bounded by twice what the peer
    sent of the current frame (at most ``max_frame``) + ``scratch``, plus what the caller
    leaves undrained.

    With ``allowance``, each frame's length is reserved from it when the header arrives
    (the caller gives a taken frame's ``len(body)`` back when done with it). A refusal
    sets :attr:`blocked` to the bytes wanted; the reader then keeps what it is fed in its
    stash (the driver should stop reading) until :meth:`grant`.
    """

    def __init__(self, max_frame: int, *, scratch: int = 256 << 10, hold: bool = False,
                 allowance: Allowance | None = None) -> None:
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
        self._want = 0
        self._have_body = 0
        self._direct = False
        self.allowance = allowance
        #: Bytes the current frame waits for from the allowance (0: not blocked).
        self.blocked = 0
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
        room = len(self._scratch)
        if body is not None and not self._stash and not self.blocked \
                and self._want - self._have_body >= room:
            if len(body) - self._have_body < room:
                body = self._body = _grow(body, self._target(self._have_body + room))
            self._direct = True
            return memoryview(body)[self._have_body:]
        self._direct = False
        return memoryview(self._scratch)

    def _target(self, need: int) -> int:
        """The next capacity of the body: doubling, at least ``need``, at most its length."""
        assert self._body is not None
        return min(self._want, max(2 * len(self._body), need, MIN_GROW))

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
        if body is not None and self._have_body == self._want:
            self._done.append((bytes(self._header), body))
            self._body = None
            self._have_body = 0

    def _consume(self, view: memoryview) -> None:
        if self._stash or self.blocked:  # held: keep the order of the bytes
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
                self._body = bytearray()
                self._want = length
                self._have_body = 0
                if self.allowance is not None and not self.allowance.take(length):
                    self.blocked = length
                    self._stash += view
                    return
                continue
            take = min(self._want - self._have_body, len(view))
            if self._have_body + take > len(body):
                body = self._body = _grow(body, self._target(self._have_body + take))
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
        if self.blocked:
            return
        stash, self._stash = self._stash, bytearray()
        self._consume(memoryview(stash))

    def grant(self, n: int) -> None:
        """The allowance reserved the ``n`` bytes :attr:`blocked` asked for; call
        :meth:`resume` next to parse what waited."""
        if n != self.blocked:
            raise ValueError(f"granted {n} bytes, blocked on {self.blocked}")
        self.blocked = 0

    @property
    def reserved(self) -> int:
        """Bytes of the allowance the frame being filled holds (given back by its owner
        when the reader is dropped mid-frame)."""
        if self._body is None or self.blocked or self.allowance is None:
            return 0
        return self._want

    def set_scratch(self, size: int) -> None:
        """Use a scratch buffer of ``size`` bytes from the next :meth:`get_buffer` on
        (a connection past its handshake reads in larger slices)."""
        if size < HEADER_LEN:
            raise ValueError("scratch out of range")
        if size != len(self._scratch):
            self._scratch = bytearray(size)
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
