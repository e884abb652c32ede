/* SIMD fast paths of the swarm-xg1 kernels for 2-byte elements (bf16, fp16): AVX-512,
 * and AVX2 (further down) for CPUs without it.
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
 * more outliers. The AVX-512 path needs F/BW/VBMI/BITALG, GFNI and BMI1/2 (Ice Lake,
 * Zen 4 and later); xg_simd_path picks the fastest path the CPU runs, and the scalar
 * kernels of _xg_module.c run where none does.
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

/* Elements before the first 64-byte boundary of ``p`` (at most ``n``): the kernels count
 * them one by one so that their vector loads never straddle two cache lines (tensors of a
 * safetensors file start anywhere; a split load costs about 5% of a scan). */
static inline int64_t head_of(const uint16_t *p, int64_t n) {
    const int64_t h = (int64_t)((64 - (uintptr_t)p % 64) % 64 / 2);
    return h < n ? h : n;
}

/* Where a scan writes its changes: class, rank and key difference, at most ``cap``. */
typedef struct {
    uint16_t *cls;
    uint32_t *rank;
    uint16_t *diff;
    int64_t cap;
} scan_out_t;

static inline void emit(const scan_out_t *out, int64_t at, unsigned c, uint32_t rk, uint16_t o,
                        uint16_t nw, uint16_t signbit, uint16_t full) {
    out->cls[at] = (uint16_t)c;
    out->rank[at] = rk;
    out->diff[at] = (uint16_t)((xg_key(nw, signbit, full) - xg_key(o, signbit, full)) & full);
}

/* Elements from..n-1 one by one after ``nch`` changes, from the running counts of every
 * class; the scan's result. */
static int64_t scan_tail(const uint16_t *old, const uint16_t *nw, int64_t from, int64_t n,
                         unsigned shift, unsigned emask, uint16_t signbit, uint16_t full,
                         uint32_t *counts, const scan_out_t *out, int64_t nch) {
    for (int64_t i = from; i < n; i++) {
        const unsigned c = (old[i] >> shift) & emask;
        if (old[i] != nw[i]) {
            if (nch == out->cap) return -1;
            emit(out, nch++, c, counts[c], old[i], nw[i], signbit, full);
        }
        counts[c]++;
    }
    return nch;
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
                                const scan_out_t *out) {
    const unsigned base = choose_base(old, n, shift, emask);
    const consts_t k = make_consts(shift, emask, base);
    uint32_t counts[MAX_CLASSES] = {0};
    const int64_t h = head_of(old, n);
    int64_t nch = scan_tail(old, nw, 0, h, shift, emask, signbit, full, counts, out, 0);
    if (nch < 0) return nch;
    __m512i run = _mm512_loadu_si512(counts + base); /* the head's window-class counts */
    uint8_t cls[64];
    const int64_t nv = h + (n - h) / 64 * 64;
    for (int64_t s = h; s < nv; s += 64) {
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
                if (nch == out->cap) return -1;
                emit(out, nch++, c, rk, old[s + j], nw[s + j], signbit, full);
            } while (todo);
        }
        run = _mm512_add_epi32(run, x.cnt);
    }
    _mm512_storeu_si512(counts + base, run); /* back where the head's counts came from */
    return scan_tail(old, nw, nv, n, shift, emask, signbit, full, counts, out, nch);
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

/* What a locate knows besides the window: the chunk's slots and, per class, the next slot
 * to place, its target rank and (outside the window) the running count. */
typedef struct {
    const int64_t *class_start, *class_end, *gaps;
    uint32_t *pos;
    uint16_t *dst; /* NULL, or the elements to write each change into as it is placed */
    const uint16_t *diffs;
    uint16_t signbit, full;
    unsigned emask, nclass;
    int64_t ptr[MAX_CLASSES], tgt[MAX_CLASSES], counts[MAX_CLASSES];
} loc_t;

/* 1 when a gap is negative or a rank lies past every element (nothing to place). */
static int loc_init(loc_t *L, int64_t n, unsigned emask) {
    L->emask = emask;
    L->nclass = emask + 1;
    for (unsigned c = 0; c < L->nclass; c++) {
        if (L->class_start[c] < 0 || L->class_end[c] < L->class_start[c]) return 1;
        for (int64_t p = L->class_start[c]; p < L->class_end[c]; p++)
            if (L->gaps[p] < 0 || L->gaps[p] >= n) return 1;
        L->ptr[c] = L->class_start[c];
        L->tgt[c] = L->ptr[c] < L->class_end[c] ? L->gaps[L->ptr[c]] : DONE;
        L->counts[c] = 0;
    }
    return 0;
}

