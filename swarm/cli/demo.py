"""``swarm demo``: seal a small model state as a signed keyframe, store and verify it.

Runs end to end on this machine with nothing downloaded: a trainer identity is created,
a random bf16 state is cut into pieces, stored in an on-disk chunk store, described by a
signed manifest, then read back, re-hashed and checked against the signed state root.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from swarm.cli.inspect import describe_manifest
from swarm.content import DiskChunkStore, Manifest, SignedManifest, StateLayout
from swarm.content.pieces import piece_ids_of, piece_slices, state_root
from swarm.errors import IntegrityError
from swarm.identity import Identity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=Path(".demo"), help="working directory")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the toy model")
    p.add_argument("--layers", type=int, default=4, help="number of layers")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    h = args.hidden
    specs: list[tuple[str, str, list[int]]] = [("embed.weight", "bfloat16", [1024, h])]
    for i in range(args.layers):
        specs += [(f"layers.{i}.attn.weight", "bfloat16", [3 * h, h]),
                  (f"layers.{i}.mlp.weight", "bfloat16", [4 * h, h]),
                  (f"layers.{i}.norm.weight", "bfloat16", [h])]
    layout = StateLayout.of(specs)
    # bf16 bit patterns of N(0, 0.02) draws: the top 16 bits of the fp32 values.
    tensors = [
        (rng.normal(0, 0.02, size=t.numel).astype(np.float32).view(np.uint32) >> 16)
        .astype(np.uint16)
        for t in layout
    ]
    piece_size = 1 << 20
    args.dir.mkdir(parents=True, exist_ok=True)
    key_path = args.dir / "trainer.key"
    trainer = Identity.load_or_create(key_path)
    print(f"trainer {trainer.peer_id} (key {key_path})")

    t0 = time.perf_counter()
    buffers = [t.data for t in tensors]
    ids = piece_ids_of(buffers, layout, piece_size)
    root = state_root(layout, ids, piece_size)
    store = DiskChunkStore(args.dir / "store")
    slices = piece_slices(layout, piece_size)
    for cid, (i, off, n) in zip(ids, slices, strict=True):
        store.put(cid, bytes(memoryview(buffers[i]).cast("B")[off:off + n]), version=0)
    sm = Manifest(
        run="demo", step=0, kind="keyframe", base_root=None, target_root=root,
        layout_digest=layout.digest, codec="raw", piece_size=piece_size,
        chunks=tuple((cid, n) for cid, (_, _, n) in zip(ids, slices, strict=True)),
        time_ms=int(time.time() * 1000),
    ).sign(trainer)
    manifest_path = args.dir / "step-0.manifest"
    manifest_path.write_bytes(sm.encode())
    sealed = time.perf_counter() - t0

    received = SignedManifest.decode(manifest_path.read_bytes(),
                                     trusted_signer=trainer.public_key)
    pieces = [store.get(cid) for cid in received.manifest.chunk_ids]
    if any(p is None for p in pieces):
        raise IntegrityError("a piece is missing from the store")
    rebuilt = _reassemble(layout, pieces, slices)
    again = state_root(layout, piece_ids_of(rebuilt, layout, piece_size), piece_size)
    if again != received.manifest.target_root:
        raise IntegrityError("state root of the stored pieces does not match the manifest")
    print("\n".join(describe_manifest(received)))
    mb = layout.nbytes / 1e6
    print(f"sealed {mb:.1f} MB in {sealed:.2f} s; read back, re-hashed and verified: "
          f"root matches the signed manifest")
    return 0


def _reassemble(layout: StateLayout, pieces: list[bytes | None],
                slices: list[tuple[int, int, int]]) -> list[bytearray]:
    out = [bytearray(t.nbytes) for t in layout]
    for piece, (i, off, n) in zip(pieces, slices, strict=True):
        assert piece is not None and len(piece) == n
        out[i][off:off + n] = piece
    return out
