/*
 * k3_engine.h - the engine: open a model, run sequences through it.
 *
 * The one interface programs use to run K3 (k3-run is a program over it).
 * Every handle is opaque; nothing here names a tensor or a weight source.
 *
 *   k3_engine_open     a packed model (manifest.json) or an upstream
 *                      checkpoint (config.json + *.safetensors), with its
 *                      tokenizer; cheap: nothing big is read or allocated
 *   k3_engine_plan     optional: the memory plan for the sequences the caller
 *                      will run (streamed models only), to print or check
 *   k3_engine_load     validate every tensor against the config, size the
 *                      scratch, read what the plan keeps resident and start
 *                      the readers; plans first if k3_engine_plan was not
 *                      called. Sequences and steps need a loaded engine.
 *   k3_seq_create      an independent token stream (position, KDA state, conv
 *                      history, MLA latents); any number per engine
 *   k3_engine_step     feed tokens to a set of sequences, logits for each
 *   k3_seq_state_*     a sequence's state as bytes: size, save, load
 *   k3_engine_close
 *
 * Batching: a step is one batch. The tokens of all its entries are laid end
 * to end in passes of at most max_chunk rows (a step of N decode tokens, N <=
 * max_chunk, is one pass; more rows, or a prompt that does not fit, go on in
 * further passes of the same step). A pass reads every trunk weight once for
 * all its rows and fetches each expert once for the union of what its rows
 * route to (expert-major: all the rows that picked expert e are multiplied
 * while e is held). Prompt chunks of new sequences and decode tokens of
 * running ones share a pass.
 *
 * Numbers: a step over N sequences gives each one exactly the bits it would
 * get stepped alone, whatever else is in the batch, and the bits never depend
 * on how a sequence's tokens were split over steps or passes, on the thread
 * count, on the RAM budget or on the source (packed, upstream): every
 * reduction is per row with one fixed order (engine/model.c), and the
 * recurrences and attention run on each sequence's own state.
 *
 * Memory: with a packed model, k3_engine_load and k3_seq_create allocate
 * everything a step needs: a step with one token per sequence (decode, up to
 * max_chunk sequences) never allocates (a test enforces it, resident and
 * streamed). An upstream checkpoint is read lazily: the first step that
 * routes to an expert reads it and allocates its record. What sequences cost
 * and how many a budget admits: k3_engine_mem_get.
 *
 * Threads: one engine is driven by one thread at a time; the engine uses
 * OpenMP workers and, streamed, its own I/O threads.
 *
 * Errors: negative K3_E* codes with the message in *e (k3_err.h). A failed
 * read stops the step; every later step of a streamed engine fails the same
 * way (close and reopen).
 */
#ifndef K3_ENGINE_H
#define K3_ENGINE_H

#include <stdint.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_plan.h"
#include "k3_tok.h"

typedef struct k3_engine k3_engine;
typedef struct k3_seq k3_seq;

/* Which logits a step writes for a sequence. */
enum { K3_LOGITS_NONE = 0, K3_LOGITS_LAST = 1, K3_LOGITS_ALL = 2 };

typedef struct k3_engine_opts {
    /* RAM budget, as k3-run --ram takes it: a size ("8G", "1500M", bytes) or
     * a preset ("floor", "double", "resident"); the weights of a packed model
     * are then streamed within it. NULL: the budget a k3-pack layout records
     * (falling back to the floor when this run needs more, see
     * k3_engine_info.fell_to_floor), else everything resident. */
    const char *ram;
    uint32_t threads;          /* compute threads (0: all cores); process-wide */
    uint32_t max_chunk;        /* rows (tokens of all a step's sequences) per pass (0: 64) */
    int chunk_auto;            /* streamed within a size budget: the largest of 256, 128
                                * and max_chunk rows per pass the budget holds (the trunk
                                * is read once per pass: a longer chunk reads less per
                                * prompt token); k3_engine_get_info says which */
    uint64_t piece_bytes;      /* streamed matrices in row pieces of at most this
                                * (K3_STREAM_PIECE_DEFAULT; 0: whole layers) */
    int trunk_crc;             /* CRC-check streamed trunk units (default 1) */
    int expert_guess;          /* streamed: read experts ahead on a guess (default 1) */
    const char *trace_path;    /* streamed: write every expert request here */
    const char *tok_dir;       /* tokenizer directory (NULL: the model's own,
                                * checked against its manifest's SHA-256) */
} k3_engine_opts;

