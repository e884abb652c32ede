"""The run card: what a peer needs to run a run's model, signed by the trainer.

A card names the model (its Hugging Face ``config.json``), carries the tokenizer and
generation files, and pins what the versions will be: the inference dtype, the state
layout's digest, the codec, and the state root of version 0. A peer reads the card before
it fetches any weights, builds the model from the config (no hub download), and refuses
a card it cannot run with the reason.

Wire form: ``msgpack([body, signature])``; ``body`` is the canonical map below and the
signature is Ed25519 over ``b"swarm/card/v1\\0" + body``. The card's id is the BLAKE3 of
the wire form (content-addressed: any node can hand it on, the signature proves its
origin). The decoder bounds every size before allocating and checks every type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.content.ids import DIGEST_LEN, chunk_id
from swarm.errors import DecodeError, IntegrityError, LocalProtocolError, SignatureError
from swarm.identity import (
    PUBLIC_KEY_LEN,
    SIGNATURE_LEN,
    Identity,
    peer_id_from_public_key,
    sign_message,
    signing_domain,
    verify_message,
)
from swarm.wire import strict

FORMAT_VERSION = 1
MAX_CONFIG_BYTES = 1 << 20
MAX_FILES = 16
MAX_FILE_BYTES = 32 << 20
MAX_CARD_BYTES = 48 << 20
MAX_STOP_IDS = 64
MAX_RUN_LEN = 128
MAX_PIECE_SIZE = 1 << 30
DTYPES = frozenset({"bfloat16", "float16", "float32"})
#: Files of a model dir a card carries (tokenizer and generation settings), when present.
CARD_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DOMAIN = signing_domain("card")
_KEYS = frozenset({"v", "run", "config", "files", "dtype", "layout", "codec", "root",
                   "piece", "stop", "signer"})


@dataclass(frozen=True, slots=True)
class RunCard:
    """A run's model, as its trainer vouches for it."""

    run: str
    config: str
    """The model's ``config.json`` text (a JSON object naming ``model_type``)."""
    files: tuple[tuple[str, bytes], ...]
    """(file name, contents) of the tokenizer and generation files, sorted by name."""
    dtype: str
    """The dtype of the published state (what peers hold and hash)."""
    layout_digest: bytes
    codec: str
    root: bytes
    """State root of version 0."""
    piece_size: int
    """Piece size the roots are computed with."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (eos and chat end markers)."""
    signer: bytes = field(default=b"\0" * PUBLIC_KEY_LEN)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def model_config(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.config)
        return out

    @property
    def model_type(self) -> str:
        return str(self.model_config["model_type"])

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.model_config.get("architectures") or ())

    @property
    def signer_peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)

    def file(self, name: str) -> bytes | None:
        return dict(self.files).get(name)

    def body(self) -> bytes:
        return strict.pack({
            "v": FORMAT_VERSION, "run": self.run, "config": self.config,
            "files": [[n, d] for n, d in self.files], "dtype": self.dtype,
            "layout": self.layout_digest, "codec": self.codec, "root": self.root,
            "piece": self.piece_size, "stop": list(self.stop_token_ids), "signer": self.signer,
        })

    def sign(self, identity: Identity) -> SignedCard:
        """Sign with ``identity`` (the signer field is set to its public key)."""
        card = RunCard(self.run, self.config, self.files, self.dtype, self.layout_digest,
                       self.codec, self.root, self.piece_size, self.stop_token_ids,
                       identity.public_key)
        body = card.body()
        return SignedCard(card, body, sign_message(identity, _DOMAIN, body))

    def write_model_dir(self, out: Path) -> Path:
        """Write ``config.json`` and the card's files into ``out`` (no weights): a model
        dir that transformers and vLLM load offline once weights are added."""
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(self.config)
        for name, data in self.files:
            (out / name).write_bytes(data)
        return out


@dataclass(frozen=True, slots=True)
class SignedCard:
    """A card with the exact body bytes that were signed and the signature."""

    card: RunCard
    body: bytes
    signature: bytes

    def encode(self) -> bytes:
        return strict.pack([self.body, self.signature])

    @property
    def id(self) -> bytes:
        return chunk_id(self.encode())

    @classmethod
    def decode(cls, data: bytes, *, trusted_signer: bytes | None = None,
               run: str | None = None) -> SignedCard:
        """Strictly decode and verify a signed card.

        :raises DecodeError: malformed, oversized, non-canonical or unknown version.
        :raises SignatureError: bad signature, or the signer is not ``trusted_signer``.
        :raises IntegrityError: a card of another run than ``run``.
        """
        body, sig = strict.unpack_signed(data, max_bytes=MAX_CARD_BYTES, what="card",
                                         signature_len=SIGNATURE_LEN)
        card = _decode_body(body)
        if trusted_signer is not None and card.signer != trusted_signer:
            raise SignatureError(f"card signed by {card.signer_peer_id}, expected "
                                 f"{peer_id_from_public_key(trusted_signer)}")
        verify_message(card.signer, sig, _DOMAIN, body)
        if run is not None and card.run != run:
            raise IntegrityError(f"card of run {card.run!r}, expected {run!r}")
        return cls(card, body, sig)


