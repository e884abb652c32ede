"""The peer directory of a libp2p node: what it says about itself, and what it learns.

A node's signed :class:`~swarm.net.topics.PeerMetadata` (listen addresses, data-plane
``host:port``, region, measured bandwidth) is served on request on
:data:`META_PROTOCOL` and, when the node is in a run, published on the run's peers
topic every ``interval`` seconds. :class:`PeerDirectory` keeps the latest metadata of
each peer heard on that topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from swarm.errors import SignatureError
from swarm.identity import Identity
from swarm.net import topics
from swarm.net.bridge import BridgeClosed
from swarm.net.transport import Subscription, TransportClosed

if TYPE_CHECKING:
    from libp2p.abc import INetStream

logger = logging.getLogger(__name__)

META_PROTOCOL = "/swarm/meta/1.0.0"
MAX_META_BYTES = 4096
#: Peers remembered from the peers topic (metadata of newcomers beyond it is ignored).
MAX_DIRECTORY = 100_000


class PeerDirectory:
    """This node's metadata and the latest metadata of each peer on the peers topic.

    ``addresses`` and ``data_address`` tell the node's libp2p listen addresses and its
    data plane's (host, port), read each time the metadata is sealed.
    """

    def __init__(self, identity: Identity, *, region: str, advertise: str,
                 addresses: Callable[[], tuple[str, ...]],
                 data_address: Callable[[], tuple[str, int] | None],
                 relay: Callable[[], str] = lambda: "") -> None:
        self.identity = identity
        self._advertise = advertise
        self._addresses = addresses
        self._data_address = data_address
        self._relay = relay
        self._region = region
        self._bandwidth = 0
        self._meta_bytes = b""
        self._peers: dict[str, topics.PeerMetadata] = {}

    def metadata(self) -> topics.PeerMetadata:
        data = self._advertise
        if not data and (address := self._data_address()) is not None:
            data = f"{address[0]}:{address[1]}"
        return topics.PeerMetadata(self._addresses(), data, self._region, self._bandwidth,
                                   int(time.time() * 1000), self._relay())

    def update(self, *, bandwidth: int | None = None, region: str | None = None) -> None:
        """Change the measured uplink (bytes per second) or the region label."""
        if bandwidth is not None:
            if not 0 <= bandwidth < 1 << 62:
                raise ValueError("bandwidth out of range")
            self._bandwidth = bandwidth
        if region is not None:
            if len(region) > 64:
                raise ValueError("region labels are at most 64 characters")
            self._region = region

    def seal(self) -> None:
        """Sign the current metadata for :meth:`serve`."""
        self._meta_bytes = self.signed(META_PROTOCOL)

    def signed(self, topic: str) -> bytes:
        return topics.SignedEnvelope.seal(self.identity, topic, self.metadata().encode()
                                          ).encode()

    async def serve(self, stream: INetStream) -> None:
        """The :data:`META_PROTOCOL` stream handler (trio)."""
        with contextlib.suppress(Exception):
            await stream.write(self._meta_bytes)
        with contextlib.suppress(Exception):
            await stream.close()

    def peers(self) -> dict[str, topics.PeerMetadata]:
        """Peers learned from the run's peers topic or their served metadata (latest of each)."""
        return dict(self._peers)

    async def collect(self, sub: Subscription) -> None:
        """Remember the metadata arriving on ``sub`` (the peers topic) until it closes."""
        while True:
            try:
                msg = await sub.get()
            except TransportClosed:
                return
            env = topics.SignedEnvelope.open(sub.topic, msg.data)
            self.learn(msg.source, topics.PeerMetadata.decode(env.body))

    def learn(self, peer: str, meta: topics.PeerMetadata) -> None:
        """Remember ``meta``, checked as signed by ``peer``, unless older than what is
        known of it (or the directory is full and ``peer`` new to it)."""
        old = self._peers.get(peer)
        fresh = old is None or old.time_ms <= meta.time_ms
        if fresh and (old is not None or len(self._peers) < MAX_DIRECTORY):
            self._peers[peer] = meta

    async def publish_every(self, publish: Callable[[str, bytes], Awaitable[None]],
                            topic: str, interval: float) -> None:
        """Publish this node's metadata on ``topic`` every ``interval`` seconds."""
        while True:
            try:
                await publish(topic, self.signed(topic))
            except (TransportClosed, BridgeClosed):
                return
            except Exception as exc:
                logger.info("publishing metadata failed: %r", exc)
            await asyncio.sleep(interval)


async def read_metadata(stream: INetStream, peer: str, timeout: float
                        ) -> topics.PeerMetadata:
    """Read and check ``peer``'s signed metadata from a :data:`META_PROTOCOL` stream
    (trio); the stream is closed after.

    :raises SignatureError: not signed by ``peer``'s key.
    :raises DecodeError: malformed.
    """
    buf = bytearray()
    try:
        with trio.fail_after(timeout):
            while len(buf) <= MAX_META_BYTES:
                try:
                    chunk = await stream.read(MAX_META_BYTES + 1 - len(buf))
                except Exception:  # EOF
                    break
                if not chunk:
                    break
                buf += chunk
    finally:
        with contextlib.suppress(Exception):
            await stream.close()
    env = topics.SignedEnvelope.open(META_PROTOCOL, bytes(buf), max_bytes=MAX_META_BYTES)
    if env.signer_peer_id != peer:
        raise SignatureError(f"metadata of {peer} signed by {env.signer_peer_id}")
    return topics.PeerMetadata.decode(env.body)
