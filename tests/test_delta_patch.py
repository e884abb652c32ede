"""Patching: wrong bases are refused before any write; corrupt, truncated or oversized
chunks are rejected before the state is touched; a bad target reverts everything."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_delta_helpers import clone_state, gaussian_bf16_pair, same_bits

from swarm.content.manifest import MAX_CHUNK_BYTES, Manifest
from swarm.delta import (
    EncoderConfig,
    Patcher,
    apply_chunk,
    decode_chunk,
    encode_delta_sync,
    layout_of,
)
from swarm.delta.codec import CODEC_NAME, state_views
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError, SwarmError
from swarm.identity import Identity
from swarm.wire import strict

pytestmark = pytest.mark.timeout(120)

IDENTITY = Identity.from_seed(b"\x07" * 32)
CFG = EncoderConfig(segment_elems=4096, chunk_target=200)


@pytest.fixture(scope="module")
def delta() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], object, list[object]]:
    old, new = gaussian_bf16_pair(1 << 15, 0.02, seed=11)
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 4, config=CFG)
    assert len(chunks) >= 2
    return old, new, signed, chunks


def _resign(signed: object, **changes: object) -> object:
    m = signed.manifest  # type: ignore[attr-defined]
    fields = {f: getattr(m, f) for f in Manifest.__dataclass_fields__}
    fields.update(changes)
    return Manifest(**fields).sign(IDENTITY)  # type: ignore[arg-type]


def test_wrong_base_is_refused_before_any_write(delta) -> None:  # type: ignore[no-untyped-def]
    old, new, signed, _ = delta
    state = clone_state(new)  # already at the target: not the base
    with pytest.raises(IntegrityError):
        Patcher(state, signed)
    assert same_bits(state, new)
    other = clone_state(old)
    other["extra"] = torch.zeros(1)
    with pytest.raises(IntegrityError):
        Patcher(other, signed)


def test_chunk_with_wrong_bytes_or_unknown_id_is_rejected(delta) -> None:  # type: ignore[no-untyped-def]
    old, _, signed, chunks = delta
    state = clone_state(old)
    p = Patcher(state, signed)
    data = bytearray(chunks[0].data)
    data[-1] ^= 1
    with pytest.raises(IntegrityError):
        p.apply(chunks[0].cid, bytes(data))
    with pytest.raises(IntegrityError):
        p.apply(b"\x00" * 32, chunks[0].data)
    with pytest.raises(IntegrityError):
        p.apply(chunks[0].cid, chunks[0].data[:-1])
    assert same_bits(state, old)
    assert p.missing == set(signed.manifest.chunk_ids)


def test_duplicates_ignored_missing_refused(delta) -> None:  # type: ignore[no-untyped-def]
    old, new, signed, chunks = delta
    state = clone_state(old)
    p = Patcher(state, signed)
    assert p.apply(chunks[0].cid, chunks[0].data) == {"w"}
    assert p.apply(chunks[0].cid, chunks[0].data) == frozenset()
    with pytest.raises(LocalProtocolError):
        p.finish()
    for c in chunks[1:]:
        p.apply(c.cid, c.data)
    assert p.finish() == {"w"}
    assert same_bits(state, new)
    with pytest.raises(LocalProtocolError):
        p.apply(chunks[0].cid, chunks[0].data)


def test_target_mismatch_reverts_everything(delta) -> None:  # type: ignore[no-untyped-def]
    old, _, signed, chunks = delta
    bad = _resign(signed, target_root=b"\x01" * 32)
    state = clone_state(old)
    p = Patcher(state, bad)
    for c in chunks:
        p.apply(c.cid, c.data)
    assert not same_bits(state, old)
    with pytest.raises(IntegrityError):
        p.finish()
    assert same_bits(state, old)


def test_a_decodable_forgery_is_caught_by_the_root_and_reverted(delta) -> None:  # type: ignore[no-untyped-def]
    """A chunk the manifest names but whose content is wrong (flipped sign bits) applies,
    then the root check fails and the state is restored exactly."""
    from swarm.content.ids import chunk_id

    old, _, signed, chunks = delta
    outer = msgpack.unpackb(chunks[0].data)
    outer[1][0][6] = bytes(b ^ 0xFF for b in outer[1][0][6][:-1]) + outer[1][0][6][-1:]
    forged = strict.pack(outer)
    rows = [(chunk_id(forged), len(forged))] + [(c.cid, len(c.data)) for c in chunks[1:]]
    bad = _resign(signed, chunks=tuple(rows))
    state = clone_state(old)
    p = Patcher(state, bad)
    p.apply(chunk_id(forged), forged)
    for c in chunks[1:]:
        p.apply(c.cid, c.data)
    with pytest.raises(IntegrityError):
        p.finish()
    assert same_bits(state, old)


@pytest.mark.parametrize("engine", ["c", "torch"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_signed_chunk_that_does_not_fit_the_state_is_undone_exactly(
        engine: str, where: str) -> None:
    """A chunk whose id matches (so it is what the trainer signed) but whose changes fall
    past a class's population in this state: the Patcher writes as it places, so the
    segments already written are undone before DecodeError and the state is bit-identical."""
    from swarm.content.ids import chunk_id

    old, new = gaussian_bf16_pair(1 << 15, 0.02, seed=12)
    _, chunks = encode_delta_sync(old, new, IDENTITY, "run", 4,
                                  config=EncoderConfig(segment_elems=4096,
                                                       chunk_target=1 << 20))
    assert len(chunks) == 1 and len(_segments(chunks[0].data)) == 8
    other = clone_state(old)
    flat = other["w"].view(-1)
    part = slice(0, 4096) if where == "first" else slice(7 * 4096, 8 * 4096)
    flat[part] = 0  # one class only there: that segment's changes cannot be placed
    from swarm.delta import state_root_of

    signed = encode_delta_sync(old, new, IDENTITY, "run", 4)[0]
    bad = _resign(signed, base_root=state_root_of(other),
                  chunks=((chunk_id(chunks[0].data), len(chunks[0].data)),))
    before = clone_state(other)
    p = Patcher(other, bad, engine=engine)
    with pytest.raises(DecodeError, match="past its class population"):
        p.apply(chunks[0].cid, chunks[0].data)
    assert same_bits(other, before)
    assert p.missing == {chunks[0].cid}


def test_non_canonical_chunks_are_refused_unless_their_bytes_are_pinned(delta) -> None:  # type: ignore[no-untyped-def]
    """Unverified bytes must be canonical msgpack; a Patcher, which checked the bytes
    against their id, does not re-encode the container to check it."""
    from swarm.content.ids import chunk_id
    from swarm.delta.codec import parse_chunk

    old, new, signed, chunks = delta
    data = chunks[0].data
    head = 1 + 10  # fixarray(2), fixstr "swarm-xg1"
    assert data[head] & 0xF0 == 0x90 and data[head + 1] == 0x98 and data[head + 2] < 0x80
    wide = data[:head + 2] + bytes([0xCC, data[head + 2]]) + data[head + 3:]  # uint8 form
    assert parse_chunk(wide, canonical=False) == parse_chunk(data)
    with pytest.raises(DecodeError, match="non-canonical"):
        apply_chunk(clone_state(old), wide)
    rows = [(chunk_id(wide), len(wide))] + [(c.cid, len(c.data)) for c in chunks[1:]]
    state = clone_state(old)
    p = Patcher(state, _resign(signed, chunks=tuple(rows)))
    p.apply(chunk_id(wide), wide)
    for c in chunks[1:]:
        p.apply(c.cid, c.data)
    p.finish()
    assert same_bits(state, new)


def test_explicit_revert_restores_base(delta) -> None:  # type: ignore[no-untyped-def]
    old, _, signed, chunks = delta
    state = clone_state(old)
    p = Patcher(state, signed)
    p.apply(chunks[-1].cid, chunks[-1].data)
    p.revert()
    assert same_bits(state, old)
    assert p.missing == set(signed.manifest.chunk_ids)


def _segments(data: bytes) -> list[list[object]]:
    obj = msgpack.unpackb(data)
    return obj[1]  # type: ignore[no-any-return]


def _with_segment(data: bytes, field: int, value: object) -> bytes:
    segs = _segments(data)
    segs[0][field] = value
    return strict.pack([CODEC_NAME, segs])


CORRUPTIONS = {
    "tensor index out of range": (0, 9),
    "negative start": (1, -1),
    "segment past the tensor": (1, 1 << 15),
    "zero count": (2, 0),
    "more changes than elements": (3, 1 << 20),
    "change count off by one": (3, None),
    "class table ragged": (4, b"\x00" * 5),
    "class id out of range": (4, b"\xff\x7f" + b"\x01\x00\x00\x00" + b"\x00"),
    "gap stream truncated": (5, None),
    "gap stream oversized": (5, b"\xff" * 100_000),
    "sign stream short": (6, b""),
    "magnitudes not zstd": (7, b"not zstd at all"),
    "magnitudes declare a huge size": (7, None),
}


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_corrupt_segments_raise_decode_error_before_writing(delta, what: str) -> None:  # type: ignore[no-untyped-def]
    import zstandard

    old, _, _, chunks = delta
    field, value = CORRUPTIONS[what]
    seg = _segments(chunks[0].data)[0]
    if what == "change count off by one":
        value = seg[3] + 1
    elif what == "gap stream truncated":
        value = seg[5][: len(seg[5]) // 2]
    elif what == "magnitudes declare a huge size":
        value = zstandard.ZstdCompressor().compress(b"\x00" * (1 << 20))
    data = _with_segment(chunks[0].data, field, value)
    state = clone_state(old)
    with pytest.raises(DecodeError):
        apply_chunk(state, data)
    assert same_bits(state, old)


def test_truncated_oversized_and_foreign_chunks(delta) -> None:  # type: ignore[no-untyped-def]
    old, _, _, chunks = delta
    state = clone_state(old)
    data = chunks[0].data
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        with pytest.raises(DecodeError):
            apply_chunk(state, data[:cut])
    with pytest.raises(DecodeError):
        apply_chunk(state, b"\x00" * (MAX_CHUNK_BYTES + 1))
    with pytest.raises(DecodeError):
        apply_chunk(state, strict.pack(["other-codec", _segments(data)]))
    with pytest.raises(DecodeError):
        apply_chunk(state, strict.pack([CODEC_NAME, []]))
    segs = _segments(data)
    with pytest.raises(DecodeError):  # the same segment twice (overlap)
        apply_chunk(state, strict.pack([CODEC_NAME, [segs[0], segs[0]]]))
    assert same_bits(state, old)


@settings(max_examples=150, deadline=None)
@given(pos=st.integers(0, 10**9), xor=st.integers(1, 255), cut=st.integers(0, 10**9))
def test_fuzzed_chunks_never_crash_or_write(pos: int, xor: int, cut: int) -> None:
    old, _new = gaussian_bf16_pair(4096, 0.05, seed=2)
    data = _FUZZ_CHUNK
    mutated = bytearray(data)
    mutated[pos % len(data)] ^= xor
    candidates = [bytes(mutated), bytes(mutated[: cut % len(data)])]
    layout = layout_of(old)
    for cand in candidates:
        state = clone_state(old)
        views = state_views(state, layout)
        try:
            decode_chunk(cand, layout, views)
        except SwarmError as exc:
            assert isinstance(exc, DecodeError)
        assert same_bits(state, old)


def _fuzz_chunk() -> bytes:
    old, new = gaussian_bf16_pair(4096, 0.05, seed=2)
    _, chunks = encode_delta_sync(old, new, IDENTITY, "run", 1,
                                  config=EncoderConfig(segment_elems=1024))
    assert len(chunks) == 1
    return chunks[0].data


_FUZZ_CHUNK = _fuzz_chunk()


def test_state_must_match_layout_for_apply(delta) -> None:  # type: ignore[no-untyped-def]
    old, _, _, chunks = delta
    state = {"w": old["w"].float(), "b": old["b"].clone()}
    with pytest.raises(LocalProtocolError):
        apply_chunk(state, chunks[0].data, layout_of(old))
    _ = np  # numpy is used by helpers through fixtures


def test_parallel_segment_decode_patches_identically(delta) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    old, new, _, _ = delta
    signed, chunks = encode_delta_sync(old, new, IDENTITY, "run", 4,
                                       config=EncoderConfig(segment_elems=4096))
    assert len(chunks) == 1 and len(msgpack.unpackb(chunks[0].data)[1]) > 4
    state = clone_state(old)
    with ThreadPoolExecutor(max_workers=2) as pool:
        p = Patcher(state, signed, executor=pool)
        for c in chunks:
            p.apply(c.cid, c.data)
        assert p.finish() == {"w"}
    assert same_bits(state, new)


def test_changes_per_chunk_are_bounded_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder closes chunks before the decoder's change bound; the decoder refuses a
    chunk declaring more changes before allocating for them."""
    from swarm.delta import codec, pipeline

    old, new = gaussian_bf16_pair(1 << 15, 0.05, seed=4)
    big = list(pipeline.delta_chunks(old, new, EncoderConfig(segment_elems=2048)))
    assert len(big) == 1 and big[0].changes > 400
    monkeypatch.setattr(pipeline, "MAX_CHUNK_CHANGES", 400)
    small = list(pipeline.delta_chunks(old, new, EncoderConfig(segment_elems=2048)))
    assert len(small) > 3 and all(c.changes <= 400 for c in small)
    monkeypatch.setattr(codec, "MAX_CHUNK_CHANGES", 400)
    state = clone_state(old)
    with pytest.raises(DecodeError):
        apply_chunk(state, big[0].data)
    assert same_bits(state, old)
    for c in small:
        apply_chunk(state, c.data)
    assert same_bits(state, new)
