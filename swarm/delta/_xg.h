/* Kernels of the swarm-xg1 delta codec shared by the extension's C files.
 *
 * Every kernel works on raw bits (unsigned integers of the element width), so change
 * detection compares bits, never float values. See swarm/delta/codec.py for the format.
 */
#ifndef SWARM_XG_H
#define SWARM_XG_H

#include <stddef.h>
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

/* Kernel paths for 2-byte elements, slowest first. */
#define XG_SCALAR 0
#define XG_AVX2 1   /* x86-64 with AVX2, POPCNT and BMI1/2 */
#define XG_AVX512 2 /* x86-64 with AVX-512 F/BW/VBMI/BITALG, GFNI, BMI1/2 */

/* Reads the CPU's features (once, before any kernel runs: at module import). */
void xg_simd_init(void);

/* The fastest path this CPU runs, at most ``cap``. */
int xg_simd_path(int cap);

/* Whether the AVX2 locate avoids pdep (xg_simd_init sets it on Zen 1/2, whose pdep is
 * microcode); for tests of either branch on any CPU. Returns the previous setting. */
int xg_set_slow_pdep(int slow);

/* SIMD scan of 2-byte elements, on the fastest path at most ``cap``: class (exponent
 * field), rank of the element within its class in the segment, and key difference of
 * every change, in element order. Returns the number of changes, -1 when more than
 * ``ncap`` changed, or XG_UNSUPPORTED (nothing written that matters) when no SIMD path
 * runs on this CPU or input. */
int64_t xg_scan16_simd(int cap, const uint16_t *old, const uint16_t *new_, int64_t n,
                       unsigned shift, unsigned emask, uint16_t signbit, uint16_t full,
                       uint16_t *cls, uint32_t *rank, uint16_t *diff, int64_t ncap);

/* SIMD locate of 2-byte elements: class ``c`` has its changes' rank gaps at
 * ``gaps[class_start[c] .. class_end[c])``; writes each change's element index to
 * ``pos[class_start[c] + j]``. ``nclass`` is emask + 1. With ``diffs`` (else NULL), each
 * change is also written as it is placed: ``arr[pos] = unkey(key(arr[pos]) + diffs[slot])``,
 * and when a class runs out of elements every change written is undone first. Returns 0,
 * 1 when a class runs out of elements before its last change, or XG_UNSUPPORTED. */
int xg_locate16_simd(int cap, uint16_t *arr, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos, const uint16_t *diffs,
                     uint16_t signbit, uint16_t full);

/* Reads two buffers of ``nwords`` 64-bit words once, as fast as this CPU reads memory, and
 * returns a fold of them (its value only keeps the reads from being optimized away). The
 * benchmark's floor for extraction, which must read old and new. */
uint64_t xg_read_pair(const uint64_t *a, const uint64_t *b, int64_t nwords);

/* BLAKE3 tree nodes (_b3.c): the chunk size of the tree. */
#define XG_B3_CHUNK 1024

/* The non-root chaining value of the node BLAKE3 builds over ``len`` >= 1 bytes whose first
 * chunk has index ``first_chunk``; full chunks go several at once on ``path`` (an
 * xg_simd_path result). */
void xg_b3_node_cv(int path, const uint8_t *data, size_t len, uint64_t first_chunk,
                   uint8_t out[32]);

/* A parent node's chaining value, or with ``root`` the 32-byte root hash. */
void xg_b3_parent(const uint8_t left[32], const uint8_t right[32], int root,
                  uint8_t out[32]);

#endif
