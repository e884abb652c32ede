"""Seed your own RL loop with swarm: the trainer side in a few lines.

Run it, then point volunteers at the printed address:
    python examples/trainer_loop.py            # loopback; --public: every interface
    swarm peer --bootstrap <printed address> --trainer <printed peer id>

Replace the tiny demo policy, prompts and reward with your own model and task. The
peers here run the demo's policy (``swarm peer`` builds it from the same config).
"""

import argparse
import asyncio
from pathlib import Path

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
from swarm.demo.grpo import DemoConfig, Rollout, make_optimizer, rollout_prompts, train_step
from swarm.demo.model import build_model


async def main(steps: int = 10, listen: str = "/ip4/127.0.0.1/tcp/4002",
               linger: float = 60.0) -> None:
    cfg = DemoConfig()
    model = build_model(cfg.model)  # your torch model (fp32 master)
    opt = make_optimizer(model, cfg.lr)
    me = Identity.load_or_create(Path(".trainer/node.key"))
    host = listen.split("/")[2]  # the data plane listens on the same interface
    async with Libp2pNode(me, NodeConfig(listen=listen, run="demo",
                                           data_plane=DataPlaneConfig(host=host))) as net, \
            TrainerNode(me, net, TrainerConfig(run="demo", data_dir=Path(".trainer"))) as node:
        print("trainer at", net.listen_addresses[0])
        print(f"peers join with: swarm peer --bootstrap {net.listen_addresses[0]} "
              f"--trainer {me.peer_id}")
        v0 = await node.publish(inference_state(model))                   # version 0
        net.serve_card(run_card(me, "demo", model, v0.manifest).encode())  # what peers run
        for step in range(1, steps + 1):
            prompts = rollout_prompts(cfg, step)
            tasks = node.add_tasks([(f"{step}-{i}", p) for i, p in enumerate(prompts)],
                                   group_size=cfg.group_size,
                                   sampling=Sampling(max_tokens=cfg.task.completion_len,
                                                     seed=step))
            results = {r.task_id: r for a in await node.collect(tasks) for r in a.results}
            groups = [[Rollout(t.prompt_tokens, c.token_ids, c.logprobs)  # c: a Completion
                       for c in results[t.task_id].completions] for t in tasks]
            rewards = [[cfg.task.reward(c.prompt, c.tokens) for c in g] for g in groups]
            train_step(model, opt, prompts, groups, rewards)
            pub = await node.publish(inference_state(model))                # sparse delta
            print(f"step {step}: delta {pub.payload_bytes} bytes ({pub.ratio:.1f}x)")


        # Keep seeding until every connected peer has the last version (at most `linger` s).
        have, peers = await wait_delivered(node, set(net.connected_peers()), linger)
        print(f"last version reached {len(have)} of {len(peers)} peers")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/4002",
                    help="libp2p listen multiaddr (default: loopback only)")
    ap.add_argument("--public", action="store_true",
                    help="listen on every interface (/ip4/0.0.0.0/tcp/4002)")
    ap.add_argument("--linger", type=float, default=60.0,
                    help="most seconds to keep seeding the last version")
    a = ap.parse_args()
    asyncio.run(main(a.steps, "/ip4/0.0.0.0/tcp/4002" if a.public else a.listen, a.linger))
