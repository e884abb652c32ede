"""Trio inside asyncio: one trio guest run per asyncio loop, on the same thread.

py-libp2p is trio-only; swarm is asyncio. :func:`trio_guest` starts
:func:`trio.lowlevel.start_guest_run` driven by the running asyncio loop (trio's I/O
waits happen in trio's helper thread; every trio task runs on the loop's thread between
asyncio callbacks). Trio allows one run per thread, so the run is shared: each
``async with trio_guest()`` takes a reference, and the last one out stops the run and
waits for it to finish, so no trio task, socket or thread outlives its users.

The bridge calls both ways and carries cancellation both ways:

- :meth:`TrioGuest.run` (asyncio -> trio): run a trio async function as a task of the
  guest run. Cancelling the asyncio caller cancels the trio task (and waits for it to
  unwind); if the guest run shuts down first, the caller gets :class:`BridgeClosed`.
- :meth:`TrioGuest.call_asyncio` (trio -> asyncio, from trio code): run an asyncio
  coroutine function as an asyncio task. Cancelling the trio caller cancels the asyncio
  task (and waits for it); an asyncio task cancelled on its side raises
  :class:`BridgeCancelled` in trio.
- :meth:`TrioGuest.start_service` runs a long-lived trio task (a libp2p host) that the
  asyncio side stops later with :meth:`ServiceHandle.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import trio

from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BridgeClosed(SwarmError):
    """The trio guest run stopped before the call finished."""


class BridgeCancelled(SwarmError):
    """The asyncio task a trio caller waited on was cancelled on the asyncio side."""


def is_cancellation(exc: BaseException) -> bool:
    """True for :class:`trio.Cancelled` or a group made only of them."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return False


class ServiceHandle:
    """A long-lived trio task started by :meth:`TrioGuest.start_service`."""

    def __init__(self, guest: TrioGuest, name: str) -> None:
        self.guest = guest
        self.name = name
        self.scope: trio.CancelScope | None = None
        self.finished: asyncio.Future[None] = guest.loop.create_future()
        self._stop_requested = False

    def _cancel_in_trio(self) -> None:
        self._stop_requested = True
        if self.scope is not None:
            self.scope.cancel()

    async def stop(self) -> None:
        """Cancel the task and wait until it has unwound (its ``finally`` blocks ran)."""
        if not self.finished.done():
            self.guest._soon(self._cancel_in_trio)
        with contextlib.suppress(BaseException):
            await asyncio.shield(self.finished)


