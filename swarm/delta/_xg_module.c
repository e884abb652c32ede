/* swarm.delta._xg: the fused single-pass kernels of the swarm-xg1 delta codec.
 *
 * Every kernel works on unsigned integer views of raw bits (1, 2, 4 or 8 bytes an
 * element), so change detection compares bits, never float values. Values are mapped to
 * order-preserving keys (sign-magnitude floats become monotone unsigned integers; integers
 * stay as they are) and a change is the key difference modulo 2**bits: exact and
 * reversible for every bit pattern, including -0.0/+0.0 and NaN payloads.
 *
 * The wrappers check every buffer (1-D, C-contiguous, integer format, item size, length,
 * writability) and every index a kernel writes through, raising TypeError/ValueError, so
 * no call writes out of bounds. Malformed *stream data* is not an exception: the decoding
 * kernels return the error codes that swarm/delta/codec.py turns into DecodeError. The
 * GIL is released around every kernel. 2-byte elements take the SIMD paths of
 * _xg_simd.c when the CPU has them (see simd()/set_simd()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_xg.h"

#define ESCAPE 255
#define RICE_KMAX 24
#define RICE_QMAX 24
#define MAX_NCLASS 2048

#if (defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) || defined(_MSC_VER)
#define XG_LITTLE 1
#else
#define XG_LITTLE 0
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static inline int xg_ctz64(uint64_t x) { /* x != 0 */
    unsigned long i;
    _BitScanForward64(&i, x);
    return (int)i;
}
#else
static inline int xg_ctz64(uint64_t x) { return __builtin_ctzll(x); }
#endif

/* Kernel bodies are inlined into dispatchers that pass the common formats' class fields as
 * constants: a shift by a constant is one instruction on every x86-64 (by a variable, it
 * is up to three without BMI2), about 15% of the scalar scan. */
#if defined(_MSC_VER) && !defined(__clang__)
#define XG_INLINE static __forceinline
#else
#define XG_INLINE static inline __attribute__((always_inline))
#endif

#if defined(__GNUC__) || defined(__clang__)
#define XG_RARELY(c) __builtin_expect(!!(c), 0)
#define XG_LIKELY(c) __builtin_expect(!!(c), 1)
#define XG_PREFETCH(p) __builtin_prefetch(p)
#define XG_PREFETCH_W(p) __builtin_prefetch((p), 1)
#else
#define XG_RARELY(c) (c)
#define XG_LIKELY(c) (c)
#define XG_PREFETCH(p) ((void)(p))
#define XG_PREFETCH_W(p) ((void)(p))
#endif

static inline uint64_t xg_bswap64(uint64_t x) {
    x = ((x & 0x00FF00FF00FF00FFu) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFu);
    x = ((x & 0x0000FFFF0000FFFFu) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFu);
    return (x << 32) | (x >> 32);
}

/* The fastest path the 2-byte kernels and b3_node_cv may take (set_simd); read under the
 * GIL. */
static int simd_cap = XG_AVX512;

/* ------------------------------------------------------------------------------------ */
/* Kernels                                                                              */
/* ------------------------------------------------------------------------------------ */

/* Scan of one element width. Four rows of per-class counts (element index mod 4), so that
 * consecutive increments do not wait on each other; an element's rank in its class is the
 * sum of the four rows. Four unchanged elements in a row only count.
 *
 * The count rows are a local array when the format has at most XG_SMALL classes (every
 * format but float64): the compiler then knows that stores to them leave the inputs and
 * outputs alone, which makes the scalar scan about 25% faster than with rows on the heap
 * (the caller's zeroed ``counts``, used otherwise). */
#define XG_SMALL 256

#define XG_ROWS_LOCAL                                                                      \
    uint32_t tab_[4][XG_SMALL];                                                            \
    for (int r_ = 0; r_ < 4; r_++) memset(tab_[r_], 0, sizeof(uint32_t) * (size_t)nclass); \
    uint32_t *c0 = tab_[0], *c1 = tab_[1], *c2 = tab_[2], *c3 = tab_[3];
#define XG_ROWS_HEAP                                                                       \
    uint32_t *c0 = counts, *c1 = counts + nclass, *c2 = counts + 2 * nclass;               \
    uint32_t *c3 = counts + 3 * nclass;

#define XG_RECORD(T, b, c, e)                                                              \
    do {                                                                                   \
        if (k == cap) return -1;                                                           \
        cls[k] = (uint16_t)(e);                                                            \
        rank[k] = c0[e] + c1[e] + c2[e] + c3[e];                                           \
        d[k] = (T)((xg_key((c), signbit, full) - xg_key((b), signbit, full)) & full);      \
        k++;                                                                               \
    } while (0)

#define XG_SCAN_PARAMS(T)                                                                  \
    const T *restrict old, const T *restrict new_, int64_t n, unsigned shift,              \
        uint64_t emask, uint64_t signbit, uint64_t full, uint32_t *counts, int64_t nclass, \
        uint16_t *restrict cls, uint32_t *restrict rank, T *restrict d, int64_t cap

#define XG_DEFINE_SCAN(NAME, T, ROWS)                                                      \
    XG_INLINE int64_t NAME(XG_SCAN_PARAMS(T)) {                                            \
        (void)counts;                                                                      \
        ROWS                                                                               \
        uint32_t *rows[4] = {c0, c1, c2, c3};                                              \
        int64_t k = 0, i = 0, n4 = n - (n & 3);                                            \
        for (; i < n4; i += 4) {                                                           \
            uint64_t x0 = old[i], x1 = old[i + 1], x2 = old[i + 2], x3 = old[i + 3];       \
            if (((x0 ^ new_[i]) | (x1 ^ new_[i + 1]) | (x2 ^ new_[i + 2])                  \
                 | (x3 ^ new_[i + 3])) == 0) {                                             \
                c0[(x0 >> shift) & emask]++;                                               \
                c1[(x1 >> shift) & emask]++;                                               \
                c2[(x2 >> shift) & emask]++;                                               \
                c3[(x3 >> shift) & emask]++;                                               \
                continue;                                                                  \
            }                                                                              \
            for (int j = 0; j < 4; j++) {                                                  \
                uint64_t b = old[i + j], c = new_[i + j];                                  \
                uint64_t e = (b >> shift) & emask;                                         \
                if (b != c) XG_RECORD(T, b, c, e);                                         \
                rows[j][e]++;                                                              \
            }                                                                              \
        }                                                                                  \
        for (; i < n; i++) {                                                               \
            uint64_t b = old[i], c = new_[i];                                              \
            uint64_t e = (b >> shift) & emask;                                             \
            if (b != c) XG_RECORD(T, b, c, e);                                             \
            rows[i & 3][e]++;                                                              \
        }                                                                                  \
        return k;                                                                          \
    }

/* 2-byte elements read as uint64 words, four elements a load: one shift per lane and the
 * mask ``em`` (``emask`` cut to the bits a 16-bit element has above ``shift``) select each
 * lane's class exactly as element by element. */
#define XG_DEFINE_SCAN16(NAME, ROWS)                                                       \
    XG_INLINE int64_t NAME(XG_SCAN_PARAMS(uint16_t)) {                                     \
        (void)counts;                                                                      \
        ROWS                                                                               \
        uint32_t *rows[4] = {c0, c1, c2, c3};                                              \
        const unsigned s1 = shift + 16, s2 = shift + 32, s3 = shift + 48;                  \
        const uint64_t em = emask & (0xFFFFu >> shift);                                    \
        int64_t k = 0, nw = n / 4;                                                         \
        for (int64_t w = 0; w < nw; w++) {                                                 \
            uint64_t x, y;                                                                 \
            XG_PREFETCH(old + 4 * w + 512); /* about 7% faster on segments past caches */  \
            XG_PREFETCH(new_ + 4 * w + 512);                                               \
            memcpy(&x, old + 4 * w, 8);                                                    \
            memcpy(&y, new_ + 4 * w, 8);                                                   \
            if (x == y) {                                                                  \
                c0[(x >> shift) & em]++;                                                   \
                c1[(x >> s1) & em]++;                                                      \
                c2[(x >> s2) & em]++;                                                      \
                c3[(x >> s3) & em]++;                                                      \
                continue;                                                                  \
            }                                                                              \
            for (int j = 0; j < 4; j++) {                                                  \
                uint64_t b = (x >> (16 * j)) & 0xFFFF, c = (y >> (16 * j)) & 0xFFFF;       \
                uint64_t e = (b >> shift) & emask;                                         \
                if (b != c) XG_RECORD(uint16_t, b, c, e);                                  \
                rows[j][e]++;                                                              \
            }                                                                              \
        }                                                                                  \
        for (int64_t i = 4 * nw; i < n; i++) {                                             \
            uint64_t b = old[i], c = new_[i];                                              \
            uint64_t e = (b >> shift) & emask;                                             \
            if (b != c) XG_RECORD(uint16_t, b, c, e);                                      \
            rows[i & 3][e]++;                                                              \
        }                                                                                  \
        return k;                                                                          \
    }

XG_DEFINE_SCAN(scan_u8_small, uint8_t, XG_ROWS_LOCAL)
XG_DEFINE_SCAN(scan_u8_wide, uint8_t, XG_ROWS_HEAP)
XG_DEFINE_SCAN(scan_u32_small, uint32_t, XG_ROWS_LOCAL)
XG_DEFINE_SCAN(scan_u32_wide, uint32_t, XG_ROWS_HEAP)
XG_DEFINE_SCAN(scan_u64_small, uint64_t, XG_ROWS_LOCAL)
XG_DEFINE_SCAN(scan_u64_wide, uint64_t, XG_ROWS_HEAP)
#if XG_LITTLE
XG_DEFINE_SCAN16(scan_u16_small, XG_ROWS_LOCAL)
XG_DEFINE_SCAN16(scan_u16_wide, XG_ROWS_HEAP)
#else
XG_DEFINE_SCAN(scan_u16_small, uint16_t, XG_ROWS_LOCAL)
XG_DEFINE_SCAN(scan_u16_wide, uint16_t, XG_ROWS_HEAP)
#endif

