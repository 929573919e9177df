/*
 * ws_st.c - weight source over an upstream safetensors checkpoint (k3_st).
 *
 * Names are resolved once at open ("language_model.model.layers.{L}.<slot>",
 * "language_model.<head slot>"; the same names without "language_model." are
 * accepted too). A group's tensors are read on its first acquire and kept
 * (freed on release with K3_WS_DROP). Embedding rows are read one by one.
 * Experts are assembled into one record each (w1 | w3 | w2, packed then
 * scales) on first use: MXFP4 tensors byte for byte; BF16/F16/F32 ".weight"
 * experts are quantized with k3_mx_quantize (a convenience for checkpoints
 * no converter has seen; documented in k3_ws.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_kern.h"
#include "k3_st.h"
#include "k3_ws.h"

typedef struct ws_st {
    k3_ws base;
    k3_st *st;
    unsigned flags;
    uint32_t ng;                      /* layers + head */
    const k3_st_tensor **t;           /* ng x K3_W_COUNT, NULL if absent */
    k3_view *views;                   /* ng x K3_W_COUNT, data when loaded */
    void **data;                      /* ng x K3_W_COUNT owned buffers */
    uint8_t *loaded;                  /* ng */
    const k3_st_tensor *embed;
    uint8_t **rec;                    /* NL x NE assembled expert records */
    uint64_t rec_off[6], rec_bytes;
    float *qbuf;                      /* f32 staging for quantizing non-MXFP4 experts */
    uint8_t *rowbuf;                  /* one embedding row in its stored dtype */
} ws_st;

static const k3_st_tensor *find2(k3_st *st, const char *name)
{
    const k3_st_tensor *t = k3_st_find(st, name);
    if (!t && strncmp(name, "language_model.", 15) == 0)
        t = k3_st_find(st, name + 15);
    return t;
}

static int st_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    ws_st *w = (ws_st *)ws;
    const k3_st_tensor *t = g < w->ng ? w->t[(uint64_t)g * K3_W_COUNT + s] : NULL;
    if (!t) {
        char name[512];
        k3_schema_name(name, sizeof name, (uint32_t)s, g, 1);
        return k3_err_set(e, K3_ENOENT, "%s: tensor %s is missing", ws->dir, name);
    }
    memset(out, 0, sizeof *out);
    out->dtype = t->dtype;
    out->ndim = t->ndim;
    for (uint32_t i = 0; i < t->ndim; i++)
        out->shape[i] = t->shape[i];
    return 0;
}

static void st_free_group(ws_st *w, uint32_t g)
{
    for (int s = 0; s < K3_W_COUNT; s++) {
        uint64_t i = (uint64_t)g * K3_W_COUNT + s;
        free(w->data[i]);
        w->data[i] = NULL;
        w->views[i].data = NULL;
    }
    w->loaded[g] = 0;
}

static int st_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    ws_st *w = (ws_st *)ws;
    if (g >= w->ng)
        return k3_err_set(e, K3_EINTERNAL, "weight group %u out of range", g);
    if (!w->loaded[g]) {
        for (int s = 0; s < K3_W_COUNT; s++) {
            uint64_t i = (uint64_t)g * K3_W_COUNT + s;
            const k3_st_tensor *t = w->t[i];
            if (!t)
                continue;
            void *p = malloc(t->nbytes ? t->nbytes : 1);
            if (!p) {
                st_free_group(w, g);
                return k3_err_set(e, K3_ENOMEM, "out of memory reading %s (%llu bytes)", t->name,
                                  (unsigned long long)t->nbytes);
            }
            int rc = k3_st_read(w->st, t, p, e);
            if (rc < 0) {
                free(p);
                st_free_group(w, g);
                return rc;
            }
            w->data[i] = p;
            w->views[i].data = p;
        }
        w->loaded[g] = 1;
    }
    *views = &w->views[(uint64_t)g * K3_W_COUNT];
    return 0;
}

