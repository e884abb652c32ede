"""Identity keys: key files, permissions, signatures and libp2p peer ids."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarm.errors import KeyFileError, SignatureError
from swarm.identity import (
    Identity,
    b58decode,
    b58encode,
    is_valid_signature,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify,
)


def test_peer_id_equals_py_libp2p() -> None:
    from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pKey
    from libp2p.peer.id import ID

    for i in range(8):
        ident = Identity.from_seed(bytes([i]) * 32)
        theirs = Libp2pKey.from_bytes(ident.seed).get_public_key()
        assert ID.from_pubkey(theirs).to_base58() == ident.peer_id
        assert ident.peer_id.startswith("12D3KooW")
        assert public_key_from_peer_id(ident.peer_id) == ident.public_key


@given(st.binary(max_size=64))
def test_base58_round_trip(data: bytes) -> None:
    assert b58decode(b58encode(data)) == data


def test_save_load_round_trip_and_mode(tmp_path: Path) -> None:
    ident = Identity.generate()
    path = ident.save(tmp_path / "sub" / "node.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).public_key == ident.public_key
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left


def test_save_refuses_overwrite(tmp_path: Path) -> None:
    path = Identity.generate().save(tmp_path / "k")
    with pytest.raises(KeyFileError, match="already exists"):
        Identity.generate().save(path)
    Identity.generate().save(path, overwrite=True)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_load_refuses_group_or_world_readable(tmp_path: Path, mode: int) -> None:
    path = Identity.generate().save(tmp_path / "k")
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"not a key", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
     b"x" * 10000],
)
def test_load_refuses_malformed(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "k"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError):
        Identity.load(path)


def test_load_refuses_other_key_types(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "k"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match="not Ed25519"):
        Identity.load(path)


def test_load_missing(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        Identity.load(tmp_path / "nope")


def test_signatures() -> None:
    a, b = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
    sig = a.sign(b"hello")
    verify(a.public_key, sig, b"hello")
    assert not is_valid_signature(b.public_key, sig, b"hello")
    assert not is_valid_signature(a.public_key, sig, b"hellp")
    with pytest.raises(SignatureError):
        verify(a.public_key, sig[:-1], b"hello")


@pytest.mark.parametrize(
    "bad", ["", "0OIl", "12D3KooW", "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"])
def test_public_key_from_bad_peer_id(bad: str) -> None:
    with pytest.raises(SignatureError):
        public_key_from_peer_id(bad)


def test_peer_id_rejects_wrong_key_length() -> None:
    with pytest.raises(ValueError):
        peer_id_from_public_key(b"x" * 31)


def test_signed_messages_share_one_domain_rule() -> None:
    """Manifests, lease messages and gossip envelopes sign ``domain + body`` with the
    domains they always had on the wire; a signature of one kind or topic never verifies
    as another."""
    from swarm.errors import SignatureError
    from swarm.identity import sign_message, signing_domain, verify_message

    assert signing_domain("manifest") == b"swarm/manifest/v1\0"
    assert signing_domain("claim", 1) == b"swarm/claim/v1\0"
    assert signing_domain("gossip", 1, "/swarm/r/have/1") == b"swarm/gossip/v1\0/swarm/r/have/1\0"
    me = Identity.from_seed(b"d" * 32)
    sig = sign_message(me, signing_domain("manifest"), b"body")
    verify_message(me.public_key, sig, signing_domain("manifest"), b"body")
    for other in (signing_domain("lease"), signing_domain("manifest", 2),
                  signing_domain("gossip", 1, "t")):
        with pytest.raises(SignatureError):
            verify_message(me.public_key, sig, other, b"body")
