"""libp2p's log records surface under ``swarm.net.libp2p``."""

from __future__ import annotations

import logging

import pytest

from swarm.net import logs
from swarm.net.logs import DialFailures, expect_dial_failures, route_libp2p_logging


def test_libp2p_records_are_forwarded_under_swarm_net(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    with caplog.at_level(logging.DEBUG, logger="swarm.net.libp2p"):
        route_libp2p_logging()
        route_libp2p_logging()  # idempotent: one forwarder
        logging.getLogger("libp2p.pubsub.pubsub").warning("queue full for %s", "t")
        logging.getLogger("libp2p.network").info("stream chatter")
    names = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("swarm.net.libp2p.libp2p.pubsub.pubsub", "WARNING", "queue full for t") in names
    assert ("swarm.net.libp2p.libp2p.network", "DEBUG", "stream chatter") in names
    forwarded = [n for n in names if n[0].startswith("swarm.net.libp2p.")]
    assert sum(1 for n in forwarded if n[2] == "queue full for t") == 1


def test_yamux_reading_a_connection_closed_here_is_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every refused reconnection of a banned peer made yamux log an ERROR."""
    with caplog.at_level(logging.DEBUG, logger="swarm.net.libp2p"):
        route_libp2p_logging()
        log = logging.getLogger("libp2p.stream_muxer.yamux.yamux")
        log.error("Error in handle_incoming for peer 12D3KooWx: ClosedResourceError: ")
        log.error("Error in handle_incoming for peer 12D3KooWx: ValueError: odd")
    levels = {r.getMessage().split(": ")[1]: r.levelname for r in caplog.records
              if r.name.startswith("swarm.net.libp2p.")}
    assert levels == {"ClosedResourceError": "DEBUG", "ValueError": "ERROR"}


def test_a_connection_arriving_while_the_node_stops_logs_no_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """Peers redialling a stopping trainer made libp2p print a traceback per connection."""
    with caplog.at_level(logging.DEBUG, logger="swarm.net.libp2p"):
        route_libp2p_logging()
        log = logging.getLogger("libp2p.network.swarm")
        log.warning("[ADDCONN_FAIL] add_conn failed for peer %s: %r\n%s", "12D3KooWx",
                    RuntimeError("Cannot schedule task after service has stopped"),
                    "Traceback (most recent call last): ...")
        log.warning("[ADDCONN_FAIL] add_conn failed for peer %s: %r\n%s", "12D3KooWy",
                    RuntimeError("odd"), "Traceback (most recent call last): ...")
    levels = {r.getMessage().split(" for peer ")[1][:10]: r.levelname for r in caplog.records
              if r.name == "swarm.net.libp2p.libp2p.network.swarm"}
    assert levels == {"12D3KooWx:": "DEBUG", "12D3KooWy:": "WARNING"}


def test_failed_dials_are_summed_up_once_a_minute_not_at_the_first() -> None:
    """A node whose bootstrap is down printed a summary of one failed dial just before its
    own error line said the same."""
    now = [100.0]
    dials = DialFailures(clock=lambda: now[0])

    def fail(target: str) -> str | None:
        rec = logging.makeLogRecord({"msg": "Failed to open TCP stream to %s failed",
                                     "args": (f"dial to {target}",)})
        return dials.add(rec)

    assert fail("10.0.0.1:4001") is None  # the first failure opens a window
    now[0] += 30.0
    assert fail("10.0.0.2:4001") is None
    now[0] += 31.0
    summary = fail("10.0.0.1:4001")
    assert summary == ("3 dial(s) failed in the last 61 s: 10.0.0.1:4001 (2x), "
                       "10.0.0.2:4001 (1x) (retried with backoff)")
    now[0] += 500.0
    assert fail("10.0.0.3:4001") is None  # a new window, not a summary of one failure


def test_dial_failures_a_peer_expects_are_summed_up_at_info(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose trainer finished the run and left redials it: those failures are
    expected, and were a WARNING a minute."""
    now = [0.0]
    monkeypatch.setattr(logs, "_DIALS", DialFailures(clock=lambda: now[0]))
    route_libp2p_logging()
    log = logging.getLogger("libp2p.transport.tcp")
    levels = []
    for expected in (True, False):
        expect_dial_failures(expected)
        with caplog.at_level(logging.DEBUG, logger="swarm.net.libp2p"):
            caplog.clear()
            for _ in range(2):  # the first opens a window, the one a minute on sums it up
                log.error("Failed to open TCP stream to %s failed", "dial to 10.0.0.9:1")
                now[0] += 61.0
        levels += [r.levelname for r in caplog.records if r.name == "swarm.net.libp2p"]
    assert levels == ["INFO", "WARNING"]


def test_a_dial_answered_by_another_peer_id_is_counted_not_printed(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adversarial trial: a --bootstrap with a wrong /p2p id printed 3 raw ERROR lines
    of libp2p's before the node's own error line."""
    now = [0.0]
    monkeypatch.setattr(logs, "_DIALS", DialFailures(clock=lambda: now[0]))
    expect_dial_failures(False)
    route_libp2p_logging()
    with caplog.at_level(logging.DEBUG, logger="swarm.net.libp2p"):
        log = logging.getLogger("libp2p.network.swarm")
        for _ in range(2):
            log.error("failed to upgrade security for peer %s: %s", "12D3KooWx", "bad id")
            now[0] += 61.0
    shown = [(r.levelname, r.getMessage()) for r in caplog.records
             if r.name.startswith("swarm.net.libp2p") and r.levelno >= logging.WARNING]
    assert shown == [("WARNING", "2 dial(s) failed in the last 61 s: peers that did not "
                                 "prove the id dialled (2x) (retried with backoff)")]
