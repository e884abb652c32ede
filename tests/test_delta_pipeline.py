"""The pipelined encoder: an async iterator of finished chunks, bounded, in state order."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_delta_helpers import clone_state, gaussian_bf16_pair, same_bits

from swarm.content.manifest import SignedManifest
from swarm.delta import (
    CODEC_NAME,
    EncoderConfig,
    Patcher,
    delta_chunks,
    encode_delta,
    encode_delta_sync,
    iter_delta_chunks,
    state_root_of,
)
from swarm.delta import pipeline as pipeline_mod
from swarm.errors import LocalProtocolError
from swarm.identity import Identity

pytestmark = pytest.mark.timeout(60)

IDENTITY = Identity.from_seed(b"\x05" * 32)
CFG = EncoderConfig(segment_elems=1 << 14, chunk_target=500, bucket_bytes=1 << 16, threads=2)


def _many_tensors() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for i in range(8):
        o, n = gaussian_bf16_pair(1 << 15, 0.02, seed=i)
        old[f"layer{i}"], new[f"layer{i}"] = o["w"], n["w"]
    return old, new


async def test_async_chunks_match_blocking_and_arrive_in_state_order() -> None:
    old, new = _many_tensors()
    got = [c async for c in iter_delta_chunks(old, new, CFG)]
    assert [c.cid for c in got] == [c.cid for c in delta_chunks(old, new, CFG)]
    firsts = [c.tensors[0] for c in got]
    assert firsts == sorted(firsts) and len(got) > 4


async def test_first_chunk_ready_before_last_tensor_is_scanned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most two buckets are submitted ahead of the consumer."""
    old, new = _many_tensors()
    submitted: list[int] = []
    real = pipeline_mod._Plan.submit

    def spy(self: pipeline_mod._Plan, pool: object, index: int) -> object:
        submitted.append(index)
        return real(self, pool, index)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline_mod._Plan, "submit", spy)
    agen = iter_delta_chunks(old, new, CFG)
    first = await agen.__anext__()
    assert first.tensors[0] == 0
    assert len(submitted) <= pipeline_mod.MAX_IN_FLIGHT_BUCKETS
    await agen.aclose()
    assert len(submitted) < 8
    assert not [t for t in threading.enumerate() if t.name.startswith("swarm-delta")]


async def test_encode_delta_signs_a_manifest_that_patches() -> None:
    old, new = _many_tensors()
    signed, chunks = await encode_delta(old, new, IDENTITY, "run-a", 12, config=CFG,
                                        time_ms=1234)
    m = signed.manifest
    assert (m.kind, m.codec, m.run, m.step) == ("delta", CODEC_NAME, "run-a", 12)
    assert m.base_root == state_root_of(old) and m.target_root == state_root_of(new)
    again = SignedManifest.decode(signed.encode(), trusted_signer=IDENTITY.public_key)
    assert again.manifest == m
    state = clone_state(old)
    patcher = Patcher(state, again)
    for c in reversed(chunks):
        await asyncio.sleep(0)
        patcher.apply(c.cid, c.data)
    assert patcher.finish() == set(old)
    assert same_bits(state, new)
    sync_signed, _ = encode_delta_sync(old, new, IDENTITY, "run-a", 12, config=CFG,
                                                 time_ms=1234)
    assert sync_signed.body == signed.body


def test_mismatched_states_are_refused() -> None:
    old, new = _many_tensors()
    new["layer0"] = new["layer0"].float()
    with pytest.raises(LocalProtocolError):
        list(delta_chunks(old, new, CFG))
    with pytest.raises(ValueError):
        EncoderConfig(segment_elems=0)


def test_a_non_contiguous_last_tensor_is_refused_before_the_first_chunk() -> None:
    old, new = _many_tensors()
    new["layer7"] = new["layer7"].t().contiguous().t()  # same shape and values
    assert not new["layer7"].is_contiguous()
    chunks = delta_chunks(old, new, CFG)
    with pytest.raises(LocalProtocolError, match="layer7: tensor is not contiguous"):
        next(chunks)
