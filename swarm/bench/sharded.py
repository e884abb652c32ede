"""``swarm bench sharded``: a sharded trainer's publish, next to gathering the state first.

A real FSDP2 job on CPU processes (gloo): a Qwen3 of ``--params`` (random weights, tied
embeddings, as ``python -m swarm.hf.model`` makes), every decoder layer and the root
``fully_shard``-ed over ``--ranks`` processes, trained with AdamW on random tokens. After
each optimizer step, on the same state, side by side:

- **sharded**: :class:`~swarm.delta.sharded.ShardedPublisher` (each rank encodes and hashes
  its own shards; ids, digests and tree summaries cross the group);
- **gather, then publish**: every rank casts its shards to bf16 and all-gathers the full
  state (``full_tensor()``, as vLLM's ModuleSource does), and rank 0 encodes the delta and
  hashes the state as a single-process trainer does (its encode and hash alone are the
  **single-process** row).

Per method: publish time (the slowest rank), peak resident memory per rank during the
publish (over the job's own resident set before it), bytes each rank sent over the
process group, the payload, and whether the roots agree. The first step (Adam's first
moves every weight) only sets the base.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarm.errors import SwarmError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from swarm.hf.model import SHAPES

    p.add_argument("--params", choices=sorted(SHAPES), default="250M",
                   help="model size (a Qwen3 shape of swarm.hf.model, 1,024-token vocabulary)")
    p.add_argument("--ranks", type=int, default=2, help="processes of the FSDP2 job")
    p.add_argument("--steps", type=int, default=3,
                   help="optimizer steps (each after the first is published both ways)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.ranks <= 64 or args.steps < 2:
        raise SwarmError("--ranks must be in 1..64 and --steps at least 2")
    with tempfile.TemporaryDirectory(prefix="swarm-bench-sharded-") as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, tmp, args.params,
                                                 args.steps, args.lr, not args.json))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise SwarmError(f"the job failed: rank {bad[0][0]} exited with {bad[0][1]}")
        report = json.loads((Path(tmp) / "report.json").read_text())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _print(r: dict[str, Any]) -> None:
    mb = 1e6
    print(f"\n{r['params']} Qwen3 ({r['numel'] / 1e6:.1f}M parameters, "
          f"{r['dense_bytes'] / mb:.1f} MB in bf16), {r['ranks']} ranks (FSDP2, gloo, CPU); "
          f"last of {r['steps']} steps, {r['density'] * 100:.2f}% of elements changed")
    print(f"{'method':<26}{'publish s':>11}{'peak MB/rank':>14}{'sent/rank':>14}"
          f"{'payload':>12}")
    for row in r["rows"]:
        sent = row["sent_bytes"]
        sent_s = f"{sent / mb:.1f} MB" if sent >= mb else f"{sent / 1e3:.1f} KB"
        print(f"{row['method']:<26}{row['seconds']:>11.2f}{row['peak_mb']:>14.0f}"
              f"{sent_s:>14}{row['payload_bytes'] / mb:>9.2f} MB")
    s, g = r["rows"][0], r["rows"][1]
    print(f"sharded vs gather-then-publish: {g['seconds'] / s['seconds']:.2f}x the speed, "
          f"{g['sent_bytes'] / max(1, s['sent_bytes']):.0f}x fewer bytes across the group, "
          f"{g['peak_mb'] / max(1.0, s['peak_mb']):.1f}x less peak memory per rank; "
          f"roots equal: {'yes' if r['roots_equal'] else 'NO'}")


def _status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> float:
    """Start a new peak resident-set measurement (Linux: VmHWM back to VmRSS, after
    glibc hands freed heap back, so that what a method allocates shows); returns the
    resident MB it starts from."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def _rank(rank: int, world: int, port: int, tmp: str, params: str, steps: int, lr: float,
          progress: bool) -> None:
    code = 0
    try:
        _job(rank, world, port, tmp, params, steps, lr, progress)
    except Exception as exc:  # one line per failed rank; the parent reports the exit
        print(f"swarm: error: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's worker threads can abort the interpreter's own teardown (SIGABRT): the
    # process group is destroyed and the report written, so leave without it
    os._exit(code)


def _job(rank: int, world: int, port: int, tmp: str, params: str, steps: int, lr: float,
         progress: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from swarm.delta.pipeline import EncoderConfig, encode_delta_sync
    from swarm.delta.sharded import ShardedPublisher
    from swarm.engines.torch_engine import random_qwen3
    from swarm.hf.model import SHAPES
    from swarm.identity import Identity

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    def say(msg: str) -> None:
        if progress and rank == 0:
            print(msg, flush=True)

    shape = SHAPES[params]
    model = random_qwen3(vocab_size=1024, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_layers=shape.layers,
                         num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                         head_dim=shape.hidden // shape.heads, max_positions=512,
                         tie_word_embeddings=True, seed=0, use_cache=False)
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    key = Identity.generate() if rank == 0 else None
    pub = ShardedPublisher("bench", identity=key)

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 1024, (2, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def gathered() -> dict[str, torch.Tensor]:
        out = {}
        for k, v in model.state_dict().items():
            low = v.to(torch.bfloat16)
            out[k] = (low.full_tensor() if isinstance(low, DTensor) else low).contiguous()
        return out

    say(f"{params} Qwen3 on {world} ranks: training step 1 (sets the base)")
    train(1)
    pub.start(model.state_dict(), 0)
    first = gathered()  # a collective: every rank takes part, rank 0 keeps it
    prev = first if rank == 0 else None
    del first
    rows: list[dict[str, Any]] = []
    density = 0.0
    roots_equal = False
    for step in range(2, steps + 1):
        train(step)
        # sharded
        base = _reset_peak()
        dist.barrier()
        t0 = time.monotonic()
        v = pub.publish(model.state_dict())
        t_sharded = time.monotonic() - t0
        peak_sharded = _status_mb("VmHWM") - base
        # gather, then publish
        base = _reset_peak()
        dist.barrier()
        t0 = time.monotonic()
        full = gathered()
        t_gather = time.monotonic() - t0
        peak_gather = _status_mb("VmHWM") - base
        t_single = 0.0
        single_root = b""
        payload = 0
        peak_single = 0.0
        if rank == 0:
            assert prev is not None and key is not None
            before = _reset_peak()
            t1 = time.monotonic()
            sm, _ = encode_delta_sync(prev, full, key, "bench", v.step,
                                      config=EncoderConfig())
            t_single = time.monotonic() - t1
            peak_single = _status_mb("VmHWM") - before
            peak_gather = max(peak_gather, _status_mb("VmHWM") - base)
            single_root, payload = sm.manifest.target_root, sm.manifest.total_bytes
            changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                          for a, b in zip(prev.values(), full.values(), strict=True))
            density = changed / sum(t.numel() for t in full.values())
            prev = full
        dist.barrier()
        t_total = time.monotonic() - t0
        del full
        sent_gather = sum(t.to_local().numel() * 2 * (world - 1)
                          for t in model.state_dict().values() if isinstance(t, DTensor))
        mine = {"sharded": (t_sharded, peak_sharded, v.group_bytes),
                "gather": (t_total, peak_gather, sent_gather), "gather_s": t_gather}
        each: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(mine, each if rank == 0 else None, dst=0)
        if rank == 0:
            assert v.manifest is not None
            rows = [
                _row("sharded", [e["sharded"] for e in each], v.manifest.manifest.total_bytes),
                _row("gather, then publish", [e["gather"] for e in each], payload),
                {"method": "single process (encode)", "seconds": t_single,
                 "peak_mb": peak_single,
                 "sent_bytes": 0, "payload_bytes": payload},
            ]
            roots_equal = single_root == v.root
            say(f"step {step}: sharded {rows[0]['seconds']:.2f} s, gather then publish "
                f"{rows[1]['seconds']:.2f} s (gather {max(e['gather_s'] for e in each):.2f} s)"
                f"; roots equal: {roots_equal}")
    if rank == 0:
        state = model.state_dict()
        report = {"params": params, "ranks": world, "steps": steps, "density": density,
                  "numel": sum(t.numel() for t in state.values()),
                  "dense_bytes": sum(t.numel() * 2 for t in state.values()),
                  "rows": rows, "roots_equal": roots_equal}
        (Path(tmp) / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _row(method: str, per_rank: list[tuple[float, float, int]], payload: int
         ) -> dict[str, Any]:
    return {"method": method, "seconds": max(r[0] for r in per_rank),
            "peak_mb": max(r[1] for r in per_rank), "sent_bytes": max(r[2] for r in per_rank),
            "payload_bytes": payload}
