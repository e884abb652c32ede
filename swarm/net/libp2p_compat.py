"""Workarounds for py-libp2p 0.8.1, in one place.

Each names the upstream behaviour it works around (as read in libp2p 0.8.1's source),
so it can be deleted when upstream changes. Everything here runs in trio code inside
the guest run of :mod:`swarm.net.bridge`; libp2p loads lazily, on first use.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import trio

if TYPE_CHECKING:
    from libp2p.abc import IHost, INetConn
    from libp2p.peer.id import ID
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub

    from swarm.net.gossip import GossipConfig

logger = logging.getLogger(__name__)

#: Bytes of RPC framing allowed on top of the largest gossip payload.
RPC_OVERHEAD = 64 << 10


# -- peer ids ------------------------------------------------------------------------
# libp2p speaks ``ID`` objects, the rest of swarm base58 strings.
def peer_str(peer: Any) -> str:
    """The base58 text of a libp2p ``ID``."""
    return str(peer.to_base58())


def id_from_bytes(raw: bytes) -> ID:
    from libp2p.peer.id import ID

    return ID(raw)


def id_from_str(peer_id: str) -> ID:
    from libp2p.peer.id import ID

    return ID.from_base58(peer_id)


# -- host ----------------------------------------------------------------------------
def new_secure_host(seed: bytes) -> IHost:
    """A host with the Ed25519 key of ``seed`` offering Noise and Yamux only.

    ``new_host()``'s default security options also accept plaintext (which lets a peer
    claim any id without proof), secio and TLS, and its default muxers include mplex.
    """
    from libp2p import create_yamux_muxer_option, new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport

    key_pair = create_new_key_pair(seed)
    return new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): NoiseTransport(
            key_pair, noise_privkey=create_x25519_key_pair().private_key)},
        muxer_opt=create_yamux_muxer_option(),
    )


# -- gossipsub -----------------------------------------------------------------------
class DeepQueues(dict[Any, Any]):
    """``Pubsub.peer_queues`` that deepens each per-peer outbound queue as it is added.

    ``Pubsub._handle_new_peer`` creates every peer's ``RpcQueue()`` with its default
    ``max_size`` of 32 (``OutBoundQueueSize``) and offers no setting for it; a full
    queue rejects the RPC (the message is dropped silently).
    """

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth

    def __setitem__(self, key: Any, queue: Any) -> None:
        inner = getattr(queue, "_queue", None)
        if inner is not None and hasattr(inner, "max_size"):
            inner.max_size = self.depth
        else:
            logger.warning("py-libp2p RpcQueue changed shape; outbound queue stays shallow")
        super().__setitem__(key, queue)


def new_pubsub(host: IHost, config: GossipConfig) -> tuple[Pubsub, GossipSub]:
    """Strictly signing gossipsub on ``host``, with the defaults that drop messages fixed.

    - ``GossipSub``'s ``heartbeat_interval`` defaults to 120 s (mesh repair, gossip
      emission every two minutes): ``config.heartbeat_interval`` instead.
    - Its spam protection drops (and scores down) more than
      ``max_messages_per_topic_per_second`` messages per peer and topic, 10 by default:
      ``config.max_messages_per_topic_per_second`` instead.
    - ``Pubsub``'s ``max_inbound_rpc_size`` defaults to 1 MiB, no room for framing
      around a 1 MiB payload: the payload bound plus :data:`RPC_OVERHEAD`.
    - Outbound queues: :class:`DeepQueues`.
    - Adaptive gossip (``adaptive_gossip_enabled``, on by default in 0.8.1) rewrites
      ``heartbeat_interval`` in ``GossipSub._adapt_heartbeat_parameters`` from its
      network-health score, formulas written for the 120 s default: ``max(30, min(60,
      base // 2))`` turned a 1 s heartbeat into 30-60 s within 30 s of start, and with
      it the message cache's reach (gossip_window heartbeats): a newcomer was handed
      about 3 minutes of stale messages. Off, so the heartbeat stays as configured.
    - The message cache: ``gossip_window`` heartbeats are advertised (IHAVE) and
      replayed whole to every peer that subscribes (``Pubsub._replay_recent_messages``
      -> ``GossipSub.send_recent_messages``), ``gossip_history`` heartbeats answer IWANT.
      Messages for a connected peer that has not subscribed yet are queued for
      ``pending_messages_ttl`` (30 s by default, up to 100) and flushed when it
      subscribes: that TTL is bounded to the history's span too, so nothing older than
      ``config.max_replay_age`` reaches a newcomer.
    - Message ids are (peer id, seqno), and ``Pubsub`` starts its seqno counter at
      ``int(time.time())``, one per message: a node restarted with the same identity
      would reuse the seqnos of its last run's busy seconds, and its neighbours would
      drop those messages (new manifests) as seen. Nanoseconds, as go-libp2p does,
      stay ahead of any earlier run.
    """
    from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
    from libp2p.pubsub.pubsub import Pubsub

    g = config
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID], degree=g.degree,
        degree_low=g.degree_low, degree_high=g.degree_high,
        heartbeat_interval=g.heartbeat_interval, heartbeat_initial_delay=0.1,
        max_messages_per_topic_per_second=g.max_messages_per_topic_per_second,
        adaptive_gossip_enabled=False,
        gossip_window=g.gossip_window, gossip_history=g.gossip_history,
        pending_messages_ttl=g.max_replay_age,
    )
    pubsub = Pubsub(host, router, strict_signing=True, seen_ttl=g.seen_ttl,
                    max_inbound_rpc_size=g.max_message_bytes + RPC_OVERHEAD)
    pubsub.peer_queues = DeepQueues(g.outbound_queue_depth)
    pubsub.counter = time.time_ns()
    return pubsub, router


# -- connections and their sockets ---------------------------------------------------
def connections(host: IHost, peer_id: str) -> list[INetConn]:
    """The host's libp2p connections to ``peer_id`` (open or already closed)."""
    return list(host.get_network().get_connections(id_from_str(peer_id)))


_SOCKET_PATH = ("muxed_conn", "secured_conn", "conn", "stream", "read_write_closer",
                "raw_conn", "_stream")


def socket_streams(conn: Any) -> list[trio.SocketStream]:
    """The trio socket streams under a libp2p connection (muxer -> Noise -> raw TCP),
    found by walking the private attributes that hold each layer."""
    found: list[trio.SocketStream] = []
    todo: list[tuple[Any, int]] = [(conn, 0)]
    seen: set[int] = set()
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if isinstance(obj, trio.SocketStream):
            found.append(obj)
            continue
        for name in _SOCKET_PATH:
            child = getattr(obj, name, None)
            if child is not None:
                todo.append((child, depth + 1))
    return found


async def close_socket_streams(streams: list[trio.SocketStream]) -> None:
    """Close sockets py-libp2p left open.

    py-libp2p 0.8.1 drops dialed TCP sockets of closed connections without closing
    them (they linger in CLOSE_WAIT until garbage collection, with a ResourceWarning).
    """
    for st in streams:
        if st.socket.fileno() >= 0:
            with contextlib.suppress(Exception):
                await st.aclose()


class SocketTracker:
    """The sockets under each open libp2p connection, to close when py-libp2p does not
    (see :func:`close_socket_streams`)."""

    def __init__(self) -> None:
        self._raw: dict[int, list[trio.SocketStream]] = {}

    def opened(self, conn: Any) -> None:
        self._raw[id(conn)] = socket_streams(conn)

    async def closed(self, conn: Any) -> None:
        await close_socket_streams(self._raw.pop(id(conn), []))

    def take(self, conns: list[INetConn]) -> list[trio.SocketStream]:
        """Forget the sockets of ``conns`` and return them."""
        return [st for c in conns for st in self._raw.pop(id(c), [])]

    async def close_all(self) -> None:
        leftovers = [st for streams in self._raw.values() for st in streams]
        self._raw.clear()
        await close_socket_streams(leftovers)


async def close_all_connections(host: IHost, sockets: SocketTracker) -> None:
    """Close every libp2p connection, then every socket py-libp2p left open."""
    for peer in list(host.get_connected_peers()):
        with contextlib.suppress(Exception):
            await host.disconnect(peer)
    await sockets.close_all()


async def dial(host: IHost, address: str, *, fresh: bool, sockets: SocketTracker,
               close_timeout: float) -> None:
    """Dial ``address`` as a deliberate dial, around two py-libp2p behaviours.

    - ``Swarm.dial_peer`` refuses, for 60 s (``_NegativePeerCache``), to dial a peer
      whose addresses all failed once: a restarted trainer would stay unreachable that
      long after it listens again. The peer is unblocked first.
    - ``BasicHost.connect`` returns at once when the swarm holds any connection to the
      peer, even a closed one, so every stream on it then fails. Connections that are all
      closed (or all of them, with ``fresh``) are closed with their sockets first.
    - ``Swarm.dial_peer`` dials at most one address per transport class
      (``MAX_ADDRS_PER_PEER``), the first the peerstore lists: a peer that came back on
      another port (a restarted trainer listening on port 0) was dialled at its old,
      dead address for as long as the peerstore kept it. The peer's known addresses are
      cleared, so the address asked for is the one dialled.
    """
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    info = info_from_p2p_addr(Multiaddr(address))
    network = cast("Any", host.get_network())
    unblock = getattr(network, "unblock_peer", None)
    if unblock is not None:
        unblock(info.peer_id)
    conns = list(network.get_connections(info.peer_id))
    if conns and (fresh or all(c.is_closed for c in conns)):
        raw = sockets.take(conns)
        with trio.move_on_after(close_timeout), contextlib.suppress(Exception):
            await network.close_peer(info.peer_id)
        await close_socket_streams(raw)
    host.get_peerstore().clear_addrs(info.peer_id)
    await host.connect(info)


# -- multistream-select ----------------------------------------------------------
#: The longest multistream-select message read (a protocol id and its newline).
MULTISTREAM_MAX_MESSAGE = 1024


def bound_multistream_reads(limit: int = MULTISTREAM_MAX_MESSAGE) -> None:
    """Bound every multistream-select message py-libp2p reads to ``limit`` bytes.

    py-libp2p 0.8.1's ``MultiselectCommunicator.read`` calls ``read_delim``, which
    reads the varint length a peer announces and then ``read_exactly`` that many bytes,
    with no bound, and the first negotiation (of the security protocol) runs before
    authentication: a raw TCP client announcing a 1 GiB "protocol id" and sending for
    ever grows the node's memory without limit (GHSA-hmjq-g7pp-rw3x, fixed upstream in
    0.8.2). Until 0.8.2 can be pinned, the method is replaced by one that refuses a
    length over ``limit`` before reading the body. Idempotent; applied when a
    :class:`~swarm.net.node.Libp2pNode` starts.
    """
    from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    async def read(self: Any) -> str:
        stream = self.read_writer
        try:
            length = shift = 0
            for _ in range(3):  # 3 varint bytes: up to 2 MiB, more than any limit here
                byte = await stream.read(1)
                if not byte:
                    raise MultiselectCommunicatorError("closed during multistream-select")
                length |= (byte[0] & 0x7F) << shift
                shift += 7
                if not byte[0] & 0x80:
                    break
            else:
                raise MultiselectCommunicatorError("multistream-select length too long")
            if not 0 < length <= limit:
                raise MultiselectCommunicatorError(
                    f"multistream-select message of {length} bytes (bound {limit})")
            data = bytearray()
            while len(data) < length:
                chunk = await stream.read(length - len(data))
                if not chunk:
                    raise MultiselectCommunicatorError("closed during multistream-select")
                data += chunk
        except MultiselectCommunicatorError:
            raise
        except Exception as exc:  # IOException and friends, as upstream wraps them
            raise MultiselectCommunicatorError(
                "fail to read from multiselect communicator") from exc
        if data[-1:] != b"\n":
            raise MultiselectCommunicatorError("multistream-select message without newline")
        return bytes(data[:-1]).decode()

    if getattr(MultiselectCommunicator.read, "_swarm_bounded", None) == limit:
        return
    read._swarm_bounded = limit  # type: ignore[attr-defined]
    MultiselectCommunicator.read = read  # type: ignore[method-assign]


# -- errors --------------------------------------------------------------------------
# py-libp2p wraps the cause of a failed dial or stream several layers deep (a Noise
# ``HandshakeFailure`` under a ``SecurityUpgradeFailure`` under a ``SwarmException``
# inside the ``MultiError`` that ``SwarmDialAllFailedError`` is raised from; a
# ``ProtocolNotSupportedError`` under a ``StreamFailure``), so errors are told apart by
# what the whole chain says.
def is_security_failure(exc: BaseException) -> bool:
    """The security handshake failed (the peer did not prove the dialed id)."""
    return mentions(exc, ("security", "handshake", "peer id"))


def is_unanswered_dial(exc: BaseException) -> bool:
    """No connection was made to any address dialled (py-libp2p's "unable to connect to
    PEER, no addresses established a successful connection", whose socket error it logs
    but does not chain)."""
    return mentions(exc, ("no addresses established",))


def is_refusal(exc: BaseException) -> bool:
    """The peer answered that it does not serve the protocol (a live connection)."""
    return mentions(exc, ("not supported",))


def mentions(exc: BaseException, words: tuple[str, ...]) -> bool:
    """Whether ``exc``, its causes or grouped errors name any of ``words``."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        text = f"{type(e).__name__} {e}".lower()
        if any(w in text for w in words):
            return True
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        errs = getattr(e, "errors", None)
        if isinstance(errs, list):
            todo.extend(x for x in errs if isinstance(x, BaseException))
    return False
