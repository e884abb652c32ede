"""Fused single-pass numba kernels of the exponent-grouped delta codec.

Every kernel works on unsigned integer views of raw bits (uint8/16/32/64), so change
detection compares bits, never float values. Values are mapped to order-preserving keys
(sign-magnitude floats become monotone unsigned integers; integers stay as they are) and a
change is the key difference modulo 2**bits: exact and reversible for every bit pattern,
including -0.0/+0.0 and NaN payloads.

Kernels return an error code instead of raising (0 = ok), release the GIL and are cached
on disk after their first compilation.
"""

from __future__ import annotations

import numba as nb  # type: ignore[import-untyped,import-not-found,unused-ignore]
import numpy as np

ONE = np.uint64(1)
ZERO = np.uint64(0)
ESCAPE = 255
RICE_KMAX = 24
RICE_QMAX = 24


@nb.njit(cache=True, nogil=True, inline="always")  # type: ignore[untyped-decorator,unused-ignore]
def _key(b: np.uint64, signbit: np.uint64, full: np.uint64) -> np.uint64:
    if signbit != 0 and (b & signbit) != 0:
        return full ^ b
    return b | signbit


@nb.njit(cache=True, nogil=True, inline="always")  # type: ignore[untyped-decorator,unused-ignore]
def _unkey(k: np.uint64, signbit: np.uint64, full: np.uint64) -> np.uint64:
    if signbit == 0:
        return k
    if (k & signbit) != 0:
        return k ^ signbit
    return full ^ k


@nb.njit(cache=True, nogil=True)
def scan_changes(old, new, shift, emask, signbit, full,  # type: ignore[no-untyped-def]
                 counts, cls_out, rank_out, d_out):
    """One pass: class rank of every element, and (class, rank, key diff) of each change.

    Elements go four at a time: ``counts`` has four rows (element index mod 4) so that
    consecutive increments do not wait on each other, and a group of four unchanged
    elements only counts. An element's rank in its class is the sum of the four rows.
    Returns the number of changes, or -1 when ``cls_out`` is too small.
    """
    n = old.shape[0]
    n4 = n - (n & 3)
    cap = cls_out.shape[0]
    k = 0
    for i in range(0, n4, 4):
        x0 = np.uint64(old[i])
        x1 = np.uint64(old[i + 1])
        x2 = np.uint64(old[i + 2])
        x3 = np.uint64(old[i + 3])
        diff = ((x0 ^ np.uint64(new[i])) | (x1 ^ np.uint64(new[i + 1]))
                | (x2 ^ np.uint64(new[i + 2])) | (x3 ^ np.uint64(new[i + 3])))
        if diff == ZERO:
            counts[0, (x0 >> shift) & emask] += 1
            counts[1, (x1 >> shift) & emask] += 1
            counts[2, (x2 >> shift) & emask] += 1
            counts[3, (x3 >> shift) & emask] += 1
        else:
            for j in range(4):
                b = np.uint64(old[i + j])
                e = (b >> shift) & emask
                c = np.uint64(new[i + j])
                if b != c:
                    if k == cap:
                        return -1
                    cls_out[k] = e
                    rank_out[k] = counts[0, e] + counts[1, e] + counts[2, e] + counts[3, e]
                    d_out[k] = (_key(c, signbit, full) - _key(b, signbit, full)) & full
                    k += 1
                counts[j, e] += 1
    for i in range(n4, n):
        b = np.uint64(old[i])
        e = (b >> shift) & emask
        c = np.uint64(new[i])
        if b != c:
            if k == cap:
                return -1
            cls_out[k] = e
            rank_out[k] = counts[0, e] + counts[1, e] + counts[2, e] + counts[3, e]
            d_out[k] = (_key(c, signbit, full) - _key(b, signbit, full)) & full
            k += 1
        counts[i & 3, e] += 1
    return k


