"""libp2p network notifications of a :class:`~swarm.net.node.Libp2pNode`: gate banned
peers, track sockets and lost connections."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from swarm.net import libp2p_compat as compat

if TYPE_CHECKING:
    from libp2p.abc import INetConn

    from swarm.net.node import Libp2pNode

logger = logging.getLogger(__name__)


class Notifee:
    """libp2p network notifications: gate banned peers, track lost connections."""

    def __init__(self, node: Libp2pNode) -> None:
        self.node = node

    async def opened_stream(self, network: Any, stream: Any) -> None:
        return None

    async def closed_stream(self, network: Any, stream: Any) -> None:
        return None

    async def connected(self, network: Any, conn: INetConn) -> None:
        self.node._sockets.opened(conn)
        peer = compat.peer_str(conn.muxed_conn.peer_id)
        if self.node._scores.is_banned(peer):
            logger.info("refusing banned peer %s", peer)
            self.node._hang_up(peer, "banned")

    async def disconnected(self, network: Any, conn: INetConn) -> None:
        await self.node._sockets.closed(conn)
        self.node._on_libp2p_disconnected(compat.peer_str(conn.muxed_conn.peer_id))

    async def listen(self, network: Any, multiaddr: Any) -> None:
        return None

    async def listen_close(self, network: Any, multiaddr: Any) -> None:
        return None
