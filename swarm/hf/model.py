"""A Hugging Face model dir made offline: a Qwen3-architecture model with the shipped
tokenizer, randomly initialised from its config under a seed, saved with
``save_pretrained``. The weights are exactly what :func:`swarm.engines.hf_model.build_model`
builds from the same config, so a peer building it from the run card already holds
version 0 (nothing dense travels).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import LocalProtocolError


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


#: Sizes by approximate parameter count (with the shipped 1,024-token vocabulary).
SHAPES = {
    "2M": Shape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),
    "25M": Shape(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
    "50M": Shape(hidden=640, layers=10, heads=10, kv_heads=5, intermediate=2048),
    "250M": Shape(hidden=1024, layers=20, heads=16, kv_heads=8, intermediate=3072),
}


def qwen3_config(params: str, vocab_size: int, *, eos: int, pad: int) -> dict[str, Any]:
    """``config.json`` fields of a Qwen3 model of about ``params`` parameters."""
    try:
        s = SHAPES[params]
    except KeyError:
        raise LocalProtocolError(f"--params must be one of {', '.join(SHAPES)}") from None
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": vocab_size, "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.hidden // s.heads, "intermediate_size": s.intermediate,
        "max_position_embeddings": 512, "tie_word_embeddings": True,
        "initializer_range": 0.02, "eos_token_id": eos, "pad_token_id": pad,
        "bos_token_id": eos, "use_cache": True,
    }


def warm_start(model: Any, tokenizer: Any, steps: int, *, lr: float = 1e-3, batch: int = 32,
               say: Callable[[str], None] = print) -> float:
    """Supervised steps on the task's reference answers (prompts of steps the RL loop
    never draws), so that RL starts from a policy with some reward, as it would from a
    pretrained model; returns the last loss."""
    import torch

    from swarm.hf.task import TextTask

    task = TextTask()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(steps):
            prompts = task.prompts(1_000_000 + step, batch)
            seqs = [tokenizer.encode(p + task.reference_completion(p), add_special_tokens=False)
                    for p in prompts]
            starts = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
            width = max(map(len, seqs))
            ids = torch.full((batch, width), int(tokenizer.pad_token_id))
            attention = torch.zeros((batch, width), dtype=torch.long)
            labels = torch.full((batch, width), -100)
            for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
                ids[i, :len(seq)] = torch.tensor(seq)
                attention[i, :len(seq)] = 1
                labels[i, start:len(seq)] = torch.tensor(seq[start:])
            out = model(input_ids=ids, attention_mask=attention, labels=labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            loss = float(out.loss.detach())
            if (step + 1) % 10 == 0 or step + 1 == steps:
                say(f"warm start: step {step + 1} of {steps}, loss {loss:.3f}")
    model.eval()
    return loss


def make_model_dir(out: Path, *, params: str = "25M", seed: int = 0, warm: int = 0,
                   say: Callable[[str], None] = print) -> Path:
    """Write a model dir (``config.json``, ``model.safetensors``, the tokenizer and
    ``generation_config.json``) to ``out``; returns ``out``. ``warm``: supervised steps
    first (:func:`warm_start`; the weights then differ from the config's seeded ones).

    :raises LocalProtocolError: ``out`` already holds a model, or an unknown size.
    """
    from transformers import AutoTokenizer

    from swarm.content.card import RunCard
    from swarm.engines.hf_model import build_model
    from swarm.hf.task import IM_END
    from swarm.hf.tokenizer import shipped_tokenizer_dir

    if (out / "config.json").exists():
        raise LocalProtocolError(f"{out} already holds a model (config.json)")
    tok: Any = AutoTokenizer.from_pretrained(shipped_tokenizer_dir())
    eos, im_end = int(tok.eos_token_id), int(tok.convert_tokens_to_ids(IM_END))
    config = qwen3_config(params, len(tok), eos=eos, pad=int(tok.pad_token_id))
    # The same construction a peer runs on the card (any card fields but the config do).
    card = RunCard("model", json.dumps(config), (), "float32", b"\0" * 32, "-", b"\0" * 32,
                   1)
    model: Any = build_model(card, seed=seed)
    if warm:
        warm_start(model, tok, warm, say=say)
    model.generation_config.eos_token_id = [eos, im_end]
    model.generation_config.pad_token_id = int(tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in shipped_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copyfile(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swarm.hf.model",
                                 description="write an offline Qwen3 model dir")
    ap.add_argument("out", type=Path)
    ap.add_argument("--params", default="25M", choices=sorted(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                    help="supervised steps on the task first (RL then starts with reward)")
    a = ap.parse_args(argv)
    out = make_model_dir(a.out, params=a.params, seed=a.seed, warm=a.warm_start)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB): a {a.params} Qwen3 with the shipped tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
