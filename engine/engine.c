/*
 * engine.c - the engine API (k3_engine.h) over a weight source and the
 * forward pass: opening (source, tokenizer, budget), planning, loading,
 * sequences and the step.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include <cjson/cJSON.h>

#include "follow.h"
#include "k3_dist.h"
#include "k3_engine.h"
#include "k3_gen.h"
#include "k3_io.h"
#include "k3_man.h"
#include "k3_mem.h"
#include "k3_model.h"
#include "k3_pk.h"
#include "k3_stream.h"
#include "k3_ws.h"

struct k3_seq {
    k3_engine *en;
    k3_sess *s;
    k3_seq *next, *prev;   /* the engine's live sequences */
    uint32_t mark;         /* step duplicate check */
    uint64_t bytes;        /* what its state takes (k3_engine_mem) */
    uint32_t id;           /* its number in rank 0's orders (follow.h) */
};

struct k3_engine {
    k3_engine_opts o;
    char dir[4096];
    k3_ws *ws;
    k3_model *m;
    k3_tok *tok;
    int streams, from_layout, fell_to_floor, planned, loaded;
    uint64_t budget, layout_budget;
    k3_engine_size sz;
    k3_stream_opts so;
    k3_stream_plan plan;
    k3_seq *seqs;
    uint32_t nseqs;        /* live sequences */
    k3_model_seq *batch;   /* a step's entries: room for every live sequence */
    uint32_t batch_cap;
    uint64_t seq_live;     /* bytes of the live sequences (streamed: within the plan) */
    uint32_t mark;
    uint32_t id;           /* its number in rank 0's orders (follow.h) */
    int slice;             /* a rank's slice (k3-pack --ranks): nothing pinned */
};

void k3_engine_opts_init(k3_engine_opts *o)
{
    memset(o, 0, sizeof *o);
    o->piece_bytes = K3_STREAM_PIECE_DEFAULT;
    o->trunk_crc = 1;
    o->expert_guess = 1;
}

/* ------------------------------------------------------------- opening */

static int has_manifest(const char *dir)
{
    char mp[4096];
    struct stat st;
    return k3_io_path_join(mp, sizeof mp, dir, "manifest.json", NULL) == 0 && stat(mp, &st) == 0;
}

/* The manifest's plan object (parsed, the caller deletes it), NULL when
 * there is no manifest or it cannot be read: that is left for the packed
 * source to report. */
static cJSON *manifest_plan(const char *dir)
{
    char mp[4096];
    char *txt = NULL;
    if (k3_io_path_join(mp, sizeof mp, dir, "manifest.json", NULL) < 0 || access(mp, F_OK) != 0 ||
        k3_io_read_file(mp, 64u << 20, &txt, NULL, NULL) < 0)
        return NULL;
    cJSON *root = cJSON_Parse(txt);
    free(txt);
    cJSON *plan = cJSON_DetachItemFromObjectCaseSensitive(root, "plan");
    cJSON_Delete(root);
    return plan;
}

/* The budget a k3-pack layout was made for (plan.k3_run.ram, when
 * plan.k3_run.streams): 1 and *budget set if there is one. */
static int layout_budget(const cJSON *plan, uint64_t *budget)
{
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(plan, "k3_run");
    const cJSON *streams = cJSON_GetObjectItemCaseSensitive(run, "streams");
    const cJSON *ram = cJSON_GetObjectItemCaseSensitive(run, "ram");
    if (!cJSON_IsTrue(streams) || !cJSON_IsNumber(ram) || ram->valuedouble < 1 || ram->valuedouble >= 0x1p63)
        return 0;
    *budget = (uint64_t)ram->valuedouble;
    return 1;
}

/* A rank's slice (k3-pack --ranks, plan.slice): 1 and its ranks, rank and
 * row piece if the plan says the model is one. */
