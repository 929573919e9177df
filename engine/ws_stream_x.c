/*
 * ws_stream_x.c - the streaming source's routed experts: the slot arena, its
 * LRU table, prefetch and the pool of I/O threads (invariants: ws_stream.c).
 */
#include "ws_stream_int.h"

/* ------------------------------------------------------------ experts */

/* Time since the last change of io_busy into io_idle_s or io_depth_s (x_mu
 * held): the report's device idle share, measured rather than derived. */
void k3_wss_io_count(ws_stream *w)
{
    const double now = now_s(), dt = now - w->io_t;
    if (w->io_busy)
        w->st.io_depth_s += dt * w->io_busy;
    else
        w->st.io_idle_s += dt;
    w->io_t = now;
}

/* A read starts (+1) or ends (-1), x_mu held. */
static void io_busy_add(ws_stream *w, int d)
{
    k3_wss_io_count(w);
    w->io_busy = (uint32_t)((int)w->io_busy + d);
}

/* The I/O threads. Order of work: expert records the model will wait for,
 * then the trunk group the reader is loading, then records read on a guess
 * (so a guess only uses time the device would otherwise be idle). */
void *k3_wss_io_main(void *arg)
{
    ws_stream *w = arg;
    pthread_mutex_lock(&w->x_mu);
    while (!w->io_stop) {
        tbatch *b = NULL;   /* the oldest batch with chunks not taken */
        for (uint32_t i = 0; i < NREADERS && w->jn == 0; i++)
            if (w->tb[i].next < w->tb[i].n && (!b || w->tb[i].seq < b->seq))
                b = &w->tb[i];
        if (b) {
            tchunk *c = &b->tc[b->next++];
            int want_crc = c->rc;
            io_busy_add(w, 1);
            pthread_mutex_unlock(&w->x_mu);
            c->rc = k3_pk_read(w->pk, c->file, c->dst, c->n, c->off, NULL, 0, &c->err);
            pthread_mutex_lock(&w->x_mu);   /* the read is done; its CRC is not the device's time */
            io_busy_add(w, -1);
            pthread_mutex_unlock(&w->x_mu);
            if (c->rc == 0 && want_crc) {
                uint64_t lo = c->cb > c->ca ? c->ca : c->off, hi = c->cb > c->ca ? c->cb : c->off + c->n;
                c->crc = k3_crc32(0, c->dst + (lo - c->off), (size_t)(hi - lo));
            }
            pthread_mutex_lock(&w->x_mu);
            if (++b->done == b->n)
                pthread_cond_broadcast(&w->tc_cv);
            continue;
        }
        uint32_t s;
        if (w->jn) {
            s = w->jobs[w->jh];
            w->jh = (w->jh + 1) % w->nslots;
            w->jn--;
        } else if (w->gn) {
            s = w->gjobs[w->gh];
            w->gh = (w->gh + 1) % w->nslots;
            w->gn--;
        } else {
            pthread_cond_wait(&w->io_cv, &w->x_mu);
            continue;
        }
        xslot *x = &w->xs[s];
        x->queued = Q_NONE;
        uint32_t layer = x->layer, expert = x->expert;
        io_busy_add(w, 1);
        pthread_mutex_unlock(&w->x_mu);
        k3_err err = {0};
        int rc = k3_pk_read_record(w->pk, layer, expert, w->xarena + (uint64_t)s * w->lay->stride, 1, &err);
        if (rc < 0 && rc != K3_ECORRUPT) {   /* the CRC message already names them */
            char what[48];
            snprintf(what, sizeof what, "layer %u expert %u", layer, expert);
            err_wrap(&err, rc, what);
        }
        pthread_mutex_lock(&w->x_mu);
        io_busy_add(w, -1);
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
        xslot *x = &w->xs[w->miss[i]];
        x->queued = Q_DEMAND;
        x->qseq = ++w->jseq;
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
        xslot *x = &w->xs[s];
        x->ref++;
        x->tick = ++w->tick;
        /* a record read ahead on this layer's guess is a miss the guess
         * caught: the hit rate stays that of the cache alone */
        int hit = !x->guess;
        if (count) {
            w->st.guess_right += (uint64_t)x->guess;
            x->guess = 0;
            w->st.expert_requests++;
            w->st.expert_hits += (uint64_t)hit;
        }
        if (w->trace && count)
            fprintf(w->trace, "%llu %u %u %c\n", (unsigned long long)w->st.forwards, layer, expert, hit ? 'H' : 'M');
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
    x->guess = 0;
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

static int has_id(const uint32_t *ids, uint32_t n, uint32_t x)   /* ids ascending */
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && ids[lo] == x;
}

/* Before the refs in pf are dropped: the guesses the routing of `layer`
 * (ids) does not name are no longer guesses - dropped unread if still
 * queued, kept as cached records otherwise; the queued ones it names stay
 * in gjobs. */
static void settle_guesses(ws_stream *w, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < w->gn; i++) {
        uint32_t s = w->gjobs[(w->gh + i) % w->nslots];
        xslot *x = &w->xs[s];
        if (x->layer == layer && has_id(ids, n, x->expert)) {
            w->gjobs[(w->gh + kept++) % w->nslots] = s;
            continue;
        }
        w->xmap[(uint64_t)x->layer * w->base.cfg.num_experts + x->expert] = 0;
        x->state = X_EMPTY;
        x->queued = Q_NONE;
        x->guess = 0;
        w->st.guess_dropped++;
    }
    w->gn = kept;
    for (uint32_t i = 0; i < w->npf; i++) {
        xslot *x = &w->xs[w->pf[i]];
        if (x->guess && !(x->layer == layer && has_id(ids, n, x->expert)))
            x->guess = 0;
    }
}

