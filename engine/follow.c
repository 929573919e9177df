/*
 * follow.c - rank 0's orders and the follower ranks' loop (follow.h,
 * docs/DIST.md).
 *
 * An order is a k3_order header broadcast from rank 0, then its payload (a
 * second broadcast when it has one). A follower waits for the next header
 * without a time limit (rank 0 may be waiting for a user), carries the
 * order out with the same engine calls rank 0 makes, and goes back to
 * waiting until K3_ORD_EXIT. Engines and sequences are named by numbers
 * rank 0 hands out (k3_order_id) and every follower gives its own to the
 * same number.
 *
 * Payloads: OPEN the options (open_msg) and the three strings (model
 * directory, --ram, tokenizer directory) end to end; PLAN a k3_engine_size
 * (b = 1) or nothing; SEQ_LOAD the state bytes; FORWARD per entry {sequence,
 * token count, logits mode} and then every entry's ids.
 */
#include <stdlib.h>
#include <string.h>

#include "follow.h"
#include "model_int.h"

static int depth;             /* rank 0: orders being carried out (nesting) */
static uint32_t next_id = 1;  /* rank 0: the next number; a follower: the order's */

uint32_t k3_order_id(void)
{
    k3_dist *d = k3_dist_get();
    return d && d->rank != 0 ? next_id : next_id++;
}

static int send(k3_dist *d, const k3_order *o, const void *payload, k3_err *e)
{
    k3_order h = *o;
    d->st.commands++;
    d->st.collectives++;
    int rc = d->ops->bcast(d, &h, sizeof h, 0, e);
    if (rc == 0 && o->len) {
        d->st.collectives++;
        d->st.bytes_out += o->len;
        rc = d->ops->bcast(d, (void *)payload, o->len, 0, e);
    }
    return rc;
}

int k3_order_begin(k3_dist *d, const k3_order *o, const void *payload, int *sent, k3_err *e)
{
    *sent = 0;
    if (!d || d->rank != 0 || depth++ > 0)
        return 0;
    *sent = 1;
    return send(d, o, payload, e);
}

int k3_order_end(k3_dist *d, int sent, int agree, int code, uint32_t value, const char *what, k3_err *e)
{
    if (d && agree)
        code = k3_dist_agree(d, code, e, value, what, e);
    (void)sent;
    if (d && d->rank == 0)
        depth--;
    return code;
}

typedef struct fwd_entry {
    uint32_t seq, n, logits, pad;
} fwd_entry;

int k3_order_forward(k3_model *m, const k3_model_seq *q, uint32_t n, k3_err *e)
{
    k3_dist *d = m->dist;
    if (!d || d->rank != 0 || depth > 0)
        return 0;
    uint64_t nid = 0;
    for (uint32_t i = 0; i < n; i++)
        nid += q[i].n;
    const uint64_t len = n * sizeof(fwd_entry) + nid * sizeof(uint32_t);
    uint8_t *p = malloc(len ? len : 1);
    if (!p)
        return k3_err_set(e, K3_ENOMEM, "out of memory sending a batch to the other ranks");
    fwd_entry *fe = (fwd_entry *)p;
    uint32_t *ids = (uint32_t *)(p + n * sizeof(fwd_entry));
    for (uint32_t i = 0; i < n; i++) {
        fe[i] = (fwd_entry){q[i].s->dist_id, q[i].n, (uint32_t)q[i].logits, 0};
        memcpy(ids, q[i].ids, q[i].n * sizeof(uint32_t));
        ids += q[i].n;
    }
    int rc = send(d, &(k3_order){K3_ORD_FORWARD, m->dist_id, n, 0, len}, p, e);
    free(p);
    return rc;
}

/* ------------------------------------------------------------ follower */

#define MAX_ENGINES 64

/* A follower's engine and the option strings it borrows. */
typedef struct fengine {
    uint32_t id;
    k3_engine *en;
    char *strings;
} fengine;

typedef struct open_msg {
    uint32_t threads, max_chunk, chunk_auto, trunk_crc;
    uint64_t piece_bytes;
    uint32_t len[3];           /* model directory, --ram, tokenizer directory (0: none) */
    uint32_t expert_guess;
} open_msg;