def card_files(model_dir: Path) -> tuple[tuple[str, bytes], ...]:
    """The card's files found in an HF model dir (tokenizer, generation config)."""
    return tuple((n, (model_dir / n).read_bytes()) for n in sorted(CARD_FILES)
                 if (model_dir / n).is_file())


def stop_ids_of(config: Mapping[str, Any], files: Mapping[str, bytes]) -> tuple[int, ...]:
    """Eos ids named by ``generation_config.json`` (else the model config)."""
    gen: Any = {}
    if "generation_config.json" in files:
        try:
            gen = json.loads(files["generation_config.json"])
        except ValueError as exc:
            raise LocalProtocolError(f"generation_config.json: {exc}") from None
    eos = gen.get("eos_token_id", config.get("eos_token_id")) if isinstance(gen, dict) else None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(type(i) is not int or i < 0 for i in ids):
        raise LocalProtocolError(f"eos_token_id must be token ids, not {eos!r}")
    return tuple(sorted(set(ids)))


def _check(card: RunCard) -> None:
    """Field bounds, shared by construction and decoding (a decoded card that fails them
    is a ``DecodeError``)."""
    if not 0 < len(card.run) <= MAX_RUN_LEN:
        raise LocalProtocolError("card: run name of 1-128 characters")
    if len(card.config.encode()) > MAX_CONFIG_BYTES:
        raise LocalProtocolError(f"card: config.json over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(card.config)
    except ValueError as exc:
        raise LocalProtocolError(f"card: config.json is not JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise LocalProtocolError("card: config.json is an object naming model_type")
    archs = config.get("architectures", [])
    if not isinstance(archs, list) or any(not isinstance(a, str) for a in archs):
        raise LocalProtocolError("card: architectures is a list of names")
    names = [n for n, _ in card.files]
    if len(names) > MAX_FILES or names != sorted(set(names)):
        raise LocalProtocolError(f"card: at most {MAX_FILES} files, sorted, each named once")
    for name, data in card.files:
        if not _NAME.fullmatch(name) or name == "config.json" or \
                name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            raise LocalProtocolError(f"card: file name {name!r} refused")
        if len(data) > MAX_FILE_BYTES:
            raise LocalProtocolError(f"card: {name} over {MAX_FILE_BYTES} bytes")
    if card.dtype not in DTYPES:
        raise LocalProtocolError(f"card: dtype {card.dtype!r} is not one of {sorted(DTYPES)}")
    if len(card.layout_digest) != DIGEST_LEN or len(card.root) != DIGEST_LEN:
        raise LocalProtocolError("card: layout digest and root are 32 bytes")
    if not 0 < card.piece_size <= MAX_PIECE_SIZE:
        raise LocalProtocolError(f"card: piece size in 1..{MAX_PIECE_SIZE}")
    if not 0 < len(card.codec) <= 64:
        raise LocalProtocolError("card: codec name of 1-64 characters")
    if len(card.stop_token_ids) > MAX_STOP_IDS or \
            any(type(i) is not int or not 0 <= i < 1 << 31 for i in card.stop_token_ids):
        raise LocalProtocolError(f"card: at most {MAX_STOP_IDS} stop token ids")
    if len(card.signer) != PUBLIC_KEY_LEN:
        raise LocalProtocolError("card: signer is a 32-byte public key")


def _decode_body(body: bytes) -> RunCard:
    obj = strict.unpack(body, max_bytes=MAX_CARD_BYTES, max_bin=MAX_FILE_BYTES,
                        max_str=MAX_CONFIG_BYTES, max_array=max(MAX_FILES, MAX_STOP_IDS),
                        max_map=len(_KEYS))
    if isinstance(obj, dict) and "v" in obj and obj["v"] != FORMAT_VERSION:
        raise DecodeError(f"card: unknown format version {obj['v']!r}")
    m = strict.as_map(obj, _KEYS, "card")
    strict.get_int(m, "v", FORMAT_VERSION, FORMAT_VERSION)
    raw_files = strict.get_list(m, "files", MAX_FILES)
    files = []
    for f in raw_files:
        if type(f) is not list or len(f) != 2 or type(f[0]) is not str or \
                type(f[1]) is not bytes:
            raise DecodeError("card: a file is [name, bytes]")
        files.append((f[0], f[1]))
    stop = strict.get_list(m, "stop", MAX_STOP_IDS)
    if any(type(i) is not int for i in stop):
        raise DecodeError("card: stop ids are integers")
    try:
        card = RunCard(
            run=strict.get_str(m, "run", MAX_RUN_LEN),
            config=strict.get_str(m, "config", MAX_CONFIG_BYTES),
            files=tuple(files),
            dtype=strict.get_str(m, "dtype", 16),
            layout_digest=strict.get_bytes(m, "layout", DIGEST_LEN),
            codec=strict.get_str(m, "codec", 64),
            root=strict.get_bytes(m, "root", DIGEST_LEN),
            piece_size=strict.get_int(m, "piece", 1, MAX_PIECE_SIZE),
            stop_token_ids=tuple(stop),
            signer=strict.get_bytes(m, "signer", PUBLIC_KEY_LEN),
        )
    except LocalProtocolError as exc:
        raise DecodeError(str(exc)) from None
    if card.body() != body:
        raise DecodeError("card: body is not canonical")
    return card

