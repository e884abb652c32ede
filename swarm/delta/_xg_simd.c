/* AVX-512 fast paths of the swarm-xg1 kernels for 2-byte elements (bf16, fp16).
 *
 * Both kernels need the rank of elements within their class (the exponent field of the
 * old value) in the segment, so every element's class is counted. Counting element by
 * element costs about 2 cycles an element (a load-increment-store per element). Here 64
 * elements go at a time: classes are extracted and packed to bytes (vpermt2b); those in a
 * *window* of WIN consecutive class ids, chosen per segment from a sample (for trained
 * weights nearly every element), become a one-hot byte per window half; gf2p8affine
 * transposes each group of 8 one-hot bytes so that byte popcounts count 8 elements of 8
 * classes at once, and a short tree sums the groups. Changed elements (encoder), targets
 * (decoder) and elements outside the window ("outliers", counted in a table) are then
 * visited one by one: a rank is the running count of its class plus a masked popcount, a
 * target is picked out of its class's mask with pdep.
 *
 * The window is a speed choice only: results are identical to the scalar kernels for
 * every input (tests compare them), and a segment whose classes spread wider just has
 * more outliers. Needs AVX-512 F/BW/VBMI/BITALG, GFNI and BMI1/2 (Ice Lake, Zen 4 and
 * later); elsewhere the scalar kernels run.
 */
#include <stdint.h>
#include <string.h>

#include "_xg.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define XG_X86 1
#include <immintrin.h>
#endif

#define WIN 16
#define MAX_CLASSES 256 /* 2-byte formats have emask <= 0xFF */
/* The window is chosen from SAMPLE_RUNS runs of SAMPLE_RUN consecutive elements spread
 * over the segment: 128 cache lines, where 4096 strided samples touched 4096 lines and cost
 * about 50 us a segment in DRAM misses (8 ms a version of 250M parameters). */
#define SAMPLE_RUNS 64
#define SAMPLE_RUN 64
/* Counts and ranks live in 32-bit lanes, and NEVER (2**30) must exceed every count. */
#define SIMD_MAX_ELEMS ((int64_t)1 << 29)
/* Software prefetch distance (elements): the hardware streamer stops at 4 KiB pages, and
 * a stalled load is not overlapped with the counting; 8 KiB ahead measured best here. */
#define AHEAD 4096

int xg_simd_available(void) {
#ifdef XG_X86
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bitalg") &&
                 __builtin_cpu_supports("gfni") && __builtin_cpu_supports("bmi") &&
                 __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    }
    return cached;
#else
    return 0;
#endif
}

#ifdef XG_X86

/* The first class id of the window holding the most elements of a sample (every element
 * of a short segment). */
static unsigned choose_base(const uint16_t *old, int64_t n, unsigned shift, unsigned emask) {
    uint32_t hist[MAX_CLASSES] = {0};
    if (n <= SAMPLE_RUNS * SAMPLE_RUN) {
        for (int64_t i = 0; i < n; i++) hist[(old[i] >> shift) & emask]++;
    } else {
        const int64_t step = n / SAMPLE_RUNS;
        for (int64_t r = 0; r < SAMPLE_RUNS; r++)
            for (int64_t i = r * step; i < r * step + SAMPLE_RUN; i++)
                hist[(old[i] >> shift) & emask]++;
    }
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

#define XG_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bitalg,gfni,bmi,bmi2,popcnt")))

typedef struct {
    __m128i shift;
    __m512i emask, base, win, lut_lo, lut_hi, bits, pack, gather;
} consts_t;

XG_TARGET static inline __attribute__((always_inline)) consts_t make_consts(unsigned shift,
                                                                            unsigned emask,
                                                                            unsigned base) {
    consts_t k;
    k.shift = _mm_cvtsi32_si128((int)shift);
    k.emask = _mm512_set1_epi16((short)emask);
    k.base = _mm512_set1_epi8((char)base);
    k.win = _mm512_set1_epi8(WIN);
    /* one-hot bytes of window classes 0..7 and 8..15 (vpshufb reads the low 4 bits) */
    k.lut_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0,
                                                    0, 0, 0, 0));
    k.lut_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 8, 16, 32,
                                                    64, -128));
    k.bits = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    uint8_t idx[64];
    for (int i = 0; i < 64; i++) idx[i] = (uint8_t)(2 * i); /* low byte of each 16-bit lane */
    k.pack = _mm512_loadu_si512(idx);
    for (int i = 0; i < 64; i++) idx[i] = (uint8_t)(i < 8 ? i : i < 16 ? 24 + i : 0);
    k.gather = _mm512_loadu_si512(idx); /* bytes 0..7 and 32..39 */
    return k;
}

