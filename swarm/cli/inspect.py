"""``swarm inspect FILE``: pretty-print a signed manifest or an identity key."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from swarm.content.ids import hex_id
from swarm.content.manifest import MAX_MANIFEST_BYTES, SignedManifest
from swarm.errors import DecodeError, SignatureError
from swarm.identity import Identity, public_key_from_peer_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="a manifest (.manifest) or a PEM key file")
    p.add_argument("--trainer", metavar="PEER_ID",
                   help="also check that the manifest is signed by this peer id")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def describe_manifest(sm: SignedManifest, trainer: str | None = None) -> list[str]:
    m = sm.manifest
    when = (datetime.datetime.fromtimestamp(m.time_ms / 1000, datetime.UTC).isoformat()
            if m.time_ms else "-")
    lines = [
        f"manifest      {hex_id(sm.id)}",
        f"run           {m.run}",
        f"step          {m.step}",
        f"kind          {m.kind}",
        f"codec         {m.codec}",
        f"base root     {hex_id(m.base_root) if m.base_root else '-'}",
        f"target root   {hex_id(m.target_root)}",
        f"layout        {hex_id(m.layout_digest)}",
        f"piece size    {_human(m.piece_size)}",
        f"chunks        {len(m.chunks)} ({_human(m.total_bytes)}, {m.total_bytes} bytes)",
        f"keep          {m.keep_versions} versions",
        f"created       {when}",
        f"signer        {m.signer_peer_id}",
        f"signature     {'valid' if sm.verify() else 'INVALID'}",
    ]
    if trainer is not None:
        ok = public_key_from_peer_id(trainer) == m.signer
        lines.append(f"trainer       {'matches' if ok else 'DOES NOT MATCH'} {trainer}")
    return lines


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    head = path.read_bytes()[:64] if path.is_file() else b""
    if b"-----BEGIN" in head:
        ident = Identity.load(path)
        print(f"key           {path}")
        print("type          Ed25519")
        print(f"public key    {ident.public_key.hex()}")
        print(f"peer id       {ident.peer_id}")
        return 0
    if not path.is_file():
        raise DecodeError(f"{path} is not a file")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise DecodeError(f"{path} is larger than any manifest ({MAX_MANIFEST_BYTES} bytes)")
    sm = SignedManifest.decode(path.read_bytes(), check_signature=False)
    lines = describe_manifest(sm, args.trainer)
    print("\n".join(lines))
    valid = sm.verify() and (args.trainer is None or
                             public_key_from_peer_id(args.trainer) == sm.manifest.signer)
    if not valid:
        raise SignatureError("manifest signature check failed")
    return 0
