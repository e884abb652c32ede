"""``swarm bench attacks``: what one hostile peer costs honest peers, on real processes.

Each scenario runs on loopback, from scratch: a ``swarm bootstrap`` that everyone joins
through, a ``swarm trainer`` (the demo model, its uplink shaped to ``--uplink-mbps`` and
its deltas cut in ``--chunk-kib`` chunks, so that peers get most chunks from each other
rather than from it) and two honest ``swarm peer`` processes, for ``--steps`` versions.
``none`` has nothing else; the others start a third ``swarm peer`` first:

- ``extra``: an honest one (the control: what one more process costs on this machine,
  and it must not be dropped);
- ``liar`` (``--chaos-liar``): announces every chunk of every version and serves none;
- ``flood`` (``--chaos-flood-haves``): sends every neighbour, twice a second, have
  summaries of 8 made-up objects of 2^18 chunks with every bit set.

Per scenario it reports the honest peers' sync time per version (their ``verified``
events' ``sync_s``: from the start of the fetch to the version verified), its median and
maximum over versions and peers and their ratio to the unattacked run of the same
invocation, the honest peers' peak RSS (``VmHWM``), which versions each honest peer
verified, and how long after it was ready itself each honest peer dropped the third.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.bench.procs import BenchError, Event, SwarmChild, say, stop_children, workdir

RUN = "bench-attacks"
HONEST = ("p0", "p1")
THIRD = "p2"  # the extra honest peer
#: Scenario name -> the third peer's flags (None: no third peer, the baseline).
SCENARIOS: dict[str, tuple[str, ...] | None] = {
    "none": None,
    "extra": (),
    "liar": ("--chaos-liar",),
    "flood": ("--chaos-flood-haves",),
}
OTHERS = tuple(n for n in SCENARIOS if n != "none")
MiB = float(1 << 20)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=3,
                   help="versions published per scenario after version 0 (default 3)")
    p.add_argument("--scenarios", default=",".join(OTHERS), metavar="LIST",
                   help="scenarios to run after the unattacked one (none), comma-separated "
                        f"from {', '.join(OTHERS)} (default: all)")
    p.add_argument("--uplink-mbps", type=float, default=1.0,
                   help="the trainer's uplink in Mbit/s (default 1: a delta takes seconds "
                        "to leave it, so peers trade between themselves)")
    p.add_argument("--chunk-kib", type=int, default=16,
                   help="the trainer's target delta chunk size in KiB (default 16: a delta "
                        "of the demo model is about 10 chunks to trade, 4 at the trainer's "
                        "default of 64)")
    p.add_argument("--prompts", type=int, default=8,
                   help="the trainer's prompts per step (default 8)")
    p.add_argument("--group", type=int, default=4,
                   help="the trainer's completions per prompt (default 4)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="most seconds for a process to start or a version to be verified "
                        "(default 120)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="work in DIR and keep it (data dirs, every process's stderr); "
                        "default: a temporary dir, deleted at the end")


@dataclass(slots=True)
class Scenario:
    """What one scenario measured."""

    name: str
    flags: tuple[str, ...] | None
    third: str = ""
    """The third peer's id (none in the baseline)."""
    #: version -> honest peer -> sync_s
    sync: dict[int, dict[str, float]] = field(default_factory=dict)
    verified: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    rss: dict[str, int] = field(default_factory=dict)
    #: honest peer -> seconds from its own ready event to its first drop of the third
    #: peer (None: not dropped)
    dropped_after: dict[str, float | None] = field(default_factory=dict)
    drop_reasons: list[str] = field(default_factory=list)

    def times(self) -> list[float]:
        return [s for by_peer in self.sync.values() for s in by_peer.values()]

    @property
    def median_s(self) -> float:
        t = self.times()
        return statistics.median(t) if t else 0.0

    @property
    def max_s(self) -> float:
        return max(self.times(), default=0.0)

    def as_dict(self, base: Scenario | None) -> dict[str, Any]:
        return {
            "third_flags": self.flags, "third": self.third or None,
            "sync_s": {str(v): by_peer for v, by_peer in sorted(self.sync.items())},
            "median_sync_s": self.median_s, "max_sync_s": self.max_s,
            "median_ratio": _ratio(self.median_s, base.median_s if base else 0.0),
            "max_ratio": _ratio(self.max_s, base.max_s if base else 0.0),
            "verified": self.verified, "verify_failed": self.failed,
            "peak_rss_bytes": self.rss, "dropped_after_s": self.dropped_after,
            "drop_reasons": self.drop_reasons,
        }