/* One vector of 64 elements. */
typedef struct {
    __m512i cls;    /* class (exponent field) byte of each element */
    uint64_t inwin; /* elements whose class is in the window */
    __m512i cnt;    /* count of each window class (16 x i32) */
} vec_t;

/* Classes of 64 elements and the count of each of the 16 window classes: a one-hot byte
 * per element and window half is transposed per 8 elements (gf2p8affine), so popcounts
 * give 8 elements' counts of 8 classes at once; a short tree sums the 8 groups. */
XG_TARGET static inline __attribute__((always_inline)) vec_t count_vector(const uint16_t *o,
                                                                         const consts_t *k) {
    vec_t x;
    __m512i a = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(o), k->shift), k->emask);
    __m512i b = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(o + 32), k->shift), k->emask);
    x.cls = _mm512_permutex2var_epi8(a, k->pack, b);
    const __m512i r = _mm512_sub_epi8(x.cls, k->base);
    x.inwin = _mm512_cmplt_epu8_mask(r, k->win);
    __m512i lo = _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(
        k->bits, _mm512_maskz_shuffle_epi8(x.inwin, k->lut_lo, r), 0));
    __m512i hi = _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(
        k->bits, _mm512_maskz_shuffle_epi8(x.inwin, k->lut_hi, r), 0));
    /* byte w of qword j: elements 8j..8j+7 of class w (lo) or 8 + w (hi); sum over j:
     * lo's qwords into the low half, hi's into the high half, then within halves */
    lo = _mm512_add_epi8(lo, _mm512_shuffle_i64x2(lo, lo, _MM_SHUFFLE(1, 0, 3, 2)));
    hi = _mm512_add_epi8(hi, _mm512_shuffle_i64x2(hi, hi, _MM_SHUFFLE(1, 0, 3, 2)));
    __m512i t = _mm512_mask_blend_epi64(0xF0, lo, hi);
    t = _mm512_add_epi8(t, _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    t = _mm512_add_epi8(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
    x.cnt = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi8(k->gather, t)));
    return x;
}

/* Lane ``w`` of 16 x i32 (without a store: a vector store read back by a scalar load may
 * wait for the store to retire). */
XG_TARGET static inline __attribute__((always_inline)) int32_t lane(__m512i v, int w) {
    return _mm_cvtsi128_si32(_mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set1_epi32(w), v)));
}

XG_TARGET static inline __attribute__((always_inline)) uint64_t class_mask(__m512i cls,
                                                                           unsigned c) {
    return _mm512_cmpeq_epi8_mask(cls, _mm512_set1_epi8((char)c));
}

