/*
 * ws_mem.c - a weight source held in memory, with weights drawn from a seeded
 * splitmix64 generator: lets the forward pass be tested and benchmarked with
 * no files at all. Matrices BF16 (uniform, variance 1/in), vectors F32 (norm
 * weights near 1), experts quantized to MXFP4 with k3_mx_quantize. The same
 * config and seed always give the same weights.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kern.h"
#include "k3_ws.h"

typedef struct ws_mem {
    k3_ws base;
    k3_view *views;          /* (NL + 1) x K3_W_COUNT */
    void **blobs;            /* owned data, same indexing */
    uint16_t *embed;         /* V x E bf16 */
    uint8_t **experts;       /* NL x NE records: w1p w1s w3p w3s w2p w2s back to back */
    uint64_t rec_off[6];
} ws_mem;

static uint64_t sm64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [-1, 1) */
static float unif(uint64_t *s) { return (float)((double)(sm64(s) >> 11) * 0x1.0p-52 - 1.0); }

static int mem_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    ws_mem *w = (ws_mem *)ws;
    const k3_view *v = &w->views[(uint64_t)g * K3_W_COUNT + s];
    if (!v->data)
        return k3_err_set(e, K3_ENOENT, "in-memory model: no tensor %s in group %u", k3_wslot_name(s), g);
    *out = *v;
    out->data = NULL;
    return 0;
}

static int mem_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    (void)e;
    *views = &((ws_mem *)ws)->views[(uint64_t)g * K3_W_COUNT];
    return 0;
}

static void mem_release(k3_ws *ws, uint32_t g) { (void)ws; (void)g; }

static int mem_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    ws_mem *w = (ws_mem *)ws;
    const uint64_t E = ws->cfg.hidden_size;
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] >= ws->cfg.vocab_size)
            return k3_err_set(e, K3_EARG, "token id %u out of range", ids[i]);
        k3_bf16_to_f32_n(w->embed + ids[i] * E, out + i * E, E);
    }
    return 0;
}

static uint32_t mem_batch_max(k3_ws *ws) { return ws->cfg.num_experts; }

static int mem_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
                               k3_err *e)
{
    ws_mem *w = (ws_mem *)ws;
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] >= ws->cfg.num_experts)
            return k3_err_set(e, K3_EARG, "expert %u out of range", ids[i]);
        const uint8_t *r = w->experts[(uint64_t)layer * ws->cfg.num_experts + ids[i]];
        if (!r)
            return k3_err_set(e, K3_ENOENT, "layer %u has no experts", layer);
        for (int k = 0; k < 3; k++) {
            out[i].packed[k] = r + w->rec_off[2 * k];
            out[i].scales[k] = r + w->rec_off[2 * k + 1];
        }
    }
    return 0;
}

static void mem_experts_release(k3_ws *ws, uint32_t layer) { (void)ws; (void)layer; }

static void mem_close(k3_ws *ws)
{
    ws_mem *w = (ws_mem *)ws;
    uint64_t ng = (uint64_t)ws->cfg.num_hidden_layers + 1;
    if (w->blobs)
        for (uint64_t i = 0; i < ng * K3_W_COUNT; i++)
            free(w->blobs[i]);
    if (w->experts)
        for (uint64_t i = 0; i < (uint64_t)ws->cfg.num_hidden_layers * ws->cfg.num_experts; i++)
            free(w->experts[i]);
    free(w->experts);
    free(w->blobs);
    free(w->views);
    free(w->embed);
    free(w);
}

static const k3_ws_ops mem_ops = {
    "memory", mem_describe, mem_acquire, mem_release, mem_embed,
    mem_batch_max, mem_experts_acquire, mem_experts_release, mem_close, NULL, NULL, NULL, NULL, NULL, NULL,
};

static int is_norm_like(k3_wslot s)
{
    return s == K3_W_INPUT_NORM || s == K3_W_POST_NORM || s == K3_W_SA_RES_NORM || s == K3_W_MLP_RES_NORM ||
           s == K3_W_KDA_ONORM || s == K3_W_MLA_QA_NORM || s == K3_W_MLA_KVA_NORM || s == K3_W_MOE_NORM ||
           s == K3_W_FINAL_NORM || s == K3_W_OUT_RES_NORM;
}