/* Places the next change of class c at element e; returns the class's next target. */
static inline int64_t loc_place(loc_t *L, unsigned c, int64_t e) {
    L->pos[L->ptr[c]] = (uint32_t)e;
    if (L->dst) put16(L->dst, e, L->diffs[L->ptr[c]], L->signbit, L->full);
    L->tgt[c] = ++L->ptr[c] < L->class_end[c] ? L->tgt[c] + L->gaps[L->ptr[c]] + 1 : DONE;
    return L->tgt[c];
}

/* Element e of class c counted one by one (outside the window, or in the tail). */
static inline void loc_count(loc_t *L, unsigned c, int64_t e) {
    if (L->counts[c]++ == L->tgt[c]) loc_place(L, c, e);
}

/* Counts the head (head_of) one by one; ``tgt`` and ``run`` get each window class's next
 * target rank and count after it. Returns the head's length. */
static int64_t loc_head(loc_t *L, const uint16_t *old, int64_t n, unsigned shift, unsigned base,
                        int32_t *tgt, int32_t *run) {
    const int64_t h = head_of(old, n);
    for (int64_t i = 0; i < h; i++) loc_count(L, (old[i] >> shift) & L->emask, i);
    for (unsigned w = 0; w < WIN; w++) {
        const int in = base + w < L->nclass;
        tgt[w] = in ? clamp_rank(L->tgt[base + w]) : NEVER;
        run[w] = in ? (int32_t)L->counts[base + w] : 0;
    }
    return h;
}

/* Counts elements from..n-1 one by one after the window classes' running counts
 * ``runs``; 0 when every change was placed, else 1 with every write undone. */
static int loc_finish(loc_t *L, const uint16_t *old, int64_t from, int64_t n, unsigned shift,
                      unsigned base, const int32_t *runs) {
    for (unsigned w = 0; w < WIN && base + w < L->nclass; w++) L->counts[base + w] = runs[w];
    for (int64_t i = from; i < n; i++) loc_count(L, (old[i] >> shift) & L->emask, i);
    for (unsigned c = 0; c < L->nclass; c++) {
        if (L->ptr[c] == L->class_end[c]) continue;
        if (L->dst) /* undo every change written, exactly */
            for (unsigned u = 0; u < L->nclass; u++)
                for (int64_t p = L->class_start[u]; p < L->ptr[u]; p++)
                    put16(L->dst, L->pos[p], (uint16_t)(0u - L->diffs[p]), L->signbit, L->full);
        return 1;
    }
    return 0;
}

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
                              loc_t *L) {
    if (loc_init(L, n, emask)) return 1;
    const unsigned base = choose_base(old, n, shift, emask);
    int32_t init[WIN], runs[WIN];
    const int64_t h = loc_head(L, old, n, shift, base, init, runs);
    __m512i tgtv = _mm512_loadu_si512(init);
    __m512i run = _mm512_loadu_si512(runs);
    const consts_t k = make_consts(shift, emask, base);
    superblock_t buf[2];
    uint8_t cls[64];
    const int64_t nb = (n - h) / SB_ELEMS;
    if (nb > 0) count_superblock(old + h, &k, &buf[0]);
    for (int64_t i = 0; i < nb; i++) {
        const int64_t s = h + i * SB_ELEMS;
        if (i + 1 < nb) count_superblock(old + s + SB_ELEMS, &k, &buf[(i + 1) & 1]);
        const superblock_t *sb = &buf[i & 1];
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
            int64_t t = L->tgt[c];
            do {
                const int64_t r = t - rb;
                int v = 0;
                for (int u = 1; u < SB_VECS; u++) v += r >= start[u];
                t = loc_place(L, c, s + 64 * v + __builtin_ctzll(_pdep_u64(1ULL << (r - start[v]), m[v])));
            } while (t < ra);
            tgtv = _mm512_mask_set1_epi32(tgtv, (__mmask16)(1u << w), clamp_rank(t));
        }
        run = after;
        for (int v = 0; v < SB_VECS; v++) {
            uint64_t out = ~sb->inwin[v];
            if (__builtin_expect(out != 0, 0)) {
                _mm512_storeu_si512(cls, sb->cls[v]);
                for (; out; out &= out - 1) {
                    const int j = __builtin_ctzll(out);
                    loc_count(L, cls[j], s + 64 * v + j);
                }
            }
        }
    }
    _mm512_storeu_si512(runs, run);
    return loc_finish(L, old, h + nb * SB_ELEMS, n, shift, base, runs);
}

