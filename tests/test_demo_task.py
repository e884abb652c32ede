"""The demo's learning part: task and reward, tiny model, GRPO rollouts and updates."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.demo.grpo import (
    DemoConfig,
    Rollout,
    derive_seed,
    generate,
    group_advantages,
    make_optimizer,
    peer_share,
    rollout_prompts,
    run_local,
    summarize,
    train_step,
)
from swarm.demo.model import (
    TinyModelConfig,
    build_model,
    delta_density,
    inference_state,
    load_state,
    model_from_state,
)
from swarm.demo.task import BOS, SEP, SortTask, digit_token
from swarm.errors import DecodeError, LocalProtocolError
from swarm.wire.strict import pack, unpack

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, head_dim=16)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Pin torch to one thread: on a shared 2-core machine that is fastest and steadiest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _p(*digits: int) -> tuple[int, ...]:
    return (BOS, *(digit_token(d) for d in digits), SEP)


def _d(*digits: int) -> tuple[int, ...]:
    return tuple(digit_token(d) for d in digits)


def test_reward_gives_full_partial_and_zero_credit() -> None:
    task = SortTask()
    prompt = _p(7, 2, 5)
    assert task.target(prompt) == _d(2, 5, 7)
    assert task.reward(prompt, _d(2, 5, 7)) == 1.0
    assert task.solved(prompt, _d(2, 5, 7))
    # The right digits in the wrong order earn the overlap half only.
    assert task.reward(prompt, _d(7, 5, 2)) == pytest.approx(0.5 + 0.5 / 3)
    assert not task.solved(prompt, _d(7, 5, 2))
    # Distractor tokens and digits absent from the prompt earn nothing.
    assert task.reward(prompt, (20, 21, 22)) == 0.0
    assert task.reward(prompt, _d(9, 9, 9)) == 0.0
    # A repeated digit counts as often as the prompt holds it.
    assert task.reward(prompt, _d(2, 2, 2)) == pytest.approx(0.5 / 3 + 0.5 / 3)
    # Short answers lose the missing positions; extra tokens are ignored.
    assert task.reward(prompt, _d(2)) == pytest.approx(1 / 3)
    assert task.reward(prompt, (*_d(2, 5, 7), 30)) == 1.0
    with pytest.raises(LocalProtocolError):
        task.reward((BOS, 40, SEP), _d(1))


@given(seed=st.integers(0, 2**32), count=st.integers(1, 20))
@settings(max_examples=30, deadline=None)
def test_prompts_are_seeded_and_well_formed(seed: int, count: int) -> None:
    task = SortTask()
    prompts = task.prompts(seed, count)
    assert prompts == task.prompts(seed, count)
    assert len(prompts) == count
    for p in prompts:
        assert len(p) == task.prompt_len
        assert 0.0 <= task.reward(p, task.target(p)) == 1.0


def test_build_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(SMALL)
    after = torch.rand(3)
    b = build_model(SMALL)
    assert torch.equal(after, expected)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_model(dataclasses.replace(SMALL, seed=1)).state_dict()
    assert not torch.equal(sa["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    # Random init with std 0.02 in the matrices.
    std = float(sa["model.layers.0.mlp.up_proj.weight"].std())
    assert 0.015 < std < 0.025


def test_inference_state_and_delta_density_compare_bits() -> None:
    model = build_model(SMALL)
    s0 = inference_state(model)
    assert all(t.dtype == torch.bfloat16 for t in s0.values())
    assert list(s0) == list(model.state_dict())
    assert delta_density(s0, s0) == 0.0
    with torch.no_grad():
        model.get_parameter("model.norm.weight")[0] = 2.0
    s1 = inference_state(model)
    total = sum(t.numel() for t in s0.values())
    assert delta_density(s0, s1) == pytest.approx(1 / total)
    # -0.0 and +0.0 are equal values but different bits: a change.
    a = {"x": torch.tensor([0.0, 1.0])}
    b = {"x": torch.tensor([-0.0, 1.0])}
    assert delta_density(a, b) == 0.5
    with pytest.raises(LocalProtocolError):
        inference_state(model, "float16")


def test_generate_is_seeded_and_logprobs_match_the_policy(one_thread: None) -> None:
    task = SortTask()
    model = build_model(SMALL)
    prompts = task.prompts(5, 4)
    a = generate(model, prompts, 6, seed=11, max_new_tokens=task.completion_len)
    b = generate(model, prompts, 6, seed=11, max_new_tokens=task.completion_len)
    c = generate(model, prompts, 6, seed=12, max_new_tokens=task.completion_len)
    assert a == b
    assert a != c
    assert [len(g) for g in a] == [6] * 4
    for prompt, group in zip(prompts, a, strict=True):
        for comp in group:
            assert comp.prompt == prompt
            assert len(comp.tokens) == len(comp.logprobs) == task.completion_len
            assert all(0 <= t < SMALL.vocab_size for t in comp.tokens)
    # The recorded log-probs are the model's own, teacher-forced on the sampled tokens.
    flat = [c for g in a for c in g]
    ids = torch.tensor([[*c.prompt, *c.tokens] for c in flat])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    n = task.prompt_len
    again = logp[:, n - 1:-1].gather(2, ids[:, n:, None])[:, :, 0]
    assert torch.allclose(again, torch.tensor([c.logprobs for c in flat]), atol=1e-5)
    # A near-uniform random policy: each token has about 1/vocab probability.
    mean_lp = float(again.mean())
    assert abs(mean_lp - math.log(1 / SMALL.vocab_size)) < 0.1


def test_peer_generates_from_the_published_state(one_thread: None) -> None:
    """A peer given only the bf16 state and the config samples what a patched model does."""
    task = SortTask()
    master = build_model(SMALL)
    state = inference_state(master)
    prompts = task.prompts(1, 3)
    from_state = generate(state, prompts, 4, seed=3, max_new_tokens=3, config=SMALL)
    peer = build_model(dataclasses.replace(SMALL, seed=99))
    load_state(peer, state)
    assert generate(peer, prompts, 4, seed=3, max_new_tokens=3) == from_state
    with pytest.raises(LocalProtocolError):
        generate(state, prompts, 4, seed=3, max_new_tokens=3)
    with pytest.raises(LocalProtocolError):
        generate(peer, [_p(1, 2), _p(1)], 4, seed=3, max_new_tokens=3)
    with pytest.raises(LocalProtocolError):
        load_state(peer, {"x": torch.zeros(1)})


def test_completions_cross_the_wire_unchanged() -> None:
    model = build_model(SMALL)
    groups = generate(model, SortTask().prompts(2, 2), 3, seed=0, max_new_tokens=3)
    for comp in (c for g in groups for c in g):
        data = pack(comp.to_obj())
        back = Rollout.from_obj(unpack(data, max_bytes=1 << 16),
                                   vocab_size=SMALL.vocab_size)
        assert back == comp


@pytest.mark.parametrize("obj", [
    None,
    [],
    {"prompt": [1, 2], "tokens": [3]},
    {"prompt": [1, 2], "tokens": [3], "logprobs": [-1.0], "extra": 1},
    {"prompt": [], "tokens": [3], "logprobs": [-1.0]},
    {"prompt": [1, 2], "tokens": [32], "logprobs": [-1.0]},
    {"prompt": [1, -2], "tokens": [3], "logprobs": [-1.0]},
    {"prompt": [1, 2], "tokens": [True], "logprobs": [-1.0]},
    {"prompt": [1, 2], "tokens": [3.0], "logprobs": [-1.0]},
    {"prompt": [1, 2], "tokens": [3], "logprobs": []},
    {"prompt": [1, 2], "tokens": [3], "logprobs": [0.5]},
    {"prompt": [1, 2], "tokens": [3], "logprobs": [float("nan")]},
    {"prompt": [1, 2], "tokens": [3], "logprobs": [-1]},
    {"prompt": [1, 2], "tokens": "abc", "logprobs": [-1.0]},
    {"prompt": [1] * 5000, "tokens": [3], "logprobs": [-1.0]},
])
def test_hostile_completions_are_rejected(obj: object) -> None:
    with pytest.raises(DecodeError):
        Rollout.from_obj(obj, vocab_size=32)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.sampled_from(["prompt", "tokens", "logprobs"]), c),
                    max_leaves=12))
@settings(max_examples=200, deadline=None)
def test_completion_decoder_never_crashes(obj: object) -> None:
    try:
        comp = Rollout.from_obj(obj, vocab_size=32)
    except DecodeError:
        return
    assert len(comp.tokens) == len(comp.logprobs)


def test_group_advantages_are_normalised() -> None:
    a = group_advantages([1.0, 0.0, 0.5, 0.5])
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert a[0] > a[2] == a[3] > a[1]
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_train_step_raises_the_likelihood_of_better_answers(one_thread: None) -> None:
    """One update moves probability towards the completions that scored above their group."""
    task = SortTask()
    model = build_model(SMALL)
    opt = make_optimizer(model, lr=1e-3)
    prompts = task.prompts(7, 8)
    groups = generate(model, prompts, 8, seed=1, max_new_tokens=task.completion_len)
    rewards = [[task.reward(c.prompt, c.tokens) for c in g] for g in groups]
    m = train_step(model, opt, prompts, groups, rewards)
    assert m.logprob_gap < 1e-5  # fp32 rollouts from the same weights: on-policy
    assert m.clipped_frac == 0.0
    assert m.grad_norm > 0.0
    assert 0.0 <= m.flat_groups < 1.0
    # Re-score the same completions under the updated model.
    flat = [(c, a) for g, rs in zip(groups, rewards, strict=True)
            for c, a in zip(g, group_advantages(rs), strict=True)]
    ids = torch.tensor([[*c.prompt, *c.tokens] for c, _ in flat])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    n = task.prompt_len
    new = logp[:, n - 1:-1].gather(2, ids[:, n:, None])[:, :, 0].sum(1)
    old = torch.tensor([sum(c.logprobs) for c, _ in flat])
    adv = torch.tensor([a for _, a in flat])
    change = new - old
    assert float(change[adv > 0].mean()) > float(change[adv < 0].mean())
    with pytest.raises(LocalProtocolError):
        train_step(model, opt, prompts[:2], groups, rewards)
    with pytest.raises(LocalProtocolError):
        train_step(model, opt, prompts[1:2], groups[:1], rewards[:1])


def test_rollout_split_covers_every_prompt_once() -> None:
    cfg = DemoConfig()
    prompts = rollout_prompts(cfg, 3)
    assert prompts == rollout_prompts(cfg, 3) != rollout_prompts(cfg, 4)
    shares = [peer_share(cfg, prompts, i) for i in range(cfg.num_peers)]
    assert [p for s in shares for p in s] == prompts
    assert {len(s) for s in shares} == {cfg.prompts_per_step // cfg.num_peers}
    assert derive_seed(0, "rollout", 1, 2) == derive_seed(0, "rollout", 1, 2)
    assert derive_seed(0, "rollout", 1, 2) != derive_seed(0, "rollout", 1, 3)
    with pytest.raises(LocalProtocolError):
        DemoConfig(prompts_per_step=30, num_peers=4)


@pytest.mark.timeout(240)
def test_grpo_learns_the_task_within_30_steps(one_thread: None) -> None:
    """The headline: a random-init policy, trained by RL alone from 4 peers' rollouts
    through a bf16 inference copy, visibly improves within 30 steps."""
    cfg = DemoConfig(steps=30, prompts_per_step=32)
    t0 = time.perf_counter()
    records = run_local(cfg)
    elapsed = time.perf_counter() - t0
    s = summarize(records)
    assert [r.step for r in records] == list(range(1, 31))
    assert s["reward_first"] < 0.2  # near chance at the start
    assert s["reward_last"] > s["reward_first"] + 0.2, s
    assert all(0.0 < r.delta_density <= 1.0 for r in records)
    print(f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, "
          f"density {s['density_mean']:.3f}, {elapsed:.1f} s")


def test_import_swarm_demo_task_does_not_import_torch() -> None:
    code = ("import sys, swarm, swarm.demo, swarm.demo.task; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_fp32_inference_state_round_trips_exactly() -> None:
    master = build_model(SMALL)
    state = inference_state(master, "float32")
    peer = model_from_state(SMALL, state)
    assert all(torch.equal(peer.state_dict()[k], master.state_dict()[k]) for k in state)


def test_stale_rollouts_are_scored_against_the_newer_master(one_thread: None) -> None:
    """With staleness 1 the second step's rollouts come from the base weights, so the
    trainer's log-probs (after one update) differ from the rollout's by more than the
    bf16 rounding gap of an on-policy step."""
    cfg = DemoConfig(model=SMALL, steps=3, prompts_per_step=8, num_peers=2, staleness=1)
    fresh = run_local(dataclasses.replace(cfg, staleness=0))
    stale = run_local(cfg)
    assert fresh[0].reward == stale[0].reward  # step 1: both sample the base version
    assert stale[1].metrics.logprob_gap > 3 * fresh[1].metrics.logprob_gap
    assert fresh[1].metrics.logprob_gap < 0.01


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_still_learns_from_one_version_stale_rollouts(one_thread: None) -> None:
    """Swarm peers generate with v-1 while fetching v: learning must survive that."""
    cfg = DemoConfig(steps=30, prompts_per_step=32, staleness=1)
    s = summarize(run_local(cfg))
    assert s["reward_last"] > s["reward_first"] + 0.2, s


def test_run_local_publishes_every_version_it_reports(one_thread: None) -> None:
    states: list[tuple[int, dict[str, torch.Tensor]]] = []
    cfg = DemoConfig(model=SMALL, steps=2, prompts_per_step=8, num_peers=4)
    records = run_local(cfg, on_publish=lambda v, s: states.append((v, dict(s))))
    assert [v for v, _ in states] == [0, 1, 2]
    assert all(t.dtype == torch.bfloat16 for _, s in states for t in s.values())
    for rec, (_, before), (_, after) in zip(records, states[:-1], states[1:], strict=True):
        assert rec.delta_density == delta_density(before, after) > 0.0
        assert 0.0 <= rec.reward <= 1.0
