"""The transport interface the chunk exchange and the roles are written against.

A :class:`Transport` moves bounded, opaque messages (``bytes``) between authenticated
peers, named by their libp2p peer id (``12D3KooW...``, derived from the node's Ed25519
identity key). The bytes are whatever the caller encodes (exchange messages: bitfield,
have, request, piece, cancel, choke/unchoke); the transport only promises:

- the peer id attached to every inbound message is the authenticated sender (it proved
  possession of the key; the in-memory network trusts the process);
- messages between one ordered pair of peers arrive in order, whole, at most once
  (the in-memory network may drop whole messages when its link has ``loss > 0``, and
  a :class:`~swarm.net.dataplane.DirectTransport` dialed with several connections to
  one peer may reorder across them: the exchange must re-request after a timeout, as
  it must after a disconnect);
- a message is at most :attr:`Transport.max_message_bytes` (at least 8 MiB + 64 KiB for
  every implementation, so a 4 MiB piece plus its header always fits);
- every queue is bounded: :meth:`Transport.send` waits when the link is busy
  (backpressure), and a slow consumer of :meth:`Transport.recv` slows its senders; the
  inbound queue is bounded in messages, in bytes, and in bytes per peer, so a peer that
  floods stalls only its own connection.

Implementations (all async context managers owning their tasks; leaving the ``async
with`` block closes every connection and task):

- :class:`swarm.net.memory.MemoryTransport` on a :class:`swarm.net.memory.MemoryNetwork`
  with per-link bandwidth, latency and loss (tests, the asyncio exchange driver, demos);
- :class:`swarm.net.node.Libp2pNode` (libp2p control plane + direct encrypted data plane,
  falling back to libp2p streams where no direct path works);
- the same node with ``NodeConfig(data_plane=None)`` (libp2p streams only);
- :class:`swarm.net.dataplane.DirectTransport`: the data plane alone, no libp2p.

Control-plane gossip (signed manifests, have summaries, peer metadata, lease traffic) is
the :class:`Gossip` protocol, implemented by the libp2p node and by the memory network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from swarm.errors import LocalProtocolError, SwarmError

#: The smallest ``max_message_bytes`` any implementation offers.
MIN_MAX_MESSAGE_BYTES = (8 << 20) + (64 << 10)


class TransportClosed(SwarmError):
    """The transport was closed; no more messages or events will come."""


class PeerUnreachable(SwarmError):
    """No connection to that peer exists and none could be made."""


class PeerIdMismatch(SwarmError):
    """The peer at a dialed address proved a different identity than the address names."""


class MessageTooLarge(LocalProtocolError):
    """The caller tried to send a message over ``max_message_bytes``."""


class Path(Enum):
    """How a connection to a peer carries messages."""

    DIRECT = "direct"    #: the encrypted asyncio TCP data plane
    LIBP2P = "libp2p"    #: a libp2p stream (Noise + Yamux) on the control-plane connection
    MEMORY = "memory"    #: the in-memory network


@dataclass(frozen=True, slots=True)
class Message:
    """One inbound message: the authenticated sender's peer id and the payload."""

    peer_id: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """A peer became reachable (``connected=True``) or was lost (``connected=False``).

    ``reason`` is empty for orderly events and names the cause otherwise (for example
    ``"protocol violation: frame over bound"``, ``"timeout"``, ``"closed by peer"``).
    """

    peer_id: str
    connected: bool
    path: Path
    reason: str = ""


@runtime_checkable
class Transport(Protocol):
    """Message transport between authenticated peers. See the module docstring."""

    @property
    def peer_id(self) -> str:
        """This node's own libp2p peer id."""
        ...

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        """Full addresses other nodes can pass to :meth:`connect`.

        For libp2p nodes: multiaddrs ``/ip4/127.0.0.1/tcp/P/p2p/12D3KooW...``; for the
        memory network: ``/memory/12D3KooW...``.
        """
        ...

    @property
    def max_message_bytes(self) -> int:
        """The largest payload :meth:`send` accepts (and a peer may send us)."""
        ...

    async def connect(self, address: str) -> str:
        """Connect to the node at a full address and return its authenticated peer id.

        Returns at once when already connected.

        :raises PeerIdMismatch: the address names a peer id the remote did not prove.
        :raises PeerUnreachable: nothing answered, or the handshake failed.
        :raises TransportClosed: the transport is closed.
        """
        ...

    async def send(self, peer_id: str, payload: bytes) -> None:
        """Queue one message to a connected peer; waits while the link's queue is full.

        Returning means the message was accepted for delivery, not that it arrived.

        :raises MessageTooLarge: ``len(payload) > max_message_bytes``.
        :raises PeerUnreachable: not connected to ``peer_id`` (or the connection died).
        :raises TransportClosed: the transport is closed.
        """
        ...

    async def recv(self) -> Message:
        """The next inbound message from any peer (waits until one arrives).

        :raises TransportClosed: the transport is closed and nothing remains queued.
        """
        ...

    async def next_event(self) -> PeerEvent:
        """The next connect/disconnect event (waits until one happens).

        :raises TransportClosed: the transport is closed and nothing remains queued.
        """
        ...

    def poll_event(self) -> PeerEvent | None:
        """The next connect/disconnect event if one is already queued (never waits).

        Events are queued before any message of the connection they announce, so a
        consumer that takes every queued event before handling a message sees that
        message's peer as connected.
        """
        ...

    def connected_peers(self) -> frozenset[str]:
        """Peer ids with a live connection right now."""
        ...

    async def disconnect(self, peer_id: str, reason: str = "") -> None:
        """Close the connection to ``peer_id`` (no-op when not connected)."""
        ...

    def penalize(self, peer_id: str, reason: str, *, disconnect: bool = True) -> None:
        """Score a peer down (bad chunk, protocol violation seen above the transport).

        With ``disconnect`` the connection is closed too. A peer whose score falls below
        the ban threshold is refused on later connects for the rest of the session.
        """
        ...

    def score(self, peer_id: str) -> float:
        """The peer's current score (0.0 for unknown peers; negative means misbehaving)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class GossipMessage:
    """One gossip message that passed the topic's validator.

    ``source`` is the peer id that signed the libp2p message (the origin, not the relay);
    ``data`` the application payload (itself signed where the topic requires it).
    """

    topic: str
    source: str
    data: bytes


#: A topic validator: ``(source peer id, data) -> accept``. Called before a message is
#: delivered or forwarded; a ``False`` (or an exception) drops it and it never propagates.
#: Validators must be fast and pure (no I/O): they run inline in the gossip router.
Validator = Callable[[str, bytes], bool]


@runtime_checkable
class Subscription(Protocol):
    """Messages of one topic; an async context manager that unsubscribes on exit."""

    @property
    def topic(self) -> str: ...

    async def get(self) -> GossipMessage:
        """The next validated message (waits).

        :raises TransportClosed: the node or the subscription was closed.
        """
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Gossip(Protocol):
    """Publish/subscribe on named topics (gossipsub on the libp2p node).

    A node does not receive its own publications. Topic names, payloads and limits:
    :mod:`swarm.net.topics`.
    """

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` to ``topic`` (signed by this node's key by libp2p).

        :raises MessageTooLarge: ``data`` is over the gossip message bound.
        :raises TransportClosed: the node is closed.
        """
        ...

    async def subscribe(self, topic: str, validator: Validator | None = None) -> Subscription:
        """Subscribe to ``topic``; messages failing ``validator`` are dropped unseen.

        Use as ``async with await node.subscribe(t, v) as sub: msg = await sub.get()``.
        """
        ...
