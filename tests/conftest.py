"""Fixtures shared by the test modules."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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
