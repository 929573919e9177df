/*
 * k3_ws.h - weight sources: where the forward pass gets its weights from.
 *
 * The forward pass never opens a file. It asks a weight source, in this order
 * and only this way:
 *   - k3_ws_embed: the embedding rows of some token ids, widened to f32;
 *   - per layer L: k3_ws_acquire(L) gives a table of tensor views indexed by
 *     k3_wslot (absent slots have data == NULL), valid until k3_ws_release(L);
 *   - per MoE layer, after routing: k3_ws_experts_acquire(L, ids, n) gives one
 *     k3_expert_view per requested expert (n <= k3_ws_expert_batch_max), valid
 *     until k3_ws_experts_release(L); the model asks in batches (one expert
 *     at a time, in the order experts_prefetch leaves the ids in);
 *   - the model output (final norm, output attention residual, head) is the
 *     group K3_WS_HEAD(cfg) = num_hidden_layers.
 * At most one trunk group and one expert batch are held at a time. A source
 * that keeps everything resident makes release a no-op; a streaming source
 * (RAM budget) reads on acquire and recycles its slots on release. Both give
 * the same bytes, so the numbers cannot depend on the source.
 *
 * Sources: k3_ws_open picks by content of the directory: a packed model
 * (manifest.json) or an upstream safetensors checkpoint (config.json +
 * *.safetensors). k3_ws_mem_create builds a random in-memory model for tests.
 *
 * Views are borrowed from the source. Matrices are row-major [out][in] BF16 (or
 * F32); vectors BF16 or F32; expert matrices MXFP4 (packed nibbles + E8M0
 * scales, layout of k3_kern.h).
 */
#ifndef K3_WS_H
#define K3_WS_H

#include <stdint.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_schema.h"
#include "k3_st.h"

/* The slots (k3_wslot), their names and where they appear: the tensor
 * schema, include/k3_schema.h. */

/* The head group's index for a config. */
#define K3_WS_HEAD(cfg) ((cfg)->num_hidden_layers)

typedef struct k3_ws k3_ws;

typedef struct k3_view {
    k3_dtype dtype;
    uint32_t ndim;
    uint64_t shape[4];
    const void *data;        /* NULL for an absent slot or in a description */
    /* A streamed matrix (data NULL, src set): its rows come from
     * k3_ws_rows_acquire(src, group, slot, ...) a range at a time, in row
     * order; k3_model_mm_rows does this. Only sources with rows_acquire set
     * it; every other view has src NULL. */
    k3_ws *src;
    uint32_t group, slot;
    /* A streamed matrix: the rows of each of its pieces (the last of each
     * rank's range may be shorter; describe sets it too, after the plan). */
    uint64_t piece_rows;
} k3_view;

/* Number of elements of a view (product of the shape). */
uint64_t k3_view_numel(const k3_view *v);

/* One routed expert in MXFP4: [0] = w1 (gate, I x L), [1] = w3 (up, I x L),
 * [2] = w2 (down, L x I). */
typedef struct k3_expert_view {
    const uint8_t *packed[3];
    const uint8_t *scales[3];
} k3_expert_view;

/* Implementation table (for sources; users call the k3_ws_* wrappers). */
typedef struct k3_ws_ops {
    const char *kind;
    /* Shape and dtype of a slot without reading data (data left NULL);
     * K3_ENOENT if the source has no such tensor. */
    int (*describe)(k3_ws *ws, uint32_t group, k3_wslot s, k3_view *out, k3_err *e);
    int (*acquire)(k3_ws *ws, uint32_t group, const k3_view **views, k3_err *e);
    void (*release)(k3_ws *ws, uint32_t group);
    int (*embed)(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e);
    uint32_t (*expert_batch_max)(k3_ws *ws);
    int (*experts_acquire)(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n,
                           k3_expert_view *out, k3_err *e);
    void (*experts_release)(k3_ws *ws, uint32_t layer);
    void (*close)(k3_ws *ws);
    /* Optional (NULL: nothing to do): a hint given right after routing, before
     * the first experts_acquire of the layer, with every expert id the layer
     * will ask for (ascending); a streaming source starts reading them, and
     * may reorder ids into the order it will have them ready (those it holds
     * first), the order the model then asks for them in. */
    void (*experts_prefetch)(k3_ws *ws, uint32_t layer, uint32_t *ids, uint32_t n);
    /* Optional, for streamed matrices (k3_view.src): the rows from row on of
     * slot s of group g (held group), *n of them (>= 1, the source's piece),
     * valid until rows_release; then the next rows. A failure is sticky:
     * status returns it (0 if none); the model checks status after every
     * layer and after the head. */
    int (*rows_acquire)(k3_ws *ws, uint32_t g, k3_wslot s, uint64_t row, uint64_t *n, const void **data, k3_err *e);
    void (*rows_release)(k3_ws *ws, uint32_t g, k3_wslot s);
    int (*status)(k3_ws *ws, k3_err *e);
    /* Optional, over several ranks (k3_dist.h): group g is done on every
     * rank with status code (0 or this rank's failure). A source that reads
     * only this rank's pieces checks here, with every rank, the CRCs of the
     * units their pieces share; without it the model just agrees on code.
     * Every rank calls it for the same groups in the same order. */
    int (*dist_check)(k3_ws *ws, uint32_t g, int code, k3_err *e);
    /* Optional: a guess, made before layer `layer`'s attention, of the
     * experts its routing will pick (ids ascending). A streaming source reads
     * them while its device has nothing else to do; the layer's
     * experts_prefetch then keeps the guesses it names and drops the others,
     * unread if their read has not started. A wrong guess costs reads, never
     * a number. */
    void (*experts_guess)(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n);
} k3_ws_ops;

