/*
 * kda.c - the Kimi Delta Attention layer (docs/MODEL.md §1.4) over a pass of tokens.
 *
 * Projections are applied to the whole pass at once (every segment's rows);
 * the short causal conv and the delta-rule recurrence then run per segment,
 * token by token, in position order, carrying its session's state (conv
 * history: the last conv-1 projected inputs of q, k, v; recurrent state: one
 * D x D matrix per head, rows = key channels). (Segment, head) pairs are
 * independent and are split across threads; within a head every loop has
 * one fixed order and everything except the stored state
 * is double (the state's two passes are k3_kda_step, k3_kern.h, vectorised
 * over the state's columns on every path with the same bits):
 *   conv   = sum_i w[i] * x[t-CW+1+i]               i ascending, then SiLU
 *   q, k   = x / sqrt(sum x^2 + 1e-6)               sums i ascending; q also * D^-0.5
 *   decay  = exp(lb * sigmoid(exp(A_log) * (z + dt_bias))),  beta = sigmoid(b)
 *   S[i][j] = (float)(S[i][j] * decay[i])
 *   u[j]  = sum_i S[i][j] * k[i]                     i ascending
 *   S[i][j] = (float)(S[i][j] + k[i] * (beta * (v[j] - u[j])))
 *   o[j]  = sum_i S[i][j] * q[i]                     i ascending
 *   out   = (float)(o_norm * o / sqrt(mean(o^2) + eps) * sigmoid(g))
 * Only the state (one D x D float matrix per head, the session's memory) and
 * the conv outputs handed to the recurrence are rounded to float. Why double:
 * o = S^T q is often far smaller than |S||q| (cancellation) and the per-head
 * RMSNorm then scales it back up, so every rounding inside the recurrence is
 * amplified; measured on the tiny gate sequence the recurrence's own error
 * (given the same inputs) drops from up to 7.5e-6 to 9e-7 relative per head
 * and the worst logit error over seeds 1..20 from 1.7e-4 to about 8e-5 (see
 * tests/ref/README.md, "float32 floor"). The state stays float: keeping it
 * in double (2x session memory) measured no better end to end, the inputs'
 * float rounding dominates.
 */
#include <string.h>

#include "k3_kern.h"
#include "model_int.h"

/* Channels a short_conv work unit takes: their SiLUs' exponentials go to
 * k3_exp_n together. */
#define CONV_BLOCK 256u

/* y = SiLU(causal depthwise conv) for the pass's rows of P channels, each
 * segment on its own history (the CW-1 previous inputs, oldest first, at
 * hist_off floats into its session's conv_hist), advanced past its rows.
 * Blocks of channels are the parallel units; each channel's sums and SiLU
 * are the same operations whatever the block. */
static void short_conv(const k3_model *m, const float *in, const float *w, uint64_t hist_off, float *y)
{
    const uint32_t P = m->d.P, CW = m->d.CW, HW = CW - 1, nb = (P + CONV_BLOCK - 1) / CONV_BLOCK;
    K3_PAR_FOR((uint64_t)P * m->rows * CW > K3_PAR_MIN,
    for (uint32_t b = 0; b < nb; b++) {
        const uint32_t c0 = b * CONV_BLOCK, nc = P - c0 < CONV_BLOCK ? P - c0 : CONV_BLOCK;
        double acc[CONV_BLOCK], ex[CONV_BLOCK];
        for (uint32_t g = 0; g < m->nseg; g++) {
            const k3_seg *sg = &m->segs[g];
            float *hist = sg->s->conv_hist + hist_off;
            const float *x0 = in + (uint64_t)sg->row * P;
            float *y0 = y + (uint64_t)sg->row * P;
            const uint32_t T = sg->n;
            for (uint32_t t = 0; t < T; t++) {
                for (uint32_t k = 0; k < nc; k++) {
                    const uint32_t c = c0 + k;
                    double a = 0.0;
                    for (uint32_t i = 0; i < CW; i++) {
                        int64_t tau = (int64_t)t - (int64_t)HW + i;
                        float x = tau >= 0 ? x0[(uint64_t)tau * P + c] : hist[(uint64_t)(HW + tau) * P + c];
                        a += (double)w[(uint64_t)c * CW + i] * (double)x;
                    }
                    acc[k] = a;
                    ex[k] = -a;
                }
                k3_exp_n(ex, ex, nc);
                for (uint32_t k = 0; k < nc; k++)
                    y0[(uint64_t)t * P + c0 + k] = (float)(acc[k] / (1.0 + ex[k]));
            }
            /* new history: the last HW inputs of (hist, in); reads stay ahead of writes */
            for (uint32_t c = c0; c < c0 + nc; c++)
                for (uint32_t k = 0; k < HW; k++) {
                    int64_t tau = (int64_t)T - (int64_t)HW + k;
                    hist[(uint64_t)k * P + c] =
                        tau >= 0 ? x0[(uint64_t)tau * P + c] : hist[(uint64_t)(HW + tau) * P + c];
                }
        }
    });
}

