/*
 * probe.h - k3-run --plan --probe: measure this machine on the model's own
 * files (O_DIRECT read rates of the trunk and of expert records) and the
 * kernels' speed (seconds per weight byte of a bf16 and an MXFP4 product at
 * T = 1 ... 256 rows, with the run's threads), then predict the prompt and
 * decode seconds per token of a memory plan from its byte counts
 * (runtime/STREAM.md, "Predicted speed").
 */
#ifndef K3_RUN_PROBE_H
#define K3_RUN_PROBE_H

#include <stdint.h>

#include <stdio.h>

#include "k3_cfg.h"
#include "k3_engine.h"
#include "k3_err.h"
#include "k3_plan.h"

#define K3_PROBE_NT 9   /* T = 1, 2, 4, ..., 256: the longest pass a budget takes */

/* What a layer computes besides its matrix products (attention, activations,
 * norms, routing) in passes of `chunk` rows (probe_rest.c): a pass of C rows
 * at positions p0 .. p0 + C - 1 takes C a + b S seconds, S = sum of (p + 1)
 * over its rows (the positions they attend to). [0]: a KDA layer, [1]: an
 * MLA layer, each with its MoE. */
#define K3_PROBE_REST_MAX 8

typedef struct k3_probe_rest {
    uint32_t chunk;
    double a[2], b[2];
} k3_probe_rest;

typedef struct k3_probe {
    double trunk_bps, expert_bps;      /* O_DIRECT (or buffered) read rates, bytes/s */
    uint64_t trunk_read, expert_read;  /* bytes the probe read */
    uint64_t rec_bytes;                /* one expert record */
    int direct;                        /* the reads bypassed the page cache */
    double bf16_s[K3_PROBE_NT];        /* seconds per weight byte at T = 1 << i */
    double mx_s[K3_PROBE_NT];
    double crc_s;                      /* seconds per byte of the CRC every byte read gets */
    double crc_share;                  /* of the CRC's CPU time, what the products wait: 1 / cores
                                        * when the run's threads take every core, else 0 */
    int no_trunk_crc;                  /* --no-trunk-crc: streamed trunk bytes are not CRC'd */
    double seconds;                    /* what the probe took */
    /* per chunk, what a layer computes besides its products
     * (k3_probe_rest_run); none: priced at 0 */
    k3_probe_rest rest[K3_PROBE_REST_MAX];
    uint32_t n_rest;
    double rest_seconds;
} k3_probe;

/* Measure (a few seconds). dir: a packed model (its .k3t and .k3e files). */
int k3_probe_run(const char *dir, const k3_cfg *c, k3_probe *p, k3_err *e);

/* Time the rest (k3_probe_rest) of the model c at each distinct chunk of
 * chunks[0..n) (at most K3_PROBE_REST_MAX; include 1 for decode), on models
 * held in memory: about 4 s (7 s before the attention kernels) and under
 * 275 MB at K3 width. On error p->n_rest is 0. */
int k3_probe_rest_run(const k3_cfg *c, const uint32_t *chunks, uint32_t n, k3_probe *p, k3_err *e);

/* The one-layer model the rest is timed on (probe_rest.c): c's layer of
 * kind mla (1 MLA, 0 KDA) with LatentMoE, c's heads and expert inner width,
 * a hidden size of at most 1024, top-k experts of latent width 32 and a
 * vocabulary of 64 (bench_attn times the same model). */
void k3_probe_rest_cfg(const k3_cfg *c, int mla, k3_cfg *out);

/* The prompt's routes as the model's own routers give them (probe_route.c):
 * the router of up to K3_PROBE_ROUTE_LAYERS MoE layers, evenly spaced,
 * applied to each prompt id's embedding normalised by that layer's
 * post-attention RMSNorm, with the model's selection rule (k3_moe_route). An
 * estimate: a layer routes the embedding plus what the layers before it
 * added. */
#define K3_PROBE_ROUTE_LAYERS 8

typedef struct k3_probe_routes {
    uint32_t n_ids, top_k, num_experts;
    uint32_t n_moe;                    /* MoE layers of the model */
    uint32_t n_layers;                 /* of them sampled; 0: no estimate */
    uint32_t layer[K3_PROBE_ROUTE_LAYERS];
    uint32_t *sel;                     /* [n_layers][n_ids][top_k] expert ids (heap) */
    double seconds;
} k3_probe_routes;