/* Rank 0's k3_engine_open: the order, with its options. */
int k3_order_open(k3_dist *d, uint32_t id, const char *dir, const k3_engine_opts *o, int *sent, k3_err *e)
{
    *sent = 0;
    if (!d || d->rank != 0 || depth > 0)
        return k3_order_begin(d, &(k3_order){0}, NULL, sent, e);
    const char *s[3] = {dir, o->ram, o->tok_dir};
    open_msg om = {o->threads, o->max_chunk, (uint32_t)o->chunk_auto, (uint32_t)o->trunk_crc, o->piece_bytes,
                   {0, 0, 0}, (uint32_t)o->expert_guess};
    uint64_t len = sizeof om;
    for (int i = 0; i < 3; i++) {
        om.len[i] = s[i] ? (uint32_t)strlen(s[i]) + 1 : 0;
        len += om.len[i];
    }
    uint8_t *p = malloc(len);
    if (!p)
        return k3_err_set(e, K3_ENOMEM, "out of memory sending the options to the other ranks");
    memcpy(p, &om, sizeof om);
    uint64_t off = sizeof om;
    for (int i = 0; i < 3; i++) {
        memcpy(p + off, s[i] ? s[i] : "", om.len[i]);
        off += om.len[i];
    }
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_OPEN, id, 0, 0, len}, p, sent, e);
    free(p);
    return rc;
}

static fengine *find_engine(fengine *t, uint32_t id)
{
    for (int i = 0; i < MAX_ENGINES; i++)
        if (t[i].en && t[i].id == id)
            return &t[i];
    return NULL;
}

static int do_open(fengine *t, const k3_order *o, uint8_t *p, k3_err *e)
{
    open_msg om;
    if (o->len < sizeof om)
        return k3_err_set(e, K3_EINTERNAL, "an open order of %llu bytes", (unsigned long long)o->len);
    memcpy(&om, p, sizeof om);
    uint64_t need = sizeof om + (uint64_t)om.len[0] + om.len[1] + om.len[2];
    if (need != o->len || !om.len[0])
        return k3_err_set(e, K3_EINTERNAL, "an open order that does not add up");
    char *s[3] = {NULL, NULL, NULL};
    uint64_t off = sizeof om;
    for (int i = 0; i < 3; i++) {
        if (om.len[i]) {
            s[i] = (char *)p + off;
            s[i][om.len[i] - 1] = 0;
        }
        off += om.len[i];
    }
    fengine *slot = NULL;
    for (int i = 0; i < MAX_ENGINES && !slot; i++)
        if (!t[i].en)
            slot = &t[i];
    k3_engine_opts eo;
    k3_engine_opts_init(&eo);
    eo.threads = om.threads;
    eo.max_chunk = om.max_chunk;
    eo.chunk_auto = (int)om.chunk_auto;
    eo.trunk_crc = (int)om.trunk_crc;
    eo.expert_guess = (int)om.expert_guess;
    eo.piece_bytes = om.piece_bytes;
    eo.ram = s[1];
    eo.tok_dir = s[2];
    next_id = o->engine;
    k3_engine *en = NULL;
    int rc = k3_engine_open(&en, s[0], &eo, e);   /* agreed inside */
    if (rc < 0)
        return rc;
    if (!slot) {
        k3_engine_close(en);
        return k3_err_set(e, K3_ELIMIT, "more than %d engines open at once", MAX_ENGINES);
    }
    slot->id = o->engine;
    slot->en = en;
    slot->strings = (char *)p;   /* the engine borrows the strings */
    return 1;
}

static int do_forward(k3_engine *en, const k3_order *o, const uint8_t *p, k3_err *e)
{
    const uint32_t n = o->a;
    const fwd_entry *fe = (const fwd_entry *)p;
    if (o->len < (uint64_t)n * sizeof *fe)
        return k3_err_set(e, K3_EINTERNAL, "a batch order too short");
    k3_model_seq *q = calloc(n ? n : 1, sizeof *q);
    if (!q)
        return k3_err_set(e, K3_ENOMEM, "out of memory for a batch of %u entries", n);
    const uint32_t *ids = (const uint32_t *)(p + n * sizeof *fe);
    int rc = 0;
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        k3_seq *s = k3_engine_seq_find(en, fe[i].seq);
        if (!s)
            rc = k3_err_set(e, K3_EINTERNAL, "a batch for sequence %u, which this rank does not have", fe[i].seq);
        else
            q[i] = (k3_model_seq){k3_seq_sess(s), ids, fe[i].n, (int)fe[i].logits, NULL};
        ids += fe[i].n;
    }
    /* a failure here is every rank's (agreed inside the pass) */
    if (rc == 0)
        rc = k3_model_forward_batch(k3_engine_model(en), q, n, e);
    free(q);
    return rc;
}

