/* W8A8_DYNAMIC linear for the CPU in one call: per-token int8 quantization of x, the int8 GEMM on AMX
 * tiles and the per-channel x per-token rescale (+ bias), written in x's dtype.
 *
 * Why: as torch ops (workers/quant/kernels.py CpuW8A8) the quantization is five passes over x and the
 * rescale three more over y, each a dispatch and a parallel region, around oneDNN's GEMM: at decode
 * sizes those cost as much as a third of the GEMM, which itself only reads the weight's bytes.
 *
 * Arithmetic (tests/w8a8_reference.py's, bit for bit):
 *   s_t     = max(max_k |x[t, k]| / 127, FLT_MIN)                     fp32, IEEE division
 *   xq[t,k] = clamp(round_half_even(x[t, k] / s_t), -127, 127)        int8, IEEE division
 *   acc     = sum_k xq[t, k] * w[n, k]                                 int32, exact
 *   y[t, n] = ((float)acc * w_scale[n]) * s_t (+ bias[n])               fp32, each op rounded once
 * then rounded to x's dtype (bf16: nearest even). The *_round_ps intrinsics are builtins the compiler
 * never contracts into an FMA (lora/native.py builds with -ffp-contract=fast).
 *
 * Layout: x [M, K] bf16 or fp32, row stride x_stride; y [M, N] dense, x's dtype; bias [N] (bf16 or fp32
 * as bias_bf16 says) or NULL; w_scale [N] fp32. The weight is packed once (cpu_w8a8.py pack()) as AMX B
 * tiles: N padded to a multiple of 32, K to a multiple of 64, laid out [N/16][K/64][16 k-quads][16 n][4 k],
 * so each 16-column block streams its K contiguously. xq goes to a per-thread scratch of 32-row blocks
 * (pad rows and columns zero). Columns are split over torch's OpenMP threads in steps of 32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../lora/native.h"

enum { OUT_OF_MEMORY = 1, NO_AMX = 3 };

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

int w8a8_init(void) { return amx_permit() ? NO_AMX : 0; }

/* tiles (amx_configure) 0-3: int32 results (rows 0-15 x cols 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31);
 * 4-5: xq rows 0-15 / 16-31 of a 64-wide K slice; 6-7: the two 16-column weight blocks of that slice */

static _Thread_local int8_t *scratch;
static _Thread_local size_t scratch_size;

/* Row t of x quantized into q (K entries, then zeros up to Kp); returns s_t. */
static float quantize_row(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        int n = K - k < 16 ? (int)(K - k) : 16;
        __m512 v = bf16 ? load_bf16((const uint16_t *)x + k, n) : load_f32((const float *)x + k, n);
        amax = _mm512_max_ps(amax, _mm512_and_ps(v, sign));
    }
    float scale = _mm512_reduce_max_ps(amax) / 127.0f;
    const float tiny = 1.17549435e-38f;   /* FLT_MIN: an all-zero row quantizes to zeros, not 0/0 */
    if (scale < tiny) scale = tiny;
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int64_t k = 0; k < K; k += 16) {
        int n = K - k < 16 ? (int)(K - k) : 16;
        __m512 v = bf16 ? load_bf16((const uint16_t *)x + k, n) : load_f32((const float *)x + k, n);
        __m512i r = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(v, s, RN), RN);
        r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
        _mm_mask_storeu_epi8(q + k, (__mmask16)((1u << n) - 1u), _mm512_cvtepi32_epi8(r));
    }
    memset(q + K, 0, Kp - K);
    return scale;
}

