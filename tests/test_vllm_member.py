"""The vLLM backend's staging of verified versions, without vLLM: which version applies
over which, and the errors that leave the model as it was."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from swarm.demo.model import inference_state
from swarm.engines.hf_model import run_card
from swarm.engines.tensors import digest_of
from swarm.engines.torch_engine import random_qwen3
from swarm.identity import Identity
from swarm.integrations.vllm import VLLMVersionError, check_vllm_version
from swarm.integrations.vllm.member import (
    MemberConfig,
    StagedVersions,
    SwarmMember,
    VersionUnavailable,
)
from swarm.net.node import Libp2pNode, NodeConfig
from swarm.roles.trainer import TrainerConfig, TrainerNode

NAMES = ("a", "b", "c")


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4, generator=gen) for n in NAMES}


def _digests(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: digest_of(t) for n, t in state.items()}


def test_a_plan_composes_the_staged_versions_up_to_the_one_asked() -> None:
    s0 = _state(0)
    staged = StagedVersions(max_staged=4)
    staged.start(0, b"r0" * 16, _digests(s0))
    s1 = dict(s0, a=torch.ones(4))
    staged.stage(1, b"r1" * 16, {"a": s1["a"]})
    s2 = dict(s1, b=torch.zeros(4))
    staged.stage(2, b"r2" * 16, {"b": s2["b"]})
    s3 = dict(s2, a=torch.full((4,), 3.0))
    staged.stage(3, b"r3" * 16, {"a": s3["a"]})
    assert staged.staged() == [1, 2, 3]
    plan = staged.plan(2)
    assert set(plan.tensors) == {"a", "b"} and plan.digests == _digests(s2)
    assert plan.expected == {n: digest_of(s2[n]) for n in ("a", "b")}
    staged.applied(plan)
    assert staged.model_version == 2 and staged.staged() == [3]
    plan = staged.plan(3, b"r3" * 16)
    assert set(plan.tensors) == {"a"} and plan.digests == _digests(s3)


def test_bad_updates_are_refused_by_name() -> None:
    staged = StagedVersions(max_staged=2)
    staged.start(0, b"r0" * 16, _digests(_state(0)))
    with pytest.raises(VersionUnavailable, match="unknown version 1"):
        staged.plan(1)
    staged.stage(1, b"r1" * 16, {"a": torch.ones(4)})
    with pytest.raises(VersionUnavailable, match="root mismatch"):
        staged.plan(1, b"xx" * 16)
    with pytest.raises(VersionUnavailable, match="wrong base: the model holds version 0"):
        staged.plan(0)
    staged.stage(2, b"r2" * 16, {"b": torch.ones(4)})
    staged.stage(3, b"r3" * 16, {"c": torch.ones(4)})  # over the bound: 1 folds into 2
    assert staged.staged() == [2, 3]
    with pytest.raises(VersionUnavailable, match="folded into staged version 2"):
        staged.plan(1)
    assert set(staged.plan(3).tensors) == {"a", "b", "c"}
    assert staged.model_version == 0  # planning applies nothing


def test_weights_of_no_version_take_only_a_full_state() -> None:
    staged = StagedVersions()
    staged.start(-1, None, _digests(_state(9)))
    staged.stage(4, b"r4" * 16, {"a": torch.ones(4)})
    with pytest.raises(VersionUnavailable, match="wrong base: the model holds no version"):
        staged.plan(4)
    staged.stage(5, b"r5" * 16, _state(5))  # a keyframe
    assert set(staged.plan(5).tensors) == set(NAMES)


def test_the_vllm_version_is_checked_by_name() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(VLLMVersionError, match=r"written for vLLM 0\.32\.0; this is vLLM 0\.33"):
        check_vllm_version("0.33.1")


@pytest.mark.timeout(120)
async def test_a_member_stages_verified_versions_and_resumes_from_its_data_dir(
        tmp_path: Path) -> None:
    """The member on its own thread, against a trainer on loopback libp2p (no vLLM): each
    version is staged with the verified state's digests; a member started again on the
    same data dir stages the version it saved, whole."""
    master = random_qwen3(seed=3)
    base = inference_state(master, "float32")
    trainer_id = Identity.from_seed(b"M" * 32)
    async with Libp2pNode(trainer_id, NodeConfig(run="member")) as tnode, \
            TrainerNode(trainer_id, tnode, TrainerConfig(run="member",
                                                         data_dir=tmp_path / "t")) as trainer:
        v0 = await trainer.publish(base)
        tnode.serve_card(run_card(trainer_id, "member", master, v0.manifest,
                                  dtype="float32").encode())
        config = MemberConfig(bootstrap=(tnode.listen_addresses[0],),
                              trainer=trainer_id.peer_id, run="member",
                              data_dir=tmp_path / "m")

        def build(card: object) -> dict[str, torch.Tensor]:
            return {n: t.clone() for n, t in base.items()}

        member = SwarmMember(config, build)
        await asyncio.to_thread(member.start)
        try:
            assert member.staged.model_version == 0 and member.staged.staged() == []
            with torch.no_grad():
                for prm in master.parameters():
                    prm.add_((torch.rand(prm.shape) < 0.05) * 1e-2)
            state1 = inference_state(master, "float32")
            await trainer.publish(state1)
            assert await asyncio.to_thread(member.staged.wait, 1, 30.0)
            plan = member.staged.plan(1)
            assert plan.digests == _digests(state1)
            assert plan.tensors and all(torch.equal(t, state1[n]) for n, t in plan.tensors.items())
            async with asyncio.timeout(10):  # staged during the install, counted after it
                while member.status()["verified"] != 1:
                    await asyncio.sleep(0.02)
        finally:
            await asyncio.to_thread(member.stop)
        again = SwarmMember(config, build)
        await asyncio.to_thread(again.start)
        try:
            assert again.staged.model_version == 0 and again.staged.staged() == [1]
            plan = again.staged.plan(1)
            assert set(plan.tensors) == set(state1) and plan.digests == _digests(state1)
        finally:
            await asyncio.to_thread(again.stop)
