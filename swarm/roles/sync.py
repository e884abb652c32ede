"""Catch-up messages on the SYNC channel: a newcomer asks for the manifests it lacks.

``[0, after_step]``: send me the signed manifests of steps after ``after_step`` (-1: all,
starting with the newest keyframe). ``[1, [manifest bytes, ...]]``: the reply, oldest first.
Each manifest is still checked against the trainer key by the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.content.manifest import MAX_MANIFEST_BYTES
from swarm.errors import DecodeError
from swarm.wire import strict

MAX_MANIFESTS_PER_REPLY = 256
MAX_SYNC_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class SyncRequest:
    after_step: int


@dataclass(frozen=True, slots=True)
class SyncReply:
    manifests: tuple[bytes, ...]


def encode(msg: SyncRequest | SyncReply) -> bytes:
    if isinstance(msg, SyncRequest):
        return strict.pack([0, msg.after_step])
    return strict.pack([1, list(msg.manifests)])


def decode(data: bytes) -> SyncRequest | SyncReply:
    """:raises DecodeError: malformed or oversized."""
    obj = strict.unpack(data, max_bytes=MAX_SYNC_BYTES, max_bin=MAX_MANIFEST_BYTES,
                        max_array=MAX_MANIFESTS_PER_REPLY, max_map=0, max_str=0)
    if type(obj) is not list or len(obj) != 2 or obj[0] not in (0, 1) or type(obj[0]) is not int:
        raise DecodeError("sync: expected [0, step] or [1, [manifest, ...]]")
    if obj[0] == 0:
        if type(obj[1]) is not int or not -1 <= obj[1] < 1 << 62:
            raise DecodeError("sync: bad step")
        return SyncRequest(obj[1])
    if type(obj[1]) is not list or any(type(m) is not bytes for m in obj[1]):
        raise DecodeError("sync: reply is a list of manifests")
    return SyncReply(tuple(obj[1]))