static int slice_of(const cJSON *plan, uint32_t *ranks, uint32_t *rank, uint64_t *piece)
{
    const cJSON *sl = cJSON_GetObjectItemCaseSensitive(plan, "slice");
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(sl, "ranks"), *r = cJSON_GetObjectItemCaseSensitive(sl, "rank"),
                *p = cJSON_GetObjectItemCaseSensitive(sl, "piece_bytes");
    if (!cJSON_IsNumber(n) || !cJSON_IsNumber(r) || !cJSON_IsNumber(p) || n->valuedouble < 2 ||
        n->valuedouble > K3_DIST_MAX_RANKS || r->valuedouble < 0 || r->valuedouble >= n->valuedouble ||
        p->valuedouble < 1 || p->valuedouble >= 0x1p63)
        return 0;
    *ranks = (uint32_t)n->valuedouble;
    *rank = (uint32_t)r->valuedouble;
    *piece = (uint64_t)p->valuedouble;
    return 1;
}

static int has_tokenizer(const char *dir)
{
    char p[4096];
    if (!dir || k3_io_path_join(p, sizeof p, dir, "tiktoken.model", NULL) < 0)
        return 0;
    return access(p, R_OK) == 0;
}

int k3_engine_tok_open(k3_tok **tok, const char *dir, k3_err *e)
{
    char mp[4096];
    if (!has_manifest(dir) || k3_io_path_join(mp, sizeof mp, dir, "manifest.json", e) < 0)
        return k3_tok_open(tok, dir, e);
    char *txt;
    uint64_t len;
    k3_man m;
    memset(&m, 0, sizeof m);
    int rc = k3_io_read_file(mp, K3_MAN_MAX_BYTES, &txt, &len, e);
    if (rc)
        return rc;
    rc = k3_man_parse(&m, txt, len, mp, e);
    free(txt);
    if (rc == 0) {
        const uint8_t *sha[2] = {NULL, NULL};
        for (uint32_t i = 0; i < m.nfiles; i++)
            if (m.files[i].kind == K3_PK_FILE_TOKENIZER)
                for (int k = 0; k < 2; k++)
                    if (!strcmp(m.files[i].name, k ? "tokenizer_config.json" : "tiktoken.model"))
                        sha[k] = m.files[i].sha256;
        rc = k3_tok_open_checked(tok, dir, sha[0], sha[1], e);
    }
    k3_man_free(&m);
    return rc;
}

/* The tokenizer: opts.tok_dir if given (it must hold one), else the model's
 * own when it has one, compared with the SHA-256 its manifest records. */
static int open_tok(k3_engine *en, k3_err *e)
{
    k3_ws *ws = en->ws;
    const char *tok_dir = en->o.tok_dir;
    const char *tdir = tok_dir ? tok_dir : ws->tok_dir[0] ? ws->tok_dir : NULL;
    if (tdir && has_tokenizer(tdir)) {
        int own = ws->tok_dir[0] && !strcmp(tdir, ws->tok_dir);
        return own ? k3_tok_open_checked(&en->tok, tdir, ws->tok_sha256[0], ws->tok_sha256[1], e)
                   : k3_tok_open(&en->tok, tdir, e);
    }
    if (tok_dir)
        return k3_err_set(e, K3_ENOENT, "%s: no tiktoken.model", tok_dir);
    return 0;
}

static int engine_open(k3_engine **out, const char *dir, const k3_engine_opts *o, k3_err *e);

int k3_engine_open(k3_engine **out, const char *dir, const k3_engine_opts *o, k3_err *e)
{
    *out = NULL;
    k3_dist *d = k3_dist_get();
    k3_engine_opts dflt;
    k3_engine_opts_init(&dflt);
    const uint32_t id = k3_order_id();
    int sent;
    int rc = k3_order_open(d, id, dir, o ? o : &dflt, &sent, e);
    if (rc == 0)
        rc = engine_open(out, dir, o, e);
    if (d) {
        rc = k3_dist_agree(d, rc, e, 0, NULL, e);
        if (rc < 0 && *out) {
            k3_engine_close(*out);   /* inside the order: every rank closes its own */
            *out = NULL;
        }
    }
    if (*out)
        (*out)->id = id;
    return k3_order_end(d, sent, 0, rc, 0, NULL, e);
}

