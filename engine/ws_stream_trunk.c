/*
 * ws_stream_trunk.c - the streaming source's trunk: the ring and its reader
 * thread, pinned and streamed groups, row pieces, the embedding rows
 * (invariants: ws_stream.c).
 */
#include "ws_stream_int.h"

/* -------------------------------------------------------------- trunk */

/* Hand the n chunks posted in b->tc to the I/O threads and wait until every
 * one is done. Called with x_mu held; returns with it released. */
static void run_chunks(ws_stream *w, tbatch *bt, uint32_t n)
{
    bt->n = n;
    bt->next = 0;
    bt->done = 0;
    bt->seq = ++w->tb_seq;
    pthread_cond_broadcast(&w->io_cv);
    while (bt->done < bt->n)
        pthread_cond_wait(&w->tc_cv, &w->x_mu);
    bt->n = 0;
    pthread_mutex_unlock(&w->x_mu);
}

/* Read a group's units as chunks spread over the I/O threads (parallel
 * O_DIRECT preads, each CRC'd where read), then fold the chunk CRCs of each
 * unit in order (crc32_combine) and compare with the unit's CRC. */
static int read_group_par(ws_stream *w, tbatch *bt, uint32_t g, uint8_t *dst, int crc, k3_err *e)
{
    const grp *G = &w->grp[g];
    pthread_mutex_lock(&w->x_mu);
    uint32_t n = 0;
    for (uint32_t i = 0; i < G->nunits; i++) {
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, G->units[i]);
        for (uint64_t o = 0; o < u->nbytes; o += TCHUNK) {
            tchunk *c = &bt->tc[n++];
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
    run_chunks(w, bt, n);
    int rc = 0;
    for (uint32_t k = 0; k < n && rc == 0; k++)
        if (bt->tc[k].rc < 0) {
            rc = bt->tc[k].rc;
            if (e) {
                k3_err_clear(e);
                *e = bt->tc[k].err;
            }
        }
    for (uint32_t k = 0; k < n && rc == 0 && crc;) {
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, bt->tc[k].unit);
        uLong v = bt->tc[k].crc;
        uint32_t j = k + 1;
        for (; j < n && bt->tc[j].unit == bt->tc[k].unit; j++)
            v = crc32_combine(v, bt->tc[j].crc, (z_off_t)bt->tc[j].n);
        if ((uint32_t)v != u->crc32)
            rc = k3_err_set(e, K3_ECORRUPT, "%s: unit %u (layer %d) at offset %llu has CRC32 %08x, expected %08x",
                            k3_pk_file_at(w->pk, u->file)->path, bt->tc[k].unit, u->layer,
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

int k3_wss_read_group(ws_stream *w, tbatch *bt, uint32_t g, uint8_t *dst, int crc, k3_err *e)
{
    const grp *G = &w->grp[g];
    if (w->threads_on && bt->tc)
        return read_group_par(w, bt, g, dst, crc, e);
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
static int read_span(ws_stream *w, tbatch *bt, uint32_t file, uint64_t off, uint64_t n, uint8_t *dst, uint64_t a, uint64_t b,
                     uint32_t *crc, k3_err *e)
{
    if (!w->threads_on || !bt->tc) {
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
            tchunk *c = &bt->tc[k];
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
        run_chunks(w, bt, k);
        for (uint32_t i = 0; i < k; i++)
            if (bt->tc[i].rc < 0) {
                if (e) {
                    k3_err_clear(e);
                    *e = bt->tc[i].err;
                }
                return bt->tc[i].rc;
            }
        for (uint32_t i = 0; crc && i < k; i++)
            if (bt->tc[i].cb > bt->tc[i].ca)
                fold = crc32_combine(fold, bt->tc[i].crc, (z_off_t)(bt->tc[i].cb - bt->tc[i].ca));
    }
    if (crc)
        *crc = (uint32_t)fold;
    return 0;
}

/* A new CRC pass over group g's parts: taken when the reader takes g's core
 * (ring_mu held), before any of this pass's pieces can be read. */
static void start_pass(grp *G)
{
    for (uint32_t p = 0; p < G->nparts; p++)
        G->parts[p].have = 0;
    memset(G->unit_done, 0, G->nunits);
}

/* Is any read of group g still in flight (ring_mu held)? */
static int group_reading(const ws_stream *w, uint32_t g)
{
    for (uint32_t i = 0; i < w->qn; i++)
        if (w->q[(w->qh + i) % RING_Q].g == g && w->q[(w->qh + i) % RING_Q].state == R_READING)
            return 1;
    for (uint32_t i = 0; i < w->pqn; i++)
        if (w->pq[(w->pqh + i) % RING_Q].g == g && w->pq[(w->pqh + i) % RING_Q].state == R_READING)
            return 1;
    return 0;
}

/* Fold the parts of every unit of g whose parts have all arrived in this
 * pass and compare with the unit's CRC (ring_mu held). */
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
 * widened to 4096 and CRC'd over its exact range (its CRC pass was started
 * when the reader took it: start_pass). */
static int read_core(ws_stream *w, tbatch *bt, uint32_t g, uint8_t *dst, k3_err *e)
{
    grp *G = &w->grp[g];
    for (uint32_t k = 0; k < G->nsegs; k++) {
        const seg *S = &G->segs[k];
        uint64_t a4 = S->a / 4096 * 4096, b4 = (S->b + 4095) / 4096 * 4096;
        uint32_t v = 0;
        int rc = read_span(w, bt, S->file, a4, b4 - a4, dst + S->pos, S->a, S->b, w->trunk_crc ? &v : NULL, e);
        if (rc < 0) {
            char name[48], what[64];
            group_name(w, g, name, sizeof name);
            snprintf(what, sizeof what, "trunk of %s", name);
            return err_wrap(e, rc, what);
        }
        pthread_mutex_lock(&w->ring_mu);
        G->parts[S->part].crc = v;
        G->parts[S->part].have = 1;
        pthread_mutex_unlock(&w->ring_mu);
    }
    pthread_mutex_lock(&w->ring_mu);
    int rc = check_units(w, g, e);
    pthread_mutex_unlock(&w->ring_mu);
    return rc;
}

/* Bytes [a, b) of piece c of streamed matrix j of group g. */
void k3_wss_piece_range(const grp *G, uint32_t j, uint32_t c, uint64_t *a, uint64_t *b)
{
    const lazyt *L = &G->lz[j];
    *a = L->off + L->prow[c] * L->rowbytes;
    *b = L->off + L->prow[c + 1] * L->rowbytes;
}

uint64_t k3_wss_piece_region(const grp *G, uint32_t j, uint32_t c)
{
    uint64_t a, b;
    k3_wss_piece_range(G, j, c, &a, &b);
    return (b + 4095) / 4096 * 4096 - a / 4096 * 4096;
}

static int read_piece(ws_stream *w, tbatch *bt, uint32_t g, uint32_t j, uint32_t c, uint8_t *dst, uint64_t *skip,
                      k3_err *e)
{
    grp *G = &w->grp[g];
    uint64_t a, b;
    k3_wss_piece_range(G, j, c, &a, &b);
    uint64_t a4 = a / 4096 * 4096, b4 = (b + 4095) / 4096 * 4096;
    *skip = a - a4;
    uint32_t v = 0;
    int rc = read_span(w, bt, G->lz[j].file, a4, b4 - a4, dst, a, b, w->trunk_crc ? &v : NULL, e);
    if (rc < 0) {
        char name[48], what[96];
        group_name(w, g, name, sizeof name);
        snprintf(what, sizeof what, "trunk of %s, %s rows from %llu", name, k3_wslot_name((k3_wslot)G->lz[j].slot),
                 (unsigned long long)G->lz[j].prow[c]);
        return err_wrap(e, rc, what);
    }
    pthread_mutex_lock(&w->ring_mu);   /* the other reader may be folding this group's parts */
    part *P = &G->parts[G->lz[j].part0 + c];
    P->crc = v;
    P->have = 1;
    rc = check_units(w, g, e);
    pthread_mutex_unlock(&w->ring_mu);
    return rc;
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

void *k3_wss_reader_main(void *arg)
{
    const reader_arg *ra = arg;
    ws_stream *w = ra->w;
    tbatch *bt = &w->tb[ra->i];
    pthread_mutex_lock(&w->ring_mu);
    while (!w->stop) {
        const item it = w->order[w->next];
        grp *G = &w->grp[it.g];
        int piece = it.j >= 0;
        uint64_t off, n = piece ? k3_wss_piece_region(G, (uint32_t)it.j, it.c) : G->nlz ? G->core : G->bytes;
        rent *q = piece ? w->pq : w->q;
        uint32_t *qh = piece ? &w->pqh : &w->qh, *qn = piece ? &w->pqn : &w->qn;
        /* a group's next CRC pass starts once its last pass's reads are in */
        int new_pass = !piece && G->nlz;
        if (*qn == RING_Q || (new_pass && group_reading(w, it.g)) ||
            !fifo_fit(q, *qh, *qn, piece ? w->pring_cap : w->ring_cap, n, &off)) {
            pthread_cond_wait(&w->ring_cv, &w->ring_mu);
            continue;
        }
        if (new_pass)
            start_pass(G);
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
            rc = read_piece(w, bt, it.g, (uint32_t)it.j, it.c, w->pring + off, &r->skip, &err);
        else if (G->nlz)
            rc = read_core(w, bt, it.g, w->ring + off, &err);
        else
            rc = k3_wss_read_group(w, bt, it.g, w->ring + off, w->trunk_crc, &err);
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
            v->piece_rows = G->lz[j].chunk_rows;
        }
}

int k3_wss_st_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
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

void k3_wss_st_release(k3_ws *ws, uint32_t g)
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

int k3_wss_st_rows_acquire(k3_ws *ws, uint32_t g, k3_wslot s, uint64_t row, uint64_t *n, const void **data,
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
    uint32_t c = L->c0;
    while (c < L->c1 && L->prow[c + 1] <= row)
        c++;
    if (c == L->c1 || row < L->prow[c])
        return k3_err_set(e, K3_EINTERNAL, "row %llu of %s in group %u is not read by this rank",
                          (unsigned long long)row, k3_wslot_name(s), g);
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
        uint32_t want = w->pos[g] + L->pos0 + (c - L->c0);
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
    const uint64_t first = L->prow[c], last = L->prow[c + 1];
    *data = w->pring + r->off + r->skip + (row - first) * L->rowbytes;
    *n = last - row;
    pthread_mutex_unlock(&w->ring_mu);
    return 0;
}

void k3_wss_st_rows_release(k3_ws *ws, uint32_t g, k3_wslot s)
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

int k3_wss_st_status(k3_ws *ws, k3_err *e)
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

int k3_wss_st_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    if (g >= w->ng || !w->tmpl[(uint64_t)g * K3_W_COUNT + s].ndim)
        return k3_err_set(e, K3_ENOENT, "%s: packed model has no tensor %s in group %u", ws->dir, k3_wslot_name(s), g);
    *out = w->tmpl[(uint64_t)g * K3_W_COUNT + s];
    out->data = NULL;
    for (uint32_t j = 0; j < w->grp[g].nlz; j++)
        if (w->grp[g].lz[j].slot == (uint32_t)s)
            out->piece_rows = w->grp[g].lz[j].chunk_rows;
    return 0;
}

int k3_wss_st_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
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

/* Over several ranks a unit whose pieces are read by different ranks is
 * checked here, after its group, by every rank: each sends the CRCs of its
 * own pieces of g (in part order), and every rank folds the unit's parts -
 * its own segments and pieces, the others' pieces - and compares with the
 * unit's CRC. All ranks fold the same numbers, so all reach the same
 * verdict. Units whose parts one rank reads whole are checked by its reader
 * (check_units). */
int k3_wss_st_dist_check(k3_ws *ws, uint32_t g, int code, k3_err *e)
{
    ws_stream *w = (ws_stream *)ws;
    k3_dist *d = k3_dist_get();
    if (!d)
        return code;
    const grp *G = g < w->ng ? &w->grp[g] : NULL;
    if (!G || G->pinned || !G->nlz || !w->started)
        return k3_dist_agree(d, code, e, 0, NULL, e);
    const uint32_t N = d->size, me = d->rank;
    const uint64_t S = sizeof(k3_dist_status);
    uint64_t n[K3_DIST_MAX_RANKS] = {0};
    uint32_t *mine = (uint32_t *)(w->dsend + S);
    pthread_mutex_lock(&w->ring_mu);   /* the reader wrote them */
    for (uint32_t p = 0; p < G->nparts; p++)
        if (G->parts[p].rank >= 0) {
            if ((uint32_t)G->parts[p].rank == me)
                mine[n[me] / 4] = G->parts[p].crc;
            n[G->parts[p].rank] += 4;
        }
    pthread_mutex_unlock(&w->ring_mu);
    const void *from[K3_DIST_MAX_RANKS];
    int rc = k3_dist_gather(d, code, e, w->dsend, n, w->drecv, from, e);
    if (rc < 0 || !w->trunk_crc)
        return rc;
    uint32_t at[K3_DIST_MAX_RANKS] = {0};
    for (uint32_t i = 0; i < G->nunits; i++) {
        const uint32_t p0 = G->unit_part0[i], p1 = G->unit_part0[i + 1];
        int shared = 0;
        uLong v = 0;
        for (uint32_t p = p0; p < p1; p++) {
            const part *P = &G->parts[p];
            uint32_t c = P->crc;
            if (P->rank >= 0) {
                const uint32_t q = (uint32_t)P->rank;
                c = ((const uint32_t *)from[q])[at[q]++];
                shared |= q != me;
            }
            v = p == p0 ? c : crc32_combine(v, c, (z_off_t)(P->b - P->a));
        }
        const k3_pk_unit *u = k3_pk_unit_at(w->pk, G->units[i]);
        if (shared && (uint32_t)v != u->crc32) {
            char name[48];
            group_name(w, g, name, sizeof name);
            return k3_err_set(e, K3_ECORRUPT,
                              "%s: unit %u (layer %d) at offset %llu has CRC32 %08x, expected %08x (trunk of %s, its "
                              "pieces read by %u ranks)", k3_pk_file_at(w->pk, u->file)->path, G->units[i], u->layer,
                              (unsigned long long)u->offset, (uint32_t)v, u->crc32, name, N);
        }
    }
    return 0;
}