/* Dispatch of a kernel NAME (parameters: the rest) to its local-table body NAME_small for
 * formats of at most XG_SMALL classes, or NAME_wide, with the two common class fields
 * (S1, M1), (S2, M2) of the width as constants; CALL(F, shift, emask, nclass) calls F. */
#define XG_DEFINE_DISPATCH(RET, NAME, CALL, S1, M1, S2, M2, ...)                           \
    static RET NAME(__VA_ARGS__) {                                                         \
        if (M1 < XG_SMALL && shift == S1 && emask == M1)                                   \
            return CALL(NAME##_small, S1, M1, M1 + 1);                                     \
        if (M2 < XG_SMALL && shift == S2 && emask == M2)                                   \
            return CALL(NAME##_small, S2, M2, M2 + 1);                                     \
        if (nclass <= XG_SMALL) return CALL(NAME##_small, shift, emask, nclass);           \
        if (shift == S1 && emask == M1) return CALL(NAME##_wide, S1, M1, M1 + 1);          \
        return CALL(NAME##_wide, shift, emask, nclass);                                    \
    }

#define XG_SCAN_CALL(F, S, M, NC) \
    F(old, new_, n, S, M, signbit, full, counts, NC, cls, rank, d, cap)

/* (shift, emask) of float8_e4m3fn/e5m2, bfloat16/float16, float32 (and integers: 0, 0),
 * float64 */
XG_DEFINE_DISPATCH(int64_t, scan_u8, XG_SCAN_CALL, 3, 0xF, 2, 0x1F, XG_SCAN_PARAMS(uint8_t))
XG_DEFINE_DISPATCH(int64_t, scan_u16, XG_SCAN_CALL, 7, 0xFF, 10, 0x1F, XG_SCAN_PARAMS(uint16_t))
XG_DEFINE_DISPATCH(int64_t, scan_u32, XG_SCAN_CALL, 23, 0xFF, 0, 0, XG_SCAN_PARAMS(uint32_t))
XG_DEFINE_DISPATCH(int64_t, scan_u64, XG_SCAN_CALL, 52, 0x7FF, 0, 0, XG_SCAN_PARAMS(uint64_t))

/* Rice parameter of one class of ``c`` > 0 gaps summing to ``total``: the cheapest of five
 * around log2 of the mean gap. Gaps are < 2**32 (ranks are uint32 and increase within a
 * class). The cost of parameter kk is the sum over gaps of q + 1 + kk (q = gap >> kk), or
 * RICE_QMAX + 32 for a gap whose q is RICE_QMAX or more. One pass: a gap that does not
 * escape at the smallest candidate lo escapes at none, and its five costs follow from
 * h = gap >> lo < RICE_QMAX (q = h >> (kk - lo)), so those gaps are only counted per h (four
 * rows of counts, so that increments of one h do not wait on each other); the few others
 * (about 2% on trained weights) add their five costs directly. */
static int rice_param(const uint32_t *restrict gapv, int64_t c, int64_t total) {
    int k0 = 0;
    while (k0 < RICE_KMAX && (c << (k0 + 1)) <= total) k0++;
    int lo = k0 - 2 < 0 ? 0 : k0 - 2, hi = k0 + 2 > RICE_KMAX ? RICE_KMAX : k0 + 2;
    const unsigned l0 = (unsigned)lo;
    int64_t cost[5] = {0, 0, 0, 0, 0};
    int64_t h[4][RICE_QMAX];
    memset(h, 0, sizeof h);
    int64_t i = 0;
#define XG_H(R, I)                                                                          \
    do {                                                                                    \
        uint32_t g_ = gapv[I], q_ = g_ >> l0;                                               \
        if (XG_LIKELY(q_ < RICE_QMAX)) h[R][q_]++;                                          \
        else for (unsigned t = 0; t < 5; t++) {                                             \
            uint32_t u_ = g_ >> (l0 + t);                                                   \
            cost[t] += u_ < RICE_QMAX ? u_ + 1 + l0 + t : RICE_QMAX + 32;                   \
        }                                                                                   \
    } while (0)
    for (; i + 4 <= c; i += 4) { XG_H(0, i); XG_H(1, i + 1); XG_H(2, i + 2); XG_H(3, i + 3); }
    for (; i < c; i++) XG_H(0, i);
#undef XG_H
    for (unsigned q = 0; q < RICE_QMAX; q++) {
        int64_t n = h[0][q] + h[1][q] + h[2][q] + h[3][q];
        for (unsigned t = 0; t < 5; t++) cost[t] += n * (int64_t)((q >> t) + 1 + l0 + t);
    }
    int best = lo;
    for (int kk = lo + 1; kk <= hi; kk++)
        if (cost[kk - lo] < cost[best - lo]) best = kk;
    return best;
}

/* Sign bits and escaped u8 magnitudes of the key differences ``ds`` (in class order;
 * overwritten); returns the magnitude bytes written. A first pass (that vectorizes) turns
 * the differences into magnitude - 1 (``ds``), its byte capped at ESCAPE (``mb``) and the
 * sign (``sg``, 0 or 1); then eight changes go at once when none of them escapes. */
#define XG_DEFINE_VALUES(NAME, T, W)                                                       \
    static int64_t NAME(T *restrict ds, int64_t k, uint8_t *restrict mb,                   \
                        uint8_t *restrict sg, uint8_t *restrict signs_out,                 \
                        uint8_t *restrict mags_out) {                                      \
        for (int64_t p = 0; p < k; p++) {                                                  \
            T dd = ds[p];                                                                  \
            T neg = (T)(dd >> (8 * W - 1));                                                \
            T mm = (T)((neg ? (T)(0 - dd) : dd) - 1);                                      \
            ds[p] = mm;                                                                    \
            mb[p] = (uint8_t)(mm < ESCAPE ? mm : ESCAPE);                                  \
            sg[p] = (uint8_t)neg;                                                          \
        }                                                                                  \
        const uint64_t ones = 0x0101010101010101u, highs = 0x8080808080808080u;            \
        int64_t m = 0, p = 0;                                                              \
        for (; p + 8 <= k; p += 8) {                                                       \
            uint64_t s8, m8;                                                               \
            memcpy(&s8, sg + p, 8);                                                        \
            memcpy(&m8, mb + p, 8);                                                        \
            if (!XG_LITTLE) s8 = xg_bswap64(s8);                                           \
            /* byte t of s8 (0 or 1) to bit t */                                           \
            signs_out[p >> 3] = (uint8_t)((s8 * 0x0102040810204080u) >> 56);               \
            uint64_t x = ~m8; /* a zero byte where m8 has ESCAPE */                       \
            if (XG_LIKELY(((x - ones) & ~x & highs) == 0)) {                               \
                memcpy(mags_out + m, &m8, 8);                                              \
                m += 8;                                                                    \
                continue;                                                                  \
            }                                                                              \
            for (int t = 0; t < 8; t++) {                                                  \
                T mm = ds[p + t];                                                          \
                if (mm < ESCAPE) {                                                         \
                    mags_out[m++] = (uint8_t)mm;                                           \
                } else {                                                                   \
                    mags_out[m] = ESCAPE;                                                  \
                    for (int u = 0; u < W; u++)                                            \
                        mags_out[m + 1 + u] = (uint8_t)((uint64_t)mm >> (8 * u));          \
                    m += 1 + W;                                                            \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        if (p < k) {                                                                       \
            unsigned sbyte = 0;                                                            \
            for (int t = 0; p + t < k; t++) {                                              \
                T mm = ds[p + t];                                                          \
                sbyte |= (unsigned)sg[p + t] << t;                                         \
                if (mm < ESCAPE) {                                                         \
                    mags_out[m++] = (uint8_t)mm;                                           \
                } else {                                                                   \
                    mags_out[m] = ESCAPE;                                                  \
                    for (int u = 0; u < W; u++)                                            \
                        mags_out[m + 1 + u] = (uint8_t)((uint64_t)mm >> (8 * u));          \
                    m += 1 + W;                                                            \
                }                                                                          \
            }                                                                              \
            signs_out[p >> 3] = (uint8_t)sbyte;                                            \
        }                                                                                  \
        return m;                                                                          \
    }

XG_DEFINE_VALUES(values_u8, uint8_t, 1)
XG_DEFINE_VALUES(values_u16, uint16_t, 2)
XG_DEFINE_VALUES(values_u32, uint32_t, 4)
XG_DEFINE_VALUES(values_u64, uint64_t, 8)

/* The bit writer of rice_write: ``acc`` holds ``used`` < 8 pending bits between codes. */
typedef struct {
    uint64_t acc;
    unsigned used;
    int64_t pos;
} xg_bits;

/* Store the whole bytes of acc: 8 bytes at once where ``out`` has room, else byte by
 * byte. */
XG_INLINE void xg_flush(xg_bits *w, uint8_t *restrict out, int64_t cap) {
    if (XG_LIKELY(w->pos + 8 <= cap)) {
        uint64_t le = w->acc;
        if (!XG_LITTLE) le = xg_bswap64(le);
        memcpy(out + w->pos, &le, 8);
    } else {
        for (unsigned u = 0; u < w->used >> 3; u++)
            out[w->pos + u] = (uint8_t)(w->acc >> (8 * u));
    }
    w->pos += w->used >> 3;
    w->acc >>= w->used & ~7u;
    w->used &= 7;
}

/* The code of gap ``g`` with parameter ``kb`` (its length in ``*nbits``): ((2r + 1) << q) - 1
 * is q ones, a zero and the kb low bits r; an escape ((g + 1) << RICE_QMAX) - 1 is
 * RICE_QMAX ones and g in 32 bits. */
XG_INLINE uint64_t xg_code(uint64_t g, unsigned kb, unsigned *nbits) {
    uint64_t q = g >> kb;
    if (XG_LIKELY(q < RICE_QMAX)) {
        *nbits = (unsigned)q + 1 + kb;
        return ((((g & (((uint64_t)1 << kb) - 1)) << 1) | 1) << q) - 1;
    }
    *nbits = RICE_QMAX + 32;
    return ((g + 1) << RICE_QMAX) - 1;
}

/* The codes of one class, four at a time into the accumulator when they fit (one store for
 * the four), else one by one. */
XG_INLINE void rice_class(const uint32_t *restrict gapv, int64_t c, unsigned kb,
                          uint8_t *restrict out, int64_t cap, xg_bits *w) {
    xg_bits b = *w;
    int64_t i = 0;
    for (; i + 4 <= c; i += 4) {
        unsigned n0, n1, n2, n3;
        uint64_t c0 = xg_code(gapv[i], kb, &n0), c1 = xg_code(gapv[i + 1], kb, &n1);
        uint64_t c2 = xg_code(gapv[i + 2], kb, &n2), c3 = xg_code(gapv[i + 3], kb, &n3);
        if (XG_LIKELY(b.used + n0 + n1 + n2 + n3 < 64)) { /* every shift below is < 64 */
            b.acc |= c0 << b.used;
            b.used += n0;
            b.acc |= c1 << b.used;
            b.used += n1;
            b.acc |= c2 << b.used;
            b.used += n2;
            b.acc |= c3 << b.used;
            b.used += n3;
            xg_flush(&b, out, cap);
        } else {
            b.acc |= c0 << b.used; b.used += n0; xg_flush(&b, out, cap);
            b.acc |= c1 << b.used; b.used += n1; xg_flush(&b, out, cap);
            b.acc |= c2 << b.used; b.used += n2; xg_flush(&b, out, cap);
            b.acc |= c3 << b.used; b.used += n3; xg_flush(&b, out, cap);
        }
    }
    for (; i < c; i++) {
        unsigned n;
        uint64_t code = xg_code(gapv[i], kb, &n);
        b.acc |= code << b.used; /* at most 56 + 7 bits */
        b.used += n;
        xg_flush(&b, out, cap);
    }
    *w = b;
}

/* Rice codes of ``gapv`` (grouped by class, ``kparam`` per class) into ``out`` (at least
 * ``cap`` >= (56 * k + 7) / 8 bytes); returns the bytes written. Bits go LSB first. Each
 * parameter has a loop of its own (shifts by a constant). */
static int64_t rice_write(const uint32_t *restrict gapv, const int64_t *ccount,
                          const int64_t *kparam, int64_t nclass, uint8_t *restrict out,
                          int64_t cap) {
    xg_bits w = {0, 0, 0};
    int64_t p = 0;
    for (int64_t e = 0; e < nclass; e++) {
        int64_t c = ccount[e];
        if (c == 0) continue;
        const uint32_t *g = gapv + p;
        p += c;
        switch (kparam[e]) {
#define XG_K(K) case K: rice_class(g, c, K, out, cap, &w); break;
        XG_K(0) XG_K(1) XG_K(2) XG_K(3) XG_K(4) XG_K(5) XG_K(6) XG_K(7) XG_K(8)
        XG_K(9) XG_K(10) XG_K(11) XG_K(12) XG_K(13) XG_K(14) XG_K(15) XG_K(16)
        XG_K(17) XG_K(18) XG_K(19) XG_K(20) XG_K(21) XG_K(22) XG_K(23)
        default: rice_class(g, c, RICE_KMAX, out, cap, &w); break;
#undef XG_K
        }
    }
    if (w.used > 0) out[w.pos++] = (uint8_t)w.acc;
    return w.pos;
}

/* Changes of a width grouped by class (a stable counting sort, from the class offsets
 * ``off``): their ranks ``rs`` and key differences ``ds`` in class order. */
#define XG_DEFINE_GROUP(NAME, T)                                                           \
    static void NAME(const uint16_t *restrict cls, const uint32_t *restrict rank,          \
                     const T *restrict d, int64_t k, uint32_t *restrict off,               \
                     uint32_t *restrict rs, T *restrict ds) {                              \
        for (int64_t j = 0; j < k; j++) {                                                  \
            uint32_t p = off[cls[j]]++;                                                    \
            rs[p] = rank[j];                                                               \
            ds[p] = d[j];                                                                  \
        }                                                                                  \
    }

XG_DEFINE_GROUP(group_u8, uint8_t)
XG_DEFINE_GROUP(group_u16, uint16_t)
XG_DEFINE_GROUP(group_u32, uint32_t)
XG_DEFINE_GROUP(group_u64, uint64_t)

/* The rank gaps ``g`` of one class of ``c`` > 0 changes from its ranks ``r``; returns
 * nonzero when the ranks do not increase. */
static int rank_gaps(const uint32_t *restrict r, int64_t c, uint32_t *restrict g) {
    uint32_t bad = 0;
    g[0] = r[0];
    for (int64_t p = 1; p < c; p++) {
        bad |= r[p] <= r[p - 1];
        g[p] = r[p] - r[p - 1] - 1;
    }
    return bad != 0;
}

#define XG_ROWS 8

/* Group changes by class; Rice-coded rank gaps, sign bits and escaped u8 magnitudes.
 * ``ccount``/``kparam`` (nclass long) are overwritten. The caller checked the output
 * sizes; this checks classes < nclass and ranks increasing within a class before any
 * output is written. Returns 0, 1 when a class or rank is bad (outputs untouched), or -1
 * when out of memory. */
static int group_encode(const uint16_t *cls, const uint32_t *rank, const void *d, int width,
                        int64_t k, int64_t nclass, int64_t *ccount, int64_t *kparam,
                        uint8_t *gaps_out, int64_t gaps_cap, uint8_t *signs_out,
                        uint8_t *mags_out, int64_t *g_bytes, int64_t *m_bytes) {
    /* XG_ROWS rows of counts (change index mod XG_ROWS: the increments of a class do not
     * wait on each other), nclass + 1 wide (the last counts classes out of range); the
     * class offsets; then in class order the ranks, their gaps, the differences, their
     * magnitude bytes and signs (values_*). k < 2**32: counts fit in uint32. */
    const int64_t nt = nclass + 1, kk = k > 0 ? k : 1;
    size_t bytes = sizeof(uint32_t) * (size_t)((XG_ROWS + 1) * nt + 2 * kk)
                   + (size_t)(width + 2) * (size_t)kk + 16;
    uint32_t *tab = malloc(bytes);
    if (tab == NULL) return -1;
    uint32_t *rows = tab, *off = tab + XG_ROWS * nt, *rs = off + nt, *gapv = rs + kk;
    uint8_t *ds_ = (uint8_t *)(gapv + kk); /* aligned for any width */
    void *ds = ds_ + (8 - ((uintptr_t)ds_ & 7)) % 8;
    uint8_t *mb = (uint8_t *)ds + (size_t)width * (size_t)kk, *sg = mb + kk;
    memset(rows, 0, sizeof(uint32_t) * (size_t)(XG_ROWS * nt));
    {
        const uint16_t top = (uint16_t)nclass;
        int64_t j = 0;
        for (; j + XG_ROWS <= k; j += XG_ROWS)
            for (int r = 0; r < XG_ROWS; r++) {
                unsigned e = cls[j + r];
                rows[r * nt + (e < top ? e : top)]++;
            }
        for (; j < k; j++) rows[cls[j] < top ? cls[j] : top]++;
    }
    uint32_t s = 0;
    for (int64_t e = 0; e < nt; e++) {
        uint32_t c = 0;
        for (int r = 0; r < XG_ROWS; r++) c += rows[r * nt + e];
        rows[e] = c;
        off[e] = s;
        s += c;
    }
    int bad = rows[nclass] != 0;
    if (!bad) {
        switch (width) {
        case 1: group_u8(cls, rank, d, k, off, rs, ds); break;
        case 2: group_u16(cls, rank, d, k, off, rs, ds); break;
        case 4: group_u32(cls, rank, d, k, off, rs, ds); break;
        default: group_u64(cls, rank, d, k, off, rs, ds); break;
        }
        /* row 1: the last rank of each class */
        for (int64_t e = 0, p0 = 0; e < nclass; p0 += rows[e], e++) {
            if (rows[e] == 0) continue;
            bad |= rank_gaps(rs + p0, rows[e], gapv + p0);
            rows[nt + e] = rs[p0 + rows[e] - 1];
        }
    }
    if (bad) {
        free(tab);
        return 1;
    }
    switch (width) {
    case 1: *m_bytes = values_u8(ds, k, mb, sg, signs_out, mags_out); break;
    case 2: *m_bytes = values_u16(ds, k, mb, sg, signs_out, mags_out); break;
    case 4: *m_bytes = values_u32(ds, k, mb, sg, signs_out, mags_out); break;
    default: *m_bytes = values_u64(ds, k, mb, sg, signs_out, mags_out); break;
    }
    int64_t p0 = 0;
    for (int64_t e = 0; e < nclass; e++) {
        int64_t c = rows[e];
        ccount[e] = c;
        kparam[e] = 0;
        if (c == 0) continue;
        /* the gaps of a class sum to its last rank + 1 - c */
        kparam[e] = rice_param(gapv + p0, c, (int64_t)rows[nt + e] + 1 - c);
        p0 += c;
    }
    *g_bytes = rice_write(gapv, ccount, kparam, nclass, gaps_out, gaps_cap);
    free(tab);
    return 0;
}

static inline uint64_t load_le64(const uint8_t *s) {
    uint64_t w;
    memcpy(&w, s, 8);
#if !XG_LITTLE
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* Rice-coded rank gaps, grouped by class. 0 ok, 1 truncated, 2 trailing bytes or bits,
 * 3 non-canonical escape, 4 rank past the segment, -1 out of memory.
 *
 * Codes are read from a 64-bit window of the stream (a zero-padded copy, so past its end it
 * reads zeros), kept complemented (``y``: the unary part ends at its lowest set bit). The
 * window is refilled (57 bits or more) before every XG_GROUP(kk) codes of a class, a number
 * that usually fits: the loops then run a fixed number of times, and the branch to refill
 * early when a code reaches past the window is rarely taken. */
#define XG_GROUP(kk) (48 / ((kk) + 3) + 1)

static int decode_gaps(const int64_t *ccounts, const int64_t *kparams, int64_t nc,
                       const uint8_t *gaps, int64_t nbytes, int64_t *gaps_out, int64_t limit) {
    uint8_t *buf = malloc((size_t)nbytes + 16);
    if (buf == NULL) return -1;
    if (nbytes > 0) memcpy(buf, gaps, (size_t)nbytes);
    memset(buf + nbytes, 0, 16);
    const int64_t nbits = nbytes * 8;
    const uint64_t cap = (uint64_t)1 << RICE_QMAX;
    int64_t b = 0, p = 0;
    int rc = 0;
    for (int64_t ci = 0; ci < nc; ci++) {
        const int64_t kk = kparams[ci], c = ccounts[ci], group = XG_GROUP(kk);
        const uint64_t kmask = ((uint64_t)1 << kk) - 1;
        int64_t last = -1;
        for (int64_t j = 0; j < c;) {
            /* at least 57 stream bits: any code fits */
            uint64_t y = ~(load_le64(buf + (b >> 3)) >> (b & 7));
            int64_t avail = 64 - (b & 7), n = c - j < group ? c - j : group, t = 0;
            for (; t < n; t++) {
                int64_t q = xg_ctz64(y | cap), v;
                int64_t len = q < RICE_QMAX ? q + 1 + kk : RICE_QMAX + 32;
                if (XG_RARELY(len > avail)) break; /* (past the window, y is not the stream) */
                if (XG_RARELY(b + len > nbits)) { rc = 1; goto out; }
                if (XG_LIKELY(q < RICE_QMAX)) {
                    v = (q << kk) | (int64_t)((~y >> (q + 1)) & kmask);
                } else {
                    v = (int64_t)((~y >> RICE_QMAX) & 0xFFFFFFFFu);
                    if ((v >> kk) < RICE_QMAX) { rc = 3; goto out; }
                }
                y >>= len;
                avail -= len;
                b += len;
                last = last + 1 + v;
                if (XG_RARELY(last >= limit)) { rc = 4; goto out; }
                gaps_out[p++] = v;
            }
            j += t;
        }
    }
out:
    free(buf);
    if (rc != 0) return rc;
    if ((b + 7) / 8 != nbytes) return 2;
    if (b < nbits && (gaps[nbytes - 1] >> (b & 7)) != 0) return 2;
    return 0;
}

/* One pass over the old values: rank gaps -> element positions, grouped by class. Each
 * class counts down the gap to its next change. ``class_start``/``class_end`` were checked
 * to lie within ``gaps``/``pos``. Returns 0, 1 when a class runs out of elements before
 * its last change, or -1 when out of memory.
 *
 * As in the scan, the per-class tables are local arrays for formats of at most XG_SMALL
 * classes (about 20% faster), and 2-byte elements go four a load. */
#define XG_LOC_STEP(e, idx)                                                                \
    do {                                                                                   \
        int64_t y_ = left[e];                                                              \
        left[e] = y_ - 1;                                                                  \
        if (XG_RARELY(y_ == 0)) {                                                          \
            int64_t p_ = ptr[e];                                                           \
            pos[p_++] = (uint32_t)(idx);                                                   \
            ptr[e] = p_;                                                                   \
            left[e] = p_ < class_end[e] ? gaps[p_] : -1;                                   \
        }                                                                                  \
    } while (0)

#define XG_TABLES_LOCAL int64_t ptr[XG_SMALL], left[XG_SMALL];
#define XG_TABLES_HEAP                                                                     \
    int64_t *ptr = malloc(sizeof(int64_t) * (size_t)(2 * nclass));                         \
    if (ptr == NULL) return -1;                                                            \
    int64_t *left = ptr + nclass;
#define XG_FREE_LOCAL
#define XG_FREE_HEAP free(ptr);

#define XG_LOCATE_PARAMS(T)                                                                \
    const T *restrict o, int64_t n, unsigned shift, uint64_t emask, int64_t nclass,        \
        const int64_t *class_start, const int64_t *class_end, const int64_t *gaps,         \
        uint32_t *restrict pos

#define XG_DEFINE_LOCATE(NAME, T, TABLES, FREE)                                            \
    XG_INLINE int NAME(XG_LOCATE_PARAMS(T)) {                                              \
        TABLES                                                                             \
        for (int64_t e = 0; e < nclass; e++) {                                             \
            ptr[e] = class_start[e];                                                       \
            left[e] = ptr[e] < class_end[e] ? gaps[ptr[e]] : -1;                           \
        }                                                                                  \
        int64_t i = 0;                                                                     \
        if (sizeof(T) == 2 && XG_LITTLE) {                                                 \
            const uint64_t em = emask & (0xFFFFu >> shift);                                \
            for (; i + 4 <= n; i += 4) {                                                   \
                uint64_t x;                                                                \
                memcpy(&x, o + i, 8);                                                      \
                for (int j = 0; j < 4; j++) XG_LOC_STEP((x >> (shift + 16 * j)) & em, i + j); \
            }                                                                              \
        }                                                                                  \
        for (; i < n; i++) XG_LOC_STEP(((uint64_t)o[i] >> shift) & emask, i);              \
        int rc = 0;                                                                        \
        for (int64_t e = 0; e < nclass; e++)                                               \
            if (ptr[e] != class_end[e]) rc = 1;                                            \
        FREE                                                                               \
        return rc;                                                                         \
    }

XG_DEFINE_LOCATE(locate_u8_small, uint8_t, XG_TABLES_LOCAL, XG_FREE_LOCAL)
XG_DEFINE_LOCATE(locate_u8_wide, uint8_t, XG_TABLES_HEAP, XG_FREE_HEAP)
XG_DEFINE_LOCATE(locate_u16_small, uint16_t, XG_TABLES_LOCAL, XG_FREE_LOCAL)
XG_DEFINE_LOCATE(locate_u16_wide, uint16_t, XG_TABLES_HEAP, XG_FREE_HEAP)
XG_DEFINE_LOCATE(locate_u32_small, uint32_t, XG_TABLES_LOCAL, XG_FREE_LOCAL)
XG_DEFINE_LOCATE(locate_u32_wide, uint32_t, XG_TABLES_HEAP, XG_FREE_HEAP)
XG_DEFINE_LOCATE(locate_u64_small, uint64_t, XG_TABLES_LOCAL, XG_FREE_LOCAL)
XG_DEFINE_LOCATE(locate_u64_wide, uint64_t, XG_TABLES_HEAP, XG_FREE_HEAP)

#define XG_LOCATE_CALL(F, S, M, NC) F(o, n, S, M, NC, class_start, class_end, gaps, pos)

XG_DEFINE_DISPATCH(int, locate_u8, XG_LOCATE_CALL, 3, 0xF, 2, 0x1F, XG_LOCATE_PARAMS(uint8_t))
XG_DEFINE_DISPATCH(int, locate_u16, XG_LOCATE_CALL, 7, 0xFF, 10, 0x1F, XG_LOCATE_PARAMS(uint16_t))
XG_DEFINE_DISPATCH(int, locate_u32, XG_LOCATE_CALL, 23, 0xFF, 0, 0, XG_LOCATE_PARAMS(uint32_t))
XG_DEFINE_DISPATCH(int, locate_u64, XG_LOCATE_CALL, 52, 0x7FF, 0, 0, XG_LOCATE_PARAMS(uint64_t))

static int locate(const void *old, int width, int64_t n, unsigned shift, uint64_t emask,
                  const int64_t *class_start, const int64_t *class_end, int64_t nclass,
                  const int64_t *gaps, uint32_t *pos) {
    switch (width) {
    case 1: return locate_u8(old, n, shift, emask, nclass, class_start, class_end, gaps, pos);
    case 2: return locate_u16(old, n, shift, emask, nclass, class_start, class_end, gaps, pos);
    case 4: return locate_u32(old, n, shift, emask, nclass, class_start, class_end, gaps, pos);
    default: return locate_u64(old, n, shift, emask, nclass, class_start, class_end, gaps,
                               pos);
    }
}

/* Sign bits + escaped u8 magnitudes -> key differences. 0 ok, 1 truncated, 2 trailing
 * bytes, 3 non-canonical or out-of-range value. For 2-byte and wider elements, eight
 * changes without an escape byte among their magnitudes go at once (no checks needed:
 * a magnitude below 256 is in range). */
#define XG_DEFINE_DECODE_VALUES(NAME, T, W)                                                \
    static int NAME(const uint8_t *restrict signs, const uint8_t *restrict mags, int64_t n, \
                    int64_t k, T *restrict d_out) {                                        \
        const uint64_t half = (uint64_t)1 << (8 * W - 1);                                  \
        const uint64_t ones = 0x0101010101010101u, highs = 0x8080808080808080u;            \
        int64_t m = 0, p = 0;                                                              \
        while (p < k) {                                                                    \
            if (W >= 2 && XG_LITTLE && (p & 7) == 0 && p + 8 <= k && m + 8 <= n) {         \
                uint64_t w;                                                                \
                memcpy(&w, mags + m, 8);                                                   \
                if (((~w - ones) & w & highs) == 0) { /* no escape byte among the 8 */     \
                    unsigned sb = signs[p >> 3];                                           \
                    for (int t = 0; t < 8; t++) {                                          \
                        T mag = (T)(((w >> (8 * t)) & 0xFF) + 1);                          \
                        d_out[p + t] = ((sb >> t) & 1) ? (T)(0 - mag) : mag;               \
                    }                                                                      \
                    p += 8;                                                                \
                    m += 8;                                                                \
                    continue;                                                              \
                }                                                                          \
            }                                                                              \
            if (m >= n) return 1;                                                          \
            uint64_t v = mags[m++];                                                        \
            if (v == ESCAPE) {                                                             \
                if (m + W > n) return 1;                                                   \
                v = 0;                                                                     \
                for (int t = 0; t < W; t++) v |= (uint64_t)mags[m + t] << (8 * t);         \
                m += W;                                                                    \
                if (v < ESCAPE) return 3;                                                  \
            }                                                                              \
            if (v >= half) return 3;                                                       \
            T mag = (T)(v + 1);                                                            \
            if ((signs[p >> 3] >> (p & 7)) & 1) {                                          \
                d_out[p] = (T)(0 - mag);                                                   \
            } else {                                                                       \
                if (mag == half) return 3;                                                 \
                d_out[p] = mag;                                                            \
            }                                                                              \
            p++;                                                                           \
        }                                                                                  \
        if (m != n) return 2;                                                              \
        if ((k & 7) != 0 && (signs[k >> 3] >> (k & 7)) != 0) return 3;                     \
        return 0;                                                                          \
    }

XG_DEFINE_DECODE_VALUES(decode_values_u8, uint8_t, 1)
XG_DEFINE_DECODE_VALUES(decode_values_u16, uint16_t, 2)
XG_DEFINE_DECODE_VALUES(decode_values_u32, uint32_t, 4)
XG_DEFINE_DECODE_VALUES(decode_values_u64, uint64_t, 8)

static int decode_values(const uint8_t *signs, const uint8_t *mags, int64_t n, int64_t k,
                         int width, void *d_out) {
    switch (width) {
    case 1: return decode_values_u8(signs, mags, n, k, d_out);
    case 2: return decode_values_u16(signs, mags, n, k, d_out);
    case 4: return decode_values_u32(signs, mags, n, k, d_out);
    default: return decode_values_u64(signs, mags, n, k, d_out);
    }
}

/* arr[pos] = unkey(key(arr[pos]) +/- d) in place (positions checked by the caller).
 * Positions come grouped by class, so consecutive ones land far apart in a large segment:
 * the element XG_AHEAD changes on is prefetched (about 3x faster on a 4M-element bf16
 * segment). */
#define XG_AHEAD 64
#define XG_DEFINE_APPLY(NAME, T)                                                           \
    static void NAME(T *restrict arr, const uint32_t *restrict pos, const T *restrict d,   \
                     int64_t k, uint64_t signbit, uint64_t full, int negate) {             \
        for (int64_t j = 0; j < k; j++) {                                                  \
            if (j + XG_AHEAD < k) XG_PREFETCH_W(arr + pos[j + XG_AHEAD]);                  \
            uint64_t dd = d[j];                                                            \
            if (negate) dd = ((full - dd) + 1) & full;                                     \
            uint64_t key = (xg_key(arr[pos[j]], signbit, full) + dd) & full;               \
            arr[pos[j]] = (T)xg_unkey(key, signbit, full);                                 \
        }                                                                                  \
    }

XG_DEFINE_APPLY(apply_u8, uint8_t)
XG_DEFINE_APPLY(apply_u16, uint16_t)
XG_DEFINE_APPLY(apply_u32, uint32_t)
XG_DEFINE_APPLY(apply_u64, uint64_t)

static void apply_diffs(void *arr, int width, const uint32_t *pos, const void *d, int64_t k,
                        uint64_t signbit, uint64_t full, int negate) {
    switch (width) {
    case 1: apply_u8(arr, pos, d, k, signbit, full, negate); break;
    case 2: apply_u16(arr, pos, d, k, signbit, full, negate); break;
    case 4: apply_u32(arr, pos, d, k, signbit, full, negate); break;
    default: apply_u64(arr, pos, d, k, signbit, full, negate); break;
    }
}

/* The class table ``u16 ids || u32 counts || u8 Rice parameters`` (little-endian, ``nc``
 * classes) -> per present class ``ccounts``/``kparams``, and per class id the slots
 * ``[class_start, class_end)`` of its changes (empty at 0 for absent classes). 0 ok, 1 ids not ascending or not below
 * ``nclass``, a zero count, a parameter above RICE_KMAX, or counts not summing to
 * ``changes``. */
static int class_table(const uint8_t *t, int64_t nc, int64_t nclass, int64_t changes,
                       int64_t *ccounts, int64_t *kparams, int64_t *class_start,
                       int64_t *class_end) {
    int64_t sum = 0, prev = -1;
    for (int64_t e = 0; e < nclass; e++) class_start[e] = class_end[e] = 0;
    for (int64_t i = 0; i < nc; i++) {
        int64_t id = (int64_t)t[2 * i] | ((int64_t)t[2 * i + 1] << 8);
        const uint8_t *c = t + 2 * nc + 4 * i;
        int64_t cnt = (int64_t)c[0] | ((int64_t)c[1] << 8) | ((int64_t)c[2] << 16)
                      | ((int64_t)c[3] << 24);
        int64_t kp = t[6 * nc + i];
        if (id <= prev || id >= nclass || cnt == 0 || kp > RICE_KMAX) return 1;
        prev = id;
        ccounts[i] = cnt;
        kparams[i] = kp;
        class_start[id] = sum;
        sum += cnt;
        class_end[id] = sum;
    }
    return sum == changes ? 0 : 1;
}

/* ------------------------------------------------------------------------------------ */
/* Argument checking                                                                    */
/* ------------------------------------------------------------------------------------ */

enum { KIND_UNSIGNED = 'u', KIND_SIGNED = 'i' };

/* A held buffer: 1-D, C-contiguous, integers of one kind and item size. */
typedef struct {
    Py_buffer view;
    int held;
    int64_t len;   /* elements */
    int width;     /* bytes an element */
} xg_buf;

static void release_all(xg_buf *bufs, int n) {
    for (int i = 0; i < n; i++) {
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
    }
}

/* Get ``obj``'s buffer as an array of integers of ``kind`` and ``width`` bytes (0: any of
 * 1, 2, 4, 8); raises TypeError and returns -1 otherwise. */
static int get_array(PyObject *obj, xg_buf *out, const char *name, int writable, int kind,
                     int width) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a buffer (a numpy array), not %.80s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", name,
                     writable ? ", writable" : "");
        return -1;
    }
    out->held = 1;
    const char *f = out->view.format != NULL ? out->view.format : "B";
    if (*f == '@' || *f == '=' || (XG_LITTLE && *f == '<') || (!XG_LITTLE && *f == '>'))
        f++;
    int fkind = 0;
    if (f[0] != '\0' && f[1] == '\0') {
        if (strchr("BHILQN", f[0]) != NULL) fkind = KIND_UNSIGNED;
        else if (strchr("bhilqn", f[0]) != NULL) fkind = KIND_SIGNED;
    }
    Py_ssize_t isz = out->view.itemsize;
    if (out->view.ndim != 1 || fkind != kind
        || !(isz == 1 || isz == 2 || isz == 4 || isz == 8) || (width != 0 && isz != width)) {
        char want[32];
        if (width != 0)
            PyOS_snprintf(want, sizeof want, "%s%d", kind == KIND_UNSIGNED ? "uint" : "int",
                          8 * width);
        else
            PyOS_snprintf(want, sizeof want, "uint8/16/32/64");
        PyErr_Format(PyExc_TypeError,
                     "%s must be a 1-D array of %s, not format '%.16s' (%zd bytes, %d dims)",
                     name, want, out->view.format != NULL ? out->view.format : "B", isz,
                     out->view.ndim);
        PyBuffer_Release(&out->view);
        out->held = 0;
        return -1;
    }
    out->width = (int)isz;
    out->len = (int64_t)(out->view.len / isz);
    return 0;
}

/* An unsigned 64-bit integer argument (Python int or numpy integer). */
static int u64_arg(PyObject *obj, void *addr) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "expected an integer in [0, 2**64)");
        return 0;
    }
    *(uint64_t *)addr = (uint64_t)v;
    return 1;
}

static uint64_t width_full(int width) {
    return width == 8 ? UINT64_MAX : (((uint64_t)1 << (8 * width)) - 1);
}

/* ``full`` must be the all-ones value of the element width, ``signbit`` 0 or its top bit. */
static int check_format(int width, uint64_t signbit, uint64_t full) {
    uint64_t want = width_full(width);
    if (full != want) {
        PyErr_Format(PyExc_ValueError, "full must be 2**%d - 1 for %d-byte elements",
                     8 * width, width);
        return -1;
    }
    if (signbit != 0 && signbit != ((uint64_t)1 << (8 * width - 1))) {
        PyErr_Format(PyExc_ValueError, "signbit must be 0 or 2**%d for %d-byte elements",
                     8 * width - 1, width);
        return -1;
    }
    return 0;
}

/* The exponent field selector: shift < bits, emask + 1 <= MAX_NCLASS classes. */
static int check_field(int width, Py_ssize_t shift, Py_ssize_t emask) {
    if (shift < 0 || shift >= 8 * width) {
        PyErr_Format(PyExc_ValueError, "shift %zd outside [0, %d)", shift, 8 * width);
        return -1;
    }
    if (emask < 0 || emask >= MAX_NCLASS) {
        PyErr_Format(PyExc_ValueError, "emask %zd outside [0, %d)", emask, MAX_NCLASS);
        return -1;
    }
    return 0;
}

static int too_short(const char *name, int64_t have, int64_t need) {
    PyErr_Format(PyExc_ValueError, "%s has %lld elements, needs at least %lld", name,
                 (long long)have, (long long)need);
    return -1;
}

/* ------------------------------------------------------------------------------------ */
/* Methods                                                                              */
/* ------------------------------------------------------------------------------------ */

PyDoc_STRVAR(scan_doc,
"scan(old, new, shift, emask, signbit, full, cls_out, rank_out, d_out) -> int\n\n"
"One pass over equal-length unsigned views (1, 2, 4 or 8 bytes): the class of every\n"
"element ((old >> shift) & emask), and for each change its class, its rank within the\n"
"class in this segment, and its key difference, in element order. Returns the number of\n"
"changes, or -1 when more than len(cls_out) changed.");

static PyObject *xg_scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_old, *o_new, *o_cls, *o_rank, *o_d;
    Py_ssize_t shift, emask;
    uint64_t signbit, full;
    if (!PyArg_ParseTuple(args, "OOnnO&O&OOO:scan", &o_old, &o_new, &shift, &emask, u64_arg,
                          &signbit, u64_arg, &full, &o_cls, &o_rank, &o_d))
        return NULL;
    xg_buf b[5];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_old, &b[0], "old", 0, KIND_UNSIGNED, 0) < 0) goto done;
    int w = b[0].width;
    if (get_array(o_new, &b[1], "new", 0, KIND_UNSIGNED, w) < 0
        || get_array(o_cls, &b[2], "cls_out", 1, KIND_UNSIGNED, 2) < 0
        || get_array(o_rank, &b[3], "rank_out", 1, KIND_UNSIGNED, 4) < 0
        || get_array(o_d, &b[4], "d_out", 1, KIND_UNSIGNED, w) < 0
        || check_format(w, signbit, full) < 0 || check_field(w, shift, emask) < 0)
        goto done;
    int64_t n = b[0].len, cap = b[2].len;
    if (b[1].len != n) {
        PyErr_Format(PyExc_ValueError, "old has %lld elements but new has %lld",
                     (long long)n, (long long)b[1].len);
        goto done;
    }
    if (n > (int64_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a segment holds at most 2**32 - 1 elements");
        goto done;
    }
    if (b[3].len < cap) { too_short("rank_out", b[3].len, cap); goto done; }
    if (b[4].len < cap) { too_short("d_out", b[4].len, cap); goto done; }
    int64_t nclass = emask + 1, k = XG_UNSUPPORTED;
    int path = simd_cap;
    uint32_t *counts = NULL; /* the count rows of formats with more than XG_SMALL classes */
    if (nclass > XG_SMALL) {
        counts = calloc((size_t)(4 * nclass), sizeof(uint32_t));
        if (counts == NULL) { PyErr_NoMemory(); goto done; }
    }
    const void *po = b[0].view.buf, *pn = b[1].view.buf;
    uint16_t *pc = b[2].view.buf;
    uint32_t *pr = b[3].view.buf;
    void *pd = b[4].view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (w == 2)
        k = xg_scan16_simd(path, po, pn, n, (unsigned)shift, (unsigned)emask, (uint16_t)signbit,
                           (uint16_t)full, pc, pr, pd, cap);
    if (k == XG_UNSUPPORTED) {
        unsigned s = (unsigned)shift;
        uint64_t em = (uint64_t)emask;
        switch (w) {
        case 1: k = scan_u8(po, pn, n, s, em, signbit, full, counts, nclass, pc, pr, pd, cap);
                break;
        case 2: k = scan_u16(po, pn, n, s, em, signbit, full, counts, nclass, pc, pr, pd, cap);
                break;
        case 4: k = scan_u32(po, pn, n, s, em, signbit, full, counts, nclass, pc, pr, pd, cap);
                break;
        default: k = scan_u64(po, pn, n, s, em, signbit, full, counts, nclass, pc, pr, pd,
                              cap);
                break;
        }
    }
    Py_END_ALLOW_THREADS
    free(counts);
    res = PyLong_FromLongLong(k);
done:
    release_all(b, 5);
    return res;
}

PyDoc_STRVAR(group_encode_doc,
"group_encode(cls, rank, d, k, nclass, ccount, kparam, gaps_out, signs_out, mags_out)\n"
"    -> (gap_bytes, mag_bytes)\n\n"
"Group the first k changes of scan() by class; write the Rice-coded rank gaps (one\n"
"parameter per class: the cheapest of five around log2 of the mean gap), the sign bits\n"
"(every one of the (k + 7) // 8 bytes) and the escaped u8 magnitudes. ccount/kparam\n"
"(int64, nclass long) receive the changes and the Rice parameter per class. Returns the\n"
"gap and magnitude bytes written.");

static PyObject *xg_group_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_cls, *o_rank, *o_d, *o_cc, *o_kp, *o_g, *o_s, *o_m;
    Py_ssize_t k, nclass;
    if (!PyArg_ParseTuple(args, "OOOnnOOOOO:group_encode", &o_cls, &o_rank, &o_d, &k,
                          &nclass, &o_cc, &o_kp, &o_g, &o_s, &o_m))
        return NULL;
    xg_buf b[8];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_cls, &b[0], "cls", 0, KIND_UNSIGNED, 2) < 0
        || get_array(o_rank, &b[1], "rank", 0, KIND_UNSIGNED, 4) < 0
        || get_array(o_d, &b[2], "d", 0, KIND_UNSIGNED, 0) < 0
        || get_array(o_cc, &b[3], "ccount", 1, KIND_SIGNED, 8) < 0
        || get_array(o_kp, &b[4], "kparam", 1, KIND_SIGNED, 8) < 0
        || get_array(o_g, &b[5], "gaps_out", 1, KIND_UNSIGNED, 1) < 0
        || get_array(o_s, &b[6], "signs_out", 1, KIND_UNSIGNED, 1) < 0
        || get_array(o_m, &b[7], "mags_out", 1, KIND_UNSIGNED, 1) < 0)
        goto done;
    int w = b[2].width;
    if (nclass < 1 || nclass > MAX_NCLASS) {
        PyErr_Format(PyExc_ValueError, "nclass %zd outside [1, %d]", nclass, MAX_NCLASS);
        goto done;
    }
    if (k < 0 || k > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "k must lie in [0, 2**32)");
        goto done;
    }
    if (b[0].len < k) { too_short("cls", b[0].len, k); goto done; }
    if (b[1].len < k) { too_short("rank", b[1].len, k); goto done; }
    if (b[2].len < k) { too_short("d", b[2].len, k); goto done; }
    if (b[3].len < nclass) { too_short("ccount", b[3].len, nclass); goto done; }
    if (b[4].len < nclass) { too_short("kparam", b[4].len, nclass); goto done; }
    if (b[5].len < ((int64_t)k * (RICE_QMAX + 32) + 7) / 8) {
        too_short("gaps_out", b[5].len, ((int64_t)k * (RICE_QMAX + 32) + 7) / 8);
        goto done;
    }
    if (b[6].len < ((int64_t)k + 7) / 8) { too_short("signs_out", b[6].len, (k + 7) / 8);
                                           goto done; }
    if (b[7].len < (int64_t)k * (1 + w)) { too_short("mags_out", b[7].len, k * (1 + w));
                                           goto done; }
    const uint16_t *cls = b[0].view.buf;
    const uint32_t *rank = b[1].view.buf;
    int64_t g = 0, m = 0, bad = -1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = group_encode(cls, rank, b[2].view.buf, w, k, nclass, b[3].view.buf, b[4].view.buf,
                      b[5].view.buf, b[5].len, b[6].view.buf, b[7].view.buf, &g, &m);
    if (rc == 1) { /* the first change with a class or rank out of order (scan()'s output
                    * has classes in range and ranks increasing within each class) */
        int64_t *lastr = malloc(sizeof(int64_t) * (size_t)nclass);
        if (lastr == NULL) {
            rc = -1;
        } else {
            for (int64_t e = 0; e < nclass; e++) lastr[e] = -1;
            for (int64_t j = 0; j < k && bad < 0; j++) {
                if (cls[j] >= nclass || (int64_t)rank[j] <= lastr[cls[j]]) bad = j;
                else lastr[cls[j]] = rank[j];
            }
            free(lastr);
        }
    }
    Py_END_ALLOW_THREADS
    if (rc < 0) { PyErr_NoMemory(); goto done; }
    if (rc == 1) {
        PyErr_Format(PyExc_ValueError,
                     "change %lld: class outside [0, nclass) or rank not increasing "
                     "within its class", (long long)bad);
        goto done;
    }
    res = Py_BuildValue("(LL)", (long long)g, (long long)m);
done:
    release_all(b, 8);
    return res;
}

PyDoc_STRVAR(decode_gaps_doc,
"decode_gaps(ccounts, kparams, gaps, gaps_out, limit) -> int\n\n"
"Decode the Rice-coded rank gaps of each class (ccounts/kparams: int64, one per class\n"
"present) into gaps_out (int64). 0 ok, 1 truncated, 2 trailing bytes or bits,\n"
"3 non-canonical escape, 4 rank past the segment (limit elements).");

static PyObject *xg_decode_gaps(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_cc, *o_kp, *o_g, *o_out;
    long long limit;
    if (!PyArg_ParseTuple(args, "OOOOL:decode_gaps", &o_cc, &o_kp, &o_g, &o_out, &limit))
        return NULL;
    xg_buf b[4];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_cc, &b[0], "ccounts", 0, KIND_SIGNED, 8) < 0
        || get_array(o_kp, &b[1], "kparams", 0, KIND_SIGNED, 8) < 0
        || get_array(o_g, &b[2], "gaps", 0, KIND_UNSIGNED, 1) < 0
        || get_array(o_out, &b[3], "gaps_out", 1, KIND_SIGNED, 8) < 0)
        goto done;
    int64_t nc = b[0].len;
    if (b[1].len != nc) {
        PyErr_SetString(PyExc_ValueError, "ccounts and kparams differ in length");
        goto done;
    }
    const int64_t *cc = b[0].view.buf, *kp = b[1].view.buf;
    int64_t total = 0;
    for (int64_t i = 0; i < nc; i++) {
        if (cc[i] < 0 || cc[i] > b[3].len - total) {
            PyErr_Format(PyExc_ValueError, "ccounts must be >= 0 and sum to at most "
                         "len(gaps_out) = %lld", (long long)b[3].len);
            goto done;
        }
        total += cc[i];
        if (kp[i] < 0 || kp[i] > RICE_KMAX) {
            PyErr_Format(PyExc_ValueError, "kparams must lie in [0, %d]", RICE_KMAX);
            goto done;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_gaps(cc, kp, nc, b[2].view.buf, b[2].len, b[3].view.buf, (int64_t)limit);
    Py_END_ALLOW_THREADS
    if (rc < 0) { PyErr_NoMemory(); goto done; }
    res = PyLong_FromLong(rc);
done:
    release_all(b, 4);
    return res;
}

PyDoc_STRVAR(locate_doc,
"locate(old, shift, emask, class_start, class_end, gaps, pos_out) -> int\n\n"
"One pass over the old values (unsigned, 1, 2, 4 or 8 bytes): turn each class's rank\n"
"gaps gaps[class_start[c]:class_end[c]] (int64; class_start/class_end: int64, emask + 1\n"
"long) into element positions pos_out (uint32) in the same slots. Returns 0, or 1 when a\n"
"class runs out of elements before its last change.");

/* Checks locate's class ranges against gaps (b[gi]) and pos_out (b[pi]) and the extra
 * slot-indexed buffer b[di] when di >= 0; 0, or -1 with an exception set. */
static int check_slots(const xg_buf *b, int64_t nclass, int ci, int gi, int pi, int di) {
    if (b[ci].len != nclass || b[ci + 1].len != nclass) {
        PyErr_Format(PyExc_ValueError, "class_start and class_end must hold emask + 1 = %lld "
                     "entries", (long long)nclass);
        return -1;
    }
    if (b[0].len > (int64_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a segment holds at most 2**32 - 1 elements");
        return -1;
    }
    const int64_t *cs = b[ci].view.buf, *ce = b[ci + 1].view.buf;
    int64_t room = b[gi].len < b[pi].len ? b[gi].len : b[pi].len;
    if (di >= 0 && b[di].len < room) room = b[di].len;
    for (int64_t e = 0; e < nclass; e++) {
        if (cs[e] < 0 || cs[e] > ce[e] || ce[e] > room) {
            PyErr_Format(PyExc_ValueError, "class %lld: [class_start, class_end) must lie "
                         "within gaps, pos_out%s", (long long)e, di >= 0 ? " and d" : "");
            return -1;
        }
    }
    return 0;
}

static PyObject *xg_locate(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_old, *o_cs, *o_ce, *o_g, *o_pos;
    Py_ssize_t shift, emask;
    if (!PyArg_ParseTuple(args, "OnnOOOO:locate", &o_old, &shift, &emask, &o_cs, &o_ce, &o_g,
                          &o_pos))
        return NULL;
    xg_buf b[5];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_old, &b[0], "old", 0, KIND_UNSIGNED, 0) < 0
        || get_array(o_cs, &b[1], "class_start", 0, KIND_SIGNED, 8) < 0
        || get_array(o_ce, &b[2], "class_end", 0, KIND_SIGNED, 8) < 0
        || get_array(o_g, &b[3], "gaps", 0, KIND_SIGNED, 8) < 0
        || get_array(o_pos, &b[4], "pos_out", 1, KIND_UNSIGNED, 4) < 0)
        goto done;
    int w = b[0].width;
    if (check_field(w, shift, emask) < 0) goto done;
    int64_t nclass = emask + 1, n = b[0].len;
    if (check_slots(b, nclass, 1, 3, 4, -1) < 0) goto done;
    const int64_t *cs = b[1].view.buf, *ce = b[2].view.buf;
    int rc = XG_UNSUPPORTED, cap = simd_cap;
    Py_BEGIN_ALLOW_THREADS
    if (w == 2) /* reads old only: no diffs, nothing written */
        rc = xg_locate16_simd(cap, (uint16_t *)b[0].view.buf, n, (unsigned)shift,
                              (unsigned)emask, cs, ce, (int)nclass, b[3].view.buf,
                              b[4].view.buf, NULL, 0, 0);
    if (rc == XG_UNSUPPORTED)
        rc = locate(b[0].view.buf, w, n, (unsigned)shift, (uint64_t)emask, cs, ce, nclass,
                    b[3].view.buf, b[4].view.buf);
    Py_END_ALLOW_THREADS
    if (rc < 0) { PyErr_NoMemory(); goto done; }
    res = PyLong_FromLong(rc);
done:
    release_all(b, 5);
    return res;
}

PyDoc_STRVAR(locate_apply_doc,
"locate_apply(arr, shift, emask, signbit, full, class_start, class_end, gaps, d, pos_out)\n"
"    -> int\n\n"
"locate() over arr that also writes each change: arr[pos] = unkey(key(arr[pos]) + d[slot])\n"
"(d: unsigned, the width of arr, slot-indexed like gaps). 2-byte elements on the SIMD\n"
"path write each change as it is placed (its cache line is still close); elsewhere all\n"
"positions are found first. Returns 0, or 1 when a class runs out of elements: then arr is\n"
"as it was (every change written was undone).");

static PyObject *xg_locate_apply(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_arr, *o_cs, *o_ce, *o_g, *o_d, *o_pos;
    Py_ssize_t shift, emask;
    uint64_t signbit, full;
    if (!PyArg_ParseTuple(args, "OnnO&O&OOOOO:locate_apply", &o_arr, &shift, &emask, u64_arg,
                          &signbit, u64_arg, &full, &o_cs, &o_ce, &o_g, &o_d, &o_pos))
        return NULL;
    xg_buf b[6];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_arr, &b[0], "arr", 1, KIND_UNSIGNED, 0) < 0
        || get_array(o_cs, &b[1], "class_start", 0, KIND_SIGNED, 8) < 0
        || get_array(o_ce, &b[2], "class_end", 0, KIND_SIGNED, 8) < 0
        || get_array(o_g, &b[3], "gaps", 0, KIND_SIGNED, 8) < 0
        || get_array(o_pos, &b[4], "pos_out", 1, KIND_UNSIGNED, 4) < 0
        || get_array(o_d, &b[5], "d", 0, KIND_UNSIGNED, b[0].width) < 0)
        goto done;
    int w = b[0].width;
    if (check_field(w, shift, emask) < 0 || check_format(w, signbit, full) < 0) goto done;
    int64_t nclass = emask + 1, n = b[0].len;
    if (check_slots(b, nclass, 1, 3, 4, 5) < 0) goto done;
    const int64_t *cs = b[1].view.buf, *ce = b[2].view.buf;
    uint32_t *pos = b[4].view.buf;
    int rc = XG_UNSUPPORTED, cap = simd_cap;
    Py_BEGIN_ALLOW_THREADS
    if (w == 2)
        rc = xg_locate16_simd(cap, b[0].view.buf, n, (unsigned)shift, (unsigned)emask, cs, ce,
                                    (int)nclass, b[3].view.buf, pos, b[5].view.buf,
                                    (uint16_t)signbit, (uint16_t)full);
    if (rc == XG_UNSUPPORTED) {
        rc = locate(b[0].view.buf, w, n, (unsigned)shift, (uint64_t)emask, cs, ce, nclass,
                    b[3].view.buf, pos);
        for (int64_t e = 0; rc == 0 && e < nclass; e++)
            apply_diffs(b[0].view.buf, w, pos + cs[e],
                        (const uint8_t *)b[5].view.buf + (size_t)cs[e] * (size_t)w,
                        ce[e] - cs[e], signbit, full, 0);
    }
    Py_END_ALLOW_THREADS
    if (rc < 0) { PyErr_NoMemory(); goto done; }
    res = PyLong_FromLong(rc);
done:
    release_all(b, 6);
    return res;
}

PyDoc_STRVAR(decode_values_doc,
"decode_values(signs, mags, k, d_out) -> int\n\n"
"Sign bits + escaped u8 magnitudes -> the first k key differences in d_out (unsigned;\n"
"its item size is the element width). 0 ok, 1 truncated, 2 trailing bytes,\n"
"3 non-canonical or out-of-range value.");

static PyObject *xg_decode_values(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_s, *o_m, *o_d;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOnO:decode_values", &o_s, &o_m, &k, &o_d)) return NULL;
    xg_buf b[3];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_s, &b[0], "signs", 0, KIND_UNSIGNED, 1) < 0
        || get_array(o_m, &b[1], "mags", 0, KIND_UNSIGNED, 1) < 0
        || get_array(o_d, &b[2], "d_out", 1, KIND_UNSIGNED, 0) < 0)
        goto done;
    if (k < 0) { PyErr_SetString(PyExc_ValueError, "k must be >= 0"); goto done; }
    if (b[0].len < ((int64_t)k + 7) / 8) { too_short("signs", b[0].len, (k + 7) / 8);
                                           goto done; }
    if (b[2].len < k) { too_short("d_out", b[2].len, k); goto done; }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode_values(b[0].view.buf, b[1].view.buf, b[1].len, k, b[2].width, b[2].view.buf);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(rc);
