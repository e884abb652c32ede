"""A ``swarm`` weight-transfer backend for vLLM: a vLLM server that follows a swarm run.

``register()`` (a ``vllm.general_plugins`` entry point, which vLLM runs in every one of its
processes) adds the backend to vLLM's ``WeightTransferEngineFactory`` under the name
``"swarm"``. Then::

    llm = LLM(model_dir, weight_transfer_config={"backend": "swarm"}, ...)
    llm.init_weight_transfer_engine({"init_info": {
        "bootstrap": ["/ip4/.../tcp/.../p2p/<trainer id>"], "trainer": "<trainer id>",
        "run": "demo", "data_dir": "/var/lib/swarm-vllm"}})
    # ... the worker fetches and verifies each version through the swarm meanwhile ...
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 3}})
    llm.finish_weight_update(weight_version="3")
    llm.reset_prefix_cache()

This module imports no vLLM at import time; :mod:`swarm.integrations.vllm.backend` (the
engine, imported by vLLM when a server asks for the backend) does.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: The backend's name in ``--weight-transfer-config '{"backend": "swarm"}'``.
BACKEND = "swarm"
#: vLLM versions the backend was written and tested for (the engine API changes often).
TESTED_VLLM_VERSIONS = ("0.32.0",)

_ENGINE_CLASS = "SwarmWeightTransferEngine"
_TRAINER_CLASS = "SwarmTrainerWeightTransferEngine"
_MODULES = {_ENGINE_CLASS: "swarm.integrations.vllm.backend",
            _TRAINER_CLASS: "swarm.integrations.vllm.trainer"}


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not a version the backend was written for."""


def check_vllm_version(version: str) -> None:
    """:raises VLLMVersionError: ``version`` (a local suffix such as ``+cpu`` aside) is
    not one of :data:`TESTED_VLLM_VERSIONS`."""
    if version.split("+", 1)[0] not in TESTED_VLLM_VERSIONS:
        raise VLLMVersionError(
            f"swarm's vLLM weight-transfer backend was written for vLLM "
            f"{', '.join(TESTED_VLLM_VERSIONS)}; this is vLLM {version}, whose weight-transfer "
            "engine API may differ: install a tested vLLM, or leave this plugin out by "
            "listing the plugins to load in VLLM_PLUGINS)")


def register() -> None:
    """Register the ``swarm`` backend with vLLM: the receiving engine
    (``WeightTransferEngineFactory``) and the trainer's
    (``WeightTransferTrainerFactory``, :mod:`swarm.integrations.vllm.trainer`); idempotent
    (vLLM calls it in every process, possibly more than once).

    It also makes vLLM's CPU backend keep plain ``F.linear`` weights in servers that use
    the ``swarm`` backend (only those), so the backend can write them in place.

    :raises VLLMVersionError: the installed vLLM is not a tested version.
    """
    import vllm
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    check_vllm_version(str(vllm.__version__))
    for factory, cls in ((WeightTransferEngineFactory, _ENGINE_CLASS),
                         (WeightTransferTrainerFactory, _TRAINER_CLASS)):
        registry: dict[str, Any] = getattr(factory, "_registry", {})
        if BACKEND not in registry:
            factory.register_engine(BACKEND, _MODULES[cls], cls)
    _keep_plain_cpu_linear()


def _keep_plain_cpu_linear() -> None:
    """Wrap vLLM's CPU GEMM dispatch: layers of a model served with the ``swarm`` backend
    keep ``layer.weight`` and compute with ``F.linear`` (as the in-tree engine does, see
    ``swarm.engines.vllm_worker.use_plain_cpu_linear``); other models are packed as vLLM
    would. Idempotent. GPU platforms never call the dispatch."""
    from vllm.model_executor.layers import utils

    current = utils.dispatch_cpu_unquantized_gemm
    if getattr(current, "_swarm_backend", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        import torch
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        transfer = getattr(config, "weight_transfer_config", None)
        if transfer is not None and getattr(transfer, "backend", None) == BACKEND:
            layer.cpu_linear = torch.nn.functional.linear
            return
        current(layer, remove_weight)

    setattr(dispatch, "_swarm_backend", True)  # noqa: B010 (a function attribute)
    utils.dispatch_cpu_unquantized_gemm = dispatch
    log.debug("vLLM CPU linear layers keep plain weights under the swarm backend")
