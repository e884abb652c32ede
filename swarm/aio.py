"""Stopping asyncio tasks: cancel them, wait a bounded time, name the ones that stay.

A task that swallows its cancellation (Python 3.11's ``asyncio.wait_for`` does when the
cancel lands as its result comes) would make a plain ``cancel(); await task`` wait for
ever, and with it the node's stop and everything waiting on that. Here the stop goes on
after ``grace`` seconds, with a warning naming each task still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

log = logging.getLogger(__name__)

STOP_GRACE_S = 60.0
"""How long a stop waits for its cancelled tasks (a verified version being written when
the stop came finishes first: see ``RolloutPeer``)."""


async def cancel_and_wait(tasks: Collection[asyncio.Future[None]], owner: str,
                          grace: float = STOP_GRACE_S) -> None:
    """Cancel ``tasks`` and wait up to ``grace`` seconds for them to end.

    Their errors are retrieved and dropped (their owner logged them, or they came from
    the cancellation). A cancellation of the caller is not swallowed.
    """
    if not tasks:
        return
    for t in tasks:
        t.cancel()
    done, pending = await asyncio.wait(tasks, timeout=grace)
    for t in done:
        if not t.cancelled():
            t.exception()
    for t in pending:
        name = t.get_name() if isinstance(t, asyncio.Task) else repr(t)
        log.warning("%s: task %s did not stop within %g s of being cancelled; "
                    "stopping without it", owner, name, grace)