done:
    release_all(b, 3);
    return res;
}

PyDoc_STRVAR(apply_diffs_doc,
"apply_diffs(arr, pos, d, signbit, full, negate) -> None\n\n"
"arr[pos] = unkey(key(arr[pos]) + d) in place (minus d when negate): arr and d are\n"
"unsigned of one width, pos uint32 (every position < len(arr)), len(pos) == len(d).");

static PyObject *xg_apply_diffs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_a, *o_p, *o_d;
    uint64_t signbit, full;
    int negate;
    if (!PyArg_ParseTuple(args, "OOOO&O&p:apply_diffs", &o_a, &o_p, &o_d, u64_arg, &signbit,
                          u64_arg, &full, &negate))
        return NULL;
    xg_buf b[3];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_a, &b[0], "arr", 1, KIND_UNSIGNED, 0) < 0
        || get_array(o_p, &b[1], "pos", 0, KIND_UNSIGNED, 4) < 0
        || get_array(o_d, &b[2], "d", 0, KIND_UNSIGNED, b[0].width) < 0
        || check_format(b[0].width, signbit, full) < 0)
        goto done;
    int64_t k = b[1].len, n = b[0].len;
    if (b[2].len != k) {
        PyErr_Format(PyExc_ValueError, "pos has %lld entries but d has %lld", (long long)k,
                     (long long)b[2].len);
        goto done;
    }
    const uint32_t *pos = b[1].view.buf;
    uint32_t top = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < k; j++) top = pos[j] > top ? pos[j] : top;
    if (k == 0 || (int64_t)top < n)  /* every position checked before any write */
        apply_diffs(b[0].view.buf, b[0].width, pos, b[2].view.buf, k, signbit, full, negate);
    Py_END_ALLOW_THREADS
    if (k > 0 && (int64_t)top >= n) {
        PyErr_Format(PyExc_ValueError, "position %lu is outside arr (%lld elements)",
                     (unsigned long)top, (long long)n);
        goto done;
    }
    res = Py_NewRef(Py_None);
