/*
 * spec.c - speculative decoding (k3_spec.h): the n-gram drafter and the
 * exact verifier over the engine API.
 *
 * Verifier state: `cur` holds the prompt and out[0..c) (committed); the ids
 * out[c..g) are generated but not yet fed (at least one: the last). A pass
 * feeds out[c..g) plus the guesses; row i of its logits is the distribution
 * of the id after the chunk's first i+1 ids, so row p-1 (p = g - c) is that
 * of out[g], row p that of out[g+1] if the first guess was right, and so on.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_engine.h"
#include "k3_io.h"
#include "k3_spec.h"

/* ------------------------------------------------------------ n-gram */

typedef struct ngram {
    k3_drafter d;
    uint32_t n_min, n_max;
} ngram;

static uint32_t ngram_propose(k3_drafter *d, const uint32_t *h, uint32_t n, uint32_t max, uint32_t *out)
{
    const ngram *g = (const ngram *)d;
    if (max == 0)
        return 0;
    for (uint32_t len = g->n_max; len >= g->n_min && len > 0; len--) {
        if (len >= n)
            continue;
        const uint32_t *suf = h + n - len;
        /* the latest earlier occurrence: start s < n - len with h[s..s+len) == suffix */
        for (uint32_t s = n - len; s-- > 0;) {
            if (memcmp(h + s, suf, len * sizeof *h) != 0)
                continue;
            uint32_t k = 0;
            for (uint32_t i = s + len; i < n && k < max; i++)
                out[k++] = h[i];
            return k;
        }
    }
    return 0;
}

static void ngram_free(k3_drafter *d) { free(d); }

int k3_drafter_ngram(k3_drafter **out, uint32_t n_min, uint32_t n_max, k3_err *e)
{
    *out = NULL;
    if (n_min == 0 || n_max < n_min)
        return k3_err_set(e, K3_EARG, "n-gram drafter: need 1 <= n_min <= n_max");
    ngram *g = calloc(1, sizeof *g);
    if (!g)
        return k3_err_set(e, K3_ENOMEM, "out of memory for the drafter");
    g->d.name = "ngram";
    g->d.propose = ngram_propose;
    g->d.free = ngram_free;
    g->n_min = n_min;
    g->n_max = n_max;
    *out = &g->d;
    return 0;
}

void k3_drafter_free(k3_drafter *d)
{
    if (d)
        d->free(d);
}

int k3_spec_parse(const char *arg, k3_drafter **out, uint32_t *k_max, k3_err *e)
{
    *out = NULL;
    *k_max = K3_SPEC_K_DEFAULT;
    if (!arg || strncmp(arg, "ngram", 5) != 0 || (arg[5] && arg[5] != ':'))
        return k3_err_set(e, K3_EARG, "--spec: '%s' is not ngram or ngram:K", arg ? arg : "");
    if (arg[5] == ':') {
        const char *v = arg + 6;
        char *end;
        unsigned long k = *v >= '0' && *v <= '9' ? strtoul(v, &end, 10) : 0;
        if (!k || *end || k > K3_SPEC_K_MAX)
            return k3_err_set(e, K3_EARG, "--spec: '%s': K must be a count from 1 to %d", arg, K3_SPEC_K_MAX);
        *k_max = (uint32_t)k;
    }
    return k3_drafter_ngram(out, 2, 4, e);
}

/* ---------------------------------------------------------- verifier */

/* Adaptive draft length: see k3_spec.h. */
typedef struct adapt {
    uint32_t k, k_max;
    uint32_t misses;     /* passes in a row with nothing accepted */
    uint32_t pause;      /* plain steps left before drafting again */
    uint32_t backoff;    /* the next pause */
} adapt;

static void adapt_update(adapt *a, uint32_t drafted, uint32_t accepted)
{
    if (accepted == drafted) {
        a->k = a->k * 2 > a->k_max ? a->k_max : a->k * 2;
        a->misses = 0;
        a->backoff = 1;
        return;
    }
    a->k = accepted + 1;
    if (accepted) {
        a->misses = 0;
        a->backoff = 1;
        return;
    }
    if (++a->misses >= 2) {
        a->pause = a->backoff;
        a->backoff = a->backoff * 2 > 64 ? 64 : a->backoff * 2;
        a->misses = 0;
        a->k = 1;
    }
}