void k3_engine_opts_init(k3_engine_opts *o);

/* What the memory plan counts (k3_engine_plan, k3_engine_load). */
typedef struct k3_engine_size {
    uint32_t max_ctx;          /* tokens of the longest sequence (0: 4096) */
    uint32_t max_seqs;         /* sequences alive at once (0: 1; K3_ENGINE_SEQS_FIT) */
    uint64_t extra_bytes;      /* the caller's own buffers (logits, ids) */
} k3_engine_size;

/* max_seqs: as many sequences of max_ctx as the budget holds with the
 * weights at their floor (streamed; resident engines have no budget to
 * bound it). k3_engine_mem_get then says how many that is. */
#define K3_ENGINE_SEQS_FIT UINT32_MAX

int k3_engine_open(k3_engine **out, const char *dir, const k3_engine_opts *o, k3_err *e);
void k3_engine_close(k3_engine *en);   /* accepts NULL; frees every sequence too */

/* The model's config (valid until close). */
const k3_cfg *k3_engine_cfg(const k3_engine *en);
/* The tokenizer (NULL if the model has none and no tok_dir was given). */
const k3_tok *k3_engine_tok(const k3_engine *en);

typedef struct k3_engine_info {
    const char *kind;          /* "packed", "upstream", "stream" */
    int streams;               /* weights streamed within a budget */
    int budget_from_layout;    /* the budget came from the k3-pack layout */
    uint64_t layout_budget;    /* that budget (bytes) */
    int fell_to_floor;         /* the layout's budget is below this run's floor */
    int direct;                /* streamed: every data file read with O_DIRECT */
    uint32_t max_chunk;
    uint32_t threads;
} k3_engine_info;
void k3_engine_get_info(const k3_engine *en, k3_engine_info *info);

/* Make the memory plan for sz (once: a second call returns the first plan).
 * *plan is the plan of a streamed engine, NULL when the weights are simply
 * resident. K3_EBUDGET with the floor in the message if the budget is below
 * it. */
int k3_engine_plan(k3_engine *en, const k3_engine_size *sz, const k3_stream_plan **plan, k3_err *e);
/*
 * What sequences cost and how many the budget admits (after the plan), for a
 * caller that admits work (a server queues what does not fit):
 *   seq_bytes     one sequence of the plan's max_ctx: seq_state (the KDA
 *                 recurrent state and conv history, fixed: about 0.44 GB at
 *                 K3 size) + seq_kv (the MLA latents, 576 floats per MLA
 *                 layer and position) + seq_scores (max_ctx floats per
 *                 thread and each of up to 8 heads)
 *   planned_seqs  the sequences the plan counts (k3_engine_size.max_seqs)
 *   max_seqs      streamed: the most sequences of max_ctx the budget holds
 *                 with the weights at their floor (planned_seqs + what the
 *                 budget's room above the plan's floor holds); 0 resident
 *   live_seqs, live_bytes  the sequences alive now and what they take
 * A streamed engine never goes past its budget: k3_seq_create refuses
 * (K3_EBUDGET) a sequence that would take the live ones past planned_seqs x
 * seq_bytes (a shorter max_ctx takes less). K3_EARG before the plan.
 */
typedef struct k3_engine_mem {
    uint64_t seq_bytes, seq_state, seq_kv, seq_scores;
    uint32_t max_ctx;
    uint32_t planned_seqs, max_seqs;
    uint32_t live_seqs;
    uint64_t live_bytes;
} k3_engine_mem;
int k3_engine_mem_get(const k3_engine *en, k3_engine_mem *m, k3_err *e);

/* Validate and load (see the top). Idempotent. */
int k3_engine_load(k3_engine *en, k3_err *e);

