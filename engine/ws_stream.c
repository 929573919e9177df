/*
 * ws_stream.c - the streaming weight source (k3_stream.h): a packed model
 * run in a RAM budget.
 *
 * Owns: the k3_pk handle; the pinned arena (whole trunk groups read once at
 * start); the ring arena with its FIFO of regions and the two reader threads; the
 * expert slot arena with its LRU table and the pool of I/O threads; the
 * trace file; the counters.
 *
 * Ring invariants (ring_mu):
 *   - the FIFO q[qh..qh+qn) lists regions in the order the readers took
 *     them (one position, w->next, shared: items are taken in order);
 *     regions never overlap; a region is READING (the reader that took it
 *     writes it, no one else touches it), READY, INUSE (the model holds it:
 *     only the FIFO head can be INUSE) or ERROR; with two readers two
 *     regions can be READING at once, and a later one may be READY first;
 *   - a reader only writes a region it has just allocated from bytes no
 *     FIFO entry covers, so a region queued or in use is never overwritten;
 *   - a group's CRC pass (its parts' CRCs, folded per unit) starts when its
 *     core is taken, and only once none of the group's regions is READING;
 *     parts are set and folded under ring_mu;
 *   - the model consumes in FIFO order: acquire(g) drops READY/ERROR heads
 *     that are not g (a prediction miss: e.g. the head group is skipped when
 *     no logits are asked), waits for a READING head, and resynchronises the
 *     reader's position when the FIFO is empty.
 * Expert invariants (x_mu): a slot is EMPTY, LOADING (one I/O thread writes
 * it) or READY; xmap maps (layer, expert) to the slot holding or loading it;
 * a slot with ref > 0 or LOADING is never evicted; refs are held from
 * prefetch/acquire to release. The experts a layer needs beyond what
 * prefetch could take (the cache is smaller than its union) are taken in the
 * model's order as releases free slots, so their reads run while the
 * experts before them compute. A LOADING slot is queued on demand (jobs),
 * queued on a guess (gjobs) or being read; only one queued on a guess and
 * not named by its layer's routing is dropped unread (back to EMPTY).
 * Every record is CRC32-checked by
 * k3_pk_read_record before its slot becomes READY. Any read error is sticky:
 * every later call fails with the first error.
 */
#include "ws_stream_int.h"

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

/* -------------------------------------------------------------- life */

static void st_close(k3_ws *ws)
{
    ws_stream *w = (ws_stream *)ws;
    if (w->reader_on) {
        pthread_mutex_lock(&w->ring_mu);
        w->stop = 1;
        pthread_cond_broadcast(&w->ring_cv);
        pthread_mutex_unlock(&w->ring_mu);
        for (uint32_t i = 0; i < w->reader_on; i++)
            pthread_join(w->reader[i], NULL);
    }
    if (w->io_on) {   /* after the readers: they may be waiting for chunks */
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
    for (uint32_t i = 0; i < NREADERS; i++)
        free(w->tb[i].tc);
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
            for (uint32_t j = 0; j < w->grp[g].nlz; j++)
                free(w->grp[g].lz[j].prow);
        }
    free(w->grp);
    free(w->tmpl);
    free(w->order);
    free(w->pos);
    free(w->io);
    free(w->xs);
    free(w->xmap);
    free(w->jobs);
    free(w->gjobs);
    free(w->okey);
    free(w->pend);
    free(w->held);
    free(w->pf);
    free(w->miss);
    free(w->rowbuf);
    free(w->dsend);
    free(w->drecv);
    k3_io_free_aligned(w->bounce);
    k3_pk_close(w->pk);
    free(w);
}

static const k3_ws_ops stream_ops = {
    "stream", k3_wss_st_describe, k3_wss_st_acquire, k3_wss_st_release, k3_wss_st_embed,
    k3_wss_st_batch_max, k3_wss_st_experts_acquire, k3_wss_st_experts_release, st_close, k3_wss_st_experts_prefetch,
    k3_wss_st_rows_acquire, k3_wss_st_rows_release, k3_wss_st_status, k3_wss_st_dist_check,
    k3_wss_st_experts_guess,
};

/* Started with expert_guess 0: no experts_guess, so the model routes no guess. */
static const k3_ws_ops stream_ops_no_guess = {
    "stream", k3_wss_st_describe, k3_wss_st_acquire, k3_wss_st_release, k3_wss_st_embed,
    k3_wss_st_batch_max, k3_wss_st_experts_acquire, k3_wss_st_experts_release, st_close, k3_wss_st_experts_prefetch,
    k3_wss_st_rows_acquire, k3_wss_st_rows_release, k3_wss_st_status, k3_wss_st_dist_check, NULL,
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
    if (w->sync_on)
        k3_wss_io_count(w);
    *st = w->st;
    st->trunk_bytes = w->st.trunk_stream_bytes + w->st.pinned_bytes + w->st.embed_bytes;
    if (w->sync_on) {
        pthread_mutex_unlock(&w->x_mu);
        pthread_mutex_unlock(&w->ring_mu);
    }
}

