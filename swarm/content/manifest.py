"""Signed manifests: what version ``step`` is made of, signed by the trainer.

Wire form: ``msgpack([body, signature])`` where ``body`` is the canonical msgpack map
below and ``signature`` is Ed25519 over ``b"swarm/manifest/v1\\0" + body``. The decoder
bounds sizes before allocating, checks every field's type and range, refuses unknown
format versions and non-canonical encodings, then checks the signature (and, when given,
that the signer is the expected trainer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.content.ids import DIGEST_LEN
from swarm.errors import DecodeError, SignatureError
from swarm.identity import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    Identity,
    peer_id_from_public_key,
    sign_message,
    signing_domain,
    verify_message,
)
from swarm.wire import strict

FORMAT_VERSION = 1
KINDS = frozenset({"delta", "keyframe"})
MAX_CHUNKS = 1 << 18
MAX_CHUNK_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 16 << 20
MAX_RUN_LEN = 128
MAX_CODEC_LEN = 64
MAX_STEP = (1 << 63) - 1
_DOMAIN = signing_domain("manifest")
_BODY_KEYS = frozenset({
    "v", "run", "step", "kind", "base", "target", "layout", "codec", "piece",
    "chunks", "keep", "time", "signer",
})
#: Most trainer seeders a manifest names (the hosts or ranks of a sharded trainer).
MAX_SEEDERS = 64


@dataclass(frozen=True, slots=True)
class Manifest:
    """One version of the policy, as the trainer publishes it.

    ``chunks`` are (BLAKE3 id, size) pairs: delta chunks for ``kind="delta"``, state
    pieces for ``kind="keyframe"``. ``base_root`` is the state root the delta applies to
    (``None`` for a keyframe); ``target_root`` the state root after applying it.
    """

    run: str
    step: int
    kind: str
    base_root: bytes | None
    target_root: bytes
    layout_digest: bytes
    codec: str
    piece_size: int
    chunks: tuple[tuple[bytes, int], ...]
    keep_versions: int = 8
    time_ms: int = 0
    signer: bytes = field(default=b"\0" * PUBLIC_KEY_LEN)
    seeders: tuple[bytes, ...] = ()
    """Public keys of other nodes the signer authorizes to seed this version's chunks as
    the trainer does (the other ranks or hosts of a sharded trainer); peers treat them
    as the trainer in the exchange. Absent from the body when empty."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}")
        if (self.kind == "delta") != (self.base_root is not None):
            raise ValueError("a delta has a base root; a keyframe has none")
        for root in (self.base_root, self.target_root, self.layout_digest):
            if root is not None and len(root) != DIGEST_LEN:
                raise ValueError("roots and digests are 32 bytes")
        if len(self.chunks) > MAX_CHUNKS:
            raise ValueError(f"at most {MAX_CHUNKS} chunks per manifest")
        if len(self.seeders) > MAX_SEEDERS or \
                any(len(k) != PUBLIC_KEY_LEN for k in self.seeders) or \
                len(set(self.seeders)) != len(self.seeders):
            raise ValueError(f"seeders are at most {MAX_SEEDERS} distinct public keys")

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.chunks)

    @property
    def chunk_ids(self) -> list[bytes]:
        return [cid for cid, _ in self.chunks]

    @property
    def signer_peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)

    @property
    def seeder_peer_ids(self) -> tuple[str, ...]:
        return tuple(peer_id_from_public_key(k) for k in self.seeders)

    def body(self) -> bytes:
        extra: dict[str, object] = {"seeders": list(self.seeders)} if self.seeders else {}
        return strict.pack({
            "v": FORMAT_VERSION,
            "run": self.run,
            "step": self.step,
            "kind": self.kind,
            "base": self.base_root,
            "target": self.target_root,
            "layout": self.layout_digest,
            "codec": self.codec,
            "piece": self.piece_size,
            "chunks": [[cid, size] for cid, size in self.chunks],
            "keep": self.keep_versions,
            "time": self.time_ms,
            "signer": self.signer,
            **extra,
        })

    def sign(self, identity: Identity) -> SignedManifest:
        """Sign with ``identity`` (the signer field is set to its public key)."""
        signed_body = Manifest(
            self.run, self.step, self.kind, self.base_root, self.target_root,
            self.layout_digest, self.codec, self.piece_size, self.chunks,
            self.keep_versions, self.time_ms, identity.public_key, self.seeders,
        )
        body = signed_body.body()
        return SignedManifest(signed_body, body, sign_message(identity, _DOMAIN, body))


