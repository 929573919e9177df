/*
 * ws_pk.c - weight source over a packed model directory (k3_pk): the product
 * path. This is the resident form: a group's units are read (CRC-checked)
 * into 4096-aligned buffers on first acquire and kept, or freed on release
 * with K3_WS_DROP; expert records likewise, each CRC-checked when read into
 * its place in one arena mapped at open (address space only: a page takes
 * memory when a record is first read into it), so a step never allocates
 * (with K3_WS_DROP: one aligned buffer per record, freed on release). Views point into those buffers, so a tensor is
 * used exactly as stored. A tensor split into several row pieces (k3-pack) is
 * gathered into one contiguous buffer at acquire. The embedding is read a row
 * at a time, each row checked against its CRC32 in embed.crc. The streaming source (RAM
 * budget) implements the same k3_ws_ops over a ring of slots.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "k3_io.h"
#include "k3_kern.h"
#include "k3_pk.h"
#include "k3_ws.h"

typedef struct ws_pk {
    k3_ws base;
    k3_pk *pk;
    unsigned flags;
    uint32_t ng;
    const k3_pk_tensor **t;        /* ng x K3_W_COUNT */
    k3_view *views;                /* ng x K3_W_COUNT */
    void **gathered;               /* ng x K3_W_COUNT: owned copies of multi-piece tensors */
    void **unit_buf;               /* per unit, aligned, NULL when not loaded */
    uint8_t *loaded;
    const k3_pk_tensor *embed;
    uint8_t *rowbuf, *bounce;
    uint64_t bounce_cap;
    uint8_t **rec;                 /* NL x NE */
    uint8_t *rec_arena;            /* NL x NE record places, mapped at open (not K3_WS_DROP) */
    uint64_t rec_arena_bytes;
    const k3_pk_expert_layout *lay;
} ws_pk;

static int32_t group_layer(const ws_pk *w, uint32_t g)
{
    return g + 1 == w->ng ? K3_PK_LAYER_HEAD : (int32_t)g;
}

static int pk_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    ws_pk *w = (ws_pk *)ws;
    const k3_pk_tensor *t = g < w->ng ? w->t[(uint64_t)g * K3_W_COUNT + s] : NULL;
    if (!t) {
        char name[512];
        k3_schema_name(name, sizeof name, (uint32_t)s, g, 1);
        return k3_err_set(e, K3_ENOENT, "%s: packed model has no tensor %s", ws->dir, name);
    }
    *out = w->views[(uint64_t)g * K3_W_COUNT + s];
    out->data = NULL;
    return 0;
}

static void pk_free_group(ws_pk *w, uint32_t g)
{
    const uint32_t *ids;
    uint32_t n;
    k3_pk_layer_units(w->pk, group_layer(w, g), &ids, &n);
    for (uint32_t i = 0; i < n; i++) {
        k3_io_free_aligned(w->unit_buf[ids[i]]);
        w->unit_buf[ids[i]] = NULL;
    }
    for (int s = 0; s < K3_W_COUNT; s++) {
        uint64_t i = (uint64_t)g * K3_W_COUNT + s;
        free(w->gathered[i]);
        w->gathered[i] = NULL;
        w->views[i].data = NULL;
    }
    w->loaded[g] = 0;
}

static int pk_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    ws_pk *w = (ws_pk *)ws;
    if (g >= w->ng)
        return k3_err_set(e, K3_EINTERNAL, "weight group %u out of range", g);
    if (!w->loaded[g]) {
        const uint32_t *ids;
        uint32_t n;
        k3_pk_layer_units(w->pk, group_layer(w, g), &ids, &n);
        for (uint32_t i = 0; i < n; i++) {
            const k3_pk_unit *u = k3_pk_unit_at(w->pk, ids[i]);
            void *buf = k3_io_alloc_aligned(u->nbytes ? u->nbytes : K3_PK_ALIGN, K3_PK_ALIGN);
            if (!buf) {
                pk_free_group(w, g);
                return k3_err_set(e, K3_ENOMEM, "out of memory for a trunk unit of %llu bytes",
                                  (unsigned long long)u->nbytes);
            }
            w->unit_buf[ids[i]] = buf;
            int rc = k3_pk_read_unit(w->pk, ids[i], buf, 1, e);
            if (rc < 0) {
                pk_free_group(w, g);
                return rc;
            }
        }
        for (int s = 0; s < K3_W_COUNT; s++) {
            uint64_t i = (uint64_t)g * K3_W_COUNT + s;
            const k3_pk_tensor *t = w->t[i];
            if (!t)
                continue;
            const void *data = NULL;
            if (t->npieces == 1) {
                const k3_pk_piece *p = &t->pieces[0];
                const k3_pk_unit *u = k3_pk_unit_at(w->pk, p->unit);
                if (!w->unit_buf[p->unit]) {
                    pk_free_group(w, g);
                    return k3_err_set(e, K3_EFORMAT, "%s: tensor %s lives in a unit of another layer", ws->dir,
                                      t->name);
                }
                data = (const uint8_t *)w->unit_buf[p->unit] + (p->offset - u->offset);
            } else {
                uint8_t *buf = malloc(t->nbytes ? t->nbytes : 1);
                if (!buf) {
                    pk_free_group(w, g);
                    return k3_err_set(e, K3_ENOMEM, "out of memory gathering %s", t->name);
                }
                w->gathered[i] = buf;
                uint64_t pos = 0;
                for (uint32_t k = 0; k < t->npieces; k++) {
                    const k3_pk_piece *p = &t->pieces[k];
                    const k3_pk_unit *u = k3_pk_unit_at(w->pk, p->unit);
                    if (!w->unit_buf[p->unit] || pos + p->nbytes > t->nbytes) {
                        pk_free_group(w, g);
                        return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: piece %u outside its layer's units",
                                          ws->dir, t->name, k);
                    }
                    memcpy(buf + pos, (const uint8_t *)w->unit_buf[p->unit] + (p->offset - u->offset), p->nbytes);
                    pos += p->nbytes;
                }
                data = buf;
            }
            w->views[i].data = data;
        }
        w->loaded[g] = 1;
    }
    *views = &w->views[(uint64_t)g * K3_W_COUNT];
    return 0;
}