class TrioGuest:
    """The shared trio guest run of one asyncio loop. Obtain it with :func:`trio_guest`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.refs = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._started: asyncio.Future[None] = loop.create_future()
        self._done: asyncio.Future[None] = loop.create_future()
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        trio.lowlevel.start_guest_run(
            self._trio_main,
            run_sync_soon_threadsafe=self._call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self._call_soon,
            done_callback=self._on_done,
            host_uses_signal_set_wakeup_fd=True,
            strict_exception_groups=True,
        )

    def _call_soon_threadsafe(self, fn: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def _call_soon(self, fn: Callable[[], object]) -> None:
        self.loop.call_soon(fn)

    async def _trio_main(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            if not self._started.done():
                self._started.set_result(None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        self._nursery = None

    def _on_done(self, result: Any) -> None:
        try:
            result.unwrap()
        except BaseException as exc:
            logger.error("trio guest run ended with an error", exc_info=exc)
            if not self._started.done():
                self._started.set_exception(BridgeClosed(f"trio guest run failed: {exc}"))
        if not self._done.done():
            self._done.set_result(None)

    async def _shutdown(self) -> None:
        self._stopping = True
        if self._started.done() and self._started.exception() is None:
            self._soon(self._set_stop)
        await asyncio.shield(self._done)

    def _set_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` inside trio's context (a trio callback) as soon as possible."""
        if self._token is None or self._done.done():
            raise BridgeClosed("the trio guest run is not running")
        self._token.run_sync_soon(fn)

    # -- asyncio -> trio -------------------------------------------------------------
    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and return its result (or raise its error).

        :raises BridgeClosed: the guest run is stopping or stopped.
        """
        if self._stopping or self._nursery is None:
            raise BridgeClosed("the trio guest run is not running")
        fut: asyncio.Future[T] = self.loop.create_future()
        scope_box: list[trio.CancelScope] = []
        cancel_early = [False]

        async def runner() -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                if cancel_early[0]:
                    scope.cancel()
                try:
                    value = await fn(*args)
                except BaseException as exc:
                    if is_cancellation(exc):
                        if not fut.done():
                            fut.set_exception(BridgeClosed("the trio task was cancelled"))
                        raise
                    if not fut.done():
                        fut.set_exception(exc)
                    return
                if not fut.done():
                    fut.set_result(value)

        def spawn() -> None:
            if self._nursery is None:
                if not fut.done():
                    fut.set_exception(BridgeClosed("the trio guest run stopped"))
                return
            self._nursery.start_soon(runner)

        self._soon(spawn)

        def cancel_in_trio() -> None:
            cancel_early[0] = True
            for s in scope_box:
                s.cancel()

        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                with contextlib.suppress(BridgeClosed):
                    self._soon(cancel_in_trio)
                with contextlib.suppress(BaseException):
                    await asyncio.shield(fut)
            raise

    def start_service(self, fn: Callable[[Callable[[], None]], Awaitable[None]], name: str
                      ) -> tuple[ServiceHandle, asyncio.Future[None]]:
        """Start ``fn(ready)`` as a long-lived trio task.

        ``fn`` calls ``ready()`` once it is up. Returns the handle and a future that
        resolves when ``ready`` was called (or fails with the task's error).
        """
        if self._stopping or self._nursery is None:
            raise BridgeClosed("the trio guest run is not running")
        handle = ServiceHandle(self, name)
        ready: asyncio.Future[None] = self.loop.create_future()

        def mark_ready() -> None:
            if not ready.done():
                ready.set_result(None)

        async def runner() -> None:
            try:
                with trio.CancelScope() as scope:
                    handle.scope = scope
                    if handle._stop_requested:
                        scope.cancel()
                    try:
                        await fn(mark_ready)
                    except BaseException as exc:
                        if is_cancellation(exc):
                            raise
                        if not ready.done():
                            ready.set_exception(exc)  # the starter's error
                            return
                        logger.warning("trio service %s failed: %r", name, exc)
            finally:
                if not ready.done():
                    ready.set_exception(BridgeClosed(f"trio service {name} stopped"))
                if not handle.finished.done():
                    handle.finished.set_result(None)

        def spawn() -> None:
            if self._nursery is None:
                ready.set_exception(BridgeClosed("the trio guest run stopped"))
                handle.finished.set_result(None)
                return
            self._nursery.start_soon(runner, name=name)

        self._soon(spawn)
        return handle, ready

    # -- trio -> asyncio -------------------------------------------------------------
    async def call_asyncio(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """From trio code: run ``fn(*args)`` as an asyncio task and return its result.

        :raises BridgeCancelled: the asyncio task was cancelled on the asyncio side.
        """
        task = self.loop.create_task(fn(*args))
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        task.add_done_callback(lambda _t: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except BaseException:
            task.cancel()
            with trio.CancelScope(shield=True):
                await done.wait()
            if task.done() and not task.cancelled() and task.exception() is not None:
                task.exception()  # retrieved: the trio side is unwinding anyway
            raise
        if task.cancelled():
            raise BridgeCancelled("the asyncio task was cancelled")
        return task.result()


_GUESTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TrioGuest] = (
    weakref.WeakKeyDictionary())


@contextlib.asynccontextmanager
async def trio_guest() -> AsyncIterator[TrioGuest]:
    """The loop's trio guest run, started on first use and stopped by the last user."""
    loop = asyncio.get_running_loop()
    guest = _GUESTS.get(loop)
    if guest is None or guest._stopping:
        if guest is not None:
            await asyncio.shield(guest._done)
        guest = TrioGuest(loop)
        _GUESTS[loop] = guest
        guest._start()
    guest.refs += 1
    try:
        await asyncio.shield(guest._started)
        yield guest
    finally:
        guest.refs -= 1
        if guest.refs == 0:
            if _GUESTS.get(loop) is guest:
                del _GUESTS[loop]
            await guest._shutdown()
