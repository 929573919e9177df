/*
 * conv_run.h - what the parts of k3-convert's run share (conv_run.c the job,
 * conv_read.c the reader thread, conv_journal.c the resume journal): the
 * read chunks, the reader, the converter's state. Tool-only, not API.
 */
#ifndef K3_CONV_RUN_H
#define K3_CONV_RUN_H

#include <pthread.h>
#include <signal.h>

#include "conv.h"
#include "k3_dest.h"
#include "k3_io.h"
#include "k3_journal.h"
#include "k3_progress.h"

#define JOURNAL ".k3-convert-journal"

/* set by k3_conv_interrupt (a signal handler): stop at the next chunk */
extern volatile sig_atomic_t k3_conv_stop_requested;

#define ZBLOCK K3_IO_DIRECT_ALIGN
#define ZWORDS (K3_CONV_CHUNK / ZBLOCK / 64)

typedef struct chunk {
    uint8_t *buf;
    uint32_t shard;
    uint64_t off, len;
    /* bit i: block i of the chunk ([i*ZBLOCK, (i+1)*ZBLOCK) clipped to len)
     * lay in a hole of the shard: zeros, not read */
    uint64_t zmap[ZWORDS];
    /* bit i: block i of buf holds zeros now (memset for an earlier hole and
     * not read into since), so a hole there needs no memset */
    uint64_t zbuf[ZWORDS];
} chunk;

/* Are bytes [lo, hi) of the chunk (lo < hi) known zeros (holes)? */
static inline int k3_conv_chunk_zero(const chunk *c, uint64_t lo, uint64_t hi)
{
    for (uint64_t b = lo / ZBLOCK; b <= (hi - 1) / ZBLOCK; b++)
        if (!(c->zmap[b / 64] >> (b % 64) & 1))
            return 0;
    return 1;
}

typedef struct reader {
    const k3_conv_plan *p;
    uint32_t shard_first, shard_end;
    uint8_t (*shard_sha)[32];
    uint8_t *arena;
    uint64_t chunk;             /* bytes per slot: K3_CONV_CHUNK, less for small shards */
    uint8_t *bounce;
    chunk slots[K3_CONV_NCHUNKS];
    uint32_t head, count;       /* filled slots: head .. head+count-1 */
    int finished, failed, stop;
    uint64_t holes;             /* bytes of this group's shards found in holes */
    k3_err err;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} reader;

typedef struct open_rec {
    int64_t rec;                /* -1: free */
    uint8_t *buf;               /* stride bytes, 4096-aligned */
    uint32_t have;
    int nonzero;                /* 0: every byte is zero so far (buf not even cleared) */
    uint8_t complete[3][K3_MAN_XP_COUNT];
    uint8_t *stage[3][K3_MAN_XP_COUNT];
} open_rec;

typedef struct conv {
    k3_conv_plan *p;
    const k3_conv_opts *o;
    k3_conv_stats *s;
    k3_progress *prog;
    uint8_t (*shard_sha)[32];
    k3_conv_w tw, xw;           /* trunk and experts writers of the group */
    int has_t, has_x;
    uint64_t ti;                /* tensor cursor */
    uint32_t g;                 /* the group being converted */
    uint8_t *scratch;           /* CHUNK + 64 */
    uint8_t carry[8];
    uint32_t carry_len;
    uint64_t out_done;
    open_rec recs[K3_CONV_MAX_OPEN_RECORDS];
    /* the embedding's row CRCs (embed.crc), taken as its bytes are written */
    int64_t embed_t;            /* index into plan->tensors, -1 if none */
    uint32_t embed_group;
    uint32_t *erow;             /* vocab_size */
    uint64_t erow_rb, erow_at;  /* row bytes; output bytes of the table fed so far */
    uint32_t erow_c;            /* CRC of the current row so far */
    uint8_t erow_sha[32];       /* of the journal's embed-crc.bin */
} conv;

/* conv_run.c: what --part and --merge (conv_part.c) share with a whole run:
 * the destination rules, the converter state, the last files. */
extern const k3_dest_tool k3_conv_dest_tool;
int k3_conv_cv_init(conv *cv, k3_conv_plan *plan, const k3_conv_opts *o, k3_conv_stats *s, k3_err *e);
void k3_conv_cv_free(conv *cv);
/* experts.idx, embed.crc, tokenizer files, manifest.json (last), then the
 * journal goes */
int k3_conv_finish(conv *cv, k3_err *e);
/* 1 if every shard group g reads (its own, and the earlier ones holding
 * tensors of its units and records) is here; else 0 with *shard and *tensor
 * naming the first missing one */
int k3_conv_group_inputs_here(const k3_conv_plan *p, uint32_t g, uint32_t *shard, const char **tensor);

/* conv_part.c: which groups a --part SPEC selects (sel[g] = 1); a group of
 * SPEC whose inputs are not all here is an error, except with "present",
 * where it is left out with a note on progress (NULL: none). */
int k3_conv_part_select(const k3_conv_plan *p, const char *spec, uint8_t *sel, FILE *progress, k3_err *e);
/* A part's last step: the skeleton (.k3-convert-part/) and part.json, last. */
int k3_conv_part_finish(conv *cv, const uint8_t *sel, k3_err *e);

/* conv_read.c: the reader thread (arg: a reader) */
void *k3_conv_reader_main(void *arg);

/* conv_journal.c: DST's journal, one group's entry written or loaded (0 and
 * *why set when the entry is unusable) */
int k3_conv_journal(k3_journal *j, const char *dst, k3_err *e);
int k3_conv_journal_write_group(conv *cv, uint32_t g, k3_err *e);
int k3_conv_journal_load_group(conv *cv, uint32_t g, const char **why, k3_err *e);

#endif
