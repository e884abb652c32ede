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
