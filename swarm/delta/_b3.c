/* BLAKE3 chaining values of tree nodes, for pieces hashed in parts (content/piecetree.py).
 *
 * The compression function of the BLAKE3 specification: a node is a chunk (up to 1024
 * bytes, 64-byte blocks, its index in the input as counter) or a parent of two child
 * chaining values; the left child of a node of k > 1 chunks holds the largest power of two
 * of chunks below k. The Python blake3 package gives the root hash only, so nodes of a
 * piece that lie in different processes are hashed here and joined with xg_b3_parent.
 * Blocks go one at a time in scalar code and, built by GCC or Clang for x86-64 or aarch64,
 * full chunks and their parents also 16, 8 or 4 at a time in the lanes of vector types
 * (AVX-512, AVX2, the SSE2 or NEON baseline: the module's SIMD path): 7x, 3x and 1.7x
 * the scalar speed on an AMD EPYC core with AVX-512.
 */
#include <stdint.h>
#include <string.h>

#include "_xg.h"

#define CHUNK_START 1u
#define CHUNK_END 2u
#define PARENT 4u
#define ROOT 8u

static const uint32_t IV[8] = {
    0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
    0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u,
};

/* Row r: the order in which round r reads the message words, the specification's
 * permutation [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8] applied r times. */
static const uint8_t SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

#define G(v, a, b, c, d, x, y)                                                             \
    do {                                                                                   \
        v[a] = v[a] + v[b] + (x);                                                          \
        v[d] = ROTR(v[d] ^ v[a], 16);                                                      \
        v[c] = v[c] + v[d];                                                                \
        v[b] = ROTR(v[b] ^ v[c], 12);                                                      \
        v[a] = v[a] + v[b] + (y);                                                          \
        v[d] = ROTR(v[d] ^ v[a], 8);                                                       \
        v[c] = v[c] + v[d];                                                                \
        v[b] = ROTR(v[b] ^ v[c], 7);                                                       \
    } while (0)

#define ROUND(v, m, r)                                                                     \
    do {                                                                                   \
        const uint8_t *s_ = SCHEDULE[r];                                                   \
        G(v, 0, 4, 8, 12, m[s_[0]], m[s_[1]]);                                             \
        G(v, 1, 5, 9, 13, m[s_[2]], m[s_[3]]);                                             \
        G(v, 2, 6, 10, 14, m[s_[4]], m[s_[5]]);                                            \
        G(v, 3, 7, 11, 15, m[s_[6]], m[s_[7]]);                                            \
        G(v, 0, 5, 10, 15, m[s_[8]], m[s_[9]]);                                            \
        G(v, 1, 6, 11, 12, m[s_[10]], m[s_[11]]);                                          \
        G(v, 2, 7, 8, 13, m[s_[12]], m[s_[13]]);                                           \
        G(v, 3, 4, 9, 14, m[s_[14]], m[s_[15]]);                                           \
    } while (0)

#define ROUNDS(v, m)                                                                       \
    do {                                                                                   \
        ROUND(v, m, 0); ROUND(v, m, 1); ROUND(v, m, 2); ROUND(v, m, 3);                    \
        ROUND(v, m, 4); ROUND(v, m, 5); ROUND(v, m, 6);                                    \
    } while (0)

static inline uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16)
           | ((uint32_t)p[3] << 24);
}

static inline void store_le32(uint8_t *p, uint32_t x) {
    p[0] = (uint8_t)x;
    p[1] = (uint8_t)(x >> 8);
    p[2] = (uint8_t)(x >> 16);
    p[3] = (uint8_t)(x >> 24);
}

/* The first 8 words of the compression output: the next chaining value. */
static void compress(uint32_t cv[8], const uint8_t block[64], uint64_t counter,
                     uint32_t block_len, uint32_t flags) {
    uint32_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le32(block + 4 * i);
    for (int i = 0; i < 8; i++) v[i] = cv[i];
    for (int i = 0; i < 4; i++) v[8 + i] = IV[i];
    v[12] = (uint32_t)counter;
    v[13] = (uint32_t)(counter >> 32);
    v[14] = block_len;
    v[15] = flags;
    ROUNDS(v, m);
    for (int i = 0; i < 8; i++) cv[i] = v[i] ^ v[i + 8];
}

