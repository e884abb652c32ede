/* AVX-512 fast paths of the swarm-xg1 kernels for 2-byte elements (bf16, fp16).
 *
 * Both kernels need the rank of elements within their class (the exponent field of the
 * old value) in the segment, so every element's class is counted. Counting element by
 * element costs about 2 cycles an element (a load-increment-store per element). Here 64
 * elements go at a time: the classes of a *window* of WIN consecutive class ids, chosen
 * per segment from a sample (for trained weights nearly every element), are counted in
 * byte lanes, one compare and one masked add per class and 64 elements, and summed once
 * per superblock of SB_VECS vectors. Changed elements (encoder), targets (decoder) and
 * elements outside the window ("outliers", counted in a table) are then visited one by
 * one, in element order within each class, which is all the format needs.
 *
 * The window is a speed choice only: results are identical to the scalar kernels for
 * every input (tests compare them), and a segment whose classes spread wider just has
 * more outliers.
 */
#include <stdint.h>
#include <string.h>

#include "_xg.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define XG_X86 1
#include <immintrin.h>
#endif

#define WIN 16
#define SB_VECS 8
#define SB_ELEMS (64 * SB_VECS)
#define MAX_CLASSES 256 /* 2-byte formats have emask <= 0xFF */
#define SAMPLES 4096

int xg_simd_available(void) {
#ifdef XG_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    }
    return cached;
#else
    return 0;
#endif
}

#ifdef XG_X86

/* The first class id of the window holding the most elements of a strided sample. */
static unsigned choose_base(const uint16_t *old, int64_t n, unsigned shift, unsigned emask) {
    uint32_t hist[MAX_CLASSES] = {0};
    int64_t step = n / SAMPLES > 1 ? n / SAMPLES : 1;
    for (int64_t i = 0; i < n; i += step) hist[(old[i] >> shift) & emask]++;
    unsigned nclass = emask + 1;
    if (nclass <= WIN) return 0;
    uint32_t sum = 0;
    for (unsigned c = 0; c < WIN; c++) sum += hist[c];
    uint32_t best = sum;
    unsigned base = 0;
    for (unsigned b = 1; b + WIN <= nclass; b++) {
        sum += hist[b + WIN - 1] - hist[b - 1];
        if (sum > best) {
            best = sum;
            base = b;
        }
    }
    return base;
}

#define XG_TARGET __attribute__((target("avx512f,avx512bw,bmi2,popcnt")))

/* One superblock of SB_ELEMS elements: class bytes to ``cls``, outlier masks to ``out``,
 * change masks to ``chg`` (when ``nw`` is not NULL) and per-window-class counts to
 * ``cnt``. */
XG_TARGET static inline __attribute__((always_inline)) void
superblock(const uint16_t *o, const uint16_t *nw, __m128i shiftv, __m512i emaskv,
           __m512i basev, uint8_t *cls, uint64_t *chg, uint64_t *out, uint32_t *cnt) {
    __m512i acc[WIN];
    for (int w = 0; w < WIN; w++) acc[w] = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i win = _mm512_set1_epi8(WIN);
    for (int v = 0; v < SB_VECS; v++) {
        __m512i a = _mm512_loadu_si512(o + 64 * v);
        __m512i b = _mm512_loadu_si512(o + 64 * v + 32);
        if (nw != NULL) {
            uint64_t lo = _mm512_cmpneq_epi16_mask(a, _mm512_loadu_si512(nw + 64 * v));
            uint64_t hi = _mm512_cmpneq_epi16_mask(b, _mm512_loadu_si512(nw + 64 * v + 32));
            chg[v] = lo | (hi << 32);
        }
        a = _mm512_and_si512(_mm512_srl_epi16(a, shiftv), emaskv);
        b = _mm512_and_si512(_mm512_srl_epi16(b, shiftv), emaskv);
        __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                                       _mm512_cvtepi16_epi8(b), 1);
        _mm512_store_si512((void *)(cls + 64 * v), c);
        __m512i r = _mm512_sub_epi8(c, basev);
        out[v] = ~(uint64_t)_mm512_cmplt_epu8_mask(r, win);
#pragma GCC unroll 16
        for (int w = 0; w < WIN; w++)
            acc[w] = _mm512_mask_add_epi8(acc[w], _mm512_cmpeq_epi8_mask(r, _mm512_set1_epi8((char)w)),
                                          acc[w], one);
    }
    /* per class: byte sums in 8 u64 lanes (each <= 8 * SB_VECS); four classes share a
     * vector in 16-bit fields, then one horizontal sum per four classes */
    const __m512i z = _mm512_setzero_si512();
    for (int q = 0; q < WIN; q += 4) {
        __m512i t = _mm512_sad_epu8(acc[q], z);
        t = _mm512_or_si512(t, _mm512_slli_epi64(_mm512_sad_epu8(acc[q + 1], z), 16));
        t = _mm512_or_si512(t, _mm512_slli_epi64(_mm512_sad_epu8(acc[q + 2], z), 32));
        t = _mm512_or_si512(t, _mm512_slli_epi64(_mm512_sad_epu8(acc[q + 3], z), 48));
        uint64_t s = (uint64_t)_mm512_reduce_add_epi64(t);
        cnt[q] = (uint32_t)(s & 0xFFFF);
        cnt[q + 1] = (uint32_t)((s >> 16) & 0xFFFF);
        cnt[q + 2] = (uint32_t)((s >> 32) & 0xFFFF);
        cnt[q + 3] = (uint32_t)(s >> 48);
    }
}

