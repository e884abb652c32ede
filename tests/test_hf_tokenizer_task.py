"""The shipped offline tokenizer (swarm.hf.tokenizer) and the addition task (swarm.hf.task)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import LocalProtocolError
from swarm.hf.task import (
    EOS,
    IM_END,
    IM_START,
    TextTask,
    decode_completion,
    encode_prompts,
    format_prompt,
    stop_token_ids,
)
from swarm.hf.tokenizer import (
    TOKENIZER_FILES,
    build_tokenizer,
    main,
    shipped_tokenizer_dir,
    training_corpus,
)

pytest.importorskip("transformers")


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("the test tried to open a network connection")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)


@pytest.fixture
def tok(offline: None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shipped_tokenizer_dir())


# --- the shipped tokenizer ------------------------------------------------------------------


def test_shipped_files_are_there_and_small() -> None:
    d = shipped_tokenizer_dir()
    assert d.is_dir()
    assert sorted(p.name for p in d.iterdir()) == sorted(TOKENIZER_FILES)
    assert sum((d / name).stat().st_size for name in TOKENIZER_FILES) < 200_000


def test_shipped_loads_offline_with_the_special_tokens(tok: Any) -> None:
    assert len(tok) == 1024
    assert tok.eos_token == EOS and tok.pad_token == EOS
    assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids(EOS) == 0
    assert tok.convert_tokens_to_ids(IM_START) == 1
    assert tok.convert_tokens_to_ids(IM_END) == 2
    assert set(tok.all_special_tokens) >= {EOS, IM_START, IM_END}
    assert stop_token_ids(tok) == (0, 2)
    # Nothing is added around the text (no bos), and each special token is one id.
    assert tok("12+3=")["input_ids"] == tok.encode("12+3=", add_special_tokens=False)
    assert tok.encode(f"{IM_START}{IM_END}{EOS}", add_special_tokens=False) == [1, 2, 0]


def test_encode_decode_round_trips_the_task_text(tok: Any) -> None:
    for max_digits in (1, 2, 4):
        task = TextTask(seed=3, max_digits=max_digits, max_new_tokens=max_digits + 2)
        prompts = task.prompts(0, 32) + task.prompts(1, 32)
        for prompt, ids in zip(prompts, encode_prompts(tok, prompts), strict=True):
            assert tok.decode(ids, skip_special_tokens=False) == prompt
            full = prompt + task.reference_completion(prompt)
            assert tok.decode(tok.encode(full, add_special_tokens=False)) == full
    for text in ["", " ", "Hello, world!  It's 3.14\n\n\tx ", "ünïcödé — 😀", "007 + -5 = 2",
                 "<|im_start|>system\nYou add.<|im_end|>\n"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_digits_are_single_tokens(tok: Any) -> None:
    ids = tok.encode("1234567890", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("1234567890")


def test_chat_template_gives_the_task_prompt(tok: Any) -> None:
    got = tok.apply_chat_template([{"role": "user", "content": "17+25="}], tokenize=False,
                                  add_generation_prompt=True)
    assert got == format_prompt("17+25=") == "<|im_start|>user\n17+25=<|im_end|>\n" \
        "<|im_start|>assistant\n"


def test_rebuild_is_byte_identical_to_the_shipped_files(tmp_path: Path) -> None:
    out = build_tokenizer(tmp_path / "tok")
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (shipped_tokenizer_dir() / name).read_bytes(), name


def test_other_seed_and_size_build_and_load(tmp_path: Path, offline: None) -> None:
    from transformers import AutoTokenizer

    out = build_tokenizer(tmp_path / "small", vocab_size=400, seed=1)
    t = AutoTokenizer.from_pretrained(out)
    assert len(t) == 400 and t.eos_token_id == 0
    prompt = TextTask(seed=1).prompts(0, 1)[0]
    assert t.decode(encode_prompts(t, [prompt])[0]) == prompt
    assert (out / "tokenizer.json").read_bytes() != \
        (shipped_tokenizer_dir() / "tokenizer.json").read_bytes()


def test_corpus_is_seeded_and_free_of_special_tokens() -> None:
    a, b = list(training_corpus(0)), list(training_corpus(0))
    assert a == b and a != list(training_corpus(1))
    assert not any(t in text for text in a for t in (EOS, IM_START, IM_END))


@pytest.mark.parametrize("kwargs", [{"vocab_size": 258}, {"vocab_size": 70000},
                                    {"seed": -1}, {"vocab_size": True}])
def test_build_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        build_tokenizer(tmp_path, **kwargs)


def test_main_writes_and_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == [str(tmp_path / "out" / n)
                                                  for n in TOKENIZER_FILES]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--vocab-size", "10"])


# --- the task -------------------------------------------------------------------------------


def test_prompts_are_a_function_of_seed_and_step() -> None:
    task = TextTask(seed=7)
    assert task.prompts(3, 16) == task.prompts(3, 16) == TextTask(seed=7).prompts(3, 16)
    assert task.prompts(3, 16)[:5] == task.prompts(3, 5)
    assert task.prompts(3, 16) != task.prompts(4, 16)
    assert task.prompts(3, 16) != TextTask(seed=8).prompts(3, 16)
    assert task.prompts(0, 0) == []
    # Pinned: the same in every process and Python version (a str seed is SHA-512 hashed).
    assert TextTask().prompts(0, 2) == [format_prompt("17+44="), format_prompt("79+71=")]


def test_prompts_have_the_chat_layout_and_known_answers() -> None:
    task = TextTask(seed=1, max_digits=3, max_new_tokens=5)
    for prompt in task.prompts(0, 50):
        assert prompt.startswith(f"{IM_START}user\n")
        assert prompt.endswith(f"={IM_END}\n{IM_START}assistant\n")
        a, b = prompt.split("\n")[1].removesuffix(f"={IM_END}").split("+")
        assert 0 <= int(a) < 1000 and 0 <= int(b) < 1000
        assert task.answer(prompt) == str(int(a) + int(b))
        assert task.reference_completion(prompt) == f"{int(a) + int(b)}{IM_END}"
        assert task.reward(prompt, task.reference_completion(prompt)) == 1.0


def test_reward_values() -> None:
    task = TextTask()
    p = format_prompt("17+25=")
    assert task.answer(p) == "42"
    assert task.reward(p, "42") == 1.0
    assert task.reward(p, " 42\n") == 1.0
    assert task.reward(p, f"42{IM_END}") == 1.0
    assert task.reward(p, f"42{EOS}anything") == 1.0
    assert task.reward(p, "43") == pytest.approx(0.2 + 0.2 + 0.4 * 0.5)
    assert task.reward(p, "24") == pytest.approx(0.4)
    assert task.reward(p, "420") == pytest.approx(0.2)
    assert task.reward(p, "042") == pytest.approx(0.2)
    assert task.reward(p, "4") == pytest.approx(0.2)
    for junk in ["", " ", "\n", "forty-two", "42!", "4 2", "-42", "42.0", "+42", "0x2a",
                 "\uff14\uff12", "\u0664\u0662", f"{IM_END}42", "42 is the answer",
                 "9" * 100_000 + "x"]:
        assert task.reward(p, junk) == 0.0, junk


def test_reward_never_raises_on_foreign_input() -> None:
    task = TextTask()
    p = task.prompts(0, 1)[0]
    assert task.reward("17+25=", "42") == 0.0
    assert task.reward(format_prompt("123+4="), "127") == 0.0  # over max_digits
    assert task.reward(p.replace("user", "system"), "1") == 0.0
    assert task.reward(None, "42") == 0.0  # type: ignore[arg-type]
    assert task.reward(p, None) == 0.0  # type: ignore[arg-type]
    assert task.reward(p, b"42") == 0.0  # type: ignore[arg-type]
    assert task.answer("") is None
    with pytest.raises(LocalProtocolError):
        task.reference_completion("nope")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 99), st.integers(0, 99), st.text(max_size=12))
def test_reward_is_in_unit_interval(a: int, b: int, completion: str) -> None:
    task = TextTask()
    r = task.reward(format_prompt(f"{a}+{b}="), completion)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (completion.split(IM_END)[0].split(EOS)[0].strip() == str(a + b))


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"max_digits": 0}, {"max_digits": 10},
                                    {"max_digits": 3, "max_new_tokens": 4},
                                    {"max_new_tokens": True}])
def test_task_rejects_bad_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalProtocolError):
        TextTask(**kwargs)


def test_prompts_reject_bad_arguments() -> None:
    with pytest.raises(LocalProtocolError):
        TextTask().prompts(-1, 1)
    with pytest.raises(LocalProtocolError):
        TextTask().prompts(0, -1)


def test_decode_completion_stops_at_the_first_stop_token(tok: Any) -> None:
    task = TextTask()
    prompt = task.prompts(5, 1)[0]
    answer = task.answer(prompt)
    assert answer is not None
    ids = tok.encode(task.reference_completion(prompt) + "junk 7", add_special_tokens=False)
    assert ids.count(2) == 1  # one im_end, then more text
    assert decode_completion(tok, ids) == answer
    assert decode_completion(tok, tok.encode(f"{answer}{EOS}99", add_special_tokens=False)) \
        == answer
    assert decode_completion(tok, tok.encode(f" {answer} ", add_special_tokens=False)) \
        == f" {answer} "
    assert decode_completion(tok, tok.encode(f"{IM_START}{answer}", add_special_tokens=False)) \
        == answer  # other special tokens are skipped
    assert decode_completion(tok, []) == ""
    assert decode_completion(tok, [2, 20]) == ""
    assert task.reward(prompt, decode_completion(tok, ids)) == 1.0
