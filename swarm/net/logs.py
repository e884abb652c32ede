"""Route py-libp2p's log records into the ``swarm.net.libp2p`` logger hierarchy.

py-libp2p configures its ``libp2p`` logger not to propagate, with no handler, so its
warnings reach stderr through Python's last-resort handler. :func:`route_libp2p_logging`
attaches one forwarding handler that re-emits each record under
``swarm.net.libp2p.<libp2p logger name>``, where the application's logging
configuration decides what is shown (libp2p's INFO records, which are per-stream
chatter, arrive as DEBUG). It installs no output handler of its own.
"""

from __future__ import annotations

import logging

PREFIX = "swarm.net.libp2p"


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        level = logging.DEBUG if record.levelno == logging.INFO else record.levelno
        target = logging.getLogger(f"{PREFIX}.{record.name}")
        if target.isEnabledFor(level):
            copy = logging.makeLogRecord(record.__dict__)  # others may hold the original
            copy.name = target.name
            copy.levelno, copy.levelname = level, logging.getLevelName(level)
            target.handle(copy)


_HANDLER = _Forward()


def route_libp2p_logging() -> None:
    """Idempotent: forward ``libp2p.*`` records to ``swarm.net.libp2p.*``.

    libp2p's level follows the effective level of ``swarm.net.libp2p`` at the time of the
    call, so libp2p does not build debug records nobody will read.
    """
    source = logging.getLogger("libp2p")
    if _HANDLER not in source.handlers:
        source.addHandler(_HANDLER)
    source.propagate = False
    source.setLevel(logging.getLogger(PREFIX).getEffectiveLevel())
