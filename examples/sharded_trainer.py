"""A sharded trainer: FSDP2 over several processes, each rank publishing its own shards.

    python examples/sharded_trainer.py --ranks 2 --steps 5   # makes a 2M Qwen3 if needed
    swarm peer --run sharded --bootstrap <printed address> --trainer <printed peer id>

Every rank holds its shard of the model (``fully_shard``), finds and encodes its own
changes after each optimizer step, and hashes its own pieces (ShardedPublisher): only
chunk ids and piece digests cross the process group, never weights. Rank 0 signs one
manifest for every rank's chunks and runs the TrainerNode (announcements, catch-up,
leases); every other rank seeds its own chunks from its own SeederNode, so the uplinks of
all the hosts add up. The loss here is next-token prediction on random tokens: put your
RL loss (and ``node.add_tasks`` / ``node.collect`` on rank 0) in its place. On GPUs run it
with ``--backend nccl`` (one process per GPU).
"""

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

RUN = "sharded"


async def rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from swarm import (
        DataPlaneConfig,
        Identity,
        Libp2pNode,
        NodeConfig,
        SeederConfig,
        SeederNode,
        ShardedPublisher,
        TrainerConfig,
        TrainerNode,
    )
    from swarm.cli.trainer import wait_delivered
    from swarm.content.card import card_files, stop_ids_of
    from swarm.engines.hf_model import card_for, model_config_json

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    config = model_config_json(model)  # before fully_shard renames the class
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = Path(args.data_dir)
    me = Identity.load_or_create(data / ("node.key" if rank == 0 else f"rank{rank}.key"))
    host = args.listen.split("/")[2]
    async with contextlib.AsyncExitStack() as stack:
        net = await stack.enter_async_context(Libp2pNode(me, NodeConfig(
            listen=args.listen, run=RUN, data_plane=DataPlaneConfig(host=host))))
        # every rank's node joins the run through rank 0's (peers find them in the
        # run's directory; the manifests authorize them as seeders)
        box = [(str(net.listen_addresses[0]), me.peer_id) if rank == 0 else None]
        await asyncio.to_thread(dist.broadcast_object_list, box, 0)
        assert box[0] is not None
        trainer_addr, trainer_id = box[0]
        if rank != 0:
            await net.connect(trainer_addr)
        pub = ShardedPublisher(RUN, identity=me if rank == 0 else None, seeder=me.peer_id)
        v0 = await asyncio.to_thread(pub.start, model.state_dict())
        if rank == 0:
            node = await stack.enter_async_context(
                TrainerNode(me, net, TrainerConfig(run=RUN, data_dir=data)))
            seeding = node.driver.exchange
            first = await node.publish_sharded(v0)
            files = card_files(Path(args.model_dir))
            card = card_for(RUN, config=config, files=files, dtype="bfloat16",
                            version0=first.manifest.manifest,
                            stop_token_ids=stop_ids_of(json.loads(config), dict(files)))
            net.serve_card(card.sign(me).encode())
            print("trainer at", net.listen_addresses[0], flush=True)
            print(f"peers join with: swarm peer --run {RUN} --bootstrap "
                  f"{net.listen_addresses[0]} --trainer {me.peer_id}", flush=True)
            while len(set(net.connected_peers())) < args.min_peers + world - 1:
                await asyncio.sleep(0.2)
        else:
            seeder = await stack.enter_async_context(
                SeederNode(me, net, SeederConfig(run=RUN, trainer=trainer_id)))
            seeding = seeder.driver.exchange
        for step in range(1, args.steps + 1):
            await asyncio.to_thread(_train_step, model, optimizer, step)
            v = await asyncio.to_thread(pub.publish, model.state_dict())
            if rank == 0:
                p = await node.publish_sharded(v)
                print(f"step {step}: delta {p.payload_bytes} bytes, {len(v.chunks)} of "
                      f"{len(p.manifest.manifest.chunks)} chunks seeded here, "
                      f"{v.group_bytes} bytes sent over the process group "
                      f"({p.ratio:.0f}x smaller than dense)", flush=True)
            else:
                seeder.seed(v)
        if rank == 0:
            peers = set(net.connected_peers()) - set(v.manifest.manifest.seeder_peer_ids
                                                     if v.manifest else ())
            have, peers = await wait_delivered(node, peers, args.linger)
            print(f"last version reached {len(have)} of {len(peers)} peers", flush=True)
        await asyncio.to_thread(dist.barrier)  # the seeders serve until rank 0 is done
        # rank 0 alone prints every rank's upload (lines printed by two processes into
        # one pipe can interleave)
        uploads: list[tuple[str, int]] | None = [("", 0)] * world if rank == 0 else None
        await asyncio.to_thread(dist.gather_object, (me.peer_id, seeding.bytes_up), uploads)
        for r, (peer_id, sent) in enumerate(uploads or ()):
            print(f"rank {r} ({peer_id}) uploaded {sent} bytes", flush=True)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        asyncio.run(rank_main(rank, world, args))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    # gloo's worker threads can abort the interpreter's own teardown (SIGABRT): the job
    # is done and the process group destroyed, so leave without it
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes (one per GPU)")
    ap.add_argument("--model-dir", default="sharded-model",
                    help="a Hugging Face model dir (a 2M Qwen3 is made there if empty)")
    ap.add_argument("--params", default="2M", help="size of the model made: 2M .. 250M")
    ap.add_argument("--data-dir", default=".sharded-trainer")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--min-peers", type=int, default=1, help="wait for this many first")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0",
                    help="libp2p listen multiaddr of every rank's node")
    ap.add_argument("--linger", type=float, default=60.0,
                    help="most seconds to wait for the peers to take the last version")
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend")
    args = ap.parse_args()
    if not (Path(args.model_dir) / "config.json").exists():
        from swarm.hf.model import make_model_dir

        make_model_dir(Path(args.model_dir), params=args.params)
        print(f"made a {args.params} Qwen3 model in {args.model_dir}", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
