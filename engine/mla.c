/*
 * mla.c - gated multi-head latent attention, NoPE (docs/MODEL.md §1.4), over a pass.
 *
 * Cache: per position only the latent after kv_a_layernorm (kv_lora floats)
 * and the shared rope key (rope floats). k/v are never expanded per position:
 * W_kv_b is absorbed instead, the same way for every chunk size:
 *   q_lat_h[c] = sum_r Wkb_h[r][c] * q_nope_h[r]          r ascending, float
 *   score(s)   = (dot(q_lat_h, lat_s) + dot(q_rope_h, kr_s)) * (nope+rope)^-0.5
 *   p = softmax over s <= pos (max first, sum of exp in double, s ascending)
 *   o_lat_h[c] = sum_s p_s * lat_s[c]                     s ascending, float
 *   o_h        = Wvb_h . o_lat_h                          (k3 kernel)
 * dot() is k3_dot8x4's (k3_kern.h): eight interleaved float partial sums
 * combined in a fixed tree, four positions at a time on every path; the
 * weighted sum adds four positions at a time with k3_axpy4, in ascending
 * order. The absorption runs per head over blocks of rows (the head's
 * slice of W_kv_b read once per block). Scores and sums run per row and
 * group of up to K3_MLA_HEAD_GROUP heads, one unit of parallel work each:
 * the group walks the row's cache once (a position's latent is read once
 * per group, not once per head). A row attends over its own session's
 * cache (the segment it belongs to, m->rowseg), never another's.
 */
#include <omp.h>
#include <string.h>

#include "k3_kern.h"
#include "model_int.h"

/* bf16 -> f32 is exact (the bits shifted up); inline so the absorption loop
 * vectorises. Same value as k3_bf16_to_f32. */