static void st_release(k3_ws *ws, uint32_t g)
{
    ws_st *w = (ws_st *)ws;
    if ((w->flags & K3_WS_DROP) && g < w->ng)
        st_free_group(w, g);
}

static int st_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    ws_st *w = (ws_st *)ws;
    const uint64_t E = ws->cfg.hidden_size, es = k3_dtype_size(w->embed->dtype);
    for (uint32_t i = 0; i < n; i++) {
        if (ids[i] >= ws->cfg.vocab_size)
            return k3_err_set(e, K3_EARG, "token id %u out of range (vocabulary %u)", ids[i], ws->cfg.vocab_size);
        int rc = k3_st_read_range(w->st, w->embed, (uint64_t)ids[i] * E * es, E * es, w->rowbuf, e);
        if (rc < 0)
            return rc;
        float *o = out + (uint64_t)i * E;
        if (w->embed->dtype == K3_DT_BF16)
            k3_bf16_to_f32_n((const uint16_t *)w->rowbuf, o, E);
        else if (w->embed->dtype == K3_DT_F16)
            k3_f16_to_f32_n((const uint16_t *)w->rowbuf, o, E);
        else
            memcpy(o, w->rowbuf, E * sizeof(float));
    }
    return 0;
}

static uint32_t st_batch_max(k3_ws *ws) { return ws->cfg.num_experts; }

/* Read one matrix of an expert into the record: MXFP4 as stored, or quantize. */
static int load_expert_matrix(ws_st *w, uint32_t layer, uint32_t x, int k, uint8_t *rec, k3_err *e)
{
    static const int wn[3] = {0, 2, 1};   /* the record's order w1, w3, w2 */
    const uint64_t I = w->base.cfg.moe_intermediate_size, L = w->base.cfg.routed_expert_hidden_size;
    const uint64_t rows = k == 2 ? L : I, cols = k == 2 ? I : L;
    char name[512];
    k3_schema_expert_name(name, sizeof name, layer, x, wn[k], K3_SCH_XP_PACKED);
    const k3_st_tensor *tp = find2(w->st, name);
    if (tp) {
        k3_schema_expert_name(name, sizeof name, layer, x, wn[k], K3_SCH_XP_SCALE);
        const k3_st_tensor *ts = find2(w->st, name);
        if (!ts)
            return k3_err_set(e, K3_ENOENT, "%s: tensor %s is missing", w->base.dir, name);
        if (tp->dtype != K3_DT_U8 || tp->ndim != 2 || tp->shape[0] != rows || tp->shape[1] != cols / 2)
            return k3_err_set(e, K3_EFORMAT, "%s: %s must be U8 [%llu, %llu]", w->base.dir, tp->name,
                              (unsigned long long)rows, (unsigned long long)(cols / 2));
        if (ts->dtype != K3_DT_U8 || ts->ndim != 2 || ts->shape[0] != rows || ts->shape[1] != cols / 32)
            return k3_err_set(e, K3_EFORMAT, "%s: %s must be U8 [%llu, %llu]", w->base.dir, ts->name,
                              (unsigned long long)rows, (unsigned long long)(cols / 32));
        int rc = k3_st_read(w->st, tp, rec + w->rec_off[2 * k], e);
        if (rc == 0)
            rc = k3_st_read(w->st, ts, rec + w->rec_off[2 * k + 1], e);
        return rc;
    }
    k3_schema_expert_name(name, sizeof name, layer, x, wn[k], K3_SCH_XP_WEIGHT);
    const k3_st_tensor *tw = find2(w->st, name);
    if (!tw)
        return k3_err_set(e, K3_ENOENT, "%s: tensor %s (or %s_packed) is missing", w->base.dir, name, name);
    if (tw->ndim != 2 || tw->shape[0] != rows || tw->shape[1] != cols ||
        (tw->dtype != K3_DT_BF16 && tw->dtype != K3_DT_F16 && tw->dtype != K3_DT_F32))
        return k3_err_set(e, K3_EFORMAT, "%s: %s must be BF16/F16/F32 [%llu, %llu]", w->base.dir, tw->name,
                          (unsigned long long)rows, (unsigned long long)cols);
    const uint64_t n = rows * cols;
    void *raw = malloc(tw->nbytes);
    if (!raw)
        return k3_err_set(e, K3_ENOMEM, "out of memory reading %s", tw->name);
    int rc = k3_st_read(w->st, tw, raw, e);
    if (rc == 0) {
        for (uint64_t i = 0; i < n; i++)
            w->qbuf[i] = tw->dtype == K3_DT_F32   ? ((const float *)raw)[i]
                         : tw->dtype == K3_DT_BF16 ? k3_bf16_to_f32(((const uint16_t *)raw)[i])
                                                   : k3_f16_to_f32(((const uint16_t *)raw)[i]);
        k3_mx_quantize(w->qbuf, n, rec + w->rec_off[2 * k], rec + w->rec_off[2 * k + 1]);
    }
    free(raw);
    return rc;
}

