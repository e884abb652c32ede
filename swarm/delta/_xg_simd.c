/* AVX-512 fast paths of the swarm-xg1 kernels for 2-byte elements (bf16, fp16). */
#include "_xg.h"

int xg_simd_available(void) { return 0; }

int64_t xg_scan16_simd(const uint16_t *old, const uint16_t *new_, int64_t n, unsigned shift,
                       unsigned emask, uint16_t signbit, uint16_t full, uint16_t *cls,
                       uint32_t *rank, uint16_t *diff, int64_t cap) {
    (void)old; (void)new_; (void)n; (void)shift; (void)emask; (void)signbit; (void)full;
    (void)cls; (void)rank; (void)diff; (void)cap;
    return XG_UNSUPPORTED;
}

int xg_locate16_simd(const uint16_t *old, int64_t n, unsigned shift, unsigned emask,
                     const int64_t *class_start, const int64_t *class_end, int nclass,
                     const int64_t *gaps, uint32_t *pos) {
    (void)old; (void)n; (void)shift; (void)emask; (void)class_start; (void)class_end;
    (void)nclass; (void)gaps; (void)pos;
    return XG_UNSUPPORTED;
}
