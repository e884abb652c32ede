"""Structured status events of a long-running node: JSON lines, a log line, metrics.

Every event is ``{"t": unix time, "node": name, "event": kind, ...fields}``. With
``json_out`` set the events go to that stream one per line (``swarm demo`` reads them from
its children); with ``human_out`` set the progress events (a version verified, a step
published, ...) become one readable line each there (:func:`human_line`); every event is
also an INFO log line. Prometheus metrics are optional.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

from swarm.errors import LocalProtocolError

log = logging.getLogger(__name__)


class Reporter:
    """Emits status events and keeps counters for ``--metrics-port``."""

    def __init__(self, node: str, *, json_out: TextIO | None = None,
                 human_out: TextIO | None = None, metrics_port: int | None = None) -> None:
        self.node = node
        self._out = json_out
        self._human = None if json_out is not None else human_out
        self._progress = _Progress()
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
            return
        log.info("%s %s %s", self.node, event, " ".join(f"{k}={v}" for k, v in fields.items()))
        if self._human is not None:
            line = self._progress.line(event, fields)
            if line is not None:
                self.say(line)

    def say(self, line: str) -> None:
        """One human-readable line on ``human_out`` (nothing with JSON output or --quiet)."""
        if self._human is not None:
            with self._lock:
                self._human.write(line + "\n")
                self._human.flush()

    def _start_metrics(self, port: int) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            print("swarm: --metrics-port needs prometheus-client (pip install "
                  "prometheus-client)", file=sys.stderr)
            return
        try:
            prom.start_http_server(port, addr="127.0.0.1")
        except OSError as exc:
            why = (exc.strerror or str(exc)).lower()
            raise LocalProtocolError(f"--metrics-port {port}: {why}") from exc
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


def human_bytes(n: object) -> str:
    size = float(n) if isinstance(n, int | float) else 0.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


class _Progress:
    """Turns status events into progress lines; keeps the counters a line reports as
    deltas (bytes down since the last version, leases since the last version)."""

    def __init__(self) -> None:
        self.down = 0
        self.from_trainer = 0
        self.leases = 0
        self.tasks = 0

    def line(self, event: str, f: dict[str, object]) -> str | None:
        if event == "lease":
            self.leases += 1
            return None
        if event == "result":
            self.tasks += _int(f.get("tasks"))
            return None
        if event == "verified" and f.get("kind") == "local":
            return (f"version {f.get('version')} verified: the local weights hash to the "
                    "run card's root (only deltas travel from here)")
        if event == "verified":
            down = _int(f.get("bytes_down"))
            got = max(0, down - self.down)
            self.down = down
            src = f"{human_bytes(got)} down"
            if "bytes_from_trainer" in f:
                trainer = _int(f.get("bytes_from_trainer"))
                from_trainer = trainer - self.from_trainer
                if from_trainer < 0:  # a new connection to the trainer counts from 0
                    from_trainer = trainer
                self.from_trainer = trainer
                from_trainer = min(from_trainer, got)
                src = (f"{human_bytes(got)} down ({human_bytes(from_trainer)} from the "
                       f"trainer, {human_bytes(got - from_trainer)} from peers)")
            leases, tasks, self.leases, self.tasks = self.leases, self.tasks, 0, 0
            return (f"version {f.get('version')} verified ({f.get('kind')}, "
                    f"{human_bytes(f.get('bytes'))}) in {f.get('sync_s')} s; {src}; "
                    f"{human_bytes(f.get('bytes_up'))} up in all; "
                    f"leases {leases}, tasks {tasks} since the last version")
        if event == "verify_failed":
            return f"version {f.get('version')} FAILED verification: {f.get('error')}"
        if event == "published":
            return (f"step {f.get('step')} published ({f.get('kind')}, "
                    f"{human_bytes(f.get('bytes'))})")
        if event == "step":
            book = f.get("leases")
            issued = book.get("leases_issued", "?") if isinstance(book, dict) else "?"
            return (f"step {f.get('step')} published: {human_bytes(f.get('bytes'))} delta "
                    f"({f.get('ratio')}x smaller), reward {f.get('reward')}, rollout "
                    f"{f.get('rollout_s')} s, {f.get('peers')} peer(s), leases issued "
                    f"{issued}, trainer egress so far {human_bytes(f.get('egress'))}")
        if event == "resumed":
            if "master" in f:
                return f"resumed at step {f.get('step')} from the data dir"
            return f"resumed at version {f.get('version')} from the data dir"
        if event == "reconnected":
            return f"trainer reachable again (holding version {f.get('version')})"
        if event == "banned":
            return f"banned peer {f.get('peer')}: {f.get('reason')}"
        if event == "rejected" and "peer" in f:
            return (f"rejected a result of {f.get('peer')} (version {f.get('version')}, "
                    f"{f.get('tasks')} task(s); re-issued): {f.get('reason')}")
        if event == "rejected":
            return (f"the trainer REJECTED our result (lease {f.get('lease')}): "
                    f"{f.get('reason')}")
        if event == "dropped":
            return f"dropped neighbour {f.get('peer')}: {f.get('reason')}"
        if event == "work_refused":
            return ("the trainer BANNED this peer and leases it no work (its log says which "
                    "results or messages it refused); versions are still followed")
        if event == "run_resumed":
            return "the trainer went on with the run: leasing work again"
        if event == "resume_refused":
            return f"saved state not used: {f.get('error')}"
        if event == "done":
            return f"done: {f.get('steps')} steps, trainer egress {human_bytes(f.get('egress'))}"
        return None


def _int(v: object) -> int:
    return int(v) if isinstance(v, int | float) else 0
