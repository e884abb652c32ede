"""``swarm bench codec`` and its workload, on sizes that run in seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_delta_helpers import gaussian_bf16_pair

from swarm.bench import codec as bench_codec
from swarm.bench.workload import ModelShape, WorkloadConfig, delta_pair
from swarm.delta import _xg
from swarm.errors import SwarmError

pytestmark = pytest.mark.timeout(120)

TINY = ModelShape(vocab=512, hidden=64, layers=1, intermediate=128, heads=2, kv_heads=1,
                  head_dim=32)


def test_workload_delta_is_sparse_like_rl_finetuning() -> None:
    old, new = delta_pair(WorkloadConfig(TINY, batch=2, seq=16), warmup=3)
    assert list(old) == list(new)
    assert all(t.dtype == torch.bfloat16 for t in new.values())
    changed = {k: int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum())
               for k in old}
    total = sum(t.numel() for t in old.values())
    density = sum(changed.values()) / total
    assert 0.001 < density < 0.2  # a few percent at lr 1e-6, never dense
    assert all(v == 0 for k, v in changed.items() if k.endswith("norm.weight"))
    emb = changed["model.embed_tokens.weight"] / old["model.embed_tokens.weight"].numel()
    assert emb < density  # only sampled tokens' rows get gradients


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_codec.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_bench_on_user_checkpoints_prints_every_row(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    old, new = gaussian_bf16_pair(1 << 16, 0.012, seed=9)
    save_file(old, str(tmp_path / "a.safetensors"))
    save_file(new, str(tmp_path / "b.safetensors"))
    code = bench_codec.run(_args(old=tmp_path / "a.safetensors", new=tmp_path / "b.safetensors",
                                 repeat=1, threads=2))
    out = capsys.readouterr().out
    assert code == 0
    paths = _xg.simd_paths()
    assert _xg.simd() == paths[0]  # the bench leaves the fastest path on
    for needle in ("AuroraRL/SparrowRL", "NeMo-DCR", "swarm-xg1", "positions | old exponent",
                   "vs memcpy 1T", "vs best memcpy", "encode / patch vs one-thread memcpy",
                   "extraction's floor", f"{paths[0]} path", "state root vs blake3",
                   "signed target root: True", "revert restored the base root: True"):
        assert needle in out
    for path in paths[1:]:  # every slower path this CPU runs, side by side
        assert f"extract + encode ({path} kernels)" in out
        assert f"decode + patch ({path} kernels)" in out
    ours = next(line for line in out.splitlines() if "swarm-xg1" in line)
    leb = next(line for line in out.splitlines() if "AuroraRL" in line)
    ratio = float(ours.split()[-2].rstrip("x"))
    assert ratio > float(leb.split()[-2].rstrip("x"))
    assert ours.split()[-1] == "yes"


def test_bench_checks_the_torch_engine_against_the_c_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = gaussian_bf16_pair(1 << 16, 0.012, seed=10)
    save_file(old, str(tmp_path / "a.safetensors"))
    save_file(new, str(tmp_path / "b.safetensors"))
    code = bench_codec.run(_args(old=tmp_path / "a.safetensors", new=tmp_path / "b.safetensors",
                                 repeat=1, threads=2, torch_device="cpu"))
    out = capsys.readouterr().out
    assert code == 0
    assert "extract + encode (torch ops on cpu)" in out
    assert "chunks identical to the C engine's: True" in out


def test_bench_refuses_an_unknown_torch_device(tmp_path: Path) -> None:
    old, new = gaussian_bf16_pair(256, 0.012, seed=11)
    save_file(old, str(tmp_path / "a.safetensors"))
    save_file(new, str(tmp_path / "b.safetensors"))
    with pytest.raises(SwarmError, match="--torch-device nosuch"):
        bench_codec.run(_args(old=tmp_path / "a.safetensors", new=tmp_path / "b.safetensors",
                              repeat=1, threads=2, torch_device="nosuch"))


def test_bench_refuses_half_a_checkpoint_pair(tmp_path: Path) -> None:
    with pytest.raises(SwarmError, match="give both --old and --new"):
        bench_codec.run(_args(old=tmp_path / "a.safetensors"))
