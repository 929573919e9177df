/*
 * ws_stream.c - the streaming weight source (k3_stream.h): a packed model
 * run in a RAM budget.
 *
 * Owns: the k3_pk handle; the pinned arena (whole trunk groups read once at
 * start); the ring arena with its FIFO of regions and the reader thread; the
 * expert slot arena with its LRU table and the pool of I/O threads; the
 * trace file; the counters.
 *
 * Ring invariants (ring_mu):
 *   - the FIFO q[qh..qh+qn) lists regions in the order the reader filled them;
 *     regions never overlap; a region is READING (the reader writes it, no
 *     one else touches it), READY, INUSE (the model holds it: only the FIFO
 *     head can be INUSE) or ERROR;
 *   - the reader only writes a region it has just allocated from bytes no
 *     FIFO entry covers, so a region queued or in use is never overwritten;
 *   - the model consumes in FIFO order: acquire(g) drops READY/ERROR heads
 *     that are not g (a prediction miss: e.g. the head group is skipped when
 *     no logits are asked), waits for a READING head, and resynchronises the
 *     reader's position when the FIFO is empty.
 * Expert invariants (x_mu): a slot is EMPTY, LOADING (one I/O thread writes
 * it) or READY; xmap maps (layer, expert) to the slot holding or loading it;
 * a slot with ref > 0 or LOADING is never evicted; refs are held from
 * prefetch/acquire to release. Every record is CRC32-checked by
 * k3_pk_read_record before its slot becomes READY. Any read error is sticky:
 * every later call fails with the first error.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "k3_crc.h"
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

#define MAX_LAZY 16

/* An exact byte range of a unit; a unit's parts tile it in offset order. */
typedef struct part {
    uint64_t a, b;
    uint32_t crc;
    uint8_t have;
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

typedef struct xslot {
    uint32_t layer, expert;
    int32_t ref;
    int state;
    uint64_t tick;
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
    pthread_t reader;
    int reader_on, stop;       /* stop: the reader's flag (ring_mu) */
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
    uint32_t *jobs, jh, jn;
    uint32_t *held, nheld;     /* refs of the current batch */
    uint32_t *pf, npf;         /* refs taken by experts_prefetch, not yet claimed */
    uint32_t *miss, nmiss;
    uint64_t tick;
    tchunk *tc;                /* the group the reader is loading, in chunks */
    uint32_t tc_cap, tc_n, tc_next, tc_done;
    pthread_cond_t tc_cv;      /* a chunk finished */
    int threads_on, sync_on;
    int io_stop;               /* the I/O threads' flag (x_mu) */
    int xfailed;
    k3_err xerr;
    FILE *trace;               /* trace_out.f while the trace is open */
    k3_outf trace_out;         /* --trace: "<path>.tmp", renamed by k3_ws_stream_finish */
    k3_stream_stats st;
} ws_stream;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int32_t group_layer(const ws_stream *w, uint32_t g)
{
    return g + 1 == w->ng ? K3_PK_LAYER_HEAD : (int32_t)g;
}

static void group_name(const ws_stream *w, uint32_t g, char *out, size_t cap)
{
    if (g + 1 == w->ng)
        snprintf(out, cap, "the head");
    else
        snprintf(out, cap, "layer %u", g);
}

/* Append context to the message of error rc already recorded in e. */
static int err_wrap(k3_err *e, int rc, const char *what)
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

/* ------------------------------------------------------------- arenas */

static uint8_t *arena_alloc(uint64_t n, uint64_t *mapped)
{
    *mapped = k3_stream_arena_bytes(n);
    if (!*mapped)
        return NULL;
    if (*mapped >= (4ull << 20))
        return k3_io_huge_alloc(*mapped);
    uint8_t *p = k3_io_alloc_aligned(*mapped, K3_PK_ALIGN);
    if (p)
        memset(p, 0, *mapped);   /* touch once now, not in the middle of a token */
    return p;
}

static void arena_free(uint8_t *p, uint64_t mapped)
{
    if (!p)
        return;
    if (mapped >= (4ull << 20))
        k3_io_huge_free(p, mapped);
    else
        k3_io_free_aligned(p);
}

/* -------------------------------------------------------------- trunk */

/* Read a group's units as chunks spread over the I/O threads (parallel
 * O_DIRECT preads, each CRC'd where read), then fold the chunk CRCs of each
 * unit in order (crc32_combine) and compare with the unit's CRC. */
static int read_group_par(ws_stream *w, uint32_t g, uint8_t *dst, int crc, k3_err *e)
{
    const grp *G = &w->grp[g];
    pthread_mutex_lock(&w->x_mu);
    uint32_t n = 0;
    for (uint32_t i = 0; i < G->nunits; i++) {
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, G->units[i]);
        for (uint64_t o = 0; o < u->nbytes; o += TCHUNK) {
            tchunk *c = &w->tc[n++];
            c->unit = G->units[i];
            c->file = u->file;
            c->off = u->offset + o;
            c->n = u->nbytes - o < TCHUNK ? u->nbytes - o : TCHUNK;
            c->dst = dst + G->unit_rel[i] + o;
            c->ca = c->cb = 0;
            c->crc = 0;
            c->rc = crc;   /* in: 1 = compute the CRC */
            k3_err_clear(&c->err);
        }
    }
    w->tc_n = n;
    w->tc_next = 0;
    w->tc_done = 0;
    pthread_cond_broadcast(&w->io_cv);
    while (w->tc_done < w->tc_n)
        pthread_cond_wait(&w->tc_cv, &w->x_mu);
    w->tc_n = 0;
    pthread_mutex_unlock(&w->x_mu);
    int rc = 0;
    for (uint32_t k = 0; k < n && rc == 0; k++)
        if (w->tc[k].rc < 0) {
            rc = w->tc[k].rc;
            if (e) {
                k3_err_clear(e);
                *e = w->tc[k].err;
            }
        }
    for (uint32_t k = 0; k < n && rc == 0 && crc;) {
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, w->tc[k].unit);
        uLong v = w->tc[k].crc;
        uint32_t j = k + 1;
        for (; j < n && w->tc[j].unit == w->tc[k].unit; j++)
            v = crc32_combine(v, w->tc[j].crc, (z_off_t)w->tc[j].n);
        if ((uint32_t)v != u->crc32)
            rc = k3_err_set(e, K3_ECORRUPT, "%s: unit %u (layer %d) at offset %llu has CRC32 %08x, expected %08x",
                            k3_pk_file_at(w->pk, u->file)->path, w->tc[k].unit, u->layer,
                            (unsigned long long)u->offset, (uint32_t)v, u->crc32);
        k = j;
    }
    if (rc < 0) {
        char name[48], what[64];
        group_name(w, g, name, sizeof name);
        snprintf(what, sizeof what, "trunk of %s", name);
        return err_wrap(e, rc, what);
    }
    return 0;
}

static int read_group(ws_stream *w, uint32_t g, uint8_t *dst, int crc, k3_err *e)
{
    const grp *G = &w->grp[g];
    if (w->threads_on && w->tc)
        return read_group_par(w, g, dst, crc, e);
    for (uint32_t i = 0; i < G->nunits; i++) {
        int rc = k3_pk_read_unit(w->pk, G->units[i], dst + G->unit_rel[i], crc, e);
        if (rc < 0) {
            char name[48], what[64];
            group_name(w, g, name, sizeof name);
            snprintf(what, sizeof what, "trunk of %s", name);
            return err_wrap(e, rc, what);
        }
    }
    return 0;
}