/* ---- AVX2 path --------------------------------------------------------------------------
 * The same algorithm on CPUs without AVX-512 (Haswell to Raptor Lake, Zen 1-3): superblocks
 * of SB2_ELEMS elements, 32 class bytes a vector. Without gf2p8affine the window classes
 * are counted with vpshufb lookups into byte counters per lane that two classes share (a
 * nibble each), and one maddubs + hadd tree per superblock sums the lanes. Needs AVX2,
 * POPCNT and BMI1/2 (every AVX2 CPU has them); on Zen 1/2, whose pdep is microcode, a
 * target is picked out of its class's mask by clearing lower bits.
 */
#define XG_TARGET2 __attribute__((target("avx2,popcnt,bmi,bmi2")))
#define SB2_VECS 8
#define SB2_ELEMS (32 * SB2_VECS)

typedef struct {
    __m128i shift;
    __m256i emask, base, hinib, to_index;
    __m256i pair_lut[WIN / 2]; /* 1 at index w, 16 at index w + 8 */
} consts2_t;

/* A counted superblock: window offset (class - base, mod 256) of each element, the
 * elements in the window, and the count of each window class (16 x i32, two vectors). */
typedef struct {
    __m256i r[SB2_VECS];
    uint32_t inwin[SB2_VECS];
    __m256i cnt_lo, cnt_hi;
} sb2_t;

XG_TARGET2 static inline __attribute__((always_inline)) consts2_t make_consts2(unsigned shift,
                                                                              unsigned emask,
                                                                              unsigned base) {
    consts2_t k;
    k.shift = _mm_cvtsi32_si128((int)shift);
    k.emask = _mm256_set1_epi16((short)emask);
    k.base = _mm256_set1_epi8((char)base);
    k.hinib = _mm256_set1_epi8((char)0xF0);
    k.to_index = _mm256_set1_epi8(0x70);
    for (int w = 0; w < WIN / 2; w++) {
        int8_t lut[16] = {0};
        lut[w] = 1;
        lut[w + WIN / 2] = 16;
        k.pair_lut[w] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut));
    }
    return k;
}

/* Bytes of 32 16-bit lanes (each < 256) in element order. */
XG_TARGET2 static inline __attribute__((always_inline)) __m256i pack32(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), _MM_SHUFFLE(3, 1, 2, 0));
}

/* Elements of 32 whose window offset is ``w``. */
XG_TARGET2 static inline __attribute__((always_inline)) uint32_t win_mask(__m256i r, unsigned w) {
    return (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(r, _mm256_set1_epi8((char)w)));
}

XG_TARGET2 static inline __attribute__((always_inline)) void
count_superblock2(const uint16_t *o, const consts2_t *k, sb2_t *sb) {
    for (int v = 0; v < SB2_VECS; v++) {
        const uint16_t *p = o + 32 * v;
        _mm_prefetch((const char *)(p + AHEAD), _MM_HINT_T0);
        const __m256i a = _mm256_and_si256(
            _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p), k->shift), k->emask);
        const __m256i b = _mm256_and_si256(
            _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + 16)), k->shift), k->emask);
        const __m256i r = _mm256_sub_epi8(pack32(a, b), k->base);
        sb->r[v] = r;
        sb->inwin[v] = (uint32_t)_mm256_movemask_epi8(
            _mm256_cmpeq_epi8(_mm256_and_si256(r, k->hinib), _mm256_setzero_si256()));
    }
    /* Window classes w and w + 8 share a byte counter per lane: vpshufb looks up 1 or 16
     * (a nibble each: at most SB2_VECS), halving the work of a compare per class. The
     * index saturates to >= 0x80 (lookup 0) outside the window. */
    __m256i idx[SB2_VECS];
    for (int v = 0; v < SB2_VECS; v++) idx[v] = _mm256_adds_epu8(sb->r[v], k->to_index);
    const __m256i ones = _mm256_set1_epi8(1), nib = _mm256_set1_epi8(0x0F);
    __m256i m[WIN];
    for (int w = 0; w < WIN / 2; w++) {
        const __m256i lut = k->pair_lut[w];
        __m256i acc = _mm256_setzero_si256();
        for (int v = 0; v < SB2_VECS; v++) acc = _mm256_add_epi8(acc, _mm256_shuffle_epi8(lut, idx[v]));
        m[w] = _mm256_maddubs_epi16(_mm256_and_si256(acc, nib), ones);
        m[w + WIN / 2] = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(acc, 4), nib), ones);
    }
    /* three hadd levels leave, per 128-bit lane, one sum per class of 8; add the lanes */
    __m256i h[8], g[4], f[2];
    for (int i = 0; i < 8; i++) h[i] = _mm256_hadd_epi16(m[2 * i], m[2 * i + 1]);
    for (int i = 0; i < 4; i++) g[i] = _mm256_hadd_epi16(h[2 * i], h[2 * i + 1]);
    for (int i = 0; i < 2; i++) f[i] = _mm256_hadd_epi16(g[2 * i], g[2 * i + 1]);
    sb->cnt_lo = _mm256_cvtepu16_epi32(_mm_add_epi16(_mm256_castsi256_si128(f[0]),
                                                     _mm256_extracti128_si256(f[0], 1)));
    sb->cnt_hi = _mm256_cvtepu16_epi32(_mm_add_epi16(_mm256_castsi256_si128(f[1]),
                                                     _mm256_extracti128_si256(f[1], 1)));
}

