"""TRL's GRPOTrainer with swarm generating: rollouts from volunteer peers, weights by delta.

A TRL ``GRPOTrainer`` calls two methods of its vLLM generation backend: ``sync_weights()``
after each optimizer step and ``generate(prompt_ids, ...)`` for each batch.
:func:`attach` puts a :class:`~swarm.integrations.trl.generation.SwarmGeneration` there:
``sync_weights`` publishes the model as a sparse bf16 delta through a swarm
:class:`~swarm.roles.trainer.TrainerNode`, and ``generate`` hands the prompts out as signed
leases to ``swarm peer`` processes; their completions and log-probs come back into TRL's
loss (with TRL's importance-sampling correction), metrics and logging::

    from swarm.integrations.trl import SwarmConfig, attach

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                          train_dataset=data, processing_class=tokenizer)
    with attach(trainer, SwarmConfig(run="my-run", data_dir=Path(".swarm-trl"))) as swarm:
        print("peers join with:", swarm.join_command)
        trainer.train()

This module imports no TRL; :func:`attach` checks TRL's version first
(:data:`TESTED_TRL_VERSIONS`) and refuses others with :class:`TRLVersionError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarm.errors import SwarmError

if TYPE_CHECKING:
    from swarm.integrations.trl.generation import SwarmConfig, SwarmGeneration, attach

#: TRL versions the adapter was written and tested for (it replaces GRPOTrainer's vLLM
#: generation backend, whose calls change across TRL versions).
TESTED_TRL_VERSIONS = ("1.16.0",)


class TRLVersionError(SwarmError):
    """The installed TRL is not a version the adapter was written for."""


def check_trl_version(version: str) -> None:
    """:raises TRLVersionError: ``version`` is not one of :data:`TESTED_TRL_VERSIONS`."""
    if version.split("+", 1)[0] not in TESTED_TRL_VERSIONS:
        raise TRLVersionError(
            f"swarm's TRL adapter was written for TRL {', '.join(TESTED_TRL_VERSIONS)}; this "
            f"is TRL {version}, whose GRPOTrainer may call its generation backend otherwise: "
            f"install a tested TRL (pip install 'deltaswarm[trl]')")


def installed_trl_version() -> str:
    """The installed TRL's version, checked.

    :raises TRLVersionError: TRL is missing or not a tested version.
    """
    try:
        import trl
    except ImportError as exc:
        raise TRLVersionError(f"TRL is not installed ({exc}): pip install 'deltaswarm[trl]'"
                              ) from None
    version = str(trl.__version__)
    check_trl_version(version)
    return version


_LAZY = {"SwarmConfig", "SwarmGeneration", "attach"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from swarm.integrations.trl import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TESTED_TRL_VERSIONS", "SwarmConfig", "SwarmGeneration", "TRLVersionError",
           "attach", "check_trl_version", "installed_trl_version"]
