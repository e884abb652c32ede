"""Parsing the multiaddrs swarm uses, without importing libp2p.

Accepted forms: ``/ip4/A/tcp/P``, ``/ip6/A/tcp/P`` and ``/dns4/NAME/tcp/P`` (``/dns``,
``/dns6`` too), each optionally followed by ``/p2p/<peer id>``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from swarm.errors import SignatureError
from swarm.identity import public_key_from_peer_id
from swarm.net.transport import PeerUnreachable

_HOST_PROTOCOLS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})


@dataclass(frozen=True, slots=True)
class TcpAddress:
    """A TCP endpoint and, when the address pins one, the peer id expected there."""

    host: str
    port: int
    peer_id: str | None = None
    family: str = "ip4"

    def multiaddr(self) -> str:
        base = f"/{self.family}/{self.host}/tcp/{self.port}"
        return base + (f"/p2p/{self.peer_id}" if self.peer_id else "")


def parse_tcp_multiaddr(text: str) -> TcpAddress:
    """Parse a TCP multiaddr.

    :raises PeerUnreachable: the text is not one of the accepted forms, or its peer id
        is not an Ed25519 libp2p peer id.
    """
    parts = text.split("/")
    if len(parts) not in (5, 7) or parts[0] != "" or parts[1] not in _HOST_PROTOCOLS \
            or parts[3] != "tcp":
        raise PeerUnreachable(
            f"not a TCP multiaddr: {text!r:.120} (expected /ip4/A/tcp/P[/p2p/ID])")
    if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
        raise PeerUnreachable(f"bad TCP port in {text!r:.120}")
    peer_id = None
    if len(parts) == 7:
        if parts[5] != "p2p":
            raise PeerUnreachable(f"expected /p2p/<peer id> at the end of {text!r:.120}")
        peer_id = parts[6]
        try:
            public_key_from_peer_id(peer_id)
        except SignatureError as exc:
            raise PeerUnreachable(f"{text!r:.120}: {exc}") from exc
    return TcpAddress(parts[2], int(parts[4]), peer_id, parts[1])


def bind_failure(listen: str) -> str | None:
    """Why ``listen``'s TCP endpoint cannot be bound (as one more, plain listener), or
    ``None`` when it can. py-libp2p's listener sets SO_REUSEPORT (for hole punching), so
    the kernel would let a second node share a port the first listens on and split the
    dials between them: a plain bind is refused while any process listens there."""
    try:
        addr = parse_tcp_multiaddr(listen)
        family = socket.AF_INET6 if addr.family == "ip6" else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr.host, addr.port))
    except PeerUnreachable as exc:
        return f"cannot listen on {listen}: {exc}"
    except OSError as exc:
        return f"cannot listen on {listen}: {(exc.strerror or str(exc)).lower()}"
    return None


def listen_failure(listen: str) -> str:
    """Why nothing listens at ``listen``: the error of binding its TCP endpoint once more
    (a node's transport may log its own failure and go on)."""
    return bind_failure(listen) or f"cannot listen on {listen}: nothing listens there"
