"""A small byte-level BPE tokenizer, trained offline on generated text, shipped with the package.

:func:`build_tokenizer` trains it with the ``tokenizers`` library on text this module
generates from a seed (the :class:`~swarm.hf.task.TextTask` prompts and answers, arithmetic,
digit strings, templated English-like sentences) and writes a directory that
``transformers.AutoTokenizer.from_pretrained`` loads without the network. It is laid out like
Qwen's: the same pre-tokenizer (one token per digit), byte-level, no bos added, the special
tokens ``<|endoftext|>`` (eos and pad), ``<|im_start|>`` and ``<|im_end|>``, a ChatML chat
template. The build is deterministic: the same (vocab_size, seed) gives a byte-identical
``tokenizer.json``.

The build for the defaults ships in ``swarm/hf/data/tokenizer`` (:func:`shipped_tokenizer_dir`).
Rebuild it with ``python -m swarm.hf.tokenizer OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

from swarm.errors import LocalProtocolError
from swarm.hf.task import EOS, IM_END, IM_START, SPECIAL_TOKENS, TextTask

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The files :func:`build_tokenizer` writes."""

# Qwen2/Qwen3's split: contractions, letter runs, single digits, punctuation, whitespace.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen's chat template without tools or thinking: ChatML turns, then the assistant's opening.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

_WORDS = {
    "det": ["the", "a", "one", "this", "that", "every", "some", "each", "no", "my", "your",
            "our", "their", "its", "his", "her"],
    "adj": ["small", "large", "quick", "slow", "red", "blue", "green", "old", "new", "bright",
            "dark", "happy", "quiet", "loud", "warm", "cold", "short", "long", "simple",
            "strange", "careful", "busy", "gentle", "heavy", "light", "early", "late", "clever",
            "brave", "calm", "empty", "full", "round", "sharp", "soft", "strong", "tired",
            "young", "wise", "wild"],
    "noun": ["cat", "dog", "bird", "tree", "river", "house", "city", "road", "book", "table",
             "window", "garden", "friend", "teacher", "student", "number", "answer", "question",
             "model", "network", "peer", "node", "message", "letter", "word", "sentence",
             "story", "child", "family", "machine", "computer", "program", "lesson", "market",
             "mountain", "forest", "ocean", "morning", "evening", "problem", "reward", "step",
             "token", "signal", "weight", "value", "world", "music", "school", "water"],
    "verb": ["sees", "finds", "likes", "helps", "follows", "reads", "writes", "counts",
             "adds", "sends", "takes", "makes", "opens", "closes", "carries", "watches",
             "knows", "remembers", "builds", "keeps", "moves", "checks", "learns", "teaches",
             "answers", "asks", "trains", "shares", "joins", "leaves"],
    "adv": ["quickly", "slowly", "often", "never", "always", "again", "today", "together",
            "carefully", "quietly", "there", "here", "now", "later", "soon", "still"],
    "prep": ["in", "on", "near", "under", "over", "with", "behind", "before", "after", "from",
             "into", "across", "around", "between"],
    "word": ["about", "above", "across", "again", "against", "almost", "alone", "along",
             "already", "also", "although", "among", "another", "anything", "because", "become",
             "begin", "believe", "better", "big", "body", "both", "bring", "call", "can",
             "change", "close", "come", "could", "country", "day", "different", "do", "does",
             "down", "during", "end", "enough", "even", "example", "eye", "face", "fact", "far",
             "feel", "few", "first", "food", "for", "form", "get", "give", "go", "good",
             "great", "group", "hand", "hard", "have", "head", "high", "hold", "idea",
             "important", "just", "kind", "know", "last", "life", "line", "little", "live",
             "look", "man", "many", "may", "mean", "might", "more", "most", "much", "must",
             "name", "need", "next", "night", "not", "nothing", "of", "off", "only", "other",
             "part", "people", "place", "point", "power", "put", "right", "same", "say",
             "seem", "should", "show", "side", "since", "something", "start", "state", "stop",
             "system", "tell", "than", "thing", "think", "through", "time", "to", "too",
             "turn", "until", "up", "use", "very", "want", "way", "well", "what", "when",
             "where", "which", "while", "who", "why", "will", "without", "woman", "work",
             "would", "year", "yes", "yet", "you"],
    "name": ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy",
             "Mallory", "Oscar", "Peggy", "Trent", "Victor", "Walter"],
}

_TEMPLATES = [
    "{Det} {adj} {noun} {verb} {det} {noun}.",
    "{name} {verb} {det} {adj} {noun} {prep} {det} {noun}.",
    "{Det} {noun} {verb} {adv}.",
    "Why does {det} {noun} {verb2} {det} {noun}?",
    "{name} and {name} {verb2} {det} {adj} {noun} {adv}.",
    "{name} said: \"{Det} {noun} is {adj}.\"",
    "There are {num} {nouns} {prep} {det} {noun}.",
    "{name} has {num} {nouns}, and {name} has {num} more.",
    "What is {num} plus {num}? It is {num}.",
    "{Word} {word} {word} {word} {word}, {word} {word} {word}.",
    "{name} wrote: \"{Word} {word} {word} {nouns} {word} {word}!\"",
    "{name}'s {noun} isn't {adj}; it's {adj}, and they'll {verb2} it {adv}.",
]


