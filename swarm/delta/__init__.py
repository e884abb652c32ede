"""Bit-exact sparse deltas of model states: extraction, codec, patch, revert, state roots.

Importing this package imports torch, numpy and the codec's C extension
(``swarm.delta._xg``); ``import swarm`` does not.
"""

from swarm.delta.codec import (
    CODEC_NAME,
    AppliedChunk,
    apply_chunk,
    decode_chunk,
    revert_chunk,
)
from swarm.delta.patch import Patcher
from swarm.delta.pipeline import (
    DeltaChunk,
    EncoderConfig,
    delta_chunks,
    encode_delta,
    encode_delta_sync,
    iter_delta_chunks,
)
from swarm.delta.state import (
    KeyframeFiller,
    keyframe_manifest,
    layout_of,
    piece_ids_of_state,
    piece_views,
    state_root_of,
)

__all__ = [
    "CODEC_NAME",
    "AppliedChunk",
    "DeltaChunk",
    "EncoderConfig",
    "KeyframeFiller",
    "Patcher",
    "apply_chunk",
    "decode_chunk",
    "delta_chunks",
    "encode_delta",
    "encode_delta_sync",
    "iter_delta_chunks",
    "keyframe_manifest",
    "layout_of",
    "piece_ids_of_state",
    "piece_views",
    "revert_chunk",
    "state_root_of",
]