/*
 * One speculating sequence. hist[0..n_hist) is the prompt and every id
 * generated; of the generated ones, the last `pend` are not in cur yet (at
 * least one: the last). A pass feeds them plus nd guesses (chunk); row i of
 * its logits is the distribution of the id after the chunk's first i+1 ids,
 * so the pass's draw i comes from row pend-1+i.
 */
struct k3_spec {
    k3_engine *en;
    k3_drafter *dr;
    k3_seq *cur, *spare;
    k3_seq *lent;              /* the caller's sequence (k3_spec_gen_seq): never freed here */
    uint32_t k_max, max_chunk, V;
    uint32_t *hist, cap;       /* max_ctx + 1 ids */
    uint32_t n_prompt, n_hist, pend;
    uint32_t *chunk;           /* 2 k_max + 1 */
    float *rows;               /* (2 k_max + 1) x V */
    uint32_t nd, drawn, acc;   /* this pass: guesses fed, ids drawn, guesses kept */
    int in_pass;
    adapt ad;
    k3_spec_stats st;
};

/* lent: use it as the committed sequence (NULL: create one) */
static int spec_new(k3_spec **out, k3_engine *en, k3_seq *lent, uint32_t max_ctx, k3_drafter *dr, uint32_t k_max,
                    k3_err *e)
{
    *out = NULL;
    if (!dr || k_max == 0)
        return k3_err_set(e, K3_EARG, "k3_spec_create: a drafter and k_max >= 1 are needed");
    if (k_max > K3_SPEC_K_MAX)
        k_max = K3_SPEC_K_MAX;
    k3_spec *s = calloc(1, sizeof *s);
    if (!s)
        return k3_err_set(e, K3_ENOMEM, "out of memory for speculative decoding");
    k3_engine_info info;
    k3_engine_get_info(en, &info);
    s->en = en;
    s->dr = dr;
    s->k_max = k_max;
    s->max_chunk = info.max_chunk ? info.max_chunk : 64;
    s->V = (uint32_t)k3_engine_cfg(en)->vocab_size;
    s->cap = max_ctx + 1;
    const uint32_t rows = 2 * k_max + 1;   /* carried ids (<= k_max) + guesses (<= k_max) */
    s->hist = malloc((uint64_t)s->cap * sizeof *s->hist);
    s->chunk = malloc(rows * sizeof *s->chunk);
    s->rows = malloc((uint64_t)rows * s->V * sizeof *s->rows);
    int rc = 0;
    if (!s->hist || !s->chunk || !s->rows)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory for speculative decoding");
    s->lent = s->cur = lent;
    if (rc == 0 && !lent)
        rc = k3_seq_create(&s->cur, en, max_ctx, e);
    if (rc == 0)
        rc = k3_seq_create(&s->spare, en, max_ctx, e);
    if (rc < 0) {
        k3_spec_free(s);
        return rc;
    }
    if (!lent)
        k3_spec_reset(s);
    else
        s->ad = (adapt){s->k_max < 2 ? s->k_max : 2, s->k_max, 0, 0, 1};
    *out = s;
    return 0;
}

int k3_spec_create(k3_spec **out, k3_engine *en, uint32_t max_ctx, k3_drafter *dr, uint32_t k_max, k3_err *e)
{
    return spec_new(out, en, NULL, max_ctx, dr, k_max, e);
}

void k3_spec_free(k3_spec *s)
{
    if (!s)
        return;
    if (s->cur != s->lent)
        k3_seq_free(s->cur);
    if (s->spare != s->lent)
        k3_seq_free(s->spare);
    free(s->hist);
    free(s->chunk);
    free(s->rows);
    free(s);
}

