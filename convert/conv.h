/*
 * conv.h - k3-convert internals (tool-only code, also linked into the tests).
 *
 * The conversion is planned completely before any data byte is read:
 * k3_conv_plan_build opens the upstream checkpoint, classifies every tensor
 * (trunk tensor the config expects, routed-expert part, or ignored), checks
 * shapes and dtypes, cuts the shards into groups (consecutive shards, no
 * expert split between two groups) and lays out every output file. Then each
 * group is converted in one sequential pass over its shards (conv_run.c):
 * input hashed while read, output hashed while written, published by rename,
 * recorded in the journal. Output bytes depend only on the plan.
 *
 * Across machines (conv_part.c): the plan needs only the headers, so a
 * machine holding some shards plans from stand-ins of the others
 * (k3_st_open_headers), converts its groups into a part directory, and
 * --merge renames the parts' files into one DST and writes the last files.
 */
#ifndef K3_CONV_H
#define K3_CONV_H

#include <stdint.h>
#include <stdio.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_man.h"
#include "k3_outfile.h"
#include "k3_pk.h"
#include "k3_st.h"

/* Expert source formats. */
enum { K3_CONV_X_NONE = 0, K3_CONV_X_MXFP4, K3_CONV_X_FLOAT, K3_CONV_X_F8 };

/* Incomplete expert records that may be held in memory at once while a
 * shard is streamed (a record is complete when its last tensor is read).
 * Checkpoints that interleave more experts than this are refused. */
#define K3_CONV_MAX_OPEN_RECORDS 8u
/* Largest single expert tensor accepted from a float source (staged whole). */
#define K3_CONV_MAX_EXPERT_TENSOR (256ull << 20)
/* Read chunk: the unit of input I/O, hashing and hand-off between threads. */
#define K3_CONV_CHUNK (16u << 20)
#define K3_CONV_NCHUNKS 4u

/* What a tensor of the input is to the converter. */
enum { K3_CONV_T_SKIP = 0, K3_CONV_T_TRUNK, K3_CONV_T_EXPERT };

typedef struct k3_conv_tensor {
    const k3_st_tensor *st;
    int role;                   /* K3_CONV_T_* */
    /* trunk */
    uint32_t out_tensor;        /* index into plan->man.tensors */
    uint32_t ext;               /* its extent in the group's trunk file */
    uint32_t slot;              /* unit slot: layer + 2 (0 embed, 1 head) */
    k3_dtype out_dtype;
    /* expert */
    uint64_t rec;               /* moe_index * num_experts + expert */
    int which, part;            /* k3_man_expert_name */
} k3_conv_tensor;

typedef struct k3_conv_rec {
    uint32_t group;
    uint32_t slot;              /* position in the group's experts file */
    uint8_t nparts_need, nparts_have;
    int32_t parts[3][K3_MAN_XP_COUNT]; /* index into plan->tensors, -1 if absent */
} k3_conv_rec;


typedef struct k3_conv_group {
    uint32_t shard_first, shard_end; /* [first, end) */
    k3_conv_ofile trunk, experts;    /* size 0: no such file */
    uint32_t unit_first, unit_end;   /* units of this group in plan->man.units */
    uint64_t input_bytes;
    int done;                        /* finished (this run or a previous one) */
} k3_conv_group;

typedef struct k3_conv_plan {
    char *src, *dst;
    k3_st *st;
    k3_cfg cfg;
    k3_conv_tensor *tensors;    /* same order as k3_st_tensor_at: (shard, offset) */
    uint64_t ntensors;
    uint64_t nskipped;
    int xfmt;                   /* K3_CONV_X_* */
    k3_dtype xdtype;            /* float/f8 source dtype of the experts */
    k3_conv_rec *recs;          /* n_moe * num_experts */
    uint64_t nrecs;
    k3_conv_group *groups;
    uint32_t ngroups;
    uint32_t *slot_group;       /* per slot: the group that writes that layer's unit */
    uint64_t *slot_first;       /* slot s's trunk tensors: slot_tensors[slot_first[s] .. slot_first[s+1]) */
    uint64_t *slot_tensors;     /* tensor indices, input order within a slot */
    k3_man man;                 /* files, units, tensors, xl, config filled by the plan */
    k3_pk_record *records;      /* final record table (crc filled as groups finish) */
    uint8_t fingerprint[32];    /* of the input tensor table and the options */
    uint64_t total_input;
} k3_conv_plan;

/* trunk_bf16: round every F16/F32 trunk tensor to BF16 (k3-convert
 * --trunk-dtype bf16, recorded in the manifest as lossy); 0 keeps every
 * trunk tensor in its upstream dtype, bytes copied. */
/* hdr_dir: NULL, or where stand-ins of the shards that are not in src are
 * (k3_st_open_headers: k3-convert --part and --merge). */
int k3_conv_plan_build(k3_conv_plan *p, const char *src, const char *dst, int trunk_bf16, const char *hdr_dir,
                       k3_err *e);
void k3_conv_plan_free(k3_conv_plan *p);

/* Options and results of a run. */
typedef struct k3_conv_opts {
    int resume, rehash, force, quiet, threads;
    int force_progress;         /* --progress: the meter also when stderr is not a terminal */
    int dense;                  /* write zero blocks instead of leaving holes */
    int trunk_bf16;             /* --trunk-dtype bf16 (lossy, on request only) */
    FILE *progress;             /* stderr, or NULL */
    const char *part;           /* --part SPEC: convert only these shards' groups (conv_part.c), or NULL */
    const char *headers;        /* --headers DIR: stand-ins of the shards not in SRC (default: SRC) */
} k3_conv_opts;

typedef struct k3_conv_stats {
    uint32_t groups, groups_skipped;
    uint64_t bytes_read, bytes_written, holes_bytes;
    uint64_t src_hole_bytes;    /* input bytes in holes: zeros, hashed but not read */
    double seconds;
    uint64_t peak_rss_kb;
} k3_conv_stats;

/* Convert SRC into DST (the whole job: plan, groups, experts.idx, manifest,
 * journal removal). Returns 0 or a negative K3_E* (K3_EINTR if interrupted
 * through k3_conv_interrupt). */
int k3_conv_run(const char *src, const char *dst, const k3_conv_opts *o, k3_conv_stats *s, k3_err *e);

/* k3-convert --headers SRC OUT: write OUT/NAME.k3hdr (k3_st.h) for every
 * shard in SRC, reading only the headers. */
int k3_conv_headers(const char *src, const char *out, k3_err *e);

/* k3-convert --merge DST PART...: check that the parts are finished parts of
 * one conversion that together hold every group exactly once, move their
 * files into DST (rename, same filesystem only) and write what a single run
 * writes last (experts.idx, embed.crc, tokenizer files, manifest.json). */
int k3_conv_merge(const char *dst, const char *const *parts, int nparts, const k3_conv_opts *o, k3_conv_stats *s,
                  k3_err *e);

/* Ask a running conversion to stop at the next chunk (async-signal-safe). */
void k3_conv_interrupt(void);

/* {"name", "size", "sha256"} of a file, for the journal and a part's
 * record (conv_journal.c). */
struct cJSON *k3_conv_named_hash(const char *name, uint64_t size, const uint8_t sha[32]);

#endif
