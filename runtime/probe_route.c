/*
 * probe_route.c - how many distinct experts a prompt's passes need, estimated
 * from the model's own routers (probe.h, k3_probe_routes_read).
 *
 * The union of the experts a pass of C ids routes to sets the expert bytes a
 * prompt reads and multiplies, and it is a property of the weights: a router
 * whose correction biases outweigh its logits sends most ids to the same few
 * experts, a balanced one spreads them. The estimate applies the router of up
 * to K3_PROBE_ROUTE_LAYERS MoE layers (evenly spaced) to each prompt id's
 * embedding, normalised with that layer's post-attention RMSNorm, with the
 * model's own selection rule (sigmoid scores, top-k of score + bias:
 * k3_moe_route). The hidden state a layer really routes is the embedding plus
 * what the layers before it added, so this is an estimate; it is exact where
 * those layers add a multiple of the embedding (a model whose other matrices
 * are zeros, like k3-synth --sparse-live) and it captures the part of the
 * skew that comes from the biases and the routers themselves.
 *
 * Reads (buffered, through k3_pk_read): the prompt's embedding rows and, per
 * sampled layer, its router, bias and norm (13 MB at K3 width). Memory: the
 * ids' hidden vectors and scores (n x (hidden + experts) floats) and one
 * router widened to f32.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_io.h"
#include "k3_kern.h"
#include "k3_model.h"
#include "k3_pk.h"
#include "k3_schema.h"
#include "probe.h"

/* A whole trunk tensor of layer L (slot s) widened to n floats at out; 1 if
 * the packed model has no such tensor (an optional one), 0, or < 0. */
static int read_f32(const k3_pk *pk, uint32_t slot, uint32_t L, uint64_t n, float *out, uint8_t *tmp, k3_err *e)
{
    char name[512];
    k3_schema_name(name, sizeof name, slot, L, 1);
    const k3_pk_tensor *t = k3_pk_tensor_find(pk, name);
    if (!t)
        return 1;
    const uint64_t es = t->dtype == K3_DT_F32 ? 4 : 2;
    if (t->nbytes != n * es || t->shape[0] == 0)
        return k3_err_set(e, K3_EFORMAT, "%s: %s has %llu bytes, expected %llu values", k3_pk_dir(pk), name,
                          (unsigned long long)t->nbytes, (unsigned long long)n);
    const uint64_t row = t->nbytes / t->shape[0];
    for (uint32_t i = 0; i < t->npieces; i++) {
        const k3_pk_piece *pc = &t->pieces[i];
        int rc = k3_pk_read(pk, k3_pk_unit_at(pk, pc->unit)->file, tmp + pc->row_begin * row, pc->nbytes,
                            pc->offset, NULL, 0, e);
        if (rc < 0)
            return rc;
    }
    if (t->dtype == K3_DT_F32)
        memcpy(out, tmp, n * 4);
    else if (t->dtype == K3_DT_F16)
        k3_f16_to_f32_n((const uint16_t *)tmp, out, n);
    else
        k3_bf16_to_f32_n((const uint16_t *)tmp, out, n);
    return 0;
}