@dataclass(frozen=True, slots=True)
class SignedManifest:
    """A manifest with the exact body bytes that were signed and the signature."""

    manifest: Manifest
    body: bytes
    signature: bytes

    def encode(self) -> bytes:
        return strict.pack([self.body, self.signature])

    @property
    def id(self) -> bytes:
        from swarm.content.ids import chunk_id

        return chunk_id(self.encode())

    @classmethod
    def decode(cls, data: bytes, *, trusted_signer: bytes | None = None,
               check_signature: bool = True) -> SignedManifest:
        """Strictly decode and verify a signed manifest.

        :raises DecodeError: malformed, oversized, non-canonical or unknown version.
        :raises SignatureError: bad signature, or signer is not ``trusted_signer``.
        """
        body, sig = strict.unpack_signed(data, max_bytes=MAX_MANIFEST_BYTES, what="manifest",
                                         signature_len=SIGNATURE_LEN)
        manifest = decode_body(body)
        if trusted_signer is not None and manifest.signer != trusted_signer:
            raise SignatureError(
                f"manifest signed by {manifest.signer_peer_id}, expected "
                f"{peer_id_from_public_key(trusted_signer)}"
            )
        if check_signature:
            verify_message(manifest.signer, sig, _DOMAIN, body)
        return cls(manifest, body, sig)

    def verify(self) -> bool:
        try:
            verify_message(self.manifest.signer, self.signature, _DOMAIN, self.body)
        except SignatureError:
            return False
        return True


def decode_body(body: bytes) -> Manifest:
    """:raises DecodeError: the body is not a valid canonical manifest body."""
    obj = strict.unpack(body, max_bytes=MAX_MANIFEST_BYTES, max_bin=DIGEST_LEN,
                        max_array=MAX_CHUNKS, max_map=len(_BODY_KEYS) + 1, max_str=MAX_RUN_LEN)
    if isinstance(obj, dict) and "v" in obj and obj["v"] != FORMAT_VERSION:
        raise DecodeError(f"manifest: unknown format version {obj['v']!r}")
    with_seeders = isinstance(obj, dict) and "seeders" in obj
    m = strict.as_map(obj, _BODY_KEYS | {"seeders"} if with_seeders else _BODY_KEYS,
                      "manifest")
    seeders: list[bytes] = []
    if with_seeders:
        rows = strict.get_list(m, "seeders", MAX_SEEDERS)
        if not rows or any(type(k) is not bytes or len(k) != PUBLIC_KEY_LEN for k in rows):
            raise DecodeError(f"manifest: seeders are 1..{MAX_SEEDERS} public keys of "
                              f"{PUBLIC_KEY_LEN} bytes (absent when none)")
        seeders = rows
    strict.get_int(m, "v", FORMAT_VERSION, FORMAT_VERSION)
    kind = strict.get_str(m, "kind", 16, KINDS)
    base: bytes | None
    if kind == "keyframe":
        if m["base"] is not None:
            raise DecodeError("manifest: a keyframe has no base root")
        base = None
    else:
        base = strict.get_bytes(m, "base", DIGEST_LEN)
    rows = strict.get_list(m, "chunks", MAX_CHUNKS)
    chunks = []
    for row in rows:
        if (type(row) is not list or len(row) != 2 or type(row[0]) is not bytes
                or len(row[0]) != DIGEST_LEN or type(row[1]) is not int
                or not 0 < row[1] <= MAX_CHUNK_BYTES):
            raise DecodeError("manifest: each chunk is [32-byte id, size in 1..64 MiB]")
        chunks.append((row[0], row[1]))
    try:
        return Manifest(
            run=strict.get_str(m, "run", MAX_RUN_LEN),
            step=strict.get_int(m, "step", 0, MAX_STEP),
            kind=kind,
            base_root=base,
            target_root=strict.get_bytes(m, "target", DIGEST_LEN),
            layout_digest=strict.get_bytes(m, "layout", DIGEST_LEN),
            codec=strict.get_str(m, "codec", MAX_CODEC_LEN),
            piece_size=strict.get_int(m, "piece", 1, 1 << 30),
            chunks=tuple(chunks),
            keep_versions=strict.get_int(m, "keep", 0, 1 << 20),
            time_ms=strict.get_int(m, "time", 0, MAX_STEP),
            signer=strict.get_bytes(m, "signer", PUBLIC_KEY_LEN),
            seeders=tuple(seeders),
        )
    except ValueError as exc:
        raise DecodeError(f"manifest: {exc}") from exc