static int engine_open(k3_engine **out, const char *dir, const k3_engine_opts *o, k3_err *e)
{
    *out = NULL;
    k3_engine *en = calloc(1, sizeof *en);
    if (!en)
        return k3_err_set(e, K3_ENOMEM, "out of memory opening the engine");
    if (o)
        en->o = *o;
    else
        k3_engine_opts_init(&en->o);
    snprintf(en->dir, sizeof en->dir, "%s", dir);
    if (en->o.threads)
        omp_set_num_threads((int)en->o.threads);
    if (!en->o.max_chunk)
        en->o.max_chunk = 64;
    int rc = 0;
    cJSON *plan = manifest_plan(dir);   /* read once: a layout's budget, a rank's slice */
    if (en->o.ram) {
        en->streams = 1;
        rc = k3_stream_parse_budget(en->o.ram, &en->budget, e);
    } else if (layout_budget(plan, &en->layout_budget)) {
        /* a model laid out by k3-pack streams by default within the budget
         * it was packed for */
        en->streams = en->from_layout = 1;
        en->budget = en->layout_budget;
    }
    uint32_t sl_ranks, sl_rank;
    uint64_t sl_piece;
    if (rc == 0 && slice_of(plan, &sl_ranks, &sl_rank, &sl_piece)) {
        /* a rank's slice: only that rank, streamed in pieces no larger than
         * the slice was cut for, nothing pinned (its groups have holes) */
        const k3_dist *d = k3_dist_get();
        if (!d || d->size != sl_ranks || d->rank != sl_rank)
            rc = k3_err_set(e, K3_EARG, "%s is the slice of rank %u of %u ranks (k3-pack --ranks): it runs only as "
                            "rank %u of a %u-rank k3-run-mpi or k3-serve-mpi job", dir, sl_rank, sl_ranks, sl_rank,
                            sl_ranks);
        if (!en->streams) {
            en->streams = 1;
            en->budget = K3_STREAM_FLOOR;
        }
        if (!en->o.piece_bytes || en->o.piece_bytes > sl_piece)
            en->o.piece_bytes = sl_piece;
        en->slice = 1;
    }
    cJSON_Delete(plan);
    if (rc == 0 && en->streams) {
        if (!has_manifest(dir))
            rc = k3_err_set(e, K3_EARG, "--ram needs a packed model (k3-convert): %s has no manifest.json", dir);
        else
            rc = k3_ws_stream_open(&en->ws, dir, 1, e);
    } else if (rc == 0) {
        rc = k3_ws_open(&en->ws, dir, 0, e);
    }
    if (rc == 0)
        rc = open_tok(en, e);
    if (rc < 0) {
        k3_engine_close(en);
        return rc;
    }
    *out = en;
    return 0;
}

void k3_engine_close(k3_engine *en)
{
    if (!en)
        return;
    k3_dist *d = k3_dist_get();
    int sent;
    k3_err e;
    k3_err_clear(&e);
    k3_order_begin(d, &(k3_order){K3_ORD_CLOSE, en->id, 0, 0, 0}, NULL, &sent, &e);
    while (en->seqs)
        k3_seq_free(en->seqs);
    k3_model_close(en->m);
    k3_ws_close(en->ws);
    k3_tok_close(en->tok);
    free(en->batch);
    free(en);
    k3_order_end(d, sent, 0, 0, 0, NULL, &e);
}

k3_seq *k3_engine_seq_find(k3_engine *en, uint32_t id)
{
    for (k3_seq *q = en->seqs; q; q = q->next)
        if (q->id == id)
            return q;
    return NULL;
}