/* Elements of class ``c`` among the 64 class bytes at ``cls``. */
XG_TARGET static inline __attribute__((always_inline)) uint64_t class_mask(const uint8_t *cls,
                                                                           unsigned c) {
    return _mm512_cmpeq_epi8_mask(_mm512_load_si512((const void *)cls),
                                  _mm512_set1_epi8((char)c));
}

XG_TARGET static int64_t scan16(const uint16_t *old, const uint16_t *nw, int64_t n,
                                unsigned shift, unsigned emask, uint16_t signbit, uint16_t full,
                                uint16_t *cls_out, uint32_t *rank_out, uint16_t *diff,
                                int64_t cap) {
    const unsigned base = choose_base(old, n, shift, emask);
    const __m128i shiftv = _mm_cvtsi32_si128((int)shift);
    const __m512i emaskv = _mm512_set1_epi16((short)emask);
    const __m512i basev = _mm512_set1_epi8((char)base);
    uint8_t cls[SB_ELEMS] __attribute__((aligned(64)));
    uint64_t chg[SB_VECS], out[SB_VECS];
    uint32_t cnt[WIN], run[WIN] = {0}, counts[MAX_CLASSES] = {0};
    int64_t k = 0;
    const int64_t nv = n - n % SB_ELEMS;
    for (int64_t s = 0; s < nv; s += SB_ELEMS) {
        superblock(old + s, nw + s, shiftv, emaskv, basev, cls, chg, out, cnt);
        uint32_t insb[WIN] = {0};
        int lastv[WIN] = {0};
        for (int v = 0; v < SB_VECS; v++) {
            uint64_t todo = chg[v] | out[v];
            while (todo) {
                const int j = (int)__builtin_ctzll(todo);
                const uint64_t bit = 1ULL << j;
                todo &= todo - 1;
                const unsigned c = cls[64 * v + j];
                uint32_t r;
                if (out[v] & bit) {
                    r = counts[c]++;
                    if (!(chg[v] & bit)) continue;
                } else {
                    const unsigned w = c - base;
                    for (; lastv[w] < v; lastv[w]++)
                        insb[w] += (uint32_t)_mm_popcnt_u64(class_mask(cls + 64 * lastv[w], c));
                    r = run[w] + insb[w] +
                        (uint32_t)_mm_popcnt_u64(class_mask(cls + 64 * v, c) & (bit - 1));
                }
                if (k == cap) return -1;
                const int64_t i = s + 64 * v + j;
                cls_out[k] = (uint16_t)c;
                rank_out[k] = r;
                diff[k] = (uint16_t)((xg_key(nw[i], signbit, full) - xg_key(old[i], signbit, full)) & full);
                k++;
            }
        }
        for (int w = 0; w < WIN; w++) run[w] += cnt[w];
    }
    for (int w = 0; w < WIN && base + w <= emask; w++) counts[base + w] = run[w];
    for (int64_t i = nv; i < n; i++) {
        const unsigned c = (old[i] >> shift) & emask;
        if (old[i] != nw[i]) {
            if (k == cap) return -1;
            cls_out[k] = (uint16_t)c;
            rank_out[k] = counts[c];
            diff[k] = (uint16_t)((xg_key(nw[i], signbit, full) - xg_key(old[i], signbit, full)) & full);
            k++;
        }
        counts[c]++;
    }
    return k;
}

#define DONE INT64_MAX
#define NEVER (INT64_MAX / 2) /* slack of a class without targets left */

/* The decoder counts each vector's window classes directly (compare + popcount per class)
 * against a per-class *slack*: how many more elements of the class to pass before its
 * next target. A vector holding a target is rare per class, and the target is then picked
 * out of the class's 64-bit mask with pdep. */
