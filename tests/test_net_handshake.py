"""Data-plane handshake (sans-IO): mutual authentication, key agreement, fuzzing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import DecodeError, LocalProtocolError
from swarm.identity import Identity
from swarm.net.handshake import ClientHandshake, HandshakeError, ServerHandshake, Session
from swarm.net.transport import PeerIdMismatch
from swarm.wire import strict

CLIENT = Identity.from_seed(bytes([1]) * 32)
SERVER = Identity.from_seed(bytes([2]) * 32)


def rand(seed: int) -> random.Random:
    return random.Random(seed)


def pair(seed: int = 0, *, expected: str | None = SERVER.peer_id
         ) -> tuple[ClientHandshake, ServerHandshake]:
    r = rand(seed)
    return (ClientHandshake(CLIENT, expected_peer_id=expected, randbytes=r.randbytes),
            ServerHandshake(SERVER, randbytes=r.randbytes))


def run(client: ClientHandshake, server: ServerHandshake) -> tuple[Session, Session]:
    reply = server.receive_hello(client.hello())
    result = client.receive_server(reply)
    return result.session, server.receive_auth(result.auth)


def roundtrip(a: Session, b: Session, payload: bytes) -> bytes:
    out = bytearray(len(payload) + 16)
    a.seal_into(b"hdr!", payload, memoryview(out))
    return b.open(b"hdr!", out)


def test_both_sides_learn_the_authenticated_peer_and_share_keys() -> None:
    cs, ss = run(*pair())
    assert cs.peer_id == SERVER.peer_id and ss.peer_id == CLIENT.peer_id
    assert cs.cipher == ss.cipher == "aes-256-gcm"
    assert roundtrip(cs, ss, b"to server") == b"to server"
    assert roundtrip(ss, cs, b"to client") == b"to client"
    # Nonces advance: a replayed frame fails.
    out = bytearray(21)
    cs.seal_into(b"hdr!", b"again", memoryview(out))
    assert ss.open(b"hdr!", out) == b"again"
    with pytest.raises(DecodeError):
        ss.open(b"hdr!", out)


def test_cipher_negotiation_and_no_common_cipher() -> None:
    r = rand(1)
    client = ClientHandshake(CLIENT, expected_peer_id=None, ciphers=("chacha20-poly1305",),
                             randbytes=r.randbytes)
    cs, ss = run(client, ServerHandshake(SERVER, randbytes=r.randbytes))
    assert cs.cipher == ss.cipher == "chacha20-poly1305"
    client = ClientHandshake(CLIENT, expected_peer_id=None, ciphers=("chacha20-poly1305",))
    server = ServerHandshake(SERVER, ciphers=("aes-256-gcm",))
    with pytest.raises(HandshakeError, match="no common cipher"):
        server.receive_hello(client.hello())
    with pytest.raises(LocalProtocolError):
        ClientHandshake(CLIENT, expected_peer_id=None, ciphers=("rot13",))


def test_wrong_server_identity_is_a_peer_id_mismatch() -> None:
    other = Identity.from_seed(bytes([3]) * 32)
    client, server = pair(expected=other.peer_id)
    with pytest.raises(PeerIdMismatch, match=other.peer_id):
        client.receive_server(server.receive_hello(client.hello()))


def test_a_recorded_server_reply_cannot_be_replayed_to_another_client() -> None:
    c1, s1 = pair(1)
    reply = s1.receive_hello(c1.hello())
    c2, _ = pair(2)
    c2.hello()
    with pytest.raises(HandshakeError, match="signature"):
        c2.receive_server(reply)


def test_auth_signed_by_someone_else_is_rejected() -> None:
    client, server = pair()
    result = client.receive_server(server.receive_hello(client.hello()))
    m = strict.unpack(result.auth, max_bytes=1024)
    m["key"] = Identity.from_seed(bytes([4]) * 32).public_key
    with pytest.raises(HandshakeError, match="signature"):
        server.receive_auth(strict.pack(m))


def test_messages_out_of_order_are_rejected() -> None:
    client, server = pair()
    with pytest.raises(HandshakeError, match="auth before hello"):
        server.receive_auth(client.hello())
    hello = client.hello()
    server.receive_hello(hello)
    with pytest.raises(HandshakeError):
        server.receive_hello(hello)
    with pytest.raises(HandshakeError):
        server.receive_auth(hello)  # a hello where the auth belongs


@pytest.mark.parametrize("bad", [
    b"\xc1",                                            # malformed msgpack
    strict.pack([1, 2, 3]),                             # wrong type
    strict.pack({"t": "bogus"}),                        # unknown tag
    strict.pack({"t": "hello", "v": 1, "eph": "x" * 32, "nonce": bytes(32),
                 "ciphers": ["aes-256-gcm"]}),          # wrong field type
    strict.pack({"t": "hello", "v": 2, "eph": bytes(32), "nonce": bytes(32),
                 "ciphers": ["aes-256-gcm"]}),          # unknown version
    bytes(2000),                                        # oversized
])
def test_malformed_hello_is_a_handshake_error(bad: bytes) -> None:
    with pytest.raises(HandshakeError):
        ServerHandshake(SERVER).receive_hello(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzzed_input_raises_only_handshake_errors(data: bytes) -> None:
    client, server = pair()
    client.hello()
    for step in (server.receive_hello, client.receive_server, server.receive_auth):
        with pytest.raises((HandshakeError, PeerIdMismatch)):
            step(data)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["hello", "server", "auth"]), st.integers(0, 10_000), st.integers(1, 255))
def test_any_tampered_byte_fails_the_handshake(which: str, where: int, xor: int) -> None:
    client, server = pair()

    def tamper(msg: bytes) -> bytes:
        b = bytearray(msg)
        b[where % len(b)] ^= xor
        return bytes(b)

    hello = client.hello()
    with pytest.raises((HandshakeError, PeerIdMismatch)):
        reply = server.receive_hello(tamper(hello) if which == "hello" else hello)
        result = client.receive_server(tamper(reply) if which == "server" else reply)
        server.receive_auth(tamper(result.auth) if which == "auth" else result.auth)
