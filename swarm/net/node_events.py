"""libp2p network notifications of a :class:`~swarm.net.node.Libp2pNode`: gate banned
peers, track sockets and lost connections."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.net import libp2p_compat as compat
from swarm.protocol.scoring import PeerScores

if TYPE_CHECKING:
    from libp2p.abc import INetConn

logger = logging.getLogger(__name__)


class Notifee:
    """libp2p network notifications: gate banned peers, track lost connections.

    ``hang_up(peer, reason)`` closes a peer's connections; ``lost(peer)`` is told when a
    libp2p connection to ``peer`` is gone."""

    def __init__(self, sockets: compat.SocketTracker, scores: PeerScores,
                 hang_up: Callable[[str, str], None], lost: Callable[[str], None]) -> None:
        self.sockets = sockets
        self.scores = scores
        self.hang_up = hang_up
        self.lost = lost

    async def opened_stream(self, network: Any, stream: Any) -> None:
        return None

    async def closed_stream(self, network: Any, stream: Any) -> None:
        return None

    async def connected(self, network: Any, conn: INetConn) -> None:
        self.sockets.opened(conn)
        peer = compat.peer_str(conn.muxed_conn.peer_id)
        if self.scores.is_banned(peer):
            logger.info("refusing banned peer %s", peer)
            self.hang_up(peer, "banned")

    async def disconnected(self, network: Any, conn: INetConn) -> None:
        await self.sockets.closed(conn)
        self.lost(compat.peer_str(conn.muxed_conn.peer_id))

    async def listen(self, network: Any, multiaddr: Any) -> None:
        return None

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        return None
