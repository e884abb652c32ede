"""What the person at the terminal sees: real `python -m swarm` processes on loopback.

Bad flags end in one ``swarm: error:`` line; trainer and peer print progress lines (no
JSON) by default; a wrong ``--trainer`` id and a trainer gone away are said on stderr;
libp2p's per-dial errors are summed up; ``swarm inspect`` reads what the nodes leave.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from swarmproc import cluster

from swarm.identity import Identity

pytestmark = pytest.mark.timeout(240)

OTHER_ID = Identity.from_seed(b"o" * 32).peer_id


def swarm(*argv: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm", *argv], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(out: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm: error: "), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("case", ["listen", "data-file", "bootstrap", "trainer",
                                  "bootstrap-no-id", "budget", "upload"])
def test_bad_input_is_one_error_line(tmp_path: Path, case: str) -> None:
    (tmp_path / "afile").write_text("x")
    good_boot = f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}"
    argv = {
        "listen": (["--listen", "0.0.0.0:4002"], "--listen '0.0.0.0:4002'"),
        "data-file": (["--data-dir", "afile"], "is not a directory"),
        "bootstrap": (["--bootstrap", "203.0.113.7:4001"], "--bootstrap"),
        "bootstrap-no-id": (["--bootstrap", "/ip4/127.0.0.1/tcp/4001"], "/p2p/PEER_ID"),
        "trainer": (["--trainer", "12D3KooWnotanid"], "--trainer '12D3KooWnotanid'"),
        "budget": (["--buffer-budget-mib", "4"], "--buffer-budget-mib 4"),
        "upload": (["--upload-mbps", "-5"], "--upload-mbps -5: must be 0 to"),
    }[case]
    base = {"--bootstrap": good_boot, "--trainer": OTHER_ID, "--data-dir": "p",
            "--listen": "/ip4/127.0.0.1/tcp/0"}
    flags, needle = argv
    base[flags[0]] = flags[1]
    out = swarm("peer", *[x for kv in base.items() for x in kv], cwd=tmp_path)
    one_error_line(out, needle)
    if case in ("listen", "data-file"):
        t = swarm("trainer", flags[0], flags[1], "--steps", "0", cwd=tmp_path)
        one_error_line(t, needle)


def test_an_unreachable_bootstrap_is_one_error_line(tmp_path: Path) -> None:
    """It printed two WARNING lines (a dial summary, the bootstrap's failure) saying what
    the error line says."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{OTHER_ID}"
    out = swarm("peer", "--bootstrap", boot, "--trainer", OTHER_ID, "--data-dir", "p",
                "--listen", "/ip4/127.0.0.1/tcp/0", cwd=tmp_path)
    one_error_line(out, f"no bootstrap node answered: libp2p dial of {boot} failed: nothing "
                   "answered (no node listening there")


@pytest.mark.parametrize("command", ["trainer", "demo"])
@pytest.mark.parametrize(("flags", "needle"), [
    (["--lr", "-1"], "--lr -1: must be a positive number"),  # was torch's traceback
    (["--lr", "nan"], "--lr nan"),
    (["--group", "1"], "--group 1: must be at least 2"),
    (["--prompts", "0"], "--prompts 0"),
    (["--wan-latency-ms", "-5"], "--wan-latency-ms -5: must be 0 to"),
], ids=["lr", "lr-nan", "group", "prompts", "latency"])
def test_bad_workload_flags_are_one_error_line_before_anything_starts(
        tmp_path: Path, command: str, flags: list[str], needle: str) -> None:
    out = swarm(command, *flags, cwd=tmp_path)
    one_error_line(out, needle)
    assert not (tmp_path / ".demo").exists() and not (tmp_path / ".swarm").exists()


def test_a_peer_started_in_the_trainers_directory_is_told_to_use_its_own(
        tmp_path: Path) -> None:
    trainer_id = Identity.load_or_create(tmp_path / ".swarm" / "node.key").peer_id
    out = swarm("peer", "--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{trainer_id}",
                "--trainer", trainer_id, cwd=tmp_path)
    one_error_line(out, "--trainer is this peer's own id: its key .swarm/node.key",
                   "give the peer a --data-dir of its own")


@pytest.mark.parametrize(("command", "other", "state"), [
    ("trainer", "peer", "peer.state"), ("bootstrap", "trainer", "leases.sqlite3"),
    ("peer", "trainer", "published.state")])
def test_a_node_refuses_the_data_directory_of_another_role(
        tmp_path: Path, command: str, other: str, state: str) -> None:
    """An adversarial trial: a trainer on a stopped peer's directory took the peer's key
    as its own identity and wrote its lease book beside the peer's state."""
    key = tmp_path / "d" / "node.key"
    other_id = Identity.load_or_create(key).peer_id
    (tmp_path / "d" / state).write_bytes(b"state")
    extra = {"trainer": ["--steps", "1"], "bootstrap": [],
             "peer": ["--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}",
                      "--trainer", OTHER_ID]}[command]
    out = swarm(command, "--data-dir", "d", *extra, cwd=tmp_path)
    one_error_line(out, f"--data-dir d holds a {other}'s state ({state})",
                   f"give the {command} a --data-dir of its own")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(["node.key", state])
    assert Identity.load_or_create(key).peer_id == other_id


@pytest.mark.parametrize(("flags", "needle"), [
    (["--peers", "-3"], "--peers -3: must be at least 1 and at most 4096"),
    (["--steps", "-2"], "--steps -2: must be at least 1 and at most 1000"),
    (["--malicious", "2"], "--malicious 2: must be at least 0"),
    (["--malicious", "nan"], "--malicious nan"),
    (["--rollout", "0"], "--rollout 0: must be more than 0"),
    (["--steps", "3", "--churn-per-min", "-1"], "--churn-per-min -1"),
], ids=["peers", "steps", "malicious", "malicious-nan", "rollout", "churn"])
def test_a_bad_simulate_flag_is_named_in_one_error_line(
        tmp_path: Path, flags: list[str], needle: str) -> None:
    # (before: "need at least one peer, one region, a trainer region" for --peers -3)
    one_error_line(swarm("simulate", *flags, "--no-plot", cwd=tmp_path), needle)
    assert not (tmp_path / "sim-out").exists()


def test_the_demo_says_why_its_trainer_stopped_at_once(tmp_path: Path) -> None:
    # the trainer cannot use its data dir: the demo used to wait out its --timeout
    # (900 s) in silence, then print a FAIL summary saying every peer verified everything
    (tmp_path / ".demo").mkdir()
    (tmp_path / ".demo" / "trainer").write_text("not a directory")
    t0 = time.monotonic()
    out = swarm("demo", "--steps", "2", "--timeout", "120", cwd=tmp_path)
    one_error_line(out, "the trainer exited with status 2: --data-dir",
                   "is not a directory", "(its log: .demo/trainer.log)")
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_swarm_folder_in_the_working_directory_does_not_shadow_the_demos_nodes(
        tmp_path: Path) -> None:
    # an installed `swarm` run inside a checkout: its nodes used to import the checkout
    (tmp_path / "swarm").mkdir()
    (tmp_path / "swarm" / "__init__.py").write_text('raise ImportError("the checkout")\n')
    out = subprocess.run(
        [sys.executable, "-P", "-m", "swarm", "demo", "--steps", "2", "--peers", "1",
         "--prompts", "8", "--quiet", "--timeout", "120"],
        cwd=tmp_path, text=True, capture_output=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "every live peer verified every version: True" in out.stdout, out.stderr
    assert "3 of 3" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_trainer_no_peer_joins_says_so_and_how_to_go_on(tmp_path: Path) -> None:
    out = swarm("trainer", "--steps", "2", "--step-timeout", "2", "--data-dir", "t",
                cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "peers join with:" in out.stdout and "swarm peer --bootstrap" in out.stdout
    last = out.stderr.splitlines()[-1]
    assert last.startswith("swarm: error: 0 of the 1 rollout peer(s) of --min-peers joined "
                           "within --step-timeout 2 s; run this again (it resumes from t)"), last
    assert "Traceback" not in out.stderr and "TimeoutError" not in out.stderr


class Lines:
    """A process whose stdout and stderr lines are read as they come."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "swarm", *argv], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out: list[str] = []
        self.err: list[str] = []
        self._q: queue.Queue[tuple[str, str]] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read, args=(name, stream, sink), daemon=True)
            for name, stream, sink in (("out", self.proc.stdout, self.out),
                                       ("err", self.proc.stderr, self.err))]
        for r in self._readers:
            r.start()

    def _read(self, name: str, stream: object, sink: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sink.append(line.rstrip("\n"))
            self._q.put((name, line))

    def wait_line(self, which: str, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in (self.out if which == "out" else self.err):
                if needle in line:
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {needle!r} on std{which} in {timeout} s; "
                                     f"out {self.out[-10:]}, err {self.err[-10:]}")
            with suppress(queue.Empty):
                self._q.get(timeout=min(left, 1.0))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for r in self._readers:
            r.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def started(*procs: Lines) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()


@pytest.mark.slow
def test_trainer_and_peer_print_progress_and_a_gone_trainer(tmp_path: Path) -> None:
    trainer = Lines(["trainer", "--data-dir", "t", "--steps", "2", "--prompts", "4",
                     "--group", "2", "--linger", "2"], tmp_path)
    with started(trainer):
        cmd = trainer.wait_line("out", "swarm peer --bootstrap", 90).split()
        tid = cmd[cmd.index("--trainer") + 1]
        assert trainer.out[0] == f"trainer {tid}"
        assert trainer.out[1].startswith("listening on /ip4/127.0.0.1/tcp/")
        peer = Lines(["peer", *cmd[cmd.index("--bootstrap"):], "--data-dir", "p",
                      "--warn-after", "2", "--trainer-timeout", "8", "--upload-mbps", "40"],
                     tmp_path)
        with started(peer):
            line = peer.wait_line("out", f"following trainer {tid}", 60)
            assert line.endswith("; advertising a 40 Mbit/s uplink")
            line = peer.wait_line("out", "version 2 verified", 120)
            assert "down" in line and "from the trainer" in line and "leases" in line
            trainer.wait_line("out", "step 2 published:", 10)
            trainer.wait_line("out", "last version 2 reached 1 of 1", 30)
            # While the trainer lingers, the peer is told the run is over.
            over = peer.wait_line("out", "the trainer finished the run at version 2, which "
                                  "this peer holds", 30)
            # said once the peer's own line says it verified that version
            verified = next(x for x in peer.out if "version 2 verified" in x)
            assert peer.out.index(verified) < peer.out.index(over)
            assert trainer.proc.wait(60) == 0
            assert not any(x.startswith("{") for x in trainer.out + peer.out)
            # A finished trainer leaving is said once, then the time-out ends the peer as
            # done (it exited 2 with "giving up", an error, before).
            peer.wait_line("out", "the trainer left after finishing the run at version 2; "
                           "waiting in case it goes on (for --trainer-timeout 8 s)", 30)
            assert peer.proc.wait(60) == 0
            peer.stop()
            assert peer.out[-1] == "done: holding version 2, the run's last"
            assert not any("unreachable" in x or "error" in x for x in peer.err), peer.err
    # swarm inspect reads what both left.
    out = swarm("inspect", "t", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"key           {tid}" in out.stdout and "step          2 (delta)" in out.stdout
    assert "lease book    run 'demo', latest step 2" in out.stdout
    assert "chunk store" in out.stdout and "signatures    valid" in out.stdout
    out = swarm("inspect", "p/peer.state", "--trainer", tid, cwd=tmp_path)
    assert out.returncode == 0 and "step          2" in out.stdout, out
    bad = swarm("inspect", "p/peer.state", "--trainer", OTHER_ID, cwd=tmp_path)
    assert bad.returncode == 2 and "signatures    INVALID" in bad.stdout
    assert bad.stderr.startswith("swarm: error:")


@pytest.mark.slow
def test_a_peer_whose_trainer_dies_mid_run_says_so_and_gives_up(tmp_path: Path) -> None:
    trainer = Lines(["trainer", "--data-dir", "t", "--steps", "50", "--prompts", "4",
                     "--group", "2"], tmp_path)
    with started(trainer):
        cmd = trainer.wait_line("out", "swarm peer --bootstrap", 90).split()
        tid = cmd[cmd.index("--trainer") + 1]
        peer = Lines(["peer", *cmd[cmd.index("--bootstrap"):], "--data-dir", "p",
                      "--warn-after", "2", "--trainer-timeout", "8"], tmp_path)
        with started(peer):
            peer.wait_line("out", "version 1 verified", 120)
            trainer.proc.send_signal(signal.SIGKILL)
            trainer.proc.wait(10)
            # The trainer is gone: said every 2 s, then the peer gives up.
            peer.wait_line("err", "unreachable for", 30)
            assert peer.proc.wait(60) == 2
            peer.stop()
            last = peer.err[-1]
            assert last.startswith(f"swarm: error: trainer {tid} unreachable for ")
            assert "giving up (--trainer-timeout 8)" in last
            assert not any("finished the run" in x for x in peer.out)
            errs = "\n".join(peer.err)
            assert "Traceback" not in errs
            assert not any(x.startswith("Failed to open TCP stream") for x in peer.err)
            assert sum("dial(s) failed" in x for x in peer.err) <= 2, errs


@pytest.mark.slow
def test_a_wrong_trainer_id_is_said_and_status_json_stays_json(tmp_path: Path) -> None:
    with cluster(tmp_path) as c:
        t = c.start("trainer", "trainer", "--data-dir", "t", "--steps", "1", "--linger", "60",
                    "--prompts", "4", "--group", "2")
        ready = t.wait_event("ready", 90)
        addr, trainer_id = str(ready["addr"]), str(ready["peer_id"])
        p = c.start("p", "peer", "--bootstrap", addr, "--trainer", OTHER_ID, "--data-dir", "p",
                    "--warn-after", "3")
        ev = p.wait_event("no_card", 60)
        # the trainer it reached is named: its card was served, signed by another key
        assert ev["trainer"] == OTHER_ID and ev["connected"] is False
        assert ev["signers"] == [trainer_id]
        deadline = time.monotonic() + 5  # stderr is a file the test reads back
        while "check that --trainer" not in p.stderr and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "no run card from trainer" in p.stderr and "check that --trainer" in p.stderr
        assert f"saw run cards signed by {trainer_id}" in p.stderr
        assert all(line.startswith("{") for line in p.stdout_lines + t.stdout_lines)


@pytest.mark.slow
def test_quiet_prints_nothing_on_stdout(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "swarm", "peer", "--quiet", "--data-dir", "p",
                          "--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{OTHER_ID}",
                          "--trainer", OTHER_ID], cwd=tmp_path, text=True,
                         capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.stdout == ""
    assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith("swarm: error: ")
    assert not any(x.startswith("Failed to open TCP stream") for x in out.stderr.splitlines())


def test_a_second_node_on_a_data_dir_in_use_is_refused(tmp_path: Path) -> None:
    """Two trainers on one data dir shared a signing key and a lease book, and two peers
    one journal (a newcomer's trial: the first peer then stalled); the second is refused
    at once, and a node killed outright leaves no lock behind."""
    with cluster(tmp_path) as c:
        c.bootstrap()
        t = c.trainer("--steps", "1000", "--min-peers", "1")
        p = c.peer("p0")
        p.wait_event("ready", 60)
        pids = {"trainer": t.proc.pid, "p0": p.proc.pid}
        for name, argv in (("trainer", ["trainer", "--bootstrap", c.bootstrap_addr]),
                           ("p0", ["peer", "--bootstrap", c.bootstrap_addr,
                                   "--trainer", c.trainer_id])):
            out = swarm(*argv, "--data-dir", name, "--listen", "/ip4/127.0.0.1/tcp/0",
                        cwd=tmp_path)
            one_error_line(out, f"--data-dir {name} is in use by another swarm node "
                           f"(process {pids[name]})", "a --data-dir of its own")
        p.signal(signal.SIGKILL)
        p.wait_exit(30)
        again = c.peer("p0")
        assert again.wait_event("ready", 60)["peer_id"] == p.of("ready")[0]["peer_id"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["peer", "--trainer", OTHER_ID, "--engine", "tensorrt"],
     "swarm peer: argument --engine: invalid choice: 'tensorrt'"),
    (["simulate", "--peers", "abc"], "swarm simulate: argument --peers: invalid int value"),
    (["lab", "bogus"], "swarm lab: argument WHAT: invalid choice: 'bogus'"),
])
def test_a_flag_argparse_refuses_is_one_error_line(tmp_path: Path, argv: list[str],
                                                   needle: str) -> None:
    """It printed argparse's usage block, 17 lines for ``swarm peer``."""
    out = swarm(*argv, cwd=tmp_path)
    one_error_line(out, needle, f"(see `swarm {argv[0]}")


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port some other program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", ["trainer", "bootstrap", "peer"])
def test_a_listen_port_in_use_is_one_error_line(tmp_path: Path, command: str) -> None:
    """A newcomer's trial: trainer and bootstrap ended in a traceback (IndexError), and a
    peer ran on, listening nowhere."""
    extra = {"trainer": ["--steps", "1"], "bootstrap": [],
             "peer": ["--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{OTHER_ID}",
                      "--trainer", OTHER_ID]}[command]
    with held_port() as port:
        listen = f"/ip4/127.0.0.1/tcp/{port}"
        out = swarm(command, "--listen", listen, "--data-dir", "n", *extra, cwd=tmp_path)
    one_error_line(out, f"cannot listen on {listen}: address already in use")


@pytest.mark.parametrize("command", ["trainer", "bootstrap"])
def test_a_port_another_swarm_node_listens_on_is_refused(tmp_path: Path,
                                                         command: str) -> None:
    """An adversarial trial: py-libp2p listens with SO_REUSEPORT, so a second node on the
    same port started and listened too, and the kernel would split dials between them."""
    with cluster(tmp_path) as c:
        first = c.bootstrap()
        listen = c.bootstrap_addr.split("/p2p/")[0]
        extra = ["--steps", "1"] if command == "trainer" else []
        out = swarm(command, "--listen", listen, "--data-dir", "second", *extra, cwd=tmp_path)
        one_error_line(out, f"cannot listen on {listen}: address already in use")
        assert first.proc.poll() is None  # the first node listens on, alone


def test_a_metrics_port_in_use_is_named_in_one_error_line(tmp_path: Path) -> None:
    with held_port() as port:
        out = swarm("bootstrap", "--metrics-port", str(port), "--data-dir", "b",
                    "--listen", "/ip4/127.0.0.1/tcp/0", cwd=tmp_path)
    one_error_line(out, f"--metrics-port {port}: address already in use")


@pytest.mark.parametrize(("argv", "needle"), [
    (["bench", "codec", "--old", "missing.safetensors", "--new", "bad.safetensors"],
     "--old missing.safetensors: no such file"),  # was a FileNotFoundError traceback
    (["bench", "codec", "--old", "bad.safetensors", "--new", "bad.safetensors"],
     "--old bad.safetensors: not a readable .safetensors file"),
    (["bench", "codec", "--old", "bad.safetensors"], "give both --old and --new"),
    (["bench", "transport", "--size", "0"], "--size 0: must be positive"),
    (["bootstrap", "--trainer", "foo", "--data-dir", "b"], "--trainer: peer id 'foo'"),
    (["inspect", "notes.txt"], "notes.txt: not a signed manifest, run card, saved state"),
    (["simulate", "--peer", "4"], "unrecognized arguments: --peer 4"),  # not --peers 4
], ids=["codec-missing", "codec-bad", "codec-one", "transport", "bootstrap-trainer",
        "inspect", "abbreviation"])
def test_more_bad_input_is_one_error_line(tmp_path: Path, argv: list[str],
                                          needle: str) -> None:
    (tmp_path / "bad.safetensors").write_text("not a checkpoint")
    (tmp_path / "notes.txt").write_text("some notes\n")
    one_error_line(swarm(*argv, cwd=tmp_path), needle)


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.add(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_sigterm_to_the_demo_stops_its_nodes_too(tmp_path: Path) -> None:
    """A newcomer's trial: ``kill <demo>`` left its nodes running (they run in sessions of
    their own, which the signal does not reach)."""
    demo = Lines(["demo", "--steps", "50", "--peers", "2", "--prompts", "8", "--dir", "d"],
                 tmp_path)
    with started(demo):
        demo.wait_line("out", "trainer ", 120)
        deadline = time.monotonic() + 60
        nodes = _children(demo.proc.pid)
        while len(nodes) < 3 and time.monotonic() < deadline:  # the trainer and 2 peers
            time.sleep(0.2)
            nodes = _children(demo.proc.pid)
        assert len(nodes) == 3, nodes
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.proc.wait(60) == 130
        demo.stop()
        assert demo.err[-1] == "swarm: demo stopped, and its nodes with it", demo.err
        assert not any(Path(f"/proc/{pid}").exists() for pid in nodes)
