"""The data-plane handshake and AEAD session: sans-IO (bytes in, bytes and a session out).

Three messages, each one frame of canonical msgpack (bounded to
:data:`MAX_HANDSHAKE_BYTES`)::

    client -> server  {"t": "hello",  "v": 1, "eph": X25519 pub, "nonce": 32 B,
                       "ciphers": [names, preferred first]}
    server -> client  {"t": "server", "v": 1, "eph": X25519 pub, "nonce": 32 B,
                       "cipher": chosen name, "key": Ed25519 pub, "sig": 64 B}
    client -> server  {"t": "auth",   "key": Ed25519 pub, "sig": 64 B}

The server signs ``"swarm/dataplane/v1 server\\0" + BLAKE3(hello || server-without-sig)``;
the client signs ``"swarm/dataplane/v1 client\\0" + BLAKE3(hello || server || auth-without-
sig)``. Both transcripts contain both ephemeral keys and nonces, so each signature binds
the long-term identity to this session's key exchange (no replay, no key-compromise
impersonation through a recorded handshake). Traffic keys come from HKDF-SHA256 over the
X25519 secret, salted with the transcript hash: one key per direction. Each data frame is
``AEAD(key, nonce=counter, plaintext, aad=frame header)``; the 64-bit counter never
repeats within a session and a connection is closed long before it could wrap.

The client checks the server's key against the peer id it meant to dial and fails with
:class:`~swarm.net.transport.PeerIdMismatch` otherwise.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import blake3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from swarm.errors import DecodeError, LocalProtocolError, RemoteProtocolError, SignatureError
from swarm.identity import PUBLIC_KEY_LEN, SIGNATURE_LEN, Identity, peer_id_from_public_key
from swarm.identity import verify as verify_signature
from swarm.net.transport import PeerIdMismatch
from swarm.wire import strict

VERSION = 1
MAX_HANDSHAKE_BYTES = 1024
NONCE_LEN = 32
TAG_LEN = 16
#: AEAD choices, preferred first. AES-GCM uses AES-NI where the CPU has it.
CIPHERS = ("aes-256-gcm", "chacha20-poly1305")
_MAX_COUNTER = (1 << 64) - 1
_SERVER_DOMAIN = b"swarm/dataplane/v1 server\0"
_CLIENT_DOMAIN = b"swarm/dataplane/v1 client\0"
_KDF_INFO = b"swarm/dataplane/v1 keys"
_NONCE = struct.Struct(">4xQ")


class HandshakeError(RemoteProtocolError):
    """The peer's handshake was malformed, out of order, or failed authentication."""


def _aead(name: str, key: bytes) -> AESGCM | ChaCha20Poly1305:
    if name == "aes-256-gcm":
        return AESGCM(key)
    if name == "chacha20-poly1305":
        return ChaCha20Poly1305(key)
    raise LocalProtocolError(f"unknown cipher {name!r}")


class Session:
    """Keys of an established connection: seals outbound and opens inbound frames."""

    def __init__(self, peer_key: bytes, cipher: str, send_key: bytes, recv_key: bytes) -> None:
        self.peer_key = peer_key
        self.peer_id = peer_id_from_public_key(peer_key)
        self.cipher = cipher
        self._send = _aead(cipher, send_key)
        self._recv = _aead(cipher, recv_key)
        self._send_ctr = 0
        self._recv_ctr = 0

    @staticmethod
    def overhead() -> int:
        return TAG_LEN

    def reserve_send(self) -> bytes:
        """The nonce of the next outbound frame (frames must be sent in this order)."""
        if self._send_ctr >= _MAX_COUNTER:
            raise LocalProtocolError("session nonce space exhausted; reconnect")
        nonce = _NONCE.pack(self._send_ctr)
        self._send_ctr += 1
        return nonce

    def reserve_recv(self) -> bytes:
        """The nonce the next inbound frame must carry.

        :raises DecodeError: the peer exhausted the nonce space.
        """
        if self._recv_ctr >= _MAX_COUNTER:
            raise DecodeError("peer exhausted the nonce space")
        nonce = _NONCE.pack(self._recv_ctr)
        self._recv_ctr += 1
        return nonce

    def seal_with(self, nonce: bytes, header: bytes, plaintext: bytes | memoryview,
                  out: memoryview) -> None:
        """Encrypt into ``out`` (``len(plaintext) + 16`` bytes) under a reserved nonce.

        Thread-safe: callers may seal several frames in parallel (the AEAD releases the
        GIL), as long as they send them in nonce order.
        """
        self._send.encrypt_into(nonce, plaintext, header, out)

    def open_with(self, nonce: bytes, header: bytes,
                  ciphertext: bytes | bytearray | memoryview) -> bytes:
        """Decrypt one frame body under a reserved nonce (thread-safe).

        :raises DecodeError: shorter than a tag, or the tag does not verify.
        """
        if len(ciphertext) < TAG_LEN:
            raise DecodeError("encrypted frame shorter than its tag")
        try:
            return self._recv.decrypt(nonce, ciphertext, header)
        except Exception as exc:  # cryptography raises InvalidTag
            raise DecodeError("frame failed authentication") from exc

    def seal_into(self, header: bytes, plaintext: bytes | memoryview, out: memoryview) -> None:
        """Encrypt the next frame into ``out`` (exactly ``len(plaintext) + 16`` bytes)."""
        self.seal_with(self.reserve_send(), header, plaintext, out)

    def open(self, header: bytes, ciphertext: bytes | bytearray | memoryview) -> bytes:
        """Decrypt the next frame body.

        :raises DecodeError: shorter than a tag, or the tag does not verify.
        """
        return self.open_with(self.reserve_recv(), header, ciphertext)


