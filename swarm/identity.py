"""Ed25519 node identity: signing key, key files and the libp2p peer id.

The same 32-byte Ed25519 key signs manifests, leases and results, and is the libp2p
host key, so a multiaddr ``/ip4/.../tcp/P/p2p/12D3KooW...`` pins the signer.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from swarm.errors import KeyFileError, SignatureError

PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64
MAX_KEY_FILE_BYTES = 4096

# libp2p PublicKey protobuf: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) = 32 bytes.
_LIBP2P_ED25519_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    """Bitcoin-alphabet base58, as libp2p uses for peer ids."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    """Inverse of :func:`b58encode`; raises ValueError on a character outside the alphabet."""
    n = 0
    for ch in text:
        if ch not in _B58_INDEX:
            raise ValueError(f"invalid base58 character {ch!r}")
        n = n * 58 + _B58_INDEX[ch]
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (identity multihash of the protobuf key, base58): ``12D3KooW...``."""
    if len(public_key) != PUBLIC_KEY_LEN:
        raise ValueError("an Ed25519 public key is 32 bytes")
    encoded = _LIBP2P_ED25519_PREFIX + public_key
    return b58encode(bytes([0x00, len(encoded)]) + encoded)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the Ed25519 public key from a ``12D3KooW...`` peer id.

    :raises SignatureError: the id is not an inline Ed25519 libp2p peer id.
    """
    try:
        raw = b58decode(peer_id)
    except ValueError as exc:
        raise SignatureError(f"peer id {peer_id!r} is not base58") from exc
    expected = 2 + len(_LIBP2P_ED25519_PREFIX) + PUBLIC_KEY_LEN
    if len(raw) != expected or raw[:2] != bytes([0x00, expected - 2]):
        raise SignatureError(f"peer id {peer_id!r} is not an inline Ed25519 key")
    if raw[2:6] != _LIBP2P_ED25519_PREFIX:
        raise SignatureError(f"peer id {peer_id!r} is not an Ed25519 key")
    return raw[6:]


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Check an Ed25519 signature.

    :raises SignatureError: wrong lengths or the signature does not verify.
    """
    if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
        raise SignatureError("malformed public key or signature length")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("signature does not verify") from exc


def signing_domain(kind: str, version: int = 1, *context: str) -> bytes:
    """The prefix every signed message of ``kind`` signs before its body:
    ``swarm/<kind>/v<version>\0``, then each ``context`` part NUL-terminated (a gossip
    envelope names its topic). A signature made for one kind, version or context never
    verifies as another."""
    return b"".join(part.encode() + b"\0" for part in (f"swarm/{kind}/v{version}", *context))


def sign_message(identity: Identity, domain: bytes, body: bytes) -> bytes:
    """Sign ``body`` (canonical bytes) under ``domain`` (from :func:`signing_domain`)."""
    return identity.sign(domain + body)


def verify_message(signer: bytes, signature: bytes, domain: bytes, body: bytes) -> None:
    """Check a signature made by :func:`sign_message`.

    :raises SignatureError: wrong lengths or the signature does not verify.
    """
    verify(signer, signature, domain + body)


def is_valid_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Boolean form of :func:`verify`."""
    try:
        verify(public_key, signature, message)
    except SignatureError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    """An Ed25519 private key with its public key and libp2p peer id."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests, simulations)."""
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the key as PKCS#8 PEM, mode 0600, atomically (temp file, fsync, rename).

        :raises KeyFileError: the file exists and ``overwrite`` is false.
        """
        target = Path(path)
        if target.exists() and not overwrite:
            raise KeyFileError(f"{target} already exists; refusing to overwrite a key")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".key-", dir=target.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(self.to_pem())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a PEM key file written by :meth:`save` (or ``swarm keygen``).

        :raises KeyFileError: missing, group/world accessible, too large, malformed, or not Ed25519.
        """
        source = Path(path)
        try:
            st = source.stat()
        except FileNotFoundError as exc:
            raise KeyFileError(f"key file {source} does not exist") from exc
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {source} is not a regular file")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file {source} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
                f"readable by group or others (run: chmod 600 {source})"
            )
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"key file {source} is {st.st_size} bytes; not a key")
        data = source.read_bytes()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyFileError(f"key file {source} is not a valid unencrypted PEM key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"key file {source} holds a {type(key).__name__}, not Ed25519")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, creating a new one there if it does not exist."""
        if Path(path).exists():
            return cls.load(path)
        ident = cls.generate()
        ident.save(path)
        return ident
