"""``swarm demo``: a trainer and N rollout peers doing GRPO on this machine.

Every node is its own process with a real libp2p host and encrypted data plane on
loopback; links are shaped into WAN regions (uplink rate, cross-region latency). The
trainer teaches a tiny Qwen3 policy to sort digits; each step's bf16 delta spreads
through the swarm, every peer verifies every version against the signed manifest, and
rollouts are done under signed leases. A live table shows progress; at the end a summary
table and a PNG plot of reward and sync time per step are written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.cli._node import check_link_flags, stop_on_signals
from swarm.engines import CHEAT_STRATEGIES
from swarm.errors import SwarmError
from swarm.selfcmd import swarm_argv

#: Seconds the demo may take to stop its nodes after Ctrl-C or SIGTERM before it exits
#: anyway (each node gets 15 s to close, then is killed).
DEMO_GRACE = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=Path(".demo"), help="working directory")
    p.add_argument("--peers", type=int, default=4, help="rollout peers")
    p.add_argument("--regions", type=int, default=2, help="WAN regions the peers are spread over")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--lr", type=float, default=3e-2, help="learning rate (AdamW, eps 0.1)")
    p.add_argument("--uplink-mbps", type=float, default=20.0,
                   help="each peer's emulated uplink (Mbit/s)")
    p.add_argument("--trainer-uplink-mbps", type=float, default=40.0,
                   help="the trainer's emulated uplink (Mbit/s)")
    p.add_argument("--wan-latency-ms", type=float, default=40.0,
                   help="one-way latency between regions")
    p.add_argument("--kill-peer-at", type=int, default=None, metavar="STEP",
                   help="chaos: SIGKILL one peer when the trainer reaches STEP")
    p.add_argument("--late-joiner", type=int, default=None, metavar="STEP",
                   help="chaos: start one more peer when the trainer reaches STEP")
    p.add_argument("--corrupt-peer", action="store_true",
                   help="chaos: add a peer that serves corrupt chunks")
    p.add_argument("--cheater", choices=CHEAT_STRATEGIES, default=None, metavar="STRATEGY",
                   help="chaos: add a peer returning bad completions the trainer's checks "
                        f"must refuse ({', '.join(CHEAT_STRATEGIES)})")
    p.add_argument("--bootstrap-node", action="store_true",
                   help="start a `swarm bootstrap` node that the trainer and peers join "
                        "through (default: peers dial the trainer directly)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after SECONDS")
    p.add_argument("--quiet", action="store_true",
                   help="no live table; one line per step (as when stdout is not a terminal)")


@dataclass
class PeerView:
    name: str
    region: str
    proc: asyncio.subprocess.Process
    corrupt: bool = False
    cheater: bool = False
    peer_id: str = ""
    version: int = -1
    verified: int = 0
    failures: int = 0
    leases: int = 0
    results: int = 0
    bans: int = 0
    killed: bool = False
    sync_s: dict[int, float] = field(default_factory=dict)
    """Per version: seconds from its manifest to a verified canonical state."""
    installed_s: dict[int, float] = field(default_factory=dict)
    """Per version: seconds until the engine ran it (waits for a rollout boundary)."""

    @property
    def honest(self) -> bool:
        return not (self.corrupt or self.cheater)


@dataclass
class DemoState:
    peers: dict[str, PeerView] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    trainer_id: str = ""
    addr: str = ""
    final_step: int = -1
    done: bool = False
    keyframe_bytes: int = 0
    banned: set[str] = field(default_factory=set)
    lease_stats: dict[str, Any] = field(default_factory=dict)
    egress: int = 0
    checks: dict[str, Any] = field(default_factory=dict)
    """The trainer's checks of results: per peer accepted and rejected, banned peers."""
    rejections: list[dict[str, Any]] = field(default_factory=list)
    cheat_strategy: str = ""