static int st_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
                              k3_err *e)
{
    ws_st *w = (ws_st *)ws;
    const uint32_t NE = ws->cfg.num_experts;
    for (uint32_t i = 0; i < n; i++) {
        if (layer >= ws->cfg.num_hidden_layers || ids[i] >= NE)
            return k3_err_set(e, K3_EINTERNAL, "expert %u of layer %u out of range", ids[i], layer);
        uint8_t **slot = &w->rec[(uint64_t)layer * NE + ids[i]];
        if (!*slot) {
            uint8_t *r = malloc(w->rec_bytes);
            if (!r)
                return k3_err_set(e, K3_ENOMEM, "out of memory for an expert record");
            for (int k = 0; k < 3; k++) {
                int rc = load_expert_matrix(w, layer, ids[i], k, r, e);
                if (rc < 0) {
                    free(r);
                    return rc;
                }
            }
            *slot = r;
        }
        for (int k = 0; k < 3; k++) {
            out[i].packed[k] = *slot + w->rec_off[2 * k];
            out[i].scales[k] = *slot + w->rec_off[2 * k + 1];
        }
    }
    return 0;
}

static void st_experts_release(k3_ws *ws, uint32_t layer)
{
    ws_st *w = (ws_st *)ws;
    if (!(w->flags & K3_WS_DROP))
        return;
    const uint32_t NE = ws->cfg.num_experts;
    for (uint32_t x = 0; x < NE; x++) {
        free(w->rec[(uint64_t)layer * NE + x]);
        w->rec[(uint64_t)layer * NE + x] = NULL;
    }
}

static void st_close(k3_ws *ws)
{
    ws_st *w = (ws_st *)ws;
    if (w->data)
        for (uint64_t i = 0; i < (uint64_t)w->ng * K3_W_COUNT; i++)
            free(w->data[i]);
    if (w->rec)
        for (uint64_t i = 0; i < (uint64_t)ws->cfg.num_hidden_layers * ws->cfg.num_experts; i++)
            free(w->rec[i]);
    free(w->rec);
    free(w->data);
    free(w->views);
    free(w->t);
    free(w->loaded);
    free(w->qbuf);
    free(w->rowbuf);
    k3_st_close(w->st);
    free(w);
}

static const k3_ws_ops st_ops = {
    "safetensors", st_describe, st_acquire, st_release, st_embed,
    st_batch_max, st_experts_acquire, st_experts_release, st_close, NULL, NULL, NULL, NULL, NULL, NULL,
};

