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
#include <time.h>

#include "k3_engine.h"
#include "k3_spec.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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
    if (k_max > K3_SPEC_K_MAX)
        k_max = K3_SPEC_K_MAX;
    if (n_prompt == 0)
        return k3_err_set(e, K3_EARG, "empty prompt: at least one token is needed");
    if ((uint64_t)k3_seq_pos(seq) + n_prompt + o->max_new > k3_seq_max_ctx(seq))
        return k3_err_set(e, K3_ELIMIT, "prompt (%u) + generation (%u) exceed the context (%u)", n_prompt,
                          o->max_new, k3_seq_max_ctx(seq));
    const uint64_t V = k3_engine_cfg(en)->vocab_size;
    k3_engine_info info;
    k3_engine_get_info(en, &info);
    const uint32_t max_chunk = info.max_chunk ? info.max_chunk : 64;
    const uint32_t rows_cap = 2 * k_max + 1;   /* carried ids (<= k_max) + guesses (<= k_max) */
    const uint64_t j0 = k3_sampler_count(smp);
    k3_seq *spare = NULL, *cur = seq;
    uint32_t *hist = malloc(((uint64_t)n_prompt + o->max_new) * sizeof *hist);
    uint32_t *chunk = malloc(rows_cap * sizeof *chunk);
    float *rows = malloc((uint64_t)rows_cap * V * sizeof *rows);
    int rc = 0;
    if (!hist || !chunk || !rows) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory for speculative decoding");
        goto out;
    }
    if ((rc = k3_seq_create(&spare, en, k3_seq_max_ctx(seq), e)) < 0)
        goto out;

    /* the prompt and the first id: exactly k3_gen_seq's */
    k3_gen_opts first = *o;
    first.max_new = 1;
    if ((rc = k3_gen_seq(en, seq, smp, prompt, n_prompt, &first, out, n_out, st, e)) < 0)
        goto out;
    memcpy(hist, prompt, (uint64_t)n_prompt * sizeof *hist);
    uint32_t g = *n_out, c = 0;   /* generated; fed into cur */
    hist[n_prompt] = out[0];
    adapt ad = {k_max < 2 ? k_max : 2, k_max, 0, 0, 1};
    int stop = st->stopped_by_eos;
    const double t1 = now_s();
    while (!stop && g < o->max_new) {
        const uint32_t p = g - c;
        uint32_t room = o->max_new - g - 1;   /* guesses beyond it could never be emitted */
        uint32_t kk = ad.pause ? 0 : ad.k;
        if (kk > room)
            kk = room;
        if (p > k_max || p + kk > max_chunk)   /* carried too many: commit with a plain pass */
            kk = 0;
        uint32_t nd = kk ? dr->propose(dr, hist, n_prompt + g, kk, chunk + p) : 0;
        if (nd > kk)
            nd = kk;
        memcpy(chunk, out + c, (uint64_t)p * sizeof *chunk);
        k3_seq *run = cur;
        if (nd) {
            double tc = now_s();
            if ((rc = k3_seq_copy(spare, cur, e)) < 0)
                goto out;
            sp->copy_s += now_s() - tc;
            sp->copy_bytes += k3_seq_state_size(cur) - 64;
            sp->copies++;
            sp->spec_passes++;
            run = spare;
        } else if (ad.pause) {
            ad.pause--;
        }
        k3_step_seq step = {run, chunk, p + nd, nd ? K3_LOGITS_ALL : K3_LOGITS_LAST, rows};
        if ((rc = k3_engine_step(en, &step, 1, e)) < 0)
            goto out;
        sp->passes++;
        sp->chunk_ids += p + nd;
        sp->drafted += nd;
        /* sample row p-1+i for i = 0..nd while the guesses hold */
        uint32_t acc = 0;
        for (uint32_t i = 0; i <= nd; i++) {
            const float *row = nd ? rows + (uint64_t)(p - 1 + i) * V : rows;
            if (o->gen_logits)
                memcpy(o->gen_logits + (uint64_t)g * V, row, V * sizeof(float));
            uint32_t id = k3_sampler_at(smp, row, j0 + g);
            out[g] = id;
            hist[n_prompt + g] = id;
            g++;
            *n_out = g;
            st->n_gen = g;
            if (o->cb && (rc = o->cb(o->ud, id)) < 0)
                goto out;
            for (uint32_t k = 0; k < o->n_eos; k++)
                if (o->eos[k] == id)
                    stop = st->stopped_by_eos = 1;
            if (stop || g == o->max_new || i == nd || id != chunk[p + i])
                break;
            acc++;
        }
        if (nd) {
            sp->accepted += acc;
            adapt_update(&ad, nd, acc);
            if (acc == nd) {   /* every guess fed is right: the copy is the sequence now */
                k3_seq *t = cur;
                cur = spare;
                spare = t;
                c += p + nd;
            }
            /* else: cur is as before the pass; out[c..g) is carried */
        } else {
            c += p;
        }
    }
    st->decode_s = now_s() - t1;
    k3_sampler_set_count(smp, j0 + g);
    if (cur != seq) {
        double tc = now_s();
        if ((rc = k3_seq_copy(seq, cur, e)) < 0)
            goto out;
        sp->copy_s += now_s() - tc;
        sp->copy_bytes += k3_seq_state_size(cur) - 64;
        sp->copies++;
    }
    sp->n_fed = c;
out:
    if (spare == seq)
        spare = cur;
    k3_seq_free(spare);
    free(hist);
    free(chunk);
    free(rows);
    return rc;
}
