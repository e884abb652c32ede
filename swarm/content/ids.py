"""BLAKE3 content ids."""

from __future__ import annotations

import blake3

DIGEST_LEN = 32
# Inputs at least this large are hashed with blake3's internal threads (it releases the GIL).
_THREADED_MIN = 1 << 22


def chunk_id(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte BLAKE3 digest that names a chunk or piece."""
    if len(data) >= _THREADED_MIN:
        return bytes(blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest())
    return bytes(blake3.blake3(data).digest())


def domain_hash(domain: str, *parts: bytes) -> bytes:
    """BLAKE3 over a domain tag and length-prefixed parts (no ambiguity between fields)."""
    h = blake3.blake3(domain.encode() + b"\0")
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return bytes(h.digest())


def hex_id(digest: bytes, short: bool = False) -> str:
    text = digest.hex()
    return text[:12] if short else text
