/* Kernels of the swarm-xg1 delta codec shared by the extension's C files.
 *
 * Every kernel works on raw bits (unsigned integers of the element width), so change
 * detection compares bits, never float values. See swarm/delta/codec.py for the format.
 */
#ifndef SWARM_XG_H
#define SWARM_XG_H

#include <stdint.h>

/* Result of a fast path that does not run on this CPU or input (the caller falls back). */
#define XG_UNSUPPORTED (-2)

/* Order-preserving key of a sign-magnitude float's bits (integers: signbit == 0): negative
 * values have every bit flipped, others the sign bit set. Branch-free: signs of changed
 * weights are random, and a mispredicted branch costs more than the whole key. */
static inline uint64_t xg_key(uint64_t b, uint64_t signbit, uint64_t full) {
    uint64_t neg = (uint64_t)0 - (uint64_t)((b & signbit) != 0);
    return b ^ (signbit | (neg & full));
}

static inline uint64_t xg_unkey(uint64_t k, uint64_t signbit, uint64_t full) {
    uint64_t pos = (uint64_t)0 - (uint64_t)((k & signbit) != 0);
    return k ^ (signbit == 0 ? 0 : (signbit | (~pos & full)));
}

/* 1 when the SIMD paths below run on this CPU (x86-64 with AVX-512 F/BW and BMI2). */
int xg_simd_available(void);

/* SIMD scan of 2-byte elements: class (exponent field), rank of the element within its
 * class in the segment, and key difference of every change, in element order within each
 * class. Returns the number of changes, -1 when more than ``cap`` changed, or
 * XG_UNSUPPORTED (nothing written that matters) when this CPU lacks the instructions. */
int64_t xg_scan16_simd(const uint16_t *old, const uint16_t *new_, int64_t n, unsigned shift,
                       unsigned emask, uint16_t signbit, uint16_t full, uint16_t *cls,
                       uint32_t *rank, uint16_t *diff, int64_t cap);

/* SIMD locate of 2-byte elements: class ``c`` has its changes' rank gaps at
 * ``gaps[class_start[c] .. class_end[c])``; writes each change's element index to
 * ``pos[class_start[c] + j]``. ``nclass`` is emask + 1. Returns 0, 1 when a class runs out
 * of elements before its last change, or XG_UNSUPPORTED. */
int xg_locate16_simd(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos);

/* xg_locate16_simd that also writes each change in place as it is placed:
 * ``arr[pos] = unkey(key(arr[pos]) + diffs[slot])``, the key difference of slot ``slot``.
 * When a class runs out of elements (1), every change written is undone first: ``arr`` is
 * as it was. */
int xg_locate_apply16_simd(uint16_t *arr, int64_t n, unsigned shift, unsigned emask,
                           const int64_t *class_start, const int64_t *class_end, int nclass,
                           const int64_t *gaps, uint32_t *pos, const uint16_t *diffs,
                           uint16_t signbit, uint16_t full);

/* Reads two buffers of ``nwords`` 64-bit words once, as fast as this CPU reads memory, and
 * returns a fold of them (its value only keeps the reads from being optimized away). The
 * benchmark's floor for extraction, which must read old and new. */
uint64_t xg_read_pair(const uint64_t *a, const uint64_t *b, int64_t nwords);

#endif
