"""Gossip topics of a run, their signed payloads and validators, and their limits.

Topic names (``<run>`` is the run name the trainer announces; at most 64 characters of
``[A-Za-z0-9._-]``):

==================================  ==========================================  =========
topic                               payload                                     signer
==================================  ==========================================  =========
``/swarm/<run>/manifests/1``        ``SignedManifest.encode()``                 trainer
``/swarm/<run>/have/1``             :class:`SignedEnvelope` (have summary)      publisher
``/swarm/<run>/peers/1``            :class:`SignedEnvelope` of PeerMetadata     publisher
``/swarm/<run>/leases/1``           :class:`SignedEnvelope` (grant or result)   publisher
==================================  ==========================================  =========

Every topic runs gossipsub with strict signing (libp2p signs each message with the
publisher's key, which is also its swarm identity), and a validator that runs before a
message is delivered or forwarded, so a message failing it never propagates:

- manifests: ``SignedManifest.decode(data, trusted_signer=<trainer key named at start>)``
  must succeed; any other signer, a bad signature, or malformed bytes are dropped (the
  first :data:`MAX_OTHER_SIGNERS` other signers of validly signed manifests are noted in
  :class:`OtherSigners`, for a warning about a wrong trainer id to name them);
- have / peers / leases: the envelope's signature must verify *and* its signer must be
  the libp2p source of the message (no relaying someone else's claims under your name),
  within the topic's size bound (have summaries :data:`MAX_HAVE_BYTES`, lease envelopes
  :data:`MAX_LEASE_BYTES`, peer metadata 4 KiB of body); lease grants are additionally
  checked against the trainer key by the lease layer.

:func:`validator_for` gives the validator of each topic that needs no trainer key; a
node that subscribes to one of its run's topics without a validator gets it
(:meth:`swarm.net.node.Libp2pNode.subscribe`). A rejected message costs the peer that
forwarded it a score penalty; repeated offences disconnect and blacklist it.

Limits (defaults of :class:`swarm.net.node.GossipConfig`): messages up to 1 MiB
(manifests of ~16k chunks); 1000 messages per second per topic per peer before
gossipsub's spam protection drops; per-peer outbound queues of 4096 RPCs; subscription
queues of 1024 messages (beyond that the newest are dropped and logged at WARNING);
mesh degree 6 (4..12), heartbeat 1 s; a node does not receive its own publications.
py-libp2p's own 32-deep subscription channel is drained by a dedicated task.

Measured on loopback (5 nodes: a bootstrap and 4 joiners, one of them publishing, on a
loaded 2-core machine): py-libp2p's defaults (32-deep outbound queues, 10 messages per
second per topic per peer) delivered 10 of a 300-message burst of 1 KiB; these settings
delivered 1000 of 1000 (1 KiB) and 100 of 100 (256 KiB) to every receiver. Publishing
runs at about 150 messages per second (1 KiB) through the trio bridge, and end-to-end
relay through the bootstrap node at about 40 messages per second per receiver, ample for
manifests (one per step), have summaries and lease traffic, not for bulk data.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from swarm.content.manifest import SignedManifest
from swarm.errors import DecodeError, RemoteProtocolError, SignatureError
from swarm.identity import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    Identity,
    peer_id_from_public_key,
    sign_message,
    signing_domain,
    verify_message,
)
from swarm.wire import strict

logger = logging.getLogger(__name__)

MAX_GOSSIP_BYTES = 1 << 20
#: The largest have-summary envelope (a bitmap of 16k chunks is 2 KiB; ids and framing).
MAX_HAVE_BYTES = 64 << 10
#: The largest lease envelope on gossip (grants and results; bulk data is not gossip).
MAX_LEASE_BYTES = MAX_GOSSIP_BYTES
MAX_RUN_NAME = 64
_RUN_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_META_KEYS = frozenset({"v", "addrs", "data", "region", "bw", "time"})
_META_RELAY_KEYS = _META_KEYS | {"relay"}
MAX_ADDRS = 8
MAX_ADDR_LEN = 200
#: Other signers a node notes having seen (see :class:`OtherSigners`).
MAX_OTHER_SIGNERS = 8


def _check_run(run: str) -> str:
    if not _RUN_RE.match(run):
        raise ValueError(f"run name {run!r} must be 1-64 characters of [A-Za-z0-9._-]")
    return run


def manifests(run: str) -> str:
    return f"/swarm/{_check_run(run)}/manifests/1"


def have(run: str) -> str:
    return f"/swarm/{_check_run(run)}/have/1"


def peers(run: str) -> str:
    return f"/swarm/{_check_run(run)}/peers/1"


def leases(run: str) -> str:
    return f"/swarm/{_check_run(run)}/leases/1"


@dataclass(frozen=True, slots=True)
class SignedEnvelope:
    """``msgpack([body, signer, signature])``; the signature is Ed25519 over
    ``"swarm/gossip/v1\\0" + topic + "\\0" + body`` so a message cannot be replayed on
    another topic."""

    topic: str
    body: bytes
    signer: bytes
    signature: bytes

    @property
    def signer_peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)

    @classmethod
    def seal(cls, identity: Identity, topic: str, body: bytes) -> SignedEnvelope:
        sig = sign_message(identity, signing_domain("gossip", 1, topic), body)
        return cls(topic, body, identity.public_key, sig)

    def encode(self) -> bytes:
        return strict.pack([self.body, self.signer, self.signature])

    @classmethod
    def open(cls, topic: str, data: bytes, *, max_bytes: int = MAX_GOSSIP_BYTES
             ) -> SignedEnvelope:
        """Decode and verify.

        :raises DecodeError: malformed or oversized.
        :raises SignatureError: the signature does not verify.
        """
        obj = strict.unpack(data, max_bytes=max_bytes, max_bin=max_bytes, max_array=3,
                            max_map=0, max_str=0)
        if type(obj) is not list or len(obj) != 3 or not all(type(x) is bytes for x in obj):
            raise DecodeError("envelope: expected [body, signer, signature] as bytes")
        body, signer, sig = obj
        if len(signer) != PUBLIC_KEY_LEN or len(sig) != SIGNATURE_LEN:
            raise DecodeError("envelope: bad signer or signature length")
        verify_message(signer, sig, signing_domain("gossip", 1, topic), body)
        return cls(topic, body, signer, sig)


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """What a node says about itself on the peers topic (inside a signed envelope).

    ``addrs`` are its libp2p multiaddrs; ``data_addr`` its data-plane ``host:port``
    (empty when it has none); ``region`` a free label; ``bandwidth`` its measured
    uplink in bytes per second (0 when unknown); ``time_ms`` when it was made;
    ``relay`` the ``host:port`` of the relay service it runs (:mod:`swarm.net.relay`;
    empty, and then not encoded, when it runs none).
    """

    addrs: tuple[str, ...]
    data_addr: str = ""
    region: str = ""
    bandwidth: int = 0
    time_ms: int = 0
    relay: str = ""

    def encode(self) -> bytes:
        m: dict[str, object] = {"v": 1, "addrs": list(self.addrs), "data": self.data_addr,
                                "region": self.region, "bw": self.bandwidth,
                                "time": self.time_ms}
        if self.relay:
            m["relay"] = self.relay
        return strict.pack(m)

    @classmethod
    def decode(cls, body: bytes) -> PeerMetadata:
        """:raises DecodeError: malformed, wrong types, over bounds."""
        obj = strict.unpack(body, max_bytes=4096, max_str=MAX_ADDR_LEN, max_array=MAX_ADDRS,
                            max_map=8)
        m = strict.as_map(obj, _META_RELAY_KEYS if isinstance(obj, dict) and "relay" in obj
                          else _META_KEYS, "peer metadata")
        strict.get_int(m, "v", 1, 1)
        addrs = strict.get_list(m, "addrs", MAX_ADDRS)
        if not all(type(a) is str and len(a) <= MAX_ADDR_LEN for a in addrs):
            raise DecodeError("peer metadata: addrs are strings")
        return cls(tuple(addrs), strict.get_str(m, "data", MAX_ADDR_LEN),
                   strict.get_str(m, "region", 64), strict.get_int(m, "bw", 0, 1 << 62),
                   strict.get_int(m, "time", 0, 1 << 62),
                   strict.get_str(m, "relay", MAX_ADDR_LEN) if "relay" in m else "")


class OtherSigners:
    """Peer ids of the keys, other than the one trusted, that validly signed a manifest
    or run card this node was sent: the first ``limit`` distinct ones, in order seen (a
    peer given the wrong ``--trainer`` says whose it saw). An id is added only once its
    signature verified, so a forger cannot put names in the warning."""

    def __init__(self, limit: int = MAX_OTHER_SIGNERS) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}

    @property
    def ids(self) -> list[str]:
        return list(self._ids)

    def wants(self, peer_id: str) -> bool:
        """Whether ``peer_id`` would be added (new, and room left): check this before
        verifying a signature for it."""
        return peer_id not in self._ids and len(self._ids) < self.limit

    def add(self, peer_id: str) -> None:
        if self.wants(peer_id):
            self._ids[peer_id] = None


def manifest_validator(trusted_signer: bytes, *, others: OtherSigners | None = None
                       ) -> Callable[[str, bytes], bool]:
    """Accept only manifests signed by ``trusted_signer`` (the trainer's public key);
    note in ``others`` who signed the valid manifests of other keys."""

    def validate(source: str, data: bytes) -> bool:
        try:
            SignedManifest.decode(data, trusted_signer=trusted_signer)
        except RemoteProtocolError as exc:
            logger.info("dropped manifest gossip from %s: %s", source, exc)
            if others is not None and isinstance(exc, SignatureError):
                _note_signer(data, trusted_signer, others)
            return False
        return True

    return validate


def _note_signer(data: bytes, trusted_signer: bytes, others: OtherSigners) -> None:
    """Add the signer of manifest ``data`` to ``others`` if it is another key than
    ``trusted_signer`` and its signature verifies (a signature check only for a signer
    not noted yet, while ``others`` has room)."""
    try:
        sm = SignedManifest.decode(data, check_signature=False)
    except RemoteProtocolError:
        return
    signer = sm.manifest.signer_peer_id
    if sm.manifest.signer != trusted_signer and others.wants(signer) and sm.verify():
        others.add(signer)


def envelope_validator(topic: str, *, allowed_signers: frozenset[bytes] | None = None,
                       max_bytes: int = MAX_GOSSIP_BYTES) -> Callable[[str, bytes], bool]:
    """Accept envelopes of at most ``max_bytes`` signed by their libp2p source (and in
    ``allowed_signers``)."""

    def validate(source: str, data: bytes) -> bool:
        if len(data) > max_bytes:
            logger.info("dropped gossip on %s from %s: %d bytes is over %d", topic, source,
                        len(data), max_bytes)
            return False
        try:
            env = SignedEnvelope.open(topic, data, max_bytes=max_bytes)
        except (DecodeError, SignatureError) as exc:
            logger.info("dropped gossip on %s from %s: %s", topic, source, exc)
            return False
        if env.signer_peer_id != source:
            logger.info("dropped gossip on %s: signed by %s but published by %s", topic,
                        env.signer_peer_id, source)
            return False
        if allowed_signers is not None and env.signer not in allowed_signers:
            logger.info("dropped gossip on %s from unexpected signer %s", topic, source)
            return False
        return True

    return validate


def peer_metadata_validator(topic: str) -> Callable[[str, bytes], bool]:
    """Envelope check plus a strict decode of the metadata body."""
    base = envelope_validator(topic)

    def validate(source: str, data: bytes) -> bool:
        if not base(source, data):
            return False
        try:
            PeerMetadata.decode(SignedEnvelope.open(topic, data).body)
        except DecodeError as exc:
            logger.info("dropped peer metadata from %s: %s", source, exc)
            return False
        return True

    return validate


def have_validator(topic: str, *, max_bytes: int = MAX_HAVE_BYTES
                   ) -> Callable[[str, bytes], bool]:
    """Have summaries: an envelope signed by its publisher, at most ``max_bytes``."""
    return envelope_validator(topic, max_bytes=max_bytes)


def lease_validator(topic: str, *, max_bytes: int = MAX_LEASE_BYTES
                    ) -> Callable[[str, bytes], bool]:
    """Lease traffic: an envelope signed by its publisher (a grant's signer is checked
    against the trainer key by the lease layer), at most ``max_bytes``."""
    return envelope_validator(topic, max_bytes=max_bytes)


_TOPIC_RE = re.compile(r"^/swarm/([A-Za-z0-9._-]{1,64})/(manifests|have|peers|leases)/1$")


def run_topic(topic: str) -> tuple[str, str] | None:
    """``(run, kind)`` of a run topic (kind: manifests, have, peers or leases), else None."""
    m = _TOPIC_RE.match(topic)
    return (m.group(1), m.group(2)) if m else None


def validator_for(topic: str) -> Callable[[str, bytes], bool] | None:
    """The validator of a run's have, peers or leases topic; None for other topics and
    for manifests (those need the trainer key: :func:`manifest_validator`)."""
    parsed = run_topic(topic)
    if parsed is None:
        return None
    kind = parsed[1]
    if kind == "have":
        return have_validator(topic)
    if kind == "peers":
        return peer_metadata_validator(topic)
    if kind == "leases":
        return lease_validator(topic)
    return None


def reject_all(topic: str) -> Callable[[str, bytes], bool]:
    """A validator that drops everything (a relay that cannot check a topic must not
    forward it)."""

    def validate(source: str, data: bytes) -> bool:
        logger.info("dropped gossip on %s from %s: this node cannot validate it", topic,
                    source)
        return False

    return validate
