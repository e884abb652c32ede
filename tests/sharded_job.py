"""An FSDP2 training job on CPU processes (gloo) that publishes with ShardedPublisher.

Spawned by tests/test_sharded_publish.py and by ``swarm bench sharded``-style probes: each
rank trains a small Qwen3 for a few optimizer steps and publishes every step; rank 0 then
gathers, for the test only, the full states and every rank's chunks (the publisher itself
never moves values) and saves what the test compares with the single-process path.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from swarm.delta.sharded import ShardedPublisher, ShardedPublishError
from swarm.demo.model import TinyModelConfig, build_model
from swarm.identity import Identity

MODEL = TinyModelConfig(vocab_size=37, hidden_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, intermediate_size=320, seed=3)


def full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded inference state (a gather: the test's reference, not the product's)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            .to(torch.bfloat16).contiguous().clone() for k, v in model.state_dict().items()}


def seeder(rank: int) -> Identity:
    """The node that seeds rank ``rank``'s chunks (rank 0's is the trainer's)."""
    return Identity.from_seed(bytes([100 + rank]) * 32)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, MODEL.vocab_size, (4, 12), generator=g)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _refused_placement() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from swarm.delta.sharded import local_shards
    from swarm.errors import LocalProtocolError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t = distribute_tensor(torch.zeros(4, 8), mesh, [Shard(1)])
    try:
        local_shards({"lm_head.weight": t}, torch.bfloat16)
    except LocalProtocolError as exc:
        return str(exc)
    return ""


def worker(rank: int, world: int, port: int, out: str, steps: int, piece_size: int,
           die_at: int, resume: bool) -> None:
    """``die_at``: rank ``world - 1`` exits mid-publish of that step (0: never).
    ``resume``: start from the checkpoint an earlier job saved in ``out``."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    path = Path(out)
    model = build_model(MODEL)
    first = 0
    if resume:
        ckpt = torch.load(path / "checkpoint.pt")
        model.load_state_dict(ckpt["model"])
        first = ckpt["step"]
    model.train()
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    key = Identity.from_seed((path / "key").read_bytes()) if rank == 0 else None
    pub = ShardedPublisher("sharded-test", identity=key, piece_size=piece_size,
                           chunk_target=4096, threads=2, seeder=seeder(rank).peer_id)
    record: dict[str, Any] = {"versions": [], "bytes_sent": [], "states": {},
                              "chunks": {}, "rank_chunks": {}, "pieces": {}, "error": None,
                              "placement": _refused_placement()}
    expect = None
    if resume:
        expect = torch.load(path / "announced.pt")["root"]
    start = pub.start(model.state_dict(), first, expect_root=expect)
    record["start_root"] = start.root
    record["pieces"][first] = start.pieces
    full = full_bf16(model)
    if rank == 0:
        record["states"][first] = full
    for step in range(first + 1, first + steps + 1):
        _train_step(model, opt, step)
        if die_at == step and rank == world - 1:
            os._exit(3)  # killed mid-publish: after training, before the collectives
        try:
            v = pub.publish(model.state_dict())
        except ShardedPublishError as exc:
            record["error"] = str(exc)
            break
        everyone: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(v.chunks, everyone if rank == 0 else None, dst=0)
        full = full_bf16(model)
        master = {k: t.full_tensor() for k, t in model.state_dict().items()}
        if rank == 0:
            merged: dict[int, bytes] = {}
            for part in everyone:
                merged.update(part)
            record["versions"].append(v.manifest.encode() if v.manifest else b"")
            record["chunks"][v.step] = merged
            record["rank_chunks"][v.step] = everyone
            record["pieces"][v.step] = v.pieces
            record["states"][v.step] = full
            torch.save({"root": v.root}, path / "announced.pt")
            torch.save({"model": master, "step": v.step}, path / "checkpoint.pt")
        gathered_sent: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(v.group_bytes, gathered_sent if rank == 0 else None, dst=0)
        if rank == 0:
            record["bytes_sent"].append(gathered_sent)
    if rank == 0:
        torch.save(record, path / ("resumed.pt" if resume else "record.pt"))
    if record["error"] is None:
        dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads can abort the interpreter's own teardown (SIGABRT, 1 run in
    # tens here): the work is done and saved, so leave without it
    os._exit(0)


def run(world: int, out: Path, *, steps: int = 3, piece_size: int = 4096, die_at: int = 0,
        resume: bool = False, timeout: float = 120.0) -> list[int | None]:
    """Run the job on ``world`` processes; returns their exit codes (None: still running
    at ``timeout``, then killed)."""
    import multiprocessing
    import socket

    if not (out / "key").exists():
        (out / "key").write_bytes(Identity.generate().seed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, port, str(out), steps, piece_size,
                                              die_at, resume)) for r in range(world)]
    for p in procs:
        p.start()
    codes: list[int | None] = []
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes
