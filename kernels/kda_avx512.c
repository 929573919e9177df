/*
 * kda_avx512.c - KDA's delta-rule step (k3_kda_step; k3_kern.h) eight
 * columns of the state at a time in double: each lane is one column j and
 * runs the scalar steps of ref.c's k3_kern_kda_cols for it (widen, multiply,
 * round to float, store; the column's sums over rows i ascending), so every
 * bit is the same; no FMA. Up to 32 columns per pass over the rows (four
 * independent chains of additions); columns left over go to the scalar code.
 */
#include <immintrin.h>

#include "k3_kern.h"
#include "kern_impl.h"

#define AI static inline __attribute__((always_inline))

/* Columns [j0, j0 + 8 nb) of the step. */
AI void cols8(float *S, uint32_t D, uint32_t j0, int nb, const double *decay, const double *k, const double *q,
              const float *v, double beta, double *o)
{
    __m512d u[4], dl[4], acc[4];
    for (int b = 0; b < nb; b++)
        u[b] = _mm512_setzero_pd();
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const __m512d di = _mm512_set1_pd(decay[i]), ki = _mm512_set1_pd(k[i]);
        for (int b = 0; b < nb; b++) {
            const __m256 f = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(row + 8 * b)), di));
            _mm256_storeu_ps(row + 8 * b, f);
            u[b] = _mm512_add_pd(u[b], _mm512_mul_pd(_mm512_cvtps_pd(f), ki));
        }
    }
    const __m512d vb = _mm512_set1_pd(beta);
    for (int b = 0; b < nb; b++) {
        dl[b] = _mm512_mul_pd(vb, _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(v + j0 + 8 * b)), u[b]));
        acc[b] = _mm512_setzero_pd();
    }
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const __m512d ki = _mm512_set1_pd(k[i]), qi = _mm512_set1_pd(q[i]);
        for (int b = 0; b < nb; b++) {
            const __m256 f =
                _mm512_cvtpd_ps(_mm512_add_pd(_mm512_cvtps_pd(_mm256_loadu_ps(row + 8 * b)), _mm512_mul_pd(ki, dl[b])));
            _mm256_storeu_ps(row + 8 * b, f);
            acc[b] = _mm512_add_pd(acc[b], _mm512_mul_pd(_mm512_cvtps_pd(f), qi));
        }
    }
    for (int b = 0; b < nb; b++)
        _mm512_storeu_pd(o + j0 + 8 * b, acc[b]);
}

void k3_kern_kda_step_avx512(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                             const float *v, double beta, double *o)
{
    uint32_t j = 0;
    for (; j + 32 <= D; j += 32)
        cols8(S, D, j, 4, decay, k, q, v, beta, o);
    for (; j + 8 <= D; j += 8)
        cols8(S, D, j, 1, decay, k, q, v, beta, o);
    if (j < D)
        k3_kern_kda_cols(S, D, j, D, decay, k, q, v, beta, o);
}