def _decode(data: bytes | bytearray, tag: str, keys: frozenset[str]) -> dict[str, object]:
    obj = strict.unpack(data, max_bytes=MAX_HANDSHAKE_BYTES, max_str=32, max_bin=64,
                        max_array=len(CIPHERS) + 4, max_map=8)
    if not isinstance(obj, dict) or obj.get("t") != tag:
        found = obj.get("t") if isinstance(obj, dict) else type(obj).__name__
        raise DecodeError(f"handshake: expected a {tag!r} message, got {found!r:.40}")
    return dict(strict.as_map(obj, keys, f"handshake {tag}"))


def _keys(shared: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    okm = HKDF(hashes.SHA256(), 64, salt=transcript, info=_KDF_INFO).derive(shared)
    return okm[:32], okm[32:]


def _x25519(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # all-zero shared secret (small-order point)
        raise HandshakeError("handshake: degenerate ephemeral key") from exc


_HELLO_KEYS = frozenset({"t", "v", "eph", "nonce", "ciphers"})
_SERVER_KEYS = frozenset({"t", "v", "eph", "nonce", "cipher", "key", "sig"})
_AUTH_KEYS = frozenset({"t", "key", "sig"})


@dataclass(frozen=True, slots=True)
class ClientResult:
    """What the client sends last, and the session it may use at once."""

    auth: bytes
    session: Session


class ClientHandshake:
    """The dialing side. ``hello()`` then ``receive_server(bytes)``."""

    def __init__(self, identity: Identity, *, expected_peer_id: str | None,
                 ciphers: tuple[str, ...] = CIPHERS,
                 randbytes: Callable[[int], bytes] = os.urandom) -> None:
        for c in ciphers:
            _aead(c, bytes(32))
        self.identity = identity
        self.expected_peer_id = expected_peer_id
        self.ciphers = ciphers
        self._eph = X25519PrivateKey.from_private_bytes(randbytes(32))
        self._nonce = randbytes(NONCE_LEN)
        self._hello: bytes | None = None

    def hello(self) -> bytes:
        self._hello = strict.pack({
            "t": "hello", "v": VERSION, "eph": self._eph.public_key().public_bytes_raw(),
            "nonce": self._nonce, "ciphers": list(self.ciphers),
        })
        return self._hello

    def receive_server(self, data: bytes | bytearray) -> ClientResult:
        """Check the server's message; returns the auth message and the session.

        :raises HandshakeError: malformed, wrong version/cipher or bad signature.
        :raises PeerIdMismatch: the server proved a different key than expected.
        """
        if self._hello is None:
            raise LocalProtocolError("hello() first")
        try:
            m = _decode(data, "server", _SERVER_KEYS)
            strict.get_int(m, "v", VERSION, VERSION)
            eph = strict.get_bytes(m, "eph", 32)
            strict.get_bytes(m, "nonce", NONCE_LEN)
            cipher = strict.get_str(m, "cipher", 32, frozenset(self.ciphers))
            key = strict.get_bytes(m, "key", PUBLIC_KEY_LEN)
            sig = strict.get_bytes(m, "sig", SIGNATURE_LEN)
        except DecodeError as exc:
            raise HandshakeError(str(exc)) from exc
        server_id = peer_id_from_public_key(key)
        if self.expected_peer_id is not None and server_id != self.expected_peer_id:
            raise PeerIdMismatch(
                f"dialed {self.expected_peer_id} but the server proved {server_id}")
        unsigned = strict.pack({k: v for k, v in m.items() if k != "sig"})
        th_server = blake3.blake3(self._hello + unsigned).digest()
        try:
            verify_signature(key, sig, _SERVER_DOMAIN + th_server)
        except SignatureError as exc:
            raise HandshakeError("server handshake signature does not verify") from exc
        server_bytes = bytes(data)
        auth_unsigned = strict.pack({"t": "auth", "key": self.identity.public_key})
        th_client = blake3.blake3(self._hello + server_bytes + auth_unsigned).digest()
        auth = strict.pack({"t": "auth", "key": self.identity.public_key,
                            "sig": self.identity.sign(_CLIENT_DOMAIN + th_client)})
        c2s, s2c = _keys(_x25519(self._eph, eph), blake3.blake3(self._hello + server_bytes)
                         .digest())
        return ClientResult(auth, Session(key, cipher, send_key=c2s, recv_key=s2c))


class ServerHandshake:
    """The accepting side. ``receive_hello(bytes) -> reply`` then ``receive_auth(bytes)``."""

    def __init__(self, identity: Identity, *, ciphers: tuple[str, ...] = CIPHERS,
                 randbytes: Callable[[int], bytes] = os.urandom) -> None:
        for c in ciphers:
            _aead(c, bytes(32))
        self.identity = identity
        self.ciphers = ciphers
        self._eph = X25519PrivateKey.from_private_bytes(randbytes(32))
        self._nonce = randbytes(NONCE_LEN)
        self._hello: bytes | None = None
        self._server: bytes | None = None
        self._keys: tuple[bytes, bytes] | None = None
        self._cipher = ""

    def receive_hello(self, data: bytes | bytearray) -> bytes:
        """Check the client's hello; returns the signed server message.

        :raises HandshakeError: malformed, wrong version, or no common cipher.
        """
        if self._hello is not None:
            raise HandshakeError("handshake: a second hello")
        try:
            m = _decode(data, "hello", _HELLO_KEYS)
            strict.get_int(m, "v", VERSION, VERSION)
            eph = strict.get_bytes(m, "eph", 32)
            strict.get_bytes(m, "nonce", NONCE_LEN)
            offered = strict.get_list(m, "ciphers", len(CIPHERS) + 4)
        except DecodeError as exc:
            raise HandshakeError(str(exc)) from exc
        if not all(type(c) is str for c in offered):
            raise HandshakeError("handshake hello: cipher names are strings")
        common = [c for c in offered if c in self.ciphers]
        if not common:
            raise HandshakeError(f"handshake: no common cipher in {offered!r:.80}")
        self._cipher = common[0]
        hello = bytes(data)
        body = {
            "t": "server", "v": VERSION, "eph": self._eph.public_key().public_bytes_raw(),
            "nonce": self._nonce, "cipher": self._cipher, "key": self.identity.public_key,
        }
        th = blake3.blake3(hello + strict.pack(body)).digest()
        server = strict.pack({**body, "sig": self.identity.sign(_SERVER_DOMAIN + th)})
        self._hello, self._server = hello, server
        self._keys = _keys(_x25519(self._eph, eph), blake3.blake3(hello + server).digest())
        return server

    def receive_auth(self, data: bytes | bytearray) -> Session:
        """Check the client's proof of identity; returns the session.

        :raises HandshakeError: malformed, out of order, or the signature fails.
        """
        if self._hello is None or self._server is None or self._keys is None:
            raise HandshakeError("handshake: auth before hello")
        try:
            m = _decode(data, "auth", _AUTH_KEYS)
            key = strict.get_bytes(m, "key", PUBLIC_KEY_LEN)
            sig = strict.get_bytes(m, "sig", SIGNATURE_LEN)
        except DecodeError as exc:
            raise HandshakeError(str(exc)) from exc
        unsigned = strict.pack({"t": "auth", "key": key})
        th = blake3.blake3(self._hello + self._server + unsigned).digest()
        try:
            verify_signature(key, sig, _CLIENT_DOMAIN + th)
        except SignatureError as exc:
            raise HandshakeError("client handshake signature does not verify") from exc
        c2s, s2c = self._keys
        return Session(key, self._cipher, send_key=s2c, recv_key=c2s)
