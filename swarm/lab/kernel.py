"""Building a :class:`~swarm.lab.plan.Plan` in the kernel, and tearing it down.

:class:`Lab` (a context manager) adds the plan's namespaces (``ip netns``), veth links
with their addresses and tbf qdiscs (``tc``), routes, and home NATs (``iptables``
MASQUERADE, forwarding on); :meth:`Lab.command` prefixes a command so it runs inside a
host's namespace as a real process (``ip netns exec``), one that the kernel kills when
the lab process dies (``setpriv --pdeathsig KILL``). Leaving the block, by an exception,
Ctrl-C or SIGTERM included, kills what still runs in the lab's namespaces and deletes
them (their veths and iptables rules go with them).

A lab killed with SIGKILL leaves its namespaces behind: :func:`cleanup` finds every
lab's by the common prefix and deletes those whose owner process (kept in
``/run/swarm-lab/PREFIX.owner``) is gone; :class:`Lab` runs it at start too. Two labs
never collide: each has its own prefix, and nothing of a lab lives in the root
namespace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from swarm.errors import SwarmError
from swarm.lab.plan import PREFIX_LEN, ROOT, Host, Plan, is_prefix

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/swarm-lab")
TOOLS = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables", "setpriv": "util-linux"}


class LabUnavailable(SwarmError):
    """This machine cannot run the lab (not root, a tool missing); the message is the
    one-line reason."""


class LabError(SwarmError):
    """A command building or running the lab failed."""


def check_available() -> None:
    """:raises LabUnavailable: not Linux, not root, or ``ip``/``tc``/``iptables`` missing."""
    if not sys.platform.startswith("linux"):
        raise LabUnavailable("the network lab needs Linux network namespaces")
    if os.geteuid() != 0:
        raise LabUnavailable("the network lab needs root (it makes network namespaces, "
                             "veth links, tc qdiscs and iptables NAT rules)")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pkgs = " ".join(sorted({TOOLS[t] for t in missing}))
        raise LabUnavailable(f"the network lab needs {', '.join(missing)} (apt-get install "
                             f"{pkgs})")


def sh(*argv: str, ns: str | None = None, check: bool = True, timeout: float = 30.0) -> str:
    """Run a command (inside namespace ``ns``); its stdout.

    :raises LabError: it failed (with ``check``) or did not finish within ``timeout``.
    """
    cmd = [*(("ip", "netns", "exec", ns) if ns else ()), *argv]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(cmd)}: {exc}") from None
    if check and done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise LabError(f"{' '.join(cmd)} failed: {why[-1] if why else done.returncode}")
    return done.stdout


# -- what exists ---------------------------------------------------------------------
def namespaces() -> list[str]:
    """Every lab namespace on this machine (names under the common prefix)."""
    out = sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if is_prefix(n[:PREFIX_LEN]) and n[PREFIX_LEN:PREFIX_LEN + 1] == "-"]


def root_links() -> list[str]:
    """Interfaces of any lab left in the root namespace (none, unless a build was killed
    between making a veth and moving it)."""
    out = sh("ip", "-o", "link", "show", check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if is_prefix(name[:PREFIX_LEN]):
                names.append(name)
    return names


def root_rules(prefix: str = ROOT) -> list[str]:
    """Root-namespace iptables rules naming a lab (there should be none)."""
    if shutil.which("iptables-save") is None:
        return []
    out = sh("iptables-save", check=False)
    return [line for line in out.splitlines() if prefix in line]


def leftovers(prefix: str = ROOT) -> dict[str, list[str]]:
    """What exists of the lab ``prefix`` (or of any lab): namespaces, root links, root
    iptables rules, owner files."""
    owners = sorted(p.name for p in STATE_DIR.glob(f"{prefix}*.owner")) \
        if STATE_DIR.is_dir() else []
    return {"namespaces": [n for n in namespaces() if n.startswith(prefix)],
            "links": [n for n in root_links() if n.startswith(prefix)],
            "rules": root_rules(prefix), "owners": owners}


# -- owners --------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _owner_alive(prefix: str) -> bool:
    try:
        pid_text, start = (STATE_DIR / f"{prefix}.owner").read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False
    return _start_time(pid) == start


def _claim(prefix: str) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{prefix}.owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _pids_in(spaces: list[str]) -> list[int]:
    return [int(p) for ns in spaces for p in sh("ip", "netns", "pids", ns, check=False).split()
            if p.isdigit() and int(p) != os.getpid()]


def _kill_inside(spaces: list[str], grace: float) -> None:
    """End what runs in namespaces ``spaces``: SIGTERM, then SIGKILL after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        running = _pids_in(spaces)
        if not running:
            return
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while _pids_in(spaces) and time.monotonic() < deadline:
            time.sleep(0.1)


def remove(prefix: str, grace: float = 0.0) -> list[str]:
    """Delete everything of lab ``prefix`` (what still runs inside is ended first, with
    ``grace`` seconds after SIGTERM); what was removed."""
    spaces = [n for n in namespaces() if n.startswith(prefix + "-")]
    _kill_inside(spaces, grace)
    gone = []
    for ns in spaces:
        sh("ip", "netns", "del", ns, check=False)
        gone.append(ns)
    for link in root_links():
        if link.startswith(prefix):
            sh("ip", "link", "del", link, check=False)
            gone.append(link)
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{prefix}.owner").unlink()
    return gone