/* Window-class elements of the superblock before element ``j`` of vector ``v``. */
XG_TARGET2 static inline __attribute__((always_inline)) uint32_t
sb2_rank(const sb2_t *sb, int v, int j, unsigned w) {
    uint32_t r = (uint32_t)_mm_popcnt_u32(win_mask(sb->r[v], w) & ((1u << j) - 1u));
    for (int u = 0; u < v; u++) r += (uint32_t)_mm_popcnt_u32(win_mask(sb->r[u], w));
    return r;
}

/* Zen 1/2 run pdep in microcode (tens to hundreds of cycles): clear lower bits there. */
static int slow_pdep;

/* The offset of the k-th (from 0) set bit of m. */
XG_TARGET2 static inline __attribute__((always_inline)) unsigned select64(uint64_t m, uint32_t k) {
    if (slow_pdep) {
        while (k--) m &= m - 1;
        return (unsigned)__builtin_ctzll(m);
    }
    return (unsigned)__builtin_ctzll(_pdep_u64(1ULL << k, m));
}

XG_TARGET2 static int64_t scan16_avx2(const uint16_t *old, const uint16_t *nw, int64_t n,
                                      unsigned shift, unsigned emask, uint16_t signbit,
                                      uint16_t full, const scan_out_t *out) {
    const unsigned base = choose_base(old, n, shift, emask);
    const consts2_t k = make_consts2(shift, emask, base);
    uint32_t counts[MAX_CLASSES] = {0}, runs[WIN];
    const int64_t h = head_of(old, n);
    int64_t nch = scan_tail(old, nw, 0, h, shift, emask, signbit, full, counts, out, 0);
    if (nch < 0) return nch;
    __m256i run_lo = _mm256_loadu_si256((const __m256i *)(counts + base));
    __m256i run_hi = _mm256_loadu_si256((const __m256i *)(counts + base + 8));
    sb2_t sb;
    const int64_t nb = (n - h) / SB2_ELEMS;
    for (int64_t i = 0; i < nb; i++) {
        const int64_t s = h + i * SB2_ELEMS;
        count_superblock2(old + s, &k, &sb);
        uint32_t todo_v[SB2_VECS], chg[SB2_VECS], any = 0;
        for (int v = 0; v < SB2_VECS; v++) {
            const uint16_t *o = old + s + 32 * v, *q = nw + s + 32 * v;
            _mm_prefetch((const char *)(q + AHEAD), _MM_HINT_T0);
            const __m256i e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)o),
                                                  _mm256_loadu_si256((const __m256i *)q));
            const __m256i e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(o + 16)),
                                                  _mm256_loadu_si256((const __m256i *)(q + 16)));
            chg[v] = ~(uint32_t)_mm256_movemask_epi8(
                _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), _MM_SHUFFLE(3, 1, 2, 0)));
            todo_v[v] = chg[v] | ~sb.inwin[v];
            any |= todo_v[v];
        }
        if (any) {
            _mm256_storeu_si256((__m256i *)runs, run_lo);
            _mm256_storeu_si256((__m256i *)(runs + 8), run_hi);
            for (int v = 0; v < SB2_VECS; v++) {
                const uint8_t *rb = (const uint8_t *)&sb.r[v];
                for (uint32_t todo = todo_v[v]; todo; todo &= todo - 1) {
                    const int j = __builtin_ctz(todo);
                    const unsigned w = rb[j], c = (w + base) & 0xFF;
                    uint32_t rk;
                    if ((sb.inwin[v] >> j) & 1) {
                        rk = runs[w] + sb2_rank(&sb, v, j, w);
                    } else {
                        rk = counts[c]++;
                        if (!((chg[v] >> j) & 1)) continue;
                    }
                    if (nch == out->cap) return -1;
                    emit(out, nch++, c, rk, old[s + 32 * v + j], nw[s + 32 * v + j], signbit, full);
                }
            }
        }
        run_lo = _mm256_add_epi32(run_lo, sb.cnt_lo);
        run_hi = _mm256_add_epi32(run_hi, sb.cnt_hi);
    }
    _mm256_storeu_si256((__m256i *)(counts + base), run_lo);
    _mm256_storeu_si256((__m256i *)(counts + base + 8), run_hi);
    return scan_tail(old, nw, h + nb * SB2_ELEMS, n, shift, emask, signbit, full, counts, out,
                     nch);
}

