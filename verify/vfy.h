/*
 * vfy.h - k3-verify internals (tool-only code, also linked into the tests).
 *
 * A check never stops at the first problem: every problem becomes one line
 * "FILE: what is wrong" on the result stream and is counted. Nothing here
 * writes into the directory being checked (every file is opened read-only).
 */
#ifndef K3_VFY_H
#define K3_VFY_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "k3_err.h"

typedef struct k3_vfy_sum {
    char *name;                 /* file name (last path component) */
    uint8_t sha256[32];
    int seen;
} k3_vfy_sum;

/* --quick hashes every file of at most this size whole (SHA-256 against
 * the manifest, and the CRC of every unit and record in it); of the larger
 * files it checks the CRC of --sample trunk units and --sample expert
 * records (first, last, evenly between). Documented in README.md. */
#define K3_VFY_QUICK_HASH_MAX (64ull << 20)

typedef struct k3_vfy {
    const char *dir;
    int full;                   /* 1: hash everything; 0: --quick */
    int threads;                /* hashing threads, >= 1 */
    FILE *out;                  /* problems and the summary (stdout) */
    struct k3_progress *progress; /* the full check's bytes hashed; NULL: none */
    k3_vfy_sum *sums;           /* --sums, NULL if not given */
    uint32_t nsums;
    uint32_t sample;            /* --quick: records sampled */
    uint64_t quick_max;         /* --quick: files up to this size are hashed whole
                                 * (K3_VFY_QUICK_HASH_MAX; K3_QUICK_HASH_MAX=BYTES overrides) */
    uint64_t problems;
    void *jproblems;            /* --json: a cJSON array collecting the problems instead of printing */
    uint64_t files, bytes_hashed, crcs_checked;
    /* A packed model's stored dtypes and what its conversion left out (from
     * the manifest; zero counts if it could not be read): printed after the
     * verdict (vfy_packed.c: k3_vfy_packed_notes). */
    int have_model;
    uint32_t slice_ranks, slice_rank;   /* a rank's slice (k3-pack --ranks; 0 ranks: a whole model) */
    uint32_t trunk_n[3];        /* tensors stored as BF16, F16, F32 */
    uint32_t trunk_rounded;     /* of them rounded to BF16 (--trunk-dtype bf16) */
    uint64_t left_outside_n, left_outside_bytes, left_unused_n, left_unused_bytes;
    pthread_mutex_t mu;
} k3_vfy;

/* The lines that name the stored trunk dtypes (and whether any was rounded:
 * lossy) and the tensors left out, each prefixed with pre; nothing when no
 * manifest was read. */
void k3_vfy_packed_notes(const k3_vfy *v, FILE *f, const char *pre);

/* Report one problem (thread-safe): "DIR/FILE: message" (file may be NULL:
 * the directory itself). */
void k3_vfy_problem(k3_vfy *v, const char *file, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Parse a sha256sum-style list ("HEX  NAME" or "HEX *NAME" per line). */
int k3_vfy_sums_load(k3_vfy *v, const char *path, k3_err *e);
void k3_vfy_sums_free(k3_vfy *v);
k3_vfy_sum *k3_vfy_sums_find(k3_vfy *v, const char *name);

/* One file to hash in full mode, with the CRC regions lying in it. */
typedef struct k3_vfy_region {
    uint64_t off, len;
    uint32_t crc;
    char what[80];              /* "record layer 3 expert 5", "unit 2 (layer 1)" */
} k3_vfy_region;

typedef struct k3_vfy_job {
    char name[256];             /* as reported */
    char path[4096];
    uint64_t size;              /* expected size (already checked) */
    int has_want;
    uint8_t want[32];           /* expected SHA-256 if has_want */
    const char *want_from;      /* "the manifest", "the sums file" */
    k3_vfy_region *regions;     /* sorted by off, disjoint; owned by the caller */
    uint32_t nregions;
} k3_vfy_job;

/* Hash every job in parallel (v->threads), checking sizes, SHA-256 and CRCs;
 * each problem is reported. */
void k3_vfy_hash_jobs(k3_vfy *v, k3_vfy_job *jobs, uint32_t n);

/* The two kinds of directory. Return 0 when the check ran (problems are
 * counted in v->problems), negative K3_E* when it could not run at all. */
int k3_vfy_packed(k3_vfy *v, k3_err *e);
int k3_vfy_upstream(k3_vfy *v, k3_err *e);

/* --info: what the directory holds (kind, config, sizes, provenance, the
 * k3-pack budget, trunk dtypes), text or JSON, to out. Nothing is checked. */
int k3_vfy_info(const char *dir, int packed, int json, FILE *out, k3_err *e);

#endif