int k3_ws_st_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    ws_st *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    w->base.ops = &st_ops;
    w->flags = flags;
    snprintf(w->base.dir, sizeof w->base.dir, "%s", dir);
    char path[4096];
    int rc = k3_io_path_join(path, sizeof path, dir, "config.json", e);
    if (rc == 0)
        rc = k3_cfg_load(&w->base.cfg, path, e);
    if (rc < 0) {
        free(w);
        return rc;
    }
    rc = k3_st_open(&w->st, dir, 0, e);
    if (rc < 0) {
        free(w);
        return rc;
    }
    if (k3_io_path_join(path, sizeof path, dir, "tiktoken.model", NULL) == 0 && access(path, R_OK) == 0)
        snprintf(w->base.tok_dir, sizeof w->base.tok_dir, "%s", dir);
    const k3_cfg *c = &w->base.cfg;
    const uint32_t NL = c->num_hidden_layers;
    w->ng = NL + 1;
    const uint64_t nslots = (uint64_t)w->ng * K3_W_COUNT;
    w->t = calloc(nslots, sizeof *w->t);
    w->views = calloc(nslots, sizeof *w->views);
    w->data = calloc(nslots, sizeof *w->data);
    w->loaded = calloc(w->ng, 1);
    w->rec = calloc((uint64_t)NL * c->num_experts + 1, sizeof *w->rec);
    if (!w->t || !w->views || !w->data || !w->loaded || !w->rec) {
        st_close(&w->base);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    char name[512];
    for (uint32_t g = 0; g < w->ng; g++)
        for (int s = 0; s < K3_W_COUNT; s++) {
            if ((g == NL) != k3_wslot_in_head((k3_wslot)s))
                continue;   /* a head slot is in the head group only, a layer slot in layers */
            k3_schema_name(name, sizeof name, (uint32_t)s, g, 1);
            const k3_st_tensor *t = find2(w->st, name);
            if (!t)
                continue;
            if (t->ndim > 4) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: tensor %s has %u dimensions", dir, name, t->ndim);
                st_close(&w->base);
                return rc;
            }
            uint64_t i = (uint64_t)g * K3_W_COUNT + s;
            w->t[i] = t;
            w->views[i].dtype = t->dtype;
            w->views[i].ndim = t->ndim;
            for (uint32_t d = 0; d < t->ndim; d++)
                w->views[i].shape[d] = t->shape[d];
        }
    w->embed = find2(w->st, K3_SCH_EMBED_NAME);
    if (!w->embed) {
        st_close(&w->base);
        return k3_err_set(e, K3_ENOENT, "%s: tensor " K3_SCH_EMBED_NAME " is missing", dir);
    }
    if ((w->embed->dtype != K3_DT_BF16 && w->embed->dtype != K3_DT_F16 && w->embed->dtype != K3_DT_F32) || w->embed->ndim != 2 ||
        w->embed->shape[0] != c->vocab_size || w->embed->shape[1] != c->hidden_size) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: embed_tokens.weight is %s [%llu, %llu], expected BF16, F16 or F32 [%u, %u]",
                        dir, k3_dtype_name(w->embed->dtype), (unsigned long long)w->embed->shape[0],
                        (unsigned long long)(w->embed->ndim > 1 ? w->embed->shape[1] : 0), c->vocab_size,
                        c->hidden_size);
        st_close(&w->base);
        return rc;
    }
    const uint64_t I = c->moe_intermediate_size, L = c->routed_expert_hidden_size, n = I * L;
    w->rec_off[0] = 0; w->rec_off[1] = n / 2;
    w->rec_off[2] = n / 2 + n / 32; w->rec_off[3] = w->rec_off[2] + n / 2;
    w->rec_off[4] = w->rec_off[3] + n / 32; w->rec_off[5] = w->rec_off[4] + n / 2;
    w->rec_bytes = w->rec_off[5] + n / 32;
    w->qbuf = malloc((n ? n : 1) * sizeof(float));
    w->rowbuf = malloc((uint64_t)c->hidden_size * 4);
    if (!w->qbuf || !w->rowbuf) {
        st_close(&w->base);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    *out = &w->base;
    return 0;
}
