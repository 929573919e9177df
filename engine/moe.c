/*
 * moe.c - the MLP half of a layer: the dense SiTU-GLU MLP and the LatentMoE
 * (docs/MODEL.md §1.4) over a chunk of tokens.
 *
 * Routing: independent sigmoids; top-k by (score + correction bias), the bias
 * only selects, ties go to the lower expert index; weights are the raw
 * scores, renormalised by their float sum in top-k order (+1e-20), then
 * scaled by routed_scaling_factor.
 * Experts: the chunk's tokens are grouped by expert (tokens ascending within
 * an expert) so each expert record is requested once per chunk, one at a
 * time, in the order the source will have them ready (k3_ws_experts_prefetch
 * leaves the ids in it: those it holds first, so they run while the others
 * are read); every expert runs its rows straight from MXFP4 with k3_gemm_mx.
 * The aggregate of a token is summed in its top-k order, so neither the
 * grouping nor the order of the experts changes a number.
 * Over several ranks (k3_dist.h) expert e runs on rank e mod N only and
 * the outputs are exchanged before the sum, which every rank then does in
 * the same order.
 * Overlap: right after routing the layer's expert ids go to the source
 * (k3_ws_experts_prefetch, a hint a streaming source uses to start its
 * reads), then the latent down projection and the shared experts run before
 * the first expert is acquired; the sum routed + shared is the same
 * expression as ever. Earlier still, before the layer's attention,
 * k3_moe_guess routes the hidden state as it stands and hands the experts it
 * picks to the source as a guess (k3_ws_experts_guess): reads that can start
 * while the attention computes, and that change no number.
 */
#include <string.h>

#include "k3_kern.h"
#include "model_int.h"

static void situ_rows(float *g, const float *u, uint64_t n, float b1, float b2)
{
    const uint64_t blk = 4096, nb = (n + blk - 1) / blk;
    K3_PAR_FOR(n > K3_PAR_MIN,
    for (uint64_t b = 0; b < nb; b++)
        k3_situ(g + b * blk, u + b * blk, n - b * blk < blk ? n - b * blk : blk, b1, b2););
}

int k3_mlp_dense_forward(k3_model *m, const k3_view *v, uint32_t T, k3_err *e)
{
    const k3_dims *d = &m->d;
    K3_TRY(k3_model_mm(m, &v[K3_W_MLP_GATE], m->xn, T, m->dg, e));
    K3_TRY(k3_model_mm(m, &v[K3_W_MLP_UP], m->xn, T, m->du, e));
    situ_rows(m->dg, m->du, (uint64_t)T * d->IDN, d->b1, d->b2);
    K3_TRY(k3_model_mm(m, &v[K3_W_MLP_DOWN], m->dg, T, m->mlp, e));
    return 0;
}

/* Top-k of key = score + bias for one token; ties to the lower index
 * (k3_model.h). */
void k3_moe_route(const float *score, const float *bias, uint32_t NE, uint32_t K, uint32_t *sel)
{
    for (uint32_t j = 0; j < K; j++) {
        uint32_t best = UINT32_MAX;
        float bk = 0.0f;
        for (uint32_t x = 0; x < NE; x++) {
            int taken = 0;
            for (uint32_t i = 0; i < j; i++)
                if (sel[i] == x) {
                    taken = 1;
                    break;
                }
            if (taken)
                continue;
            float key = score[x] + (bias ? bias[x] : 0.0f);
            if (key != key)
                key = -INFINITY;   /* a NaN never wins over a number */
            if (best == UINT32_MAX || key > bk) {
                best = x;
                bk = key;
            }
        }
        sel[j] = best;
    }
}

/* The router's scores of the T rows of in into m->rs, sigmoids, and each
 * row's top-k into m->rsel. */
static int route(k3_model *m, const k3_view *v, const float *in, uint32_t T, k3_err *e)
{
    const k3_dims *d = &m->d;
    const uint32_t NE = d->NE, K = d->TOPK;
    K3_TRY(k3_model_mm(m, &v[K3_W_MOE_ROUTER], in, T, m->rs, e));
    const float *bias = m->vf[K3_W_MOE_BIAS];
    K3_PAR_FOR((uint64_t)T * NE * K > K3_PAR_MIN,
    for (uint32_t t = 0; t < T; t++) {
        float *sc = m->rs + (uint64_t)t * NE;
        for (uint32_t x = 0; x < NE; x++)
            sc[x] = k3_sigmoidf(sc[x]);
        k3_moe_route(sc, bias, NE, K, m->rsel + (uint64_t)t * K);
    });
    return 0;
}

/* The distinct experts of m->rsel's T rows, ascending, this rank's only (k3_dist_expert_rank), into m->eids. */
static uint32_t chunk_experts(k3_model *m, uint32_t T)
{
    const uint32_t NE = m->d.NE;
    memset(m->ecount, 0, NE * sizeof(uint32_t));
    for (uint64_t i = 0; i < (uint64_t)T * m->d.TOPK; i++)
        m->ecount[m->rsel[i]]++;
    const uint32_t N = m->dist ? m->dist->size : 1, me = m->dist ? m->dist->rank : 0;
    uint32_t n = 0;
    for (uint32_t x = 0; x < NE; x++)
        if (m->ecount[x] && k3_dist_expert_rank(x, N) == me)
            m->eids[n++] = x;
    return n;
}

