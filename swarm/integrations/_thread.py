"""A swarm node's event loop on a thread of its own, for hosts that are not asyncio.

vLLM's workers and TRL's trainer call into the swarm from plain threads. Each integration
subclasses :class:`NodeThread`: its ``_main`` binds the loop (:meth:`NodeThread._bind`),
runs the node, sets ``_ready`` once it is up and returns when the stop event is set; the
host's thread starts it with :meth:`NodeThread._launch`, calls into it with
:meth:`NodeThread._call` and ends it with :meth:`NodeThread._halt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from swarm.errors import SwarmError

T = TypeVar("T")


class NodeThread:
    def __init__(self, name: str) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def _main(self) -> None:
        raise NotImplementedError

    def _bind(self) -> asyncio.Event:
        """In ``_main``, first: this loop is the node's; the event that stops it."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        return self._stop

    def _launch(self, wait: float | None = None, join: float = 30.0) -> None:
        """Start the thread and wait (at most ``wait`` s) until the node is up.

        :raises BaseException: what made the node fail to start.
        """
        self._thread.start()
        self._ready.wait(wait)
        if self._error is not None:
            self._thread.join(join)
            raise self._error

    def _call(self, coro: Coroutine[Any, Any, T], what: str = "the swarm node",
              timeout: float | None = None) -> T:
        """Run ``coro`` on the node's loop and wait for its result.

        :raises SwarmError: the node is not running.
        """
        loop = self._loop
        if loop is None or self._error is not None or not self._thread.is_alive():
            coro.close()
            raise SwarmError(f"{what} is not running ({self._error})")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def _halt(self, join: float) -> None:
        """Set the stop event and wait (at most ``join`` s) for the thread to end."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(join)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            if self._error is None:
                self._error = exc
        finally:
            self._ready.set()
