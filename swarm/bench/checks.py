"""``swarm bench checks``: the trainer's rollout checks, calibrated and costed side by side.

It trains the demo policy for a few GRPO steps (so that it is no longer uniform), and at
every version after the first has a peer engine (torch, or vLLM with ``--engine vllm``)
generate tasks honestly and as each cheating strategy of ``swarm peer --chaos-cheat``.
Every result then goes through the checks the trainer runs (copy, log-probs, a replay of
every task), and the report gives:

- how far honest log-probs are from the trainer's recomputation (largest and largest mean
  per completion): what the tolerance must allow, for this engine and dtype;
- how far each cheating strategy is, and the share of its results each check refuses;
- the honest results refused (false positives; 0 is the requirement);
- what the checks cost the trainer per task, next to what generating the task cost the
  peer; and how far the fp32 master's log-probs (the loss's forward pass) are from the
  bf16 policy's, which is why the check cannot reuse that pass.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from swarm.engines import CHEAT_STRATEGIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="the peer's engine (the trainer always recomputes with torch)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the published policy")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps (versions checked)")
    p.add_argument("--tasks", type=int, default=8, help="tasks per version and strategy")
    p.add_argument("--group", type=int, default=4, help="completions per task")
    p.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="calibrate on this Hugging Face model dir instead of the demo policy "
                        "(prompts of the text task of swarm.hf, its tokenizer; make one with "
                        "python -m swarm.hf.model DIR --params 25M --warm-start 40)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of the steps between versions (demo 3e-2, HF 1e-5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from swarm.errors import SwarmError

    if args.steps < 1 or args.tasks < 1 or args.group < 2:
        raise SwarmError("--steps and --tasks must be at least 1, --group at least 2")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        raise SwarmError(f"{args.model_dir} is not a Hugging Face model dir (no config.json); "
                         f"make one with: python -m swarm.hf.model {args.model_dir}")
    report = _measure(args, _HFWork(args) if args.model_dir is not None else _DemoWork(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


class _DemoWork:
    """The demo's policy and GRPO task: versions that move as the demo's do."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from swarm.demo.grpo import DemoConfig, make_optimizer
        from swarm.demo.model import build_model

        self.cfg = DemoConfig(steps=args.steps, prompts_per_step=args.tasks,
                              group_size=args.group, num_peers=1, inference_dtype=args.dtype,
                              lr=args.lr if args.lr is not None else 3e-2)
        self.args = args
        self.dtype = getattr(torch, args.dtype)
        self.master = build_model(self.cfg.model)
        self.optimizer = make_optimizer(self.master, self.cfg.lr, self.cfg.weight_decay,
                                        self.cfg.adam_eps)
        self.vocab_size = self.cfg.model.vocab_size
        self.max_positions = self.cfg.model.max_positions
        self.name = "the demo policy"

    def build(self, state: dict[str, Any]) -> Any:
        from swarm.demo.model import model_from_state

        return model_from_state(self.cfg.model, state, self.dtype)

    def prompts(self, version: int) -> list[tuple[int, ...]]:
        from swarm.demo.grpo import rollout_prompts

        return rollout_prompts(self.cfg, version + 1)

    def sampling(self, version: int) -> Any:
        from swarm.demo.grpo import derive_seed
        from swarm.protocol.leases import Sampling

        return Sampling(max_tokens=self.cfg.task.completion_len,
                        temperature=self.cfg.temperature,
                        seed=derive_seed(self.cfg.seed, "bench", version) % (1 << 62))

    def train(self, prompts: list[tuple[int, ...]], groups: list[list[Any]]) -> None:
        from swarm.demo.grpo import train_step

        rewards = [[self.cfg.task.reward(r.prompt, r.tokens) for r in g] for g in groups]
        train_step(self.master, self.optimizer, prompts, groups, rewards,
                   temperature=self.cfg.temperature)


