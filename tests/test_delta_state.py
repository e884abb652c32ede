"""State roots over every core, pieces to serve, and keyframes for late joiners."""

from __future__ import annotations

import pytest
import torch
from test_delta_helpers import clone_state, raw_bytes, same_bits

from swarm.content.ids import chunk_id
from swarm.content.pieces import piece_ids_of, piece_slices, state_root
from swarm.delta import (
    KeyframeFiller,
    keyframe_manifest,
    layout_of,
    piece_views,
    state_root_of,
)
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError
from swarm.identity import Identity

pytestmark = pytest.mark.timeout(60)

PIECE = 1 << 12
IDENTITY = Identity.from_seed(b"\x03" * 32)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(300, 40, generator=g).to(torch.bfloat16),
        "norm": torch.ones(40),
        "empty": torch.zeros(0, 8, dtype=torch.float16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(5000, generator=g) < 0.5,
    }


def test_root_equals_content_root_over_raw_bytes() -> None:
    state = _state(1)
    layout = layout_of(state)
    raw = [raw_bytes(t) for t in state.values()]
    expected = state_root(layout, piece_ids_of(raw, layout, PIECE, threads=1), PIECE)
    assert state_root_of(state, PIECE) == expected
    assert state_root_of(state, PIECE, threads=1) == expected


def test_root_sees_every_bit() -> None:
    state = _state(2)
    root = state_root_of(state, PIECE)
    flipped = clone_state(state)
    flipped["norm"].view(torch.int32)[39] ^= 1 << 31  # +1.0 -> -1.0 in the last element
    assert state_root_of(flipped, PIECE) != root
    renamed = {("x" if k == "norm" else k): v for k, v in state.items()}
    assert state_root_of(renamed, PIECE) != root


def test_piece_views_serve_every_piece_without_a_copy() -> None:
    state = _state(3)
    signed = keyframe_manifest(state, IDENTITY, "run", 5, piece_size=PIECE)
    views = piece_views(state, PIECE)
    assert sorted(views) == list(range(len(signed.manifest.chunks)))
    for i, (cid, size) in enumerate(signed.manifest.chunks):
        assert views[i].readonly and len(views[i]) == size and chunk_id(views[i]) == cid
    # Views of the live state: a write shows through, which is why a peer withdraws them
    # before it patches its state.
    state["emb"].view(torch.uint8).reshape(-1)[0] ^= 0xFF
    assert chunk_id(views[0]) != signed.manifest.chunks[0][0]


def test_keyframe_fills_a_late_joiner_in_any_order() -> None:
    state = _state(4)
    signed = keyframe_manifest(state, IDENTITY, "run", 9, piece_size=PIECE)
    assert signed.manifest.kind == "keyframe" and signed.verify()
    layout = layout_of(state)
    slices = piece_slices(layout, PIECE)
    joiner = {k: torch.zeros_like(v) for k, v in state.items()}
    filler = KeyframeFiller(joiner, signed)
    pieces = piece_views(state, PIECE)
    order = list(range(len(slices)))[::-1]
    for i in order[:-1]:
        filler.put_piece(i, pieces[i])
    with pytest.raises(LocalProtocolError):
        filler.finish()
    assert filler.missing == {order[-1]}
    filler.put_piece(order[-1], bytes(pieces[order[-1]]))
    assert filler.finish() == signed.manifest.target_root
    assert same_bits(joiner, state)


def test_keyframe_rejects_bad_pieces_and_layouts() -> None:
    state = _state(5)
    signed = keyframe_manifest(state, IDENTITY, "run", 9, piece_size=PIECE)
    joiner = {k: torch.zeros_like(v) for k, v in state.items()}
    filler = KeyframeFiller(joiner, signed)
    good = bytes(piece_views(state, PIECE)[0])
    bad = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(IntegrityError):
        filler.put_piece(0, bad)
    with pytest.raises(DecodeError):
        filler.put_piece(0, good[:-1])
    with pytest.raises(DecodeError):
        filler.put_piece(len(signed.manifest.chunks), good)
    assert all(not t.any() for t in joiner.values() if t.numel())
    wrong = dict(joiner)
    wrong["norm"] = torch.zeros(41)
    with pytest.raises(IntegrityError):
        KeyframeFiller(wrong, signed)


def test_non_cpu_or_strided_tensors_are_refused_clearly() -> None:
    state = {"t": torch.zeros(4, 4).t()}
    with pytest.raises(LocalProtocolError):
        state_root_of(state, PIECE)
    with pytest.raises(LocalProtocolError):
        layout_of({"c": torch.zeros(2, dtype=torch.complex64)})
