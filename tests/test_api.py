"""The public API: every name importable from ``swarm``, lazily, and ``import swarm`` light."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

import swarm

LAZY = ("TrainerNode", "TrainerConfig", "Published", "RolloutPeer", "PeerConfig", "Libp2pNode",
        "NodeConfig", "DataPlaneConfig", "Identity", "RolloutEngine", "TorchEngine",
        "VLLMEngine", "VLLMEngineConfig", "Sampling", "Completion", "RolloutTask",
        "TaskResult", "Accepted", "LeaseConfig", "inference_state", "run_card")


HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def test_every_public_name_imports_from_swarm() -> None:
    names = [n for n in LAZY if HAVE_VLLM or not n.startswith("VLLM")]
    code = "import swarm\n" + "".join(
        f"from swarm import {n}\nassert {n} is swarm.{n}\nprint({n}.__module__)\n"
        for n in names)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert all(m.startswith("swarm.") for m in out.stdout.split()), out.stdout
    assert set(LAZY) <= set(swarm.__all__) and set(LAZY) <= set(dir(swarm))


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_vllm_names_need_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", "from swarm import VLLMEngine"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'vllm'" in out.stderr


def test_import_swarm_loads_no_heavy_layer() -> None:
    code = ("import sys, swarm; from swarm import Sampling, Completion, LeaseConfig, Identity; "
            "heavy = [m for m in ('torch', 'libp2p', 'vllm', 'trio', 'swarm.roles', "
            "'swarm.net', 'swarm.engines') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_all_names_resolve_and_unknown_ones_raise() -> None:
    for name in swarm.__all__:
        if not name.startswith("VLLM") or HAVE_VLLM:
            assert getattr(swarm, name) is not None
    with pytest.raises(AttributeError):
        _ = swarm.NoSuchThing  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from swarm import NoSuchThing", {})


def test_one_sampling_and_one_completion_from_wire_to_engine() -> None:
    from swarm.engines import Completion, Sampling
    from swarm.protocol.leases import Completion as WireCompletion
    from swarm.protocol.leases import Sampling as WireSampling

    assert swarm.Sampling is Sampling is WireSampling
    assert swarm.Completion is Completion is WireCompletion


def test_trainer_config_exposes_the_lease_policy(tmp_path: object) -> None:
    from pathlib import Path

    from swarm import LeaseConfig, TrainerConfig

    d = Path(str(tmp_path))
    assert TrainerConfig(run="r", data_dir=d, max_staleness=2).lease_config == LeaseConfig(
        run="r", max_staleness=2)
    policy = LeaseConfig(run="r", grace_s=9.0, max_leases_per_peer=4, backup_after=None)
    assert TrainerConfig(run="r", data_dir=d, leases=policy).lease_config is policy
    for wrong in (LeaseConfig(run="other"), LeaseConfig(run="r", max_staleness=3)):
        with pytest.raises(ValueError):
            TrainerConfig(run="r", data_dir=d, leases=wrong)