XG_TARGET static int64_t scan16(const uint16_t *old, const uint16_t *nw, int64_t n,
                                unsigned shift, unsigned emask, uint16_t signbit, uint16_t full,
                                uint16_t *cls_out, uint32_t *rank_out, uint16_t *diff,
                                int64_t cap) {
    const unsigned base = choose_base(old, n, shift, emask);
    const consts_t k = make_consts(shift, emask, base);
    __m512i run = _mm512_setzero_si512();
    uint32_t counts[MAX_CLASSES] = {0}, runs[WIN];
    uint8_t cls[64];
    int64_t nch = 0;
    const int64_t nv = n - n % 64;
    for (int64_t s = 0; s < nv; s += 64) {
        _mm_prefetch((const char *)(old + s + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(old + s + 32 + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(nw + s + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(nw + s + 32 + AHEAD), _MM_HINT_T0);
        const vec_t x = count_vector(old + s, &k);
        const uint64_t chg =
            _mm512_cmpneq_epi16_mask(_mm512_loadu_si512(old + s), _mm512_loadu_si512(nw + s)) |
            ((uint64_t)_mm512_cmpneq_epi16_mask(_mm512_loadu_si512(old + s + 32),
                                                _mm512_loadu_si512(nw + s + 32)) << 32);
        uint64_t todo = chg | ~x.inwin;
        if (todo) {
            _mm512_storeu_si512(cls, x.cls);
            do {
                const int j = __builtin_ctzll(todo);
                todo &= todo - 1;
                const unsigned c = cls[j];
                uint32_t rk;
                if ((x.inwin >> j) & 1) {
                    rk = (uint32_t)lane(run, (int)(c - base)) + (uint32_t)_mm_popcnt_u64(_bzhi_u64(class_mask(x.cls, c), (unsigned)j));
                } else {
                    rk = counts[c]++;
                    if (!((chg >> j) & 1)) continue;
                }
                if (nch == cap) return -1;
                const int64_t i = s + j;
                cls_out[nch] = (uint16_t)c;
                rank_out[nch] = rk;
                diff[nch] = (uint16_t)((xg_key(nw[i], signbit, full) - xg_key(old[i], signbit, full)) & full);
                nch++;
            } while (todo);
        }
        run = _mm512_add_epi32(run, x.cnt);
    }
    _mm512_storeu_si512(runs, run);
    for (int w = 0; w < WIN && base + w <= emask; w++) counts[base + w] = runs[w];
    for (int64_t i = nv; i < n; i++) {
        const unsigned c = (old[i] >> shift) & emask;
        if (old[i] != nw[i]) {
            if (nch == cap) return -1;
            cls_out[nch] = (uint16_t)c;
            rank_out[nch] = counts[c];
            diff[nch] = (uint16_t)((xg_key(nw[i], signbit, full) - xg_key(old[i], signbit, full)) & full);
            nch++;
        }
        counts[c]++;
    }
    return nch;
}

#define DONE INT64_MAX
#define NEVER (1 << 30) /* beyond every rank (SIMD_MAX_ELEMS) */
#define SB_VECS 4
#define SB_ELEMS (64 * SB_VECS)

/* A counted superblock of SB_VECS vectors waiting for its targets to be placed. */
typedef struct {
    __m512i cls[SB_VECS];
    __m512i cnt;
    uint64_t inwin[SB_VECS];
} superblock_t;

/* Classes and window-class counts of SB_ELEMS elements (byte sums over the vectors, one
 * reduction tree per superblock). */
XG_TARGET static inline __attribute__((always_inline)) void
count_superblock(const uint16_t *o, const consts_t *k, superblock_t *sb) {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int v = 0; v < SB_VECS; v++) {
        const uint16_t *p = o + 64 * v;
        _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + 32 + AHEAD), _MM_HINT_T0);
        __m512i a = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(p), k->shift), k->emask);
        __m512i b = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(p + 32), k->shift), k->emask);
        const __m512i c8 = _mm512_permutex2var_epi8(a, k->pack, b);
        const __m512i r = _mm512_sub_epi8(c8, k->base);
        const __mmask64 in = _mm512_cmplt_epu8_mask(r, k->win);
        sb->cls[v] = c8;
        sb->inwin[v] = in;
        lo = _mm512_add_epi8(lo, _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(
                                     k->bits, _mm512_maskz_shuffle_epi8(in, k->lut_lo, r), 0)));
        hi = _mm512_add_epi8(hi, _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(
                                     k->bits, _mm512_maskz_shuffle_epi8(in, k->lut_hi, r), 0)));
    }
    /* bytes hold at most 8 * SB_VECS; sums over the 8 qwords reach 64 * SB_VECS: widen */
    __m512i l16 = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)),
                                   _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)));
    __m512i h16 = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)),
                                   _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1)));
    /* lanes 8q + w (q = 0..3) -> lo into the low half, hi into the high half */
    l16 = _mm512_add_epi16(l16, _mm512_shuffle_i64x2(l16, l16, _MM_SHUFFLE(1, 0, 3, 2)));
    h16 = _mm512_add_epi16(h16, _mm512_shuffle_i64x2(h16, h16, _MM_SHUFFLE(1, 0, 3, 2)));
    __m512i t = _mm512_mask_blend_epi64(0xF0, l16, h16);
    t = _mm512_add_epi16(t, _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    /* lanes 0..7 (lo) and 16..23 (hi) */
    sb->cnt = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(
        _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 0, 0, 0, 0), t)));
}

/* w[e] = unkey(key(w[e]) + d) for 2-byte elements. */
static inline void put16(uint16_t *w, int64_t e, uint16_t d, uint16_t signbit, uint16_t full) {
    w[e] = (uint16_t)xg_unkey((xg_key(w[e], signbit, full) + d) & full, signbit, full);
}

static inline int32_t clamp_rank(int64_t t) { return t < NEVER ? (int32_t)t : NEVER; }

