/*
 * gemm_avx512bf16.c - the opt-in "avx512bf16" path: bf16 weights times
 * activations ROUNDED TO BF16, with vdpbf16ps. Never chosen automatically;
 * only K3_ISA=avx512bf16 or k3_kern_use("avx512bf16") select it.
 *
 * It does not follow the ref.c contract: each activation is rounded to bf16
 * (relative error up to 2^-9), pairs of products are summed in the
 * instruction's own order with denormals flushed, and there are 16 lanes of
 * pairs instead of 32 lanes. The tested bound (tests/t_kernels.c) is
 *   |y - y_ref| <= 2^-8 * sum_c |w_c * x_c| + 2^-100
 * per output. Results are still identical for every thread count (threads
 * split rows; each row's order is fixed). MXFP4 products on this path are
 * the exact avx512 ones.
 *
 * Why it can pay: no weight decode at all (a 64-byte load is 32 bf16 weights
 * in the pair order vdpbf16ps wants) and one instruction per 32 multiply-adds,
 * against two FMAs plus two widenings in the exact path. At T = 1 the exact
 * path is already memory-bound, so the gain is in the batched form.
 */
#include "k3_kern.h"
#include "kern_impl.h"

#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

AI float fold16(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
    return _mm_cvtss_f32(d);
}

AI void dot_tile(const uint16_t *W, uint64_t rows, uint64_t cols, const float *X, float *Y,
                 uint64_t r, uint32_t t0, const int R, const int TB)
{
    __m512 acc[4][4];
    const uint16_t *w[4];
    const float *x[4];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        w[i] = W + (r + (uint64_t)i) * cols;
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            acc[i][j] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;
    uint64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512bh xb[4];
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            xb[j] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x[j] + c + 16), _mm512_loadu_ps(x[j] + c));
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            __m512bh wb = (__m512bh)_mm512_loadu_si512((const void *)(w[i] + c));
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wb, xb[j]);
        }
    }
    if (c < cols) {
        uint64_t n = cols - c;
        __mmask32 mw = (__mmask32)((n >= 32 ? 0xffffffffu : (1u << n) - 1u));
        __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u);
        __mmask16 m1 = (__mmask16)(n > 16 ? (1u << (n - 16)) - 1u : 0u);
        __m512bh xb[4];
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            xb[j] = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x[j] + c + 16),
                                        _mm512_maskz_loadu_ps(m0, x[j] + c));
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            __m512bh wb = (__m512bh)_mm512_maskz_loadu_epi16(mw, w[i] + c);
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wb, xb[j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            Y[(uint64_t)(t0 + (uint32_t)j) * rows + r + (uint64_t)i] = fold16(acc[i][j]);
}

typedef void (*dot_tile_fn)(const uint16_t *, uint64_t, uint64_t, const float *, float *, uint64_t, uint32_t);
#define DOT_TILE_FN(R, TB)                                                                 \
    static void dot_##R##x##TB(const uint16_t *W, uint64_t rows, uint64_t cols,            \
                               const float *X, float *Y, uint64_t r, uint32_t t0)          \
    {                                                                                      \
        dot_tile(W, rows, cols, X, Y, r, t0, R, TB);                                       \
    }
DOT_TILE_FN(4, 1)
DOT_TILE_FN(4, 2)
DOT_TILE_FN(4, 3)
DOT_TILE_FN(4, 4)
DOT_TILE_FN(1, 1)
DOT_TILE_FN(1, 2)
DOT_TILE_FN(1, 3)
DOT_TILE_FN(1, 4)

static void bf16dot_gemm_bf16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                                   const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    static const dot_tile_fn four[5] = {0, dot_4x1, dot_4x2, dot_4x3, dot_4x4};
    static const dot_tile_fn one[5] = {0, dot_1x1, dot_1x2, dot_1x3, dot_1x4};
    uint64_t r = r0;
    for (; r + 4 <= r1; r += 4)
        for (uint32_t t = 0; t < T; t += 4)
            four[T - t >= 4 ? 4 : T - t](W, rows, cols, X, Y, r, t);
    for (; r < r1; r++)
        for (uint32_t t = 0; t < T; t += 4)
            one[T - t >= 4 ? 4 : T - t](W, rows, cols, X, Y, r, t);
}

static void bf16dot_gemm_mx_rows(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                                 uint64_t cols, const float *X, uint32_t T, float *Y,
                                 uint64_t r0, uint64_t r1)
{
    k3_kern_path_avx512.gemm_mx_rows(packed, scales, rows, cols, X, T, Y, r0, r1);
}

const k3_kern_path k3_kern_path_avx512bf16 = {
    .name = "avx512bf16",
    .gemm_bf16_rows = bf16dot_gemm_bf16_rows,
    .gemm_mx_rows = bf16dot_gemm_mx_rows,
};
