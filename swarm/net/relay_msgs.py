"""Messages of the swarm relay (:mod:`swarm.net.relay`): sans-IO, bounded, strict.

Every message is one frame (:mod:`swarm.wire.frames`) of canonical msgpack, at most
:data:`MAX_MSG_BYTES`, sent on a plain TCP connection to the relay before it is spliced
(after that the bytes are the two peers' own data-plane session, which the relay only
copies). The relay speaks first on every connection::

    relay -> any      {"t": "relay", "v": 1, "nonce": 32 B}
    B -> relay        {"t": "reserve", "key": Ed25519 pub, "sig": sig(DOMAIN + nonce)}
    relay -> B        {"t": "ok", "seen": "ip:port"}            (then, while it lasts:)
    relay -> B        {"t": "incoming", "id": 16 B}
    B -> relay        {"t": "accept", "id": 16 B}               (a new connection)
    A -> relay        {"t": "connect", "to": peer id of B}
    relay -> A and B  {"t": "ok", "seen": "ip:port of the other end, as the relay sees it"}
    relay -> any      {"t": "error", "reason": str}             (then it closes)

A reservation is proved by a signature over the relay's fresh nonce, so nobody can
take another peer's circuits (and a recorded one cannot be replayed). A connecting
peer is not authenticated by the relay: the data-plane handshake that then runs
end to end inside the circuit proves both identities to each other, and seals every
frame, so the relay can neither read nor alter what it carries. Circuit ids are 16
random bytes, only ever sent to the reserved peer.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.errors import DecodeError
from swarm.identity import PUBLIC_KEY_LEN, SIGNATURE_LEN, peer_id_from_public_key
from swarm.identity import verify as verify_signature
from swarm.wire import strict

VERSION = 1
MAX_MSG_BYTES = 512
NONCE_LEN = 32
CIRCUIT_ID_LEN = 16
MAX_REASON = 120
MAX_PEER_ID = 64
MAX_ADDR = 64
#: What a reservation signs, before the relay's nonce.
DOMAIN = b"swarm/relay/v1 reserve\0"

TAGS = frozenset({"relay", "reserve", "ok", "incoming", "accept", "connect", "error"})
_KEYS: dict[str, frozenset[str]] = {
    "relay": frozenset({"t", "v", "nonce"}),
    "reserve": frozenset({"t", "key", "sig"}),
    "ok": frozenset({"t", "seen"}),
    "incoming": frozenset({"t", "id"}),
    "accept": frozenset({"t", "id"}),
    "connect": frozenset({"t", "to"}),
    "error": frozenset({"t", "reason"}),
}


@dataclass(frozen=True, slots=True)
class Msg:
    """One relay message: its tag and its fields (validated by :func:`decode`)."""

    t: str
    nonce: bytes = b""
    key: bytes = b""
    sig: bytes = b""
    seen: str = ""
    id: bytes = b""
    to: str = ""
    reason: str = ""

    def encode(self) -> bytes:
        m: dict[str, object] = {"t": self.t}
        if self.t == "relay":
            m |= {"v": VERSION, "nonce": self.nonce}
        elif self.t == "reserve":
            m |= {"key": self.key, "sig": self.sig}
        elif self.t == "ok":
            m |= {"seen": self.seen}
        elif self.t in ("incoming", "accept"):
            m |= {"id": self.id}
        elif self.t == "connect":
            m |= {"to": self.to}
        elif self.t == "error":
            m |= {"reason": self.reason[:MAX_REASON]}
        else:
            raise ValueError(f"unknown relay message {self.t!r}")
        return strict.pack(m)

    @property
    def peer_id(self) -> str:
        """The peer id a ``reserve`` message's key names."""
        return peer_id_from_public_key(self.key)

    def check_reservation(self, nonce: bytes) -> None:
        """:raises DecodeError: the signature is not over ``nonce`` by ``key``."""
        try:
            verify_signature(self.key, self.sig, DOMAIN + nonce)
        except Exception as exc:  # SignatureError, a malformed key
            raise DecodeError("relay reservation: the signature does not verify") from exc


def decode(data: bytes | bytearray, *expected: str) -> Msg:
    """One relay message, which must be one of ``expected`` (an ``error`` always is).

    :raises DecodeError: malformed, over its bounds, or not expected here.
    """
    obj = strict.unpack(data, max_bytes=MAX_MSG_BYTES, max_str=MAX_REASON, max_bin=64,
                        max_array=0, max_map=4)
    if not isinstance(obj, dict) or obj.get("t") not in TAGS:
        raise DecodeError("relay: not a relay message")
    t = str(obj["t"])
    if t not in expected and t != "error":
        raise DecodeError(f"relay: got {t!r}, expected one of {sorted(expected)}")
    m = strict.as_map(obj, _KEYS[t], f"relay {t}")
    if t == "relay":
        strict.get_int(m, "v", VERSION, VERSION)
        return Msg(t, nonce=strict.get_bytes(m, "nonce", NONCE_LEN))
    if t == "reserve":
        return Msg(t, key=strict.get_bytes(m, "key", PUBLIC_KEY_LEN),
                   sig=strict.get_bytes(m, "sig", SIGNATURE_LEN))
    if t == "ok":
        return Msg(t, seen=strict.get_str(m, "seen", MAX_ADDR))
    if t in ("incoming", "accept"):
        return Msg(t, id=strict.get_bytes(m, "id", CIRCUIT_ID_LEN))
    if t == "connect":
        return Msg(t, to=strict.get_str(m, "to", MAX_PEER_ID))
    return Msg(t, reason=strict.get_str(m, "reason", MAX_REASON))


def split_hostport(text: str) -> tuple[str, int]:
    """``"10.0.0.1:4011"`` -> ``("10.0.0.1", 4011)``.

    :raises DecodeError: not ``host:port``.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DecodeError(f"relay: {text!r:.80} is not host:port")
    return host.strip("[]"), int(port)


def circuit_address(relay_host: str, relay_port: int, relay_id: str, peer_id: str) -> str:
    """The address a peer reserved on a relay advertises:
    ``/ip4/R/tcp/P/p2p/<relay id>/p2p-circuit/p2p/<peer id>`` (R:P the relay service)."""
    family = "ip6" if ":" in relay_host else "ip4"
    return f"/{family}/{relay_host}/tcp/{relay_port}/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}"


@dataclass(frozen=True, slots=True)
class Circuit:
    """A parsed :func:`circuit_address`."""

    relay_host: str
    relay_port: int
    relay_id: str
    peer_id: str


def parse_circuit(address: str) -> Circuit | None:
    """The parts of a circuit address, or None when ``address`` is not one."""
    parts = address.split("/")
    # "", ip4, H, tcp, P, p2p, R, p2p-circuit, p2p, B
    if len(parts) != 10 or parts[7] != "p2p-circuit" or parts[1] not in ("ip4", "ip6") \
            or parts[3] != "tcp" or parts[5] != "p2p" or parts[8] != "p2p":
        return None
    if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536 or not parts[9] or \
            len(parts[9]) > MAX_PEER_ID:
        return None
    return Circuit(parts[2], int(parts[4]), parts[6], parts[9])