/* A chunk of 1..1024 bytes. */
static void chunk_cv(const uint8_t *d, size_t len, uint64_t counter, uint32_t out[8]) {
    memcpy(out, IV, sizeof IV);
    uint32_t flags = CHUNK_START;
    for (; len > 64; d += 64, len -= 64, flags = 0) compress(out, d, counter, 64, flags);
    uint8_t last[64] = {0};
    memcpy(last, d, len);
    compress(out, last, counter, (uint32_t)len, flags | CHUNK_END);
}

static void parent_cv(const uint32_t l[8], const uint32_t r[8], uint32_t flags,
                      uint32_t out[8]) {
    uint8_t block[64];
    for (int i = 0; i < 8; i++) {
        store_le32(block + 4 * i, l[i]);
        store_le32(block + 32 + 4 * i, r[i]);
    }
    memcpy(out, IV, sizeof IV);
    compress(out, block, 0, 64, PARENT | flags);
}

static void store_cv(const uint32_t cv[8], uint8_t out[32]) {
    for (int i = 0; i < 8; i++) store_le32(out + 4 * i, cv[i]);
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__aarch64__))
#define B3_MANY 1

/* LANES nodes at once, one a lane of GCC/Clang vector types: the full chunks at
 * ``in + 1024 * lane`` (counters ``ctr + lane``), or with ``parents`` the parents of the
 * chaining value pairs at ``in + 64 * lane``; chaining values to ``out + 32 * lane``. */