void k3_spec_reset(k3_spec *s)
{
    k3_seq_reset(s->cur);
    s->n_prompt = s->n_hist = s->pend = 0;
    s->in_pass = 0;
    s->ad = (adapt){s->k_max < 2 ? s->k_max : 2, s->k_max, 0, 0, 1};
    memset(&s->st, 0, sizeof s->st);
}

k3_seq *k3_spec_seq(k3_spec *s) { return s->cur; }

int k3_spec_begin(k3_spec *s, const uint32_t *prompt, uint32_t n_prompt, uint32_t first, k3_err *e)
{
    if ((uint64_t)n_prompt + 1 > s->cap)
        return k3_err_set(e, K3_ELIMIT, "prompt (%u) exceeds the context (%u)", n_prompt, s->cap - 1);
    memcpy(s->hist, prompt, (uint64_t)n_prompt * sizeof *s->hist);
    s->hist[n_prompt] = first;
    s->n_prompt = n_prompt;
    s->n_hist = n_prompt + 1;
    s->pend = 1;
    return 0;
}

int k3_spec_plan(k3_spec *s, uint32_t room, k3_step_seq *q, k3_err *e)
{
    const uint32_t p = s->pend;
    if (p == 0 || s->in_pass)
        return k3_err_set(e, K3_EARG, "k3_spec_plan: no id to feed (k3_spec_begin), or a pass not ended");
    uint32_t kk = s->ad.pause ? 0 : s->ad.k;
    if (kk > room)
        kk = room;
    const uint32_t left = s->cap - 1 > s->n_hist ? s->cap - 1 - s->n_hist : 0;
    if (kk > left)   /* never past the context */
        kk = left;
    if (p > s->k_max || p + kk > s->max_chunk)   /* carried too many: commit with a plain pass */
        kk = 0;
    uint32_t nd = kk ? s->dr->propose(s->dr, s->hist, s->n_hist, kk, s->chunk + p) : 0;
    if (nd > kk)
        nd = kk;
    memcpy(s->chunk, s->hist + s->n_hist - p, (uint64_t)p * sizeof *s->chunk);
    k3_seq *run = s->cur;
    if (nd) {
        double tc = k3_now_s();
        int rc = k3_seq_copy(s->spare, s->cur, e);
        if (rc < 0)
            return rc;
        s->st.copy_s += k3_now_s() - tc;
        s->st.copy_bytes += k3_seq_state_size(s->cur) - 64;
        s->st.copies++;
        s->st.spec_passes++;
        run = s->spare;
    } else if (s->ad.pause) {
        s->ad.pause--;
    }
    *q = (k3_step_seq){run, s->chunk, p + nd, nd ? K3_LOGITS_ALL : K3_LOGITS_LAST, s->rows};
    s->nd = nd;
    s->drawn = s->acc = 0;
    s->in_pass = 1;
    s->st.passes++;
    s->st.chunk_ids += p + nd;
    s->st.drafted += nd;
    return 0;
}

float *k3_spec_row(k3_spec *s, uint32_t i)
{
    return s->nd ? s->rows + (uint64_t)(s->pend - 1 + i) * s->V : s->rows;
}

int k3_spec_take(k3_spec *s, uint32_t id)
{
    const uint32_t i = s->drawn++;
    if (s->n_hist < s->cap)
        s->hist[s->n_hist++] = id;
    if (i == s->nd || id != s->chunk[s->pend + i])
        return 0;
    s->acc++;
    return 1;
}

void k3_spec_end(k3_spec *s)
{
    if (!s->in_pass)
        return;
    s->in_pass = 0;
    const uint32_t p = s->pend, nd = s->nd;
    if (nd) {
        s->st.accepted += s->acc;
        adapt_update(&s->ad, nd, s->acc);
        if (s->acc == nd) {   /* every guess fed is right: the copy is the sequence now */
            k3_seq *t = s->cur;
            s->cur = s->spare;
            s->spare = t;
            s->pend = s->drawn - nd;   /* the model's own id after the guesses (or none) */
        } else {
            s->pend = p + s->drawn;    /* cur is as before the pass: carry what it confirmed */
        }
    } else {
        s->pend = s->drawn;
    }
}