int k3_kda_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e)
{
    const k3_dims *d = &m->d;
    const uint32_t H = d->H, D = d->D, P = d->P, CW = d->CW;
    const uint32_t idx = m->layer_slot[layer];

    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_Q], m->xn, T, m->kq, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_K], m->xn, T, m->kk, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_V], m->xn, T, m->kv, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_G], m->xn, T, m->kg, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_B], m->xn, T, m->kb, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_FA], m->xn, T, m->kfa, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_FB], m->kfa, T, m->kz, e));

    const uint64_t hist = (uint64_t)idx * 3 * (CW - 1) * P, hstride = (uint64_t)(CW - 1) * P;
    short_conv(m, m->kq, m->vf[K3_W_KDA_QCONV], hist, m->kcq);
    short_conv(m, m->kk, m->vf[K3_W_KDA_KCONV], hist + hstride, m->kck);
    short_conv(m, m->kv, m->vf[K3_W_KDA_VCONV], hist + 2 * hstride, m->kcv);

    const float *alog = m->vf[K3_W_KDA_ALOG], *dtb = m->vf[K3_W_KDA_DTBIAS], *onorm = m->vf[K3_W_KDA_ONORM];
    const double lb = (double)d->lb, eps = (double)d->eps, qscale = 1.0 / sqrt((double)D);
    const uint32_t units = m->nseg * H;   /* (segment, head): independent recurrences */

    K3_PAR_FOR((uint64_t)H * T * D * D > K3_PAR_MIN,
    for (uint32_t un = 0; un < units; un++) {
        const k3_seg *sg = &m->segs[un / H];
        const uint32_t h = un % H;
        double q[D], k[D], decay[D], o[D];
        float *S = sg->s->kda_state + ((uint64_t)idx * H + h) * D * D;
        const double ah = k3_exp((double)alog[h]);
        for (uint32_t t = sg->row; t < sg->row + sg->n; t++) {
            const uint64_t off = (uint64_t)t * P + (uint64_t)h * D;
            const float *qf = m->kcq + off, *kf = m->kck + off, *vf = m->kcv + off;
            double sq = 0.0, sk = 0.0;
            for (uint32_t i = 0; i < D; i++) {
                sq += (double)qf[i] * (double)qf[i];
                sk += (double)kf[i] * (double)kf[i];
            }
            const double rq = qscale / sqrt(sq + 1e-6), rk = 1.0 / sqrt(sk + 1e-6);
            for (uint32_t i = 0; i < D; i++) {
                q[i] = (double)qf[i] * rq;
                k[i] = (double)kf[i] * rk;
            }
            const double beta = 1.0 / (1.0 + k3_exp(-(double)m->kb[(uint64_t)t * H + h]));
            for (uint32_t i = 0; i < D; i++)
                decay[i] = -(ah * ((double)m->kz[off + i] + (double)dtb[(uint64_t)h * D + i]));
            k3_exp_n(decay, decay, D);
            for (uint32_t i = 0; i < D; i++)
                decay[i] = lb / (1.0 + decay[i]);
            k3_exp_n(decay, decay, D);
            k3_kda_step(S, D, decay, k, q, vf, beta, o);
            /* head-wise RMSNorm, then the output gate */
            double ss = 0.0;
            for (uint32_t j = 0; j < D; j++)
                ss += o[j] * o[j];
            const double r = 1.0 / sqrt(ss / (double)D + eps);
            float *out = m->ko + off;
            for (uint32_t j = 0; j < D; j++)
                q[j] = -(double)m->kg[off + j];   /* q is spent: the gate's exponentials */
            k3_exp_n(q, q, D);
            for (uint32_t j = 0; j < D; j++)
                out[j] = (float)((double)onorm[j] * (o[j] * r) / (1.0 + q[j]));
        }
    });
    K3_TRY(k3_model_mm(m, &v[K3_W_KDA_O], m->ko, T, m->attn, e));
    return 0;
}