/* The pieces of a streamed matrix: chunk_rows rows each, and over several
 * ranks cut at every rank's range too, so that each piece is one rank's. */
static int cut_pieces(lazyt *L)
{
    const k3_dist *d = k3_dist_get();
    const uint32_t N = d ? d->size : 1, me = d ? d->rank : 0;
    uint64_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        n = 0;
        for (uint32_t q = 0; q < N; q++) {
            uint64_t lo = 0, hi = L->rows;
            if (d)
                k3_dist_rows(L->rows, q, N, &lo, &hi);
            if (pass && q == me)
                L->c0 = (uint32_t)n;
            for (uint64_t r = lo; r < hi; r += L->chunk_rows) {
                if (pass)
                    L->prow[n] = r;
                n++;
            }
            if (pass && q == me)
                L->c1 = (uint32_t)n;
        }
        if (!pass && !(L->prow = malloc((n + 1) * sizeof *L->prow)))
            return -1;
    }
    L->prow[n] = L->rows;
    L->nchunks = (uint32_t)n;
    return 0;
}

/* The rank that reads piece c of L (-1 in one process). */
static int32_t piece_rank(const lazyt *L, uint32_t c)
{
    const k3_dist *d = k3_dist_get();
    if (!d)
        return -1;
    for (uint32_t q = 0; q < d->size; q++) {
        uint64_t lo, hi;
        k3_dist_rows(L->rows, q, d->size, &lo, &hi);
        if (L->prow[c] >= lo && L->prow[c] < hi)
            return (int32_t)q;
    }
    return -1;
}

/* Split group g into a core and pieces of at most piece bytes for every
 * lazy-capable matrix larger than that (none if piece == 0). */