done:
    release_all(b, 3);
    return res;
}

PyDoc_STRVAR(class_table_doc,
"class_table(classes, changes, ccounts, kparams, class_start, class_end) -> int\n\n"
"Parse a segment's class table (u16 ids || u32 counts || u8 Rice parameters,\n"
"little-endian; len(classes) a multiple of 7) into ccounts/kparams (int64, one per class\n"
"present) and class_start/class_end (int64, one per class id: nclass long). 0 ok, 1 ids\n"
"not ascending or not below nclass, a zero count, a parameter above RICE_KMAX, or counts\n"
"not summing to changes.");

static PyObject *xg_class_table(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_t, *o_cc, *o_kp, *o_cs, *o_ce;
    long long changes;
    if (!PyArg_ParseTuple(args, "OLOOOO:class_table", &o_t, &changes, &o_cc, &o_kp, &o_cs,
                          &o_ce))
        return NULL;
    xg_buf b[5];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_t, &b[0], "classes", 0, KIND_UNSIGNED, 1) < 0
        || get_array(o_cc, &b[1], "ccounts", 1, KIND_SIGNED, 8) < 0
        || get_array(o_kp, &b[2], "kparams", 1, KIND_SIGNED, 8) < 0
        || get_array(o_cs, &b[3], "class_start", 1, KIND_SIGNED, 8) < 0
        || get_array(o_ce, &b[4], "class_end", 1, KIND_SIGNED, 8) < 0)
        goto done;
    if (b[0].len % 7 != 0) {
        PyErr_Format(PyExc_ValueError, "classes has %lld bytes, not a multiple of 7",
                     (long long)b[0].len);
        goto done;
    }
    int64_t nc = b[0].len / 7, nclass = b[3].len;
    if (b[1].len < nc) { too_short("ccounts", b[1].len, nc); goto done; }
    if (b[2].len < nc) { too_short("kparams", b[2].len, nc); goto done; }
    if (nclass < 1 || nclass > MAX_NCLASS || b[4].len != nclass) {
        PyErr_Format(PyExc_ValueError, "class_start and class_end must hold the same number "
                     "of classes, 1 to %d", MAX_NCLASS);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = class_table(b[0].view.buf, nc, nclass, (int64_t)changes, b[1].view.buf,
                     b[2].view.buf, b[3].view.buf, b[4].view.buf);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLong(rc);
done:
    release_all(b, 5);
    return res;
}

