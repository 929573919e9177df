/*
 * kda_avx2.c - KDA's delta-rule step (k3_kda_step; k3_kern.h) four columns
 * of the state at a time in double: kda_avx512.c on AVX2 (the same steps;
 * see there), the same bits as ref.c's. Up to 16 columns per pass over the
 * rows; columns left over go to the scalar code.
 */
#include <immintrin.h>

#include "k3_kern.h"
#include "kern_impl.h"

#define AI static inline __attribute__((always_inline))

/* Columns [j0, j0 + 4 nb) of the step. */
AI void cols4(float *S, uint32_t D, uint32_t j0, int nb, const double *decay, const double *k, const double *q,
              const float *v, double beta, double *o)
{
    __m256d u[4], dl[4], acc[4];
    for (int b = 0; b < nb; b++)
        u[b] = _mm256_setzero_pd();
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const __m256d di = _mm256_set1_pd(decay[i]), ki = _mm256_set1_pd(k[i]);
        for (int b = 0; b < nb; b++) {
            const __m128 f = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(row + 4 * b)), di));
            _mm_storeu_ps(row + 4 * b, f);
            u[b] = _mm256_add_pd(u[b], _mm256_mul_pd(_mm256_cvtps_pd(f), ki));
        }
    }
    const __m256d vb = _mm256_set1_pd(beta);
    for (int b = 0; b < nb; b++) {
        dl[b] = _mm256_mul_pd(vb, _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(v + j0 + 4 * b)), u[b]));
        acc[b] = _mm256_setzero_pd();
    }
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const __m256d ki = _mm256_set1_pd(k[i]), qi = _mm256_set1_pd(q[i]);
        for (int b = 0; b < nb; b++) {
            const __m128 f =
                _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(row + 4 * b)), _mm256_mul_pd(ki, dl[b])));
            _mm_storeu_ps(row + 4 * b, f);
            acc[b] = _mm256_add_pd(acc[b], _mm256_mul_pd(_mm256_cvtps_pd(f), qi));
        }
    }
    for (int b = 0; b < nb; b++)
        _mm256_storeu_pd(o + j0 + 4 * b, acc[b]);
}

void k3_kern_kda_step_avx2(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                           const float *v, double beta, double *o)
{
    uint32_t j = 0;
    for (; j + 16 <= D; j += 16)
        cols4(S, D, j, 4, decay, k, q, v, beta, o);
    for (; j + 4 <= D; j += 4)
        cols4(S, D, j, 1, decay, k, q, v, beta, o);
    if (j < D)
        k3_kern_kda_cols(S, D, j, D, decay, k, q, v, beta, o);
}
