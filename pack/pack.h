/*
 * pack.h - k3-pack internals (tool-only code, also linked into the tests):
 * re-lay out a packed model for a RAM floor without going back to the
 * upstream shards.
 *
 * A repack is planned completely before a byte is written (pack_plan.c):
 *   - trunk: every layer's tensors (source order kept) go into one unit, or
 *     into units of at most unit_bytes (--unit-mb); with split_rows a matrix
 *     larger than that is split by row ranges, each piece but the last
 *     filling its unit exactly from offset 0, so the pieces of a tensor are
 *     contiguous once a layer's units are read back to back. The embedding
 *     is never split (it is read row by row). Tensors of 64 KiB or more start
 *     page-aligned. Units of pinned groups come first in the new trunk file,
 *     in group order, so the pinned set is one sequential read;
 *   - the pinned set and the floor come from the streaming runtime's own
 *     code (k3_ws_stream_open + k3_ws_stream_plan) run on a sparse stand-in
 *     of the planned model, so k3-pack and k3-run --ram agree for the same
 *     session parameters;
 *   - experts: the source expert files are linked (hard link, else reflink,
 *     else copied) unless an expert order from a k3-run trace moves records,
 *     in which case each MoE layer's records are rewritten in that order;
 *     experts.idx is always re-encoded (file indices change);
 *   - the plan is recorded in the manifest's "plan" object (manifests/FORMAT.md
 *     leaves it free-form), with the provenance of the source packed model.
 * Then pack_run.c builds DST in "DST.k3-pack-tmp", journaling each finished
 * output file, writes manifest.json last and renames the directory into
 * place: at any kill point DST is absent or complete, and the temporary
 * directory can be resumed.
 */
#ifndef K3_PACK_H
#define K3_PACK_H

#include <stdint.h>
#include <stdio.h>

#include "k3_cfg.h"
#include "k3_err.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_dest.h"
#include "k3_stream.h"
#include "k3_progress.h"

#define K3_PACK_BASELINE      (16ull << 20)     /* k3-run's RSS assumed at plan time */
#define K3_PACK_COPY_CHUNK    (16u << 20)       /* trunk copy / expert copy buffer */
#define K3_PACK_PAGE_ALIGN_MIN (64u << 10)      /* tensors this big start 4096-aligned in their unit */
#define K3_PACK_HOT_SHARE     0.8               /* hot set: experts covering this share of requests */
#define K3_PACK_TMP_SUFFIX    ".k3-pack-tmp"
#define K3_PACK_OLD_SUFFIX    ".k3-pack-old"
#define K3_PACK_PROBE_SUFFIX  ".k3-pack-probe."
#define K3_PACK_JOURNAL       ".k3-pack-journal"

/* Named budgets besides k3_stream_parse_budget's. */
typedef struct k3_pack_preset {
    const char *name;
    uint64_t bytes;
} k3_pack_preset;
extern const k3_pack_preset k3_pack_presets[];   /* terminated by {NULL, 0} */

/* --pin modes */
enum { K3_PACK_PIN_AUTO = 0, K3_PACK_PIN_NONE, K3_PACK_PIN_ALL, K3_PACK_PIN_LIST };

typedef struct k3_pack_opts {
    uint64_t budget;            /* bytes or a K3_STREAM_* preset */
    char budget_arg[64];        /* as given, for the plan record */
    uint64_t unit_bytes;        /* with unit_explicit: 0 = one unit per layer */
    int unit_explicit;
    int split_rows;             /* cut tensors larger than unit_bytes by rows */
    uint64_t piece_bytes;       /* k3-run --ram-piece assumed (default: k3-run's, K3_STREAM_PIECE_DEFAULT) */
    int pin_mode;               /* K3_PACK_PIN_* */
    uint8_t pin[K3_CFG_MAX_LAYERS + 1];   /* K3_PACK_PIN_LIST: per stream group (head last) */
    const char *trace_path;     /* --expert-order */
    uint32_t max_ctx, max_chunk, nthreads;  /* the k3-run session the floor is computed for */
    uint64_t baseline;          /* k3-run RSS assumed at plan time */
    int resume, force, quiet, copy_only;
    int dense;                  /* write zero blocks of the trunk instead of leaving holes */
    FILE *progress;             /* one-off lines (a resumed trunk): stderr, or NULL */
    k3_progress *meter;         /* bytes of DST done, added per trunk unit, expert and file (NULL: none) */
} k3_pack_opts;

void k3_pack_opts_init(k3_pack_opts *o);

/* Parse a budget: k3_stream_parse_budget's forms plus the presets
 * (laptop, workstation, server). */
int k3_pack_parse_budget(const char *s, uint64_t *out, k3_err *e);
/* Parse --pin: "none", "all", or a comma list of layers, ranges A-B and "head". */
int k3_pack_parse_pin(const char *s, uint32_t ngroups, k3_pack_opts *o, k3_err *e);

/* One piece of the new trunk file, in file order: its rows are copied from
 * the source tensor of the same index (both tables are sorted by name), from
 * whichever source pieces hold them. */
