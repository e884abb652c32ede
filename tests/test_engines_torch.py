"""The torch rollout engine: reproducible generation, in-place updates, weight digests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from swarm.engines import (
    Completion,
    EngineUpdateError,
    RolloutEngine,
    Sampling,
    tensor_digest,
    weights_digest,
)
from swarm.engines.tensors import digest_of, dtype_name, from_bytes, raw_bytes
from swarm.engines.torch_engine import TorchEngine, random_qwen3
from swarm.errors import LocalProtocolError

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 12]
GREEDY = Sampling(max_tokens=12, temperature=0)


@pytest.fixture
def engine() -> Iterator[TorchEngine]:
    # A wide init makes a random model's greedy tokens vary (std 0.02 repeats one token).
    with TorchEngine(random_qwen3(init_std=0.5, seed=1)) as eng:
        yield eng


def sparse_update(engine: TorchEngine, fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """New values for a random `fraction` of the entries of every tensor (as GRPO steps do)."""
    gen = torch.Generator().manual_seed(seed)
    update: dict[str, torch.Tensor] = {}
    for name, value in engine.model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding: the same tensor
            continue
        new = value.detach().clone()
        mask = torch.rand(new.shape, generator=gen) < fraction
        new[mask] += torch.randn(int(mask.sum()), generator=gen) * 0.5
        update[name] = new
    return update


def test_engine_satisfies_the_protocol(engine: TorchEngine) -> None:
    assert isinstance(engine, RolloutEngine)


def same_tokens(a: list[Completion], b: list[Completion]) -> None:
    """Same tokens; log-probs equal up to batched-vs-single-row float differences."""
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_greedy_is_reproducible_and_independent_of_the_batch(engine: TorchEngine) -> None:
    batch = engine.generate(PROMPTS, GREEDY)
    same_tokens([engine.generate([p], GREEDY)[0] for p in PROMPTS], batch)
    assert engine.generate(PROMPTS, GREEDY) == batch
    assert all(len(c.token_ids) == GREEDY.max_tokens and c.finish_reason == "length"
               for c in batch)
    assert len({c.token_ids for c in batch}) == len(PROMPTS)
    assert all(lp <= 0 for c in batch for lp in c.logprobs)


def test_greedy_logprobs_are_the_models_own(engine: TorchEngine) -> None:
    (done,) = engine.generate([PROMPTS[0]], GREEDY)
    ids = torch.tensor([PROMPTS[0] + list(done.token_ids)])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(PROMPTS[0]) - 1
    expected = [float(logp[start + i, t]) for i, t in enumerate(done.token_ids)]
    assert done.logprobs == pytest.approx(expected, abs=1e-4)
    assert list(done.token_ids) == [int(logp[start + i].argmax()) for i in range(12)]


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine: TorchEngine) -> None:
    s = Sampling(max_tokens=12, temperature=1.0, top_p=0.95, seed=7)
    first = engine.generate(PROMPTS, s)
    assert engine.generate(PROMPTS, s) == first
    # Prompt i uses seed + i: the second prompt alone with seed 8 gives the same tokens.
    same_tokens(engine.generate([PROMPTS[1]], Sampling(max_tokens=12, top_p=0.95, seed=8)),
                first[1:2])
    other = engine.generate(PROMPTS, Sampling(max_tokens=12, temperature=1.0, seed=99))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_a_group_batched_together_matches_one_by_one(engine: TorchEngine) -> None:
    """A GRPO group (one prompt repeated) plus another prompt of that length share a batch
    of at most 3 rows; each row samples with its own seed, as if generated alone."""
    group = [[7, 8, 9, 10]] * 5 + [[1, 2, 3, 4]]
    s = Sampling(max_tokens=10, temperature=0.8, seed=21)
    with TorchEngine(engine.model, max_batch=3) as batched:
        together = batched.generate(group, s)
    alone = [
        engine.generate([p], Sampling(max_tokens=10, temperature=0.8, seed=21 + i))[0]
        for i, p in enumerate(group)
    ]
    same_tokens(together, alone)
    assert len({c.token_ids for c in together[:5]}) > 1  # seeds differ within the group
    with pytest.raises(ValueError):
        TorchEngine(engine.model, max_batch=0)


def test_top_k_one_and_tiny_top_p_sample_the_greedy_tokens(engine: TorchEngine) -> None:
    greedy = engine.generate(PROMPTS, GREEDY)
    for s in (Sampling(max_tokens=12, top_k=1, seed=3),
              Sampling(max_tokens=12, top_p=1e-6, seed=3)):
        assert [c.token_ids for c in engine.generate(PROMPTS, s)] == [c.token_ids for c in greedy]


def test_generation_ends_after_a_stop_token(engine: TorchEngine) -> None:
    (full,) = engine.generate([PROMPTS[0]], GREEDY)
    stop = full.token_ids[3]
    first = full.token_ids.index(stop)
    (cut,) = engine.generate([PROMPTS[0]], Sampling(max_tokens=12, temperature=0,
                                                    stop_token_ids=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.logprobs == full.logprobs[: first + 1]


def test_apply_writes_in_place_and_digests_follow(engine: TorchEngine) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    params = dict(engine.model.named_parameters())
    pointers = {n: p.data_ptr() for n, p in params.items()}
    update = sparse_update(engine, 0.05, seed=2)
    engine.apply(update)
    assert {n: p.data_ptr() for n, p in params.items()} == pointers
    for name, value in update.items():
        assert torch.equal(engine.model.state_dict()[name], value)
    digests = engine.tensor_digests()
    for name, value in update.items():
        assert digests[name] == tensor_digest("float32", tuple(value.shape), raw_bytes(value))
    # The tied output head is the embedding: its digest follows the embedding's update.
    emb = update["model.embed_tokens.weight"]
    assert digests["lm_head.weight"] == digest_of(emb)
    after = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_an_engine_built_from_the_updated_state_generates_the_same(engine: TorchEngine) -> None:
    update = sparse_update(engine, 0.05, seed=4)
    engine.apply(update)
    fresh = random_qwen3(init_std=0.5, seed=1)
    fresh.load_state_dict(update, strict=False)
    with TorchEngine(fresh) as other:
        assert weights_digest(other.tensor_digests()) == weights_digest(engine.tensor_digests())
        assert other.generate(PROMPTS, GREEDY) == engine.generate(PROMPTS, GREEDY)


def sparse_pairs(update: dict[str, torch.Tensor], current: dict[str, torch.Tensor]
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same update as (flat indices, values) of the entries that changed."""
    pairs = {}
    for name, new in update.items():
        flat_new = new.reshape(-1)
        idx = torch.nonzero(flat_new != current[name].reshape(-1)).reshape(-1)
        pairs[name] = (idx, flat_new[idx].clone())
    return pairs


