"""Which version a rollout peer takes next: a sans-IO follower of the trainer's versions.

The follower is the one place that decides what to fetch. It is fed what the peer learns
(signed manifests announced on gossip or answered by a sync, what the peer holds, each
fetch's progress, install results, the trainer's connection) with the time ``now``, and
answers with actions for its driver to carry out: fetch an object, drop one, ask the
trainer what follows a version, install a fetched version, stop. :meth:`Follower.wake_at`
says when it wants to be polled again if nothing else happens.

Routes are chosen by bytes with :func:`swarm.protocol.picker.plan_catch_up`: the delta
chain from the version held, or a keyframe of a newer version when the chain costs at
least as much or has a gap. The trainer answers catch-up requests with the same rule
(:func:`catch_up_reply`).

No stall: while the peer is behind (a newer version was announced, or the trainer said
so) and nothing it holds leads there, or its fetch gets no chunk for ``stall`` seconds,
it asks the trainer, once per ``stall``; a fetch still stalled after that asks for a
keyframe (the chain's seeders may be gone). Restarts are covered by the same rule: a
follower made with the version restored from disk asks as soon as the trainer is
reachable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarm.content.manifest import Manifest, SignedManifest
from swarm.protocol.picker import plan_catch_up

#: Ask for "what follows" this step to get a keyframe of the trainer's newest version.
KEYFRAME = -1


@dataclass(frozen=True, slots=True)
class FollowConfig:
    """Settings of a :class:`Follower`."""

    stall: float = 10.0
    """Seconds without a chunk of the version being fetched (or, when nothing leads to a
    newer version, since the last ask) after which the trainer is asked again, and a
    stalled fetch is given up if another route exists."""
    max_pending: int = 64
    """Deltas kept ahead of the version held (further ones are asked for later)."""
    max_failed: int = 64
    """Manifests remembered as failed (offered again, they are ignored)."""

    def __post_init__(self) -> None:
        if not self.stall > 0:
            raise ValueError("stall must be positive")
        if self.max_pending < 1 or self.max_failed < 1:
            raise ValueError("max_pending and max_failed must be at least 1")


# ------------------------------------------------------------------------------ actions


def _named(sm: SignedManifest) -> str:
    return f"{sm.manifest.kind} {sm.manifest.step}"


@dataclass(frozen=True, slots=True)
class Fetch:
    """Start fetching the chunks of ``manifest``."""

    manifest: SignedManifest

    def __str__(self) -> str:
        return f"fetch {_named(self.manifest)}"


@dataclass(frozen=True, slots=True)
class Drop:
    """Stop fetching ``manifest`` and free what was received of it."""

    manifest: SignedManifest

    def __str__(self) -> str:
        return f"drop {_named(self.manifest)}"


@dataclass(frozen=True, slots=True)
class AskTrainer:
    """Ask the trainer what follows step ``after`` (:data:`KEYFRAME`: a keyframe)."""

    after: int


@dataclass(frozen=True, slots=True)
class Install:
    """Every chunk of ``manifest`` is held: patch or fill the state, verify, report back
    with :meth:`Follower.installed` or :meth:`Follower.install_failed`."""

    manifest: SignedManifest

    def __str__(self) -> str:
        return f"install {_named(self.manifest)}"


@dataclass(frozen=True, slots=True)
class Stop:
    """The run cannot be followed by this peer (``reason`` says why)."""

    reason: str


Action = Fetch | Drop | AskTrainer | Install | Stop


@dataclass(frozen=True, slots=True)
class Offered:
    """What :meth:`Follower.offer` made of a manifest."""

    kind: str
    """``"ahead"`` (kept as a route), ``"held"`` (a keyframe of the version held: the
    peer can seed it from its state), ``"ignored"`` (old, foreign, failed or over the
    bound)."""
    reason: str = ""


# ------------------------------------------------------------------------------ routes


def route(version: int, root: bytes | None, deltas: Mapping[int, Manifest],
          keyframe: Manifest | None) -> Manifest | None:
    """The next manifest on the cheapest known route from ``version`` (root ``root``):
    the delta after it, or ``keyframe`` when that costs no more than the deltas up to its
    step or some of them are missing. ``None``: nothing known leads further."""
    if keyframe is not None and keyframe.step > version:
        if version < 0 or root is None:
            return keyframe
        plan = plan_catch_up(version, root, keyframe.step, deltas, keyframe.total_bytes)
        if plan.kind == "state" or plan.chain_bytes == keyframe.total_bytes:
            return keyframe
    if version < 0 or root is None:
        return None
    nxt = deltas.get(version + 1)
    if nxt is None or nxt.kind != "delta" or nxt.base_root != root:
        return None
    return nxt


def catch_up_reply(after: int, kept: Sequence[SignedManifest], state_bytes: int
                   ) -> tuple[str, list[SignedManifest]]:
    """The trainer's answer to a peer at step ``after``, from the manifests it keeps
    (oldest first): ``("chain", deltas)`` when the deltas after ``after`` are all kept and
    cost less than the state, ``("none", [])`` when ``after`` is the newest step, else
    ``("keyframe", [])`` (the caller sends a keyframe of its newest version)."""
    if not kept:
        return "none", []
    head = kept[-1].manifest.step
    if after == head:
        return "none", []
    by_step = {m.manifest.step: m for m in kept if m.manifest.kind == "delta"}
    base = next((m.manifest.target_root for m in kept if m.manifest.step == after), None)
    if 0 <= after < head and base is not None:
        plan = plan_catch_up(after, base, head, {s: m.manifest for s, m in by_step.items()},
                             state_bytes)
        if plan.kind == "chain" and plan.nbytes < state_bytes:
            return "chain", [by_step[s] for s in plan.steps]
    return "keyframe", []


# ------------------------------------------------------------------------------ follower


@dataclass(slots=True)
class _Fetching:
    manifest: SignedManifest
    started: float
    last_chunk: float
    complete: bool = False
    installing: bool = False


class Follower:
    """Decides, for one peer, which version to fetch and install next (sans-IO)."""

    def __init__(self, *, run: str, codec: str, layout_digest: bytes,
                 config: FollowConfig | None = None, version: int = -1,
                 root: bytes | None = None, now: float = 0.0) -> None:
        self.config = config or FollowConfig()
        self.run = run
        self.codec = codec
        self.layout_digest = layout_digest
        self.version = version
        self.root = root if version >= 0 else None
        self.head = version
        """The newest step known to exist (announced, or said by the trainer)."""
        self._deltas: dict[int, SignedManifest] = {}
        self._keyframe: SignedManifest | None = None
        self._failed: deque[bytes] = deque(maxlen=self.config.max_failed)
        self._fetch: _Fetching | None = None
        self._out: list[Action] = []
        self._asked_at: float | None = None
        self._asks_unanswered = 0
        self._ask_now = True  # ask as soon as the trainer can be reached
        self._stopped = False
        self._since = now  # when the peer last made progress (a chunk, an install)

    # -- what the peer learns -----------------------------------------------------------
    def offer(self, sm: SignedManifest, now: float) -> Offered:
        """A manifest whose signature the caller checked against the trainer's key."""
        m = sm.manifest
        if m.run != self.run:
            return Offered("ignored", f"run {m.run!r}")
        if sm.id in self._failed:
            return Offered("ignored", "failed before")
        if m.kind == "delta" and m.codec != self.codec:
            return Offered("ignored", f"codec {m.codec!r}, this peer decodes {self.codec!r}")
        if m.layout_digest != self.layout_digest:
            if m.step > self.version and not self._stopped:
                self._stopped = True
                self._out.append(Stop(
                    f"step {m.step} is for another model (layout digest "
                    f"{m.layout_digest.hex()[:16]}, this peer's state has "
                    f"{self.layout_digest.hex()[:16]}): this peer cannot follow the run"))
            return Offered("ignored", "another model")
        if m.kind == "keyframe" and m.step == self.version and m.target_root == self.root:
            return Offered("held")
        if m.step <= self.version:
            return Offered("ignored", "not ahead")
        self.head = max(self.head, m.step)
        if m.kind == "keyframe":
            held = self._keyframe
            if held is None or m.step > held.manifest.step or \
                    (m.step == held.manifest.step and sm.id != held.id):
                self._keyframe = sm  # the newest; of one step, the last announced
            self._answered()
            return Offered("ahead")
        if m.step > self.version + self.config.max_pending:
            return Offered("ignored", "too far ahead")
        if m.step not in self._deltas:
            self._deltas[m.step] = sm
            if m.step == self.version + 1:
                self._answered()
        return Offered("ahead")

    def behind(self, head: int, now: float) -> None:
        """The trainer says its newest version is at least ``head`` (a refused claim)."""
        if head > self.head:
            self.head = head

    def trainer_connected(self, now: float) -> None:
        """The trainer is reachable (again): ask it what it has at the next poll."""
        self._ask_now = True

    def chunk_arrived(self, sm: SignedManifest, now: float) -> None:
        f = self._fetch
        if f is not None and f.manifest.id == sm.id:
            f.last_chunk = now
            self._since = now
            self._asks_unanswered = 0

    def fetched(self, sm: SignedManifest, now: float) -> None:
        """Every chunk of ``sm`` is held."""
        f = self._fetch
        if f is not None and f.manifest.id == sm.id:
            f.complete = True
            f.last_chunk = now

    def installed(self, sm: SignedManifest, root: bytes, now: float) -> None:
        """``sm`` was installed and verified: the state holds its version."""
        self.version, self.root = sm.manifest.step, root
        self.head = max(self.head, self.version)
        if self._fetch is not None and self._fetch.manifest.id == sm.id:
            self._fetch = None
        self._forget_through(self.version)
        self._since = now
        self._asks_unanswered = 0

    def install_failed(self, sm: SignedManifest, *, bad_content: bool, version: int,
                       root: bytes | None, now: float) -> None:
        """Installing ``sm`` failed; the state now holds ``version`` (-1: none).

        ``bad_content``: the version itself is wrong (a chunk that does not decode, a root
        that does not match): never take it again, and ask for a keyframe. Otherwise (a
        base that does not match, say) only this attempt is dropped."""
        if bad_content:
            self._failed.append(sm.id)
        if sm.manifest.kind == "keyframe":
            if self._keyframe is not None and self._keyframe.id == sm.id:
                self._keyframe = None
        elif (held := self._deltas.get(sm.manifest.step)) is not None and held.id == sm.id:
            del self._deltas[sm.manifest.step]
        self.version, self.root = version, root if version >= 0 else None
        if self._fetch is not None and self._fetch.manifest.id == sm.id:
            self._fetch = None
            if bad_content:
                self._out.append(Drop(sm))
        self._ask_now = True  # news: not held back by the last ask
        self._ask(KEYFRAME if bad_content or version < 0 else version, now)

    def state_lost(self, now: float) -> None:
        """The state holds no version any more (a write was cut short)."""
        self.version, self.root = -1, None
        self._ask_now = True

    # -- what the peer should do --------------------------------------------------------
    def poll(self, now: float) -> list[Action]:
        """The actions due at ``now`` (each returned once)."""
        if self._stopped:
            out, self._out = self._out, []
            return out
        f = self._fetch
        target = self._route()
        if f is not None and not f.installing:
            stale = f.manifest.manifest.step <= self.version
            stalled = not f.complete and now - f.last_chunk >= self.config.stall
            cheaper = (target is not None and target.id != f.manifest.id
                       and target.manifest.kind == "keyframe"
                       and f.manifest.manifest.kind == "delta")
            if stale or cheaper or (stalled and target is not None
                                            and target.id != f.manifest.id):
                self._out.append(Drop(f.manifest))
                self._fetch = f = None
            elif stalled:
                # the only route gets no chunk: its seeders may have moved on
                self._ask(KEYFRAME if self._asks_unanswered >= 1 else self.version, now)
        if f is None and target is not None:
            self._fetch = f = _Fetching(target, now, now)
            self._out.append(Fetch(target))
        if f is not None and f.complete and not f.installing:
            f.installing = True
            self._out.append(Install(f.manifest))
        if f is None and (self._ask_now or self.head > self.version or self.version < 0):
            # behind (or just back), and nothing known leads on: ask, once a stall
            self._ask(self.version if self.version >= 0 else KEYFRAME, now)
        out, self._out = self._out, []
        return out

    def wake_at(self) -> float | None:
        """When :meth:`poll` may have something to do if no input comes first."""
        if self._stopped:
            return None
        f = self._fetch
        stall = self.config.stall
        if f is not None:
            if f.installing or f.complete:
                return None
            return f.last_chunk + stall
        if self.head > self.version or self.version < 0:
            return (self._asked_at or 0.0) + stall
        return None

    @property
    def fetching(self) -> SignedManifest | None:
        return None if self._fetch is None else self._fetch.manifest

    def pending(self) -> list[SignedManifest]:
        """Manifests kept ahead of the version held (deltas, then the keyframe)."""
        out = [self._deltas[s] for s in sorted(self._deltas)]
        return out + ([self._keyframe] if self._keyframe is not None else [])

    # -- internals -----------------------------------------------------------------------
    def _route(self) -> SignedManifest | None:
        kf = self._keyframe
        nxt = route(self.version, self.root,
                    {s: m.manifest for s, m in self._deltas.items()},
                    None if kf is None else kf.manifest)
        if nxt is None:
            return None
        if kf is not None and nxt is kf.manifest:
            return kf
        return self._deltas[nxt.step]

    def _ask(self, after: int, now: float) -> None:
        if not self._ask_now and self._asked_at is not None and \
                now - self._asked_at < self.config.stall:
            return
        self._ask_now = False
        self._asked_at = now
        self._asks_unanswered += 1
        self._out.append(AskTrainer(after))

    def _answered(self) -> None:
        self._asks_unanswered = 0

    def _forget_through(self, step: int) -> None:
        for s in [s for s in self._deltas if s <= step]:
            del self._deltas[s]
        if self._keyframe is not None and self._keyframe.manifest.step <= step:
            self._keyframe = None
