"""Content addressing: BLAKE3 ids, state layouts, pieces, state roots, manifests, chunk stores."""

from swarm.content.ids import DIGEST_LEN, chunk_id, hex_id
from swarm.content.layout import DTYPE_SIZES, StateLayout, TensorSpec
from swarm.content.manifest import Manifest, SignedManifest
from swarm.content.pieces import DEFAULT_PIECE_SIZE, piece_ids_of, state_root
from swarm.content.store import ChunkStore, DiskChunkStore, MemoryChunkStore

__all__ = [
    "DEFAULT_PIECE_SIZE",
    "DIGEST_LEN",
    "DTYPE_SIZES",
    "ChunkStore",
    "DiskChunkStore",
    "Manifest",
    "MemoryChunkStore",
    "SignedManifest",
    "StateLayout",
    "TensorSpec",
    "chunk_id",
    "hex_id",
    "piece_ids_of",
    "state_root",
]