def test_apply_sparse_equals_the_dense_update(engine: TorchEngine) -> None:
    update = sparse_update(engine, 0.03, seed=6)
    state = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
    pairs = sparse_pairs(update, state)
    assert 0 < sum(int(i.numel()) for i, _ in pairs.values()) < 0.1 * sum(
        t.numel() for t in update.values()
    )
    pointer = engine.model.get_parameter("model.norm.weight").data_ptr()
    engine.apply_sparse(pairs)
    assert engine.model.get_parameter("model.norm.weight").data_ptr() == pointer
    expected = {n: digest_of(t) for n, t in update.items()}
    assert engine.tensor_digests(list(update)) == expected


@pytest.mark.parametrize(
    "indices, values",
    [
        (torch.tensor([3, 2]), torch.zeros(2)),
        (torch.tensor([2, 2]), torch.zeros(2)),
        (torch.tensor([64]), torch.zeros(1)),
        (torch.tensor([-1]), torch.zeros(1)),
        (torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2)),
        (torch.tensor([[1, 2]]), torch.zeros(1, 2)),
        (torch.tensor([1, 2]), torch.zeros(3)),
        (torch.tensor([1, 2]), torch.zeros(2, dtype=torch.float64)),
    ],
    ids=["unsorted", "duplicate", "past-end", "negative", "int32", "2-d", "count", "dtype"],
)
def test_apply_sparse_rejects_bad_entries_and_writes_nothing(
    engine: TorchEngine, indices: torch.Tensor, values: torch.Tensor
) -> None:
    digests = engine.tensor_digests()
    good = (torch.tensor([0, 5]), torch.tensor([7.0, 8.0]))
    with pytest.raises(EngineUpdateError):
        engine.apply_sparse({"model.layers.1.input_layernorm.weight": good,
                             "model.norm.weight": (indices, values)})
    with pytest.raises(EngineUpdateError):
        engine.apply_sparse({"model.missing": good})
    assert engine.tensor_digests() == digests