typedef struct k3_pack_copy {
    uint32_t tensor;            /* index into plan->man.tensors and plan->src_man.tensors */
    uint32_t piece;             /* index into the new tensor's pieces */
} k3_pack_copy;

/* One output file of the repack. */
enum { K3_PACK_OUT_TRUNK = 0, K3_PACK_OUT_LINK, K3_PACK_OUT_EXPERTS, K3_PACK_OUT_INDEX };

typedef struct k3_pack_out {
    int how;                    /* K3_PACK_OUT_* */
    uint32_t file;              /* index into plan->man.files */
    uint32_t src_file;          /* K3_PACK_OUT_LINK: index into the source's files */
    uint32_t moe_layer;         /* K3_PACK_OUT_EXPERTS: which layer's records */
} k3_pack_out;

typedef struct k3_pack_plan {
    char *src, *dst;
    k3_pk *pk;                  /* the source, opened O_DIRECT where possible */
    k3_man src_man;             /* the source manifest */
    uint8_t src_manifest_sha[32];
    k3_cfg cfg;
    k3_man man;                 /* the new manifest (sha256 / crc filled while writing) */
    uint32_t *unit_group;       /* new unit -> stream group (layer, head = NL, embed = NL + 1) */
    k3_pack_out *outs;
    uint32_t nouts;
    /* trunk copy order: new pieces in file order */
    k3_pack_copy *copies;
    uint32_t ncopies;
    uint32_t trunk_file;        /* index into man.files of the new trunk file */
    /* layout figures */
    uint64_t unit_bytes;        /* 0: one unit per layer */
    uint32_t split_tensors;     /* tensors cut into several pieces */
    uint64_t largest_unit;
    k3_stream_plan sp;          /* k3-run's plan on the new layout at the budget */
    int sp_ok;                  /* 0: the budget is below k3-run's floor on this layout */
    int stream_refused;         /* row-split tensors: k3-run --ram does not run this layout */
    k3_stream_plan sp_floor;    /* the same at the floor */
    uint64_t piece_bytes;       /* k3-run --ram-piece the plan assumes */
    uint8_t pinned[K3_CFG_MAX_LAYERS + 1];
    uint64_t pinned_bytes;
    /* experts */
    int reorder;
    uint32_t *order;            /* n_moe x NE: new position -> expert */
    uint32_t *hot_n;            /* n_moe: size of the suggested hot set */
    uint64_t *counts;           /* n_moe x NE from the trace */
    k3_pk_record *records;      /* new record table */
    uint64_t trunk_bytes, expert_bytes_linked, expert_bytes_copied;
    uint8_t fingerprint[32];    /* of the planned manifest (hashes zeroed) and the inputs */
} k3_pack_plan;

/* Plan a repack of SRC into DST (dst may be NULL for --plan). */
int k3_pack_plan_build(k3_pack_plan *p, const char *src, const char *dst, const k3_pack_opts *o, k3_err *e);
void k3_pack_plan_free(k3_pack_plan *p);   /* accepts a zeroed plan */
/* Human-readable summary of the plan (several lines, each starting with prefix). */
void k3_pack_plan_print(const k3_pack_plan *p, FILE *f, const char *prefix);

/* Trace of k3-run --trace: lines "FORWARD LAYER EXPERT H|M", '#' comments.
 * counts has n_moe x num_experts entries (layer-major, MoE layers only) and
 * is zeroed first; every request counts once. Malformed lines are K3_EFORMAT
 * naming the line. */
int k3_pack_trace_read(const char *path, const k3_cfg *cfg, uint64_t *counts, uint64_t *nreq, k3_err *e);

typedef struct k3_pack_stats {
    uint64_t bytes_written;     /* trunk + reordered experts + index + manifest */
    uint64_t bytes_linked;      /* expert bytes shared with the source (links/reflinks) */
    uint64_t bytes_copied;      /* expert bytes copied because linking was impossible */
    uint32_t files_linked, files_reflinked, files_copied, files_resumed;
    uint64_t trunk_bytes_kept;  /* trunk bytes of an interrupted run continued by --resume */
    double seconds;
} k3_pack_stats;

/* k3-pack's destination (k3_dest.h): a packed model built in DST.k3-pack-tmp. */
extern const k3_dest_tool k3_pack_dest_tool;

/* Execute a plan on dest (opened with k3_pack_dest_tool on p->src and the
 * DST the plan was built for: checked and locked): build DST.k3-pack-tmp
 * (resuming it with o->resume), publish DST. K3_EEXIST if DST (or an
 * unresumed temporary) exists without --force. */
int k3_pack_run(k3_pack_plan *p, const k3_dest *dest, const k3_pack_opts *o, k3_pack_stats *s, k3_err *e);

/* Ask a running repack to stop at the next chunk (async-signal-safe). */
void k3_pack_interrupt(void);
int k3_pack_interrupted(void);

/* k3-pack --ranks N --rank R (pack/pack_slice.c): write DST, the slice of
 * SRC that rank R of an N-rank job streaming with row pieces of piece bytes
 * reads; K3_EEXIST if DST or its temporary exists. */
int k3_pack_slice(const char *src, const char *dst, uint32_t ranks, uint32_t rank, uint64_t piece, k3_err *e);

#endif
