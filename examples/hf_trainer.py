"""Train a Hugging Face model with swarm: GRPO on a text task, rollouts from volunteers.

    python examples/hf_trainer.py --model-dir my-model   # makes a 25M Qwen3 there if empty
    swarm peer --run hf-add --bootstrap <printed address> --trainer <printed peer id> \
        [--base-weights my-model]

Peers need nothing but that line: they fetch the run card (the model's config, tokenizer
and eos ids, signed by this trainer), build the model offline, and follow the versions
this loop publishes. A peer that has the model dir (``--base-weights``) starts at version
0 and fetches only deltas; others fetch one keyframe first. Point ``--model-dir`` at your
own HF model dir (config.json, safetensors, tokenizer) and swap the task for yours.
"""

import argparse
import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm import (
    DataPlaneConfig,
    Identity,
    Libp2pNode,
    NodeConfig,
    Sampling,
    TrainerConfig,
    TrainerNode,
    inference_state,
    run_card,
)
from swarm.cli.trainer import wait_delivered
from swarm.demo.grpo import Rollout
from swarm.engines.rollout_check import PolicyWindow, policy_builder
from swarm.hf.grpo import grpo_step
from swarm.hf.model import make_model_dir
from swarm.hf.task import TextTask, decode_completion, encode_prompts, stop_token_ids

RUN = "hf-add"


async def main(model_dir: Path, *, steps: int, listen: str, linger: float, prompts: int,
               group: int, min_peers: int, params: str, lr: float, warm: int) -> None:
    if not (model_dir / "config.json").exists():
        make_model_dir(model_dir, params=params, warm=warm)
        print(f"made a {params} Qwen3 model in {model_dir} ({warm} warm-start steps)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    task = TextTask()
    stop = stop_token_ids(tokenizer)
    # The trainer checks every result before it counts: log-probs recomputed under the
    # result's version, a tenth of the tasks replayed (see the README's Untrusted rollouts)
    policies = PolicyWindow(policy_builder(model), keep=3)
    me = Identity.load_or_create(Path(".hf-trainer/node.key"))
    host = listen.split("/")[2]  # the data plane listens on the same interface
    async with Libp2pNode(me, NodeConfig(listen=listen, run=RUN,
                                           data_plane=DataPlaneConfig(host=host))) as net, \
            TrainerNode(me, net, TrainerConfig(run=RUN, data_dir=Path(".hf-trainer")),
                        checks=policies.checks("bfloat16")) as node:
        print("trainer at", net.listen_addresses[0])
        print(f"peers join with: swarm peer --run {RUN} --bootstrap {net.listen_addresses[0]} "
              f"--trainer {me.peer_id}")
        v0 = await node.publish(policies.add(0, inference_state(model)))        # version 0
        net.serve_card(run_card(me, RUN, model, v0.manifest, model_dir=model_dir).encode())
        while len(net.connected_peers()) < min_peers:
            await asyncio.sleep(0.2)
        for step in range(1, steps + 1):
            texts = task.prompts(step, prompts)
            tasks = node.add_tasks(
                [(f"{step}-{i}", ids) for i, ids in enumerate(encode_prompts(tokenizer, texts))],
                group_size=group, sampling=Sampling(max_tokens=task.max_new_tokens, seed=step,
                                                    stop_token_ids=stop))
            accepted = await node.collect(tasks)  # only these tasks, checked
            results = {r.task_id: r for a in accepted for r in a.results}
            groups = [[Rollout(tuple(t.prompt_tokens), tuple(c.token_ids), tuple(c.logprobs))
                       for c in results[t.task_id].completions] for t in tasks]
            rewards = [[task.reward(text, decode_completion(tokenizer, c.tokens)) for c in g]
                       for text, g in zip(texts, groups, strict=True)]
            metrics = await asyncio.to_thread(grpo_step, model, optimizer, groups, rewards,
                                              pad_id=tokenizer.pad_token_id)
            pub = await node.publish(policies.add(step, inference_state(model)))  # a delta
            print(f"step {step}: reward {metrics.reward_mean:.3f}, "
                  f"{sum(len(g) for g in groups)} completions from "
                  f"{len({a.holder for a in accepted})} peer(s); delta "
                  f"{pub.payload_bytes} bytes ({pub.ratio:.1f}x smaller than dense); "
                  f"{len(node.rejected)} result(s) refused by the checks so far")
        have, peers = await wait_delivered(node, set(net.connected_peers()), linger)
        print(f"last version reached {len(have)} of {len(peers)} peers")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("hf-model"))
    ap.add_argument("--params", default="25M", help="size of the model made when the dir "
                    "is empty: 2M, 25M, 50M or 250M")
    ap.add_argument("--warm-start", type=int, default=40, metavar="STEPS",
                    help="supervised steps on the task when making the model, so that RL "
                         "starts with some reward (as from a pretrained model)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--min-peers", type=int, default=1, help="wait for this many first")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/4003",
                    help="libp2p listen multiaddr (default: loopback only)")
    ap.add_argument("--public", action="store_true",
                    help="listen on every interface (/ip4/0.0.0.0/tcp/4003)")
    ap.add_argument("--linger", type=float, default=60.0,
                    help="most seconds to keep seeding the last version")
    a = ap.parse_args()
    asyncio.run(main(a.model_dir, steps=a.steps, linger=a.linger, prompts=a.prompts,
                     group=a.group, min_peers=a.min_peers, params=a.params, lr=a.lr,
                     warm=a.warm_start,
                     listen="/ip4/0.0.0.0/tcp/4003" if a.public else a.listen))
