/*
 * probe.h - k3-run --plan --probe: measure this machine on the model's own
 * files (O_DIRECT read rates of the trunk and of expert records) and the
 * kernels' speed (seconds per weight byte of a bf16 and an MXFP4 product at
 * T = 1 ... 64 rows, with the run's threads), then predict the prompt and
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

#define K3_PROBE_NT 7   /* T = 1, 2, 4, 8, 16, 32, 64 */

typedef struct k3_probe {
    double trunk_bps, expert_bps;      /* O_DIRECT (or buffered) read rates, bytes/s */
    uint64_t trunk_read, expert_read;  /* bytes the probe read */
    uint64_t rec_bytes;                /* one expert record */
    int direct;                        /* the reads bypassed the page cache */
    double bf16_s[K3_PROBE_NT];        /* seconds per weight byte at T = 1 << i */
    double mx_s[K3_PROBE_NT];
    double seconds;                    /* what the probe took */
} k3_probe;

/* Measure (a few seconds). dir: a packed model (its .k3t and .k3e files). */
int k3_probe_run(const char *dir, const k3_cfg *c, k3_probe *p, k3_err *e);

typedef struct k3_probe_pred {
    double prompt_s, decode_s;         /* seconds per token */
    double prompt_io, prompt_compute;  /* per token */
    double decode_io, decode_compute;
} k3_probe_pred;

/* Predict a plan: prompts in chunks of `chunk` ids, decode one id per pass.
 * Reads and compute are added (not overlapped); the larger is the bound. */
void k3_probe_predict(const k3_probe *p, const k3_cfg *c, const k3_stream_plan *plan, uint32_t chunk,
                      k3_probe_pred *out);

/* k3-run --plan --probe: measure, then print the prediction for the floor,
 * the plan asked (given, made for --ram given_ram), 4, 16, 64, 256 GiB and everything
 * resident (the budgets this model and machine can take, below resident). */
int k3_probe_print(const char *dir, const k3_engine_opts *eo, const k3_engine_size *sz, const k3_stream_plan *given,
                   const char *given_ram, uint32_t given_chunk, FILE *f, const char *pre, k3_err *e);

#endif