/* rows [m0, m0 + rows) x columns [n0, n0 + 16) of y from a 16 x 16 int32 tile */
static void store_block(const int32_t *acc, int64_t m0, int rows, int64_t n0, int64_t N, const float *x_scale,
                        const float *w_scale, const void *bias, int bias_bf16, void *y, int bf16) {
    if (n0 >= N) return;
    int n = N - n0 < 16 ? (int)(N - n0) : 16;
    __mmask16 mask = (__mmask16)((1u << n) - 1u);
    __m512 ws = _mm512_maskz_loadu_ps(mask, w_scale + n0);
    __m512 b = _mm512_setzero_ps();
    if (bias) b = bias_bf16 ? load_bf16((const uint16_t *)bias + n0, n) : load_f32((const float *)bias + n0, n);
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + 16 * r));
        v = _mm512_mul_round_ps(_mm512_mul_round_ps(v, ws, RN), _mm512_set1_ps(x_scale[m0 + r]), RN);
        if (bias) v = _mm512_add_round_ps(v, b, RN);
        int64_t at = (m0 + r) * N + n0;
        if (bf16) {
            uint16_t out[16];
            store_bf16(out, v);
            _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, _mm256_loadu_si256((const __m256i *)out));
        } else {
            _mm512_mask_storeu_ps((float *)y + at, mask, v);
        }
    }
}

/* y = the W8A8 linear of x; see the top of the file. */
int w8a8_linear(const void *x, int64_t x_stride, int x_bf16, int64_t M, int64_t K, const int8_t *w, int64_t N,
                const float *w_scale, const void *bias, int bias_bf16, void *y) {
    const int64_t Kp = (K + 63) / 64 * 64, Mp = (M + 31) / 32 * 32, Np = (N + 31) / 32 * 32;
    const int64_t chunks = Kp / 64, esize = x_bf16 ? 2 : 4;
    size_t need = (size_t)(Mp * Kp) + (size_t)Mp * sizeof(float);
    if (need > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        scratch_size = scratch ? need : 0;
        if (!scratch) return OUT_OF_MEMORY;
    }
    int8_t *xq = scratch;
    float *x_scale = (float *)(scratch + Mp * Kp);
    for (int64_t t = 0; t < M; t++)
        x_scale[t] = quantize_row((const char *)x + t * x_stride * esize, x_bf16, K, Kp, xq + t * Kp);
    memset(xq + M * Kp, 0, (size_t)((Mp - M) * Kp));

#pragma omp parallel
    {
        amx_configure();   /* once per thread and call */
        int32_t acc[4][256];
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < Np; n0 += 32) {
            const int8_t *b0 = w + (n0 / 16) * chunks * 1024, *b1 = b0 + chunks * 1024;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int8_t *a = xq + m0 * Kp;
                const int two = M - m0 > 16;   /* a second 16-row block has real rows */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(6, b0 + c * 1024, 64);
                    _tile_loadd(7, b1 + c * 1024, 64);
                    _tile_loadd(4, a + c * 64, Kp);
                    _tile_dpbssd(0, 4, 6);
                    _tile_dpbssd(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, a + 16 * Kp + c * 64, Kp);
                        _tile_dpbssd(2, 5, 6);
                        _tile_dpbssd(3, 5, 7);
                    }
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                store_block(acc[0], m0, rows, n0, N, x_scale, w_scale, bias, bias_bf16, y, x_bf16);
                store_block(acc[1], m0, rows, n0 + 16, N, x_scale, w_scale, bias, bias_bf16, y, x_bf16);
                if (two) {
                    _tile_stored(2, acc[2], 64);
                    _tile_stored(3, acc[3], 64);
                    rows = M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16;
                    store_block(acc[2], m0 + 16, rows, n0, N, x_scale, w_scale, bias, bias_bf16, y, x_bf16);
                    store_block(acc[3], m0 + 16, rows, n0 + 16, N, x_scale, w_scale, bias, bias_bf16, y, x_bf16);
                }
            }
        }
        _tile_release();
    }
    return 0;
}

#else   /* no AMX int8 in this build (LORASERVE_KERNEL_ARCH, or the CPU): callers keep oneDNN's path */

int w8a8_init(void) { return NO_AMX; }

int w8a8_linear(const void *x, int64_t x_stride, int x_bf16, int64_t M, int64_t K, const int8_t *w, int64_t N,
                const float *w_scale, const void *bias, int bias_bf16, void *y) {
    (void)x, (void)x_stride, (void)x_bf16, (void)M, (void)K, (void)w, (void)N, (void)w_scale, (void)bias;
    (void)bias_bf16, (void)y;
    return NO_AMX;
}

#endif