int k3_ws_mem_create(k3_ws **out, const k3_cfg *cfg, uint64_t seed, k3_err *e)
{
    *out = NULL;
    ws_mem *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    w->base.ops = &mem_ops;
    w->base.cfg = *cfg;
    const k3_cfg *c = &w->base.cfg;
    const uint64_t NL = c->num_hidden_layers, ng = NL + 1, E = c->hidden_size;
    w->views = calloc(ng * K3_W_COUNT, sizeof(k3_view));
    w->blobs = calloc(ng * K3_W_COUNT, sizeof(void *));
    w->embed = malloc((uint64_t)c->vocab_size * E * sizeof(uint16_t));
    w->experts = calloc(NL * c->num_experts + 1, sizeof(uint8_t *));
    if (!w->views || !w->blobs || !w->embed || !w->experts)
        goto oom;
    uint64_t st = seed;
    for (uint64_t i = 0; i < (uint64_t)c->vocab_size * E; i++)
        w->embed[i] = k3_f32_to_bf16(unif(&st));
    for (uint64_t g = 0; g < ng; g++) {
        for (int si = 0; si < K3_W_COUNT; si++) {
            k3_wslot s = (k3_wslot)si;
            const k3_sch_row *row = k3_schema_row((uint32_t)si);
            if (!k3_schema_in_group(c, row, (uint32_t)g))
                continue;
            uint64_t shape[3], r, cl = 0;
            r = k3_schema_shape(c, row, shape);   /* a vector (conv taps too): all its values */
            if (row->cls == K3_SCH_MATRIX) {
                r = shape[0];
                cl = shape[1];
            }
            k3_view *v = &w->views[g * K3_W_COUNT + si];
            if (cl) {
                uint16_t *p = malloc(r * cl * sizeof(uint16_t));
                if (!p)
                    goto oom;
                float sc = sqrtf(3.0f / (float)cl);
                for (uint64_t i = 0; i < r * cl; i++)
                    p[i] = k3_f32_to_bf16(unif(&st) * sc);
                *v = (k3_view){.dtype = K3_DT_BF16, .ndim = 2, .shape = {r, cl, 0, 0}, .data = p};
                w->blobs[g * K3_W_COUNT + si] = p;
            } else {
                float *p = malloc(r * sizeof(float));
                if (!p)
                    goto oom;
                for (uint64_t i = 0; i < r; i++) {
                    float u = unif(&st);
                    p[i] = is_norm_like(s) ? 1.0f + 0.2f * u
                           : s == K3_W_KDA_ALOG ? 0.5f * u
                           : s == K3_W_KDA_DTBIAS ? 0.5f * u
                           : s == K3_W_MOE_BIAS ? 0.05f * u
                           : s == K3_W_KDA_QCONV || s == K3_W_KDA_KCONV || s == K3_W_KDA_VCONV ? 0.6f * u
                           : u; /* attention-residual projections */
                }
                *v = (k3_view){.dtype = K3_DT_F32, .ndim = 1, .shape = {r, 0, 0, 0}, .data = p};
                w->blobs[g * K3_W_COUNT + si] = p;
            }
        }
    }
    /* experts: w1, w3 [I][L], w2 [L][I] */
    const uint64_t I = c->moe_intermediate_size, L = c->routed_expert_hidden_size, n = I * L;
    w->rec_off[0] = 0; w->rec_off[1] = n / 2;
    w->rec_off[2] = n / 2 + n / 32; w->rec_off[3] = w->rec_off[2] + n / 2;
    w->rec_off[4] = w->rec_off[3] + n / 32; w->rec_off[5] = w->rec_off[4] + n / 2;
    const uint64_t rec = w->rec_off[5] + n / 32;
    float *tmp = malloc(n * sizeof(float));
    if (!tmp)
        goto oom;
    for (uint64_t L0 = c->first_k_dense_replace; L0 < NL; L0++)
        for (uint64_t x = 0; x < c->num_experts; x++) {
            uint8_t *r = malloc(rec);
            if (!r) {
                free(tmp);
                goto oom;
            }
            w->experts[L0 * c->num_experts + x] = r;
            for (int k = 0; k < 3; k++) {
                float sc = sqrtf(3.0f / (float)(k == 2 ? I : L));
                for (uint64_t i = 0; i < n; i++)
                    tmp[i] = unif(&st) * sc;
                k3_mx_quantize(tmp, n, r + w->rec_off[2 * k], r + w->rec_off[2 * k + 1]);
            }
        }
    free(tmp);
    *out = &w->base;
    return 0;
oom:
    mem_close(&w->base);
    return k3_err_set(e, K3_ENOMEM, "out of memory building an in-memory model");
}

