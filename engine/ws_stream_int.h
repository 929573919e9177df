/*
 * ws_stream_int.h - what the parts of the streaming weight source share
 * (private): ws_stream.c (arenas, open, plan, start, close), ws_stream_trunk.c
 * (the ring, its reader, trunk groups and row pieces, the embedding) and
 * ws_stream_x.c (the expert slots and their I/O threads). The invariants are
 * ws_stream.c's.
 */
#ifndef K3_WS_STREAM_INT_H
#define K3_WS_STREAM_INT_H

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "k3_crc.h"
#include "k3_dist.h"
#include "k3_io.h"
#include "k3_kern.h"
#include "k3_out.h"
#include "k3_pk.h"
#include "k3_stream.h"
#include "k3_ws.h"

#define RING_Q 64
#define TCHUNK (w->tchunk)     /* trunk reads are split in chunks of this over the I/O threads */

enum { R_READING = 1, R_READY, R_INUSE, R_ERROR };
enum { X_EMPTY = 0, X_LOADING, X_READY, X_ERROR };
enum { Q_NONE = 0, Q_DEMAND, Q_GUESS };   /* the queue a LOADING slot waits in (none: being read) */

#define MAX_LAZY 16

/* An exact byte range of a unit; a unit's parts tile it in offset order. */
typedef struct part {
    uint64_t a, b;
    uint32_t crc;
    uint8_t have;
    int32_t rank;              /* over several ranks: the one rank that reads this piece; -1 every rank */
} part;

/* A run of a unit without streamed matrices, read into the core region at pos. */
typedef struct seg {
    uint32_t file, part;
    uint64_t a, b, pos;
} seg;

/* A matrix delivered in row pieces through the piece ring. */
typedef struct lazyt {
    uint32_t slot, file, nchunks, part0, pos0;   /* pos0: its first piece in the order, from the core */
    uint64_t off, rowbytes, rows, chunk_rows;
    /* piece c holds rows [prow[c], prow[c + 1]); over several ranks the
     * pieces are cut at every rank's range (k3_dist_rows) and this rank
     * reads only its own, [c0, c1) (all of them in one process) */
    uint64_t *prow;
    uint32_t c0, c1;
} lazyt;

typedef struct grp {
    const uint32_t *units;
    uint32_t nunits;
    uint64_t bytes;            /* sum of unit sizes (at least 4096) */
    uint64_t *unit_rel;        /* offset of each unit in the group's region */
    uint64_t rel[K3_W_COUNT];  /* offset of each present tensor in the region */
    uint8_t *pinned;           /* region in the pinned arena, NULL if streamed */
    /* with streamed matrices (nlz > 0): the core is the rest, read as segments */
    uint32_t nlz, nsegs, nparts;
    lazyt lz[MAX_LAZY];
    seg *segs;
    part *parts;
    uint32_t *unit_part0;      /* nunits + 1 */
    uint8_t *unit_done;        /* per unit: checked in this pass */
    uint64_t core;             /* core region bytes */
    uint64_t crel[K3_W_COUNT]; /* offset of each core tensor in the core region */
    uint8_t cok[K3_W_COUNT];   /* crel is set (a tensor of this layer's kind, in the core) */
} grp;

typedef struct rent {
    uint32_t g;
    int state;
    uint64_t off, n;
    int rc;
    k3_err err;
    int32_t j;                 /* piece ring: which streamed matrix, -1 for a core */
    uint32_t c;                /* and which piece */
    uint64_t skip;             /* bytes before the piece's first row in its region */
} rent;

/* The reader's order: a group's core, then the pieces of its streamed matrices. */
typedef struct item {
    uint32_t g;
    int32_t j;
    uint32_t c;
} item;

/* The trunk readers: two, so that the I/O threads already hold the next
 * piece's chunks while one reader waits for a scheduler slot to finish the
 * last one (on busy cores that wait was 0.5-1.3 ms a piece, the device idle). */
#define NREADERS 2

/* One chunk of a read spread over the I/O threads. */
typedef struct tchunk {
    uint64_t ca, cb;           /* the CRC covers file bytes [ca, cb) of the chunk (all of it if ca == cb == 0) */
    uint32_t unit, file;
    uint64_t off, n;           /* in the file */
    uint8_t *dst;
    uint32_t crc;
    int rc;
    k3_err err;
} tchunk;

/* A reader's batch of chunks (x_mu): posted whole, served oldest first. */
typedef struct tbatch {
    tchunk *tc;
    uint32_t n, next, done;
    uint64_t seq;
} tbatch;

struct ws_stream;
typedef struct reader_arg {
    struct ws_stream *w;
    uint32_t i;                /* its batch */
} reader_arg;

typedef struct xslot {
    uint32_t layer, expert;
    int32_t ref;
    int state;
    uint8_t queued;            /* Q_*: while LOADING, queued or in flight */
    uint8_t guess;             /* read on a guess the layer's routing has not seen yet */
    uint64_t tick;
    uint64_t qseq;             /* when it was queued on demand (the ready order) */
    int rc;
    k3_err err;
} xslot;

