"""The trio guest run inside asyncio: calls and cancellation in both directions."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from swarm.net.bridge import BridgeCancelled, TrioGuest, trio_guest

pytestmark = pytest.mark.timeout(20)


async def test_asyncio_calls_trio_on_the_same_thread() -> None:
    main = threading.get_ident()

    async def in_trio(x: int) -> tuple[int, int]:
        await trio.sleep(0.01)
        return x * 2, threading.get_ident()

    async with trio_guest() as guest:
        assert await guest.run(in_trio, 21) == (42, main)

        async def boom() -> None:
            raise ValueError("from trio")

        with pytest.raises(ValueError, match="from trio"):
            await guest.run(boom)


async def test_cancelling_the_asyncio_caller_cancels_the_trio_task() -> None:
    unwound = asyncio.Event()

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            unwound.set()

    async with trio_guest() as guest:
        task = asyncio.create_task(guest.run(forever))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert unwound.is_set()  # the trio side ran its finally before the caller resumed


async def test_trio_calls_asyncio_and_cancellation_reaches_the_asyncio_task() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def quick(x: int) -> int:
        await asyncio.sleep(0.01)
        return x + 1

    async def trio_side(guest: TrioGuest) -> int:
        value = await guest.call_asyncio(quick, 1)
        with trio.move_on_after(0.05):
            await guest.call_asyncio(slow)
        return value

    async with trio_guest() as guest:
        assert await guest.run(trio_side, guest) == 2
        assert cancelled.is_set()


async def test_asyncio_side_cancellation_surfaces_in_trio() -> None:
    async def victim() -> None:
        await asyncio.sleep(60)

    async def trio_side(guest: TrioGuest) -> str:
        holder: list[asyncio.Task[None]] = []

        async def start() -> None:
            holder.append(asyncio.current_task())  # type: ignore[arg-type]
            await victim()

        async def canceller() -> None:
            await trio.sleep(0.05)
            holder[0].cancel()

        async with trio.open_nursery() as n:
            n.start_soon(canceller)
            try:
                await guest.call_asyncio(start)
            except BridgeCancelled:
                return "cancelled"
        return "not cancelled"

    async with trio_guest() as guest:
        assert await guest.run(trio_side, guest) == "cancelled"


async def test_guest_run_is_shared_and_stops_with_the_last_user() -> None:
    async with trio_guest() as g1:
        async with trio_guest() as g2:
            assert g1 is g2
        await g1.run(trio.sleep, 0)
        assert not g1._done.done()
    assert g1._done.done()
