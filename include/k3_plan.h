/*
 * k3_plan.h - the memory plan of a streamed run: budgets, what is pinned, the
 * ring, the expert cache, and the run report. No weight-source type here (the
 * source itself is k3_stream.h), so programs over the engine API can use it.
 *
 * Memory is planned once, before anything big is allocated (k3_stream_plan_make):
 *   - pinned trunk: whole trunk groups (a layer, or the head) kept resident,
 *     chosen to minimise the trunk bytes read per token;
 *   - ring: one byte arena through which every other trunk group is read, in
 *     the order the model acquires them, by a background reader thread that
 *     stays ahead of the compute. A group occupies one contiguous region of
 *     the ring from the moment the reader starts filling it until the model
 *     releases it; the reader never writes a region that is queued or in use.
 *     The ring must hold the largest streamed group (the floor); with twice
 *     that it double-buffers every group;
 *   - expert cache: S whole-record slots (S >= top-k), LRU, filled after the
 *     router of a layer by one batch of parallel preads sorted by offset,
 *     every record CRC32-checked when read;
 *   - the model's own memory (scratch, KV cache, recurrent state, logits),
 *     computed from the config, and the process baseline (measured RSS plus a
 *     fixed allowance for thread stacks and the allocator).
 * The embedding is read row by row (never resident). Nothing here changes a
 * number: every budget and thread count gives the same bytes to the model.
 *
 * Arenas are huge-page backed (k3_io_huge_alloc: 2 MiB aligned, touched once
 * at start) when at least 4 MiB, 4096-aligned heap otherwise; the plan counts
 * what is really mapped.
 *
 * Errors: a budget below the floor is K3_EBUDGET naming the floor; a failed,
 * short or corrupt read is K3_EIO / K3_ECORRUPT naming the file, the offset
 * and the layer (and expert), and every later call fails the same way.
 */
#ifndef K3_PLAN_H
#define K3_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "k3_cfg.h"
#include "k3_err.h"

/* Named budgets (k3_stream_parse_budget). */
#define K3_STREAM_FLOOR    0ull            /* the smallest budget the plan can honour */
#define K3_STREAM_DOUBLE   1ull            /* the floor with a double-buffered ring */
#define K3_STREAM_RESIDENT UINT64_MAX      /* everything resident */

/* Bytes added to the measured RSS for what grows after planning (thread
 * stacks, allocator arenas, output buffers). Documented in README. */
#define K3_STREAM_ALLOWANCE (16ull << 20)

typedef struct k3_stream_opts {
    uint64_t budget;          /* bytes, or K3_STREAM_FLOOR / _DOUBLE / _RESIDENT */
    uint32_t max_chunk;       /* tokens per forward step (as given to k3_model_open) */
    uint32_t max_ctx;         /* session length */
    uint32_t nthreads;        /* compute threads */
    uint64_t extra_bytes;     /* caller's own buffers (logits, ids) to count */
    uint64_t baseline;        /* process RSS before the plan (0: measure now) */
    uint32_t io_threads;      /* parallel reads (0: 4) */
    uint64_t io_chunk;        /* trunk reads are split in chunks of this (0: 2 MiB) */
    int trunk_crc;            /* CRC32-check trunk units too (1 by default via k3_stream_opts_init) */
    const char *trace_path;   /* write expert requests here (NULL: no trace) */
    uint64_t piece_bytes;     /* stream the weight matrices larger than this in row
                               * pieces of at most this (0: whole groups); default
                               * K3_STREAM_PIECE_DEFAULT */
    int no_pin;               /* pin no trunk group, whatever the budget (a rank's
                               * slice: its groups have holes only pieces skip) */
    int expert_guess;         /* read experts ahead on the model's guess
                               * (k3_ws_experts_guess; 1 by default) */
} k3_stream_opts;

/* The default row piece (k3-run --ram-piece, k3-pack). 16 MiB: every matrix
 * of a K3 layer but a few small ones (the router, MLA's kv_a and kv_b) then
 * flows through the double-buffered piece ring, so the cores read through
 * the single-slot ring at the floor stay small (a core read is time the
 * model waits with nothing else read) and the floor drops; measured on the
 * k3-width checkpoint against 32, 64 and 128 MiB in runtime/STREAM.md. */
#define K3_STREAM_PIECE_DEFAULT (16ull << 20)

void k3_stream_opts_init(k3_stream_opts *o);

/* Parse "123", "64K", "1.5G", "2GiB" (K/M/G/T powers of 1024) or a preset
 * name ("floor", "double", "resident") into *out. K3_EARG if unparsable. */
int k3_stream_parse_budget(const char *s, uint64_t *out, k3_err *e);

/* What the plan is computed from (filled from a packed model, or from a
 * config alone for what-if plans). */
typedef struct k3_stream_shape {
    uint32_t ngroups;               /* num_hidden_layers + 1 (head last) */
    const uint64_t *group_bytes;    /* bytes each trunk group occupies when resident */
    uint64_t embed_row_bytes;
    uint64_t expert_stride;         /* 0 if no MoE layer */
    uint32_t n_moe_layers, num_experts, top_k;
    const uint64_t *core_bytes;     /* ring bytes of each group when streamed (NULL: group_bytes) */
    uint64_t piece_max;             /* largest row piece region (0: no pieces) */
} k3_stream_shape;

