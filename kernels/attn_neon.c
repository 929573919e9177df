/*
 * attn_neon.c - the attention and exponential kernels on aarch64 Advanced
 * SIMD, the same bits as ref.c's (aarch64 builds only): k3_dot8x4 and
 * k3_axpy4 four float lanes at a time (a dot's eight partial sums are two
 * registers), k3_kda_step two double columns at a time (up to 8 columns per
 * pass over the rows), k3_exp_n and k3_expf_n two doubles at a time, lane by
 * lane ref.c's steps. Multiplies and adds stay separate (no FMA: these are
 * not the products, whose contract is fmaf); tails, combines and blocks
 * outside the exponentials' vector range run the scalar code.
 */
#include <arm_neon.h>

#include "k3_kern.h"
#include "kern_impl.h"

#define AI static inline __attribute__((always_inline))

void k3_kern_dot8x4_neon(const float *a, const float *const b[4], uint32_t n, float out[4])
{
    float32x4_t lo[4], hi[4];
    for (int j = 0; j < 4; j++)
        lo[j] = hi[j] = vdupq_n_f32(0.0f);
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const float32x4_t x0 = vld1q_f32(a + c), x1 = vld1q_f32(a + c + 4);
        for (int j = 0; j < 4; j++) {
            lo[j] = vaddq_f32(lo[j], vmulq_f32(x0, vld1q_f32(b[j] + c)));
            hi[j] = vaddq_f32(hi[j], vmulq_f32(x1, vld1q_f32(b[j] + c + 4)));
        }
    }
    float p[4][8];
    for (int j = 0; j < 4; j++) {
        vst1q_f32(p[j], lo[j]);
        vst1q_f32(p[j] + 4, hi[j]);
    }
    k3_kern_dot8x4_finish(a, b, c, n, p, out);
}

void k3_kern_axpy4_neon(float *y, const float w[4], const float *const x[4], uint32_t n)
{
    const float32x4_t w0 = vdupq_n_f32(w[0]), w1 = vdupq_n_f32(w[1]), w2 = vdupq_n_f32(w[2]), w3 = vdupq_n_f32(w[3]);
    uint32_t c = 0;
    for (; c + 4 <= n; c += 4) {
        float32x4_t v = vld1q_f32(y + c);
        v = vaddq_f32(v, vmulq_f32(w0, vld1q_f32(x[0] + c)));
        v = vaddq_f32(v, vmulq_f32(w1, vld1q_f32(x[1] + c)));
        v = vaddq_f32(v, vmulq_f32(w2, vld1q_f32(x[2] + c)));
        v = vaddq_f32(v, vmulq_f32(w3, vld1q_f32(x[3] + c)));
        vst1q_f32(y + c, v);
    }
    for (; c < n; c++)
        y[c] = (((y[c] + w[0] * x[0][c]) + w[1] * x[1][c]) + w[2] * x[2][c]) + w[3] * x[3][c];
}

/* Columns [j0, j0 + 2 nb) of the KDA step (ref.c's k3_kern_kda_cols, a
 * column per lane). */
AI void kda_cols2(float *S, uint32_t D, uint32_t j0, int nb, const double *decay, const double *k, const double *q,
                  const float *v, double beta, double *o)
{
    float64x2_t u[4], dl[4], acc[4];
    for (int b = 0; b < nb; b++)
        u[b] = vdupq_n_f64(0.0);
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const float64x2_t di = vdupq_n_f64(decay[i]), ki = vdupq_n_f64(k[i]);
        for (int b = 0; b < nb; b++) {
            const float32x2_t f = vcvt_f32_f64(vmulq_f64(vcvt_f64_f32(vld1_f32(row + 2 * b)), di));
            vst1_f32(row + 2 * b, f);
            u[b] = vaddq_f64(u[b], vmulq_f64(vcvt_f64_f32(f), ki));
        }
    }
    const float64x2_t vb = vdupq_n_f64(beta);
    for (int b = 0; b < nb; b++) {
        dl[b] = vmulq_f64(vb, vsubq_f64(vcvt_f64_f32(vld1_f32(v + j0 + 2 * b)), u[b]));
        acc[b] = vdupq_n_f64(0.0);
    }
    for (uint32_t i = 0; i < D; i++) {
        float *row = S + (uint64_t)i * D + j0;
        const float64x2_t ki = vdupq_n_f64(k[i]), qi = vdupq_n_f64(q[i]);
        for (int b = 0; b < nb; b++) {
            const float32x2_t f = vcvt_f32_f64(vaddq_f64(vcvt_f64_f32(vld1_f32(row + 2 * b)), vmulq_f64(ki, dl[b])));
            vst1_f32(row + 2 * b, f);
            acc[b] = vaddq_f64(acc[b], vmulq_f64(vcvt_f64_f32(f), qi));
        }
    }
    for (int b = 0; b < nb; b++)
        vst1q_f64(o + j0 + 2 * b, acc[b]);
}