static void drop_pf(ws_stream *w)
{
    for (uint32_t i = 0; i < w->npf; i++)
        w->xs[w->pf[i]].ref--;
    w->npf = 0;
}

/* Take refs in pf on the first min(n, nslots) of ids, hits first so that a
 * miss never evicts a record the same call wants; misses go to w->miss. */
static void take_all(ws_stream *w, uint32_t layer, const uint32_t *ids, uint32_t n, int count)
{
    const uint32_t m = n < w->nslots ? n : w->nslots;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < m; i++) {
            if (ids[i] >= w->base.cfg.num_experts)
                continue;
            int present = w->xmap[(uint64_t)layer * w->base.cfg.num_experts + ids[i]] != 0;
            if (present != (pass == 0))
                continue;
            int s = take(w, layer, ids[i], count);
            if (s < 0)
                return;
            w->pf[w->npf++] = (uint32_t)s;
        }
}

void k3_wss_st_experts_guess(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started || !w->lay || layer >= ws->cfg.num_hidden_layers)
        return;
    pthread_mutex_lock(&w->x_mu);
    if (!w->xfailed) {
        settle_guesses(w, UINT32_MAX, NULL, 0);   /* a guess no routing came for */
        drop_pf(w);
        w->npend = 0;
        take_all(w, layer, ids, n, 0);
        for (uint32_t i = 0; i < w->nmiss; i++) {
            xslot *x = &w->xs[w->miss[i]];
            x->guess = 1;
            x->queued = Q_GUESS;
            w->gjobs[(w->gh + w->gn) % w->nslots] = w->miss[i];
            w->gn++;
        }
        w->st.guess_queued += w->nmiss;
        if (w->nmiss)
            pthread_cond_broadcast(&w->io_cv);
        w->nmiss = 0;
    }
    pthread_mutex_unlock(&w->x_mu);
}

/* ids into the order their records will be ready: held, being read, then
 * queued in read order; those beyond the cache last, as they were. */
