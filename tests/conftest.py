"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

_DUMP_AHEAD_S = 20.0
_dumps: dict[str, threading.Timer] = {}


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    print(f"\n===== asyncio tasks of a test near its time-out ({len(asyncio.all_tasks(loop))})",
          file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        print(f"--- {task.get_name()}", file=sys.stderr)
        task.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def _near_timeout() -> None:
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            obj.call_soon_threadsafe(_dump_tasks, obj)


def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Shortly before pytest-timeout fails a test, print the stacks of its asyncio tasks
    (pytest-timeout prints the threads', where an idle event loop shows nothing): a hang
    in CI then names the await it is stuck on."""
    if settings.timeout and settings.timeout > 2 * _DUMP_AHEAD_S:
        timer = threading.Timer(settings.timeout - _DUMP_AHEAD_S, _near_timeout)
        timer.daemon = True
        timer.start()
        _dumps[item.nodeid] = timer


def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = _dumps.pop(item.nodeid, None)
    if timer is not None:
        timer.cancel()


@pytest.fixture
def quiet_exchange_bans() -> Iterator[None]:
    """Bans are logged at WARNING by design; the simulator's malicious runs make hundreds."""
    logging.getLogger("swarm.protocol.exchange").setLevel(logging.ERROR)
    yield
    logging.getLogger("swarm.protocol.exchange").setLevel(logging.NOTSET)


@pytest.fixture
def needs_lab() -> None:
    """Skip, saying why, where the kernel network lab cannot run (not root, no iptables)."""
    from swarm.lab import kernel

    try:
        kernel.check_available()
    except kernel.LabUnavailable as exc:
        pytest.skip(str(exc))