/* locate16 on AVX2: the window classes' next target ranks in two vectors next to the
 * running counts; counting runs one superblock ahead of placing (see locate16). */
XG_TARGET2 static int locate16_avx2(const uint16_t *old, int64_t n, unsigned shift,
                                    unsigned emask, loc_t *L) {
    if (loc_init(L, n, emask)) return 1;
    const unsigned base = choose_base(old, n, shift, emask);
    int32_t tg[WIN], rb[WIN], ra[WIN];
    const int64_t h = loc_head(L, old, n, shift, base, tg, rb);
    __m256i tgt_lo = _mm256_loadu_si256((const __m256i *)tg);
    __m256i tgt_hi = _mm256_loadu_si256((const __m256i *)(tg + 8));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i run_lo = _mm256_loadu_si256((const __m256i *)rb);
    __m256i run_hi = _mm256_loadu_si256((const __m256i *)(rb + 8));
    const consts2_t k = make_consts2(shift, emask, base);
    sb2_t buf[2];
    const int64_t nb = (n - h) / SB2_ELEMS;
    if (nb > 0) count_superblock2(old + h, &k, &buf[0]);
    for (int64_t i = 0; i < nb; i++) {
        const int64_t s = h + i * SB2_ELEMS;
        if (i + 1 < nb) count_superblock2(old + s + SB2_ELEMS, &k, &buf[(i + 1) & 1]);
        const sb2_t *sb = &buf[i & 1];
        _mm256_storeu_si256((__m256i *)rb, run_lo);
        _mm256_storeu_si256((__m256i *)(rb + 8), run_hi);
        run_lo = _mm256_add_epi32(run_lo, sb->cnt_lo);
        run_hi = _mm256_add_epi32(run_hi, sb->cnt_hi);
        uint32_t hit = (uint32_t)_mm256_movemask_ps(
                           _mm256_castsi256_ps(_mm256_cmpgt_epi32(run_lo, tgt_lo))) |
                       (uint32_t)_mm256_movemask_ps(
                           _mm256_castsi256_ps(_mm256_cmpgt_epi32(run_hi, tgt_hi))) << 8;
        if (hit) {
            _mm256_storeu_si256((__m256i *)ra, run_lo);
            _mm256_storeu_si256((__m256i *)(ra + 8), run_hi);
        }
        for (; hit; hit &= hit - 1) {
            const unsigned w = (unsigned)__builtin_ctz(hit), c = base + w;
            uint64_t m[SB2_VECS / 2]; /* 64 elements a mask */
            int64_t start[SB2_VECS / 2];
            int64_t sum = 0;
            for (int q = 0; q < SB2_VECS / 2; q++) {
                m[q] = win_mask(sb->r[2 * q], w) | (uint64_t)win_mask(sb->r[2 * q + 1], w) << 32;
                start[q] = sum;
                sum += (int64_t)_mm_popcnt_u64(m[q]);
            }
            int64_t t = L->tgt[c];
            do {
                const int64_t r = t - rb[w];
                int q = 0;
                for (int u = 1; u < SB2_VECS / 2; u++) q += r >= start[u];
                t = loc_place(L, c, s + 64 * q + select64(m[q], (uint32_t)(r - start[q])));
            } while (t < ra[w]);
            const __m256i tv = _mm256_set1_epi32(clamp_rank(t));
            const __m256i at = _mm256_cmpeq_epi32(lanes, _mm256_set1_epi32((int)(w & 7)));
            if (w < 8)
                tgt_lo = _mm256_blendv_epi8(tgt_lo, tv, at);
            else
                tgt_hi = _mm256_blendv_epi8(tgt_hi, tv, at);
        }
        for (int v = 0; v < SB2_VECS; v++) {
            uint32_t out = ~sb->inwin[v];
            if (__builtin_expect(out != 0, 0)) {
                const uint8_t *rv = (const uint8_t *)&sb->r[v];
                for (; out; out &= out - 1) {
                    const int j = __builtin_ctz(out);
                    loc_count(L, (rv[j] + base) & 0xFF, s + 32 * v + j);
                }
            }
        }
    }
    _mm256_storeu_si256((__m256i *)rb, run_lo);
    _mm256_storeu_si256((__m256i *)(rb + 8), run_hi);
    return loc_finish(L, old, h + nb * SB2_ELEMS, n, shift, base, rb);
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

static int best_path = XG_SCALAR;

void xg_simd_init(void) {
#ifdef XG_X86
    __builtin_cpu_init();
    best_path = XG_SCALAR;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") &&
        __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2"))
        best_path = XG_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bitalg") &&
        __builtin_cpu_supports("gfni") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt"))
        best_path = XG_AVX512;
    slow_pdep = __builtin_cpu_is("znver1") || __builtin_cpu_is("znver2");
#endif
}

int xg_set_slow_pdep(int slow) {
#ifdef XG_X86
    const int was = slow_pdep;
    slow_pdep = slow;
    return was;
#else
    (void)slow;
    return 0;
#endif
}

int xg_simd_path(int cap) { return cap < best_path ? cap : best_path; }

#ifdef XG_X86
/* The path a 2-byte kernel takes for this input, at most ``cap``. */
static int path_for(int cap, int64_t n, unsigned shift, unsigned emask) {
    if (emask >= MAX_CLASSES || shift >= 16 || n >= SIMD_MAX_ELEMS) return XG_SCALAR;
    return xg_simd_path(cap);
}
#endif

int64_t xg_scan16_simd(int cap, const uint16_t *old, const uint16_t *new_, int64_t n,
                       unsigned shift, unsigned emask, uint16_t signbit, uint16_t full,
                       uint16_t *cls, uint32_t *rank, uint16_t *diff, int64_t ncap) {
#ifdef XG_X86
    const scan_out_t out = {cls, rank, diff, ncap};
    switch (path_for(cap, n, shift, emask)) {
    case XG_AVX512: return scan16(old, new_, n, shift, emask, signbit, full, &out);
    case XG_AVX2: return scan16_avx2(old, new_, n, shift, emask, signbit, full, &out);
    default: break;
    }
#endif
    (void)cap; (void)old; (void)new_; (void)n; (void)shift; (void)emask; (void)signbit;
    (void)full; (void)cls; (void)rank; (void)diff; (void)ncap;
    return XG_UNSUPPORTED;
}

int xg_locate16_simd(int cap, uint16_t *arr, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos, const uint16_t *diffs,
                     uint16_t signbit, uint16_t full) {
#ifdef XG_X86
    if (nclass == (int)emask + 1) {
        loc_t L = {class_start, class_end, gaps, pos, diffs ? arr : NULL, diffs, signbit, full};
        switch (path_for(cap, n, shift, emask)) {
        case XG_AVX512: return locate16(arr, n, shift, emask, &L);
        case XG_AVX2: return locate16_avx2(arr, n, shift, emask, &L);
        default: break;
        }
    }
#endif
    (void)cap; (void)arr; (void)n; (void)shift; (void)emask; (void)class_start;
    (void)class_end; (void)nclass; (void)gaps; (void)pos; (void)diffs; (void)signbit;
    (void)full;
    return XG_UNSUPPORTED;
}

uint64_t xg_read_pair(const uint64_t *a, const uint64_t *b, int64_t nwords) {
#ifdef XG_X86
    if (xg_simd_path(XG_AVX512) == XG_AVX512) return read_pair512(a, b, nwords);
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