PyDoc_STRVAR(read_pair_doc,
"read_pair(a, b) -> int\n\n"
"Read two equal-sized unsigned arrays once, 8 bytes at a time, as fast as this CPU reads\n"
"memory (the last len % 8 bytes are not read), and return a fold of them: the\n"
"benchmark's floor for extraction, which must read old and new.");

static PyObject *xg_read_pair_py(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_a, *o_b;
    if (!PyArg_ParseTuple(args, "OO:read_pair", &o_a, &o_b)) return NULL;
    xg_buf b[2];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (get_array(o_a, &b[0], "a", 0, KIND_UNSIGNED, 0) < 0
        || get_array(o_b, &b[1], "b", 0, KIND_UNSIGNED, 0) < 0)
        goto done;
    if (b[0].view.len != b[1].view.len) {
        PyErr_Format(PyExc_ValueError, "a has %zd bytes but b has %zd", b[0].view.len,
                     b[1].view.len);
        goto done;
    }
    uint64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = xg_read_pair(b[0].view.buf, b[1].view.buf, (int64_t)(b[0].view.len / 8));
    Py_END_ALLOW_THREADS
    res = PyLong_FromUnsignedLongLong(r);
done:
    release_all(b, 2);
    return res;
}

PyDoc_STRVAR(b3_node_cv_doc,
"b3_node_cv(data, first_chunk) -> bytes\n\n"
"The 32-byte non-root BLAKE3 chaining value of the tree node over the bytes of ``data``\n"
"(at least 1; 1024-byte chunks, the last possibly shorter) whose first chunk has index\n"
"``first_chunk``: a multiple of the node's span (its chunk count rounded up to a power of\n"
"two), as for every node of a BLAKE3 tree. Full chunks are hashed 16, 8 or 4 at a time on\n"
"the avx512, avx2 and scalar paths (see set_simd).");

static PyObject *xg_b3_node_cv_py(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    uint64_t first;
    if (!PyArg_ParseTuple(args, "y*O&:b3_node_cv", &data, u64_arg, &first)) return NULL;
    PyObject *res = NULL;
    uint64_t chunks = ((uint64_t)data.len + XG_B3_CHUNK - 1) / XG_B3_CHUNK, span = 1;
    while (span < chunks) span *= 2;
    if (data.len == 0) {
        PyErr_SetString(PyExc_ValueError, "b3_node_cv: data is empty");
    } else if (first % span != 0) {
        PyErr_Format(PyExc_ValueError,
                     "b3_node_cv: a node of %llu chunks starts at a multiple of %llu, not at "
                     "chunk %llu", (unsigned long long)chunks, (unsigned long long)span,
                     (unsigned long long)first);
    } else {
        uint8_t out[32];
        const int path = xg_simd_path(simd_cap);
        Py_BEGIN_ALLOW_THREADS
        xg_b3_node_cv(path, data.buf, (size_t)data.len, first, out);
        Py_END_ALLOW_THREADS
        res = PyBytes_FromStringAndSize((const char *)out, 32);
    }
    PyBuffer_Release(&data);
    return res;
}

PyDoc_STRVAR(b3_parent_doc,
"b3_parent(left, right, root) -> bytes\n\n"
"The BLAKE3 chaining value of the parent of two 32-byte child chaining values, or with\n"
"``root`` the 32-byte root hash.");

static PyObject *xg_b3_parent_py(PyObject *self, PyObject *args) {
    (void)self;
    const char *l, *r;
    Py_ssize_t nl, nr;
    int root;
    if (!PyArg_ParseTuple(args, "y#y#p:b3_parent", &l, &nl, &r, &nr, &root)) return NULL;
    if (nl != 32 || nr != 32) {
        PyErr_Format(PyExc_ValueError, "b3_parent: chaining values are 32 bytes, not %zd and "
                     "%zd", nl, nr);
        return NULL;
    }
    uint8_t out[32];
    xg_b3_parent((const uint8_t *)l, (const uint8_t *)r, root, out);
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static const char *const PATH_NAMES[] = {"scalar", "avx2", "avx512"};

PyDoc_STRVAR(simd_doc,
"simd() -> str\n\n"
"The path the 2-byte kernels and b3_node_cv take on this CPU: \"avx512\", \"avx2\" or\n"
"\"scalar\".");

static PyObject *xg_simd(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    return PyUnicode_FromString(PATH_NAMES[xg_simd_path(simd_cap)]);
}

PyDoc_STRVAR(simd_paths_doc,
"simd_paths() -> list[str]\n\n"
"Every path the 2-byte kernels can take on this CPU, fastest first.");

static PyObject *xg_simd_paths(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    PyObject *res = PyList_New(0);
    for (int p = xg_simd_path(XG_AVX512); res != NULL && p >= XG_SCALAR; p--) {
        PyObject *name = PyUnicode_FromString(PATH_NAMES[p]);
        if (name == NULL || PyList_Append(res, name) < 0) Py_CLEAR(res);
        Py_XDECREF(name);
    }
    return res;
}

PyDoc_STRVAR(set_simd_doc,
"set_simd(path) -> None\n\n"
"The fastest path the 2-byte kernels and b3_node_cv may take: \"avx512\" (the default: the\n"
"best this CPU runs), \"avx2\" or \"scalar\" (process-wide; for tests and benchmarks of\n"
"slower paths).");

static PyObject *xg_set_simd(PyObject *self, PyObject *arg) {
    (void)self;
    for (int p = XG_SCALAR; p <= XG_AVX512; p++) {
        if (PyUnicode_Check(arg) && PyUnicode_CompareWithASCIIString(arg, PATH_NAMES[p]) == 0) {
            simd_cap = p;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "set_simd: path must be \"avx512\", \"avx2\" or "
                 "\"scalar\", not %R", arg);
    return NULL;
}

PyDoc_STRVAR(set_slow_pdep_doc,
"set_slow_pdep(slow) -> bool\n\n"
"Whether the AVX2 locate avoids pdep, as it does on Zen 1/2 where pdep is microcode (set\n"
"at import from the CPU; process-wide; for tests of either branch). Returns the previous\n"
"setting.");

static PyObject *xg_set_slow_pdep_py(PyObject *self, PyObject *arg) {
    (void)self;
    int v = PyObject_IsTrue(arg);
    if (v < 0) return NULL;
    return PyBool_FromLong(xg_set_slow_pdep(v));
}

static PyMethodDef xg_methods[] = {
    {"scan", xg_scan, METH_VARARGS, scan_doc},
    {"group_encode", xg_group_encode, METH_VARARGS, group_encode_doc},
    {"class_table", xg_class_table, METH_VARARGS, class_table_doc},
    {"decode_gaps", xg_decode_gaps, METH_VARARGS, decode_gaps_doc},
    {"locate", xg_locate, METH_VARARGS, locate_doc},
    {"locate_apply", xg_locate_apply, METH_VARARGS, locate_apply_doc},
    {"decode_values", xg_decode_values, METH_VARARGS, decode_values_doc},
    {"apply_diffs", xg_apply_diffs, METH_VARARGS, apply_diffs_doc},
    {"read_pair", xg_read_pair_py, METH_VARARGS, read_pair_doc},
    {"b3_node_cv", xg_b3_node_cv_py, METH_VARARGS, b3_node_cv_doc},
    {"b3_parent", xg_b3_parent_py, METH_VARARGS, b3_parent_doc},
    {"simd", xg_simd, METH_NOARGS, simd_doc},
    {"simd_paths", xg_simd_paths, METH_NOARGS, simd_paths_doc},
    {"set_simd", xg_set_simd, METH_O, set_simd_doc},
    {"set_slow_pdep", xg_set_slow_pdep_py, METH_O, set_slow_pdep_doc},
    {NULL, NULL, 0, NULL},
};

static int xg_exec(PyObject *m) {
    xg_simd_init();
    if (PyModule_AddIntConstant(m, "ESCAPE", ESCAPE) < 0
        || PyModule_AddIntConstant(m, "RICE_KMAX", RICE_KMAX) < 0
        || PyModule_AddIntConstant(m, "RICE_QMAX", RICE_QMAX) < 0
        || PyModule_AddIntConstant(m, "MAX_NCLASS", MAX_NCLASS) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot xg_slots[] = {
    {Py_mod_exec, (void *)xg_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
"Fused single-pass kernels of the swarm-xg1 delta codec (see swarm/delta/codec.py).\n\n"
"Buffers are 1-D C-contiguous numpy arrays of the integer types each function names;\n"
"misuse raises TypeError/ValueError, malformed stream data returns an error code.\n"
"The GIL is released while a kernel runs. b3_node_cv and b3_parent hash BLAKE3 tree nodes\n"
"(swarm/content/piecetree.py).");

static struct PyModuleDef xg_module = {
    PyModuleDef_HEAD_INIT, "_xg", module_doc, 0, xg_methods, xg_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__xg(void) { return PyModuleDef_Init(&xg_module); }
