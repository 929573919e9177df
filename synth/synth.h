/*
 * synth.h - k3-synth internals: model presets, the tensor list of an upstream
 * checkpoint (docs/MODEL.md §2), the counter-based weight generator, the small BPE
 * vocabulary, and the checkpoint writer that ties them together.
 *
 * Invariants: everything written is a pure function of the options (seed,
 * preset, sizes, forms); any byte of any tensor can be produced on its own
 * (counter-based generator), so shards are generated in parallel, in
 * constant memory, and two runs with the same options are byte-identical.
 */
#ifndef K3_SYNTH_H
#define K3_SYNTH_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "k3_err.h"
#include "k3_progress.h"
#include "k3_schema.h"
#include "k3_st.h"

#define K3_SYNTH_MAX_LAYERS 1024

/* Vector dtype policy. */
enum { K3_SYNTH_VEC_REAL = 0, K3_SYNTH_VEC_BF16, K3_SYNTH_VEC_F32, K3_SYNTH_VEC_MIXED };

/* Trunk dtype policy (every tensor but the routed experts):
 *   BF16:  matrices BF16, vectors by the vector policy;
 *   REAL:  as some exporters ship K3: BF16 matrices but the routers
 *          (gate.weight) and the conv taps in F32, the AttnRes projections
 *          as F32 [1][E]; vectors by the vector policy;
 *   F32, F16: every trunk tensor in that dtype;
 *   MIXED: per tensor, BF16, F16 or F32 by a hash of its name (and the
 *          AttnRes projections [1][E] when F32). */
enum { K3_SYNTH_TRUNK_BF16 = 0, K3_SYNTH_TRUNK_REAL, K3_SYNTH_TRUNK_F32, K3_SYNTH_TRUNK_F16, K3_SYNTH_TRUNK_MIXED };

/* The model shape and the writing options. */
typedef struct k3_synth_model {
    char preset[16];
    uint32_t hidden, layers, vocab;
    uint32_t kda_heads, kda_head_dim, conv;
    double gate_lower_bound;
    uint32_t mla_heads, q_lora, kv_lora, nope, rope, v_dim;
    uint32_t experts, top_k, shared, latent, moe_inter;
    uint32_t first_dense, dense_inter, attn_res_block;
    double situ_beta, situ_linear_beta, rms_eps, routed_scaling;
    uint8_t is_mla[K3_SYNTH_MAX_LAYERS];
    /* tokenizer */
    uint32_t n_specials;       /* specials after the ranks */
    uint32_t max_ranks;        /* cap on BPE ranks (256 + merges) */
} k3_synth_model;

typedef struct k3_synth_opts {
    k3_synth_model m;
    uint64_t seed;
    int experts_bf16;          /* experts as BF16 .weight instead of MXFP4 */
    int vec_dtype;             /* K3_SYNTH_VEC_* */
    int trunk_dtype;           /* K3_SYNTH_TRUNK_* */
    int vision;                /* also write a small vision tower (outside language_model.) */
    int alog_padded;           /* A_log [D] instead of [H] */
    int nested;                /* nested config.json */
    int sparse;                /* K3_SYNTH_SPARSE_* */
    int write_index, write_tokenizer;
    uint64_t shard_size;       /* maximum shard file size */
    int force, quiet, direct;
    int threads;               /* 0: default */
    uint64_t chunk_bytes;      /* 0: default */
} k3_synth_opts;

/* Fill m with a preset ("tiny", "k3-width", "k3"); layers/vocab 0 = preset
 * default. Also sets the option defaults that depend on the preset. */
int k3_synth_preset(k3_synth_opts *o, const char *name, uint32_t layers, uint32_t vocab, k3_err *e);

/* ---- tensor list ---------------------------------------------------------- */

/* Tensor kinds: a language-model trunk tensor is its tensor-schema row
 * (k3_wslot, or K3_SCH_EMBED; include/k3_schema.h), written in the schema's
 * checkpoint order; then the routed experts' parts and the vision tower. */