/* Read [off, off + n) of a file (4096-aligned) into dst, in chunks over the
 * I/O threads, without CRC (the caller checks exact ranges). */
/* Read [off, off + n) of a file (4096-aligned) into dst, in chunks over the
 * I/O threads; with crc, *crc is the CRC32 of the exact bytes [a, b) inside
 * it (each chunk CRCs its share where it is read, folded in order). */
static int read_span(ws_stream *w, uint32_t file, uint64_t off, uint64_t n, uint8_t *dst, uint64_t a, uint64_t b,
                     uint32_t *crc, k3_err *e)
{
    if (!w->threads_on || !w->tc) {
        int rc = k3_pk_read(w->pk, file, dst, n, off, NULL, 0, e);
        if (rc == 0 && crc)
            *crc = k3_crc32(0, dst + (a - off), (size_t)(b - a));
        return rc;
    }
    uLong fold = 0;   /* the CRC of nothing */
    for (uint64_t done = 0; done < n;) {
        pthread_mutex_lock(&w->x_mu);
        uint32_t k = 0;
        for (; k < w->tc_cap && done < n; k++) {
            tchunk *c = &w->tc[k];
            c->unit = 0;
            c->file = file;
            c->off = off + done;
            c->n = n - done < TCHUNK ? n - done : TCHUNK;
            c->dst = dst + done;
            c->ca = c->off > a ? c->off : a;
            c->cb = c->off + c->n < b ? c->off + c->n : b;
            c->rc = crc && c->cb > c->ca;   /* in: compute the CRC of [ca, cb) */
            if (!c->rc)
                c->ca = c->cb = 0;
            c->crc = 0;
            k3_err_clear(&c->err);
            done += c->n;
        }
        w->tc_n = k;
        w->tc_next = 0;
        w->tc_done = 0;
        pthread_cond_broadcast(&w->io_cv);
        while (w->tc_done < w->tc_n)
            pthread_cond_wait(&w->tc_cv, &w->x_mu);
        w->tc_n = 0;
        pthread_mutex_unlock(&w->x_mu);
        for (uint32_t i = 0; i < k; i++)
            if (w->tc[i].rc < 0) {
                if (e) {
                    k3_err_clear(e);
                    *e = w->tc[i].err;
                }
                return w->tc[i].rc;
            }
        for (uint32_t i = 0; crc && i < k; i++)
            if (w->tc[i].cb > w->tc[i].ca)
                fold = crc32_combine(fold, w->tc[i].crc, (z_off_t)(w->tc[i].cb - w->tc[i].ca));
    }
    if (crc)
        *crc = (uint32_t)fold;
    return 0;
}

/* Fold the parts of every unit of g whose parts have all arrived in this
 * pass and compare with the unit's CRC. */
static int check_units(ws_stream *w, uint32_t g, k3_err *e)
{
    grp *G = &w->grp[g];
    for (uint32_t i = 0; i < G->nunits; i++) {
        if (G->unit_done[i])
            continue;
        uint32_t p0 = G->unit_part0[i], p1 = G->unit_part0[i + 1];
        int all = 1;
        for (uint32_t p = p0; p < p1 && all; p++)
            all = G->parts[p].have;
        if (!all)
            continue;
        G->unit_done[i] = 1;
        uLong v = G->parts[p0].crc;
        for (uint32_t p = p0 + 1; p < p1; p++)
            v = crc32_combine(v, G->parts[p].crc, (z_off_t)(G->parts[p].b - G->parts[p].a));
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, G->units[i]);
        if (w->trunk_crc && (uint32_t)v != u->crc32) {
            char name[48];
            group_name(w, g, name, sizeof name);
            return k3_err_set(e, K3_ECORRUPT,
                              "%s: unit %u (layer %d) at offset %llu has CRC32 %08x, expected %08x (trunk of %s)",
                              k3_pk_file_at(w->pk, u->file)->path, G->units[i], u->layer,
                              (unsigned long long)u->offset, (uint32_t)v, u->crc32, name);
        }
    }
    return 0;
}

/* The core of a group with streamed matrices: its segments, each read
 * widened to 4096 and CRC'd over its exact range. Starts a CRC pass. */
static int read_core(ws_stream *w, uint32_t g, uint8_t *dst, k3_err *e)
{
    grp *G = &w->grp[g];
    for (uint32_t p = 0; p < G->nparts; p++)
        G->parts[p].have = 0;
    memset(G->unit_done, 0, G->nunits);
    for (uint32_t k = 0; k < G->nsegs; k++) {
        const seg *S = &G->segs[k];
        uint64_t a4 = S->a / 4096 * 4096, b4 = (S->b + 4095) / 4096 * 4096;
        uint32_t v = 0;
        int rc = read_span(w, S->file, a4, b4 - a4, dst + S->pos, S->a, S->b, w->trunk_crc ? &v : NULL, e);
        if (rc < 0) {
            char name[48], what[64];
            group_name(w, g, name, sizeof name);
            snprintf(what, sizeof what, "trunk of %s", name);
            return err_wrap(e, rc, what);
        }
        G->parts[S->part].crc = v;
        G->parts[S->part].have = 1;
    }
    return check_units(w, g, e);
}

/* Bytes [a, b) of piece c of streamed matrix j of group g. */
static void piece_range(const grp *G, uint32_t j, uint32_t c, uint64_t *a, uint64_t *b)
{
    const lazyt *L = &G->lz[j];
    *a = L->off + (uint64_t)c * L->chunk_rows * L->rowbytes;
    uint64_t end = L->off + L->rows * L->rowbytes, n = L->chunk_rows * L->rowbytes;
    *b = end - *a < n ? end : *a + n;
}

static uint64_t piece_region(const grp *G, uint32_t j, uint32_t c)
{
    uint64_t a, b;
    piece_range(G, j, c, &a, &b);
    return (b + 4095) / 4096 * 4096 - a / 4096 * 4096;
}

static int read_piece(ws_stream *w, uint32_t g, uint32_t j, uint32_t c, uint8_t *dst, uint64_t *skip, k3_err *e)
{
    grp *G = &w->grp[g];
    uint64_t a, b;
    piece_range(G, j, c, &a, &b);
    uint64_t a4 = a / 4096 * 4096, b4 = (b + 4095) / 4096 * 4096;
    *skip = a - a4;
    uint32_t v = 0;
    int rc = read_span(w, G->lz[j].file, a4, b4 - a4, dst, a, b, w->trunk_crc ? &v : NULL, e);
    if (rc < 0) {
        char name[48], what[96];
        group_name(w, g, name, sizeof name);
        snprintf(what, sizeof what, "trunk of %s, %s rows from %llu", name, k3_wslot_name((k3_wslot)G->lz[j].slot),
                 (unsigned long long)(c * G->lz[j].chunk_rows));
        return err_wrap(e, rc, what);
    }
    part *P = &G->parts[G->lz[j].part0 + c];
    P->crc = v;
    P->have = 1;
    return check_units(w, g, e);
}

/* Where a region of n bytes fits after the newest entry of FIFO q. */
static int fifo_fit(const rent *q, uint32_t qh, uint32_t qn, uint64_t cap, uint64_t n, uint64_t *off)
{
    if (n > cap)
        return 0;
    if (qn == 0) {
        *off = 0;
        return 1;
    }
    const rent *first = &q[qh], *last = &q[(qh + qn - 1) % RING_Q];
    uint64_t end = last->off + last->n;
    if (last->off >= first->off) {     /* not wrapped: free [end, cap) and [0, first) */
        if (n <= cap - end) {
            *off = end;
            return 1;
        }
        if (n <= first->off) {
            *off = 0;
            return 1;
        }
        return 0;
    }
    if (n <= first->off - end) {       /* wrapped: free [end, first) */
        *off = end;
        return 1;
    }
    return 0;
}

