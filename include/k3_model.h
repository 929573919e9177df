/*
 * k3_model.h - the Kimi K3 forward pass (docs/MODEL.md §1) over a weight source.
 *
 * A k3_model holds the dimensions, the scratch for one chunk of up to
 * max_chunk tokens (sized at open: the decode loop never allocates) and a
 * borrowed weight source. A k3_sess holds one token stream's state: the
 * position, the KDA recurrent state and short-conv history of every KDA layer,
 * and the MLA cache (per MLA layer and position: the latent after
 * kv_a_layernorm, kv_lora_rank floats, then the shared rope key,
 * qk_rope_head_dim floats - 576 floats at K3 size).
 *
 * Numbers: every token's result depends only on the token ids before it, never
 * on how the ids were split into chunks, on the thread count or on the weight
 * source: work is split only over independent outputs and every reduction has
 * one fixed order (documented in engine/model.c).
 */
#ifndef K3_MODEL_H
#define K3_MODEL_H

#include <stdint.h>

#include "k3_cfg.h"
#include "k3_engine.h"
#include "k3_err.h"
#include "k3_ws.h"

typedef struct k3_model k3_model;
typedef struct k3_sess k3_sess;

typedef struct k3_model_opts {
    uint32_t max_chunk;   /* tokens per forward step (0: 64) */
} k3_model_opts;

/* Validate every tensor's shape and dtype against ws's config and size the
 * scratch. ws is borrowed and must outlive the model. */
int k3_model_open(k3_model **out, k3_ws *ws, const k3_model_opts *opts, k3_err *e);
void k3_model_close(k3_model *m);   /* accepts NULL */

/* The bytes k3_model_open and k3_sess_create allocate, from the config alone:
 * model = the model and its scratch for chunks of max_chunk (0: 64) tokens;
 * per session: kv (the MLA latent cache of max_ctx positions), state
 * (KDA state, conv history, the session itself) and scores (attention
 * scores: nthreads x max_ctx floats for each of up to 8 heads). Vectors
 * are counted at the config's sizes (an A_log padded to D values takes
 * D - H floats more). The memory planner's
 * model sizes are these (k3_stream_model_mem); tests/t_schema.c checks them
 * against what open and create allocate. */
typedef struct k3_model_mem {
    uint64_t model, kv, state, scores;
} k3_model_mem;
void k3_model_mem_need(const k3_cfg *c, uint32_t max_chunk, uint32_t max_ctx, uint32_t nthreads,
                       k3_model_mem *out);

const k3_cfg *k3_model_cfg(const k3_model *m);
uint32_t k3_model_max_chunk(const k3_model *m);

/* A stream of up to max_ctx tokens (prompt + generated). */
int k3_sess_create(k3_sess **out, const k3_model *m, uint32_t max_ctx, k3_err *e);
void k3_sess_free(k3_sess *s);   /* accepts NULL */
void k3_sess_reset(k3_sess *s);  /* back to position 0, all state zero */
uint32_t k3_sess_pos(const k3_sess *s);
uint32_t k3_sess_max_ctx(const k3_sess *s);
/* dst takes src's state (same model; dst must have room for src's position). */
int k3_sess_copy(k3_sess *dst, const k3_sess *src, k3_err *e);
/* The state as bytes: the layout and rules of k3_seq_state_* (k3_engine.h). */
uint64_t k3_sess_state_size(const k3_sess *s);
int k3_sess_state_save(const k3_sess *s, void *buf, uint64_t cap, uint64_t *len, k3_err *e);
int k3_sess_state_load(k3_sess *s, const void *buf, uint64_t len, k3_err *e);

/* Which logits k3_model_forward writes: K3_LOGITS_* of k3_engine.h. */

/*
 * Run n tokens (appended at the session's position) through the model, in
 * chunks of at most max_chunk. logits receives V floats for the last token
 * (K3_LOGITS_LAST) or n*V floats, row t for token t (K3_LOGITS_ALL); it may be
 * NULL with K3_LOGITS_NONE. Ids must be < vocab_size; the session must have
 * room for n more tokens (K3_ELIMIT otherwise). On error the session is left
 * in an unspecified state (reset it).
 */
int k3_model_forward(k3_model *m, k3_sess *s, const uint32_t *ids, uint32_t n,
                     int logits_mode, float *logits, k3_err *e);

/* One session's tokens in a batched forward: as k3_model_forward's
 * arguments. */
typedef struct k3_model_seq {
    k3_sess *s;
    const uint32_t *ids;
    uint32_t n;
    int logits;
    float *out;
} k3_model_seq;

/*
 * Run several sessions at once: their tokens are laid end to end in passes of
 * at most max_chunk rows (an entry that does not fit goes on in the next
 * pass), each pass reading every weight once for all its rows and the experts
 * once for the union the rows route to. Each session gets exactly the bits
 * k3_model_forward gives it alone. Every entry is checked first (a session at
 * most once, ids, room, buffers): on such an error nothing moves. The
 * single-session k3_model_forward is this with one entry.
 */
int k3_model_forward_batch(k3_model *m, const k3_model_seq *q, uint32_t n, k3_err *e);

/* The routing rule of a MoE layer for one token: sel[0..K) gets the K
 * experts of the largest score[x] + bias[x] (bias may be NULL), in order,
 * ties to the lower index, a NaN key never chosen over a number. score holds
 * the NE sigmoid scores (the model's, or an estimate's: k3-run --probe). */
void k3_moe_route(const float *score, const float *bias, uint32_t NE, uint32_t K, uint32_t *sel);

/* Loops with less work than this (multiply-adds; default 65536) run on one
 * thread. Results never depend on it; tests set 0 to force every loop
 * through the threaded path. Process-wide. */
void k3_model_set_parallel_threshold(uint64_t work);

/* Time spent per layer kind since open (seconds), for benchmarks.
 * products: of the layers' time, what their matrix products took (a
 * streamed matrix's wait for its pieces included); the rest is attention,
 * activations, norms and routing (k3-run --probe prices it). */
typedef struct k3_model_times {
    double embed, attn_kda, attn_mla, mlp_dense, moe, head;
    double products;
} k3_model_times;
void k3_model_times_get(const k3_model *m, k3_model_times *t);
/* Seconds spent in each layer since open or the last reset (compute only:
 * the weight source's acquire/release are outside); out has num_hidden_layers
 * entries. */
void k3_model_layer_times(const k3_model *m, double *out);
void k3_model_times_reset(k3_model *m);

#endif