class _HFWork:
    """A Hugging Face model dir on the text task of :mod:`swarm.hf`: versions that move
    by GRPO steps at a fine-tuning learning rate."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from swarm.hf.task import TextTask, stop_token_ids

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        self.master = AutoModelForCausalLM.from_pretrained(args.model_dir,
                                                           dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.master.parameters(),
                                           lr=args.lr if args.lr is not None else 1e-5)
        self.task = TextTask()
        self.stop = stop_token_ids(self.tokenizer)
        config = self.master.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 512))
        params = sum(p.numel() for p in self.master.parameters())
        self.name = f"{args.model_dir} ({params / 1e6:.0f}M parameters)"
        self._texts: dict[tuple[int, ...], str] = {}

    def build(self, state: dict[str, Any]) -> Any:
        from swarm.engines.rollout_check import policy_builder

        return policy_builder(self.master)(state)

    def prompts(self, version: int) -> list[tuple[int, ...]]:
        from swarm.hf.task import encode_prompts

        texts = self.task.prompts(version, self.args.tasks)
        ids = [tuple(p) for p in encode_prompts(self.tokenizer, texts)]
        self._texts.update(zip(ids, texts, strict=True))
        return ids

    def sampling(self, version: int) -> Any:
        from swarm.protocol.leases import Sampling

        return Sampling(max_tokens=self.task.max_new_tokens, seed=1000 + version,
                        stop_token_ids=self.stop)

    def train(self, prompts: list[tuple[int, ...]], groups: list[list[Any]]) -> None:
        from swarm.hf.grpo import grpo_step
        from swarm.hf.task import decode_completion

        rewards = [[self.task.reward(self._texts[p],
                                     decode_completion(self.tokenizer, r.tokens)) for r in g]
                   for p, g in zip(prompts, groups, strict=True)]
        grpo_step(self.master, self.optimizer, groups, rewards,
                  pad_id=self.tokenizer.pad_token_id)


class _Peer:
    """The peer's engine at one version, torch or vLLM, built from the published state."""

    def __init__(self, args: argparse.Namespace, work: Any) -> None:
        self.args = args
        self.work = work
        self._dir = Path(tempfile.mkdtemp(prefix="swarm-bench-checks-"))
        self._vllm: Any = None

    def engine(self, state: dict[str, Any]) -> Any:
        from swarm.engines.torch_engine import TorchEngine

        model: Any = self.work.build(state).eval()
        if self.args.engine == "torch":
            return TorchEngine(model)
        if self._vllm is None:
            from safetensors.torch import save_file

            from swarm.engines.hf_model import model_config_json
            from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

            (self._dir / "config.json").write_text(model_config_json(model))
            save_file({n: t.contiguous() for n, t in state.items()},
                      str(self._dir / "model.safetensors"))
            self._vllm = VLLMEngine(VLLMEngineConfig(
                model_dir=str(self._dir), dtype=self.args.dtype,
                max_model_len=min(512, self.work.max_positions)))
        else:
            self._vllm.apply(state)
        return self._vllm


