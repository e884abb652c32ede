"""Structured status events of a long-running node: JSON lines, a log line, metrics.

Every event is ``{"t": unix time, "node": name, "event": kind, ...fields}``. With
``json_out`` set the events go to that stream one per line (``swarm demo`` reads them from
its children); otherwise each becomes an INFO log line. Prometheus metrics are optional.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

log = logging.getLogger(__name__)


class Reporter:
    """Emits status events and keeps counters for ``--metrics-port``."""

    def __init__(self, node: str, *, json_out: TextIO | None = None,
                 metrics_port: int | None = None) -> None:
        self.node = node
        self._out = json_out
        self._lock = threading.Lock()
        self._gauges: dict[str, Any] = {}
        if metrics_port is not None:
            self._start_metrics(metrics_port)

    def __call__(self, event: str, fields: dict[str, object]) -> None:
        self.emit(event, **fields)

    def emit(self, event: str, **fields: object) -> None:
        record = {"t": round(time.time(), 3), "node": self.node, "event": event, **fields}
        self._observe(event, fields)
        if self._out is not None:
            with self._lock:
                self._out.write(json.dumps(record, default=str) + "\n")
                self._out.flush()
        else:
            log.info("%s %s %s", self.node, event,
                     " ".join(f"{k}={v}" for k, v in fields.items()))

    def _start_metrics(self, port: int) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            print("swarm: --metrics-port needs prometheus-client (pip install "
                  "prometheus-client)", file=sys.stderr)
            return
        prom.start_http_server(port, addr="127.0.0.1")
        self._gauges = {
            "version": prom.Gauge("swarm_version", "policy version held"),
            "verified": prom.Counter("swarm_versions_verified_total", "versions verified"),
            "verify_failed": prom.Counter("swarm_verify_failures_total",
                                          "versions that failed verification"),
            "bytes_up": prom.Gauge("swarm_bytes_up", "exchange bytes uploaded"),
            "bytes_down": prom.Gauge("swarm_bytes_down", "exchange bytes downloaded"),
            "lease": prom.Counter("swarm_leases_total", "leases received"),
            "result": prom.Counter("swarm_results_total", "results submitted"),
            "tokens_per_s": prom.Gauge("swarm_tokens_per_second", "rollout tokens/s"),
            "step": prom.Gauge("swarm_trainer_step", "trainer step published"),
        }

    def _observe(self, event: str, fields: dict[str, object]) -> None:
        g = self._gauges
        if not g:
            return
        if event == "verified":
            g["verified"].inc()
            g["version"].set(fields.get("version", 0))
            g["bytes_up"].set(fields.get("bytes_up", 0))
            g["bytes_down"].set(fields.get("bytes_down", 0))
        elif event in ("verify_failed", "lease"):
            g[event].inc()
        elif event == "result":
            g["result"].inc()
            g["tokens_per_s"].set(fields.get("tokens_per_s", 0))
        elif event == "step":
            g["step"].set(fields.get("step", 0))
