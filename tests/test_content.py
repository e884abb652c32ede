"""Content addressing: layouts, pieces, state roots and signed manifests."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.content import (
    DTYPE_SIZES,
    Manifest,
    SignedManifest,
    StateLayout,
    TensorSpec,
    chunk_id,
    piece_ids_of,
    state_root,
)
from swarm.content.pieces import piece_slices
from swarm.errors import DecodeError, SignatureError, SwarmError
from swarm.identity import Identity
from swarm.wire import strict

TRAINER = Identity.from_seed(b"t" * 32)
OTHER = Identity.from_seed(b"o" * 32)

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                max_size=40)
specs = st.builds(TensorSpec, names, st.sampled_from(sorted(DTYPE_SIZES)),
                  st.lists(st.integers(0, 50), max_size=3).map(tuple))
layouts = st.lists(specs, max_size=6, unique_by=lambda s: s.name).map(
    lambda xs: StateLayout(tuple(xs)))
digests = st.binary(min_size=32, max_size=32)


@given(layouts)
def test_layout_round_trip(layout: StateLayout) -> None:
    assert StateLayout.decode(layout.encode()) == layout


def test_layout_digest_depends_on_everything() -> None:
    base = StateLayout.of([("a", "bfloat16", [2, 3]), ("b", "float32", [4])])
    variants = [
        StateLayout.of([("a", "bfloat16", [3, 2]), ("b", "float32", [4])]),
        StateLayout.of([("a", "float16", [2, 3]), ("b", "float32", [4])]),
        StateLayout.of([("b", "float32", [4]), ("a", "bfloat16", [2, 3])]),
        StateLayout.of([("A", "bfloat16", [2, 3]), ("b", "float32", [4])]),
    ]
    assert len({base.digest, *(v.digest for v in variants)}) == 5


@pytest.mark.parametrize("data", [
    b"", b"\xc1", strict.pack({"v": 2, "tensors": []}),
    strict.pack({"v": 1, "tensors": [["a", "complex64", [1]]]}),
    strict.pack({"v": 1, "tensors": [["a", "bfloat16", [-1]]]}),
    strict.pack({"v": 1, "tensors": [["a", "bfloat16", [1]], ["a", "bfloat16", [1]]]}),
    strict.pack({"v": 1, "tensors": [["a", "bfloat16", "12"]]}),
    strict.pack({"v": 1, "tensors": [], "x": 1}),
])
def test_layout_decode_rejects(data: bytes) -> None:
    with pytest.raises(DecodeError):
        StateLayout.decode(data)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_piece_ids_on_threads_are_the_pieces_in_order(threads: int) -> None:
    """Many small tensors next to large ones: pieces are hashed in runs of about equal
    bytes, one task a run, and come back in state order."""
    rng = random.Random(threads)
    sizes = [rng.choice([1, 100, 5000, 40000]) for _ in range(60)]
    layout = StateLayout.of([(f"t{i}", "uint8", [n]) for i, n in enumerate(sizes)])
    bufs = [rng.randbytes(n) for n in sizes]
    ids = piece_ids_of(bufs, layout, 4096, threads=threads)
    assert ids == [chunk_id(bufs[i][off:off + n])
                   for i, off, n in piece_slices(layout, 4096)]


def test_pieces_and_root() -> None:
    layout = StateLayout.of([("a", "uint8", [10000]), ("e", "float32", [0]),
                             ("b", "bfloat16", [3000])])
    bufs = [bytes(range(256)) * 39 + bytes(16), b"", bytes(6000)]
    ids = piece_ids_of(bufs, layout, 4096)
    assert piece_slices(layout, 4096) == [(0, 0, 4096), (0, 4096, 4096), (0, 8192, 1808),
                                          (2, 0, 4096), (2, 4096, 1904)]
    assert ids[0] == chunk_id(bufs[0][:4096]) and ids[-1] == chunk_id(bufs[2][4096:])
    assert piece_ids_of(bufs, layout, 4096, threads=1) == ids
    root = state_root(layout, ids, 4096)
    flipped = bytearray(bufs[2])
    flipped[5999] ^= 1
    other = piece_ids_of([bufs[0], b"", bytes(flipped)], layout, 4096)
    assert state_root(layout, other, 4096) != root
    assert state_root(layout, piece_ids_of(bufs, layout, 8192), 8192) != root
    with pytest.raises(ValueError):
        state_root(layout, ids[:-1], 4096)
    with pytest.raises(ValueError):
        piece_ids_of(bufs[:2], layout, 4096)
    with pytest.raises(ValueError):
        piece_ids_of(bufs, layout, 5000)


def _manifest(n_chunks: int = 3, kind: str = "delta") -> Manifest:
    return Manifest(
        run="run-1", step=7, kind=kind, base_root=b"b" * 32 if kind == "delta" else None,
        target_root=b"t" * 32, layout_digest=b"l" * 32, codec="test", piece_size=1 << 22,
        chunks=tuple((bytes([i % 256]) * 32, 1000 + i) for i in range(n_chunks)),
        keep_versions=4, time_ms=1_700_000_000_000,
    )


manifests = st.builds(
    Manifest,
    run=st.text(max_size=20), step=st.integers(0, 2**63 - 1),
    kind=st.just("delta"), base_root=digests, target_root=digests, layout_digest=digests,
    codec=st.text(max_size=10), piece_size=st.integers(1, 1 << 30),
    chunks=st.lists(st.tuples(digests, st.integers(1, 64 << 20)), max_size=20).map(tuple),
    keep_versions=st.integers(0, 100), time_ms=st.integers(0, 2**63 - 1),
)


@settings(max_examples=50)
@given(manifests)
def test_manifest_round_trip(m: Manifest) -> None:
    sm = m.sign(TRAINER)
    back = SignedManifest.decode(sm.encode(), trusted_signer=TRAINER.public_key)
    assert back == sm
    assert back.manifest.signer == TRAINER.public_key
    assert back.manifest.total_bytes == sum(s for _, s in m.chunks)


def test_keyframe_round_trip() -> None:
    sm = _manifest(kind="keyframe").sign(TRAINER)
    assert SignedManifest.decode(sm.encode()).manifest.base_root is None


def test_every_single_bit_flip_fails() -> None:
    data = _manifest(n_chunks=2).sign(TRAINER).encode()
    for bit in range(len(data) * 8):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(SwarmError):
            SignedManifest.decode(bytes(bad), trusted_signer=TRAINER.public_key)


def test_wrong_signer_refused() -> None:
    sm = _manifest().sign(OTHER)
    SignedManifest.decode(sm.encode())  # valid on its own
    with pytest.raises(SignatureError, match="expected"):
        SignedManifest.decode(sm.encode(), trusted_signer=TRAINER.public_key)


def test_signature_by_other_key_with_claimed_signer_refused() -> None:
    sm = _manifest().sign(TRAINER)
    forged = strict.pack([sm.body, OTHER.sign(b"swarm/manifest/v1\0" + sm.body)])
    with pytest.raises(SignatureError):
        SignedManifest.decode(forged)


def _resign(body: dict[str, object]) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return strict.pack([raw, TRAINER.sign(b"swarm/manifest/v1\0" + raw)])


def _body(**changes: object) -> dict[str, object]:
    sm = _manifest().sign(TRAINER)
    body = msgpack.unpackb(sm.body, raw=False)
    body.update(changes)
    return dict(sorted(body.items()))


@pytest.mark.parametrize("changes,match", [
    ({"v": 2}, "unknown format version"),
    ({"kind": "weird"}, "kind"),
    ({"step": -1}, "step"),
    ({"step": "7"}, "step"),
    ({"target": b"x" * 31}, "target"),
    ({"chunks": [[b"x" * 32, 0]]}, "chunk"),
    ({"chunks": [[b"x" * 32, 1 << 40]]}, "chunk"),
    ({"chunks": [[b"x" * 32]]}, "chunk"),
    ({"base": None}, "base"),
    ({"extra": 1}, "unexpected keys"),
    ({"seeders": []}, "seeders"),
    ({"seeders": [b"k" * 31]}, "seeders"),
    ({"seeders": [b"k" * 32, b"k" * 32]}, "seeders"),
    ({"seeders": [b"k" * 32] * 65}, "seeders"),
    ({"seeders": b"k" * 32}, "seeders"),
])
def test_malformed_bodies_refused(changes: dict[str, object], match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        SignedManifest.decode(_resign(_body(**changes)))


def test_seeders_are_signed_and_absent_when_none() -> None:
    """The other hosts of a sharded trainer, authorized in the manifest the run's key
    signs; a manifest without any keeps the body (and so the id) it had before."""
    hosts = tuple(Identity.from_seed(bytes([i]) * 32).public_key for i in (7, 8))
    plain = _manifest().sign(TRAINER)
    assert b"seeders" not in plain.body
    sm = dataclasses.replace(_manifest(), seeders=hosts).sign(TRAINER)
    back = SignedManifest.decode(sm.encode(), trusted_signer=TRAINER.public_key)
    assert back.manifest.seeders == hosts
    assert back.manifest.seeder_peer_ids == tuple(
        Identity.from_seed(bytes([i]) * 32).peer_id for i in (7, 8))
    assert back.id != plain.id


def test_non_canonical_refused() -> None:
    body = _body()
    reordered = dict(reversed(list(body.items())))
    with pytest.raises(DecodeError, match="non-canonical"):
        SignedManifest.decode(_resign(reordered))


@pytest.mark.parametrize("data", [
    b"", b"\x92", b"\xc1\xc1", b"\x93\xc4\x00\xc4\x00\xc4\x00",
    strict.pack([b"x", b"y" * 64]), strict.pack({"a": 1}), strict.pack([1, 2]),
])
def test_garbage_refused(data: bytes) -> None:
    with pytest.raises(DecodeError):
        SignedManifest.decode(data)


def test_oversized_refused_before_decoding() -> None:
    # A header announcing a 4 GiB bin must be refused without allocating it.
    huge_header = b"\x92\xc6\xff\xff\xff\xff"
    with pytest.raises(DecodeError):
        SignedManifest.decode(huge_header)
    too_big = b"\x00" * ((16 << 20) + 1)
    with pytest.raises(DecodeError, match="bound"):
        SignedManifest.decode(too_big)
    many = strict.pack([b"\x91" * 10, b"s" * 64])
    with pytest.raises(DecodeError):
        SignedManifest.decode(many)


@settings(max_examples=300)
@given(st.binary(max_size=400))
def test_fuzz_decoder_only_raises_swarm_errors(data: bytes) -> None:
    with contextlib.suppress(SwarmError):
        SignedManifest.decode(data)
