/* One vector of W fp32 lanes and the few operations the element-wise kernels need (workers/cpu_ops.c,
 * workers/models/cpu_moe_fused.c): AVX-512 where built for it, else one lane (the same code, scalar). `n` is how
 * many leading lanes a load or store touches. lora/native.py hashes this header with each kernel that includes it. */
#ifndef LORASERVE_VEC_H
#define LORASERVE_VEC_H

#include <math.h>

#include "native.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512 vf;
#define W 16
static inline __mmask16 lanes(int n) { return (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u); }
static inline vf v_set(float a) { return _mm512_set1_ps(a); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf ld_f32(const float *p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
static inline vf ld_bf16(const uint16_t *p, int n) { return load_bf16(p, n < 16 ? n : 16); }
static inline vf round_f32(vf v) { return v; }
#if defined(__AVX512BF16__)
/* One instruction for bf16_store's rounding (round to nearest even, NaN kept a quiet NaN of its sign and payload),
 * where the CPU has it: the integer sequence below cost a third of RMSNorm's and SiLU's time. It differs from
 * bf16_store only on fp32 denormals (|x| < 1.2e-38), which it flushes to a zero of their sign. */
static inline void st_bf16(uint16_t *p, vf v, int n) { _mm256_mask_storeu_epi16(p, lanes(n), (__m256i)_mm512_cvtneps_pbh(v)); }
static inline vf round_bf16(vf v) {   /* the rounded value, kept in fp32 lanes (the low half zero) */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#else
/* bf16_store's rounding, kept in fp32 lanes (the low half zero), so a later op sees the rounded value */
static inline vf round_bf16(vf v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void st_bf16(uint16_t *p, vf v, int n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
}
#endif
static inline void st_f32(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
/* exp(x): 2^k * e^f, k = round(x / ln 2), f = x - k ln 2 in two parts (|f| <= ln 2 / 2), e^f by its
 * degree-7 Taylor polynomial (truncation < 6e-9 relative); saturates to 0 / inf past fp32's range (-inf -> 0,
 * as attention's masked scores need); NaN stays NaN (min / max return their second operand on a NaN). */
static inline vf v_exp(vf x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
    const vf k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vf f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), f);
    vf p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}
#else
typedef float vf;
#define W 1
static inline vf v_set(float a) { return a; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline float v_sum(vf a) { return a; }
static inline vf ld_f32(const float *p, int n) { (void)n; return *p; }
static inline vf ld_bf16(const uint16_t *p, int n) { (void)n; return bf16_load(*p); }
static inline vf round_f32(vf v) { return v; }
static inline vf round_bf16(vf v) { return bf16_load(bf16_store(v)); }
static inline void st_f32(float *p, vf v, int n) { (void)n; *p = v; }
static inline void st_bf16(uint16_t *p, vf v, int n) { (void)n; *p = bf16_store(v); }
static inline vf v_exp(vf x) { return expf(x); }
#endif

/* One row of SiLU-and-mul: g [2I] (gate | up) -> out [I] = round(round(silu(gate)) * up), silu(g) = g / (1 +
 * exp(-g)) as torch computes it (workers/models/llama.py's MLP.act: silu, rounded, then the product). */
#define DEFINE_SILU_MUL_ROW(NAME, T, LD, ROUND, ST)                                                    \
static inline void NAME(const T *g, int64_t I, T *out) {                                           \
    const T *u = g + I;                                                                            \
    for (int64_t d = 0; d < I; d += W) {                                                           \
        const int n = (int)(I - d);                                                                \
        const vf gv = LD(g + d, n);                                                                \
        const vf s = ROUND(v_div(gv, v_add(v_set(1.f), v_exp(v_sub(v_set(0.f), gv)))));            \
        ST(out + d, v_mul(s, LD(u + d, n)), n);                                                    \
    }                                                                                              \
}
DEFINE_SILU_MUL_ROW(silu_mul_row_bf16, uint16_t, ld_bf16, round_bf16, st_bf16)
DEFINE_SILU_MUL_ROW(silu_mul_row_f32, float, ld_f32, round_f32, st_f32)

#endif
