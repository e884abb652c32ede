"""Gossip topics: names, signed envelopes, validators, peer metadata."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.content.manifest import Manifest
from swarm.errors import DecodeError, SignatureError
from swarm.identity import Identity
from swarm.net import topics
from swarm.net.memory import MemoryNetwork
from swarm.net.transport import Gossip
from swarm.wire import strict

TRAINER = Identity.from_seed(bytes([7]) * 32)
PEER = Identity.from_seed(bytes([8]) * 32)


def signed_manifest(signer: Identity) -> bytes:
    m = Manifest(run="r", step=3, kind="keyframe", base_root=None, target_root=bytes(32),
                 layout_digest=bytes(32), codec="raw", piece_size=1 << 20,
                 chunks=((bytes(32), 10),))
    return m.sign(signer).encode()


def test_topic_names_are_per_run_and_checked() -> None:
    assert topics.manifests("run-1") == "/swarm/run-1/manifests/1"
    assert {topics.have("a"), topics.peers("a"), topics.leases("a")} == {
        "/swarm/a/have/1", "/swarm/a/peers/1", "/swarm/a/leases/1"}
    with pytest.raises(ValueError):
        topics.manifests("bad/run")


def test_manifest_validator_accepts_only_the_trainer() -> None:
    ok = topics.manifest_validator(TRAINER.public_key)
    assert ok(TRAINER.peer_id, signed_manifest(TRAINER))
    assert ok(PEER.peer_id, signed_manifest(TRAINER))  # relayed by anyone: still the trainer's
    assert not ok(PEER.peer_id, signed_manifest(PEER))
    broken = bytearray(signed_manifest(TRAINER))
    broken[-1] ^= 1
    assert not ok(TRAINER.peer_id, bytes(broken))
    assert not ok(TRAINER.peer_id, b"\xc1garbage")


def test_the_manifest_validator_notes_other_signers_whose_signature_holds() -> None:
    others = topics.OtherSigners(limit=2)
    ok = topics.manifest_validator(TRAINER.public_key, others=others)
    assert ok(TRAINER.peer_id, signed_manifest(TRAINER)) and others.ids == []
    assert not ok(PEER.peer_id, signed_manifest(PEER))
    assert not ok(TRAINER.peer_id, signed_manifest(PEER))  # the same signer, once
    forged = bytearray(signed_manifest(Identity.from_seed(bytes([9]) * 32)))
    forged[-1] ^= 1  # a bad signature names no one
    assert not ok(PEER.peer_id, bytes(forged))
    assert not ok(PEER.peer_id, b"\xc1garbage")
    assert others.ids == [PEER.peer_id]
    for seed in (10, 11, 12):  # bounded: the first `limit` signers
        assert not ok(PEER.peer_id, signed_manifest(Identity.from_seed(bytes([seed]) * 32)))
    assert others.ids == [PEER.peer_id, Identity.from_seed(bytes([10]) * 32).peer_id]


def test_envelopes_bind_signer_topic_and_body() -> None:
    topic = topics.have("r")
    env = topics.SignedEnvelope.seal(PEER, topic, b"have: 1,2,3")
    data = env.encode()
    assert topics.SignedEnvelope.open(topic, data) == env
    with pytest.raises(SignatureError):
        topics.SignedEnvelope.open(topics.leases("r"), data)  # replayed on another topic
    body, signer, sig = strict.unpack(data, max_bytes=1 << 20)
    with pytest.raises(SignatureError):
        topics.SignedEnvelope.open(topic, strict.pack([body + b"!", signer, sig]))
    with pytest.raises(DecodeError):
        topics.SignedEnvelope.open(topic, strict.pack([body, signer]))


def test_envelope_validator_requires_the_publisher_to_be_the_signer() -> None:
    topic = topics.leases("r")
    check = topics.envelope_validator(topic)
    data = topics.SignedEnvelope.seal(PEER, topic, b"result").encode()
    assert check(PEER.peer_id, data)
    assert not check(TRAINER.peer_id, data)  # someone else's claim under their own name
    only_trainer = topics.envelope_validator(topic, allowed_signers=frozenset(
        {TRAINER.public_key}))
    assert not only_trainer(PEER.peer_id, data)


def test_peer_metadata_roundtrip_and_strict_decoding() -> None:
    meta = topics.PeerMetadata(("/ip4/127.0.0.1/tcp/1/p2p/" + PEER.peer_id,),
                               "127.0.0.1:2", "eu-west", 125_000_000, 5)
    assert topics.PeerMetadata.decode(meta.encode()) == meta
    bad = strict.pack({"v": 1, "addrs": [1], "data": "", "region": "", "bw": 0, "time": 0})
    with pytest.raises(DecodeError):
        topics.PeerMetadata.decode(bad)
    extra = strict.pack({"v": 1, "addrs": [], "data": "", "region": "", "bw": 0, "time": 0,
                         "x": 1})
    with pytest.raises(DecodeError):
        topics.PeerMetadata.decode(extra)
    topic = topics.peers("r")
    check = topics.peer_metadata_validator(topic)
    assert check(PEER.peer_id, topics.SignedEnvelope.seal(PEER, topic, meta.encode()).encode())
    assert not check(PEER.peer_id, topics.SignedEnvelope.seal(PEER, topic, bad).encode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzzed_envelopes_fail_cleanly(data: bytes) -> None:
    with pytest.raises((DecodeError, SignatureError)):
        topics.SignedEnvelope.open("t", data)
    assert not topics.envelope_validator("t")(PEER.peer_id, data)


async def test_forged_lease_traffic_is_dropped_on_the_memory_network() -> None:
    net = MemoryNetwork()
    topic = topics.leases("r")
    async with net.transport(TRAINER) as trainer, net.transport(PEER) as peer:
        assert isinstance(trainer, Gossip)
        async with await trainer.subscribe(topic, topics.envelope_validator(topic)) as sub:
            forged = topics.SignedEnvelope.seal(TRAINER, topic, b"grant to myself").encode()
            await peer.publish(topic, forged)  # signed by the trainer key, sent by peer
            honest = topics.SignedEnvelope.seal(PEER, topic, b"result").encode()
            await peer.publish(topic, honest)
            msg = await sub.get()
            assert msg.data == honest
            assert sub.queue.empty()
