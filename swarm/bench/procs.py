"""What the benches that run real ``swarm`` processes share: a child process whose JSON
status lines are read as they come, stopping children, a work dir, progress lines.

Used by ``swarm bench e2e`` (:mod:`swarm.bench.e2e`) and ``swarm bench attacks``
(:mod:`swarm.bench.attacks`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from swarm.errors import SwarmError
from swarm.selfcmd import swarm_argv

Event = dict[str, Any]
MB = 1e6


class BenchError(SwarmError):
    """The benchmark could not finish (a process died, a version was not verified in
    time)."""


def say(line: str) -> None:
    """A progress line on stdout, flushed."""
    print(line, flush=True)


class SwarmChild:
    """One ``python -m swarm ARGV`` child (ARGV ends with ``--status-json``): its JSON
    events, read by a thread; its stderr goes to ``WORKDIR/NAME.stderr`` (``verbose``:
    that many ``-v``, more logging there; ``launcher``: a command prefix it runs under,
    such as ``ip netns exec NS``)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, verbose: int = 0,
                 launcher: Sequence[str] = ()) -> None:
        self.name = name
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self.stderr_path = workdir / f"{name}.stderr"
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [*launcher, *swarm_argv(*["-v"] * verbose, *argv)],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("{"):
                continue
            with contextlib.suppress(json.JSONDecodeError), self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def of(self, event: str, **fields: object) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.get("event") == event
                    and all(e.get(k) == v for k, v in fields.items())]

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str) -> Event:
        """The first event (seen or to come) for which ``pred`` holds.

        :raises BenchError: none within ``timeout`` seconds, or the process ended first.
        """
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for ev in self.events[seen:]:
                    if pred(ev):
                        return ev
                seen = len(self.events)
                left = deadline - time.monotonic()
                ended = self.proc.poll() is not None and not self._reader.is_alive()
                if left <= 0 or ended:
                    how = f"it exited with status {self.proc.poll()}" if ended else \
                        f"not within {timeout:g} s"
                    raise BenchError(f"{self.name}: no {what} ({how}); its stderr ends:\n"
                                     f"{self.stderr_tail()}")
                self._cond.wait(min(left, 1.0))

    def wait_event(self, event: str, timeout: float, **fields: object) -> Event:
        return self.wait_for(lambda e: e.get("event") == event and all(
            e.get(k) == v for k, v in fields.items()), timeout, f"{event} event {fields}")

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def peak_rss(self) -> int:
        """VmHWM of the process in bytes (0 once it is gone)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0


def stop_children(children: Sequence[SwarmChild], grace: float = 10.0) -> None:
    """SIGTERM every child started here, then SIGKILL those still running after
    ``grace`` seconds."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait(10)
        if c.proc.stdout is not None:
            c.proc.stdout.close()


@contextlib.contextmanager
def workdir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """``keep`` (made, and kept), else a temporary dir deleted at the end."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
