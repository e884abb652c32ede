"""Sharded publishing on real FSDP2 jobs (gloo, CPU processes): each rank encodes and hashes
its own shards, and the result is the single-process path's, bit for bit.

The job (tests/sharded_job.py) trains a small Qwen3 for a few AdamW steps; rank 0 saves the
full states (gathered for the test only) and every rank's chunks. Here a peer applies each
signed delta to the previous full state, as a peer does, and must reach the next state
exactly, under the root an unsharded publish of that state gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_job import run, seeder

from swarm.content.manifest import SignedManifest
from swarm.delta.patch import Patcher
from swarm.delta.pipeline import EncoderConfig, encode_delta_sync
from swarm.delta.state import piece_ids_of_state, state_root_of
from swarm.identity import Identity

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.long]


def _load(out: Path, name: str = "record.pt") -> dict[str, Any]:
    rec: dict[str, Any] = torch.load(out / name, weights_only=False)
    return rec


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _check_versions(rec: dict[str, Any], key: Identity, piece_size: int, first: int,
                    world: int) -> list[SignedManifest]:
    states = rec["states"]
    assert rec["start_root"] == state_root_of(states[first], piece_size)
    hosts = tuple(seeder(r).public_key for r in range(1, world))
    out = []
    for data in rec["versions"]:
        sm = SignedManifest.decode(data, trusted_signer=key.public_key)
        m = sm.manifest
        before, after = states[m.step - 1], states[m.step]
        # the roots are the single-process path's
        assert m.base_root == state_root_of(before, piece_size)
        assert m.target_root == state_root_of(after, piece_size)
        # the other ranks' nodes are authorized to seed, and the root rank knows every
        # piece id (a keyframe of the version, served by peers holding it)
        assert m.seeders == hosts
        assert [cid for cid, _ in rec["pieces"][m.step]] == \
            piece_ids_of_state(after, piece_size)
        single, _ = encode_delta_sync(before, after, key, "sharded-test", m.step,
                                      config=EncoderConfig(piece_size=piece_size))
        assert single.manifest.target_root == m.target_root
        # and a peer holding the previous version reaches this one exactly
        peer = {k: v.clone() for k, v in before.items()}
        patcher = Patcher(peer, sm)
        chunks = rec["chunks"][m.step]
        assert sorted(chunks) == list(range(len(m.chunks)))
        for i, (cid, _) in enumerate(m.chunks):
            patcher.apply(cid, chunks[i])
        patcher.finish()
        assert _same(peer, after)
        assert not _same(before, after)
        out.append(sm)
    return out


@pytest.mark.parametrize(("world", "piece_size"), [(2, 4096), (4, 4 << 20)])
def test_sharded_publish_gives_the_single_process_roots_and_peer_states(
        tmp_path: Path, world: int, piece_size: int) -> None:
    """2 ranks with 4 KiB pieces (tensors of many pieces, a few straddling a boundary), and
    4 ranks with 4 MiB pieces (every tensor one piece, held in 4 parts; the embedding's 37
    rows split 10/10/10/7, boundaries not 1 KiB aligned)."""
    assert run(world, tmp_path, steps=3, piece_size=piece_size) == [0] * world
    rec = _load(tmp_path)
    key = Identity.from_seed((tmp_path / "key").read_bytes())
    assert rec["error"] is None
    sms = _check_versions(rec, key, piece_size, 0, world)
    assert [sm.manifest.step for sm in sms] == [1, 2, 3]
    # chunks of every rank are in the one manifest
    assert all(len(sm.manifest.chunks) >= world for sm in sms)
    # no values cross the process group: ids, digests and tree summaries only
    dense = sum(t.numel() * 2 for t in rec["states"][0].values())
    for per_rank in rec["bytes_sent"]:
        assert max(per_rank) < dense / 20
    assert "lm_head.weight" in rec["placement"] and "Shard(dim=1)" in rec["placement"]


def test_sharded_rank_killed_mid_publish_leaves_the_version_unsigned_and_a_restart_goes_on(
        tmp_path: Path) -> None:
    codes = run(2, tmp_path, steps=3, die_at=2)
    assert codes == [0, 3]  # rank 0 survives it with an error, not a hang
    rec = _load(tmp_path)
    assert rec["error"] and "step 2 was not published" in rec["error"]
    assert [SignedManifest.decode(d).manifest.step for d in rec["versions"]] == [1]
    # the job restarts from its checkpoint of step 1 and publishes step 2 and 3
    assert run(2, tmp_path, steps=2, resume=True) == [0, 0]
    again = _load(tmp_path, "resumed.pt")
    key = Identity.from_seed((tmp_path / "key").read_bytes())
    assert again["error"] is None
    announced_root = SignedManifest.decode(rec["versions"][0]).manifest.target_root
    assert again["start_root"] == announced_root
    sms = _check_versions(again, key, 4096, 1, 2)
    assert [sm.manifest.step for sm in sms] == [2, 3]
    assert sms[0].manifest.base_root == announced_root
