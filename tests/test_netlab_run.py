"""``swarm lab run`` in the kernel network lab (root): every peer, NATed or not, verifies
every version; a lab killed mid-way (SIGKILL, then ``swarm lab cleanup``) or stopped with
Ctrl-C or SIGTERM leaves no namespace, veth, iptables rule or process behind."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swarm.lab import kernel

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("needs_lab")]


def _swarm(*argv: str) -> list[str]:
    return [sys.executable, "-m", "swarm", *argv]


class Lines:
    """A process's stdout lines, read by a thread, waited for by pattern."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Once the process has ended: the reader sees EOF; the pipe is closed."""
        self.proc.wait(30)
        self._reader.join(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line matching {pattern!r}; got:\n" + "\n".join(self.seen)
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, (f"exited ({self.proc.wait()}) before {pattern!r}:\n"
                                      + "\n".join(self.seen))
            self.seen.append(line)
            if (m := re.search(pattern, line)) is not None:
                return m


def _nothing_left(prefix: str) -> None:
    left = kernel.leftovers(prefix)
    assert left == {"namespaces": [], "links": [], "rules": [], "owners": []}, left
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert prefix not in links


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(200)
@pytest.mark.parametrize("listen", [[], ["--listen-any"]], ids=["lab-address", "0.0.0.0"])
def test_netlab_natted_peers_verify_every_version(tmp_path: Path, listen: list[str]) -> None:
    out = tmp_path / "lab.json"
    done = subprocess.run(_swarm("lab", "run", "--peers", "4", "--nat-fraction", "0.5",
                                 "--steps", "3", "--json", str(out), "--timeout", "90",
                                 *listen),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "summary (" in done.stdout and "trainer egress" in done.stdout
    assert "result: PASS" in done.stdout
    assert "Traceback" not in done.stderr
    figures = json.loads(out.read_text())
    assert figures["all_verified"]
    peers = figures["peers"]
    assert [p["natted"] for p in peers] == [False, False, True, True]
    for p in peers:
        assert p["verified"] == [0, 1, 2, 3], p
        assert p["failed"] == 0
        # The dial-back check: NATed peers find out, and advertise no address.
        assert p["reachability"] == ("private" if p["natted"] else "public"), p
        assert p["bytes_down"] > 0
    assert figures["trainer_egress"] > 0
    # Connection reversal: the NATed peers upload over the connections they dialled.
    assert sum(p["bytes_up"] for p in peers if p["natted"]) > 0
    prefix = re.search(r"lab (swl[0-9a-f]{5}):", done.stdout)
    assert prefix is not None
    _nothing_left(prefix.group(1))


def _start_lab(tmp_path: Path) -> tuple[subprocess.Popen[str], Lines, str, list[int]]:
    with (tmp_path / "lab.stderr").open("w") as err:
        # far more versions than the test lets it reach: the signal must find it mid-run,
        # not already tearing down (with signals held) on a fast machine
        proc = subprocess.Popen(_swarm("lab", "run", "--peers", "2", "--steps", "500",
                                       "--keep", str(tmp_path / "work"), "--timeout", "90"),
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = Lines(proc)
    prefix = lines.wait(r"lab (swl[0-9a-f]{5}): \d+ namespaces", 60).group(1)
    lines.wait(r"p1 \(NAT\): version 1 verified", 120)  # mid-way: the swarm is running
    spaces = [n for n in kernel.namespaces() if n.startswith(prefix + "-")]
    pids = kernel._pids_in(spaces)
    assert spaces and len(pids) >= 4  # bootstrap, trainer, 2 peers
    return proc, lines, prefix, pids


@pytest.mark.timeout(200)
def test_netlab_sigkill_then_cleanup_leaves_nothing(tmp_path: Path) -> None:
    proc, lines, prefix, pids = _start_lab(tmp_path)
    proc.send_signal(signal.SIGKILL)
    lines.close()
    # Its children die with it; the namespaces stay until cleanup.
    assert _gone(pids), "processes of the killed lab still run"
    assert kernel.leftovers(prefix)["namespaces"]
    done = subprocess.run(_swarm("lab", "cleanup"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"lab {prefix}: removed" in done.stdout
    _nothing_left(prefix)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_netlab_signal_tears_down(tmp_path: Path, sig: signal.Signals) -> None:
    proc, lines, prefix, pids = _start_lab(tmp_path)
    try:
        proc.send_signal(sig)
        lines.wait(rf"lab {prefix}: removed \d+ namespace", 60)
        assert proc.wait(30) == 130
    finally:
        lines.close()
    err = (tmp_path / "lab.stderr").read_text()
    assert "Traceback" not in err and "swarm: interrupted" in err
    assert _gone(pids)
    _nothing_left(prefix)