XG_TARGET static int locate16(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                              const int64_t *class_start, const int64_t *class_end,
                              const int64_t *gaps, uint32_t *pos) {
    const unsigned nclass = emask + 1;
    int64_t ptr[MAX_CLASSES], tgt[MAX_CLASSES], counts[MAX_CLASSES] = {0};
    for (unsigned c = 0; c < nclass; c++) {
        if (class_start[c] < 0 || class_end[c] < class_start[c]) return 1;
        for (int64_t p = class_start[c]; p < class_end[c]; p++)
            if (gaps[p] < 0) return 1;
        ptr[c] = class_start[c];
        tgt[c] = ptr[c] < class_end[c] ? gaps[ptr[c]] : DONE;
    }
    const unsigned base = choose_base(old, n, shift, emask);
    int64_t slack[WIN];
    for (int w = 0; w < WIN; w++)
        slack[w] = base + w < nclass && tgt[base + w] != DONE ? tgt[base + w] : NEVER;
    const __m128i shiftv = _mm_cvtsi32_si128((int)shift);
    const __m512i emaskv = _mm512_set1_epi16((short)emask);
    const __m512i basev = _mm512_set1_epi8((char)base);
    const __m512i winv = _mm512_set1_epi8(WIN);
    const int64_t nv = n - n % 64;
    for (int64_t s = 0; s < nv; s += 64) {
        __m512i a = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(old + s), shiftv), emaskv);
        __m512i b = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(old + s + 32), shiftv), emaskv);
        __m512i c8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                                        _mm512_cvtepi16_epi8(b), 1);
        __m512i r = _mm512_sub_epi8(c8, basev);
#pragma GCC unroll 16
        for (int w = 0; w < WIN; w++) {
            const uint64_t m = _mm512_cmpeq_epi8_mask(r, _mm512_set1_epi8((char)w));
            const int64_t cnt = (int64_t)_mm_popcnt_u64(m);
            int64_t sl = slack[w] - cnt;
            if (__builtin_expect(sl < 0, 0)) {
                const unsigned c = base + (unsigned)w;
                do {
                    pos[ptr[c]] = (uint32_t)(s + __builtin_ctzll(_pdep_u64(1ULL << (sl + cnt), m)));
                    if (++ptr[c] == class_end[c]) {
                        sl = NEVER;
                        break;
                    }
                    sl += gaps[ptr[c]] + 1;
                } while (sl < 0);
            }
            slack[w] = sl;
        }
        uint64_t out = ~(uint64_t)_mm512_cmplt_epu8_mask(r, winv);
        if (__builtin_expect(out != 0, 0)) {
            uint8_t cls[64] __attribute__((aligned(64)));
            _mm512_store_si512((void *)cls, c8);
            for (; out; out &= out - 1) {
                const int j = __builtin_ctzll(out);
                const unsigned c = cls[j];
                if (counts[c]++ == tgt[c]) {
                    pos[ptr[c]] = (uint32_t)(s + j);
                    tgt[c] = ++ptr[c] < class_end[c] ? tgt[c] + gaps[ptr[c]] + 1 : DONE;
                }
            }
        }
    }
    for (int64_t i = nv; i < n; i++) {
        const unsigned c = (old[i] >> shift) & emask;
        const unsigned w = c - base;
        if (w < WIN) {
            if (slack[w]-- == 0) {
                pos[ptr[c]] = (uint32_t)i;
                slack[w] = ++ptr[c] < class_end[c] ? gaps[ptr[c]] : NEVER;
            }
        } else if (counts[c]++ == tgt[c]) {
            pos[ptr[c]] = (uint32_t)i;
            tgt[c] = ++ptr[c] < class_end[c] ? tgt[c] + gaps[ptr[c]] + 1 : DONE;
        }
    }
    for (unsigned c = 0; c < nclass; c++)
        if (ptr[c] != class_end[c]) return 1;
    return 0;
}

#endif /* XG_X86 */

int64_t xg_scan16_simd(const uint16_t *old, const uint16_t *new_, int64_t n, unsigned shift,
                       unsigned emask, uint16_t signbit, uint16_t full, uint16_t *cls,
                       uint32_t *rank, uint16_t *diff, int64_t cap) {
#ifdef XG_X86
    if (emask < MAX_CLASSES && shift < 16 && xg_simd_available())
        return scan16(old, new_, n, shift, emask, signbit, full, cls, rank, diff, cap);
#endif
    (void)old; (void)new_; (void)n; (void)shift; (void)emask; (void)signbit; (void)full;
    (void)cls; (void)rank; (void)diff; (void)cap;
    return XG_UNSUPPORTED;
}

int xg_locate16_simd(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos) {
#ifdef XG_X86
    if (emask < MAX_CLASSES && shift < 16 && nclass == (int)emask + 1 && xg_simd_available())
        return locate16(old, n, shift, emask, class_start, class_end, gaps, pos);
#endif
    (void)old; (void)n; (void)shift; (void)emask; (void)class_start; (void)class_end;
    (void)nclass; (void)gaps; (void)pos;
    return XG_UNSUPPORTED;
}