/* The decoder holds each window class's next target rank in a register (16 x i32) next to
 * the running counts; a superblock whose count passes a target holds it, and the target
 * is picked out of the class's masks with pdep. Placing targets forms a dependency chain
 * from superblock to superblock, so counting runs one superblock ahead: it is older than
 * this superblock's branches and survives their mispredictions.
 *
 * With ``dst`` (the same buffer as ``old``) each change is also written as it is placed,
 * while its cache line is still in L1: written after the whole chunk was checked, the
 * changes' lines come back from DRAM (about 30% of all lines at 1% density). Classes are
 * counted before their elements are written, so the writes never change a count. */
XG_TARGET static int locate16(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                              const int64_t *class_start, const int64_t *class_end,
                              const int64_t *gaps, uint32_t *pos, uint16_t *dst,
                              const uint16_t *diffs, uint16_t signbit, uint16_t full) {
    const unsigned nclass = emask + 1;
    int64_t ptr[MAX_CLASSES], tgt[MAX_CLASSES], counts[MAX_CLASSES] = {0};
    for (unsigned c = 0; c < nclass; c++) {
        if (class_start[c] < 0 || class_end[c] < class_start[c]) return 1;
        for (int64_t p = class_start[c]; p < class_end[c]; p++)
            if (gaps[p] < 0 || gaps[p] >= n) return 1; /* a rank past every element */
        ptr[c] = class_start[c];
        tgt[c] = ptr[c] < class_end[c] ? gaps[ptr[c]] : DONE;
    }
    const unsigned base = choose_base(old, n, shift, emask);
    int32_t init[WIN];
    for (int w = 0; w < WIN; w++) init[w] = base + w < nclass ? clamp_rank(tgt[base + w]) : NEVER;
    __m512i tgtv = _mm512_loadu_si512(init);
    __m512i run = _mm512_setzero_si512();
    const consts_t k = make_consts(shift, emask, base);
    superblock_t buf[2];
    uint8_t cls[64];
    const int64_t nb = n / SB_ELEMS;
    if (nb > 0) count_superblock(old, &k, &buf[0]);
    for (int64_t i = 0; i < nb; i++) {
        if (i + 1 < nb) count_superblock(old + (i + 1) * SB_ELEMS, &k, &buf[(i + 1) & 1]);
        const superblock_t *sb = &buf[i & 1];
        const int64_t s = i * SB_ELEMS;
        const __m512i after = _mm512_add_epi32(run, sb->cnt);
        for (uint32_t hit = _mm512_cmplt_epi32_mask(tgtv, after); hit; hit &= hit - 1) {
            const int w = __builtin_ctz(hit);
            const unsigned c = base + (unsigned)w;
            const int64_t rb = lane(run, w), ra = lane(after, w);
            uint64_t m[SB_VECS];
            int64_t start[SB_VECS];
            int64_t sum = 0;
            for (int v = 0; v < SB_VECS; v++) {
                m[v] = class_mask(sb->cls[v], c);
                start[v] = sum;
                sum += (int64_t)_mm_popcnt_u64(m[v]);
            }
            int64_t t = tgt[c];
            do {
                const int64_t r = t - rb;
                int v = 0;
                for (int u = 1; u < SB_VECS; u++) v += r >= start[u];
                const int64_t e = s + 64 * v + __builtin_ctzll(_pdep_u64(1ULL << (r - start[v]), m[v]));
                pos[ptr[c]] = (uint32_t)e;
                if (dst) put16(dst, e, diffs[ptr[c]], signbit, full);
                if (++ptr[c] == class_end[c]) {
                    t = DONE;
                    break;
                }
                t += gaps[ptr[c]] + 1;
            } while (t < ra);
            tgt[c] = t;
            tgtv = _mm512_mask_set1_epi32(tgtv, (__mmask16)(1u << w), clamp_rank(t));
        }
        run = after;
        for (int v = 0; v < SB_VECS; v++) {
            uint64_t out = ~sb->inwin[v];
            if (__builtin_expect(out != 0, 0)) {
                _mm512_storeu_si512(cls, sb->cls[v]);
                for (; out; out &= out - 1) {
                    const int j = __builtin_ctzll(out);
                    const unsigned c = cls[j];
                    if (counts[c]++ == tgt[c]) {
                        pos[ptr[c]] = (uint32_t)(s + 64 * v + j);
                        if (dst) put16(dst, s + 64 * v + j, diffs[ptr[c]], signbit, full);
                        tgt[c] = ++ptr[c] < class_end[c] ? tgt[c] + gaps[ptr[c]] + 1 : DONE;
                    }
                }
            }
        }
    }
    int32_t runs[WIN];
    _mm512_storeu_si512(runs, run);
    for (int w = 0; w < WIN && base + w < nclass; w++) counts[base + w] = runs[w];
    for (int64_t i = nb * SB_ELEMS; i < n; i++) {
        const unsigned c = (old[i] >> shift) & emask;
        if (counts[c]++ == tgt[c]) {
            pos[ptr[c]] = (uint32_t)i;
            if (dst) put16(dst, i, diffs[ptr[c]], signbit, full);
            tgt[c] = ++ptr[c] < class_end[c] ? tgt[c] + gaps[ptr[c]] + 1 : DONE;
        }
    }
    for (unsigned c = 0; c < nclass; c++) {
        if (ptr[c] == class_end[c]) continue;
        if (dst) /* undo every change written, exactly */
            for (unsigned u = 0; u < nclass; u++)
                for (int64_t p = class_start[u]; p < ptr[u]; p++)
                    put16(dst, pos[p], (uint16_t)(0u - diffs[p]), signbit, full);
        return 1;
    }
    return 0;
}

