"""Strict bounded msgpack: canonical encoding and hostile-input decoding.

Every decode bounds the input size and each container/string length *before* msgpack
allocates, checks types field by field, and insists the bytes are the canonical encoding
(re-encoding the decoded value must give the same bytes), so one value has one signed form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from swarm.errors import DecodeError


def _sorted_maps(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _sorted_maps(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple) and any(isinstance(x, dict | list | tuple) for x in obj):
        return [_sorted_maps(x) for x in obj]
    return obj


def pack(obj: object) -> bytes:
    """Canonical msgpack: bin type for bytes, smallest int widths, map keys sorted."""
    out: bytes = msgpack.packb(_sorted_maps(obj), use_bin_type=True)
    return out


def unpack(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    max_str: int = 1024,
    max_bin: int = 1 << 20,
    max_array: int = 1 << 16,
    max_map: int = 64,
    canonical: bool = True,
) -> Any:
    """Decode one msgpack value under hard bounds.

    :raises DecodeError: oversized, malformed, trailing bytes, ext types, or non-canonical.
    """
    if len(data) > max_bytes:
        raise DecodeError(f"message is {len(data)} bytes, bound is {max_bytes}")
    raw = bytes(data)
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_str,
            max_bin_len=max_bin,
            max_array_len=max_array,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, UnicodeDecodeError) as exc:
        raise DecodeError(f"malformed msgpack: {exc}") from exc
    except Exception as exc:  # msgpack raises a few undocumented types on garbage
        raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    if canonical and pack(obj) != raw:
        raise DecodeError("non-canonical msgpack encoding")
    return obj


def as_map(obj: object, required: frozenset[str], what: str) -> Mapping[str, Any]:
    """Check ``obj`` is a map with exactly the ``required`` string keys."""
    if not isinstance(obj, dict):
        raise DecodeError(f"{what}: expected a map, got {type(obj).__name__}")
    keys = frozenset(obj)
    if keys != required:
        missing = sorted(required - keys)
        extra = sorted(str(k) for k in keys - required)
        raise DecodeError(f"{what}: missing keys {missing}, unexpected keys {extra}")
    return obj


def get_int(m: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = m[key]
    if type(v) is not int or not lo <= v <= hi:
        raise DecodeError(f"field {key!r}: expected an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def get_bytes(m: Mapping[str, Any], key: str, length: int | None = None, *,
              max_len: int | None = None) -> bytes:
    v = m[key]
    if type(v) is not bytes:
        raise DecodeError(f"field {key!r}: expected bytes, got {type(v).__name__}")
    if length is not None and len(v) != length:
        raise DecodeError(f"field {key!r}: expected {length} bytes, got {len(v)}")
    if max_len is not None and len(v) > max_len:
        raise DecodeError(f"field {key!r}: {len(v)} bytes exceeds {max_len}")
    return v


def get_str(m: Mapping[str, Any], key: str, max_len: int, choices: frozenset[str] | None = None
            ) -> str:
    v = m[key]
    if type(v) is not str or len(v) > max_len:
        raise DecodeError(f"field {key!r}: expected a string of at most {max_len} chars")
    if choices is not None and v not in choices:
        raise DecodeError(f"field {key!r}: {v!r} is not one of {sorted(choices)}")
    return v


def get_list(m: Mapping[str, Any], key: str, max_len: int) -> list[Any]:
    v = m[key]
    if type(v) is not list or len(v) > max_len:
        raise DecodeError(f"field {key!r}: expected a list of at most {max_len} items")
    return v


def unpack_signed(data: bytes, *, max_bytes: int, what: str, signature_len: int = 64
                  ) -> tuple[bytes, bytes]:
    """``(body, signature)`` of a ``msgpack([body, signature])`` envelope (the form of
    signed manifests and run cards), bounded before anything is allocated.

    :raises DecodeError: not such a pair, oversized, or a signature of another length.
    """
    outer = unpack(data, max_bytes=max_bytes, max_bin=max_bytes, max_array=2, max_map=0,
                   max_str=0)
    if type(outer) is not list or len(outer) != 2 or any(type(x) is not bytes for x in outer):
        raise DecodeError(f"{what}: expected [body, signature]")
    body, sig = outer
    if len(sig) != signature_len:
        raise DecodeError(f"{what}: signature is not {signature_len} bytes")
    return body, sig