def cleanup(*, every: bool = False) -> dict[str, list[str]]:
    """Delete the leftovers of lab runs whose process is gone (``every``: of running
    labs too); prefix -> what was removed."""
    check_available()
    prefixes = {n[:PREFIX_LEN] for n in (*namespaces(), *root_links())}
    if STATE_DIR.is_dir():
        prefixes |= {p.name[:PREFIX_LEN] for p in STATE_DIR.glob(f"{ROOT}*.owner")}
    removed = {}
    for prefix in sorted(p for p in prefixes if is_prefix(p)):
        if every or not _owner_alive(prefix):
            removed[prefix] = remove(prefix)
    return removed


# -- the lab -------------------------------------------------------------------------
class _Stop(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same clean-up runs."""


@dataclass
class Lab:
    """The plan, built. Use as ``with Lab(plan) as lab``."""

    plan: Plan
    say: Callable[[str], None] = field(default=lambda line: None)
    grace: float = 10.0
    _built: bool = False
    _old_term: object = None
    _old_int: object = None

    def __enter__(self) -> Self:
        check_available()
        stale = cleanup()
        if stale:
            self.say(f"removed leftovers of {len(stale)} earlier lab run(s): "
                     f"{', '.join(stale)}")
        self._old_term = signal.signal(signal.SIGTERM, _raise_stop) \
            if _main_thread() else None
        # Ctrl-C as well, even where it came in ignored (a job a script started in the
        # background): Python then installs no handler, and the lab ran on to its end
        self._old_int = signal.signal(signal.SIGINT, signal.default_int_handler) \
            if _main_thread() else None
        try:
            _claim(self.plan.prefix)
            self._built = True
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()

    def build(self) -> None:
        p = self.plan
        t0 = time.monotonic()
        for ns in p.namespaces:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        for ln in p.links:
            sh("ip", "link", "add", ln.a_if, "netns", ln.a_ns, "type", "veth",
               "peer", "name", ln.b_if, "netns", ln.b_ns)
            for ns, name, addr, mbps in ((ln.a_ns, ln.a_if, ln.a_addr, ln.a_mbps),
                                         (ln.b_ns, ln.b_if, ln.b_addr, ln.b_mbps)):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/{ln.prefixlen}", "dev", name)
                sh("ip", "-n", ns, "link", "set", name, "up")
                if mbps:
                    sh("tc", "qdisc", "add", "dev", name, "root", "tbf", "rate",
                       f"{mbps:g}mbit", "burst", _burst(mbps), "latency", "400ms", ns=ns)
        for ns in p.forwarders:
            sh("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", ns=ns)
        for r in p.routes:
            if r.kind == "blackhole":
                sh("ip", "-n", r.ns, "route", "add", "blackhole", r.dest)
            else:
                sh("ip", "-n", r.ns, "route", "add", r.dest, "via", r.via)
        tag = ("-m", "comment", "--comment", p.prefix)
        for nat in p.nats:
            sh("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", nat.wan_if, *tag,
               "-j", "MASQUERADE", *(["--random-fully"] if nat.symmetric else []), ns=nat.ns)
            sh("iptables", "-A", "FORWARD", "-i", nat.wan_if, "-m", "conntrack",
               "--ctstate", "NEW", *tag, "-j", "DROP", ns=nat.ns)
            # As most home routers: an unsolicited SYN to the router itself is dropped,
            # not reset (a reset also ends the conntrack entry a hole punch relies on).
            sh("iptables", "-A", "INPUT", "-i", nat.wan_if, "-p", "tcp", "-m", "conntrack",
               "--ctstate", "NEW", *tag, "-j", "DROP", ns=nat.ns)
        self.say(f"lab {p.prefix}: {len(p.namespaces)} namespaces, {len(p.links)} links, "
                 f"{len(p.nats)} NAT(s), up in {time.monotonic() - t0:.1f} s")

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace, killed if this process dies."""
        return ["ip", "netns", "exec", host.ns, "setpriv", "--pdeathsig", "KILL", *argv]

    def exec(self, host: Host, *argv: str, check: bool = True, timeout: float = 30.0) -> str:
        """Run a short command in ``host``'s namespace; its stdout."""
        return sh(*argv, ns=host.ns, check=check, timeout=timeout)

    def teardown(self) -> None:
        """Kill what runs in the lab and delete it; signals wait until it is done."""
        if not self._built:
            self._restore()
            return
        with _signals_held():
            t0 = time.monotonic()
            gone = remove(self.plan.prefix, grace=self.grace)
            self._built = False
            self.say(f"lab {self.plan.prefix}: removed {len(gone)} namespace(s) in "
                     f"{time.monotonic() - t0:.1f} s")
        self._restore()

    def _restore(self) -> None:
        if self._old_term is not None and _main_thread():
            signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]
            self._old_term = None
        if self._old_int is not None and _main_thread():
            signal.signal(signal.SIGINT, self._old_int)  # type: ignore[arg-type]
            self._old_int = None


def _burst(mbps: float) -> str:
    """tbf's bucket: at least 32 kbit, and about 1 ms of the rate (a bucket far below
    the rate times the timer tick caps the rate itself)."""
    return f"{max(32, int(mbps * 1000 / 8 / 1024) * 8 + 8)}kbit"


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM are ignored meanwhile (teardown runs to its end)."""
    if not _main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