static int layout_group(ws_stream *w, uint32_t g, uint64_t piece, k3_err *e)
{
    grp *G = &w->grp[g];
    /* a plan made again (k3_engine tries longer chunks first) starts over */
    free(G->parts), free(G->segs), free(G->unit_part0), free(G->unit_done);
    G->parts = NULL, G->segs = NULL, G->unit_part0 = NULL, G->unit_done = NULL;
    for (uint32_t j = 0; j < G->nlz; j++) {
        free(G->lz[j].prow);
        G->lz[j].prow = NULL;
    }
    G->nlz = G->nsegs = G->nparts = 0;
    G->core = 0;
    memset(G->cok, 0, sizeof G->cok);
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
        if (cut_pieces(L) < 0)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
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
                G->parts[G->nparts].rank = -1;
                G->parts[G->nparts++].b = stop;
            }
            if (nj < 0)
                break;
            lazyt *L = &G->lz[nj];
            L->part0 = G->nparts;
            for (uint32_t c = 0; c < L->nchunks; c++) {
                uint64_t a, b;
                k3_wss_piece_range(G, (uint32_t)nj, c, &a, &b);
                G->parts[G->nparts].a = a;
                G->parts[G->nparts].rank = piece_rank(L, c);
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
        at += G->lz[j].c1 - G->lz[j].c0;
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
                if (k3_wss_piece_region(&w->grp[g], j, k) > pmax)
                    pmax = k3_wss_piece_region(&w->grp[g], j, k);
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
    if (!o->expert_guess)
        w->base.ops = &stream_ops_no_guess;
    const k3_cfg *c = &ws->cfg;
    const k3_stream_plan *p = &w->plan;
    /* counters and tables first (small), then the arenas */
    uint64_t nitems = 0;
    for (uint32_t g = 0; g < w->ng; g++)
        if (!p->pinned[g]) {
            nitems++;
            for (uint32_t j = 0; j < w->grp[g].nlz; j++)
                nitems += w->grp[g].lz[j].c1 - w->grp[g].lz[j].c0;
        }
    w->order = calloc(nitems + 1, sizeof *w->order);
    w->pos = calloc(w->ng, sizeof *w->pos);
    if (!w->order || !w->pos)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    const k3_dist *d = k3_dist_get();
    if (d) {   /* the piece CRCs of a group (k3_wss_st_dist_check) */
        uint64_t most = 0;
        for (uint32_t g = 0; g < w->ng; g++)
            most = w->grp[g].nparts > most ? w->grp[g].nparts : most;
        w->dsend = malloc(sizeof(k3_dist_status) + 4 * most + 8);   /* + rounding to 8 (k3_dist_gather) */
        w->drecv = malloc(d->size * (sizeof(k3_dist_status) + 8) + 4 * most);
        if (!w->dsend || !w->drecv)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    for (uint32_t g = 0; g < w->ng; g++)
        if (!p->pinned[g]) {
            w->pos[g] = w->norder;
            w->order[w->norder++] = (item){g, -1, 0};
            for (uint32_t j = 0; j < w->grp[g].nlz; j++)
                for (uint32_t k = w->grp[g].lz[j].c0; k < w->grp[g].lz[j].c1; k++)
                    w->order[w->norder++] = (item){g, (int32_t)j, k};   /* this rank's pieces */
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
    int bad = !w->io;
    for (uint32_t i = 0; i < NREADERS; i++) {
        w->tb[i].tc = calloc(w->tc_cap + 1, sizeof *w->tb[i].tc);
        bad |= !w->tb[i].tc;
    }
    if (bad)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    if (w->lay) {
        w->nslots = p->expert_slots;
        w->cyclic = (uint64_t)w->nslots <
                    (uint64_t)(c->num_hidden_layers - c->first_k_dense_replace) * c->num_experts_per_token;
        w->xs = calloc(w->nslots, sizeof *w->xs);
        w->xmap = calloc((uint64_t)c->num_hidden_layers * c->num_experts, sizeof *w->xmap);
        w->jobs = calloc(w->nslots, sizeof *w->jobs);
        w->gjobs = calloc(w->nslots, sizeof *w->gjobs);
        w->held = calloc(w->nslots, sizeof *w->held);
        w->pf = calloc(w->nslots, sizeof *w->pf);
        w->miss = calloc(w->nslots, sizeof *w->miss);
        w->okey = calloc(c->num_experts, sizeof *w->okey);
        w->pend = calloc(c->num_experts, sizeof *w->pend);
        if (!w->xs || !w->xmap || !w->jobs || !w->gjobs || !w->held || !w->pf || !w->miss || !w->okey || !w->pend)
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
    w->io_t = now_s();
    for (uint32_t i = 0; i < w->nio; i++) {
        if (pthread_create(&w->io[i], NULL, k3_wss_io_main, w) != 0)
            return k3_err_set(e, K3_ENOMEM, "cannot start an I/O thread");
        w->io_on++;
    }
    w->threads_on = 1;
    double t0 = now_s();
    uint64_t at = 0;
    for (uint32_t g = 0; g < w->ng; g++)
        if (p->pinned[g]) {
            w->grp[g].pinned = w->pin_arena + at;
            rc = k3_wss_read_group(w, &w->tb[0], g, w->grp[g].pinned, 1, e);
            if (rc < 0)
                return rc;
            at += w->grp[g].bytes;
            w->st.pinned_bytes += w->grp[g].bytes;
        }
    w->st.load_s = now_s() - t0;
    for (uint32_t i = 0; i < NREADERS && w->norder; i++) {
        w->rarg[i] = (reader_arg){w, i};
        if (pthread_create(&w->reader[i], NULL, k3_wss_reader_main, &w->rarg[i]) != 0)
            return k3_err_set(e, K3_ENOMEM, "cannot start a reader thread");
        w->reader_on++;
    }
    w->started = 1;
    return 0;
}

int k3_ws_stream_foreign(const char *dir, uint32_t ranks, uint32_t rank, uint64_t piece,
                         void (*cb)(void *arg, uint32_t file, uint64_t a, uint64_t b), void *arg, k3_err *e)
{
    if (ranks < 2 || ranks > K3_DIST_MAX_RANKS || rank >= ranks)
        return k3_err_set(e, K3_EARG, "rank %u of %u ranks: expected 2 to %u ranks and a rank below them", rank,
                          ranks, K3_DIST_MAX_RANKS);
    /* the layout of rank `rank` is cut as that rank's own run cuts it */
    k3_dist as_rank = {NULL, rank, ranks, 0, {0}, NULL}, *was = k3_dist_get();
    k3_dist_set(&as_rank);
    k3_ws *ws;
    int rc = k3_ws_stream_open(&ws, dir, 0, e);
    if (rc == 0) {
        ws_stream *w = (ws_stream *)ws;
        for (uint32_t g = 0; g < w->ng && rc == 0; g++) {
            rc = layout_group(w, g, piece, e);
            const grp *G = &w->grp[g];
            for (uint32_t j = 0; j < G->nlz && rc == 0; j++)
                for (uint32_t c = 0; c < G->lz[j].nchunks; c++)
                    if (c < G->lz[j].c0 || c >= G->lz[j].c1) {
                        uint64_t a, b;
                        k3_wss_piece_range(G, j, c, &a, &b);
                        cb(arg, G->lz[j].file, a, b);
                    }
        }
        k3_ws_close(ws);
    }
    k3_dist_set(was);
    return rc;
}
