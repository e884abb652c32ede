"""``swarm bench transport`` runs end to end at a small size and prints every figure."""

from __future__ import annotations

import argparse

import pytest

from swarm.bench import transport

pytestmark = pytest.mark.timeout(120)


def test_bench_transport_prints_all_three_and_the_ratios(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    args = parser.parse_args(["--size", "8", "--connections", "1,2"])
    assert transport.run(args) == 0
    out = capsys.readouterr().out
    for mode in ("raw asyncio TCP", "data plane (aes-256-gcm", "py-libp2p streams"):
        assert out.count(mode) == 2
    assert "1 connection(s):" in out and "2 connection(s):" in out
    assert "data plane / libp2p" in out and "data plane / raw TCP" in out


async def test_each_measurement_moves_the_bytes_it_reports() -> None:
    raw = await transport.bench_raw(8 << 20, 2)
    plane = await transport.bench_dataplane(8 << 20, 2, "chacha20-poly1305", crypto_threads=0)
    assert raw.nbytes == plane.nbytes == 8 << 20
    assert raw.mb_per_s > 0 and plane.mb_per_s > 0 and plane.cpu_per_gb > 0
