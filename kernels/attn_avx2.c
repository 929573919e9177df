/*
 * attn_avx2.c - the attention primitives (k3_dot8x4, k3_axpy4; k3_kern.h)
 * eight lanes at a time: a dot's eight partial sums are the eight lanes of
 * one register, so each lane adds exactly the products the scalar sum
 * s[c mod 8] adds, in the same order; the tail and the final combine run
 * the scalar steps on the stored lanes. Multiplies and adds stay separate
 * (no FMA), as in ref.c. The AVX-512 path uses these too.
 */
#include <immintrin.h>

#include "k3_kern.h"
#include "kern_impl.h"

void k3_kern_dot8x4_avx2(const float *a, const float *const b[4], uint32_t n, float out[4])
{
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2], *b3 = b[3];
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 x = _mm256_loadu_ps(a + c);
        s0 = _mm256_add_ps(s0, _mm256_mul_ps(x, _mm256_loadu_ps(b0 + c)));
        s1 = _mm256_add_ps(s1, _mm256_mul_ps(x, _mm256_loadu_ps(b1 + c)));
        s2 = _mm256_add_ps(s2, _mm256_mul_ps(x, _mm256_loadu_ps(b2 + c)));
        s3 = _mm256_add_ps(s3, _mm256_mul_ps(x, _mm256_loadu_ps(b3 + c)));
    }
    float p[4][8];
    _mm256_storeu_ps(p[0], s0);
    _mm256_storeu_ps(p[1], s1);
    _mm256_storeu_ps(p[2], s2);
    _mm256_storeu_ps(p[3], s3);
    k3_kern_dot8x4_finish(a, b, c, n, p, out);
}

void k3_kern_axpy4_avx2(float *y, const float w[4], const float *const x[4], uint32_t n)
{
    const __m256 w0 = _mm256_set1_ps(w[0]), w1 = _mm256_set1_ps(w[1]), w2 = _mm256_set1_ps(w[2]),
                 w3 = _mm256_set1_ps(w[3]);
    const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 v = _mm256_loadu_ps(y + c);
        v = _mm256_add_ps(v, _mm256_mul_ps(w0, _mm256_loadu_ps(x0 + c)));
        v = _mm256_add_ps(v, _mm256_mul_ps(w1, _mm256_loadu_ps(x1 + c)));
        v = _mm256_add_ps(v, _mm256_mul_ps(w2, _mm256_loadu_ps(x2 + c)));
        v = _mm256_add_ps(v, _mm256_mul_ps(w3, _mm256_loadu_ps(x3 + c)));
        _mm256_storeu_ps(y + c, v);
    }
    for (; c < n; c++)
        y[c] = (((y[c] + w[0] * x0[c]) + w[1] * x1[c]) + w[2] * x2[c]) + w[3] * x3[c];
}