/* Estimate the routes of ids[0..n) from the packed model at dir. r owns
 * r->sel until k3_probe_routes_free (also on error: nothing to free then).
 * K3_EARG for an id past the vocabulary; I/O and format errors as k3_pk's. */
int k3_probe_routes_read(const char *dir, const uint32_t *ids, uint32_t n, k3_probe_routes *r, k3_err *e);
void k3_probe_routes_free(k3_probe_routes *r);   /* accepts NULL */

/* The experts of a prompt of n ids in passes of `chunk`, over all MoE
 * layers: with routes (r->n_layers > 0), each sampled layer's union per pass
 * and the rows each expert gets, against an LRU cache of slots / n_moe
 * records per layer that starts empty (the cold first pass), scaled to all
 * MoE layers; without, independent routes (E (1 - (1 - k/E)^C) per layer),
 * the first pass missing everything and later ones hitting in proportion to
 * the cache's share of all records. */
typedef struct k3_probe_xcost {
    double records;                    /* distinct records the passes need, summed */
    double misses;                     /* of them read from disk */
    double compute_s, mem_s;           /* their products; the same bytes at T = 1's seconds per byte */
    uint32_t passes;
    /* with routes, decode's hit rate after the passes: per sampled layer the
     * records the LRU is left holding, weighted by how often the prompt
     * routed to each, times one less the share of its routes whose expert it
     * used only once (Good-Turing: the chance a route goes to an expert not
     * seen yet); the records decode brings in are not followed. -1 without
     * routes */
    double decode_hit;
} k3_probe_xcost;

void k3_probe_prompt_experts(const k3_probe *p, const k3_cfg *c, const k3_probe_routes *r, uint32_t n,
                             uint32_t chunk, uint32_t slots, k3_probe_xcost *out);

typedef enum { K3_PROBE_DISK, K3_PROBE_MEMORY, K3_PROBE_COMPUTE } k3_probe_bound;

typedef struct k3_probe_pred {
    double prompt_s, decode_s;         /* seconds per token */
    double prompt_io, prompt_compute;  /* per token */
    double prompt_mem;                 /* of prompt_compute: the weight bytes at T = 1's speed */
    double prompt_rest;                /* of prompt_compute: what the layers compute besides products */
    double decode_io, decode_compute;
    double decode_rest;
    double decode_hit;                 /* the expert cache's hit rate decode is priced at */
    k3_probe_bound prompt_bound, decode_bound;   /* the largest of reads, memory, compute - memory */
    double experts_per_pass;           /* distinct records per pass, all MoE layers */
    double expert_misses;              /* records the prompt reads */
    uint32_t passes;
} k3_probe_pred;

/* Predict a plan: a prompt of n_ids ids (0: one full chunk) in passes of
 * `chunk`, its experts from k3_probe_prompt_experts (r may be NULL), then
 * decode one id per pass, hitting the records the prompt's passes leave in
 * the cache in proportion to how often the prompt routed to them, less the
 * share of its routes to experts it used once (the chance a decode route is
 * new); without routes, the cache's share of all records. Reads and compute
 * are added (not overlapped); the largest part names the bound. */
void k3_probe_predict(const k3_probe *p, const k3_cfg *c, const k3_stream_plan *plan, uint32_t chunk,
                      uint32_t n_ids, const k3_probe_routes *r, k3_probe_pred *out);

const char *k3_probe_bound_name(k3_probe_bound b);

/* k3-run --plan --probe: measure, then print the prediction for the floor,
 * the plan asked (given, made for --ram given_ram), 4, 16, 64, 256 GiB and everything
 * resident (the budgets this model and machine can take, below resident),
 * for the prompt ids[0..n_ids) (their routes estimated from the model). */
int k3_probe_print(const char *dir, const k3_engine_opts *eo, const k3_engine_size *sz, const k3_stream_plan *given,
                   const char *given_ram, uint32_t given_chunk, const uint32_t *ids, uint32_t n_ids, FILE *f,
                   const char *pre, k3_err *e);

#endif
