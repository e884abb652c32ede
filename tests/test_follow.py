"""The sans-IO version follower: routes by bytes, asks the trainer instead of stalling.

Table-driven cases, then a hypothesis state machine: a trainer publishing versions (it
keeps a few deltas and seeds a keyframe of its newest version only), announcements and
sync replies that get lost, restarts of the peer, time jumps. Once the trainer stops
publishing, the follower must reach the newest version within a bounded time, fetching
no more than the cheapest route plus one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from swarm.content.manifest import Manifest, SignedManifest
from swarm.identity import Identity
from swarm.protocol.follow import (
    KEYFRAME,
    Action,
    AskTrainer,
    Drop,
    Fetch,
    FollowConfig,
    Follower,
    Install,
    Stop,
    catch_up_reply,
    route,
)

SIGNER = Identity.from_seed(b"F" * 32)
LAYOUT = b"l" * 32
STATE_BYTES = 1000


def root(step: int) -> bytes:
    return step.to_bytes(4, "little") * 8


def delta(step: int, size: int = 100, run: str = "r", codec: str = "c") -> SignedManifest:
    return Manifest(run, step, "delta", root(step - 1), root(step), LAYOUT, codec, 4096,
                    ((bytes([step % 256, 1]) * 16, size),)).sign(SIGNER)


def keyframe(step: int, size: int = STATE_BYTES, layout: bytes = LAYOUT) -> SignedManifest:
    return Manifest("r", step, "keyframe", None, root(step), layout, "c", 4096,
                    ((bytes([step % 256, 2]) * 16, size),)).sign(SIGNER)


def follower(version: int = -1, **cfg: float) -> Follower:
    return Follower(run="r", codec="c", layout_digest=LAYOUT,
                    config=FollowConfig(**cfg),  # type: ignore[arg-type]
                    version=version, root=root(version) if version >= 0 else None)


def test_route_prefers_held_deltas_over_a_dearer_keyframe() -> None:
    d = {s: delta(s).manifest for s in range(1, 5)}
    k4 = keyframe(4).manifest
    assert route(1, root(1), d, k4) is d[2]                   # 300 bytes of deltas < 1000
    assert route(3, root(3), d, k4) is d[4]
    assert route(1, root(1), d, keyframe(4, 250).manifest).step == 4  # keyframe cheaper
    assert route(0, root(0), d, k4) is d[1]
    assert route(1, root(1), {2: d[2], 4: d[4]}, k4) is k4    # a gap: jump
    assert route(-1, None, d, k4) is k4                       # a newcomer starts from one
    assert route(-1, None, d, None) is None
    assert route(4, root(4), d, k4) is None                   # nothing ahead
    assert route(1, b"x" * 32, d, None) is None               # the delta is not for my root


def test_trainer_answers_with_the_cheaper_route() -> None:
    kept = [keyframe(0), *(delta(s) for s in range(1, 6))]
    kind, chain = catch_up_reply(2, kept, STATE_BYTES)
    assert kind == "chain" and [m.manifest.step for m in chain] == [3, 4, 5]
    assert catch_up_reply(5, kept, STATE_BYTES) == ("none", [])
    assert catch_up_reply(-1, kept, STATE_BYTES)[0] == "keyframe"
    assert catch_up_reply(0, kept, 450)[0] == "keyframe"      # 500 bytes of deltas > 450
    assert catch_up_reply(2, kept[3:], STATE_BYTES)[0] == "keyframe"  # 3 not kept
    assert catch_up_reply(9, kept, STATE_BYTES)[0] == "keyframe"      # ahead of the trainer
    assert catch_up_reply(3, [], STATE_BYTES) == ("none", [])


def _kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_resumed_peer_asks_at_once_then_follows_the_chain() -> None:
    f = follower(3)
    assert f.poll(0.0) == [AskTrainer(3)]
    assert f.poll(0.1) == []                                  # once, not every poll
    for s in (4, 5):
        assert f.offer(delta(s), 0.2).kind == "ahead"
    out = f.poll(0.2)
    assert out == [Fetch(delta(4))]
    f.fetched(delta(4), 0.3)
    assert f.poll(0.3) == [Install(delta(4))]
    f.installed(delta(4), root(4), 0.4)
    assert f.poll(0.4) == [Fetch(delta(5))]
    assert f.version == 4


def test_a_fetch_that_gets_no_chunk_asks_again_then_for_a_keyframe() -> None:
    f = follower(3, stall=10.0)
    f.poll(0.0)
    f.offer(delta(4), 0.0)
    assert f.poll(0.0) == [Fetch(delta(4))]
    assert f.wake_at() == 10.0
    assert f.poll(10.0) == [AskTrainer(3)]                    # stalled: ask again
    assert f.poll(15.0) == []
    assert f.poll(20.0) == [AskTrainer(KEYFRAME)]             # still nothing: a keyframe
    f.offer(keyframe(6), 20.1)
    assert f.poll(20.1) == [Drop(delta(4)), Fetch(keyframe(6))]


def test_a_progressing_keyframe_is_kept_when_a_newer_one_is_announced() -> None:
    f = follower(-1, stall=10.0)
    f.offer(keyframe(2), 0.0)
    assert _kinds(f.poll(0.0)) == ["Fetch"]
    f.chunk_arrived(keyframe(2), 5.0)
    f.offer(keyframe(3), 6.0)
    assert f.poll(6.0) == []                                  # progress: keep it
    assert f.poll(15.1) == [Drop(keyframe(2)), Fetch(keyframe(3))]  # stalled: the newer


def test_a_peer_behind_with_no_route_asks_once_a_stall() -> None:
    f = follower(3, stall=10.0)
    f.poll(0.0)                                               # the resume ask
    f.offer(delta(9), 1.0)                                    # 4..8 lost
    assert f.head == 9
    assert f.poll(1.0) == []
    assert f.poll(10.0) == [AskTrainer(3)]                    # the first went unanswered
    assert f.poll(15.0) == []
    f.trainer_connected(16.0)
    assert f.poll(16.0) == [AskTrainer(3)]                    # reconnects ask at once


def test_failed_installs_are_never_retried_and_ask_for_a_keyframe() -> None:
    f = follower(3)
    f.poll(0.0)
    f.offer(delta(4), 0.0)
    f.poll(0.0)
    f.fetched(delta(4), 0.1)
    assert f.poll(0.1) == [Install(delta(4))]
    f.install_failed(delta(4), bad_content=True, version=3, root=root(3), now=0.2)
    assert f.poll(0.2) == [Drop(delta(4)), AskTrainer(KEYFRAME)]
    assert f.offer(delta(4), 0.3).kind == "ignored"
    f.state_lost(0.4)
    assert f.version == -1 and f.poll(0.4) == [AskTrainer(KEYFRAME)]


def test_offers_that_cannot_be_followed_are_ignored_or_stop() -> None:
    f = follower(3)
    assert f.offer(delta(5, run="other"), 0.0).kind == "ignored"
    assert f.offer(delta(5, codec="zz"), 0.0).kind == "ignored"
    assert f.offer(delta(3), 0.0).kind == "ignored"
    assert f.offer(keyframe(3), 0.0).kind == "held"           # seed it from the state
    assert f.offer(delta(3 + 65), 0.0).kind == "ignored"      # past max_pending
    assert f.offer(keyframe(8, layout=b"o" * 32), 0.0).kind == "ignored"
    out = f.poll(0.0)
    assert len(out) == 1 and isinstance(out[0], Stop) and "another model" in out[0].reason
    assert f.wake_at() is None


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        FollowConfig(stall=0)
    with pytest.raises(ValueError):
        FollowConfig(max_pending=0)


# ------------------------------------------------------------------------- state machine

KEEP = 4
STALL = 5.0


@dataclass
class World:
    """The trainer, the swarm's seeders and the lossy paths to one peer."""

    head: int = 0
    sizes: dict[int, int] = field(default_factory=dict)
    replies: list[list[SignedManifest]] = field(default_factory=list)

    def kept(self) -> list[SignedManifest]:
        first = max(1, self.head - KEEP + 1)
        return [keyframe(0)] * (first == 1) + [delta(s, self.sizes[s])
                                               for s in range(first, self.head + 1)]

    def available(self, sm: SignedManifest) -> bool:
        m = sm.manifest
        if m.kind == "keyframe":
            return m.step == self.head
        return m.step > self.head - KEEP

    def answer(self, after: int) -> list[SignedManifest]:
        kind, chain = catch_up_reply(after, self.kept(), STATE_BYTES)
        if kind == "keyframe":
            return [keyframe(self.head)]
        return chain


class FollowMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(50, 400), min_size=3, max_size=3))
    def start(self, sizes: list[int]) -> None:
        self.world = World()
        for s in sizes:
            self.world.head += 1
            self.world.sizes[self.world.head] = s
        self.now = 0.0
        self.f = follower(-1, stall=STALL)
        self.fetched_bytes = 0
        self.installing: SignedManifest | None = None
        self.fetching: SignedManifest | None = None
        self.lose_replies = True

    def _act(self) -> None:
        for a in self.f.poll(self.now):
            if isinstance(a, Fetch):
                self.fetching = a.manifest
            elif isinstance(a, Drop):
                if self.fetching is not None and self.fetching.id == a.manifest.id:
                    self.fetching = None
            elif isinstance(a, AskTrainer):
                self.world.replies.append(self.world.answer(a.after))
            elif isinstance(a, Install):
                self.installing = a.manifest
            else:
                raise AssertionError(f"unexpected {a}")

    def _progress(self) -> None:
        sm = self.fetching
        if sm is not None and self.installing is None and self.world.available(sm):
            self.f.chunk_arrived(sm, self.now)
            self.f.fetched(sm, self.now)
            self.fetched_bytes += sm.manifest.total_bytes
            self.fetching = None
        self._act()
        if self.installing is not None:
            sm, self.installing = self.installing, None
            self.f.installed(sm, sm.manifest.target_root, self.now)
            self._act()

    @rule(size=st.integers(50, 400), announce=st.booleans())
    def publish(self, size: int, announce: bool) -> None:
        self.world.head += 1
        self.world.sizes[self.world.head] = size
        if announce:
            self.f.offer(delta(self.world.head, size), self.now)
        self._act()

    @rule(deliver=st.booleans())
    def sync_reply(self, deliver: bool) -> None:
        if self.world.replies:
            reply = self.world.replies.pop(0)
            if deliver or not self.lose_replies:
                for sm in reply:
                    self.f.offer(sm, self.now)
        self._act()

    @rule(dt=st.floats(0.01, 3 * STALL))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._progress()

    @rule()
    def restart(self) -> None:
        """The peer process restarts on its saved state (the fetch in flight is lost)."""
        v = self.f.version
        self.f = follower(v, stall=STALL)
        self.fetching = self.installing = None
        self.world.replies.clear()
        self._act()

    @rule()
    def claim_refused(self) -> None:
        """A claim naming an old version is refused: the trainer has a newer one."""
        if self.f.version < self.world.head:
            self.f.behind(self.f.version + 1, self.now)
        self._act()

    @rule()
    def reconnect(self) -> None:
        self.f.trainer_connected(self.now)
        self._act()

    @invariant()
    def never_ahead_of_the_trainer(self) -> None:
        assert self.f.version <= self.world.head

    def teardown(self) -> None:
        """No more versions, no more losses: the head is reached in bounded time, by no
        more bytes than the cheapest route plus one object."""
        if not hasattr(self, "f"):
            return
        self.lose_replies = False
        v = self.f.version
        head = self.world.head
        chain = sum(self.world.sizes[s] for s in range(v + 1, head + 1)) if v >= 0 else None
        cheapest = STATE_BYTES if chain is None or v < head - KEEP else min(chain, STATE_BYTES)
        start = self.fetched_bytes
        for _ in range(400):
            if self.f.version == head:
                break
            # The peer claims work again and again; while it is behind, each claim is
            # refused, which tells it (a reply it waited for may have been answered
            # before the newest step, as announcements can all be lost).
            self.claim_refused()
            self.sync_reply(True)
            wake = self.f.wake_at()
            self.now = max(self.now + 0.01, wake if wake is not None else self.now)
            self._progress()
        assert self.f.version == head, f"stalled at {self.f.version} of {head}"
        assert self.fetched_bytes - start <= cheapest + STATE_BYTES


TestFollowMachine = FollowMachine.TestCase
TestFollowMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     derandomize=True)
