"""Run cards: strict signed encoding, and what a peer checks before it builds the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.content.card import RunCard, SignedCard, card_files, stop_ids_of
from swarm.delta.state import layout_of, state_root_of
from swarm.demo.model import TinyModelConfig, build_model, inference_state
from swarm.engines.hf_model import (
    CardUnsupported,
    check_card,
    check_layout,
    load_base_weights,
    model_config_json,
)
from swarm.engines.hf_model import (
    build_model as build_from_card,
)
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError, SignatureError
from swarm.identity import Identity
from swarm.wire import strict

TRAINER = Identity.from_seed(b"\1" * 32)
OTHER = Identity.from_seed(b"\2" * 32)
SHAPE = TinyModelConfig()


def _card(files: tuple[tuple[str, bytes], ...] = (), **over: object) -> RunCard:
    model = build_model(SHAPE)
    state = inference_state(model)
    fields: dict[str, object] = dict(
        run="r1", config=model_config_json(model), files=files, dtype="bfloat16",
        layout_digest=layout_of(state).digest, codec="swarm-xg1",
        root=state_root_of(state, 1 << 16), piece_size=1 << 16, stop_token_ids=(0, 2))
    fields.update(over)
    return RunCard(**fields)  # type: ignore[arg-type]


def test_a_signed_card_round_trips_and_is_content_addressed() -> None:
    signed = _card((("tokenizer.json", b"{}"),)).sign(TRAINER)
    back = SignedCard.decode(signed.encode(), trusted_signer=TRAINER.public_key, run="r1")
    assert back.card == signed.card and back.id == signed.id
    assert back.card.signer_peer_id == TRAINER.peer_id
    assert back.card.file("tokenizer.json") == b"{}"


def test_a_card_from_another_signer_run_or_with_a_flipped_byte_is_refused() -> None:
    data = _card().sign(TRAINER).encode()
    with pytest.raises(SignatureError, match="expected"):
        SignedCard.decode(data, trusted_signer=OTHER.public_key)
    with pytest.raises(IntegrityError, match="run 'r1'"):
        SignedCard.decode(data, run="r2")
    body, sig = strict.unpack(data, max_bytes=1 << 24, max_bin=1 << 24)
    flipped = bytearray(body)
    at = flipped.index(b"qwen3")
    flipped[at] ^= 0x20
    with pytest.raises((SignatureError, DecodeError)):
        SignedCard.decode(strict.pack([bytes(flipped), sig]))
    with pytest.raises(DecodeError):
        SignedCard.decode(b"\x92\xc4\x01x")


@pytest.mark.parametrize(("files", "match"), [
    ((("config.json", b"{}"),), "refused"),
    ((("model.safetensors", b""),), "refused"),
    ((("../x", b""),), "refused"),
    ((("b", b""), ("a", b"")), "sorted"),
])
def test_weights_paths_and_unsorted_files_never_make_a_card(files: tuple[tuple[str, bytes], ...],
                                                            match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        _card(files)


def test_a_config_that_names_no_model_type_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="model_type"):
        _card(config=json.dumps({"hidden_size": 8}))


def test_the_model_built_from_the_card_is_version_0_and_base_weights_load(tmp_path: Path
                                                                          ) -> None:
    card = _card()
    assert check_card(card) > 0
    state = inference_state(build_from_card(card), card.dtype)
    check_layout(card, state)
    assert state_root_of(state, card.piece_size) == card.root
    # a volunteer's checkpoint of the same weights, loaded over a differently seeded model
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "m.safetensors"))
    other = build_from_card(card, seed=5)
    assert state_root_of(inference_state(other), card.piece_size) != card.root
    assert load_base_weights(tmp_path, other) == len(state)
    assert state_root_of(inference_state(other), card.piece_size) == card.root


def test_base_weights_saved_with_tied_embeddings_fill_both_names(tmp_path: Path) -> None:
    """save_pretrained writes a tied tensor once (the embedding): the head follows it."""
    tied = json.loads(_card().config)
    tied["tie_word_embeddings"] = True
    model = build_from_card(_card(config=json.dumps(tied)), seed=3)
    model.save_pretrained(tmp_path)
    card = _card(config=json.dumps(tied))
    card = _card(config=card.config, layout_digest=layout_of(inference_state(model)).digest,
                 root=state_root_of(inference_state(model), 1 << 16))
    fresh = build_from_card(card)
    assert state_root_of(inference_state(fresh), 1 << 16) != card.root
    load_base_weights(tmp_path, fresh)
    assert state_root_of(inference_state(fresh), 1 << 16) == card.root


def test_what_a_peer_cannot_run_is_said_before_any_weights() -> None:
    with pytest.raises(CardUnsupported, match="'nosuchmodel' is not a causal LM"):
        check_card(_card(config=json.dumps({"model_type": "nosuchmodel"})))
    with pytest.raises(CardUnsupported, match="GiB is available"):
        check_card(_card(), available=1000)
    with pytest.raises(CardUnsupported, match="unknown engine"):
        check_card(_card(), "tpu")
    with pytest.raises(CardUnsupported, match="codec 'xg0'"):
        check_card(_card(codec="xg0"))
    wider = json.loads(_card().config)
    wider["intermediate_size"] += 8
    card = _card(config=json.dumps(wider))
    with pytest.raises(CardUnsupported, match="another tensor layout"):
        check_layout(card, inference_state(build_from_card(card), card.dtype))
    with pytest.raises(CardUnsupported, match=r"no \*\.safetensors"):
        load_base_weights(Path("/nonexistent"), {})


def test_stop_ids_and_files_come_from_a_model_dir(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    files = card_files(tmp_path)
    assert [n for n, _ in files] == ["generation_config.json", "tokenizer.json"]
    assert stop_ids_of({}, dict(files)) == (0, 2)
    assert stop_ids_of({"eos_token_id": 7}, {}) == (7,)
    with pytest.raises(LocalProtocolError):
        stop_ids_of({"eos_token_id": "x"}, {})