typedef struct ws_stream {
    k3_ws base;
    k3_pk *pk;
    int direct;
    uint32_t ng;
    grp *grp;
    k3_view *tmpl;             /* ng x K3_W_COUNT: dtype and shape of each slot */
    k3_view cur[K3_W_COUNT];
    const k3_pk_tensor *embed;
    uint8_t *rowbuf, *bounce;
    uint8_t *dsend, *drecv;    /* over several ranks: the piece CRCs sent and received (dist_check) */
    uint64_t bounce_cap;
    const k3_pk_expert_layout *lay;
    int started, planned, trunk_crc;
    uint64_t tchunk;           /* k3_stream_opts.io_chunk (16 MiB by default) */
    k3_stream_plan plan;
    /* arenas */
    uint8_t *pin_arena, *ring, *xarena;
    uint64_t pin_map, ring_map, x_map;
    /* ring */
    pthread_mutex_t ring_mu;
    pthread_cond_t ring_cv;    /* any change of the FIFO or of the reader position */
    pthread_t reader[NREADERS];
    reader_arg rarg[NREADERS];
    uint32_t reader_on;
    int stop;                  /* stop: the readers' flag (ring_mu) */
    uint64_t ring_cap;
    rent q[RING_Q];
    uint32_t qh, qn;
    item *order;               /* what the reader reads, in the order the model uses it */
    uint32_t norder, next, *pos;  /* pos[g]: index of group g's core in order */
    /* piece ring */
    uint8_t *pring;
    uint64_t pring_map, pring_cap, piece_bytes;
    rent pq[RING_Q];
    uint32_t pqh, pqn;
    int perr_rc;               /* sticky piece failure (ring_mu) */
    k3_err perr;
    /* experts */
    pthread_mutex_t x_mu;
    pthread_cond_t x_cv;       /* slot state changes, refs dropped */
    pthread_cond_t io_cv;      /* jobs queued */
    pthread_t *io;
    uint32_t nio, io_on;
    xslot *xs;
    uint32_t nslots;
    int cyclic;                /* replacement by layer distance (find_victim) */
    uint32_t *xmap;            /* NL x NE -> slot + 1 */
    uint32_t *jobs, jh, jn;    /* records the model will wait for, in read order */
    uint32_t *gjobs, gh, gn;   /* records guessed: read when nothing else is to be read */
    uint64_t jseq;
    uint32_t io_busy;          /* reads in flight (x_mu) */
    double io_t;               /* when io_busy last changed or was counted */
    uint64_t *okey;            /* num_experts: experts_prefetch's ready order */
    uint32_t *held, nheld;     /* refs of the current batch */
    uint32_t *pf, npf;         /* refs taken by experts_prefetch, not yet claimed */
    /* the layer's experts the cache could not take at prefetch, in the order
     * the model will ask for them: read as slots come free (read_ahead) */
    uint32_t *pend, npend, pend_next, pend_layer;
    uint32_t *miss, nmiss;
    uint64_t tick;
    tbatch tb[NREADERS];       /* what each reader is loading, in chunks */
    uint32_t tc_cap;
    uint64_t tb_seq;
    pthread_cond_t tc_cv;      /* a chunk finished */
    int threads_on, sync_on;
    int io_stop;               /* the I/O threads' flag (x_mu) */
    int xfailed;
    k3_err xerr;
    FILE *trace;               /* trace_out.f while the trace is open */
    k3_outf trace_out;         /* --trace: "<path>.tmp", renamed by k3_ws_stream_finish */
    k3_stream_stats st;
} ws_stream;

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int32_t group_layer(const ws_stream *w, uint32_t g)
{
    return g + 1 == w->ng ? K3_PK_LAYER_HEAD : (int32_t)g;
}

static inline void group_name(const ws_stream *w, uint32_t g, char *out, size_t cap)
{
    if (g + 1 == w->ng)
        snprintf(out, cap, "the head");
    else
        snprintf(out, cap, "layer %u", g);
}

/* Append context to the message of error rc already recorded in e. */
static inline int err_wrap(k3_err *e, int rc, const char *what)
{
    if (!e)
        return rc;
    char m[K3_ERR_MSG_MAX];
    int sys = e->sys_errno;
    snprintf(m, sizeof m, "%s", e->msg);
    k3_err_clear(e);
    k3_err_set(e, rc, "%s (%s)", m, what);
    e->sys_errno = sys;
    return rc;
}

/* called across the files */
int k3_wss_read_group(ws_stream *w, tbatch *b, uint32_t g, uint8_t *dst, int crc, k3_err *e);
void k3_wss_piece_range(const grp *G, uint32_t j, uint32_t c, uint64_t *a, uint64_t *b);
uint64_t k3_wss_piece_region(const grp *G, uint32_t j, uint32_t c);
void *k3_wss_reader_main(void *arg);
int k3_wss_st_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e);
void k3_wss_st_release(k3_ws *ws, uint32_t g);
int k3_wss_st_rows_acquire(k3_ws *ws, uint32_t g, k3_wslot s, uint64_t row, uint64_t *n, const void **data,
                           k3_err *e);
void k3_wss_st_rows_release(k3_ws *ws, uint32_t g, k3_wslot s);
int k3_wss_st_status(k3_ws *ws, k3_err *e);
int k3_wss_st_dist_check(k3_ws *ws, uint32_t g, int code, k3_err *e);
int k3_wss_st_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e);
int k3_wss_st_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e);
void *k3_wss_io_main(void *arg);
void k3_wss_io_count(ws_stream *w);
void k3_wss_st_experts_prefetch(k3_ws *ws, uint32_t layer, uint32_t *ids, uint32_t n);
void k3_wss_st_experts_guess(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n);
uint32_t k3_wss_st_batch_max(k3_ws *ws);
int k3_wss_st_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
                              k3_err *e);
void k3_wss_st_experts_release(k3_ws *ws, uint32_t layer);

#endif