static inline float bf16_widen(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f16 -> f32, exact: normals by moving the fields, the rest through
 * k3_f16_to_f32 (same value). */
static inline float f16_widen(uint16_t h)
{
    uint32_t ex = (h >> 10) & 0x1fu;
    if (ex == 0 || ex == 0x1f)
        return k3_f16_to_f32(h);
    uint32_t u = ((uint32_t)(h & 0x8000u) << 16) | (((uint32_t)(h & 0x7fffu) << 13) + 0x38000000u);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Rows the absorption takes per head at a time: their queries and latents
 * (2 x 16 x KVL floats) stay in L1/L2 while the head's slice of kv_b passes. */
#define MLA_ROW_BLOCK 16u

/* ql_t[c] = sum_r W[row0 + r][c] * q_t[r] for rows t in [t0, t1): r outer,
 * so each row of W is widened once for the block; every sum is still over r
 * ascending in float, the same bits as one row at a time. q_t = q + t *
 * q_stride, ql_t = ql + t * ql_stride. */
static void absorb_rows(const k3_view *W, uint64_t row0, uint32_t nope, uint32_t kvl, const float *q, uint64_t q_stride,
                        float *ql, uint64_t ql_stride, uint32_t t0, uint32_t t1)
{
    for (uint32_t t = t0; t < t1; t++)
        memset(ql + t * ql_stride, 0, kvl * sizeof *ql);
    for (uint32_t r = 0; r < nope; r++) {
        for (uint32_t t = t0; t < t1; t++) {
            const float qr = q[t * q_stride + r];
            float *o = ql + t * ql_stride;
            if (W->dtype == K3_DT_BF16) {
                const uint16_t *w = (const uint16_t *)W->data + (row0 + r) * kvl;
#pragma omp simd
                for (uint32_t c = 0; c < kvl; c++)
                    o[c] += bf16_widen(w[c]) * qr;
            } else if (W->dtype == K3_DT_F16) {
                const uint16_t *w = (const uint16_t *)W->data + (row0 + r) * kvl;
                for (uint32_t c = 0; c < kvl; c++)
                    o[c] += f16_widen(w[c]) * qr;
            } else {
                const float *w = (const float *)W->data + (row0 + r) * kvl;
#pragma omp simd
                for (uint32_t c = 0; c < kvl; c++)
                    o[c] += w[c] * qr;
            }
        }
    }
}

/* Attention of one row for heads [h0, h0 + nh) over positions [0, n) of
 * its cache: q holds the heads' queries (QK apart: nope part, then rope
 * part), ql their absorbed latents (KVL apart); sc has nh score rows of
 * sc_stride floats; head k's output goes to ol + k * ol_stride. Positions
 * are the outer loop in blocks of 4, the group's heads inner; per head
 * every sum runs over positions ascending, as one head at a time would. */
static void attend_heads(const float *cache, uint32_t n, const k3_dims *d, const float *q, const float *ql,
                         uint32_t nh, float scale, float *sc, uint64_t sc_stride, float *ol, uint64_t ol_stride)
{
    const uint32_t NOPE = d->NOPE, ROPE = d->ROPE, QK = d->QK, KVL = d->KVL, CL = KVL + ROPE;
    float mx[K3_MLA_HEAD_GROUP];
    for (uint32_t k = 0; k < nh; k++)
        mx[k] = -INFINITY;
    for (uint32_t p4 = 0; p4 < n; p4 += 4) {
        const uint32_t np = n - p4 < 4 ? n - p4 : 4;
        const float *cp[4], *cr[4];
        for (uint32_t j = 0; j < 4; j++) {   /* a short last block repeats its last position */
            cp[j] = cache + (uint64_t)(p4 + (j < np ? j : np - 1)) * CL;
            cr[j] = cp[j] + KVL;
        }
        for (uint32_t k = 0; k < nh; k++) {
            float lat[4], rope[4], *sk = sc + k * sc_stride;
            k3_dot8x4(ql + (uint64_t)k * KVL, cp, KVL, lat);
            k3_dot8x4(q + (uint64_t)k * QK + NOPE, cr, ROPE, rope);
            for (uint32_t j = 0; j < np; j++) {
                sk[p4 + j] = (lat[j] + rope[j]) * scale;
                if (sk[p4 + j] > mx[k])
                    mx[k] = sk[p4 + j];
            }
        }
    }
    float inv[K3_MLA_HEAD_GROUP];
    for (uint32_t k = 0; k < nh; k++) {
        float *sk = sc + k * sc_stride;
        for (uint32_t p = 0; p < n; p++)
            sk[p] = sk[p] - mx[k];
        k3_expf_n(sk, sk, n);
        double sum = 0.0;
        for (uint32_t p = 0; p < n; p++)
            sum += sk[p];
        inv[k] = (float)(1.0 / sum);
        float *o = ol + k * ol_stride;
        for (uint32_t c = 0; c < KVL; c++)
            o[c] = 0.0f;
    }
    uint32_t p = 0;
    for (; p + 4 <= n; p += 4) {
        const float *cp[4];
        for (uint32_t j = 0; j < 4; j++)
            cp[j] = cache + (uint64_t)(p + j) * CL;
        for (uint32_t k = 0; k < nh; k++) {
            const float *sk = sc + k * sc_stride;
            const float w[4] = {sk[p] * inv[k], sk[p + 1] * inv[k], sk[p + 2] * inv[k], sk[p + 3] * inv[k]};
            k3_axpy4(ol + k * ol_stride, w, cp, KVL);
        }
    }
    for (; p < n; p++) {
        const float *cp = cache + (uint64_t)p * CL;
        for (uint32_t k = 0; k < nh; k++) {
            const float w = sc[k * sc_stride + p] * inv[k];
            float *o = ol + k * ol_stride;
#pragma omp simd
            for (uint32_t c = 0; c < KVL; c++)
                o[c] += w * cp[c];
        }
    }
}

int k3_mla_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e)
{
    const k3_dims *d = &m->d;
    const uint32_t MH = d->MH, NOPE = d->NOPE, ROPE = d->ROPE, VD = d->VD, QK = d->QK, KVL = d->KVL;
    const uint32_t CL = KVL + ROPE, idx = m->layer_slot[layer];

    K3_TRY(k3_model_mm(m, &v[K3_W_MLA_QA], m->xn, T, m->mqa, e));
    k3_model_rmsnorm(m->mqa, m->vf[K3_W_MLA_QA_NORM], d->QL, T, d->eps, m->mqa);
    K3_TRY(k3_model_mm(m, &v[K3_W_MLA_QB], m->mqa, T, m->mq, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_MLA_KVA], m->xn, T, m->mc, e));

    /* each row's latent into its own session's cache at its position */
    uint64_t work = 0;
    for (uint32_t g = 0; g < m->nseg; g++) {
        const k3_seg *sg = &m->segs[g];
        float *cache = sg->s->mla_cache + (uint64_t)idx * sg->s->max_ctx * CL;
        for (uint32_t t = 0; t < sg->n; t++) {
            float *dst = cache + (uint64_t)(sg->s->pos + t) * CL;
            const float *c = m->mc + (uint64_t)(sg->row + t) * CL;
            k3_model_rmsnorm(c, m->vf[K3_W_MLA_KVA_NORM], KVL, 1, d->eps, dst);
            memcpy(dst + KVL, c + KVL, ROPE * sizeof(float));
        }
        work += (uint64_t)sg->n * MH * (sg->s->pos + sg->n) * CL;
    }

    const k3_view *kvb = &v[K3_W_MLA_KVB];
    const uint32_t kvb_rows_per_head = NOPE + VD;
    const float scale = 1.0f / sqrtf((float)QK);

    /* absorb the key half of W_kv_b into each row's query: per head, a
     * block of rows at a time, so the head's slice of kv_b is read once per
     * block rather than once per row (each sum still over r ascending) */
    const uint32_t nblk = (T + MLA_ROW_BLOCK - 1) / MLA_ROW_BLOCK;
    const uint64_t absorb = (uint64_t)T * MH * NOPE * KVL;
    K3_PAR_FOR_DYNAMIC(absorb > K3_PAR_MIN, m->nthreads,
    for (uint32_t u = 0; u < MH * nblk; u++) {
        const uint32_t h = u / nblk, t0 = u % nblk * MLA_ROW_BLOCK;
        const uint32_t t1 = T - t0 < MLA_ROW_BLOCK ? T : t0 + MLA_ROW_BLOCK;
        absorb_rows(kvb, (uint64_t)h * kvb_rows_per_head, NOPE, KVL, m->mq + (uint64_t)h * QK, (uint64_t)MH * QK,
                    m->mqlat + (uint64_t)h * KVL, (uint64_t)MH * KVL, t0, t1);
    });

    /* every (row, group of heads) unit walks the row's cache once for all
     * its heads: each position's latent is read once per group rather than
     * once per head; each head's scores, softmax and sum are its own, in
     * the same order as one head at a time */
    const uint32_t HG = k3_mla_head_group(MH), ngrp = (MH + HG - 1) / HG;
    K3_PAR_FOR_DYNAMIC(work > K3_PAR_MIN, m->nthreads,
    for (uint32_t u = 0; u < T * ngrp; u++) {
        const uint32_t t = u / ngrp, h0 = u % ngrp * HG, nh = MH - h0 < HG ? MH - h0 : HG;
        const k3_seg *sg = &m->segs[m->rowseg[t]];
        const k3_sess *s = sg->s;
        attend_heads(s->mla_cache + (uint64_t)idx * s->max_ctx * CL, s->pos + (t - sg->row) + 1, d,
                     m->mq + (uint64_t)t * MH * QK + (uint64_t)h0 * QK, m->mqlat + ((uint64_t)t * MH + h0) * KVL,
                     nh, scale, s->scores + (uint64_t)omp_get_thread_num() * HG * s->max_ctx, s->max_ctx,
                     m->molat + ((uint64_t)h0 * T + t) * KVL, (uint64_t)T * KVL);
    });
    /* values: per head, Wvb_h . o_lat_h for the chunk's tokens */
    K3_TRY(k3_model_mm_heads(m, kvb, MH, kvb_rows_per_head, NOPE, VD, m->molat, (uint64_t)T * KVL, T, m->mov, e));
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < MH; h++)
            memcpy(m->mo + ((uint64_t)t * MH + h) * VD, m->mov + ((uint64_t)h * T + t) * VD, VD * sizeof(float));
    if (d->mla_gate) {
        K3_TRY(k3_model_mm(m, &v[K3_W_MLA_G], m->xn, T, m->mg, e));
        const uint64_t n = (uint64_t)T * MH * VD;
        for (uint64_t i = 0; i < n; i++)
            m->mo[i] *= k3_sigmoidf(m->mg[i]);
    }
    K3_TRY(k3_model_mm(m, &v[K3_W_MLA_O], m->mo, T, m->attn, e));
    return 0;
}