/* One order: 0 done (an error of it is rank 0's to report), 1 the payload
 * is kept, -1 K3_ORD_EXIT. */
static int carry_out(fengine *t, const k3_order *o, uint8_t *p, k3_err *e)
{
    if (o->op == K3_ORD_EXIT)
        return -1;
    if (o->op == K3_ORD_OPEN)
        return do_open(t, o, p, e) == 1 ? 1 : 0;
    fengine *fe = find_engine(t, o->engine);
    if (!fe)   /* an engine that failed to open here never gets orders: a bug */
        return k3_err_set(e, K3_EINTERNAL, "order %u for engine %u, which this rank does not have", o->op,
                          o->engine), 0;
    k3_engine *en = fe->en;
    k3_seq *s = NULL;
    switch (o->op) {
    case K3_ORD_PLAN: {
        k3_engine_size sz;
        if (o->b && o->len == sizeof sz)
            memcpy(&sz, p, sizeof sz);
        k3_engine_plan(en, o->b ? &sz : NULL, NULL, e);
        break;
    }
    case K3_ORD_LOAD:
        k3_engine_load(en, e);
        break;
    case K3_ORD_CLOSE:
        k3_engine_close(en);
        free(fe->strings);
        memset(fe, 0, sizeof *fe);
        break;
    case K3_ORD_SEQ_NEW:
        next_id = o->a;
        k3_seq_create(&s, en, o->b, e);
        break;
    case K3_ORD_SEQ_FREE:
        k3_seq_free(k3_engine_seq_find(en, o->a));
        break;
    case K3_ORD_SEQ_RESET:
        if ((s = k3_engine_seq_find(en, o->a)))
            k3_seq_reset(s);
        break;
    case K3_ORD_SEQ_COPY: {
        k3_seq *dst = k3_engine_seq_find(en, o->a), *src = k3_engine_seq_find(en, o->b);
        if (dst && src)
            k3_seq_copy(dst, src, e);
        else
            k3_order_end(k3_dist_get(), 0, 1, k3_err_set(e, K3_EINTERNAL, "a copy of a sequence this rank "
                                                          "does not have"), 0, NULL, e);
        break;
    }
    case K3_ORD_SEQ_LOAD:
        if ((s = k3_engine_seq_find(en, o->a)))
            k3_seq_state_load(s, p, o->len, e);
        else
            k3_order_end(k3_dist_get(), 0, 1, k3_err_set(e, K3_EINTERNAL, "a state for a sequence this rank "
                                                          "does not have"), 0, NULL, e);
        break;
    case K3_ORD_FORWARD:
        do_forward(en, o, p, e);
        break;
    default:
        k3_err_set(e, K3_EINTERNAL, "unknown order %u", o->op);
    }
    return 0;
}

int k3_follow_stop(k3_dist *d, k3_err *e) { return send(d, &(k3_order){K3_ORD_EXIT, 0, 0, 0, 0}, NULL, e); }

int k3_follow(k3_dist *d, k3_err *e)
{
    fengine t[MAX_ENGINES];
    memset(t, 0, sizeof t);
    int rc = 0;
    for (;;) {
        k3_order o;
        if ((rc = d->ops->bcast(d, &o, sizeof o, 1, e)) < 0)
            break;
        uint8_t *p = NULL;
        if (o.len) {
            if (!(p = malloc(o.len))) {
                /* without the payload this rank cannot stay in step */
                rc = k3_err_set(e, K3_ENOMEM, "out of memory for an order of %llu bytes",
                                (unsigned long long)o.len);
                break;
            }
            if ((rc = d->ops->bcast(d, p, o.len, 0, e)) < 0) {
                free(p);
                break;
            }
            d->st.bytes_in += o.len;
        }
        k3_err oe;
        k3_err_clear(&oe);
        int r = carry_out(t, &o, p, &oe);
        if (r != 1)
            free(p);
        if (r < 0)
            break;
    }
    for (int i = 0; i < MAX_ENGINES; i++)
        if (t[i].en) {
            k3_engine_close(t[i].en);
            free(t[i].strings);
        }
    return rc;
}
