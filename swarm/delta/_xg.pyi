"""Typed stub of the codec's C extension (swarm/delta/_xg_module.c)."""

from typing import Any, TypeAlias

import numpy as np

# 1-D C-contiguous integer arrays (bytes-like objects count as uint8)
Buffer: TypeAlias = np.ndarray[Any, Any] | bytes | bytearray | memoryview

ESCAPE: int
RICE_KMAX: int
RICE_QMAX: int
MAX_NCLASS: int

def scan(old: Buffer, new: Buffer, shift: int, emask: int, signbit: int, full: int,
         cls_out: Buffer, rank_out: Buffer, d_out: Buffer) -> int: ...
def group_encode(cls: Buffer, rank: Buffer, d: Buffer, k: int, nclass: int, ccount: Buffer,
                 kparam: Buffer, gaps_out: Buffer, signs_out: Buffer, mags_out: Buffer
                 ) -> tuple[int, int]: ...
def class_table(classes: Buffer, changes: int, ccounts: Buffer, kparams: Buffer,
                class_start: Buffer, class_end: Buffer) -> int: ...
def decode_gaps(ccounts: Buffer, kparams: Buffer, gaps: Buffer, gaps_out: Buffer,
                limit: int) -> int: ...
def locate(old: Buffer, shift: int, emask: int, class_start: Buffer, class_end: Buffer,
           gaps: Buffer, pos_out: Buffer) -> int: ...
def decode_values(signs: Buffer, mags: Buffer, k: int, d_out: Buffer) -> int: ...
def apply_diffs(arr: Buffer, pos: Buffer, d: Buffer, signbit: int, full: int,
                negate: bool) -> None: ...
def simd() -> str: ...
def set_simd(enabled: bool, /) -> None: ...