def _ratio(x: float, base: float) -> float | None:
    return x / base if base > 0 else None


def _scenario(name: str, args: argparse.Namespace, work: Path) -> Scenario:
    flags = SCENARIOS[name]
    out = Scenario(name, flags)
    home = work / name
    home.mkdir(parents=True, exist_ok=True)
    children: list[SwarmChild] = []

    def start(who: str, argv: list[str]) -> SwarmChild:
        child = SwarmChild(who, [*argv, "--data-dir", str(home / who), "--run", RUN,
                                 "--listen", "/ip4/127.0.0.1/tcp/0", "--status-json"], home,
                           verbose=getattr(args, "verbose", 0))
        children.append(child)
        return child

    try:
        # Everyone joins through a bootstrap node, as volunteers do; it relays the
        # trainer's manifests (its key is made first, in its data dir).
        from swarm.identity import Identity

        trainer_id = Identity.load_or_create(home / "trainer" / "node.key").peer_id
        boot = start("bootstrap", ["bootstrap", "--trainer", trainer_id])
        boot_addr = str(boot.wait_event("ready", args.timeout)["addr"])
        trainer = start("trainer", [
            "trainer", "--bootstrap", boot_addr, "--steps", str(args.steps),
            "--min-peers", str(len(HONEST)), "--uplink-mbps", f"{args.uplink_mbps:g}",
            "--chunk-kib", str(args.chunk_kib), "--prompts", str(args.prompts),
            "--group", str(args.group), "--linger", "600"])
        trainer.wait_event("ready", args.timeout)

        def peer(who: str, *extra: str) -> SwarmChild:
            return start(who, ["peer", "--bootstrap", boot_addr, "--trainer", trainer_id,
                               "--name", who, "--region", "r1",
                               "--card-timeout", f"{args.timeout:g}", *extra])

        third = None
        if flags is not None:
            third = peer(THIRD if not flags else name, *flags)
            out.third = str(third.wait_event("ready", args.timeout)["peer_id"])
            third.wait_event("card", args.timeout)  # in the swarm, as the peers come
            say(f"{name}: third peer {out.third} ({_what(flags)}) joined")
        honest = [peer(who) for who in HONEST]
        for version in range(args.steps + 1):
            for p in honest:
                ev = p.wait_for(_reached(version), args.timeout, f"version {version} verified")
                if int(ev["version"]) == version and version > 0:
                    out.sync.setdefault(version, {})[p.name] = float(ev["sync_s"])
                    say(f"{name}: {p.name} verified version {version} ({ev.get('kind')}, "
                        f"synced in {float(ev['sync_s']):.2f} s)")
        for p in honest:
            out.verified[p.name] = sorted({int(e["version"]) for e in p.of("verified")})
            out.failed[p.name] = len(p.of("verify_failed"))
            out.rss[p.name] = p.peak_rss()
            if third is not None:
                drops = [e for e in p.of("dropped") if e.get("peer") == out.third]
                ready_at = float(p.of("ready")[0]["t"])
                out.dropped_after[p.name] = \
                    round(float(drops[0]["t"]) - ready_at, 2) if drops else None
                out.drop_reasons.extend(str(e.get("reason")) for e in drops[:1])
    finally:
        stop_children(list(reversed(children)))
    return out


def _reached(version: int) -> Callable[[Event], bool]:
    """A ``verified`` event of ``version`` or later."""
    return lambda e: e.get("event") == "verified" and int(e.get("version", -1)) >= version