@nb.njit(cache=True, nogil=True)
def group_encode(cls, rank, d, k, nclass, nbytes_val, full, half,  # type: ignore[no-untyped-def]
                 ccount, kparam, gaps_out, signs_out, mags_out):
    """Group changes by class; write Rice-coded rank gaps (one parameter per class: the
    cheapest of five around log2 of the mean gap), sign bits and escaped u8 magnitudes.

    ``ccount``/``kparam`` (``nclass`` long, zeroed) receive changes and the Rice parameter
    per class. Returns (gap bytes, magnitude bytes) written.
    """
    for j in range(k):
        ccount[cls[j]] += 1
    off = np.empty(nclass, np.int64)
    s = 0
    for e in range(nclass):
        off[e] = s
        s += ccount[e]
    order = np.empty(k, np.int64)
    gapv = np.empty(k, np.int64)
    last = np.full(nclass, -1, np.int64)
    for j in range(k):
        e = cls[j]
        r = np.int64(rank[j])
        order[off[e]] = j
        gapv[off[e]] = r - last[e] - 1
        last[e] = r
        off[e] += 1
    cost = np.zeros(RICE_KMAX + 1, np.int64)
    p0 = 0
    for e in range(nclass):
        c = ccount[e]
        if c == 0:
            continue
        total = 0
        for p in range(p0, p0 + c):
            total += gapv[p]
        k0 = 0
        while k0 < RICE_KMAX and (c << (k0 + 1)) <= total:
            k0 += 1
        lo = max(0, k0 - 2)
        hi = min(RICE_KMAX, k0 + 2)
        cost[:] = 0
        for p in range(p0, p0 + c):
            g = gapv[p]
            for kk in range(lo, hi + 1):
                q = g >> kk
                cost[kk] += (1 + kk + q) if q < RICE_QMAX else RICE_QMAX + 32
        best = lo
        for kk in range(lo + 1, hi + 1):
            if cost[kk] < cost[best]:
                best = kk
        kparam[e] = best
        p0 += c
    acc = ZERO
    used = np.uint64(0)
    pos = 0
    m = 0
    p0 = 0
    for e in range(nclass):
        c = ccount[e]
        if c == 0:
            continue
        kb = np.uint64(kparam[e])
        kmask = (ONE << kb) - ONE
        for p in range(p0, p0 + c):
            g = np.uint64(gapv[p])
            q = g >> kb
            if q < np.uint64(RICE_QMAX):
                code = ((ONE << q) - ONE) | ((g & kmask) << (q + ONE))
                nbits = q + ONE + kb
            else:
                code = ((ONE << np.uint64(RICE_QMAX)) - ONE) | (g << np.uint64(RICE_QMAX))
                nbits = np.uint64(RICE_QMAX + 32)
            # acc holds < 8 pending bits; a code is at most 56 bits
            acc |= code << used
            used += nbits
            while used >= np.uint64(8):
                gaps_out[pos] = acc & np.uint64(0xFF)
                acc >>= np.uint64(8)
                used -= np.uint64(8)
                pos += 1
        p0 += c
    if used:
        gaps_out[pos] = acc & np.uint64(0xFF)
        pos += 1
    g_bytes = pos
    for p in range(k):
        j = order[p]
        dd = np.uint64(d[j])
        if (dd & half) != 0:
            signs_out[p >> 3] |= np.uint8(1 << (p & 7))
            mag = (full - dd) + ONE
        else:
            mag = dd
        mm = mag - ONE
        if mm < np.uint64(ESCAPE):
            mags_out[m] = mm
            m += 1
        else:
            mags_out[m] = ESCAPE
            for t in range(nbytes_val):
                mags_out[m + 1 + t] = (mm >> np.uint64(8 * t)) & np.uint64(0xFF)
            m += 1 + nbytes_val
    return g_bytes, m


_DEBRUIJN = np.array([0, 47, 1, 56, 48, 27, 2, 60, 57, 49, 41, 37, 28, 16, 3, 61, 54, 58, 35,
                      52, 50, 42, 21, 44, 38, 32, 29, 23, 17, 11, 4, 62, 46, 55, 26, 59, 40,
                      36, 15, 53, 34, 51, 20, 43, 31, 22, 10, 45, 25, 39, 14, 33, 19, 30, 9,
                      24, 13, 18, 8, 12, 7, 6, 5, 63], np.int64)