void k3_kern_kda_step_neon(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                           const float *v, double beta, double *o)
{
    uint32_t j = 0;
    for (; j + 8 <= D; j += 8)
        kda_cols2(S, D, j, 4, decay, k, q, v, beta, o);
    for (; j + 2 <= D; j += 2)
        kda_cols2(S, D, j, 1, decay, k, q, v, beta, o);
    if (j < D)
        k3_kern_kda_cols(S, D, j, D, decay, k, q, v, beta, o);
}

/* ref.c's exp_reduce, Horner sum and scale2 (2^k a normal double) */
AI float64x2_t exp_core(float64x2_t x, const double *c, int nc)
{
    const float64x2_t y = vaddq_f64(vmulq_f64(x, vdupq_n_f64(K3_KERN_INV_LN2)), vdupq_n_f64(0.5));
    const float64x2_t kd = vrndmq_f64(y);
    const float64x2_t r = vsubq_f64(vsubq_f64(x, vmulq_f64(kd, vdupq_n_f64(K3_KERN_LN2_HI))),
                                    vmulq_f64(kd, vdupq_n_f64(K3_KERN_LN2_LO)));
    float64x2_t p = vdupq_n_f64(c[0]);
    for (int i = 1; i < nc; i++)
        p = vaddq_f64(vmulq_f64(p, r), vdupq_n_f64(c[i]));
    const int64x2_t e = vshlq_n_s64(vaddq_s64(vcvtq_s64_f64(kd), vdupq_n_s64(1023)), 52);
    return vmulq_f64(p, vreinterpretq_f64_s64(e));
}

void k3_kern_exp_n_neon(double *y, const double *x, uint64_t n)
{
    uint64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        const float64x2_t v = vld1q_f64(x + i);
        const uint64x2_t ok = vandq_u64(vcgeq_f64(v, vdupq_n_f64(-708.0)), vcleq_f64(v, vdupq_n_f64(709.0)));
        if (vgetq_lane_u64(ok, 0) != UINT64_MAX || vgetq_lane_u64(ok, 1) != UINT64_MAX) {
            y[i] = k3_exp(x[i]);
            y[i + 1] = k3_exp(x[i + 1]);
            continue;
        }
        vst1q_f64(y + i, exp_core(v, k3_kern_exp_c, 14));
    }
    for (; i < n; i++)
        y[i] = k3_exp(x[i]);
}

void k3_kern_expf_n_neon(float *y, const float *x, uint64_t n)
{
    uint64_t i = 0;
    for (; i + 2 <= n; i += 2) {
        const float64x2_t v = vcvt_f64_f32(vld1_f32(x + i));
        /* finite and inside k3_expf's cut-offs: the series; else scalar */
        const uint64x2_t ok = vandq_u64(vcgeq_f64(v, vdupq_n_f64(-104.0)), vcleq_f64(v, vdupq_n_f64(89.0)));
        if (vgetq_lane_u64(ok, 0) != UINT64_MAX || vgetq_lane_u64(ok, 1) != UINT64_MAX) {
            y[i] = k3_expf(x[i]);
            y[i + 1] = k3_expf(x[i + 1]);
            continue;
        }
        vst1_f32(y + i, vcvt_f32_f64(exp_core(v, k3_kern_expf_c, 9)));
    }
    for (; i < n; i++)
        y[i] = k3_expf(x[i]);
}