k3_model *k3_engine_model(k3_engine *en) { return en->m; }
k3_sess *k3_seq_sess(k3_seq *q) { return q->s; }

const k3_cfg *k3_engine_cfg(const k3_engine *en) { return k3_ws_cfg(en->ws); }
const k3_tok *k3_engine_tok(const k3_engine *en) { return en->tok; }

void k3_engine_get_info(const k3_engine *en, k3_engine_info *info)
{
    memset(info, 0, sizeof *info);
    info->kind = en->ws->ops->kind;
    info->streams = en->streams;
    info->budget_from_layout = en->from_layout;
    info->layout_budget = en->layout_budget;
    info->fell_to_floor = en->fell_to_floor;
    info->direct = en->streams ? k3_ws_stream_direct(en->ws) : 0;
    info->max_chunk = en->o.max_chunk;
    info->threads = (uint32_t)omp_get_max_threads();
}

/* --------------------------------------------------------- plan and load */

/* What one sequence of max_ctx tokens takes (k3_sess_create): the KDA state
 * and conv history, the MLA latents, the attention score rows. */
static void seq_mem(const k3_cfg *c, uint32_t max_ctx, uint32_t nthreads, uint64_t *state, uint64_t *kv,
                    uint64_t *scores)
{
    k3_model_mem mm;
    k3_model_mem_need(c, 1, max_ctx, nthreads, &mm);
    *state = mm.state;
    *kv = mm.kv;
    *scores = mm.scores;
}

static uint64_t seq_bytes(const k3_engine *en, uint32_t max_ctx)
{
    uint64_t st, kv, sc;
    seq_mem(k3_ws_cfg(en->ws), max_ctx, (uint32_t)omp_get_max_threads(), &st, &kv, &sc);
    return st + kv + sc;
}

/* The streamed plan for en->sz: the model's own memory counts one sequence,
 * extra_bytes every further one. K3_ENGINE_SEQS_FIT: first the plan for one,
 * then for as many as the budget's room above that floor holds. */
static int plan_stream(k3_engine *en, k3_err *e)
{
    k3_stream_opts *so = &en->so;
    const uint64_t caller = so->extra_bytes, per = seq_bytes(en, en->sz.max_ctx);
    int fit = en->sz.max_seqs == K3_ENGINE_SEQS_FIT;
    if (fit) {
        en->sz.max_seqs = 1;
        if (!so->baseline)   /* both plans from the same measured RSS */
            so->baseline = k3_stream_rss_now();
    }
    for (;;) {
        so->extra_bytes = caller + (uint64_t)(en->sz.max_seqs - 1) * per;
        int rc = k3_ws_stream_plan(en->ws, so, &en->plan, e);
        if (rc == K3_EBUDGET && en->from_layout && !en->fell_to_floor) {
            /* packed for another session shape (context, threads): its floor */
            k3_err_clear(e);
            en->fell_to_floor = 1;
            so->budget = K3_STREAM_FLOOR;
            rc = k3_ws_stream_plan(en->ws, so, &en->plan, e);
        }
        if (rc < 0 || !fit)
            return rc;
        fit = 0;
        uint64_t more = (en->plan.budget - en->plan.floor) / per;
        if (more == 0)
            return 0;
        if (more > UINT32_MAX / 2)
            more = UINT32_MAX / 2;
        /* the budget resolved from a preset is kept as bytes */
        so->budget = en->plan.budget;
        en->sz.max_seqs += (uint32_t)more;
    }
}

/* chunk_auto: the longest pass the budget holds, of 256, 128 and max_chunk
 * rows. Not for the floor or a k3-pack layout (both were sized for the
 * given chunk). The bits do not depend on it: a chunk of T ids gives the
 * bits of T single steps. */