/* Streamed engines: the read counters since open (0); 0 and *st zeroed for
 * resident engines (-1 then). */
int k3_engine_stream_stats(const k3_engine *en, k3_stream_stats *st);
/* Streamed engines: publish what the run wrote (the --trace file: flushed,
 * fsynced, renamed from "<path>.tmp"); a write error is returned and nothing
 * is left. 0 for resident engines. Closing without it drops the trace. */
int k3_engine_stream_finish(k3_engine *en, k3_err *e);

/* ---- sequences ---- */

/* A sequence of at most max_ctx tokens, at position 0. */
int k3_seq_create(k3_seq **out, k3_engine *en, uint32_t max_ctx, k3_err *e);
void k3_seq_free(k3_seq *s);          /* accepts NULL */
void k3_seq_reset(k3_seq *s);         /* back to position 0, all state zero */
uint32_t k3_seq_pos(const k3_seq *s);
uint32_t k3_seq_max_ctx(const k3_seq *s);
/* dst becomes a copy of src (same engine; dst must have room for src's
 * position): both continue independently with the same bits. */
int k3_seq_copy(k3_seq *dst, const k3_seq *src, k3_err *e);

/*
 * A sequence's state as bytes, to keep, move or restore:
 *   k3_seq_state_size  bytes k3_seq_state_save writes at the current position
 *                      (it grows with the position: the MLA latents)
 *   k3_seq_state_save  writes them into buf (cap bytes, at least the size;
 *                      K3_ELIMIT otherwise), *len = bytes written
 *   k3_seq_state_load  replaces s's state with a saved one; K3_EFORMAT if the
 *                      bytes are not a state, are of another model shape, or
 *                      fail their CRC; K3_ELIMIT if the position does not fit
 *                      s's max_ctx. On failure s is unchanged.
 * Layout (little-endian): "K3SEQST1", u32 header bytes (64), u32 position,
 * u32 layers, u32 hidden size, u32 KDA heads, u32 KDA head dim, u32 conv
 * kernel, u32 MLA latent + rope (floats per position), u32 KDA layers, u32 MLA
 * layers, u32 vocabulary, u64 payload bytes, u32 CRC32 of the payload, u32
 * zero; then the payload as float32: every KDA layer's state (heads x dim x
 * dim), every KDA layer's conv history (3 x (kernel - 1) x heads*dim), every
 * MLA layer's latents for positions 0..position-1. The bytes say nothing about
 * which weights made them: a caller that keeps states across runs records the
 * model it ran (a state file does).
 */
uint64_t k3_seq_state_size(const k3_seq *s);
int k3_seq_state_save(const k3_seq *s, void *buf, uint64_t cap, uint64_t *len, k3_err *e);
int k3_seq_state_load(k3_seq *s, const void *buf, uint64_t len, k3_err *e);

/* ---- the step ---- */

typedef struct k3_step_seq {
    k3_seq *seq;
    const uint32_t *ids;       /* appended at the sequence's position */
    uint32_t n;                /* >= 1 */
    int logits;                /* K3_LOGITS_NONE, _LAST (V floats), _ALL (n x V) */
    float *out;                /* where the logits go (NULL with K3_LOGITS_NONE) */
} k3_step_seq;

/*
 * Feed each sequence its tokens and write its logits. Every entry is checked
 * first (ids below the vocabulary, room in the sequence, a sequence at most
 * once per step, an output buffer when logits are asked): a bad entry fails
 * the step with K3_EARG / K3_ELIMIT before any sequence moves. A failure while
 * running (a read, memory) leaves every sequence of the step unspecified:
 * reset it or load a saved state.
 */
int k3_engine_step(k3_engine *en, const k3_step_seq *seqs, uint32_t n, k3_err *e);

/* The tokenizer of a model directory without opening the model (k3-run
 * --tokenize): a packed model's tokenizer files are checked against the
 * SHA-256 its manifest records; any other directory's are read as they are. */
int k3_engine_tok_open(k3_tok **out, const char *dir, k3_err *e);

#endif