XG_TARGET static uint64_t read_pair512(const uint64_t *a, const uint64_t *b, int64_t nwords) {
    __m512i x0 = _mm512_setzero_si512(), x1 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= nwords; i += 16) {
        x0 = _mm512_xor_si512(x0, _mm512_xor_si512(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i)));
        x1 = _mm512_xor_si512(x1, _mm512_xor_si512(_mm512_loadu_si512(a + i + 8),
                                                   _mm512_loadu_si512(b + i + 8)));
    }
    uint64_t r = (uint64_t)_mm512_reduce_or_epi64(_mm512_xor_si512(x0, x1));
    for (; i < nwords; i++) r ^= a[i] ^ b[i];
    return r;
}

#endif /* XG_X86 */

int64_t xg_scan16_simd(const uint16_t *old, const uint16_t *new_, int64_t n, unsigned shift,
                       unsigned emask, uint16_t signbit, uint16_t full, uint16_t *cls,
                       uint32_t *rank, uint16_t *diff, int64_t cap) {
#ifdef XG_X86
    if (emask < MAX_CLASSES && shift < 16 && n < SIMD_MAX_ELEMS && xg_simd_available())
        return scan16(old, new_, n, shift, emask, signbit, full, cls, rank, diff, cap);
#endif
    (void)old; (void)new_; (void)n; (void)shift; (void)emask; (void)signbit; (void)full;
    (void)cls; (void)rank; (void)diff; (void)cap;
    return XG_UNSUPPORTED;
}

#ifdef XG_X86
static int locate_ok(int64_t n, unsigned shift, unsigned emask, int nclass) {
    return emask < MAX_CLASSES && shift < 16 && nclass == (int)emask + 1 && n < SIMD_MAX_ELEMS &&
           xg_simd_available();
}
#endif

int xg_locate16_simd(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos) {
#ifdef XG_X86
    if (locate_ok(n, shift, emask, nclass))
        return locate16(old, n, shift, emask, class_start, class_end, gaps, pos, NULL, NULL, 0, 0);
#endif
    (void)old; (void)n; (void)shift; (void)emask; (void)class_start; (void)class_end;
    (void)nclass; (void)gaps; (void)pos;
    return XG_UNSUPPORTED;
}

int xg_locate_apply16_simd(uint16_t *arr, int64_t n, unsigned shift, unsigned emask,
                           const int64_t *class_start, const int64_t *class_end, int nclass,
                           const int64_t *gaps, uint32_t *pos, const uint16_t *diffs,
                           uint16_t signbit, uint16_t full) {
#ifdef XG_X86
    if (locate_ok(n, shift, emask, nclass))
        return locate16(arr, n, shift, emask, class_start, class_end, gaps, pos, arr, diffs,
                        signbit, full);
#endif
    (void)arr; (void)n; (void)shift; (void)emask; (void)class_start; (void)class_end;
    (void)nclass; (void)gaps; (void)pos; (void)diffs; (void)signbit; (void)full;
    return XG_UNSUPPORTED;
}

uint64_t xg_read_pair(const uint64_t *a, const uint64_t *b, int64_t nwords) {
#ifdef XG_X86
    if (xg_simd_available()) return read_pair512(a, b, nwords);
#endif
    uint64_t x0 = 0, x1 = 0;
    int64_t i = 0;
    for (; i + 2 <= nwords; i += 2) {
        x0 ^= a[i] ^ b[i];
        x1 ^= a[i + 1] ^ b[i + 1];
    }
    if (i < nwords) x0 ^= a[i] ^ b[i];
    return x0 ^ x1;
}