void k3_moe_guess(k3_model *m, uint32_t layer, const k3_view *v, const float *x, uint32_t T)
{
    if (!v[K3_W_MOE_ROUTER].data)   /* a router in row pieces would be read twice */
        return;
    k3_err e = {0};
    if (route(m, v, x, T, &e) < 0)   /* cannot fail on a held matrix; a guess is only a hint */
        return;
    k3_ws_experts_guess(m->ws, layer, m->eids, chunk_experts(m, T));
}

int k3_moe_forward(k3_model *m, uint32_t layer, const k3_view *v, uint32_t T, k3_err *e)
{
    const k3_dims *d = &m->d;
    const uint32_t NE = d->NE, K = d->TOPK, LAT = d->LAT, I = d->I;

    /* routing */
    K3_TRY(route(m, v, m->xn, T, e));
    K3_PAR_FOR((uint64_t)T * K > K3_PAR_MIN,
    for (uint32_t t = 0; t < T; t++) {
        const float *sc = m->rs + (uint64_t)t * NE;
        const uint32_t *sel = m->rsel + (uint64_t)t * K;
        float *w = m->rw + (uint64_t)t * K;
        float sum = 0.0f;
        for (uint32_t j = 0; j < K; j++) {
            w[j] = sc[sel[j]];
            sum += w[j];
        }
        if (d->renorm)
            for (uint32_t j = 0; j < K; j++)
                w[j] /= sum + 1e-20f;
        for (uint32_t j = 0; j < K; j++)
            w[j] *= d->rsf;
    });

    /* the experts this chunk needs: a streaming source starts reading them
     * now, while the latent down projection and the shared experts run */
    const uint32_t nused = chunk_experts(m, T);
    k3_ws_experts_prefetch(m->ws, layer, m->eids, nused);

    /* experts live in the latent */
    K3_TRY(k3_model_mm(m, &v[K3_W_MOE_LDOWN], m->xn, T, m->mz, e));

    /* shared experts: one unweighted MLP on the layer input, into m->mlp */
    const uint64_t TE = (uint64_t)T * d->E;
    if (d->NSH) {
        const uint64_t IS = (uint64_t)I * d->NSH;
        K3_TRY(k3_model_mm(m, &v[K3_W_MOE_SH_GATE], m->xn, T, m->dg, e));
        K3_TRY(k3_model_mm(m, &v[K3_W_MOE_SH_UP], m->xn, T, m->du, e));
        situ_rows(m->dg, m->du, (uint64_t)T * IS, d->b1, d->b2);
        K3_TRY(k3_model_mm(m, &v[K3_W_MOE_SH_DOWN], m->dg, T, m->mlp, e));
    }

    int rc = 0;
    for (uint32_t i = 0; i < nused && rc == 0; i++) {
        const uint32_t x = m->eids[i];
        k3_expert_view ev;
        rc = k3_ws_experts_acquire(m->ws, layer, &x, 1, &ev, e);
        if (rc < 0)
            break;
        uint32_t n = 0;
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t j = 0; j < K; j++)
                if (m->rsel[(uint64_t)t * K + j] == x) {
                    memcpy(m->mx + (uint64_t)n * LAT, m->mz + (uint64_t)t * LAT, LAT * sizeof(float));
                    m->eslot[n++] = t * K + j;
                }
        double t0 = omp_get_wtime();
        k3_gemm_mx(ev.packed[0], ev.scales[0], I, LAT, m->mx, n, m->m1);
        k3_gemm_mx(ev.packed[1], ev.scales[1], I, LAT, m->mx, n, m->m3);
        double t1 = omp_get_wtime();
        situ_rows(m->m1, m->m3, (uint64_t)n * I, d->b1, d->b2);
        double t2 = omp_get_wtime();
        k3_gemm_mx(ev.packed[2], ev.scales[2], LAT, I, m->m1, n, m->my);
        m->times.products += (t1 - t0) + (omp_get_wtime() - t2);
        for (uint32_t k = 0; k < n; k++)
            memcpy(m->mout + (uint64_t)m->eslot[k] * LAT, m->my + (uint64_t)k * LAT, LAT * sizeof(float));
        k3_ws_experts_release(m->ws, layer);
    }
    if (m->dist)   /* every rank's expert outputs to every rank */
        rc = k3_model_dist_experts(m, T, rc, e);
    if (rc < 0)
        return rc;

    /* aggregate in top-k order, norm, back up to the model width */
    K3_PAR_FOR((uint64_t)T * K * LAT > K3_PAR_MIN,
    for (uint32_t t = 0; t < T; t++) {
        float *acc = m->macc + (uint64_t)t * LAT;
        const float *w = m->rw + (uint64_t)t * K;
        for (uint32_t c = 0; c < LAT; c++)
            acc[c] = 0.0f;
        for (uint32_t j = 0; j < K; j++) {
            const float *y = m->mout + ((uint64_t)t * K + j) * LAT;
            for (uint32_t c = 0; c < LAT; c++)
                acc[c] += w[j] * y[c];
        }
    });
    if (d->moe_norm)
        k3_model_rmsnorm(m->macc, m->vf[K3_W_MOE_NORM], LAT, T, d->eps, m->macc);
    K3_TRY(k3_model_mm(m, &v[K3_W_MOE_LUP], m->macc, T, m->mup, e));

    /* routed + shared */
    if (d->NSH) {
        for (uint64_t i = 0; i < TE; i++)
            m->mlp[i] = m->mup[i] + m->mlp[i];
    } else {
        memcpy(m->mlp, m->mup, TE * sizeof(float));
    }
    return 0;
}
