"""The placement file of ``swarm bench e2e --placement``: read back as written, and
anything else refused with one clear line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from swarm.bench.placement import Placement, PlacementError, Spot, load


def _good() -> Placement:
    ns = ["ip", "netns", "exec", "swl00000-p0"]
    return Placement(Spot("trainer", "a", "10.77.10.6"), Spot("bootstrap", "a", "10.77.10.2"),
                     (Spot("p0", "b", "10.77.11.2", tuple(ns)),
                      Spot("p1", "c", "10.77.128.2", tuple(ns), natted=True)))


def test_a_placement_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _good().write(path)
    assert load(path) == _good()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(peers=[]), "peers must be a list of 1-1024"),
    (lambda d: d["trainer"].update(addr="10.77.10"), "trainer: addr '10.77.10' is not an IPv4"),
    (lambda d: d["trainer"].update(addr=167772161), "trainer: addr 167772161 is not an IPv4"),
    (lambda d: d["peers"][0].update(launcher="ip netns"), r"peers\[0\]: launcher must be"),
    (lambda d: d["peers"][1].update(name="p0"), "peer names repeat"),
    (lambda d: d["peers"][0].update(natted="yes"), "natted must be true or false"),
    (lambda d: d.pop("bootstrap"), "bootstrap: expected an object"),
])
def test_a_bad_placement_is_one_clear_error(tmp_path: Path,
                                            edit: Callable[[dict[str, Any]], None],
                                            message: str) -> None:
    data = _good().as_dict()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlacementError, match=message):
        load(path)


def test_unreadable_oversized_or_not_json(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="cannot read placement"):
        load(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(PlacementError, match="over 1048576 bytes"):
        load(big)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlacementError, match="is not JSON"):
        load(bad)
