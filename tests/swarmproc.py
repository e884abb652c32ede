"""Real ``swarm`` processes for tests: start them as a user would, read their JSON status
lines as they come, stop them by PID.

Each process runs ``python -m swarm ... --status-json``; a reader thread parses stdout
line by line into events, and :meth:`SwarmProc.wait_for` waits on them (no polling).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

Event = dict[str, Any]
T = TypeVar("T")


class SwarmProc:
    """One ``swarm`` command running in the background."""

    def __init__(self, name: str, argv: Sequence[str], cwd: Path,
                 command: Sequence[str] | None = None) -> None:
        """``command``: run this instead of ``swarm ARGV --status-json`` (a script)."""
        self.name = name
        self.argv = list(argv)
        self.events: list[Event] = []
        self.stdout_lines: list[str] = []
        self._cond = threading.Condition()
        stem = f"{name}.{time.monotonic_ns()}"
        self._stderr_path = cwd / f"{stem}.stderr"
        self._stderr = self._stderr_path.open("wb")
        # what it printed stays in the test's directory too, for a failure's post-mortem
        self._stdout_copy = (cwd / f"{stem}.stdout").open("wb", buffering=0)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if command is None:
            command = [sys.executable, "-m", "swarm",
                       *(["-v"] * int(os.environ.get("SWARM_TEST_V", "0"))), *self.argv,
                       "--status-json"]
        self.proc = subprocess.Popen(
            list(command), cwd=cwd,
            stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._stdout_copy.write(raw)
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self.stdout_lines.append(line)
                if line.startswith("{"):
                    with suppress(json.JSONDecodeError):
                        self.events.append(json.loads(line))
                self._cond.notify_all()
        self._stdout_copy.close()
        with self._cond:
            self._cond.notify_all()

    @property
    def stderr(self) -> str:
        self._stderr.flush()
        return self._stderr_path.read_text(errors="replace")

    def of(self, event: str) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.get("event") == event]

    @classmethod
    def script(cls, script: Path, argv: Sequence[str], cwd: Path) -> SwarmProc:
        """A Python script run as a user runs it (``python SCRIPT ARGV``)."""
        return cls(script.stem, argv, cwd, [sys.executable, str(script), *argv])

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str = "") -> Event:
        """The first event (already seen or to come) for which ``pred`` holds."""
        return self._wait(self.events, pred, timeout, f"event {what or pred}")

    def wait_line(self, prefix: str, timeout: float) -> str:
        """The first stdout line (already printed or to come) that starts with ``prefix``."""
        return self._wait(self.stdout_lines, lambda x: x.startswith(prefix), timeout,
                          f"line {prefix!r}")

    def _wait(self, items: list[T], pred: Callable[[T], bool], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for item in items[seen:]:
                    if pred(item):
                        return item
                seen = len(items)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.name}: no {what} within {timeout} s "
                        f"(exit {self.proc.poll()}); last events: {self.events[-5:]}; "
                        f"stderr tail: {self.stderr[-2000:]}")
                self._cond.wait(min(left, 1.0))

    def wait_event(self, event: str, timeout: float, **fields: Any) -> Event:
        return self.wait_for(
            lambda e: e.get("event") == event and all(e.get(k) == v for k, v in fields.items()),
            timeout, f"{event} {fields}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 10 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


class Cluster:
    """A bootstrap node, a trainer and peers started through the ``swarm`` command."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[SwarmProc] = []
        self.bootstrap_addr = ""
        self.trainer_id = ""

    def start(self, name: str, *argv: str) -> SwarmProc:
        p = SwarmProc(name, argv, self.root)
        self.procs.append(p)
        return p

    def bootstrap(self) -> SwarmProc:
        """A bootstrap node that relays the trainer's manifests (the trainer's key is
        made first, in its data dir, as an operator would with ``swarm keygen``)."""
        from swarm.identity import Identity

        trainer_id = Identity.load_or_create(self.root / "trainer" / "node.key").peer_id
        b = self.start("bootstrap", "bootstrap", "--data-dir", "boot",
                       "--listen", "/ip4/127.0.0.1/tcp/0", "--trainer", trainer_id)
        self.bootstrap_addr = str(b.wait_event("ready", 60)["addr"])
        return b

    def trainer(self, *extra: str, data_dir: str = "trainer") -> SwarmProc:
        t = self.start("trainer", "trainer", "--bootstrap", self.bootstrap_addr,
                       "--data-dir", data_dir, "--linger", "600", *extra)
        self.trainer_id = str(t.wait_event("ready", 60)["peer_id"])
        return t

    def peer(self, name: str, *extra: str, region: str = "r1") -> SwarmProc:
        return self.start(name, "peer", "--bootstrap", self.bootstrap_addr,
                          "--trainer", self.trainer_id, "--region", region,
                          "--data-dir", name, "--name", name, *extra)

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    c = Cluster(root)
    try:
        yield c
    finally:
        c.stop_all()


def verified(p: SwarmProc) -> list[int]:
    return [int(e["version"]) for e in p.of("verified")]


def step_of(ev: Event) -> int:
    return int(ev["step"])