static void pk_release(k3_ws *ws, uint32_t g)
{
    ws_pk *w = (ws_pk *)ws;
    if ((w->flags & K3_WS_DROP) && g < w->ng)
        pk_free_group(w, g);
}

static int pk_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    ws_pk *w = (ws_pk *)ws;
    const uint64_t E = ws->cfg.hidden_size;
    for (uint32_t i = 0; i < n; i++) {
        int rc = k3_pk_embed_row(w->pk, w->embed, ids[i], w->rowbuf, w->bounce, w->bounce_cap, out + (uint64_t)i * E,
                                 NULL, ws->dir, e);
        if (rc < 0)
            return rc;
    }
    return 0;
}

static uint32_t pk_batch_max(k3_ws *ws) { return ws->cfg.num_experts; }

static int pk_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
                              k3_err *e)
{
    ws_pk *w = (ws_pk *)ws;
    const uint32_t NE = ws->cfg.num_experts;
    if (!w->lay)
        return k3_err_set(e, K3_EFORMAT, "%s: packed model has no expert records", ws->dir);
    for (uint32_t i = 0; i < n; i++) {
        if (layer >= ws->cfg.num_hidden_layers || ids[i] >= NE)
            return k3_err_set(e, K3_EINTERNAL, "expert %u of layer %u out of range", ids[i], layer);
        uint8_t **slot = &w->rec[(uint64_t)layer * NE + ids[i]];
        if (!*slot) {
            uint8_t *r = w->rec_arena ? w->rec_arena + ((uint64_t)layer * NE + ids[i]) * w->lay->stride
                                      : k3_io_alloc_aligned(w->lay->stride, K3_PK_ALIGN);
            if (!r)
                return k3_err_set(e, K3_ENOMEM, "out of memory for an expert record");
            int rc = k3_pk_read_record(w->pk, layer, ids[i], r, 1, e);
            if (rc < 0) {
                if (!w->rec_arena)
                    k3_io_free_aligned(r);
                return rc;
            }
            *slot = r;
        }
        const k3_pk_expert_layout *l = w->lay;
        out[i].packed[0] = *slot + l->w1_packed;
        out[i].scales[0] = *slot + l->w1_scales;
        out[i].packed[1] = *slot + l->w3_packed;
        out[i].scales[1] = *slot + l->w3_scales;
        out[i].packed[2] = *slot + l->w2_packed;
        out[i].scales[2] = *slot + l->w2_scales;
    }
    return 0;
}

static void pk_experts_release(k3_ws *ws, uint32_t layer)
{
    ws_pk *w = (ws_pk *)ws;
    if (!(w->flags & K3_WS_DROP))
        return;
    const uint32_t NE = ws->cfg.num_experts;
    for (uint32_t x = 0; x < NE; x++) {
        k3_io_free_aligned(w->rec[(uint64_t)layer * NE + x]);
        w->rec[(uint64_t)layer * NE + x] = NULL;
    }
}

static void pk_close(k3_ws *ws)
{
    ws_pk *w = (ws_pk *)ws;
    if (w->gathered)
        for (uint64_t i = 0; i < (uint64_t)w->ng * K3_W_COUNT; i++)
            free(w->gathered[i]);
    if (w->unit_buf && w->pk)
        for (uint32_t i = 0; i < k3_pk_unit_count(w->pk); i++)
            k3_io_free_aligned(w->unit_buf[i]);
    if (w->rec_arena)
        munmap(w->rec_arena, w->rec_arena_bytes);
    else if (w->rec)
        for (uint64_t i = 0; i < (uint64_t)ws->cfg.num_hidden_layers * ws->cfg.num_experts; i++)
            k3_io_free_aligned(w->rec[i]);
    free(w->rec);
    free(w->gathered);
    free(w->unit_buf);
    free(w->views);
    free(w->t);
    free(w->loaded);
    free(w->rowbuf);
    k3_io_free_aligned(w->bounce);
    k3_pk_close(w->pk);
    free(w);
}