#define B3_DEFINE_MANY(NAME, LANES, ATTR)                                                  \
    typedef uint32_t NAME##_v __attribute__((vector_size(4 * LANES)));                     \
    ATTR static void NAME(const uint8_t *in, int parents, uint64_t ctr, uint8_t *out) {    \
        const size_t stride = parents ? 64 : XG_B3_CHUNK, blocks = parents ? 1 : 16;       \
        NAME##_v h[8], v[16], m[16], lo, hi;                                               \
        for (int i = 0; i < 8; i++) h[i] = (NAME##_v){0} + IV[i];                          \
        for (int l = 0; l < LANES; l++) {                                                  \
            lo[l] = parents ? 0 : (uint32_t)(ctr + (uint64_t)l);                           \
            hi[l] = parents ? 0 : (uint32_t)((ctr + (uint64_t)l) >> 32);                   \
        }                                                                                  \
        for (size_t b = 0; b < blocks; b++) {                                              \
            for (int i = 0; i < 16; i++)                                                   \
                for (int l = 0; l < LANES; l++)                                            \
                    m[i][l] = load_le32(in + stride * (size_t)l + 64 * b + 4 * (size_t)i); \
            uint32_t f = parents ? PARENT                                                  \
                                 : (b == 0 ? CHUNK_START : 0) | (b == 15 ? CHUNK_END : 0); \
            for (int i = 0; i < 8; i++) v[i] = h[i];                                       \
            for (int i = 0; i < 4; i++) v[8 + i] = (NAME##_v){0} + IV[i];                  \
            v[12] = lo;                                                                    \
            v[13] = hi;                                                                    \
            v[14] = (NAME##_v){0} + 64u;                                                   \
            v[15] = (NAME##_v){0} + f;                                                     \
            ROUNDS(v, m);                                                                  \
            for (int i = 0; i < 8; i++) h[i] = v[i] ^ v[i + 8];                            \
        }                                                                                  \
        for (int l = 0; l < LANES; l++)                                                    \
            for (int i = 0; i < 8; i++) store_le32(out + 32 * l + 4 * i, h[i][l]);         \
    }

#if defined(__x86_64__)
B3_DEFINE_MANY(many16, 16, __attribute__((target("avx512f"))))
B3_DEFINE_MANY(many8, 8, __attribute__((target("avx2"))))
#endif
B3_DEFINE_MANY(many4, 4, )

static size_t many_lanes(int path) {
#if defined(__x86_64__)
    if (path == XG_AVX512) return 16;
    if (path == XG_AVX2) return 8;
#endif
    (void)path;
    return 4;
}

static void many(int path, const uint8_t *in, int parents, uint64_t ctr, uint8_t *out) {
#if defined(__x86_64__)
    if (path == XG_AVX512) {
        many16(in, parents, ctr, out);
        return;
    }
    if (path == XG_AVX2) {
        many8(in, parents, ctr, out);
        return;
    }
#endif
    many4(in, parents, ctr, out);
}

/* At most this many full chunks are hashed lane-parallel at a time (8 KiB of chaining
 * values on the stack). */
#define B3_BATCH 256

/* A node of ``chunks`` full chunks, a power of two up to B3_BATCH: its chunks, then each
 * level of parents, many_lanes(path) nodes at once (those left over one by one). */
static void batch_cv(int path, const uint8_t *d, size_t chunks, uint64_t ctr,
                     uint32_t out[8]) {
    uint8_t cvs[32 * B3_BATCH];
    uint32_t cv[8], l[8], r[8];
    const size_t lanes = many_lanes(path);
    size_t i = 0;
    for (; i + lanes <= chunks; i += lanes)
        many(path, d + XG_B3_CHUNK * i, 0, ctr + i, cvs + 32 * i);
    for (; i < chunks; i++) {
        chunk_cv(d + XG_B3_CHUNK * i, XG_B3_CHUNK, ctr + i, cv);
        store_cv(cv, cvs + 32 * i);
    }
    for (size_t k = chunks / 2; k >= 1; k /= 2) {
        for (i = 0; i + lanes <= k; i += lanes)
            many(path, cvs + 64 * i, 1, 0, cvs + 32 * i);
        for (; i < k; i++) {
            for (int j = 0; j < 8; j++) {
                l[j] = load_le32(cvs + 64 * i + 4 * j);
                r[j] = load_le32(cvs + 64 * i + 32 + 4 * j);
            }
            parent_cv(l, r, 0, cv);
            store_cv(cv, cvs + 32 * i);
        }
    }
    for (int j = 0; j < 8; j++) out[j] = load_le32(cvs + 4 * j);
}
#endif

static void node_cv(int path, const uint8_t *d, size_t len, uint64_t counter,
                    uint32_t out[8]) {
    if (len <= XG_B3_CHUNK) {
        chunk_cv(d, len, counter, out);
        return;
    }
    size_t chunks = (len + XG_B3_CHUNK - 1) / XG_B3_CHUNK, left = 1;
#ifdef B3_MANY
    if (len == chunks * XG_B3_CHUNK && (chunks & (chunks - 1)) == 0 && chunks <= B3_BATCH) {
        batch_cv(path, d, chunks, counter, out);
        return;
    }
#else
    (void)path;
#endif
    while (2 * left < chunks) left *= 2;
    uint32_t l[8], r[8];
    node_cv(path, d, left * XG_B3_CHUNK, counter, l);
    node_cv(path, d + left * XG_B3_CHUNK, len - left * XG_B3_CHUNK, counter + left, r);
    parent_cv(l, r, 0, out);
}

void xg_b3_node_cv(int path, const uint8_t *data, size_t len, uint64_t first_chunk,
                   uint8_t out[32]) {
    uint32_t cv[8];
    node_cv(path, data, len, first_chunk, cv);
    store_cv(cv, out);
}

void xg_b3_parent(const uint8_t left[32], const uint8_t right[32], int root,
                  uint8_t out[32]) {
    uint32_t l[8], r[8], cv[8];
    for (int i = 0; i < 8; i++) {
        l[i] = load_le32(left + 4 * i);
        r[i] = load_le32(right + 4 * i);
    }
    parent_cv(l, r, root ? ROOT : 0, cv);
    store_cv(cv, out);
}