static void *reader_main(void *arg)
{
    ws_stream *w = arg;
    pthread_mutex_lock(&w->ring_mu);
    while (!w->stop) {
        const item it = w->order[w->next];
        const grp *G = &w->grp[it.g];
        int piece = it.j >= 0;
        uint64_t off, n = piece ? piece_region(G, (uint32_t)it.j, it.c) : G->nlz ? G->core : G->bytes;
        rent *q = piece ? w->pq : w->q;
        uint32_t *qh = piece ? &w->pqh : &w->qh, *qn = piece ? &w->pqn : &w->qn;
        if (*qn == RING_Q || !fifo_fit(q, *qh, *qn, piece ? w->pring_cap : w->ring_cap, n, &off)) {
            pthread_cond_wait(&w->ring_cv, &w->ring_mu);
            continue;
        }
        rent *r = &q[(*qh + *qn) % RING_Q];
        r->g = it.g;
        r->j = it.j;
        r->c = it.c;
        r->off = off;
        r->n = n;
        r->skip = 0;
        r->state = R_READING;
        r->rc = 0;
        (*qn)++;
        w->next = (w->next + 1) % w->norder;
        pthread_mutex_unlock(&w->ring_mu);
        k3_err err = {0};
        int rc;
        if (piece)
            rc = read_piece(w, it.g, (uint32_t)it.j, it.c, w->pring + off, &r->skip, &err);
        else if (G->nlz)
            rc = read_core(w, it.g, w->ring + off, &err);
        else
            rc = read_group(w, it.g, w->ring + off, w->trunk_crc, &err);
        pthread_mutex_lock(&w->ring_mu);
        if (rc < 0) {
            r->rc = rc;
            r->err = err;
            r->state = R_ERROR;
        } else {
            r->state = R_READY;
            w->st.trunk_stream_bytes += r->n;
        }
        pthread_cond_broadcast(&w->ring_cv);
    }
    pthread_mutex_unlock(&w->ring_mu);
    return NULL;
}

static void fill_views(ws_stream *w, uint32_t g, const uint8_t *region, int core)
{
    const k3_view *t = &w->tmpl[(uint64_t)g * K3_W_COUNT];
    const grp *G = &w->grp[g];
    for (int s = 0; s < K3_W_COUNT; s++) {
        w->cur[s] = t[s];
        w->cur[s].data = !t[s].ndim ? NULL : !core ? region + G->rel[s] : G->cok[s] ? region + G->crel[s] : NULL;
    }
    if (core)
        for (uint32_t j = 0; j < G->nlz; j++) {
            k3_view *v = &w->cur[G->lz[j].slot];
            v->data = NULL;
            v->src = &w->base;
            v->group = g;
            v->slot = G->lz[j].slot;
        }
}

static int st_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started)
        return k3_err_set(e, K3_EINTERNAL, "streaming source used before k3_ws_stream_start");
    if (g >= w->ng)
        return k3_err_set(e, K3_EINTERNAL, "weight group %u out of range", g);
    if (g == 0)
        w->st.forwards++;
    if (w->grp[g].pinned) {
        fill_views(w, g, w->grp[g].pinned, 0);
        *views = w->cur;
        return 0;
    }
    double t0 = now_s();
    pthread_mutex_lock(&w->ring_mu);
    rent *r;
    for (;;) {
        if (w->qn) {
            r = &w->q[w->qh];
            if (r->state == R_READING) {
                pthread_cond_wait(&w->ring_cv, &w->ring_mu);
                continue;
            }
            if (r->g == g)
                break;
            w->qh = (w->qh + 1) % RING_Q;   /* a group the model did not ask for */
            w->qn--;
            w->st.ring_drops++;
            pthread_cond_broadcast(&w->ring_cv);
            continue;
        }
        if (w->order[w->next].g != g || w->order[w->next].j >= 0) {
            w->next = w->pos[g];
            pthread_cond_broadcast(&w->ring_cv);
        }
        pthread_cond_wait(&w->ring_cv, &w->ring_mu);
    }
    w->st.trunk_wait_s += now_s() - t0;
    if (r->state == R_ERROR) {
        int rc = r->rc;
        if (e)
            *e = r->err;
        pthread_mutex_unlock(&w->ring_mu);
        return rc;
    }
    r->state = R_INUSE;
    uint8_t *region = w->ring + r->off;
    pthread_mutex_unlock(&w->ring_mu);
    fill_views(w, g, region, w->grp[g].nlz > 0);
    *views = w->cur;
    return 0;
}

static void st_release(k3_ws *ws, uint32_t g)
{
    ws_stream *w = (ws_stream *)ws;
    if (g >= w->ng || w->grp[g].pinned || !w->started)
        return;
    pthread_mutex_lock(&w->ring_mu);
    if (w->qn && w->q[w->qh].g == g && w->q[w->qh].state == R_INUSE) {
        w->qh = (w->qh + 1) % RING_Q;
        w->qn--;
        pthread_cond_broadcast(&w->ring_cv);
    }
    pthread_mutex_unlock(&w->ring_mu);
}

static int st_rows_acquire(k3_ws *ws, uint32_t g, k3_wslot s, uint64_t row, uint64_t *n, const void **data,
                           k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    const grp *G = g < w->ng ? &w->grp[g] : NULL;
    int32_t j = -1;
    for (uint32_t k = 0; G && k < G->nlz; k++)
        if (G->lz[k].slot == (uint32_t)s)
            j = (int32_t)k;
    if (j < 0 || row >= G->lz[j].rows)
        return k3_err_set(e, K3_EINTERNAL, "no streamed rows %llu of %s in group %u", (unsigned long long)row,
                          k3_wslot_name(s), g);
    const lazyt *L = &G->lz[j];
    const uint32_t c = (uint32_t)(row / L->chunk_rows);
    double t0 = now_s();
    pthread_mutex_lock(&w->ring_mu);
    if (w->perr_rc) {
        int rc = w->perr_rc;
        if (e)
            *e = w->perr;
        pthread_mutex_unlock(&w->ring_mu);
        return rc;
    }
    rent *r;
    for (;;) {
        if (w->pqn) {
            r = &w->pq[w->pqh];
            if (r->state == R_READING) {
                pthread_cond_wait(&w->ring_cv, &w->ring_mu);
                continue;
            }
            if (r->g == g && r->j == j && r->c == c)
                break;
            w->pqh = (w->pqh + 1) % RING_Q;   /* a piece the model did not ask for */
            w->pqn--;
            w->st.ring_drops++;
            pthread_cond_broadcast(&w->ring_cv);
            continue;
        }
        uint32_t want = w->pos[g] + L->pos0 + c;
        if (w->next != want) {
            w->next = want;
            pthread_cond_broadcast(&w->ring_cv);
        }
        pthread_cond_wait(&w->ring_cv, &w->ring_mu);
    }
    w->st.trunk_wait_s += now_s() - t0;
    if (r->state == R_ERROR) {
        w->perr_rc = r->rc;
        w->perr = r->err;
        w->perr.code = r->rc;
        if (e)
            *e = r->err;
        pthread_mutex_unlock(&w->ring_mu);
        return w->perr_rc;
    }
    r->state = R_INUSE;
    const uint64_t first = (uint64_t)c * L->chunk_rows;
    uint64_t last = first + L->chunk_rows < L->rows ? first + L->chunk_rows : L->rows;
    *data = w->pring + r->off + r->skip + (row - first) * L->rowbytes;
    *n = last - row;
    pthread_mutex_unlock(&w->ring_mu);
    return 0;
}