static const k3_ws_ops pk_ops = {
    "packed", pk_describe, pk_acquire, pk_release, pk_embed,
    pk_batch_max, pk_experts_acquire, pk_experts_release, pk_close, NULL, NULL, NULL, NULL, NULL, NULL,
};

int k3_ws_pk_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    ws_pk *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    w->base.ops = &pk_ops;
    w->flags = flags;
    snprintf(w->base.dir, sizeof w->base.dir, "%s", dir);
    int rc = k3_pk_open(&w->pk, dir, 0, e);
    if (rc < 0) {
        free(w);
        return rc;
    }
    w->base.cfg = *k3_pk_cfg(w->pk);
    if (k3_pk_tokenizer_file(w->pk, "tiktoken.model"))
        snprintf(w->base.tok_dir, sizeof w->base.tok_dir, "%s", k3_pk_tokenizer_dir(w->pk));
    w->base.tok_sha256[0] = k3_pk_tokenizer_sha256(w->pk, "tiktoken.model");
    w->base.tok_sha256[1] = k3_pk_tokenizer_sha256(w->pk, "tokenizer_config.json");
    const k3_cfg *c = &w->base.cfg;
    const uint32_t NL = c->num_hidden_layers;
    w->ng = NL + 1;
    const uint64_t nslots = (uint64_t)w->ng * K3_W_COUNT;
    w->t = calloc(nslots, sizeof *w->t);
    w->views = calloc(nslots, sizeof *w->views);
    w->gathered = calloc(nslots, sizeof *w->gathered);
    w->unit_buf = calloc(k3_pk_unit_count(w->pk) + 1, sizeof *w->unit_buf);
    w->loaded = calloc(w->ng, 1);
    w->rec = calloc((uint64_t)NL * c->num_experts + 1, sizeof *w->rec);
    w->rowbuf = malloc((uint64_t)c->hidden_size * 4);
    w->bounce_cap = ((uint64_t)c->hidden_size * 4 + 2 * K3_PK_ALIGN + K3_PK_ALIGN - 1) / K3_PK_ALIGN * K3_PK_ALIGN;
    w->bounce = k3_io_alloc_aligned(w->bounce_cap, K3_PK_ALIGN);
    if (!w->t || !w->views || !w->gathered || !w->unit_buf || !w->loaded || !w->rec || !w->rowbuf || !w->bounce) {
        pk_close(&w->base);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    char name[512];
    for (uint32_t g = 0; g < w->ng; g++)
        for (int s = 0; s < K3_W_COUNT; s++) {
            if ((g == NL) != k3_wslot_in_head((k3_wslot)s))
                continue;   /* a head slot is in the head group only, a layer slot in layers */
            k3_schema_name(name, sizeof name, (uint32_t)s, g, 1);
            const k3_pk_tensor *t = k3_pk_tensor_find(w->pk, name);
            if (!t)
                continue;
            if (t->ndim > 4) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: tensor %s has %u dimensions", dir, name, t->ndim);
                pk_close(&w->base);
                return rc;
            }
            uint64_t i = (uint64_t)g * K3_W_COUNT + s;
            w->t[i] = t;
            w->views[i].dtype = t->dtype;
            w->views[i].ndim = t->ndim;
            for (uint32_t d = 0; d < t->ndim; d++)
                w->views[i].shape[d] = t->shape[d];
        }
    w->embed = k3_pk_tensor_find(w->pk, K3_SCH_EMBED_NAME);
    if (!w->embed || (w->embed->dtype != K3_DT_BF16 && w->embed->dtype != K3_DT_F16 && w->embed->dtype != K3_DT_F32) || w->embed->ndim != 2 ||
        w->embed->shape[0] != c->vocab_size || w->embed->shape[1] != c->hidden_size) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: embed_tokens.weight missing or not as expected: BF16/F16/F32 [%u, %u]", dir,
                        c->vocab_size, c->hidden_size);
        pk_close(&w->base);
        return rc;
    }
    w->lay = k3_pk_experts(w->pk);
    if (w->lay && (w->lay->rows_w13 != c->moe_intermediate_size || w->lay->cols_w13 != c->routed_expert_hidden_size)) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: expert records are %ux%u, expected %ux%u from the config", dir,
                        w->lay->rows_w13, w->lay->cols_w13, c->moe_intermediate_size, c->routed_expert_hidden_size);
        pk_close(&w->base);
        return rc;
    }
    if (w->lay && !(flags & K3_WS_DROP)) {
        /* stride is a multiple of K3_PK_ALIGN, so every place stays aligned */
        w->rec_arena_bytes = (uint64_t)NL * c->num_experts * w->lay->stride;
        void *a = w->rec_arena_bytes ? mmap(NULL, w->rec_arena_bytes, PROT_READ | PROT_WRITE,
                                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                                     : MAP_FAILED;
        if (a == MAP_FAILED) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: cannot map %llu bytes of address space for the expert records", dir,
                            (unsigned long long)w->rec_arena_bytes);
            pk_close(&w->base);
            return rc;
        }
        w->rec_arena = a;
    }
    *out = &w->base;
    return 0;
}