@nb.njit(cache=True, nogil=True, inline="always")  # type: ignore[untyped-decorator,unused-ignore]
def _ctz(m):  # type: ignore[no-untyped-def]
    """Index of the lowest set bit of a non-zero uint64."""
    return _DEBRUIJN[((m ^ (m - ONE)) * np.uint64(0x03F79D71B4CB0A89)) >> np.uint64(58)]


@nb.njit(cache=True, nogil=True, inline="always")  # type: ignore[untyped-decorator,unused-ignore]
def _peek(w, b):  # type: ignore[no-untyped-def]
    """64 bits of the little-endian word stream ``w`` from bit ``b`` (LSB first)."""
    q = b >> 6
    r = np.uint64(b & 63)
    lo = w[q] >> r
    if r == ZERO:
        return lo
    return lo | (w[q + 1] << (np.uint64(64) - r))


@nb.njit(cache=True, nogil=True)
def decode_gaps(ccounts, kparams, gaps, gaps_out, limit):  # type: ignore[no-untyped-def]
    """Rice-coded rank gaps, grouped by class. 0 ok, 1 truncated, 2 trailing bytes or
    bits, 3 non-canonical escape, 4 rank past the segment.

    Codes are read 64 bits at a time from a zero-padded word copy of the stream.
    """
    nbytes = gaps.shape[0]
    nbits = nbytes * 8
    w = np.zeros(nbytes // 8 + 2, np.uint64)
    wb = w.view(np.uint8)
    for t in range(nbytes):
        wb[t] = gaps[t]
    cap = ONE << np.uint64(RICE_QMAX)
    b = 0
    p = 0
    for ci in range(ccounts.shape[0]):
        kk = kparams[ci]
        kmask = (ONE << np.uint64(kk)) - ONE
        last = -1
        for _ in range(ccounts[ci]):
            if b >= nbits:
                return 1
            x = _peek(w, b)
            q = _ctz(~x | cap)
            if q < RICE_QMAX:
                if b + q + 1 + kk > nbits:
                    return 1
                v = (np.int64(q) << kk) | np.int64((x >> np.uint64(q + 1)) & kmask)
                b += q + 1 + kk
            else:
                if b + RICE_QMAX + 32 > nbits:
                    return 1
                v = np.int64((x >> np.uint64(RICE_QMAX)) & np.uint64(0xFFFFFFFF))
                b += RICE_QMAX + 32
                if (v >> kk) < RICE_QMAX:
                    return 3
            last = last + 1 + v
            if last >= limit:
                return 4
            gaps_out[p] = v
            p += 1
    if (b + 7) // 8 != nbytes:
        return 2
    if b < nbits and (np.uint64(gaps[nbytes - 1]) >> np.uint64(b & 7)) != ZERO:
        return 2
    return 0


@nb.njit(cache=True, nogil=True)
def locate(old, shift, emask, class_start, class_end, gaps, pos_out):  # type: ignore[no-untyped-def]
    """One pass over the old values: rank gaps -> element positions, grouped by class.

    Each class counts down the gap to its next change. Returns 0, or 1 when a class
    runs out of elements before its last change.
    """
    nclass = class_start.shape[0]
    ptr = class_start.copy()
    left = np.full(nclass, -1, np.int64)
    for e in range(nclass):
        if ptr[e] < class_end[e]:
            left[e] = gaps[ptr[e]]
    n = old.shape[0]
    for i in range(n):
        e = (np.uint64(old[i]) >> shift) & emask
        x = left[e]
        left[e] = x - 1
        if x == 0:
            p = ptr[e]
            pos_out[p] = i
            p += 1
            ptr[e] = p
            left[e] = gaps[p] if p < class_end[e] else -1
    for e in range(nclass):
        if ptr[e] != class_end[e]:
            return 1
    return 0


@nb.njit(cache=True, nogil=True)
def decode_values(signs, mags, k, nbytes_val, full, half, d_out):  # type: ignore[no-untyped-def]
    """Sign bits + escaped u8 magnitudes -> key differences. 0 ok, 1 truncated,
    2 trailing bytes, 3 non-canonical or out-of-range value."""
    n = mags.shape[0]
    m = 0
    for p in range(k):
        if m >= n:
            return 1
        v = np.uint64(mags[m])
        m += 1
        if v == np.uint64(ESCAPE):
            if m + nbytes_val > n:
                return 1
            v = np.uint64(0)
            for t in range(nbytes_val):
                v |= np.uint64(mags[m + t]) << np.uint64(8 * t)
            m += nbytes_val
            if v < np.uint64(ESCAPE):
                return 3
        if v >= half:
            return 3
        mag = v + ONE
        if (signs[p >> 3] >> (p & 7)) & 1:
            d_out[p] = (full - mag) + ONE
        else:
            if mag == half:
                return 3
            d_out[p] = mag
    if m != n:
        return 2
    if (k & 7) != 0 and (signs[k >> 3] >> (k & 7)) != 0:
        return 3
    return 0


@nb.njit(cache=True, nogil=True)
def apply_diffs(arr, pos, d, signbit, full, negate):  # type: ignore[no-untyped-def]
    """arr[pos] = unkey(key(arr[pos]) +/- d) in place."""
    for j in range(pos.shape[0]):
        i = pos[j]
        dd = np.uint64(d[j])
        if negate:
            dd = ((full - dd) + ONE) & full
        k = (_key(np.uint64(arr[i]), signbit, full) + dd) & full
        arr[i] = _unkey(k, signbit, full)


@nb.njit(cache=True, nogil=True)
def scan_changes16(old, new, shift, emask, signbit, full,  # type: ignore[no-untyped-def]
                   counts, cls_out, rank_out, d_out):
    """:func:`scan_changes` for 2-byte elements read as uint64 words, four elements a
    load (same results; about 7% faster on bf16). ``old``/``new`` are uint64 views of a
    whole number of words; the caller scans a tail with :func:`scan_changes` after."""
    n = old.shape[0]
    cap = cls_out.shape[0]
    k = 0
    s1 = shift + np.uint64(16)
    s2 = shift + np.uint64(32)
    s3 = shift + np.uint64(48)
    m16 = np.uint64(0xFFFF)
    for i in range(n):
        x = old[i]
        y = new[i]
        if x == y:
            counts[0, (x >> shift) & emask] += 1
            counts[1, (x >> s1) & emask] += 1
            counts[2, (x >> s2) & emask] += 1
            counts[3, (x >> s3) & emask] += 1
        else:
            for j in range(4):
                sh = np.uint64(16 * j)
                b = (x >> sh) & m16
                c = (y >> sh) & m16
                e = (b >> shift) & emask
                if b != c:
                    if k == cap:
                        return -1
                    cls_out[k] = e
                    rank_out[k] = counts[0, e] + counts[1, e] + counts[2, e] + counts[3, e]
                    d_out[k] = (_key(c, signbit, full) - _key(b, signbit, full)) & full
                    k += 1
                counts[j, e] += 1
    return k


@nb.njit(cache=True, nogil=True)
def locate16(words, tail, shift, emask, class_start, class_end,  # type: ignore[no-untyped-def]
             gaps, pos_out):
    """:func:`locate` for 2-byte elements: ``words`` (a uint64 view, four elements a load,
    about 10% faster on bf16) then the ``tail`` elements that do not fill a word; same
    results."""
    nclass = class_start.shape[0]
    ptr = class_start.copy()
    left = np.full(nclass, -1, np.int64)
    for e in range(nclass):
        if ptr[e] < class_end[e]:
            left[e] = gaps[ptr[e]]
    n = words.shape[0]
    for i in range(n):
        x = words[i]
        for j in range(4):
            e = (x >> (shift + np.uint64(16 * j))) & emask
            y = left[e]
            left[e] = y - 1
            if y == 0:
                p = ptr[e]
                pos_out[p] = 4 * i + j
                p += 1
                ptr[e] = p
                left[e] = gaps[p] if p < class_end[e] else -1
    for j in range(tail.shape[0]):
        e = (np.uint64(tail[j]) >> shift) & emask
        y = left[e]
        left[e] = y - 1
        if y == 0:
            p = ptr[e]
            pos_out[p] = 4 * n + j
            p += 1
            ptr[e] = p
            left[e] = gaps[p] if p < class_end[e] else -1
    for e in range(nclass):
        if ptr[e] != class_end[e]:
            return 1
    return 0