static void st_rows_release(k3_ws *ws, uint32_t g, k3_wslot s)
{
    ws_stream *w = (ws_stream *)ws;
    (void)s;
    pthread_mutex_lock(&w->ring_mu);
    if (w->pqn && w->pq[w->pqh].g == g && w->pq[w->pqh].state == R_INUSE) {
        w->pqh = (w->pqh + 1) % RING_Q;
        w->pqn--;
        pthread_cond_broadcast(&w->ring_cv);
    }
    pthread_mutex_unlock(&w->ring_mu);
}

static int st_status(k3_ws *ws, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->sync_on)
        return 0;
    pthread_mutex_lock(&w->ring_mu);
    int rc = w->perr_rc;
    if (rc && e)
        *e = w->perr;
    pthread_mutex_unlock(&w->ring_mu);
    return rc;
}

static int st_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (g >= w->ng || !w->tmpl[(uint64_t)g * K3_W_COUNT + s].ndim)
        return k3_err_set(e, K3_ENOENT, "%s: packed model has no tensor %s in group %u", ws->dir, k3_wslot_name(s), g);
    *out = w->tmpl[(uint64_t)g * K3_W_COUNT + s];
    out->data = NULL;
    return 0;
}

static int st_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    const uint64_t E = ws->cfg.hidden_size;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t cost = 0;
        int rc = k3_pk_embed_row(w->pk, w->embed, ids[i], w->rowbuf, w->bounce, w->bounce_cap, out + (uint64_t)i * E,
                                 &cost, ws->dir, e);
        if (rc == K3_EARG)
            return rc;
        if (rc < 0) {
            char what[48];
            snprintf(what, sizeof what, "embedding row %u", ids[i]);
            return err_wrap(e, rc, what);
        }
        w->st.embed_bytes += cost;
    }
    return 0;
}

/* ------------------------------------------------------------ experts */

static void *io_main(void *arg)
{
    ws_stream *w = arg;
    pthread_mutex_lock(&w->x_mu);
    while (!w->io_stop) {
        if (w->jn == 0 && w->tc_next < w->tc_n) {   /* expert records first: the model waits for them */
            tchunk *c = &w->tc[w->tc_next++];
            int want_crc = c->rc;
            pthread_mutex_unlock(&w->x_mu);
            c->rc = k3_pk_read(w->pk, c->file, c->dst, c->n, c->off, NULL, 0, &c->err);
            if (c->rc == 0 && want_crc) {
                uint64_t a = c->cb > c->ca ? c->ca : c->off, b = c->cb > c->ca ? c->cb : c->off + c->n;
                c->crc = k3_crc32(0, c->dst + (a - c->off), (size_t)(b - a));
            }
            pthread_mutex_lock(&w->x_mu);
            if (++w->tc_done == w->tc_n)
                pthread_cond_broadcast(&w->tc_cv);
            continue;
        }
        if (w->jn == 0) {
            pthread_cond_wait(&w->io_cv, &w->x_mu);
            continue;
        }
        uint32_t s = w->jobs[w->jh];
        w->jh = (w->jh + 1) % w->nslots;
        w->jn--;
        xslot *x = &w->xs[s];
        uint32_t layer = x->layer, expert = x->expert;
        pthread_mutex_unlock(&w->x_mu);
        k3_err err = {0};
        int rc = k3_pk_read_record(w->pk, layer, expert, w->xarena + (uint64_t)s * w->lay->stride, 1, &err);
        if (rc < 0 && rc != K3_ECORRUPT) {   /* the CRC message already names them */
            char what[48];
            snprintf(what, sizeof what, "layer %u expert %u", layer, expert);
            err_wrap(&err, rc, what);
        }
        pthread_mutex_lock(&w->x_mu);
        if (rc < 0) {
            x->state = X_ERROR;
            x->rc = rc;
            x->err = err;
        } else {
            x->state = X_READY;
            w->st.expert_bytes += w->lay->stride;
        }
        pthread_cond_broadcast(&w->x_cv);
    }
    pthread_mutex_unlock(&w->x_mu);
    return NULL;
}

/* How many MoE layers after `layer` the model next serves layer l (0: the
 * next one; n_moe - 1: l == layer, a whole token away). */
static uint32_t cyc_dist(const ws_stream *w, uint32_t l, uint32_t layer)
{
    const uint32_t f = w->base.cfg.first_k_dense_replace, n = w->base.cfg.num_hidden_layers - f;
    return ((l - f) + n - (layer - f) - 1) % n;
}

/* Replacement: when the cache holds less than one token's experts (MoE
 * layers x top-k), LRU would evict exactly what comes back first (the layers
 * come round in a fixed cycle): then the record whose layer comes back last
 * goes first, LRU among equals. Otherwise LRU. Both measured on traces with
 * bench-bench_stream --replay (runtime/STREAM.md). */
static int find_victim(ws_stream *w, uint32_t layer)
{
    int best = -1;
    uint32_t bd = 0;
    for (uint32_t s = 0; s < w->nslots; s++) {
        const xslot *x = &w->xs[s];
        if (x->ref > 0 || x->state == X_LOADING)
            continue;
        if (x->state == X_EMPTY)
            return (int)s;
        uint32_t d = w->cyclic ? cyc_dist(w, x->layer, layer) : 0;
        if (best < 0 || d > bd || (d == bd && x->tick < w->xs[best].tick)) {
            best = (int)s;
            bd = d;
        }
    }
    return best;
}

/* Queue the collected misses sorted by (file, offset). */
static void flush_misses(ws_stream *w)
{
    for (uint32_t i = 1; i < w->nmiss; i++)
        for (uint32_t j = i; j > 0; j--) {
            const xslot *a = &w->xs[w->miss[j - 1]], *b = &w->xs[w->miss[j]];
            const k3_pk_record *ra = k3_pk_record_find(w->pk, a->layer, a->expert);
            const k3_pk_record *rb = k3_pk_record_find(w->pk, b->layer, b->expert);
            if (ra->file < rb->file || (ra->file == rb->file && ra->offset <= rb->offset))
                break;
            uint32_t t = w->miss[j];
            w->miss[j] = w->miss[j - 1];
            w->miss[j - 1] = t;
        }
    for (uint32_t i = 0; i < w->nmiss; i++) {
        w->jobs[(w->jh + w->jn) % w->nslots] = w->miss[i];
        w->jn++;
    }
    if (w->nmiss)
        pthread_cond_broadcast(&w->io_cv);
    w->nmiss = 0;
}

/* Take a reference on (layer, expert), starting its read on a miss. Returns
 * the slot, or -1 if no slot can be freed right now. */