int k3_probe_routes_read(const char *dir, const uint32_t *ids, uint32_t n, k3_probe_routes *r, k3_err *e)
{
    memset(r, 0, sizeof *r);
    k3_pk *pk = NULL;
    int rc = k3_pk_open(&pk, dir, 0, e);
    if (rc < 0)
        return rc;
    const k3_cfg *c = k3_pk_cfg(pk);
    const uint32_t NL = c->num_hidden_layers, first = c->first_k_dense_replace;
    const uint32_t n_moe = NL > first ? NL - first : 0, NE = c->num_experts, K = c->num_experts_per_token;
    const uint64_t E = c->hidden_size;
    const double t0 = k3_now_s();
    r->n_ids = n, r->top_k = K, r->num_experts = NE, r->n_moe = n_moe;
    if (n_moe == 0 || n == 0 || NE == 0 || K == 0 || K > NE) {
        k3_pk_close(pk);
        return 0;   /* nothing routed: no estimate, and none needed */
    }
    r->n_layers = n_moe < K3_PROBE_ROUTE_LAYERS ? n_moe : K3_PROBE_ROUTE_LAYERS;
    for (uint32_t i = 0; i < r->n_layers; i++)
        r->layer[i] = first + (r->n_layers > 1 ? (uint32_t)((uint64_t)i * (n_moe - 1) / (r->n_layers - 1)) : 0);
    const k3_pk_tensor *emb = k3_pk_tensor_find(pk, K3_SCH_EMBED_NAME);
    float *X = malloc((uint64_t)n * E * sizeof *X), *Xn = malloc((uint64_t)n * E * sizeof *Xn);
    float *S = malloc((uint64_t)n * NE * sizeof *S), *W = malloc((uint64_t)NE * E * sizeof *W);
    float *norm = malloc(E * sizeof *norm), *bias = malloc((uint64_t)NE * sizeof *bias);
    uint8_t *tmp = malloc((uint64_t)NE * E * 4 + E * 4);
    r->sel = malloc((uint64_t)r->n_layers * n * K * sizeof *r->sel);
    if (!X || !Xn || !S || !W || !norm || !bias || !tmp || !r->sel) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory estimating the routes of %u ids", n);
        goto out;
    }
    if (!emb || emb->ndim != 2 || emb->shape[1] != E) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: no embedding of width %llu to route", dir, (unsigned long long)E);
        goto out;
    }
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        if (ids[i] >= c->vocab_size) {
            rc = k3_err_set(e, K3_EARG, "token id %u (position %u) is out of range: vocabulary %u", ids[i], i,
                            c->vocab_size);
            break;
        }
        rc = k3_pk_embed_row(pk, emb, ids[i], tmp, NULL, 0, X + (uint64_t)i * E, NULL, dir, e);
    }
    for (uint32_t l = 0; l < r->n_layers && rc == 0; l++) {
        const uint32_t L = r->layer[l];
        int have_norm = 1, have_bias = 1;
        if ((rc = read_f32(pk, K3_W_POST_NORM, L, E, norm, tmp, e)) < 0)
            break;
        have_norm = rc == 0;
        if ((rc = read_f32(pk, K3_W_MOE_BIAS, L, NE, bias, tmp, e)) < 0)
            break;
        have_bias = rc == 0;
        if ((rc = read_f32(pk, K3_W_MOE_ROUTER, L, (uint64_t)NE * E, W, tmp, e)) != 0) {
            if (rc > 0)
                rc = k3_err_set(e, K3_EFORMAT, "%s: layer %u has no router", dir, L);
            break;
        }
        for (uint32_t i = 0; i < n; i++) {
            const float *x = X + (uint64_t)i * E;
            float *y = Xn + (uint64_t)i * E;
            double ss = 0;
            for (uint64_t j = 0; j < E; j++)
                ss += (double)x[j] * x[j];
            const float s = (float)(1.0 / sqrt(ss / (double)E + c->rms_norm_eps));
            for (uint64_t j = 0; j < E; j++)
                y[j] = x[j] * s * (have_norm ? norm[j] : 1.0f);
        }
        k3_gemm_f32(W, NE, E, Xn, n, S);
        for (uint32_t i = 0; i < n; i++) {
            float *sc = S + (uint64_t)i * NE;
            for (uint32_t x = 0; x < NE; x++)
                sc[x] = 1.0f / (1.0f + expf(-sc[x]));
            k3_moe_route(sc, have_bias ? bias : NULL, NE, K, r->sel + ((uint64_t)l * n + i) * K);
        }
    }
out:
    free(X), free(Xn), free(S), free(W), free(norm), free(bias), free(tmp);
    k3_pk_close(pk);
    r->seconds = k3_now_s() - t0;
    if (rc < 0)
        k3_probe_routes_free(r);
    return rc < 0 ? rc : 0;
}

void k3_probe_routes_free(k3_probe_routes *r)
{
    if (!r)
        return;
    free(r->sel);
    r->sel = NULL;
    r->n_layers = 0;
}
