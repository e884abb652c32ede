"""TRL's GRPOTrainer with swarm peers generating: the trainer's loop is TRL's own.

    pip install 'deltaswarm[trl]'
    python examples/trl_grpo.py            # 5 steps, 2 `swarm peer` processes it starts

A tiny Qwen3 (made offline from a config, with the shipped tokenizer, warm-started on the
task) learns to add two numbers, rewarded by a program. ``swarm.integrations.trl.attach``
swaps TRL's vLLM generation for the swarm: each ``sync_weights`` publishes a sparse bf16
delta, each batch goes out as signed leases, and the peers' completions and log-probs
come back into TRL's loss. The peers run ``--check-engine``: after every version their
engine's per-tensor digests are compared with the verified state's, and this script
checks them against the trainer's own for that version (``--peers 0``: it starts none,
and prints the command volunteers join with).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RUN = "trl-add"


class Peer:
    """A ``swarm peer`` process, its JSON status lines read as they come."""

    def __init__(self, name: str, argv: list[str], workdir: Path) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self._stderr = (workdir / f"{name}.stderr").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm", "peer", *argv, "--name", name, "--status-json"],
            cwd=workdir, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))

    def checked_versions(self) -> dict[int, tuple[str, str]]:
        """version -> (the engine's weights digest, the verified state's) for each
        version verified: the engine check that came just before its ``verified``."""
        out: dict[int, tuple[str, str]] = {}
        last: tuple[str, str] | None = None
        for e in list(self.events):
            if e.get("event") == "engine_checked":
                last = (e["engine"], e["state"])
            elif e.get("event") == "verified" and last is not None:
                out[int(e["version"])] = last
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


def main(a: argparse.Namespace) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from swarm.hf.model import make_model_dir
    from swarm.hf.task import TextTask
    from swarm.integrations.trl import SwarmConfig, attach

    torch.set_num_threads(1)
    work = a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    for old in [work / "trainer", *work.glob("p[0-9]*")]:  # a new run each time (not the model)
        if old.is_dir():
            shutil.rmtree(old)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        make_model_dir(model_dir, params="2M", warm=a.warm_start, say=lambda s: None)
        print(f"made a 2M Qwen3 in {model_dir} ({a.warm_start} warm-start steps)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    task = TextTask()
    # TRL takes plain-text prompts (here already in the model's ChatML layout)
    prompts = task.prompts(1, a.prompts * a.steps)
    data = Dataset.from_dict({"prompt": prompts})

    def add_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [task.reward(p, c) for p, c in zip(prompts, completions, strict=True)]

    args = GRPOConfig(
        output_dir=str(work / "out"), max_steps=a.steps, learning_rate=a.lr,
        per_device_train_batch_size=a.prompts * a.group, num_generations=a.group,
        max_completion_length=task.max_new_tokens, temperature=1.0, beta=0.0,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=add_reward, args=args, train_dataset=data,
                          processing_class=tokenizer)

    class Print(TrainerCallback):  # TRL's own logs, one line a step
        def on_log(self, _args: Any, state: Any, _control: Any, logs: Any = None,
                   **_: Any) -> None:
            if logs and "loss" in logs:
                keys = ("loss", "reward", "reward_std", "completions/mean_length",
                        "sampling/importance_sampling_ratio/mean", "swarm/peers",
                        "swarm/delta_bytes", "swarm/sync_s", "step_time")
                print(f"trl log step {state.global_step}: " + ", ".join(
                    f"{k}={logs[k]:.4g}" for k in keys if k in logs), flush=True)

    trainer.add_callback(Print())
    swarm = attach(trainer, SwarmConfig(run=RUN, data_dir=work / "trainer",
                                        listen=a.listen, min_peers=a.peers,
                                        model_dir=model_dir, record_digests=True,
                                        linger=a.linger, replay_fraction=a.replay_fraction,
                                        collect_timeout=a.collect_timeout))
    print("trainer at", swarm.address)
    print("peers join with:", swarm.join_command)
    peers: list[Peer] = []
    try:
        for i in range(a.peers):
            extra = ["--base-weights", str(model_dir)] if i == 0 else []
            peers.append(Peer(f"p{i}", ["--run", RUN, "--bootstrap", swarm.address,
                                        "--trainer", swarm.peer_id, "--data-dir",
                                        str(work / f"p{i}"), "--tasks", "2",
                                        "--check-engine", *extra], work))
        with swarm:
            swarm.wait_for_peers(a.peers, timeout=300)
            t0 = time.perf_counter()
            trainer.train()
            took = time.perf_counter() - t0
        s = swarm.stats
        deltas = s.payload_bytes
        print(f"trained {a.steps} steps in {took:.1f} s ({took / a.steps:.2f} s a step); "
              f"{s.completions} completions from {len(s.holders)} peer(s)")
        if deltas:
            print(f"sync_weights: {sum(s.sync_seconds) / len(s.sync_seconds):.3f} s on "
                  f"average; a version is {sum(deltas) / len(deltas) / 1e3:.1f} kB "
                  f"published vs {s.dense_bytes / 1e3:.1f} kB dense "
                  f"({s.dense_bytes * len(deltas) / max(1, sum(deltas)):.1f}x smaller)")
        ok = True
        want = swarm.digests  # version -> the trainer's weights digest of what it published
        deadline = time.monotonic() + 60
        for p in peers:
            while (time.monotonic() < deadline and
                   not set(want) <= set(p.checked_versions()) and p.proc.poll() is None):
                time.sleep(0.2)
            got = p.checked_versions()
            bad = [v for v in want if got.get(v) != (want[v], want[v])]
            ok &= not bad
            print(f"peer {p.name}: verified versions {sorted(got)}; "
                  + ("every one with the trainer's per-tensor digests" if not bad else
                     f"versions {bad} missing or with other digests"))
        if a.peers and len(s.holders) < a.peers:
            print(f"only {len(s.holders)} of {a.peers} peers generated")
            ok = False
        return 0 if ok else 1
    finally:
        for p in peers:
            p.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--peers", type=int, default=2, help="swarm peer processes to start")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warm-start", type=int, default=60, metavar="STEPS",
                    help="supervised steps when making the model (RL then has reward)")
    ap.add_argument("--workdir", type=Path, default=Path(".trl-grpo"))
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--linger", type=float, default=30.0)
    ap.add_argument("--collect-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="most seconds a batch waits for its completions")
    ap.add_argument("--replay-fraction", type=float, default=0.1,
                    help="share of the tasks the trainer generates again to check them")
    args = ap.parse_args()
    if not 0.0 <= args.replay_fraction <= 1.0:
        ap.error("--replay-fraction is a share, in [0, 1]")
    if not args.collect_timeout > 0:
        ap.error("--collect-timeout must be > 0")
    try:
        sys.exit(main(args))
    except Exception as exc:
        from swarm.errors import SwarmError

        if not isinstance(exc, SwarmError):
            raise
        print(f"swarm: error: {exc}", file=sys.stderr)
        sys.exit(2)