static int take(ws_stream *w, uint32_t layer, uint32_t expert, int count)
{
    uint64_t key = (uint64_t)layer * w->base.cfg.num_experts + expert;
    int s = (int)w->xmap[key] - 1;
    if (s >= 0) {
        w->xs[s].ref++;
        w->xs[s].tick = ++w->tick;
        if (count) {
            w->st.expert_requests++;
            w->st.expert_hits++;
        }
        if (w->trace && count)
            fprintf(w->trace, "%llu %u %u H\n", (unsigned long long)w->st.forwards, layer, expert);
        return s;
    }
    s = find_victim(w, layer);
    if (s < 0)
        return -1;
    xslot *x = &w->xs[s];
    if (x->state != X_EMPTY)
        w->xmap[(uint64_t)x->layer * w->base.cfg.num_experts + x->expert] = 0;
    x->layer = layer;
    x->expert = expert;
    x->state = X_LOADING;
    x->ref = 1;
    x->tick = ++w->tick;
    w->xmap[key] = (uint32_t)s + 1;
    w->miss[w->nmiss++] = (uint32_t)s;
    if (count)
        w->st.expert_requests++;
    if (w->trace && count)
        fprintf(w->trace, "%llu %u %u M\n", (unsigned long long)w->st.forwards, layer, expert);
    return s;
}

static void st_experts_prefetch(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started || !w->lay || layer >= ws->cfg.num_hidden_layers)
        return;
    pthread_mutex_lock(&w->x_mu);
    if (!w->xfailed) {
        for (uint32_t i = 0; i < w->npf; i++)
            w->xs[w->pf[i]].ref--;
        w->npf = 0;
        /* hits first, so that a miss never evicts a record this batch wants */
        const uint32_t m = n < w->nslots ? n : w->nslots;
        for (int pass = 0; pass < 2; pass++)
            for (uint32_t i = 0; i < m; i++) {
                if (ids[i] >= ws->cfg.num_experts)
                    continue;
                int present = w->xmap[(uint64_t)layer * ws->cfg.num_experts + ids[i]] != 0;
                if (present != (pass == 0))
                    continue;
                int s = take(w, layer, ids[i], 1);
                if (s < 0)
                    break;
                w->pf[w->npf++] = (uint32_t)s;
            }
        flush_misses(w);
    }
    pthread_mutex_unlock(&w->x_mu);
}

/* The planned slot count once planned (plan before k3_model_open to let the
 * model ask for whole cache-fulls), top-k before (the floor's slot count). */
static uint32_t st_batch_max(k3_ws *ws)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->nslots)
        return w->nslots;
    if (w->planned && w->plan.expert_slots)
        return w->plan.expert_slots;
    return ws->cfg.num_experts_per_token ? ws->cfg.num_experts_per_token : 1;
}

static int st_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
                              k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started || !w->lay)
        return k3_err_set(e, K3_EINTERNAL, "%s: no expert cache (not started or no MoE layer)", ws->dir);
    if (n > w->nslots || layer >= ws->cfg.num_hidden_layers)
        return k3_err_set(e, K3_EINTERNAL, "expert batch of %u for layer %u (cache of %u slots)", n, layer,
                          w->nslots);
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] >= ws->cfg.num_experts)
            return k3_err_set(e, K3_EINTERNAL, "expert %u of layer %u out of range", ids[i], layer);
    double t0 = now_s();
    pthread_mutex_lock(&w->x_mu);
    if (w->xfailed)
        goto failed;
    /* refs taken by prefetch for this batch are claimed; the others stay for
     * the layer's later batches (dropped when a slot is needed) */
    w->nheld = 0;
    for (uint32_t i = 0; i < n; i++) {
        int got = -1;
        for (uint32_t k = 0; k < w->npf; k++) {
            const xslot *x = &w->xs[w->pf[k]];
            if (x->layer == layer && x->expert == ids[i]) {
                got = (int)w->pf[k];
                w->pf[k] = w->pf[--w->npf];
                break;
            }
        }
        w->held[i] = got < 0 ? UINT32_MAX : (uint32_t)got;
    }
    for (uint32_t i = 0; i < n; i++)   /* hits first (see experts_prefetch) */
        if (w->held[i] == UINT32_MAX && w->xmap[(uint64_t)layer * ws->cfg.num_experts + ids[i]])
            w->held[i] = (uint32_t)take(w, layer, ids[i], 1);
    for (uint32_t i = 0; i < n;) {
        if (w->held[i] != UINT32_MAX) {
            i++;
            continue;
        }
        int s = take(w, layer, ids[i], 1);
        if (s < 0 && w->npf) {   /* give back the prefetched records not claimed yet */
            for (uint32_t k = 0; k < w->npf; k++)
                w->xs[w->pf[k]].ref--;
            w->npf = 0;
            continue;
        }
        if (s < 0) {   /* every free slot is still loading: let them land */
            flush_misses(w);
            pthread_cond_wait(&w->x_cv, &w->x_mu);
            continue;
        }
        w->held[i] = (uint32_t)s;
        i++;
    }
    w->nheld = n;
    flush_misses(w);
    for (uint32_t i = 0; i < n;) {
        xslot *x = &w->xs[w->held[i]];
        if (x->state == X_LOADING) {
            pthread_cond_wait(&w->x_cv, &w->x_mu);
            continue;
        }
        if (x->state == X_ERROR) {
            w->xfailed = 1;
            w->xerr = x->err;
            w->xerr.code = x->rc;
            goto failed;
        }
        i++;
    }
    pthread_mutex_unlock(&w->x_mu);
    w->st.expert_wait_s += now_s() - t0;
    const k3_pk_expert_layout *l = w->lay;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *r = w->xarena + (uint64_t)w->held[i] * l->stride;
        out[i].packed[0] = r + l->w1_packed;
        out[i].scales[0] = r + l->w1_scales;
        out[i].packed[1] = r + l->w3_packed;
        out[i].scales[1] = r + l->w3_scales;
        out[i].packed[2] = r + l->w2_packed;
        out[i].scales[2] = r + l->w2_scales;
    }
    return 0;
failed:;
    int rc = w->xerr.code ? w->xerr.code : K3_EIO;
    if (e)
        *e = w->xerr;
    pthread_mutex_unlock(&w->x_mu);
    return rc;
}

static void st_experts_release(k3_ws *ws, uint32_t layer)
{
    ws_stream *w = (ws_stream *)ws;
    (void)layer;
    if (!w->started || !w->lay)
        return;
    pthread_mutex_lock(&w->x_mu);
    for (uint32_t i = 0; i < w->nheld; i++)
        if (w->held[i] != UINT32_MAX)
            w->xs[w->held[i]].ref--;
    w->nheld = 0;
    pthread_cond_broadcast(&w->x_cv);
    pthread_mutex_unlock(&w->x_mu);
}

/* -------------------------------------------------------------- life */

static void st_close(k3_ws *ws)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->reader_on) {
        pthread_mutex_lock(&w->ring_mu);
        w->stop = 1;
        pthread_cond_broadcast(&w->ring_cv);
        pthread_mutex_unlock(&w->ring_mu);
        pthread_join(w->reader, NULL);
    }
    if (w->io_on) {   /* after the reader: it may be waiting for chunks */
        pthread_mutex_lock(&w->x_mu);
        w->io_stop = 1;
        pthread_cond_broadcast(&w->io_cv);
        pthread_mutex_unlock(&w->x_mu);
        for (uint32_t i = 0; i < w->io_on; i++)
            pthread_join(w->io[i], NULL);
    }
    if (w->sync_on) {
        pthread_mutex_destroy(&w->ring_mu);
        pthread_cond_destroy(&w->ring_cv);
        pthread_mutex_destroy(&w->x_mu);
        pthread_cond_destroy(&w->x_cv);
        pthread_cond_destroy(&w->io_cv);
        pthread_cond_destroy(&w->tc_cv);
    }
    free(w->tc);
    k3_outf_abort(&w->trace_out);   /* a trace never finished is not left behind */
    arena_free(w->pin_arena, w->pin_map);
    arena_free(w->ring, w->ring_map);
    arena_free(w->pring, w->pring_map);
    arena_free(w->xarena, w->x_map);
    if (w->grp)
        for (uint32_t g = 0; g < w->ng; g++)
        {
            free(w->grp[g].unit_rel);
            free(w->grp[g].segs);
            free(w->grp[g].parts);
            free(w->grp[g].unit_part0);
            free(w->grp[g].unit_done);
        }
    free(w->grp);
    free(w->tmpl);
    free(w->order);
    free(w->pos);
    free(w->io);
    free(w->xs);
    free(w->xmap);
    free(w->jobs);
    free(w->held);
    free(w->pf);
    free(w->miss);
    free(w->rowbuf);
    k3_io_free_aligned(w->bounce);
    k3_pk_close(w->pk);
    free(w);
}