static int plan_chunk(k3_engine *en, k3_err *e)
{
    static const uint32_t longer[] = {256, 128};
    if (!en->o.chunk_auto || en->from_layout || en->budget == K3_STREAM_FLOOR || en->budget == K3_STREAM_DOUBLE)
        return plan_stream(en, e);
    const k3_engine_size sz0 = en->sz;
    const k3_stream_opts so0 = en->so;
    for (size_t i = 0; i < sizeof longer / sizeof *longer; i++) {
        if (longer[i] <= en->o.max_chunk)
            break;
        en->sz = sz0;
        en->so = so0;
        en->so.max_chunk = longer[i];
        k3_err te = {0};
        if (plan_stream(en, &te) == 0 && k3_stream_plan_check_memory(&en->plan, &te) == 0) {
            en->o.max_chunk = longer[i];
            return 0;
        }
    }
    en->sz = sz0;
    en->so = so0;
    return plan_stream(en, e);
}

int k3_engine_mem_get(const k3_engine *en, k3_engine_mem *out, k3_err *e)
{
    memset(out, 0, sizeof *out);
    if (!en->planned)
        return k3_err_set(e, K3_EARG, "k3_engine_mem_get: no plan yet (k3_engine_plan or k3_engine_load)");
    seq_mem(k3_ws_cfg(en->ws), en->sz.max_ctx, (uint32_t)omp_get_max_threads(), &out->seq_state, &out->seq_kv,
            &out->seq_scores);
    out->seq_bytes = out->seq_state + out->seq_kv + out->seq_scores;
    out->max_ctx = en->sz.max_ctx;
    out->planned_seqs = en->sz.max_seqs;
    out->live_seqs = en->nseqs;
    out->live_bytes = en->seq_live;
    if (en->streams && out->seq_bytes) {
        uint64_t n = en->sz.max_seqs + (en->plan.budget - en->plan.floor) / out->seq_bytes;
        out->max_seqs = n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
    }
    return 0;
}

/* The weight files of a model directory (shards, trunk and expert files):
 * what holding it resident reads into memory. */
static uint64_t weight_file_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    uint64_t n = 0;
    if (!d)
        return 0;
    for (struct dirent *de; (de = readdir(d));) {
        const char *x = strrchr(de->d_name, '.');
        if (!x || (strcmp(x, ".safetensors") && strcmp(x, ".k3t") && strcmp(x, ".k3e")))
            continue;
        char p[8192];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (stat(p, &st) == 0 && S_ISREG(st.st_mode))
            n += (uint64_t)st.st_size;
    }
    closedir(d);
    return n;
}

/* Resident weights larger than the memory available would end in the
 * kernel's OOM killer mid-load: refuse them before, naming the way out. */
static int check_resident_memory(const k3_engine *en, k3_err *e)
{
    uint64_t avail;
    const char *src;
    const uint64_t need = weight_file_bytes(en->dir);
    if (!need || k3_mem_available(&avail, &src) < 0 || need <= avail)
        return 0;
    const double G = 1073741824.0;
    return k3_err_set(e, K3_EBUDGET,
                      "%s: the weights are %llu bytes (%.2f GiB) and are held resident without --ram, more than the "
                      "memory available: %llu bytes (%.2f GiB, %s); stream them with --ram floor or a budget%s",
                      en->dir, (unsigned long long)need, need / G, (unsigned long long)avail, avail / G, src,
                      has_manifest(en->dir) ? "" : " (after k3-convert: --ram needs a packed model)");
}

static int engine_plan(k3_engine *en, const k3_engine_size *sz, const k3_stream_plan **plan, k3_err *e);

