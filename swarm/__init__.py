"""swarm: bit-exact sparse RL weight deltas spread peer to peer.

The public API, importable from here::

    from swarm import Identity, Libp2pNode, NodeConfig, Sampling, TrainerConfig, TrainerNode

Importing this package is cheap: it pulls in neither torch, libp2p nor vLLM. Each public
name below is imported on first use (PEP 562), with the layer it lives in
(``swarm.roles``, ``swarm.net``, ``swarm.engines``, ``swarm.protocol.leases``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from swarm.errors import (
    DecodeError,
    IntegrityError,
    KeyFileError,
    LocalProtocolError,
    RemoteProtocolError,
    SignatureError,
    StoreError,
    SwarmError,
)

if TYPE_CHECKING:
    from swarm.delta.sharded import ShardedPublisher, ShardedVersion
    from swarm.demo.model import inference_state
    from swarm.engines import RolloutEngine
    from swarm.engines.hf_model import run_card
    from swarm.engines.torch_engine import TorchEngine
    from swarm.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from swarm.identity import Identity
    from swarm.net.dataplane import DataPlaneConfig
    from swarm.net.node import Libp2pNode, NodeConfig
    from swarm.protocol.leases import (
        Accepted,
        Completion,
        LeaseConfig,
        RolloutTask,
        Sampling,
        TaskResult,
    )
    from swarm.roles.peer import PeerConfig, RolloutPeer
    from swarm.roles.seeder import SeederConfig, SeederNode
    from swarm.roles.trainer import Published, TrainerConfig, TrainerNode

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # roles: the trainer and the rollout peer
    "TrainerNode": "swarm.roles.trainer",
    "TrainerConfig": "swarm.roles.trainer",
    "Published": "swarm.roles.trainer",
    "RolloutPeer": "swarm.roles.peer",
    "PeerConfig": "swarm.roles.peer",
    # a sharded (FSDP2) trainer: each rank publishes and seeds its own shards
    "ShardedPublisher": "swarm.delta.sharded",
    "ShardedVersion": "swarm.delta.sharded",
    "SeederNode": "swarm.roles.seeder",
    "SeederConfig": "swarm.roles.seeder",
    # the network and identities
    "Libp2pNode": "swarm.net.node",
    "NodeConfig": "swarm.net.node",
    "DataPlaneConfig": "swarm.net.dataplane",
    "Identity": "swarm.identity",
    # rollout engines
    "RolloutEngine": "swarm.engines",
    "TorchEngine": "swarm.engines.torch_engine",
    "VLLMEngine": "swarm.engines.vllm_engine",
    "VLLMEngineConfig": "swarm.engines.vllm_engine",
    # rollout work, from the wire to the engine and back
    "Sampling": "swarm.protocol.leases",
    "Completion": "swarm.protocol.leases",
    "RolloutTask": "swarm.protocol.leases",
    "TaskResult": "swarm.protocol.leases",
    "Accepted": "swarm.protocol.leases",
    "LeaseConfig": "swarm.protocol.leases",
    # the state a trainer publishes
    "inference_state": "swarm.demo.model",
    "run_card": "swarm.engines.hf_model",
}

__all__ = [
    "Accepted",
    "Completion",
    "DataPlaneConfig",
    "DecodeError",
    "Identity",
    "IntegrityError",
    "KeyFileError",
    "LeaseConfig",
    "Libp2pNode",
    "LocalProtocolError",
    "NodeConfig",
    "PeerConfig",
    "Published",
    "RemoteProtocolError",
    "RolloutEngine",
    "RolloutPeer",
    "RolloutTask",
    "Sampling",
    "SeederConfig",
    "SeederNode",
    "ShardedPublisher",
    "ShardedVersion",
    "SignatureError",
    "StoreError",
    "SwarmError",
    "TaskResult",
    "TorchEngine",
    "TrainerConfig",
    "TrainerNode",
    "VLLMEngine",
    "VLLMEngineConfig",
    "__version__",
    "inference_state",
    "run_card",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