def run(args: argparse.Namespace) -> int:
    from swarm.cli.trainer import check_workload

    if args.peers < 1 or args.regions < 1 or args.steps < 1:
        raise SwarmError("--peers, --regions and --steps must be at least 1")
    check_workload(args)
    check_link_flags(args, "uplink_mbps", "trainer_uplink_mbps")
    if not args.timeout > 0:
        raise SwarmError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    try:
        return asyncio.run(_stoppable(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("swarm: demo stopped, and its nodes with it", file=sys.stderr)
        return 130


async def _stoppable(args: argparse.Namespace) -> int:
    """Ctrl-C and SIGTERM stop the demo as they stop a node; its nodes (in sessions of
    their own, which neither signal reaches) are stopped first (each within 15 s, else
    killed), within ``DEMO_GRACE``."""
    async with stop_on_signals(grace=DEMO_GRACE):
        return await _main(args)


async def _spawn(cmd: list[str], log_path: Path) -> asyncio.subprocess.Process:
    """Start a node; its stderr (warnings, errors) goes to ``log_path``, opened for
    appending so the demo can add the node's status events there too (see ``read``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_path.write_bytes(b"")
    with open(log_path, "ab") as err:
        return await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=err, env=env,
            start_new_session=True)


async def _main(args: argparse.Namespace) -> int:
    base: Path = args.dir
    base.mkdir(parents=True, exist_ok=True)
    # Nodes resume from their data directories; a demo always starts from scratch.
    for old in ("trainer", "corrupt", "cheater", "bootstrap",
                *(p.name for p in base.glob("peer-*"))):
        shutil.rmtree(base / old, ignore_errors=True)
    st = DemoState(cheat_strategy=args.cheater or "")
    events = asyncio.Queue[dict[str, Any]]()
    procs: list[asyncio.subprocess.Process] = []
    readers: list[asyncio.Task[None]] = []

    async def read(proc: asyncio.subprocess.Process, log_path: Path) -> None:
        assert proc.stdout is not None
        with open(log_path, "ab", buffering=0) as log_file:  # the node's events, as they come
            async for line in proc.stdout:
                log_file.write(line)
                with contextlib.suppress(ValueError):
                    await events.put(json.loads(line))

    async def start(cmd: list[str], name: str) -> asyncio.subprocess.Process:
        proc = await _spawn(cmd, base / f"{name}.log")
        procs.append(proc)
        readers.append(asyncio.create_task(read(proc, base / f"{name}.log")))
        return proc

    async def ready(proc: asyncio.subprocess.Process, name: str) -> dict[str, Any]:
        """The node's ready event (other events until then are dropped); a node that
        exits before it is ready ends the demo with the reason from its log."""
        while True:
            try:
                async with asyncio.timeout(0.5):
                    ev = await events.get()
            except TimeoutError:
                if proc.returncode is not None:
                    raise SwarmError(_exited(name, proc.returncode, base)) from None
                continue
            if ev.get("event") == "ready" and ev.get("node") == name:
                return ev

    t_start = time.perf_counter()
    join: list[str] = []

    async def start_trainer() -> asyncio.subprocess.Process:
        if args.bootstrap_node:
            boot = await start(swarm_argv(
                "bootstrap", "--data-dir", str(base / "bootstrap"), "--status-json",
                "--listen", "/ip4/127.0.0.1/tcp/0", "--run", "demo"), "bootstrap")
            try:
                async with asyncio.timeout(120):
                    join.extend(["--bootstrap", str((await ready(boot, "bootstrap"))["addr"])])
            except TimeoutError:
                raise SwarmError("the bootstrap node was not ready within 120 s; see "
                                 f"{base / 'bootstrap.log'}") from None
            print(f"bootstrap node at {join[1]}", flush=True)
        return await start(swarm_argv(
            "trainer", "--data-dir", str(base / "trainer"), "--status-json",
            "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
            "--lr", str(args.lr),
            "--min-peers", str(args.peers + args.corrupt_peer + (args.cheater is not None)),
            "--linger", "600",
            "--region", "r0", "--uplink-mbps", str(args.trainer_uplink_mbps),
            "--wan-latency-ms", str(args.wan_latency_ms), "--run", "demo", *join), "trainer")
    n_peers = 0

    async def add_peer(corrupt: bool = False, cheat: str | None = None) -> None:
        nonlocal n_peers
        name = "corrupt" if corrupt else "cheater" if cheat else f"peer-{n_peers}"
        region = f"r{n_peers % args.regions}"
        n_peers += 1
        cmd = swarm_argv("peer", "--data-dir", str(base / name), "--status-json", "--name", name,
                   *(join or ["--bootstrap", st.addr]), "--trainer", st.trainer_id,
                   "--region", region,
                   "--uplink-mbps", str(args.uplink_mbps),
                   "--wan-latency-ms", str(args.wan_latency_ms), "--run", "demo")
        if corrupt:
            cmd.append("--corrupt")
        if cheat:
            cmd += ["--chaos-cheat", cheat]
        st.peers[name] = PeerView(name, region, await start(cmd, name), corrupt=corrupt,
                                  cheater=cheat is not None)

    display = _Display(args.quiet)
    ok = False
    try:
        trainer = await start_trainer()
        async with asyncio.timeout(args.timeout):
            ev = await ready(trainer, "trainer")
            st.addr, st.trainer_id = str(ev["addr"]), str(ev["peer_id"])
            display.line(f"trainer {st.trainer_id} at {st.addr}")
            for _ in range(args.peers):
                await add_peer()
            if args.corrupt_peer:
                await add_peer(corrupt=True)
            if args.cheater:
                await add_peer(cheat=args.cheater)
            while True:
                try:
                    async with asyncio.timeout(1.0):
                        ev = await events.get()
                except TimeoutError:
                    display.render(st, time.perf_counter() - t_start)
                    if trainer.returncode is not None:
                        raise SwarmError(_exited("trainer", trainer.returncode, base)) from None
                    continue
                step_reached = _apply(st, ev)
                if step_reached is not None:
                    if args.kill_peer_at == step_reached:
                        victim = next((p for p in st.peers.values()
                                       if not p.killed and p.honest), None)
                        if victim is not None:
                            victim.proc.send_signal(signal.SIGKILL)
                            victim.killed = True
                            display.line(f"chaos: killed {victim.name} at step {step_reached}")
                    if args.late_joiner == step_reached:
                        await add_peer()
                        display.line(f"chaos: late joiner started at step {step_reached}")
                    if not display.live:  # --quiet, or stdout is not a terminal
                        display.step_line(st.steps[-1])
                display.render(st, time.perf_counter() - t_start)
                live = [p for p in st.peers.values() if not p.killed and p.honest]
                if st.done and all(p.version >= st.final_step for p in live):
                    ok = True
                    break
    except TimeoutError:
        display.line(f"demo timed out after {args.timeout:.0f} s")
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                async with asyncio.timeout(15):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for r in readers:
            r.cancel()
        display.close()
    elapsed = time.perf_counter() - t_start
    verdict = _summary(st, elapsed)
    _plot(st, base / "demo.png")
    (base / "summary.json").write_text(json.dumps(_summary_json(st, elapsed), indent=2))
    print(f"\nplot: {base / 'demo.png'}   summary: {base / 'summary.json'}   logs: {base}/")
    print("next: `swarm trainer` runs a trainer of your own; it prints the `swarm peer ...` "
          "command that joins a peer to it")
    return 0 if ok and verdict else 1


def _exited(name: str, status: int, base: Path) -> str:
    """Why the demo's ``name`` node stopped early: the last error its log shows."""
    log_path = base / f"{name}.log"
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    reasons = [ln for ln in lines if ln.startswith("swarm: error: ")] or \
        [ln for ln in lines if ln.strip() and not ln.startswith(("{", " "))]
    reason = reasons[-1].removeprefix("swarm: error: ") if reasons else "no error logged"
    return f"the {name} exited with status {status}: {reason} (its log: {log_path})"


def _apply(st: DemoState, ev: dict[str, Any]) -> int | None:
    """Fold one event into the state; returns the step when the trainer finished one."""
    node, kind = str(ev.get("node", "")), ev.get("event")
    if node == "trainer":
        if kind == "published" and ev.get("step") == 0:
            st.keyframe_bytes = int(ev.get("bytes", 0))
        elif kind == "step":
            st.steps.append(ev)
            st.final_step = int(ev["step"])
            st.lease_stats = dict(ev.get("leases", {}))
            st.egress = int(ev.get("egress", 0))
            st.checks = dict(ev.get("checks", {}))
            return st.final_step
        elif kind == "rejected":
            st.rejections.append(ev)
        elif kind == "done":
            st.done = True
            st.lease_stats = dict(ev.get("leases", {}))
            st.egress = int(ev.get("egress", 0))
            st.checks = dict(ev.get("checks", {}))
        return None
    peer = st.peers.get(node)
    if peer is None:
        return None
    if kind == "ready":
        peer.peer_id = str(ev.get("peer_id", ""))
    elif kind == "verified":
        peer.version = int(ev["version"])
        peer.verified += 1
        peer.sync_s[peer.version] = float(ev.get("sync_s", 0.0))
        peer.installed_s[peer.version] = float(ev.get("installed_s", 0.0))
    elif kind == "verify_failed":
        peer.failures += 1
    elif kind == "lease":
        peer.leases += 1
    elif kind == "result":
        peer.results += 1
    elif kind == "banned":
        peer.bans += 1
        st.banned.add(str(ev.get("peer", "")))
    return None


class _Display:
    """A live table on a terminal, or plain lines elsewhere."""

    def __init__(self, quiet: bool) -> None:
        self.live = not quiet and sys.stdout.isatty()
        self._last = 0.0
        self._lines = 0

    def line(self, text: str) -> None:
        self._clear()
        print(text, flush=True)

    def step_line(self, s: dict[str, Any]) -> None:
        print(f"step {s['step']:>3}  reward {s['reward']:.3f}  solved {s['solved']:.2f}  "
              f"delta {s['bytes'] / 1e3:.0f} kB ({s['ratio']:.1f}x)  "
              f"rollout {s['rollout_s']:.1f} s", flush=True)

    def _clear(self) -> None:
        if self.live and self._lines:
            sys.stdout.write(f"\x1b[{self._lines}F\x1b[J")
            self._lines = 0

    def render(self, st: DemoState, elapsed: float) -> None:
        if not self.live or time.monotonic() - self._last < 0.5:
            return
        self._last = time.monotonic()
        rows = [f"swarm demo  {elapsed:6.1f} s   trainer step {max(st.final_step, 0)}"]
        if st.steps:
            s = st.steps[-1]
            syncs = [p.sync_s.get(s["step"]) for p in st.peers.values()]
            sync = max((x for x in syncs if x is not None), default=float("nan"))
            rows.append(f"reward {s['reward']:.3f}  solved {s['solved']:.2f}  delta "
                        f"{s['bytes'] / 1e3:.0f} kB ({s['ratio']:.1f}x)  rollout "
                        f"{s['rollout_s']:.1f} s  sync {sync:.2f} s")
        rows.append(f"{'peer':<10}{'region':<8}{'version':>8}{'verified':>9}{'failed':>7}"
                    f"{'leases':>7}{'results':>8}{'bans':>5}  state")
        for p in st.peers.values():
            state = "killed" if p.killed else ("corrupt" if p.corrupt else "ok")
            rows.append(f"{p.name:<10}{p.region:<8}{p.version:>8}{p.verified:>9}{p.failures:>7}"
                        f"{p.leases:>7}{p.results:>8}{p.bans:>5}  {state}")
        self._clear()
        sys.stdout.write("\n".join(rows) + "\n")
        sys.stdout.flush()
        self._lines = len(rows)

    def close(self) -> None:
        self._lines = 0


def _window(values: list[float], first: bool, n: int = 5) -> float:
    """Mean of the first or last ``n`` values (of each half, for short runs)."""
    n = max(1, min(n, len(values) // 2))
    part = values[:n] if first else values[-n:]
    return sum(part) / max(1, len(part))


def _summary(st: DemoState, elapsed: float) -> bool:
    rewards = [float(s["reward"]) for s in st.steps]
    print("\n== summary")
    print(f"steps {len(st.steps)} in {elapsed:.0f} s")
    if rewards:
        w = max(1, min(5, len(rewards) // 2))
        print(f"reward: first {w} steps {_window(rewards, True):.3f} -> last {w} steps "
              f"{_window(rewards, False):.3f}")
        payload = sum(int(s["bytes"]) for s in st.steps)
        dense = sum(int(s["dense"]) for s in st.steps)
        print(f"deltas: {payload / 1e6:.2f} MB for {dense / 1e6:.2f} MB of dense bf16 states "
              f"({dense / max(1, payload):.1f}x smaller); "
              f"keyframe {st.keyframe_bytes / 1e6:.2f} MB")
        roll = [float(s["rollout_s"]) for s in st.steps]
        print(f"rollout time per step: mean {sum(roll) / len(roll):.2f} s")
        total_payload = payload + st.keyframe_bytes
        print(f"trainer egress {st.egress / 1e6:.2f} MB = "
              f"{st.egress / max(1, total_payload):.2f}x the payload for "
              f"{len(st.peers)} peers")
    print(f"{'peer':<10}{'region':<8}{'versions verified':>18}{'failed':>7}{'leases':>7}"
          f"{'mean sync s':>12}{'to engine s':>12}  state")
    expected = st.final_step + 1
    all_ok = True
    for p in st.peers.values():
        syncs = [v for k, v in p.sync_s.items() if k > 0]
        mean = sum(syncs) / len(syncs) if syncs else float("nan")
        inst = [v for k, v in p.installed_s.items() if k > 0]
        mean_inst = sum(inst) / len(inst) if inst else float("nan")
        state = ("killed" if p.killed else "corrupt (chaos)" if p.corrupt
                 else "cheater (chaos)" if p.cheater else "ok")
        if not p.killed and p.honest:
            all_ok = all_ok and p.failures == 0 and p.version >= st.final_step
        first = min(p.sync_s, default=0)
        held = f"{p.verified} of {expected - first}" + (f" from v{first}" if first else "")
        print(f"{p.name:<10}{p.region:<8}{held:>18}{p.failures:>7}"
              f"{p.leases:>7}{mean:>12.2f}{mean_inst:>12.2f}  {state}")
    honest = [p for p in st.peers.values() if not p.killed and p.honest]
    all_ok = all_ok and bool(honest)
    print(f"bit-exact: {sum(p.verified for p in honest)} version installs verified against "
          f"signed roots on {len(honest)} live peers; "
          f"{sum(p.failures for p in st.peers.values())} failures")
    corrupt_ids = {p.peer_id for p in st.peers.values() if p.corrupt}
    if corrupt_ids:
        print(f"corrupt peer banned by others: {'yes' if corrupt_ids & st.banned else 'no'}")
    cheat, cheat_ok = _cheater_line(st)
    if cheat:
        print(cheat)
    if st.lease_stats:
        ls = st.lease_stats
        print(f"leases: {ls.get('leases_issued', 0)} issued, {ls.get('leases_expired', 0)} "
              f"expired, {ls.get('tasks_reissued', 0)} tasks re-issued, "
              f"{ls.get('tasks_completed', 0)} tasks completed; refused "
              f"{ls.get('refused', {})}")
    learned = len(rewards) >= 2 and _window(rewards, False) > _window(rewards, True)
    checked = "" if not cheat else f"; the checks held: {cheat_ok}"
    ok = all_ok and learned and cheat_ok
    print(f"result: {'PASS' if ok else 'FAIL'} (every live peer verified "
          f"every version: {all_ok}; reward rose: {learned}{checked})")
    return ok


def _cheater_line(st: DemoState) -> tuple[str, bool]:
    """``cheater: N results rejected, M accepted, banned after K`` (or never banned), and
    whether the checks held: nothing of the cheater's counted, nothing honest refused."""
    ids = {p.peer_id for p in st.peers.values() if p.cheater}
    if not ids:
        return "", True
    mine = [r for r in st.rejections if r.get("peer") in ids]
    by_version = {int(v): int(n) for peer, by in st.checks.get("accepted", {}).items()
                  if peer in ids for v, n in by.items()}
    # A one-version-late engine is the right one at version 0 (there is none before it).
    honest_v0 = by_version.pop(0, 0) if st.cheat_strategy == "stale" else 0
    accepted = sum(by_version.values())
    at = next((i + 1 for i, r in enumerate(mine) if r.get("banned")), None)
    ban = f"banned after {at}" if at else "not banned"
    if honest_v0:
        ban += f" ({honest_v0} accepted at version 0, where its engine was right)"
    honest = sum(int(n) for peer, n in st.checks.get("rejected", {}).items()
                 if peer not in ids)
    return (f"cheater: {len(mine)} results rejected, {accepted} accepted, {ban}; honest "
            f"peers' results rejected: {honest}"), accepted == 0 and honest == 0


def _summary_json(st: DemoState, elapsed: float) -> dict[str, Any]:
    return {
        "elapsed_s": round(elapsed, 1), "steps": st.steps, "keyframe_bytes": st.keyframe_bytes,
        "peers": {p.name: {"region": p.region, "verified": p.verified, "failures": p.failures,
                           "leases": p.leases, "results": p.results, "killed": p.killed,
                           "corrupt": p.corrupt, "sync_s": p.sync_s,
                           "installed_s": p.installed_s}
                  for p in st.peers.values()},
        "lease_stats": st.lease_stats, "egress": st.egress, "checks": st.checks,
    }


def _plot(st: DemoState, path: Path) -> None:
    if not st.steps:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    steps = [int(s["step"]) for s in st.steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [s["reward"] for s in st.steps], marker="o", label="mean reward")
    ax1.plot(steps, [s["solved"] for s in st.steps], marker=".", label="fraction solved")
    ax1.set_ylabel("reward")
    ax1.legend()
    ax1.set_title("swarm demo: GRPO on digit sorting, trainer + peers over libp2p")
    for p in st.peers.values():
        xs = [k for k in steps if k in p.sync_s]
        ax2.plot(xs, [p.sync_s[k] for k in xs], marker=".",
                 label=f"{p.name} fetch+verify")
    ax2.plot(steps, [s["rollout_s"] for s in st.steps], "k--", label="rollout (trainer view)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