int k3_engine_plan(k3_engine *en, const k3_engine_size *sz, const k3_stream_plan **plan, k3_err *e)
{
    if (plan)
        *plan = NULL;
    if (en->planned) {
        if (plan && en->streams)
            *plan = &en->plan;
        return 0;
    }
    k3_dist *d = k3_dist_get();
    k3_engine_size none = {0};
    int sent;
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_PLAN, en->id, 0, sz != NULL, sizeof none}, sz ? sz : &none,
                            &sent, e);
    if (rc == 0)
        rc = engine_plan(en, sz, plan, e);
    /* every rank must cut passes the same way */
    rc = k3_order_end(d, sent, 1, rc, en->o.max_chunk, "the rows per pass (--chunk)", e);
    if (rc < 0 && plan)
        *plan = NULL;
    en->planned = rc == 0;
    return rc;
}

static int engine_plan(k3_engine *en, const k3_engine_size *sz, const k3_stream_plan **plan, k3_err *e)
{
    if (sz)
        en->sz = *sz;
    if (!en->sz.max_ctx)
        en->sz.max_ctx = 4096;
    if (!en->sz.max_seqs)
        en->sz.max_seqs = 1;
    if (en->streams) {
        k3_stream_opts *so = &en->so;
        k3_stream_opts_init(so);
        so->budget = en->budget;
        so->max_chunk = en->o.max_chunk;
        so->max_ctx = en->sz.max_ctx;
        so->nthreads = (uint32_t)omp_get_max_threads();
        so->trace_path = en->o.trace_path;
        so->trunk_crc = en->o.trunk_crc;
        so->expert_guess = en->o.expert_guess;
        so->piece_bytes = en->o.piece_bytes;
        so->no_pin = en->slice;
        so->extra_bytes = en->sz.extra_bytes;
        int rc = plan_chunk(en, e);
        if (rc == 0)
            rc = k3_stream_plan_check_memory(&en->plan, e);   /* before anything big is mapped */
        if (rc < 0)
            return rc;
        if (plan)
            *plan = &en->plan;
    } else {
        int rc = check_resident_memory(en, e);
        if (rc < 0)
            return rc;
    }
    return 0;
}

int k3_engine_load(k3_engine *en, k3_err *e)
{
    if (en->loaded)
        return 0;
    k3_dist *d = k3_dist_get();
    int sent;
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_LOAD, en->id, 0, 0, 0}, NULL, &sent, e);
    if (rc == 0)
        rc = k3_engine_plan(en, NULL, NULL, e);
    /* the model opens after the plan: it sizes its expert batches by the cache */
    k3_model_opts mo = {en->o.max_chunk};
    if (rc == 0 && (rc = k3_model_open(&en->m, en->ws, &mo, e)) == 0)
        k3_model_dist_id_set(en->m, en->id);
    if (rc == 0 && en->streams)
        rc = k3_ws_stream_start(en->ws, &en->so, &en->plan, e);
    rc = k3_order_end(d, sent, 1, rc, 0, NULL, e);
    en->loaded = rc == 0;
    return rc;
}

int k3_engine_stream_stats(const k3_engine *en, k3_stream_stats *st)
{
    if (!en->streams) {
        memset(st, 0, sizeof *st);
        return -1;
    }
    k3_ws_stream_stats(en->ws, st);
    return 0;
}

int k3_engine_stream_finish(k3_engine *en, k3_err *e)
{
    return en->streams ? k3_ws_stream_finish(en->ws, e) : 0;
}

/* ------------------------------------------------------------ sequences */