static const k3_ws_ops stream_ops = {
    "stream", st_describe, st_acquire, st_release, st_embed,
    st_batch_max, st_experts_acquire, st_experts_release, st_close, st_experts_prefetch,
    st_rows_acquire, st_rows_release, st_status,
};

static void name_of(char *out, size_t cap, uint32_t g, uint32_t nl, k3_wslot s)
{
    if (g == nl)
        snprintf(out, cap, "language_model.%s", k3_wslot_name(s));
    else
        snprintf(out, cap, "language_model.model.layers.%u.%s", g, k3_wslot_name(s));
}

int k3_ws_stream_open(k3_ws **out, const char *dir, int direct, k3_err *e)
{
    *out = NULL;
    ws_stream *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    w->base.ops = &stream_ops;
    snprintf(w->base.dir, sizeof w->base.dir, "%s", dir);
    int rc = k3_pk_open(&w->pk, dir, direct ? K3_PK_DIRECT : 0, e);
    if (rc < 0) {
        free(w);
        return rc;
    }
    w->direct = 1;
    for (uint32_t i = 0; i < k3_pk_file_count(w->pk); i++) {
        const k3_pk_file *f = k3_pk_file_at(w->pk, i);
        if ((f->kind == K3_PK_FILE_TRUNK || f->kind == K3_PK_FILE_EXPERTS) && !k3_pk_file_is_direct(w->pk, i))
            w->direct = 0;
    }
    w->base.cfg = *k3_pk_cfg(w->pk);
    if (k3_pk_tokenizer_file(w->pk, "tiktoken.model"))
        snprintf(w->base.tok_dir, sizeof w->base.tok_dir, "%s", k3_pk_tokenizer_dir(w->pk));
    w->base.tok_sha256[0] = k3_pk_tokenizer_sha256(w->pk, "tiktoken.model");
    w->base.tok_sha256[1] = k3_pk_tokenizer_sha256(w->pk, "tokenizer_config.json");
    const k3_cfg *c = &w->base.cfg;
    const uint32_t NL = c->num_hidden_layers;
    w->ng = NL + 1;
    w->grp = calloc(w->ng, sizeof *w->grp);
    w->tmpl = calloc((uint64_t)w->ng * K3_W_COUNT, sizeof *w->tmpl);
    w->rowbuf = malloc((uint64_t)c->hidden_size * 4);
    w->bounce_cap = ((uint64_t)c->hidden_size * 4 + 3 * K3_PK_ALIGN) / K3_PK_ALIGN * K3_PK_ALIGN;
    w->bounce = k3_io_alloc_aligned(w->bounce_cap, K3_PK_ALIGN);
    if (!w->grp || !w->tmpl || !w->rowbuf || !w->bounce) {
        st_close(&w->base);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    char name[512];
    for (uint32_t g = 0; g < w->ng && rc == 0; g++) {
        grp *G = &w->grp[g];
        k3_pk_layer_units(w->pk, group_layer(w, g), &G->units, &G->nunits);
        G->unit_rel = calloc(G->nunits + 1, sizeof *G->unit_rel);
        if (!G->unit_rel) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            break;
        }
        for (uint32_t i = 0; i < G->nunits; i++) {
            G->unit_rel[i] = G->bytes;
            G->bytes += k3_pk_unit_at(w->pk, G->units[i])->nbytes;
        }
        if (G->bytes < K3_PK_ALIGN)
            G->bytes = K3_PK_ALIGN;
        for (int s = 0; s < K3_W_COUNT && rc == 0; s++) {
            name_of(name, sizeof name, g, NL, (k3_wslot)s);
            const k3_pk_tensor *t = k3_pk_tensor_find(w->pk, name);
            if (!t)
                continue;
            if (t->ndim == 0 || t->ndim > 4) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: tensor %s has %u dimensions", dir, name, t->ndim);
                break;
            }
            if (t->npieces != 1) {
                rc = k3_err_set(e, K3_EFORMAT,
                                "%s: tensor %s is split into %u row pieces: the streaming source needs each trunk "
                                "tensor in one piece (row-range consumption is not implemented)",
                                dir, name, t->npieces);
                break;
            }
            const k3_pk_piece *p = &t->pieces[0];
            int found = 0;
            for (uint32_t i = 0; i < G->nunits; i++)
                if (G->units[i] == p->unit) {
                    G->rel[s] = G->unit_rel[i] + (p->offset - k3_pk_unit_at(w->pk, p->unit)->offset);
                    found = 1;
                }
            if (!found) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: tensor %s lives in a unit of another layer", dir, name);
                break;
            }
            k3_view *v = &w->tmpl[(uint64_t)g * K3_W_COUNT + s];
            v->dtype = t->dtype;
            v->ndim = t->ndim;
            for (uint32_t d = 0; d < t->ndim; d++)
                v->shape[d] = t->shape[d];
        }
    }
    if (rc == 0) {
        w->embed = k3_pk_tensor_find(w->pk, K3_SCH_EMBED_NAME);
        if (!w->embed || (w->embed->dtype != K3_DT_BF16 && w->embed->dtype != K3_DT_F16 && w->embed->dtype != K3_DT_F32) || w->embed->ndim != 2 ||
            w->embed->shape[0] != c->vocab_size || w->embed->shape[1] != c->hidden_size)
            rc = k3_err_set(e, K3_EFORMAT, "%s: embed_tokens.weight missing or not as expected: BF16/F16/F32 [%u, %u]",
                            dir, c->vocab_size, c->hidden_size);
    }
    w->lay = k3_pk_experts(w->pk);
    if (rc == 0 && w->lay &&
        (w->lay->rows_w13 != c->moe_intermediate_size || w->lay->cols_w13 != c->routed_expert_hidden_size))
        rc = k3_err_set(e, K3_EFORMAT, "%s: expert records are %ux%u, expected %ux%u from the config", dir,
                        w->lay->rows_w13, w->lay->cols_w13, c->moe_intermediate_size, c->routed_expert_hidden_size);
    if (rc < 0) {
        st_close(&w->base);
        return rc;
    }
    *out = &w->base;
    return 0;
}

int k3_ws_stream_finish(k3_ws *ws, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->trace)
        return 0;
    if (w->sync_on)
        pthread_mutex_lock(&w->x_mu);
    w->trace = NULL;   /* no I/O thread writes to it any more */
    if (w->sync_on)
        pthread_mutex_unlock(&w->x_mu);
    return k3_outf_commit(&w->trace_out, e);
}

