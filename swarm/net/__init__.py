"""Networking: the transport interface, the in-memory network, the libp2p control plane
(hosted in asyncio through trio guest mode) and the direct encrypted data plane.

``import swarm.net`` stays light: libp2p and trio load only with :mod:`swarm.net.node`.
"""

from swarm.net.transport import (
    Gossip,
    GossipMessage,
    Message,
    MessageTooLarge,
    Path,
    PeerEvent,
    PeerIdMismatch,
    PeerUnreachable,
    Subscription,
    Transport,
    TransportClosed,
    Validator,
)

__all__ = [
    "Gossip",
    "GossipMessage",
    "Message",
    "MessageTooLarge",
    "Path",
    "PeerEvent",
    "PeerIdMismatch",
    "PeerUnreachable",
    "Subscription",
    "Transport",
    "TransportClosed",
    "Validator",
]