int k3_seq_create(k3_seq **out, k3_engine *en, uint32_t max_ctx, k3_err *e)
{
    *out = NULL;
    if (!en->loaded)
        return k3_err_set(e, K3_EARG, "k3_seq_create: the engine is not loaded (k3_engine_load)");
    const uint64_t need = max_ctx ? seq_bytes(en, max_ctx) : 0;
    if (en->streams) {
        /* never past the budget: the live sequences stay within what the
         * plan counts for them */
        const uint64_t room = (uint64_t)en->sz.max_seqs * seq_bytes(en, en->sz.max_ctx);
        if (en->seq_live + need > room)
            return k3_err_set(e, K3_EBUDGET,
                              "a sequence of %u tokens needs %llu bytes; the memory plan counts %u sequence(s) of "
                              "%u tokens (%llu bytes) and %u live ones take %llu",
                              max_ctx, (unsigned long long)need, en->sz.max_seqs, en->sz.max_ctx,
                              (unsigned long long)room, en->nseqs, (unsigned long long)en->seq_live);
    }
    if (en->nseqs + 1 > en->batch_cap) {   /* room for a step with every live sequence */
        uint32_t cap = en->batch_cap ? 2 * en->batch_cap : 8;
        k3_model_seq *b = realloc(en->batch, (size_t)cap * sizeof *b);
        if (!b)
            return k3_err_set(e, K3_ENOMEM, "out of memory creating a sequence");
        en->batch = b;
        en->batch_cap = cap;
    }
    k3_dist *d = k3_dist_get();
    const uint32_t id = k3_order_id();
    int sent;
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_SEQ_NEW, en->id, id, max_ctx, 0}, NULL, &sent, e);
    if (rc < 0)
        return k3_order_end(d, sent, 0, rc, 0, NULL, e);
    k3_seq *q = calloc(1, sizeof *q);
    rc = q ? k3_sess_create(&q->s, en->m, max_ctx, e) : k3_err_set(e, K3_ENOMEM, "out of memory creating a sequence");
    if (d) {
        rc = k3_dist_agree(d, rc, e, 0, NULL, e);
        if (rc < 0 && q)
            k3_sess_free(q->s);
    }
    rc = k3_order_end(d, sent, 0, rc, 0, NULL, e);
    if (rc < 0) {
        free(q);
        return rc;
    }
    q->id = id;
    k3_sess_dist_id_set(q->s, id);
    q->en = en;
    q->bytes = need;
    en->nseqs++;
    en->seq_live += need;
    q->next = en->seqs;
    if (en->seqs)
        en->seqs->prev = q;
    en->seqs = q;
    *out = q;
    return 0;
}

void k3_seq_free(k3_seq *q)
{
    if (!q)
        return;
    k3_dist *d = k3_dist_get();
    int sent;
    k3_err e;
    k3_order_begin(d, &(k3_order){K3_ORD_SEQ_FREE, q->en->id, q->id, 0, 0}, NULL, &sent, &e);
    if (q->prev)
        q->prev->next = q->next;
    else
        q->en->seqs = q->next;
    if (q->next)
        q->next->prev = q->prev;
    q->en->nseqs--;
    q->en->seq_live -= q->bytes;
    k3_sess_free(q->s);
    free(q);
    k3_order_end(d, sent, 0, 0, 0, NULL, &e);
}

void k3_seq_reset(k3_seq *q)
{
    k3_dist *d = k3_dist_get();
    int sent;
    k3_err e;
    k3_order_begin(d, &(k3_order){K3_ORD_SEQ_RESET, q->en->id, q->id, 0, 0}, NULL, &sent, &e);
    k3_sess_reset(q->s);
    k3_order_end(d, sent, 0, 0, 0, NULL, &e);
}
uint32_t k3_seq_pos(const k3_seq *q) { return k3_sess_pos(q->s); }
uint32_t k3_seq_max_ctx(const k3_seq *q) { return k3_sess_max_ctx(q->s); }

int k3_seq_copy(k3_seq *dst, const k3_seq *src, k3_err *e)
{
    if (dst->en != src->en)
        return k3_err_set(e, K3_EARG, "k3_seq_copy: the sequences belong to different engines");
    if (dst == src)
        return 0;
    k3_dist *d = k3_dist_get();
    int sent;
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_SEQ_COPY, dst->en->id, dst->id, src->id, 0}, NULL, &sent, e);
    if (rc == 0)
        rc = k3_sess_copy(dst->s, src->s, e);
    return k3_order_end(d, sent, 1, rc, 0, NULL, e);
}