int k3_ws_stream_direct(const k3_ws *ws) { return ((const ws_stream *)ws)->direct; }

void k3_ws_stream_stats(const k3_ws *ws, k3_stream_stats *st)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->sync_on) {
        pthread_mutex_lock(&w->ring_mu);
        pthread_mutex_lock(&w->x_mu);
    }
    *st = w->st;
    st->trunk_bytes = w->st.trunk_stream_bytes + w->st.pinned_bytes + w->st.embed_bytes;
    if (w->sync_on) {
        pthread_mutex_unlock(&w->x_mu);
        pthread_mutex_unlock(&w->ring_mu);
    }
}

/* Split group g into a core and pieces of at most piece bytes for every
 * lazy-capable matrix larger than that (none if piece == 0). */
static int layout_group(ws_stream *w, uint32_t g, uint64_t piece, k3_err *e)
{
    grp *G = &w->grp[g];
    G->nlz = 0;
    char name[512];
    const uint32_t NL = w->base.cfg.num_hidden_layers;
    /* pick the streamed matrices, in the model's order (k3_stream_piece_slots) */
    const k3_wslot *order;
    const uint32_t norder = k3_stream_piece_slots(&order);
    for (uint32_t oi = 0; oi < norder && piece; oi++) {
        const int s = (int)order[oi];
        const k3_view *t = &w->tmpl[(uint64_t)g * K3_W_COUNT + s];
        /* KDA and MLA share upstream names (self_attn.o_proj, g_proj): only
         * the slots of this layer's kind */
        int mine = g == NL ? k3_wslot_in_head((k3_wslot)s)
                           : k3_wslot_in_layer((k3_wslot)s, k3_cfg_layer_is_mla(&w->base.cfg, g),
                                               k3_cfg_layer_is_dense(&w->base.cfg, g));
        if (t->ndim != 2 || !mine)
            continue;
        if (g == NL)
            snprintf(name, sizeof name, "language_model.%s", k3_wslot_name((k3_wslot)s));
        else
            snprintf(name, sizeof name, "language_model.model.layers.%u.%s", g, k3_wslot_name((k3_wslot)s));
        const k3_pk_tensor *pt = k3_pk_tensor_find(w->pk, name);
        if (!pt || pt->npieces != 1 || pt->nbytes <= piece || G->nlz == MAX_LAZY)
            continue;
        int dup = 0;
        for (uint32_t j = 0; j < G->nlz; j++)
            dup |= G->lz[j].off == pt->pieces[0].offset;
        if (dup)
            continue;
        lazyt *L = &G->lz[G->nlz++];
        L->slot = (uint32_t)s;
        L->file = k3_pk_unit_at(w->pk, pt->pieces[0].unit)->file;
        L->off = pt->pieces[0].offset;
        L->rows = pt->shape[0];
        L->rowbytes = pt->nbytes / pt->shape[0];
        L->chunk_rows = piece / L->rowbytes ? piece / L->rowbytes : 1;
        L->nchunks = (uint32_t)((L->rows + L->chunk_rows - 1) / L->chunk_rows);
    }
    if (!G->nlz)
        return 0;
    /* parts of every unit in offset order: segments and pieces */
    uint32_t maxp = 0;
    for (uint32_t j = 0; j < G->nlz; j++)
        maxp += G->lz[j].nchunks + 1;
    maxp += G->nunits;
    G->parts = calloc(maxp, sizeof *G->parts);
    G->segs = calloc(maxp, sizeof *G->segs);
    G->unit_part0 = calloc(G->nunits + 1, sizeof *G->unit_part0);
    G->unit_done = calloc(G->nunits + 1, 1);
    if (!G->parts || !G->segs || !G->unit_part0 || !G->unit_done)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    uint64_t pos = 0;
    for (uint32_t i = 0; i < G->nunits; i++) {
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, G->units[i]);
        G->unit_part0[i] = G->nparts;
        uint64_t cur = u->offset, end = u->offset + u->nbytes;
        for (;;) {
            /* the next streamed matrix inside this unit at or after cur */
            int32_t nj = -1;
            for (uint32_t j = 0; j < G->nlz; j++)
                if (G->lz[j].file == u->file && G->lz[j].off >= cur && G->lz[j].off < end &&
                    (nj < 0 || G->lz[j].off < G->lz[nj].off))
                    nj = (int32_t)j;
            uint64_t stop = nj >= 0 ? G->lz[nj].off : end;
            if (stop > cur) {
                seg *S = &G->segs[G->nsegs++];
                S->file = u->file;
                S->a = cur;
                S->b = stop;
                S->pos = pos;
                S->part = G->nparts;
                pos += (stop + 4095) / 4096 * 4096 - cur / 4096 * 4096;
                G->parts[G->nparts].a = cur;
                G->parts[G->nparts++].b = stop;
            }
            if (nj < 0)
                break;
            lazyt *L = &G->lz[nj];
            L->part0 = G->nparts;
            for (uint32_t c = 0; c < L->nchunks; c++) {
                uint64_t a, b;
                piece_range(G, (uint32_t)nj, c, &a, &b);
                G->parts[G->nparts].a = a;
                G->parts[G->nparts++].b = b;
            }
            cur = L->off + L->rows * L->rowbytes;
        }
    }
    G->unit_part0[G->nunits] = G->nparts;
    G->core = pos < K3_PK_ALIGN ? K3_PK_ALIGN : pos;
    /* core tensors: where they landed */
    for (int s = 0; s < K3_W_COUNT; s++) {
        const k3_view *t = &w->tmpl[(uint64_t)g * K3_W_COUNT + s];
        int mine = g == NL ? k3_wslot_in_head((k3_wslot)s)
                           : k3_wslot_in_layer((k3_wslot)s, k3_cfg_layer_is_mla(&w->base.cfg, g),
                                               k3_cfg_layer_is_dense(&w->base.cfg, g));
        if (!t->ndim || !mine)
            continue;
        int lz = 0;
        for (uint32_t j = 0; j < G->nlz; j++)
            lz |= G->lz[j].slot == (uint32_t)s;
        if (lz)
            continue;
        if (g == NL)
            snprintf(name, sizeof name, "language_model.%s", k3_wslot_name((k3_wslot)s));
        else
            snprintf(name, sizeof name, "language_model.model.layers.%u.%s", g, k3_wslot_name((k3_wslot)s));
        const k3_pk_tensor *pt = k3_pk_tensor_find(w->pk, name);
        uint64_t off = pt->pieces[0].offset;
        int found = 0;
        for (uint32_t k = 0; k < G->nsegs && !found; k++)
            if (off >= G->segs[k].a && off + pt->nbytes <= G->segs[k].b) {
                G->crel[s] = G->segs[k].pos + (off - G->segs[k].a / 4096 * 4096);
                G->cok[s] = 1;
                found = 1;
            }
        if (!found)
            return k3_err_set(e, K3_EFORMAT, "%s: tensor %s overlaps a streamed matrix", w->base.dir, name);
    }
    /* piece positions in the reader's order, after the core */
    uint32_t at = 1;
    for (uint32_t j = 0; j < G->nlz; j++) {
        G->lz[j].pos0 = at;
        at += G->lz[j].nchunks;
    }
    return 0;
}

