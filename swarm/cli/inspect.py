"""``swarm inspect PATH``: pretty-print what the nodes write.

- a signed manifest (``*.manifest``), a run card (``run.card``) or an identity key (PEM);
- a saved state (``published.state`` of a trainer, ``peer.state`` of a peer; the format
  of :mod:`swarm.roles.persist`): its versions, signer, layout and size, checked against
  the signer named in the file (or ``--trainer``);
- a node's data directory: its key's peer id, the saved state, the chunk store's
  versions, and a trainer's lease book.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from swarm.content.ids import hex_id
from swarm.content.manifest import MAX_MANIFEST_BYTES, SignedManifest
from swarm.errors import DecodeError, SignatureError
from swarm.identity import Identity, public_key_from_peer_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, metavar="PATH",
                   help="a manifest, a key file, a saved state (published.state, peer.state) "
                        "or a node's data directory")
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


def describe_card(data: bytes, trainer: str | None = None) -> tuple[list[str], bool]:
    """Lines about a signed run card, and whether its signature checks out (against
    ``trainer`` when given)."""
    from swarm.content.card import SignedCard

    signer = public_key_from_peer_id(trainer) if trainer else None
    try:
        sc = SignedCard.decode(data, trusted_signer=signer)
        valid = True
    except SignatureError:
        valid = False
        sc = None
    if sc is None:
        return ["run card      signature INVALID"
                + (f" (against --trainer {trainer})" if trainer else "")], False
    c = sc.card
    cfg = c.model_config
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("vocab_size", "hidden_size",
                                                  "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads") if k in cfg)
    files = ", ".join(f"{n} ({_human(len(d))})" for n, d in c.files) or "-"
    return [
        f"run card      {hex_id(sc.id)}",
        f"run           {c.run}",
        f"model         {c.model_type} {', '.join(c.architectures) or ''}".rstrip(),
        f"shape         {shape or '-'}",
        f"dtype         {c.dtype}",
        f"codec         {c.codec}",
        f"layout        {hex_id(c.layout_digest)}",
        f"version 0     root {hex_id(c.root)} (pieces of {_human(c.piece_size)})",
        f"stop ids      {', '.join(map(str, c.stop_token_ids)) or '-'}",
        f"files         {files}",
        f"signer        {c.signer_peer_id}",
        "signature     valid" + (f" (against --trainer {trainer})" if trainer else ""),
    ], valid


def describe_state(path: Path, trainer: str | None = None) -> tuple[list[str], bool]:
    """Lines about a saved state file (a base, with the journal of deltas beside it), and
    whether its signatures all check out (against ``trainer``, or else the signer its
    newest manifest names). The tensor bytes are counted, not hashed."""
    from swarm.content.layout import MAX_LAYOUT_BYTES, StateLayout
    from swarm.roles import persist, statelog
    from swarm.wire import strict

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(len(persist.MAGIC) + 4)
        if len(head) != len(persist.MAGIC) + 4 or head[:len(persist.MAGIC)] != persist.MAGIC:
            raise DecodeError(f"{path}: not a manifest, key, or saved state (bad magic)")
        hlen = int.from_bytes(head[len(persist.MAGIC):], "big")
        if hlen > persist.MAX_HEADER_BYTES or len(head) + hlen > size:
            raise DecodeError(f"{path}: saved state header of {hlen} bytes does not fit")
        header = fh.read(hlen)
    obj = strict.unpack(header, max_bytes=persist.MAX_HEADER_BYTES,
                        max_bin=max(MAX_LAYOUT_BYTES, MAX_MANIFEST_BYTES),
                        max_array=persist.MAX_SAVED_MANIFESTS, max_map=3, max_str=16)
    h = strict.as_map(obj, frozenset({"v", "layout", "manifests"}), "saved state")
    layout = StateLayout.decode(strict.get_bytes(h, "layout", max_len=MAX_LAYOUT_BYTES))
    raw = strict.get_list(h, "manifests", persist.MAX_SAVED_MANIFESTS)
    manifests = [SignedManifest.decode(x, check_signature=False) for x in raw
                 if type(x) is bytes]
    if not manifests:
        raise DecodeError(f"{path}: a saved state without manifests")
    base = manifests[-1].manifest
    journal_line = None
    try:
        info = statelog.describe_journal(path, base.step, base.target_root)
    except (OSError, DecodeError) as exc:
        info, journal_line = None, f"journal       unreadable: {exc}"
    if info is not None:
        manifests += info.manifests
        journal_line = (f"journal       {len(info.manifests)} deltas ({_human(info.record_bytes)}) "
                        f"after base step {base.step}"
                        + (f"; {info.ignored}" if info.ignored else ""))
    last = manifests[-1].manifest
    signer = public_key_from_peer_id(trainer) if trainer else last.signer
    valid = all(sm.verify() and sm.manifest.signer == signer for sm in manifests)
    tensor_bytes = size - len(head) - hlen
    kinds = ", ".join(f"{sm.manifest.step}{'k' if sm.manifest.kind == 'keyframe' else ''}"
                      for sm in manifests)
    lines = [
        f"saved state   {path} ({_human(size)})",
        f"run           {last.run}",
        f"step          {last.step} ({last.kind})",
        f"root          {hex_id(last.target_root)}",
        f"manifests     {len(manifests)}: steps {kinds}"
        + (" (k: keyframe)" if "k" in kinds else ""),
        f"tensors       {len(list(layout))} ({_human(tensor_bytes)}; layout needs "
        f"{_human(layout.nbytes)}{'' if tensor_bytes == layout.nbytes else ': TRUNCATED'})",
        f"signer        {last.signer_peer_id}",
        f"signatures    {'valid' if valid else 'INVALID'}"
        + (f" (against --trainer {trainer})" if trainer else ""),
    ]
    if journal_line is not None:
        lines.insert(5, journal_line)
    return lines, valid and tensor_bytes == layout.nbytes


def describe_data_dir(path: Path, trainer: str | None = None) -> list[str]:
    """What a node left in its data directory."""
    lines = [f"data dir      {path}"]
    key = path / "node.key"
    if key.is_file():
        try:
            lines.append(f"key           {Identity.load(key).peer_id} (node.key)")
        except Exception as exc:
            lines.append(f"key           unreadable: {exc}")
    for name in ("published.state", "peer.state"):
        state = path / name
        if state.is_file():
            try:
                found, _ = describe_state(state, trainer)
                lines += [f"  {line}" for line in found]
            except Exception as exc:
                lines.append(f"{name:<14}unreadable: {exc}")
        if (path / f"{name}.bad").exists():
            lines.append(f"{name + '.bad':<14}a refused state moved aside")
        if not state.is_file() and (path / f"{name}.journal").is_file():
            lines.append(f"{name + '.journal':<14}a journal without its base (ignored)")
    card = path / "run.card"
    if card.is_file():
        try:
            found, _ = describe_card(card.read_bytes(), trainer)
            lines += [f"  {line}" for line in found]
        except Exception as exc:
            lines.append(f"run.card      unreadable: {exc}")
    versions = sorted((path / "chunks" / "versions").glob("*.log"))
    if versions:
        steps = [int(v.stem) for v in versions if v.stem.isdigit()]
        chunks = [c for c in (path / "chunks" / "chunks").glob("*/*") if c.is_file()]
        total = sum(c.stat().st_size for c in chunks)
        shown = ", ".join(map(str, steps[-10:])) + (" ..." if len(steps) > 10 else "")
        lines.append(f"chunk store   {len(chunks)} chunks ({_human(total)}); versions {shown}")
    if (path / "master.pt").is_file():
        lines.append(f"master        master.pt ({_human((path / 'master.pt').stat().st_size)})")
    book = path / "leases.sqlite3"
    if book.is_file():
        lines.append(f"lease book    {_lease_book(book)}")
    if len(lines) == 1:
        lines.append("              (nothing a swarm node writes)")
    return lines


def _lease_book(path: Path) -> str:
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            tasks = dict(db.execute("SELECT state, COUNT(*) FROM tasks GROUP BY state"))
            leases = dict(db.execute("SELECT state, COUNT(*) FROM leases GROUP BY state"))
            results = db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error as exc:
        return f"unreadable: {exc}"
    return (f"run {meta.get('run')!r}, latest step {meta.get('latest')}; tasks {tasks or 0}; "
            f"leases {leases or 0}; results {results}")


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    if path.is_dir():
        print("\n".join(describe_data_dir(path, args.trainer)))
        return 0
    head = path.read_bytes()[:64] if path.is_file() else b""
    if b"-----BEGIN" in head:
        ident = Identity.load(path)
        print(f"key           {path}")
        print("type          Ed25519")
        print(f"public key    {ident.public_key.hex()}")
        print(f"peer id       {ident.peer_id}")
        return 0
    if not path.is_file():
        raise DecodeError(f"{path} is not a file or directory")
    from swarm.roles.persist import MAGIC

    if head.startswith(MAGIC):
        lines, ok = describe_state(path, args.trainer)
        print("\n".join(lines))
        if not ok:
            raise SignatureError("saved state check failed (signatures or size)")
        return 0
    from swarm.content.card import MAX_CARD_BYTES

    if path.name.endswith(".card") and path.stat().st_size <= MAX_CARD_BYTES:
        lines, ok = describe_card(path.read_bytes(), args.trainer)
        print("\n".join(lines))
        if not ok:
            raise SignatureError("run card signature check failed")
        return 0
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise DecodeError(f"{path} is larger than any manifest ({MAX_MANIFEST_BYTES} bytes)")
    try:
        sm = SignedManifest.decode(path.read_bytes(), check_signature=False)
    except DecodeError as exc:
        raise DecodeError(f"{path}: not a signed manifest, run card, saved state, key file "
                          f"or data directory ({exc})") from None
    lines = describe_manifest(sm, args.trainer)
    print("\n".join(lines))
    valid = sm.verify() and (args.trainer is None or
                             public_key_from_peer_id(args.trainer) == sm.manifest.signer)
    if not valid:
        raise SignatureError("manifest signature check failed")
    return 0
