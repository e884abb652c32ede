"""Hostile gossip on real py-libp2p hosts on loopback, and a real ``swarm bootstrap``.

- a bootstrap started with ``--trainer`` relays the trainer's manifests and nothing else
  published there (garbage, a genuine manifest with a byte flipped);
- without ``--trainer`` it relays no manifests, and peers still find each other;
- the peer that forwards invalid gossip is scored down, and disconnected and blacklisted
  after repeated offences;
- the heartbeat stays at the configured interval (adaptive gossip off) and a newcomer
  is handed only messages younger than the configured bound;
- SIGTERM ends the bootstrap with status 130 and no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from swarmproc import SwarmProc
from test_net_libp2p import ident, manifest

from swarm.net import topics
from swarm.net.gossip import GossipConfig
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.net.transport import TransportClosed

pytestmark = pytest.mark.timeout(120)

RUN = "r1"


def joiner(addr: str, **kw: object) -> NodeConfig:
    return NodeConfig(run=RUN, bootstrap=(addr,), data_plane=None, metadata_interval=0.5,
                      **kw)  # type: ignore[arg-type]


@contextlib.contextmanager
def bootstrap_proc(tmp_path: Path, *extra: str) -> Iterator[tuple[SwarmProc, str]]:
    p = SwarmProc("bootstrap", ["bootstrap", "--data-dir", str(tmp_path / "boot"),
                                "--listen", "/ip4/127.0.0.1/tcp/0", "--run", RUN, *extra],
                  tmp_path)
    try:
        ready = p.wait_event("ready", 60)
        yield p, str(ready["addr"])
    finally:
        p.stop()
    err = p._stderr_path.read_text(errors="replace")
    assert "Traceback" not in err, err[-3000:]


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def flipped(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 1
    return bytes(b)


async def test_bootstrap_with_trainer_relays_only_genuine_manifests(tmp_path: Path) -> None:
    trainer, attacker_id = ident(40), ident(41)
    with bootstrap_proc(tmp_path, "--trainer", trainer.peer_id) as (boot, addr):
        assert boot.of("ready")[0]["relays"] == ["peers", "manifests", "leases"]
        boot_id = addr.rsplit("/", 1)[1]
        topic = topics.manifests(RUN)
        async with contextlib.AsyncExitStack() as stack:
            receiver = await stack.enter_async_context(Libp2pNode(ident(42), joiner(addr)))
            sub = await stack.enter_async_context(await receiver.subscribe(
                topic, topics.manifest_validator(trainer.public_key)))
            attacker = await stack.enter_async_context(Libp2pNode(attacker_id, joiner(addr)))
            tnode = await stack.enter_async_context(Libp2pNode(trainer, joiner(addr)))
            for n in (attacker, tnode):  # they publish without subscribing (fanout)
                await n.wait_for_mesh(topic, 1, timeout=20)
            await receiver.wait_for_mesh(topic, 1, timeout=20)

            genuine = manifest(1, trainer)
            await attacker.publish(topic, b"\x93garbage")
            await attacker.publish(topic, flipped(genuine, len(genuine) // 2))
            await tnode.publish(topic, genuine)
            msg = await asyncio.wait_for(sub.get(), 15)
            assert msg.data == genuine and msg.source == trainer.peer_id
            await asyncio.sleep(1.0)
            assert sub.queue.empty()
            # The forgeries never reached the receiver (its own validator saw none), and
            # the honest relay was not scored down.
            assert sub.rejected == 0 and receiver.score(boot_id) == 0.0
            assert boot_id in attacker.connected_peers()

            # A third offence: the bootstrap disconnects the attacker.
            await attacker.publish(topic, flipped(genuine, 10))
            await wait_until(lambda: boot_id not in attacker.connected_peers(), 15,
                             "the bootstrap did not disconnect the attacker")
            await tnode.publish(topic, manifest(2, trainer))
            msg = await asyncio.wait_for(sub.get(), 15)
            assert msg.data == manifest(2, trainer)


async def test_bootstrap_without_trainer_relays_no_manifests_but_peers_meet(
        tmp_path: Path) -> None:
    trainer = ident(50)
    with bootstrap_proc(tmp_path) as (boot, addr):
        assert boot.of("ready")[0]["relays"] == ["peers"]
        topic = topics.manifests(RUN)
        async with contextlib.AsyncExitStack() as stack:
            a = await stack.enter_async_context(Libp2pNode(ident(51), joiner(addr)))
            sub = await stack.enter_async_context(await a.subscribe(
                topic, topics.manifest_validator(trainer.public_key)))
            tnode = await stack.enter_async_context(Libp2pNode(trainer, joiner(addr)))
            # Peers learn each other through the bootstrap's (validated) peers topic.
            await wait_until(lambda: a.peer_id in tnode.directory()
                             and tnode.peer_id in a.directory(), 20,
                             "peer metadata did not propagate through the bootstrap")
            assert a.peer_id not in tnode.connected_peers()
            await tnode.publish(topic, manifest(1, trainer))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sub.get(), 3)
            # ... and can then meet directly, where manifests do flow.
            await tnode.connect(tnode.directory()[a.peer_id].addrs[0])
            await tnode.wait_for_mesh(topic, 1, timeout=20)
            await tnode.publish(topic, manifest(2, trainer))
            assert (await asyncio.wait_for(sub.get(), 15)).data == manifest(2, trainer)


async def test_sender_of_invalid_gossip_is_scored_then_disconnected() -> None:
    victim_id, bad_id, other = ident(60), ident(61), ident(62)
    topic = topics.have(RUN)
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(
            Libp2pNode(victim_id, NodeConfig(run=RUN, data_plane=None)))
        # No validator given: the run's have topic gets topics.have_validator.
        sub = await stack.enter_async_context(await victim.subscribe(topic))
        bad = await stack.enter_async_context(
            Libp2pNode(bad_id, NodeConfig(data_plane=None, bootstrap=victim.listen_addresses)))
        await bad.wait_for_mesh(topic, 1)
        penalty = victim.config.scores.penalty
        honest = topics.SignedEnvelope.seal(bad_id, topic, b"have v1").encode()
        await bad.publish(topic, honest)
        assert (await asyncio.wait_for(sub.get(), 10)).data == honest
        offences = [
            b"not an envelope",
            topics.SignedEnvelope.seal(other, topic, b"someone else's claim").encode(),
            topics.SignedEnvelope.seal(bad_id, topic, b"x" * (topics.MAX_HAVE_BYTES + 1)
                                       ).encode(),
        ]
        for i, data in enumerate(offences[:2], 1):
            await bad.publish(topic, data)
            await wait_until(lambda i=i: victim.score(bad_id.peer_id) <= -penalty * i, 10,
                             f"offence {i} was not scored")
        assert bad_id.peer_id in victim.connected_peers()
        await bad.publish(topic, offences[2])
        await wait_until(lambda: bad_id.peer_id not in victim.connected_peers()
                         and victim_id.peer_id not in bad.connected_peers(), 10,
                         "the offender was not disconnected")
        pubsub = victim._gossip.pubsub
        assert pubsub is not None
        from swarm.net import libp2p_compat as compat
        assert pubsub.is_peer_blacklisted(compat.id_from_str(bad_id.peer_id))
        assert victim._gossip.invalid_from[bad_id.peer_id] == 3
        assert sub.queue.empty()
        # A banned peer cannot come back.
        with contextlib.suppress(Exception):
            await bad.connect(victim.listen_addresses[0])
        await asyncio.sleep(1.0)
        assert bad_id.peer_id not in victim.connected_peers()


async def test_heartbeat_is_fixed_and_newcomers_get_only_recent_messages() -> None:
    cfg = GossipConfig()
    assert cfg.max_replay_age == cfg.gossip_history * cfg.heartbeat_interval == 5.0
    topic = topics.have(RUN)
    pub_id = ident(70)
    async with contextlib.AsyncExitStack() as stack:
        relay = await stack.enter_async_context(
            Libp2pNode(ident(71), NodeConfig(run=RUN, data_plane=None)))
        router = relay._gossip.pubsub.router if relay._gossip.pubsub else None
        assert router is not None
        assert router.adaptive_gossip_enabled is False
        assert router.heartbeat_interval == cfg.heartbeat_interval == 1
        assert (router.mcache.window_size, router.mcache.history_size) == (3, 5)
        assert router._pending_messages_ttl == cfg.max_replay_age
        await stack.enter_async_context(await relay.subscribe(topic))
        pub = await stack.enter_async_context(Libp2pNode(
            pub_id, NodeConfig(data_plane=None, bootstrap=relay.listen_addresses)))
        await pub.wait_for_mesh(topic, 1)

        n, spacing = 40, 0.2  # 8 s of messages, each stamped with its publication time
        for i in range(n):
            body = struct.pack(">Id", i, time.time())
            await pub.publish(topic, topics.SignedEnvelope.seal(pub_id, topic, body).encode())
            await asyncio.sleep(spacing)
        assert router.heartbeat_interval == 1  # several heartbeats later, unchanged

        newcomer = await stack.enter_async_context(Libp2pNode(
            ident(72), NodeConfig(run=RUN, data_plane=None,
                                  bootstrap=relay.listen_addresses)))
        joined = time.time()
        sub = await stack.enter_async_context(await newcomer.subscribe(topic))
        got: list[tuple[int, float]] = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(4):
                while True:
                    m = await sub.get()
                    env = topics.SignedEnvelope.open(topic, m.data)
                    i, sent = struct.unpack(">Id", env.body)
                    got.append((i, joined - sent))
        ages = [age for _, age in got]
        print(f"newcomer got {len(got)} of {n} old messages; ages {min(ages, default=0):.2f}"
              f"..{max(ages, default=0):.2f} s (bound {cfg.max_replay_age} s)")
        assert max(ages, default=0.0) <= cfg.max_replay_age + 1.0
        assert len(got) <= int((cfg.max_replay_age + 1.0) / spacing)


async def test_sigterm_ends_the_bootstrap_cleanly(tmp_path: Path) -> None:
    """Messages sent straight to a bootstrap (which nobody reads there) no longer leave a
    paused reader whose wake-up raised ``trio.RunFinishedError`` at shutdown."""
    p = SwarmProc("bootstrap", ["bootstrap", "--data-dir", str(tmp_path / "boot"),
                                "--listen", "/ip4/127.0.0.1/tcp/0", "--run", RUN], tmp_path)
    try:
        addr = str(p.wait_event("ready", 60)["addr"])
        async with Libp2pNode(ident(80), NodeConfig(data_plane=None, bootstrap=(addr,))) as n:
            boot_id = addr.rsplit("/", 1)[1]
            with contextlib.suppress(TransportClosed, asyncio.TimeoutError):
                async with asyncio.timeout(10):
                    for _ in range(600):
                        await n.send(boot_id, b"x" * 1024)
            p.signal(signal.SIGTERM)
            rc = await asyncio.to_thread(p.wait_exit, 20)
    finally:
        p.stop()
    err = p._stderr_path.read_text(errors="replace")
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "RunFinishedError" not in err, err[-3000:]


async def test_closing_a_node_with_paused_readers_is_clean() -> None:
    """A reader paused on a full inbox is woken by ``Inbox.close`` after the trio run
    ended; that wake-up must not raise (it raised ``trio.RunFinishedError``)."""
    a = Libp2pNode(ident(90), NodeConfig(data_plane=None, inbox_depth=8))
    async with a:
        async with Libp2pNode(ident(91), NodeConfig(
                data_plane=None, bootstrap=a.listen_addresses)) as b:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    for _ in range(100):
                        await b.send(a.peer_id, b"x" * 1024)
            assert a._inbox._resume, "no reader paused on the full inbox"
        # a is the trio guest run's last user: closing it ends the run, then its inbox.
        await a.aclose()  # raised trio.RunFinishedError from Inbox.close
