"""A node's task group: its background tasks live and die together.

A task that fails cancels the others, records the failure and sets ``closed``; callers
waiting through :meth:`TaskGroup.wait` then get :class:`~swarm.errors.NodeFailed` with the
cause chained, instead of waiting for ever on a node that stopped. Unlike
:class:`asyncio.TaskGroup`, the group outlives the ``async with`` body of its node (the
body is the user's code, which the group must not cancel) and reports failures to
whoever waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from swarm.aio import cancel_and_wait
from swarm.errors import NodeFailed
from swarm.net.transport import TransportClosed

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskGroup:
    """Owns a node's tasks (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: dict[asyncio.Task[None], Coroutine[Any, Any, None]] = {}
        """Running tasks and their coroutines (a finished task leaves on its own)."""
        self.failure: NodeFailed | None = None
        self.closed = asyncio.Event()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
        """Run ``coro`` in the group (``None``: the group is closed; it never runs)."""
        if self.closed.is_set():
            coro.close()
            return None
        task = asyncio.create_task(self._guard(coro, name), name=name)
        self._tasks[task] = coro
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled():
            task.exception()  # retrieved: _guard logged it and failed the group

    async def _guard(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await coro
        except (asyncio.CancelledError, TransportClosed):
            raise
        except Exception as exc:
            log.error("%s: task %s failed: %s", self.name, name, exc,
                      exc_info=not isinstance(exc, NodeFailed))
            self.fail(exc, name)
            raise

    def fail(self, exc: BaseException, where: str) -> None:
        """Stop the group because of ``exc``: cancel every task, wake every waiter."""
        if self.failure is None:
            failure = NodeFailed(f"{self.name} stopped: {where}: {exc}")
            failure.__cause__ = exc
            self.failure = failure
        self.closed.set()
        me = asyncio.current_task()
        for t in list(self._tasks):
            if t is not me:
                t.cancel()

    async def wait(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the group closes first.

        :raises NodeFailed: a task failed (its cause chained), or the node was closed.
        """
        if self.closed.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()  # never to run
            self._raise_if_closed()
        fut = asyncio.ensure_future(aw)
        closed = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait({fut, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not fut.done():
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await fut
        if fut.done() and not fut.cancelled():
            return fut.result()
        self._raise_if_closed()
        raise NodeFailed(f"{self.name} closed")

    def _raise_if_closed(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.closed.is_set():
            raise NodeFailed(f"{self.name} closed")

    async def close(self) -> None:
        """Cancel every task and wait for them to end."""
        self.closed.set()
        tasks = dict(self._tasks)
        await cancel_and_wait(tasks.keys(), self.name)
        for task, coro in tasks.items():
            if task.done():  # (not one left running: see cancel_and_wait)
                coro.close()  # a task cancelled before it ran never started its coroutine
        self._tasks.clear()