typedef struct k3_stream_plan {
    uint64_t budget;                /* as asked (resolved for presets) */
    uint64_t trunk_total;           /* all groups */
    uint64_t trunk_pinned;          /* bytes of pinned groups */
    uint64_t trunk_streamed;        /* bytes read per token through the ring */
    uint32_t n_pinned, ngroups;
    uint8_t pinned[K3_CFG_MAX_LAYERS + 1];   /* per group */
    uint64_t ring;                  /* ring arena bytes (0 if everything pinned) */
    uint64_t largest_streamed;      /* the ring's minimum */
    int double_buffered;            /* ring >= 2 x largest streamed (and piece ring >= 2 pieces) */
    uint64_t piece_ring;            /* piece ring bytes: two of the largest piece (0 if none) */
    uint64_t piece_max;             /* the same */
    uint32_t expert_slots;          /* whole-record slots */
    uint64_t expert_bytes;          /* mapped bytes of the slots */
    uint64_t kv, state, scratch;    /* model memory, computed from the config */
    uint64_t io;                    /* row/bounce buffers */
    uint64_t runtime;               /* baseline RSS + allowance */
    uint64_t mapped_pinned, mapped_ring;  /* arena sizes as mapped */
    uint64_t total;                 /* everything counted */
    uint64_t floor;                 /* smallest budget this shape accepts */
    uint64_t floor_double;          /* smallest with a double-buffered ring */
    uint64_t resident;              /* budget that keeps everything resident */
} k3_stream_plan;

/* Memory the model itself takes for these settings, from the model's own
 * sizing (k3_model_mem_need, expert views for a whole layer): scratch = the
 * model and one session's attention scores; kv and state per session. */
void k3_stream_model_mem(const k3_cfg *c, uint32_t max_chunk, uint32_t max_ctx, uint32_t nthreads,
                         uint64_t *scratch, uint64_t *kv, uint64_t *state);

/* Bytes an arena of n bytes maps (huge pages for n >= 4 MiB). */
uint64_t k3_stream_arena_bytes(uint64_t n);

/* Make the plan for a budget. K3_EBUDGET (with the floor in the message) if
 * the budget is below the floor. Presets resolve to their budget. */
int k3_stream_plan_make(const k3_stream_shape *sh, const k3_cfg *c, const k3_stream_opts *o,
                        k3_stream_plan *p, k3_err *e);

/* Trunk group sizes of a config laid out as k3-convert lays it out (one
 * unit per layer, tensors 64-aligned, unit 4096-aligned), for what-if plans
 * without a packed model (bench_stream), assuming the published checkpoint's
 * dtypes (BF16 matrices). Plans of a real packed model (k3-run, k3-pack)
 * size every unit and piece by the bytes its manifest records, whatever the
 * stored dtypes. gb must hold num_hidden_layers + 1 entries. */
void k3_stream_cfg_groups(const k3_cfg *c, uint64_t *gb, uint64_t *embed_row, uint64_t *stride);

/* The same split as k3_ws_stream_plan makes with pieces of at most piece
 * bytes: ring bytes of each group (cb) and the largest piece region. */
void k3_stream_cfg_cores(const k3_cfg *c, uint64_t piece, const uint64_t *gb, uint64_t *cb, uint64_t *piece_max);

/* Print the plan (several lines, each starting with prefix). */
void k3_stream_plan_print(const k3_stream_plan *p, FILE *f, const char *prefix);
/* Refuse (K3_EBUDGET, both numbers in the message) a plan whose floor or
 * budget exceeds the memory this machine has available (k3_mem_available:
 * MemAvailable, the cgroup limit, or K3_MEM_AVAILABLE). 0 if it fits or
 * nothing is known. */
int k3_stream_plan_check_memory(const k3_stream_plan *p, k3_err *e);

/* Counters of a streaming source since open. */
typedef struct k3_stream_stats {
    uint64_t trunk_bytes;           /* ring + pinned-at-start + embedding rows */
    uint64_t trunk_stream_bytes;    /* through the ring */
    uint64_t pinned_bytes;          /* read once at start */
    uint64_t embed_bytes;
    uint64_t expert_bytes;          /* records read */
    uint64_t expert_requests, expert_hits;
    /* read ahead on a guess (k3_ws_experts_guess): records queued, of them
     * those the routing then asked for, and wrong ones dropped unread */
    uint64_t guess_queued, guess_right, guess_dropped;
    /* taken ahead of the model's acquire as slots came free, when a layer
     * needed more records than the cache could take at once */
    uint64_t read_ahead;
    uint64_t ring_drops;            /* prefetched groups the model did not ask for */
    double trunk_wait_s, expert_wait_s;   /* time the model spent waiting for reads */
    /* the device side, from the I/O threads: wall time with no read in
     * flight (the device idle for us), and the integral of the number of
     * reads in flight over time (divided by the busy time: the mean depth) */
    double io_idle_s, io_depth_s;
    double load_s;                  /* pinned set read at start */
    uint64_t forwards;              /* passes through layer 0 */
} k3_stream_stats;


/* Current and peak resident set of this process (bytes). */
uint64_t k3_stream_rss_now(void);
uint64_t k3_stream_rss_peak(void);

/* One run's figures, for the report (k3-run). */
typedef struct k3_stream_run {
    k3_stream_plan plan;
    k3_stream_stats at_first;       /* counters when the first token was produced */
    k3_stream_stats end;
    int have_first;
    uint32_t n_prompt, n_gen;
    double prompt_s, decode_s;      /* as k3_gen_stats measures them */
    uint64_t peak_rss;
    int direct;
} k3_stream_run;

/* The run report: s/token for prompt and decode, bytes read per token
 * (trunk, experts), I/O wait share of the wall time, cache hit rate, peak
 * RSS against the budget. Several lines, each starting with prefix. */
void k3_stream_report_print(const k3_stream_run *r, FILE *f, const char *prefix);
/* The same as one JSON object's text (heap, caller frees), NULL if out of
 * memory. */
char *k3_stream_report_json(const k3_stream_run *r);

#endif
