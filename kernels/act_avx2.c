/*
 * act_avx2.c - SiTU-GLU (k3_situ) four lanes at a time in double: act_avx512.c
 * on AVX2 (the same steps; see there), the same bits as ref.c's; and
 * k3_exp_n and k3_expf_n, four values at a time.
 */
#include <immintrin.h>

#include "k3_kern.h"
#include "kern_impl.h"

#define AI static inline __attribute__((always_inline))

/* p * 2^k for whole-number doubles k in [-1022, 1023] */
AI __m256d scale2(__m256d p, __m256d kd)
{
    __m256i k = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(kd));
    __m256i b = _mm256_slli_epi64(_mm256_add_epi64(k, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(b));
}

AI __m256d exp_core(__m256d x, const double *c, int nc)
{
    const __m256d y = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(K3_KERN_INV_LN2)), _mm256_set1_pd(0.5));
    const __m256d kd = _mm256_round_pd(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(kd, _mm256_set1_pd(K3_KERN_LN2_HI))),
                                    _mm256_mul_pd(kd, _mm256_set1_pd(K3_KERN_LN2_LO)));
    __m256d p = _mm256_set1_pd(c[0]);
    for (int i = 1; i < nc; i++)
        p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(c[i]));
    return scale2(p, kd);
}

AI __m128 expf4(__m256d x)
{
    __m256d e = exp_core(x, k3_kern_expf_c, 9);
    e = _mm256_blendv_pd(e, _mm256_set1_pd(__builtin_inf()), _mm256_cmp_pd(x, _mm256_set1_pd(89.0), _CMP_GT_OQ));
    e = _mm256_blendv_pd(e, _mm256_setzero_pd(), _mm256_cmp_pd(x, _mm256_set1_pd(-104.0), _CMP_LT_OQ));
    return _mm256_cvtpd_ps(e);
}

AI __m128 tanhf4(__m256d x)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    const __m256d a = _mm256_andnot_pd(sign, x);
    const __m256d a2 = _mm256_mul_pd(_mm256_set1_pd(2.0), a);
    __m256d s = _mm256_set1_pd(k3_kern_expm1_c[0]);
    for (int i = 1; i < 14; i++)
        s = _mm256_add_pd(_mm256_mul_pd(s, a2), _mm256_set1_pd(k3_kern_expm1_c[i]));
    s = _mm256_mul_pd(s, a2);
    const __m256d big = _mm256_sub_pd(exp_core(a2, k3_kern_exp_c, 14), _mm256_set1_pd(1.0));
    const __m256d em = _mm256_blendv_pd(big, s, _mm256_cmp_pd(a2, _mm256_set1_pd(0.34), _CMP_LT_OQ));
    __m256d t = _mm256_div_pd(em, _mm256_add_pd(em, _mm256_set1_pd(2.0)));
    t = _mm256_blendv_pd(t, _mm256_set1_pd(1.0), _mm256_cmp_pd(a, _mm256_set1_pd(20.0), _CMP_GT_OQ));
    t = _mm256_or_pd(_mm256_andnot_pd(sign, t), _mm256_and_pd(sign, x));
    return _mm256_cvtpd_ps(t);
}

/* float x 4 -> double x 4 through f, back to float */
#define HALVES(f, v) _mm256_set_m128(f(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))), \
                                     f(_mm256_cvtps_pd(_mm256_castps256_ps128(v))))

AI __m256 situ8(__m256 g, __m256 u, __m256 b1, __m256 b2)
{
    const __m256 q = _mm256_div_ps(g, b1), mg = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f)), w = _mm256_div_ps(u, b2);
    const __m256 th = HALVES(tanhf4, q);
    const __m256 ex = HALVES(expf4, mg);
    const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), ex));
    const __m256 gate = _mm256_mul_ps(_mm256_mul_ps(b1, th), sig);
    const __m256 tu = HALVES(tanhf4, w);
    return _mm256_mul_ps(gate, _mm256_mul_ps(b2, tu));
}

void k3_kern_situ_avx2(float *g, const float *u, uint64_t n, float b1, float b2)
{
    const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    const __m256 inf = _mm256_set1_ps(__builtin_inff()), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(u + i);
        const __m256 q1 = _mm256_and_ps(_mm256_div_ps(x, vb1), abs), q2 = _mm256_and_ps(_mm256_div_ps(y, vb2), abs);
        const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(x, abs), inf, _CMP_NLT_UQ),
                                        _mm256_or_ps(_mm256_cmp_ps(q1, inf, _CMP_NLT_UQ), _mm256_cmp_ps(q2, inf, _CMP_NLT_UQ)));
        if (_mm256_movemask_ps(bad)) {
            k3_kern_situ_scalar(g + i, u + i, 8, b1, b2);
            continue;
        }
        _mm256_storeu_ps(g + i, situ8(x, y, vb1, vb2));
    }
    k3_kern_situ_scalar(g + i, u + i, n - i, b1, b2);
}

/* k3_exp of 4 doubles: act_avx512.c's k3_kern_exp_n_avx512 on AVX2 */
void k3_kern_exp_n_avx2(double *y, const double *x, uint64_t n)
{
    const __m256d lo = _mm256_set1_pd(-708.0), hi = _mm256_set1_pd(709.0);
    uint64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d v = _mm256_loadu_pd(x + i);
        const __m256d ok = _mm256_and_pd(_mm256_cmp_pd(v, lo, _CMP_GE_OQ), _mm256_cmp_pd(v, hi, _CMP_LE_OQ));
        if (_mm256_movemask_pd(ok) != 0xf) {
            for (int l = 0; l < 4; l++)
                y[i + l] = k3_exp(x[i + l]);
            continue;
        }
        _mm256_storeu_pd(y + i, exp_core(v, k3_kern_exp_c, 14));
    }
    for (; i < n; i++)
        y[i] = k3_exp(x[i]);
}

/* k3_expf of 4 floats: act_avx512.c's k3_kern_expf_n_avx512 on AVX2 */
void k3_kern_expf_n_avx2(float *y, const float *x, uint64_t n)
{
    const __m128 inf = _mm_set1_ps(__builtin_inff()), abs = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    uint64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m128 v = _mm_loadu_ps(x + i);
        if (_mm_movemask_ps(_mm_cmp_ps(_mm_and_ps(v, abs), inf, _CMP_NLT_UQ))) {
            for (int l = 0; l < 4; l++)
                y[i + l] = k3_expf(x[i + l]);
            continue;
        }
        _mm_storeu_ps(y + i, expf4(_mm256_cvtps_pd(v)));
    }
    for (; i < n; i++)
        y[i] = k3_expf(x[i]);
}
