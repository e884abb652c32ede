"""Layering rules that keep the cores sans-IO: nothing under ``swarm/protocol`` imports
asyncio, trio or torch (the same cores run on sockets, in memory and in the simulator)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import swarm.protocol


def test_protocol_imports_no_asyncio_trio_or_torch() -> None:
    mods = sorted(m.name for m in pkgutil.walk_packages(swarm.protocol.__path__,
                                                         "swarm.protocol."))
    assert "swarm.protocol.follow" in mods and "swarm.protocol.exchange" in mods
    code = ("import sys\n"
            f"for m in {mods!r}: __import__(m)\n"
            "print(','.join(sorted(m for m in ('asyncio', 'trio', 'torch') "
            "if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == ""
