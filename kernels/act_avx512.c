/*
 * act_avx512.c - SiTU-GLU (k3_situ) eight lanes at a time in double, the
 * same bits as ref.c's: every lane runs ref.c's k3_tanhf and k3_expf
 * operation for operation (no fused multiply-add, the same constants, both
 * sides of each branch computed and the one ref.c takes kept), and every
 * float operation of the activation is the same float operation. Lanes whose
 * input is not finite, and the tail, go through the scalar functions.
 * Also k3_exp_n and k3_expf_n, k3_exp and k3_expf of eight values at a
 * time in the same way.
 */
#include <immintrin.h>

#include "k3_kern.h"
#include "kern_impl.h"

#define AI static inline __attribute__((always_inline))

/* p * 2^k for whole-number doubles k in [-1022, 1023] (ref.c's scale2 on its
 * fast path: the callers' ranges never leave it) */
AI __m512d scale2(__m512d p, __m512d kd)
{
    __m512i k = _mm512_cvtpd_epi64(kd);
    __m512i b = _mm512_slli_epi64(_mm512_add_epi64(k, _mm512_set1_epi64(1023)), 52);
    return _mm512_mul_pd(p, _mm512_castsi512_pd(b));
}

/* ref.c's exp_reduce and Horner sum, for |x| < 745: e^x */
AI __m512d exp_core(__m512d x, const double *c, int nc)
{
    const __m512d y = _mm512_add_pd(_mm512_mul_pd(x, _mm512_set1_pd(K3_KERN_INV_LN2)), _mm512_set1_pd(0.5));
    const __m512d kd = _mm512_roundscale_pd(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512d r = _mm512_sub_pd(_mm512_sub_pd(x, _mm512_mul_pd(kd, _mm512_set1_pd(K3_KERN_LN2_HI))),
                                    _mm512_mul_pd(kd, _mm512_set1_pd(K3_KERN_LN2_LO)));
    __m512d p = _mm512_set1_pd(c[0]);
    for (int i = 1; i < nc; i++)
        p = _mm512_add_pd(_mm512_mul_pd(p, r), _mm512_set1_pd(c[i]));
    return scale2(p, kd);
}

/* k3_expf of finite x (as doubles), rounded to float */
AI __m256 expf8(__m512d x)
{
    __m512d e = exp_core(x, k3_kern_expf_c, 9);
    e = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_set1_pd(89.0), _CMP_GT_OQ), e,
                             _mm512_set1_pd(__builtin_inf()));
    e = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_set1_pd(-104.0), _CMP_LT_OQ), e, _mm512_setzero_pd());
    return _mm512_cvtpd_ps(e);
}

/* k3_tanhf of finite x (as doubles), rounded to float */
AI __m256 tanhf8(__m512d x)
{
    const __m512d sign = _mm512_set1_pd(-0.0);
    const __m512d a = _mm512_andnot_pd(sign, x);
    const __m512d a2 = _mm512_mul_pd(_mm512_set1_pd(2.0), a);
    /* e^2a - 1: the series near 0, else k3_exp(2a) - 1 (2a <= 40 here) */
    __m512d s = _mm512_set1_pd(k3_kern_expm1_c[0]);
    for (int i = 1; i < 14; i++)
        s = _mm512_add_pd(_mm512_mul_pd(s, a2), _mm512_set1_pd(k3_kern_expm1_c[i]));
    s = _mm512_mul_pd(s, a2);
    const __m512d big = _mm512_sub_pd(exp_core(a2, k3_kern_exp_c, 14), _mm512_set1_pd(1.0));
    const __m512d em = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a2, _mm512_set1_pd(0.34), _CMP_LT_OQ), big, s);
    __m512d t = _mm512_div_pd(em, _mm512_add_pd(em, _mm512_set1_pd(2.0)));
    t = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(a, _mm512_set1_pd(20.0), _CMP_GT_OQ), t, _mm512_set1_pd(1.0));
    t = _mm512_or_pd(_mm512_andnot_pd(sign, t), _mm512_and_pd(sign, x));   /* copysign */
    return _mm512_cvtpd_ps(t);
}

/* The activation of 8 lanes, all inputs finite. */
AI __m256 situ8(__m256 g, __m256 u, __m256 b1, __m256 b2)
{
    const __m256 th = tanhf8(_mm512_cvtps_pd(_mm256_div_ps(g, b1)));
    const __m256 ex = expf8(_mm512_cvtps_pd(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f))));   /* -g */
    const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), ex));
    const __m256 gate = _mm256_mul_ps(_mm256_mul_ps(b1, th), sig);
    const __m256 tu = tanhf8(_mm512_cvtps_pd(_mm256_div_ps(u, b2)));
    return _mm256_mul_ps(gate, _mm256_mul_ps(b2, tu));
}

void k3_kern_situ_avx512(float *g, const float *u, uint64_t n, float b1, float b2)
{
    const __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    const __m256 inf = _mm256_set1_ps(__builtin_inff()), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(u + i);
        /* a lane whose g, g / b1 or u / b2 is not finite: the block by the
         * scalar code (NaN payloads through tanh and exp are its business) */
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

/* k3_exp of 8 doubles: lanes in [-708, 709] (where 2^k is a normal double)
 * by exp_core, a block with any other lane (NaN, infinities, overflow,
 * subnormal results) by the scalar k3_exp */
void k3_kern_exp_n_avx512(double *y, const double *x, uint64_t n)
{
    const __m512d lo = _mm512_set1_pd(-708.0), hi = _mm512_set1_pd(709.0);
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m512d v = _mm512_loadu_pd(x + i);
        const __mmask8 ok = _mm512_cmp_pd_mask(v, lo, _CMP_GE_OQ) & _mm512_cmp_pd_mask(v, hi, _CMP_LE_OQ);
        if (ok != 0xff) {
            for (int l = 0; l < 8; l++)
                y[i + l] = k3_exp(x[i + l]);
            continue;
        }
        _mm512_storeu_pd(y + i, exp_core(v, k3_kern_exp_c, 14));
    }
    for (; i < n; i++)
        y[i] = k3_exp(x[i]);
}

/* k3_expf of 8 floats: finite lanes by expf8 (its range checks are
 * k3_expf's), a block with a NaN or an infinity by the scalar k3_expf */
void k3_kern_expf_n_avx512(float *y, const float *x, uint64_t n)
{
    const __m256 inf = _mm256_set1_ps(__builtin_inff()), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v, abs), inf, _CMP_NLT_UQ))) {
            for (int l = 0; l < 8; l++)
                y[i + l] = k3_expf(x[i + l]);
            continue;
        }
        _mm256_storeu_ps(y + i, expf8(_mm512_cvtps_pd(v)));
    }
    for (; i < n; i++)
        y[i] = k3_expf(x[i]);
}