def _what(flags: tuple[str, ...] | None) -> str:
    return "honest" if not flags else " ".join(flags)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(scenarios: list[Scenario]) -> None:
    base = scenarios[0]
    for s in scenarios:
        say("")
        say(f"scenario {s.name}" + (f": third peer {s.third} ({_what(s.flags)})"
                                    if s.flags is not None else ": no third peer"))
        say("ver  median sync s  max sync s")
        for v, by_peer in sorted(s.sync.items()):
            t = list(by_peer.values())
            say(f"{v:>3} {statistics.median(t):>14.2f} {max(t):>11.2f}")
        say(f"all {s.median_s:>14.2f} {s.max_s:>11.2f}   vs unattacked: median "
            f"{_fmt(_ratio(s.median_s, base.median_s))}x, max "
            f"{_fmt(_ratio(s.max_s, base.max_s))}x")
        say("verified: " + ", ".join(f"{p} {_span(v)}" for p, v in s.verified.items()))
        say("peak RSS: " + ", ".join(f"{p} {r / MiB:.0f} MiB" for p, r in s.rss.items()))
        if any(s.failed.values()):
            say("verify failures: " + ", ".join(f"{p} {n}" for p, n in s.failed.items()))
        if s.flags is not None:
            say("third peer dropped: " + ", ".join(
                f"by {p} after {t:.1f} s" if t is not None else f"not by {p}"
                for p, t in s.dropped_after.items()))
    say("")
    say("scenario  median s  max s  median/none  max/none  peak RSS MiB  dropped after s")
    for s in scenarios:
        drops = [t for t in s.dropped_after.values() if t is not None]
        dropped = "-" if s.flags is None else "none" if not drops else (
            f"{min(drops):.1f}-{max(drops):.1f}" if len(drops) == len(s.dropped_after)
            else f"{len(drops)} of {len(s.dropped_after)}")
        say(f"{s.name:<9} {s.median_s:>8.2f} {s.max_s:>6.2f} "
            f"{_fmt(_ratio(s.median_s, base.median_s)):>12} "
            f"{_fmt(_ratio(s.max_s, base.max_s)):>9} "
            f"{max(s.rss.values(), default=0) / MiB:>13.0f} {dropped:>16}")


def _span(versions: list[int]) -> str:
    if versions and versions == list(range(versions[0], versions[-1] + 1)):
        return f"{versions[0]}-{versions[-1]}"
    return ",".join(map(str, versions)) or "none"


def run(args: argparse.Namespace) -> int:
    chosen = [a.strip() for a in args.scenarios.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in OTHERS]
    if unknown:
        raise BenchError(f"--scenarios: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(OTHERS)})")
    if min(args.steps, args.prompts, args.group, args.chunk_kib) < 1 or args.uplink_mbps <= 0:
        raise BenchError("--steps, --chunk-kib, --prompts and --group must be at least 1, "
                         "--uplink-mbps positive")
    say(f"swarm bench attacks: trainer (demo model, uplink {args.uplink_mbps:g} Mbit/s, "
        f"{args.chunk_kib} KiB chunks) and "
        f"{len(HONEST)} honest peers, {args.steps} versions per scenario; scenarios: none, "
        f"{', '.join(chosen)}")
    scenarios: list[Scenario] = []
    t0 = time.monotonic()
    with workdir(args.keep, "swarm-bench-attacks-") as work:
        for name in ("none", *chosen):
            say(f"{name}: starting")
            t_scenario = time.monotonic()
            scenarios.append(_scenario(name, args, work))
            say(f"{name}: done in {time.monotonic() - t_scenario:.0f} s")
    print_tables(scenarios)
    say(f"all scenarios in {time.monotonic() - t0:.0f} s")
    if args.json is not None:
        base = scenarios[0]
        figures = {"steps": args.steps, "uplink_mbps": args.uplink_mbps,
                   "chunk_kib": args.chunk_kib,
                   "prompts": args.prompts, "group": args.group,
                   "scenarios": {s.name: s.as_dict(base) for s in scenarios}}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        say(f"figures written to {args.json}")
    return 0