void k3_spec_get_stats(const k3_spec *s, k3_spec_stats *st)
{
    *st = s->st;
    st->n_fed = s->n_hist ? s->n_hist - s->n_prompt - s->pend : 0;
}

int k3_spec_gen_seq(k3_engine *en, k3_seq *seq, k3_sampler *smp, k3_drafter *dr, uint32_t k_max,
                    const uint32_t *prompt, uint32_t n_prompt, const k3_gen_opts *o, uint32_t *out,
                    uint32_t *n_out, k3_gen_stats *st, k3_spec_stats *sp, k3_err *e)
{
    memset(sp, 0, sizeof *sp);
    *n_out = 0;
    if (!dr || k_max == 0 || o->max_new <= 1) {
        int rc = k3_gen_seq(en, seq, smp, prompt, n_prompt, o, out, n_out, st, e);
        sp->n_fed = *n_out ? *n_out - 1 : 0;
        return rc;
    }
    if (n_prompt == 0)
        return k3_err_set(e, K3_EARG, "empty prompt: at least one token is needed");
    if ((uint64_t)k3_seq_pos(seq) + n_prompt + o->max_new > k3_seq_max_ctx(seq))
        return k3_err_set(e, K3_ELIMIT, "prompt (%u) + generation (%u) exceed the context (%u)", n_prompt,
                          o->max_new, k3_seq_max_ctx(seq));
    const uint64_t V = k3_engine_cfg(en)->vocab_size;
    const uint64_t j0 = k3_sampler_count(smp);
    k3_spec *s = NULL;
    int rc = spec_new(&s, en, seq, k3_seq_max_ctx(seq), dr, k_max, e);
    if (rc < 0)
        return rc;
    /* the prompt and the first id: exactly k3_gen_seq's */
    k3_gen_opts first = *o;
    first.max_new = 1;
    if ((rc = k3_gen_seq(en, seq, smp, prompt, n_prompt, &first, out, n_out, st, e)) < 0)
        goto out;
    if ((rc = k3_spec_begin(s, prompt, n_prompt, out[0], e)) < 0)
        goto out;
    uint32_t g = *n_out;
    int stop = st->stopped_by_eos;
    const double t1 = k3_now_s();
    while (!stop && g < o->max_new) {
        k3_step_seq step;
        if ((rc = k3_spec_plan(s, o->max_new - g - 1, &step, e)) < 0)
            goto out;
        if ((rc = k3_engine_step(en, &step, 1, e)) < 0)
            goto out;
        for (uint32_t i = 0;; i++) {
            const float *row = k3_spec_row(s, i);
            if (o->gen_logits)
                memcpy(o->gen_logits + (uint64_t)g * V, row, V * sizeof(float));
            uint32_t id = k3_sampler_at(smp, row, j0 + g);
            const int more = k3_spec_take(s, id);
            out[g++] = id;
            *n_out = g;
            st->n_gen = g;
            if (o->cb && (rc = o->cb(o->ud, id)) < 0)
                goto out;
            for (uint32_t k = 0; k < o->n_eos; k++)
                if (o->eos[k] == id)
                    stop = st->stopped_by_eos = 1;
            if (stop || g == o->max_new || !more)
                break;
        }
        k3_spec_end(s);
    }
    st->decode_s = k3_now_s() - t1;
    k3_sampler_set_count(smp, j0 + g);
    if (s->cur != seq) {   /* the committed state is the copy: the caller's sequence gets it */
        double tc = k3_now_s();
        if ((rc = k3_seq_copy(seq, s->cur, e)) < 0)
            goto out;
        s->st.copy_s += k3_now_s() - tc;
        s->st.copy_bytes += k3_seq_state_size(s->cur) - 64;
        s->st.copies++;
    }
out:
    k3_spec_end(s);
    k3_spec_get_stats(s, sp);
    k3_spec_free(s);
    return rc;
}