enum k3_synth_kind {
    SK_EXP_W1_P = K3_SCH_COUNT, SK_EXP_W1_S, SK_EXP_W2_P, SK_EXP_W2_S, SK_EXP_W3_P, SK_EXP_W3_S,
    SK_EXP_W1, SK_EXP_W2, SK_EXP_W3,
    SK_VIS_PATCH, SK_VIS_NORM, SK_VIS_PROJ,   /* --vision: not language-model tensors */
    SK_COUNT
};

typedef struct k3_synth_tensor {
    uint64_t key;       /* generator key: hash of (seed, name) */
    uint32_t layer;     /* UINT32_MAX for model-level tensors */
    uint32_t expert;
    uint16_t kind;
    uint8_t dtype;      /* k3_dtype */
    uint8_t ndim;
    uint32_t shard;
    uint64_t shape[3];
    uint64_t bytes;
} k3_synth_tensor;

/* The whole tensor list in file order (heap; caller frees *t). */
int k3_synth_tensors(const k3_synth_opts *o, k3_synth_tensor **t, uint64_t *count, k3_err *e);
/* Full tensor name into buf; returns its length (or what it would be). */
int k3_synth_tensor_name(const k3_synth_tensor *t, char *buf, size_t cap);
/* --sparse: only routers, vectors and the embedding carry data. --sparse-live:
 * the output head and the MXFP4 scale bytes too, so that the zero experts
 * compute at the speed of real ones (an all-zero scale byte is a float
 * denormal) and the text is a function of the last id. */
enum { K3_SYNTH_DENSE, K3_SYNTH_SPARSE, K3_SYNTH_SPARSE_LIVE };
/* Whether a kind carries data in a --sparse checkpoint. */
int k3_synth_kind_has_data_when_sparse(int kind);
/* Whether tensors of a kind carry data under o (every kind when dense). */
int k3_synth_has_data(const k3_synth_opts *o, int kind);

/* ---- generator ------------------------------------------------------------ */

/* The counter-based generator: word j of tensor stream `key` is
 * k3_synth_mix(key + (j+1) * 0x9E3779B97F4A7C15), a splitmix64 finalizer. */
uint64_t k3_synth_mix(uint64_t x);
/* FNV-1a of the name, mixed with the seed. */
uint64_t k3_synth_key(uint64_t seed, const char *name);

/* Fill bytes [off, off+n) of tensor t (see k3_stw_fill_fn). Returns 0 or
 * K3_STW_ZERO (sparse and not a data kind). */
int k3_synth_fill(const k3_synth_opts *o, const k3_synth_tensor *t, uint64_t off, uint64_t n, void *buf);

/* ---- tokenizer ------------------------------------------------------------ */

/* Learn a byte-level BPE vocabulary on the built-in text: at most max_ranks
 * ranks (>= 256). *tokens is a heap array of *count heap byte strings with
 * lengths in *lens; free with k3_synth_bpe_free. Deterministic. */
int k3_synth_bpe_learn(uint32_t max_ranks, unsigned char ***tokens, uint32_t **lens, uint32_t *count,
                       k3_err *e);
void k3_synth_bpe_free(unsigned char **tokens, uint32_t *lens, uint32_t count);
/* Name of special token k (0-based) */
void k3_synth_special_name(uint32_t k, char *buf, size_t cap);

/* ---- the checkpoint ------------------------------------------------------- */

/* Summary of what was written. */
typedef struct k3_synth_result {
    uint64_t tensors, shards, logical_bytes, written_bytes, ranks, vocab;
    double seconds;
} k3_synth_result;

/* Write the checkpoint directory dst (published atomically: built in
 * "<dst>.tmp", renamed at the end). cancel may be NULL. */
int k3_synth_write(const k3_synth_opts *o, const char *dst, volatile sig_atomic_t *cancel,
                   k3_synth_result *r, k3_err *e);

/* The config.json text (heap, caller frees). */
char *k3_synth_config_json(const k3_synth_opts *o);

#endif
