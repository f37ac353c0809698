/* Helpers shared by the repo's C kernels (lora/backends/cpu_sgmv.c, workers/cpu_attention.c).
 * lora/native.py hashes this header with each kernel's source, so a change here rebuilds both. */
#ifndef LORASERVE_NATIVE_H
#define LORASERVE_NATIVE_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch does; NaN stays NaN (quiet bit set) */
static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float v) { return v; }
static inline float f32_store(float f) { return f; }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 elements (or the first `n`) as fp32 lanes; the rest are zero. */
static inline __m512 load_bf16(const uint16_t *p, int n) {
    __m256i v = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512 load_f32(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }

static inline void store_bf16(uint16_t *p, __m512 v) {   /* as bf16_store, 16 lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
static inline void store_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }

/* The steps of a transposing reduction: in each 128-bit block, lanes of a and b summed in pairs
 * (ps: [a0+a2, b0+b2, a1+a3, b1+b3]), then 64-bit halves (pd: [sum a, sum b, sum c, sum d] of
 * four such inputs), then 128-bit blocks across two vectors (blocks: even + odd). */
static inline __m512 pair_sum_ps(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 pair_sum_pd(__m512 a, __m512 b) {
    __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
static inline __m512 block_sum(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* lane i = sum of the 16 lanes of v[i] */
static inline __m512 reduce16(const __m512 *v) {
    __m512 u[8], w[4];
    for (int k = 0; k < 8; k++) u[k] = pair_sum_ps(v[2 * k], v[2 * k + 1]);
    for (int k = 0; k < 4; k++) w[k] = pair_sum_pd(u[2 * k], u[2 * k + 1]);
    return block_sum(block_sum(w[0], w[1]), block_sum(w[2], w[3]));
}
#endif

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux lends AMX's tile state to a process only on request (permission is process-wide: torch's OpenMP threads
 * may use it once granted). 0 when granted. */
static inline int amx_permit(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0;
}

/* all 8 tiles 16 rows x 64 bytes (the kernels' one shape), on the calling thread */
static inline void amx_configure(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* tiles 0-3 are the kernels' accumulators: zeroed, and stored (all four, or 0 and 1) as 256 floats each */
static inline void amx_zero_acc(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}
static inline void amx_store_acc(float *acc, int four) {
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    if (four) {
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
    }
}
#endif

#endif