def _measure(args: argparse.Namespace, work: Any) -> dict[str, Any]:
    import torch

    from swarm.demo.grpo import Rollout
    from swarm.demo.model import inference_state
    from swarm.engines.cheater import CheatingEngine
    from swarm.engines.rollout_check import TOLERANCES, LogprobCheck, PolicyWindow, ReplayCheck
    from swarm.engines.torch_engine import TorchEngine
    from swarm.identity import Identity
    from swarm.protocol.checks import CheckInput, CopyCheck
    from swarm.protocol.leases import Result, RolloutTask, TaskResult

    torch.set_num_threads(1)
    ident = Identity.from_seed(b"b" * 32)
    master = work.master
    window = PolicyWindow(work.build, keep=3)
    peer = _Peer(args, work)
    tol = TOLERANCES[args.dtype][args.engine]
    rows: dict[str, dict[str, Any]] = {
        s: {"results": 0, "refused": 0, "by": {}, "max_abs": 0.0, "mean_abs": 0.0,
            "gen_s": 0.0, "tasks": 0}
        for s in ("honest", *CHEAT_STRATEGIES)}
    cost = {"logprobs": 0.0, "replay": 0.0, "copy": 0.0, "tasks": 0}
    master_gap = 0.0
    next_task = 0

    state = window.add(0, inference_state(master, args.dtype))
    prev_state = state
    group = args.group
    vocab = work.vocab_size
    for version in range(args.steps + 1):
        prompts = work.prompts(version)
        sampling = work.sampling(version)
        if version > 0:
            honest = peer.engine(state)
            before: Any = work.build(prev_state).eval()
            stale = CheatingEngine(TorchEngine(before), "stale", vocab_size=vocab)
            copy_check = CopyCheck()
            logprobs = LogprobCheck(window.model_for, TOLERANCES[args.dtype])
            replay = ReplayCheck(window.engine_for, 1.0)  # torch results only
            for strategy in rows:
                if strategy == "honest":
                    engine = honest
                elif strategy == "stale":
                    engine = stale  # holds the previous version's weights
                elif strategy == "other-model":  # other weights need a torch model
                    now: Any = work.build(state).eval()
                    engine = CheatingEngine(TorchEngine(now), strategy, vocab_size=vocab,
                                            seed=version)
                else:
                    engine = CheatingEngine(honest, strategy, vocab_size=vocab, seed=version)
                row = rows[strategy]
                for p in prompts:
                    t0 = time.perf_counter()
                    comps = tuple(engine.generate([list(p)] * group, sampling))
                    row["gen_s"] += time.perf_counter() - t0
                    row["tasks"] += 1
                    task = RolloutTask(next_task, "b", tuple(p), group, sampling)
                    res = Result("bench", b"\0" * 16, version, (TaskResult(next_task, comps),),
                                 0, engine=engine.kind).sign(ident)
                    next_task += 1
                    inp = CheckInput(res, {task.task_id: task}, None)
                    logprobs.seen.clear()
                    failed = None
                    for name, check in (("copy", copy_check), ("logprobs", logprobs),
                                        ("replay", replay)):
                        t0 = time.perf_counter()
                        why = check(inp)
                        if strategy == "honest":
                            cost[name] += time.perf_counter() - t0
                        failed = failed or (name if why else None)
                    row["results"] += 1
                    if failed:
                        row["refused"] += 1
                        row["by"][failed] = row["by"].get(failed, 0) + 1
                    for m in logprobs.seen:  # this result's (up to the first refused)
                        row["max_abs"] = max(row["max_abs"], m.max_abs)
                        row["mean_abs"] = max(row["mean_abs"], m.mean_abs)
                    if strategy == "honest":
                        cost["tasks"] += 1
                        master_gap = max(master_gap, _master_gap(master, p, comps))
            if args.engine == "torch":
                honest.close()
        # one GRPO step on honest rollouts: the policy moves as in a run
        policy = window.engine_for(version)
        assert policy is not None
        work.train(prompts, [[Rollout(tuple(p), c.token_ids, c.logprobs) for c in
                              policy.generate([list(p)] * group, replace(sampling, seed=version))]
                             for p in prompts])
        prev_state, state = state, window.add(version + 1, inference_state(master, args.dtype))
    n = max(1, cost["tasks"])
    gen = rows["honest"]["gen_s"] / max(1, rows["honest"]["tasks"])
    return {
        "model": work.name, "engine": args.engine, "dtype": args.dtype, "versions": args.steps,
        "tasks_per_version": args.tasks, "group": args.group,
        "tolerance": {"max_abs": tol.max_abs, "mean_abs": tol.mean_abs, "min_log_p": tol.min_log_p},
        "strategies": rows,
        "cost_per_task_ms": {k: round(1000 * cost[k] / n, 3) for k in ("copy", "logprobs",
                                                                          "replay")},
        "generate_per_task_ms": round(1000 * gen, 3),
        "master_fp32_gap": master_gap,
    }


def _master_gap(master: Any, prompt: Any, comps: Any) -> float:
    """Largest |log-prob| difference between the fp32 master and what the peer reported."""
    import torch

    from swarm.engines.rollout_check import recompute

    worst = 0.0
    for logits, c in zip(recompute(master, prompt, comps), comps, strict=True):
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, float((lp.double() - torch.tensor(c.logprobs)).abs().max()))
    return worst


def _print(r: dict[str, Any]) -> None:
    tol = r["tolerance"]
    print(f"rollout checks on {r['model']}: peer engine {r['engine']}, {r['dtype']} policy, "
          f"{r['versions']} "
          f"versions x {r['tasks_per_version']} tasks x {r['group']} completions per strategy")
    print(f"tolerance: per token {tol['max_abs']:g}, mean {tol['mean_abs']:g}, "
          f"likelihood bound >= e^{tol['min_log_p']:g}")
    print(f"{'strategy':<15}{'max |dlp|':>11}{'max mean':>10}{'refused':>14}  by check")
    for name, row in r["strategies"].items():
        refused = f"{row['refused']}/{row['results']}"
        by = ", ".join(f"{k} {v}" for k, v in sorted(row["by"].items())) or "-"
        print(f"{name:<15}{row['max_abs']:>11.3g}{row['mean_abs']:>10.3g}{refused:>14}  {by}")
    c = r["cost_per_task_ms"]
    gen = r["generate_per_task_ms"]
    print(f"trainer cost per task: log-probs {c['logprobs']:.2f} ms ({c['logprobs'] / gen:.2f}x "
          f"the peer's generation, {gen:.2f} ms), replay {c['replay']:.2f} ms "
          f"({c['replay'] / gen:.2f}x, on the replayed fraction only), copy {c['copy']:.3f} ms")
    gap = r["master_fp32_gap"]
    verdict = ("within the tolerance: for results of the master's own version the loss's "
               "forward pass could stand in for the check" if gap <= tol["max_abs"] else
               "past the tolerance: the loss's forward pass cannot stand in for the check")
    print(f"fp32 master vs the {r['dtype']} policy: log-probs differ by up to {gap:.3g}, "
          f"{verdict}")