@pytest.mark.parametrize(
    "bad",
    [
        {"model.nope.weight": torch.zeros(3)},
        {"model.norm.weight": torch.zeros(65)},
        {"model.norm.weight": torch.zeros(64, dtype=torch.float64)},
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype"],
)
def test_apply_rejects_a_bad_update_and_writes_nothing(
    engine: TorchEngine, bad: dict[str, torch.Tensor]
) -> None:
    digests = engine.tensor_digests()
    good = {"model.layers.0.input_layernorm.weight": torch.full((64,), 3.0)}
    with pytest.raises(EngineUpdateError):
        engine.apply({**good, **bad})
    assert engine.tensor_digests() == digests


def test_bad_prompts_are_refused(engine: TorchEngine) -> None:
    for prompt in ([], [256], [-1], [1] * 250):
        with pytest.raises(LocalProtocolError):
            engine.generate([prompt], GREEDY)
    with pytest.raises(EngineUpdateError):
        engine.tensor_digests(["model.nope"])


def test_closed_engine_refuses_use(engine: TorchEngine) -> None:
    engine.close()
    engine.close()
    with pytest.raises(LocalProtocolError):
        engine.generate(PROMPTS, GREEDY)


def test_sampling_and_completion_validate() -> None:
    for kwargs in ({"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")},
                   {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -1},
                   {"stop_token_ids": (-3,)}):
        with pytest.raises(ValueError):
            Sampling(**kwargs)
    with pytest.raises(ValueError):
        Completion((1, 2), (0.0,), "length")


def test_engine_speaks_the_lease_types(engine: TorchEngine) -> None:
    from swarm.protocol import leases

    assert Sampling is leases.Sampling and Completion is leases.Completion
    greedy = engine.generate(PROMPTS[:1], GREEDY)[0]
    outs = engine.generate(PROMPTS[:2], Sampling(max_tokens=12, temperature=0,
                                                 stop_token_ids=(greedy.token_ids[2],)))
    assert outs[0].finish_reason == "stop"
    row = leases.TaskResult(3, tuple(outs))  # what a peer signs, unconverted
    assert leases.TaskResult.from_wire(row.to_wire()) == row


def test_digests_bind_dtype_shape_and_bytes() -> None:
    t = torch.arange(12, dtype=torch.float32)
    d = digest_of(t)
    assert d == digest_of(t.clone())
    assert d != digest_of(t.reshape(3, 4))
    assert d != digest_of(t.view(torch.int32))
    changed = t.clone()
    changed[5] = 5.5
    assert d != digest_of(changed)
    # A non-contiguous view hashes as its C-ordered values.
    m = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert digest_of(m.t()) == digest_of(m.t().contiguous())
    # bf16 round-trips through raw bytes.
    b = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    back = from_bytes(dtype_name(b.dtype), b.shape, bytes(raw_bytes(b)))
    assert torch.equal(back, b)
    with pytest.raises(EngineUpdateError):
        from_bytes("float32", (4,), b"\0" * 15)
    assert weights_digest({"a": d, "b": d}) == weights_digest({"b": d, "a": d})
    assert weights_digest({"a": d}) != weights_digest({"b": d})


def test_importing_swarm_engines_stays_light() -> None:
    code = (
        "import sys, swarm, swarm.engines\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers', 'libp2p') "
        "if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