_IRREGULAR_PLURALS = {"child": "children", "music": "songs"}


def _plural(noun: str) -> str:
    if noun in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[noun]
    if noun.endswith(("ch", "sh", "ss")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "o", "u"):
        return noun[:-1] + "ies"
    return noun + "s"


def _bare(verb: str) -> str:
    """The bare form of a third-person verb: "sees" -> "see", "carries" -> "carry"."""
    if verb.endswith("ies"):
        return verb[:-3] + "y"
    if verb.endswith(("ches", "shes", "sses")):
        return verb[:-2]
    return verb[:-1]


def _sentence(rng: random.Random, template: str) -> str:
    """``template`` with each ``{key}`` filled in; a capitalised key capitalises the word."""
    out: list[str] = []
    rest = template
    while "{" in rest:
        head, _, tail = rest.partition("{")
        key, _, rest = tail.partition("}")
        out.append(head)
        lower = key.lower()
        if lower == "num":
            word = str(rng.randrange(10 ** rng.randint(1, 4)))
        elif lower == "nouns":
            word = _plural(rng.choice(_WORDS["noun"]))
        elif lower == "verb2":
            word = _bare(rng.choice(_WORDS["verb"]))
        else:
            word = rng.choice(_WORDS[lower])
        out.append(word[:1].upper() + word[1:] if key[:1].isupper() else word)
    out.append(rest)
    return "".join(out)


def training_corpus(seed: int = 0) -> Iterator[str]:
    """The text the tokenizer is trained on, the same sequence for the same ``seed``.

    The special tokens are cut out (the trainer does not extract them, and encoding always
    does), so no merge spans one.
    """
    for text in _raw_corpus(seed):
        yield from (piece for piece in _SPECIAL_RE.split(text) if piece)


def _raw_corpus(seed: int) -> Iterator[str]:
    rng = random.Random(f"swarm.hf.tokenizer:{seed}")
    # The task's own chat turns (prompt + reference answer + end marker + eos).
    for max_digits in (1, 2, 3, 4):
        task = TextTask(seed=seed, max_digits=max_digits, max_new_tokens=max_digits + 2)
        for step in range(8):
            for prompt in task.prompts(step, 64):
                yield prompt + task.reference_completion(prompt) + "\n" + EOS
    # Arithmetic with the four operators, with and without spaces.
    for _ in range(4000):
        a, b = rng.randrange(10 ** rng.randint(1, 5)), rng.randrange(10 ** rng.randint(1, 5))
        op = rng.choice("+-*/")
        val = {"+": a + b, "-": a - b, "*": a * b, "/": a // max(b, 1)}[op]
        yield f"{a} {op} {b} = {val}" if rng.random() < 0.5 else f"{a}{op}{b}={val}"
    # Digit strings.
    for _ in range(1000):
        yield "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 24)))
    # Templated English-like sentences, some inside ChatML turns.
    for _ in range(12000):
        text = _sentence(rng, rng.choice(_TEMPLATES))
        if rng.random() < 0.1:
            role = rng.choice(("system", "user", "assistant"))
            text = f"{IM_START}{role}\n{text}{IM_END}\n"
        yield text


def build_tokenizer(out_dir: Path, *, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Train the tokenizer and write :data:`TOKENIZER_FILES` into ``out_dir`` (created if
    missing; the files are replaced). Returns ``out_dir``.

    :raises LocalProtocolError: ``vocab_size`` is too small for the bytes and the special
        tokens (259) or over 65536, or ``seed`` is negative.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not 256 + len(SPECIAL_TOKENS) <= vocab_size <= 65536:
        raise LocalProtocolError("vocab_size must be an int in 259..65536")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LocalProtocolError("seed must be a non-negative int")
    # Only effective before the tokenizers thread pool first starts in this process; the
    # build is deterministic either way (checked by the tests), this keeps it single-threaded
    # and quiet when it is the first use.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed), trainer=trainer)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"additional_special_tokens": [IM_START, IM_END], "bos_token": EOS,
                   "eos_token": EOS, "pad_token": EOS}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n",
                                    encoding="utf-8")
    return out_dir


def shipped_tokenizer_dir() -> Path:
    """The directory of the shipped tokenizer (the build for the defaults)."""
    return Path(__file__).resolve().parent / "data" / "tokenizer"


def main(argv: list[str] | None = None) -> int:
    """``python -m swarm.hf.tokenizer OUT_DIR [--vocab-size N] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m swarm.hf.tokenizer",
        description="Train the offline byte-level BPE tokenizer on generated text and write "
                    "a directory that transformers.AutoTokenizer loads.")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="default 1024")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training text")
    args = parser.parse_args(argv)
    try:
        out = build_tokenizer(args.out_dir, vocab_size=args.vocab_size, seed=args.seed)
    except LocalProtocolError as e:
        parser.error(str(e))
    for name in TOKENIZER_FILES:
        path = out / name
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