uint64_t k3_seq_state_size(const k3_seq *q) { return k3_sess_state_size(q->s); }

int k3_seq_state_save(const k3_seq *q, void *buf, uint64_t cap, uint64_t *len, k3_err *e)
{
    return k3_sess_state_save(q->s, buf, cap, len, e);
}

int k3_seq_state_load(k3_seq *q, const void *buf, uint64_t len, k3_err *e)
{
    k3_dist *d = k3_dist_get();
    int sent;
    int rc = k3_order_begin(d, &(k3_order){K3_ORD_SEQ_LOAD, q->en->id, q->id, 0, len}, buf, &sent, e);
    if (rc == 0)
        rc = k3_sess_state_load(q->s, buf, len, e);
    return k3_order_end(d, sent, 1, rc, 0, NULL, e);
}

/* ----------------------------------------------------------------- step */

int k3_engine_step(k3_engine *en, const k3_step_seq *seqs, uint32_t n, k3_err *e)
{
    if (!en->loaded)
        return k3_err_set(e, K3_EARG, "k3_engine_step: the engine is not loaded (k3_engine_load)");
    const uint32_t V = k3_ws_cfg(en->ws)->vocab_size;
    if (++en->mark == 0)
        en->mark = 1;
    for (uint32_t i = 0; i < n; i++) {
        const k3_step_seq *q = &seqs[i];
        if (!q->seq || q->seq->en != en)
            return k3_err_set(e, K3_EARG, "step entry %u: no sequence of this engine", i);
        if (q->seq->mark == en->mark)
            return k3_err_set(e, K3_EARG, "step entry %u: the sequence is already in this step", i);
        q->seq->mark = en->mark;
        if (q->n == 0 || !q->ids)
            return k3_err_set(e, K3_EARG, "step entry %u: no tokens", i);
        if (q->logits != K3_LOGITS_NONE && q->logits != K3_LOGITS_LAST && q->logits != K3_LOGITS_ALL)
            return k3_err_set(e, K3_EARG, "step entry %u: logits mode %d is not one of NONE, LAST, ALL", i,
                              q->logits);
        if (q->logits != K3_LOGITS_NONE && !q->out)
            return k3_err_set(e, K3_EARG, "step entry %u: logits requested without a buffer", i);
        uint32_t pos = k3_sess_pos(q->seq->s);
        for (uint32_t t = 0; t < q->n; t++)
            if (q->ids[t] >= V)
                return k3_err_set(e, K3_EARG, "token id %u at position %u is out of range (vocabulary %u)",
                                  q->ids[t], pos + t, V);
        if ((uint64_t)pos + q->n > k3_sess_max_ctx(q->seq->s))
            return k3_err_set(e, K3_ELIMIT, "context full: %u + %u tokens exceed the sequence's %u", pos, q->n,
                              k3_sess_max_ctx(q->seq->s));
    }
    /* One batch: each weight read once per pass for all of them, each
     * sequence still getting exactly its own bits. n <= live sequences (each
     * at most once), so the entries fit without allocating. */
    for (uint32_t i = 0; i < n; i++)
        en->batch[i] = (k3_model_seq){seqs[i].seq->s, seqs[i].ids, seqs[i].n, seqs[i].logits, seqs[i].out};
    return k3_model_forward_batch(en->m, en->batch, n, e);
}

/* ----------------------------------------------------------- generation */

int k3_gen_seq(k3_engine *en, k3_seq *q, k3_sampler *smp, const uint32_t *prompt, uint32_t n_prompt,
               const k3_gen_opts *o, uint32_t *out, uint32_t *n_out, k3_gen_stats *st, k3_err *e)
{
    if (q->en != en)
        return k3_err_set(e, K3_EARG, "k3_gen_seq: the sequence belongs to another engine");
    return k3_gen_run(en->m, q->s, smp, prompt, n_prompt, o, out, n_out, st, e);
}