int k3_ws_stream_plan(k3_ws *ws, const k3_stream_opts *o, k3_stream_plan *plan, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    const k3_cfg *c = &ws->cfg;
    if (w->started)   /* planning again before the start just replaces the plan */
        return k3_err_set(e, K3_EINTERNAL, "streaming source planned after its start");
    w->piece_bytes = o->piece_bytes;
    uint64_t gb[K3_CFG_MAX_LAYERS + 1], cb[K3_CFG_MAX_LAYERS + 1], pmax = 0;
    for (uint32_t g = 0; g < w->ng; g++) {
        int rc = layout_group(w, g, o->piece_bytes, e);
        if (rc < 0)
            return rc;
        gb[g] = w->grp[g].bytes;
        cb[g] = w->grp[g].nlz ? w->grp[g].core : w->grp[g].bytes;
        for (uint32_t j = 0; j < w->grp[g].nlz; j++)
            for (uint32_t k = 0; k < w->grp[g].lz[j].nchunks; k++)
                if (piece_region(&w->grp[g], j, k) > pmax)
                    pmax = piece_region(&w->grp[g], j, k);
    }
    uint32_t nmoe = c->num_hidden_layers > c->first_k_dense_replace
                        ? c->num_hidden_layers - c->first_k_dense_replace : 0;
    k3_stream_shape sh = {w->ng, gb, (uint64_t)c->hidden_size * k3_dtype_size(w->embed->dtype),
                          w->lay ? w->lay->stride : 0, nmoe, c->num_experts, c->num_experts_per_token, cb, pmax};
    k3_stream_opts oo = *o;
    if (!oo.baseline)
        oo.baseline = k3_stream_rss_now();
    int rc = k3_stream_plan_make(&sh, c, &oo, &w->plan, e);
    if (rc < 0)
        return rc;
    w->planned = 1;
    if (plan)
        *plan = w->plan;
    return 0;
}

int k3_ws_stream_start(k3_ws *ws, const k3_stream_opts *o, k3_stream_plan *plan, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->started)
        return k3_err_set(e, K3_EINTERNAL, "streaming source started twice");
    int rc = w->planned ? 0 : k3_ws_stream_plan(ws, o, NULL, e);
    if (rc < 0)
        return rc;
    if (plan)
        *plan = w->plan;
    w->trunk_crc = o->trunk_crc;
    const k3_cfg *c = &ws->cfg;
    const k3_stream_plan *p = &w->plan;
    /* counters and tables first (small), then the arenas */
    uint64_t nitems = 0;
    for (uint32_t g = 0; g < w->ng; g++)
        if (!p->pinned[g]) {
            nitems++;
            for (uint32_t j = 0; j < w->grp[g].nlz; j++)
                nitems += w->grp[g].lz[j].nchunks;
        }
    w->order = calloc(nitems + 1, sizeof *w->order);
    w->pos = calloc(w->ng, sizeof *w->pos);
    if (!w->order || !w->pos)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint32_t g = 0; g < w->ng; g++)
        if (!p->pinned[g]) {
            w->pos[g] = w->norder;
            w->order[w->norder++] = (item){g, -1, 0};
            for (uint32_t j = 0; j < w->grp[g].nlz; j++)
                for (uint32_t k = 0; k < w->grp[g].lz[j].nchunks; k++)
                    w->order[w->norder++] = (item){g, (int32_t)j, k};
        }
    /* 2 MiB: a 16 MiB row piece is read by the four I/O threads at once and
     * its CRC split between them; in 16 MiB chunks one thread read a piece
     * and CRC'd it while the device idled (runtime/STREAM.md "Figures") */
    w->tchunk = o->io_chunk ? (o->io_chunk + 4095) / 4096 * 4096 : 2ull << 20;
    w->nio = o->io_threads ? o->io_threads : 4;
    if (w->nio > 64)
        w->nio = 64;
    w->io = calloc(w->nio, sizeof *w->io);
    for (uint32_t g = 0; g < w->ng; g++) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < w->grp[g].nunits; i++)
            n += (uint32_t)((k3_pk_unit_at(w->pk, w->grp[g].units[i])->nbytes + TCHUNK - 1) / TCHUNK);
        if (n > w->tc_cap)
            w->tc_cap = n;
    }
    w->tc = calloc(w->tc_cap + 1, sizeof *w->tc);
    if (!w->io || !w->tc)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    if (w->lay) {
        w->nslots = p->expert_slots;
        w->cyclic = (uint64_t)w->nslots <
                    (uint64_t)(c->num_hidden_layers - c->first_k_dense_replace) * c->num_experts_per_token;
        w->xs = calloc(w->nslots, sizeof *w->xs);
        w->xmap = calloc((uint64_t)c->num_hidden_layers * c->num_experts, sizeof *w->xmap);
        w->jobs = calloc(w->nslots, sizeof *w->jobs);
        w->held = calloc(w->nslots, sizeof *w->held);
        w->pf = calloc(w->nslots, sizeof *w->pf);
        w->miss = calloc(w->nslots, sizeof *w->miss);
        if (!w->xs || !w->xmap || !w->jobs || !w->held || !w->pf || !w->miss)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    if (o->trace_path) {
        rc = k3_outf_open(&w->trace_out, o->trace_path, e);
        if (rc < 0)
            return rc;
        w->trace = w->trace_out.f;
        fprintf(w->trace, "# k3-run expert trace: forward layer expert H|M (hit or miss at first request)\n");
    }
    w->pin_arena = p->trunk_pinned ? arena_alloc(p->trunk_pinned, &w->pin_map) : NULL;
    w->ring = p->ring ? arena_alloc(p->ring, &w->ring_map) : NULL;
    w->pring = p->piece_ring ? arena_alloc(p->piece_ring, &w->pring_map) : NULL;
    w->pring_cap = p->piece_ring;
    w->ring_cap = p->ring;
    w->xarena = p->expert_slots ? arena_alloc((uint64_t)p->expert_slots * w->lay->stride, &w->x_map) : NULL;
    if ((p->trunk_pinned && !w->pin_arena) || (p->ring && !w->ring) || (p->expert_slots && !w->xarena) ||
        (p->piece_ring && !w->pring))
        return k3_err_set(e, K3_ENOMEM, "cannot map the planned arenas (%llu bytes)",
                          (unsigned long long)(p->mapped_pinned + p->mapped_ring + p->expert_bytes));
    pthread_mutex_init(&w->ring_mu, NULL);
    pthread_cond_init(&w->ring_cv, NULL);
    pthread_mutex_init(&w->x_mu, NULL);
    pthread_cond_init(&w->x_cv, NULL);
    pthread_cond_init(&w->io_cv, NULL);
    pthread_cond_init(&w->tc_cv, NULL);
    w->sync_on = 1;
    for (uint32_t i = 0; i < w->nio; i++) {
        if (pthread_create(&w->io[i], NULL, io_main, w) != 0)
            return k3_err_set(e, K3_ENOMEM, "cannot start an I/O thread");
        w->io_on++;
    }
    w->threads_on = 1;
    double t0 = now_s();
    uint64_t at = 0;
    for (uint32_t g = 0; g < w->ng; g++)
        if (p->pinned[g]) {
            w->grp[g].pinned = w->pin_arena + at;
            rc = read_group(w, g, w->grp[g].pinned, 1, e);
            if (rc < 0)
                return rc;
            at += w->grp[g].bytes;
            w->st.pinned_bytes += w->grp[g].bytes;
        }
    w->st.load_s = now_s() - t0;
    if (w->norder) {
        if (pthread_create(&w->reader, NULL, reader_main, w) != 0)
            return k3_err_set(e, K3_ENOMEM, "cannot start the reader thread");
        w->reader_on = 1;
    }
    w->started = 1;
    return 0;
}
