"""Route py-libp2p's log records into the ``swarm.net.libp2p`` logger hierarchy.

py-libp2p configures its ``libp2p`` logger not to propagate, with no handler, so its
warnings reach stderr through Python's last-resort handler. :func:`route_libp2p_logging`
attaches one forwarding handler that re-emits each record under
``swarm.net.libp2p.<libp2p logger name>``, where the application's logging
configuration decides what is shown (libp2p's INFO records, which are per-stream
chatter, arrive as DEBUG). It installs no output handler of its own.

Two things it takes care of:

- ``import libp2p`` runs py-libp2p's ``setup_logging``, which clears the ``libp2p``
  logger's handlers: a forwarder attached before that import is removed, and libp2p's
  records then print through Python's last-resort handler (bare messages on stderr, with
  no logger name and no level filter). So libp2p is imported before attaching.
- libp2p logs an ERROR for every failed TCP dial ("Failed to open TCP stream"); the
  callers (the peer's discovery with its backoff, the bootstrap redial) handle these
  failures themselves. They are counted, not forwarded: one WARNING line under
  ``swarm.net.libp2p`` sums up each :data:`DIAL_SUMMARY_S` seconds that had some, at the
  next failure after them (each one is still forwarded at DEBUG); at INFO while
  :func:`expect_dial_failures` says they are expected. A node that cannot reach its
  bootstrap says so in its own error line, without a summary before it.
- libp2p logs an ERROR for a dial whose security handshake fails ("failed to upgrade
  security for peer ...": the address answers with another peer id, as when a
  ``--bootstrap`` names a wrong ``/p2p`` id); it is counted with the failed dials.
- yamux logs an ERROR ("Error in handle_incoming ... ClosedResourceError") whenever a
  connection this node closed itself is read once more: every refused reconnection of
  a banned peer printed one. It is forwarded at DEBUG.
- libp2p's swarm logs a WARNING with a traceback ("[ADDCONN_FAIL] ... Cannot schedule
  task after service has stopped") for a connection that arrives while this node stops:
  every peer redialling a stopping trainer printed one. It is forwarded at DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

PREFIX = "swarm.net.libp2p"
#: Shortest time between two summaries of failed dials.
DIAL_SUMMARY_S = 60.0
#: A dial answered by another peer id than the one dialled (the node says so in its own
#: error line; three raw ERROR lines came before it).
_SECURITY_FAILED = "failed to upgrade security for peer "
_DIAL_FAILED = ("Failed to open TCP stream", "Unexpected error opening TCP stream",
                # a stream to a peer whose connection just broke (a peer gone away)
                "Failed to open stream to peer", "MultiselectClient handshake",
                _SECURITY_FAILED)
_CLOSED_HERE = ("Error in handle_incoming for peer", "ClosedResourceError")
_STOPPING = ("[ADDCONN_FAIL]", "Cannot schedule task after service has stopped")
#: A failed bind: the node fails to start with its own error (``listen_failure``).
_LISTEN_FAILED = "Failed to start TCP listener for "


class DialFailures:
    """Counts libp2p's per-attempt dial errors; says when a summary is due."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.count = 0
        self.targets: dict[str, int] = {}
        self._since: float | None = None
        """When the failures counted now began (None: none counted)."""
        self.level = logging.WARNING
        """Of the summary lines (INFO while failures are expected)."""

    def add(self, record: logging.LogRecord) -> str | None:
        """Count ``record``; the summary line to log now, if one is due."""
        target = "streams on a broken connection"
        if record.msg.startswith(_DIAL_FAILED[:2]) and isinstance(record.args, tuple) \
                and record.args:
            target = str(record.args[0]).rsplit(" to ", 1)[-1].removesuffix(" failed")
        elif record.msg.startswith(_SECURITY_FAILED):
            target = "peers that did not prove the id dialled"
        with self._lock:
            self.count += 1
            self.targets[target] = self.targets.get(target, 0) + 1
            now = self.clock()
            if self._since is None:
                self._since = now
            if now - self._since < DIAL_SUMMARY_S:
                return None
            span = now - self._since
            self._since = None
            count, targets, self.count, self.targets = self.count, self.targets, 0, {}
        shown = ", ".join(f"{t} ({n}x)" for t, n in sorted(targets.items())[:5])
        more = f" and {len(targets) - 5} more" if len(targets) > 5 else ""
        return (f"{count} dial(s) failed in the last {span:.0f} s: {shown}{more} "
                "(retried with backoff)")


_DIALS = DialFailures()


def _expected(record: logging.LogRecord, level: int) -> bool:
    """A yamux read of a connection closed here, a connection arriving as we stop, or a
    failed bind (which the node reports as its own error)."""
    msg = record.msg
    if not isinstance(msg, str):
        return False
    if msg.startswith(_LISTEN_FAILED):
        return True
    if level >= logging.ERROR and msg.startswith(_CLOSED_HERE[0]):
        return _CLOSED_HERE[1] in msg
    return msg.startswith(_STOPPING[0]) and _STOPPING[1] in record.getMessage()


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        level = logging.DEBUG if record.levelno == logging.INFO else record.levelno
        if level >= logging.ERROR and isinstance(record.msg, str) \
                and record.msg.startswith(_DIAL_FAILED):
            summary = _DIALS.add(record)
            if summary is not None:
                logging.getLogger(PREFIX).log(_DIALS.level, "%s", summary)
            level = logging.DEBUG
        elif _expected(record, level):
            level = logging.DEBUG
        target = logging.getLogger(f"{PREFIX}.{record.name}")
        if target.isEnabledFor(level):
            copy = logging.makeLogRecord(record.__dict__)  # others may hold the original
            copy.name = target.name
            copy.levelno, copy.levelname = level, logging.getLevelName(level)
            target.handle(copy)


_HANDLER = _Forward()


def expect_dial_failures(expected: bool) -> None:
    """Sum up failed dials at INFO while ``expected`` (a peer redialling the trainer of a
    finished run, which it has said), at WARNING otherwise."""
    _DIALS.level = logging.INFO if expected else logging.WARNING


def route_libp2p_logging() -> None:
    """Idempotent: forward ``libp2p.*`` records to ``swarm.net.libp2p.*``.

    libp2p's level follows the effective level of ``swarm.net.libp2p`` at the time of the
    call, so libp2p does not build debug records nobody will read.
    """
    import libp2p  # noqa: F401 - its import clears the libp2p logger's handlers

    source = logging.getLogger("libp2p")
    if _HANDLER not in source.handlers:
        source.addHandler(_HANDLER)
    source.propagate = False
    source.setLevel(logging.getLogger(PREFIX).getEffectiveLevel())