struct k3_ws {
    const k3_ws_ops *ops;
    k3_cfg cfg;
    char dir[4096];          /* model directory ("" for in-memory sources) */
    char tok_dir[4096];      /* where tokenizer files are ("" if none) */
    /* The SHA-256 a packed model's manifest records for tiktoken.model [0]
     * and tokenizer_config.json [1] (borrowed from the source, NULL if none):
     * k3_tok_open_checked compares the files with them. */
    const uint8_t *tok_sha256[2];
};

/* Open the model at dir: a packed model if dir/manifest.json exists, otherwise
 * an upstream checkpoint. flags: K3_WS_DROP asks a resident source to free a
 * group's memory on release (used by benchmarks on huge checkpoints). */
#define K3_WS_DROP 1u
int k3_ws_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e);

/* An upstream safetensors checkpoint (config.json + shards), read with k3_st.
 * Trunk tensors are read on first acquire and kept (or freed on release with
 * K3_WS_DROP). Experts: upstream MXFP4 (weight_packed/weight_scale) are used
 * as stored; experts given as BF16/F16/F32 ".weight" are quantized with
 * k3_mx_quantize when first read - a convenience for checkpoints that a
 * converter has not seen; the packed path never does this. */
int k3_ws_st_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e);

/* A packed model directory (manifest.json), read with k3_pk. */
int k3_ws_pk_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e);

/* A model held in memory with weights drawn from a seeded generator: for
 * tests and benchmarks only. cfg is copied. Matrices are BF16 scaled by
 * 1/sqrt(in), vectors F32, experts MXFP4. */
int k3_ws_mem_create(k3_ws **out, const k3_cfg *cfg, uint64_t seed, k3_err *e);

void k3_ws_close(k3_ws *ws);   /* accepts NULL */

static inline const k3_cfg *k3_ws_cfg(const k3_ws *ws) { return &ws->cfg; }
static inline int k3_ws_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *v, k3_err *e)
{
    return ws->ops->describe(ws, g, s, v, e);
}
static inline int k3_ws_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    return ws->ops->acquire(ws, g, views, e);
}
static inline void k3_ws_release(k3_ws *ws, uint32_t g) { ws->ops->release(ws, g); }
static inline int k3_ws_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    return ws->ops->embed(ws, ids, n, out, e);
}
static inline uint32_t k3_ws_expert_batch_max(k3_ws *ws) { return ws->ops->expert_batch_max(ws); }
static inline int k3_ws_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n,
                                        k3_expert_view *out, k3_err *e)
{
    return ws->ops->experts_acquire(ws, layer, ids, n, out, e);
}
static inline void k3_ws_experts_release(k3_ws *ws, uint32_t layer) { ws->ops->experts_release(ws, layer); }
static inline int k3_ws_rows_acquire(k3_ws *ws, uint32_t g, k3_wslot s, uint64_t row, uint64_t *n,
                                     const void **data, k3_err *e)
{
    return ws->ops->rows_acquire(ws, g, s, row, n, data, e);
}
static inline void k3_ws_rows_release(k3_ws *ws, uint32_t g, k3_wslot s) { ws->ops->rows_release(ws, g, s); }
static inline int k3_ws_status(k3_ws *ws, k3_err *e) { return ws->ops->status ? ws->ops->status(ws, e) : 0; }
static inline int k3_ws_dist_check(k3_ws *ws, uint32_t g, int code, k3_err *e)
{
    return ws->ops->dist_check(ws, g, code, e);
}
static inline int k3_ws_has_dist_check(const k3_ws *ws) { return ws->ops->dist_check != NULL; }
static inline void k3_ws_experts_prefetch(k3_ws *ws, uint32_t layer, uint32_t *ids, uint32_t n)
{
    if (ws->ops->experts_prefetch)
        ws->ops->experts_prefetch(ws, layer, ids, n);
}
static inline int k3_ws_has_experts_guess(const k3_ws *ws) { return ws->ops->experts_guess != NULL; }
static inline void k3_ws_experts_guess(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    ws->ops->experts_guess(ws, layer, ids, n);
}

#endif