static void ready_order(ws_stream *w, uint32_t layer, uint32_t *ids, uint32_t n)
{
    uint64_t *key = w->okey;
    for (uint32_t i = 0; i < n; i++) {
        int s = ids[i] < w->base.cfg.num_experts ? (int)w->xmap[(uint64_t)layer * w->base.cfg.num_experts + ids[i]] - 1 : -1;
        const xslot *x = s >= 0 ? &w->xs[s] : NULL;
        key[i] = !x || x->ref == 0 ? UINT64_MAX
                 : x->state != X_LOADING ? 0
                 : x->queued == Q_NONE ? 1
                 : 2 + x->qseq;
    }
    for (uint32_t i = 1; i < n; i++)   /* stable */
        for (uint32_t j = i; j > 0 && key[j - 1] > key[j]; j--) {
            uint64_t k = key[j];
            key[j] = key[j - 1];
            key[j - 1] = k;
            uint32_t t = ids[j];
            ids[j] = ids[j - 1];
            ids[j - 1] = t;
        }
}

void k3_wss_st_experts_prefetch(k3_ws *ws, uint32_t layer, uint32_t *ids, uint32_t n)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started || !w->lay || layer >= ws->cfg.num_hidden_layers)
        return;
    pthread_mutex_lock(&w->x_mu);
    if (!w->xfailed) {
        settle_guesses(w, layer, ids, n);
        drop_pf(w);
        take_all(w, layer, ids, n, 1);
        /* the right guesses not read yet: now the model waits for them */
        for (uint32_t i = 0; i < w->gn; i++)
            w->miss[w->nmiss++] = w->gjobs[(w->gh + i) % w->nslots];
        w->gn = 0;
        flush_misses(w);
        ready_order(w, layer, ids, n);
        /* those without a ref come last, as they were: read as slots free */
        w->npend = w->pend_next = 0;
        w->pend_layer = layer;
        for (uint32_t i = 0; i < n; i++)
            if (w->okey[i] == UINT64_MAX && ids[i] < ws->cfg.num_experts)
                w->pend[w->npend++] = ids[i];
    }
    pthread_mutex_unlock(&w->x_mu);
}

/* Refs on the layer's pending experts, in order, while a slot can be had
 * without waiting (x_mu held): each record read ahead of its acquire, as
 * prefetch reads the first cache-full. */
static void read_ahead(ws_stream *w, uint32_t layer)
{
    if (w->pend_layer != layer)
        return;
    while (w->pend_next < w->npend && w->npf < w->nslots) {
        int s = take(w, layer, w->pend[w->pend_next], 1);
        if (s < 0)
            break;
        w->pf[w->npf++] = (uint32_t)s;
        w->pend_next++;
        w->st.read_ahead++;
    }
    flush_misses(w);
}

/* The planned slot count once planned (plan before k3_model_open to let the
 * model ask for whole cache-fulls), top-k before (the floor's slot count). */
uint32_t k3_wss_st_batch_max(k3_ws *ws)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->nslots)
        return w->nslots;
    if (w->planned && w->plan.expert_slots)
        return w->plan.expert_slots;
    return ws->cfg.num_experts_per_token ? ws->cfg.num_experts_per_token : 1;
}

int k3_wss_st_experts_acquire(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out,
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
     * the layer's later batches (dropped when a slot is needed). A pending
     * expert asked for is taken here, and those before it were */
    w->nheld = 0;
    for (uint32_t i = 0; i < n && w->pend_layer == layer; i++)
        for (uint32_t j = w->pend_next; j < w->npend; j++)
            if (w->pend[j] == ids[i]) {
                w->pend_next = j + 1;
                break;
            }
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

void k3_wss_st_experts_release(k3_ws *ws, uint32_t layer)
{
    ws_stream *w = (ws_stream *)ws;
    if (!w->started || !w->lay)
        return;
    pthread_mutex_lock(&w->x_mu);
    for (uint32_t i = 0; i < w->nheld; i++)
        if (w->held[i] != UINT32_MAX)
            w->xs[w->held[i]].ref--;
    w->nheld = 0;
    if (!w->xfailed)
        read_ahead(w, layer);
    pthread_cond_broadcast(&w->x_cv);
    pthread_mutex_unlock(&w->x_mu);
}
