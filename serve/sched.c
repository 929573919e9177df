/*
 * sched.c - the engine thread of k3-serve: continuous batching over
 * k3_engine_step (serve/SERVE.md).
 *
 * Each turn of the loop: drop the sequences whose clients went away, admit
 * queued requests into free slots (at most --parallel, the number of
 * sequences the memory plan was made for), build one step - the next prompt
 * chunk of every sequence still reading its prompt, the last sampled token of
 * every decoding one - run it, sample each sequence that got logits with its
 * own sampler, and hand the text to the connection. A request's tokens are
 * therefore exactly the ones it gets alone: the engine gives each sequence
 * its solo bits whatever else is in the step, and every request has its own
 * sampler seeded by its own seed.
 *
 * Text: ids go through a k3_tok_stream (incomplete UTF-8 held back); content
 * that could be the start of a stop string is held back until it is known
 * not to be; every piece handed out is valid UTF-8 (bytes that are not, and
 * NUL, become U+FFFD). Chat requests classify each id with the K3 chat
 * parser: reasoning, answer, markup, end.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_io.h"
#include "serve.h"

void srv_req_unref(srv *S, srv_req *r)
{
    if (--r->refs > 0)
        return;
    k3_sampler_free(r->smp);
    k3_tok_stream_free(r->ts);
    k3_chat_turn_free(r->turn);
    pthread_cond_destroy(&r->cv);
    srv_req_free_fields(r);
    free(r);
}

/* ------------------------------------------------------------- output */

static int grow(char **buf, uint32_t *cap, uint64_t need)
{
    if (need <= *cap)
        return 0;
    uint64_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    if (c > UINT32_MAX)
        return -1;
    char *t = realloc(*buf, c);
    if (!t)
        return -1;
    *buf = t;
    *cap = (uint32_t)c;
    return 0;
}

/* Out of memory for a request's text: it ends with 500 at the next step
 * (released as a cancelled one); nothing is dropped silently. */
static void out_of_memory(srv_req *r)
{
    if (!r->err_status) {
        r->err_status = 500;
        snprintf(r->err_msg, sizeof r->err_msg, "out of memory for the answer's text");
    }
    r->cancel = 1;
}

/* Hand n bytes of channel ch to the connection (mutex held). */
static void put_out(srv_req *r, int ch, const char *b, uint64_t n)
{
    if (n == 0 || r->cancel)
        return;
    char *clean = NULL;
    uint64_t cl = 0;
    k3_err e = {0};
    if (k3_chat_utf8_clean(b, n, &clean, &cl, &e) < 0) {
        out_of_memory(r);
        return;
    }
    /* NUL is valid UTF-8 but not in a JSON client's string: U+FFFD too */
    uint64_t nul = 0;
    for (uint64_t i = 0; i < cl; i++)
        nul += clean[i] == 0;
    if (r->n_pieces == r->cap_pieces) {
        uint32_t c = r->cap_pieces ? 2 * r->cap_pieces : 64;
        srv_piece *t = realloc(r->pieces, (size_t)c * sizeof *t);
        if (!t) {
            free(clean);
            out_of_memory(r);
            return;
        }
        r->pieces = t;
        r->cap_pieces = c;
    }
    if (grow(&r->text[ch], &r->cap[ch], (uint64_t)r->len[ch] + cl + 2 * nul + 1) < 0) {
        free(clean);
        out_of_memory(r);
        return;
    }
    char *d = r->text[ch] + r->len[ch];
    uint32_t at = 0;
    for (uint64_t i = 0; i < cl; i++) {
        if (clean[i] == 0) {
            memcpy(d + at, "\xef\xbf\xbd", 3);
            at += 3;
        } else {
            d[at++] = clean[i];
        }
    }
    d[at] = 0;
    free(clean);
    r->pieces[r->n_pieces++] = (srv_piece){(uint8_t)ch, r->len[ch], at};
    r->len[ch] += at;
    pthread_cond_broadcast(&r->cv);
}

/* Content through the stop strings: 1 when one matched (the request ends
 * before it). */
static int put_content(srv_req *r, const char *b, uint64_t n)
{
    if (r->n_stop == 0) {
        put_out(r, SRV_CH_CONTENT, b, n);
        return 0;
    }
    if (grow(&r->hold, &r->hold_cap, (uint64_t)r->hold_len + n + 1) < 0) {
        out_of_memory(r);
        return 0;
    }
    memcpy(r->hold + r->hold_len, b, n);
    r->hold_len += (uint32_t)n;
    r->hold[r->hold_len] = 0;
    /* the earliest match of any stop string */
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (uint32_t p = 0; p + sl <= r->hold_len && p < best; p++)
            if (!memcmp(r->hold + p, r->stop[i], sl)) {
                best = p;
                break;
            }
    }
    if (best != UINT32_MAX) {
        put_out(r, SRV_CH_CONTENT, r->hold, best);
        r->hold_len = 0;
        return 1;
    }
    /* keep the longest tail that begins some stop string */
    uint32_t keep = 0;
    for (uint32_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (uint32_t k = (uint32_t)(sl - 1 < r->hold_len ? sl - 1 : r->hold_len); k > keep; k--)
            if (!memcmp(r->hold + r->hold_len - k, r->stop[i], k)) {
                keep = k;
                break;
            }
    }
    put_out(r, SRV_CH_CONTENT, r->hold, r->hold_len - keep);
    memmove(r->hold, r->hold + r->hold_len - keep, keep);
    r->hold_len = keep;
    return 0;
}

/* Bytes of a channel; 1 when a stop string ended the request. */
static int put_text(srv_req *r, int ch, const char *b, uint64_t n)
{
    if (ch == SRV_CH_CONTENT)
        return put_content(r, b, n);
    put_out(r, ch, b, n);
    return 0;
}

/* The request leaves the engine (mutex held): its slot is free. */
static void release(srv *S, uint32_t slot)
{
    srv_req *r = S->active[slot];
    S->active[slot] = NULL;
    S->n_active--;
    k3_sampler_free(r->smp);
    k3_tok_stream_free(r->ts);
    k3_chat_turn_free(r->turn);
    r->smp = NULL;
    r->ts = NULL;
    r->turn = NULL;
    r->seq = NULL;
    if (r->spec) {   /* what its passes did, counted when it leaves */
        k3_spec_stats st;
        k3_spec_get_stats(r->spec, &st);
        S->m.spec_passes += st.spec_passes;
        S->m.spec_drafted += st.drafted;
        S->m.spec_accepted += st.accepted;
        r->spec = NULL;
    }
    if (r->state != SRV_DONE) {
        r->state = SRV_DONE;
        pthread_cond_broadcast(&r->cv);
    }
    srv_req_unref(S, r);
}

static void finish(srv *S, uint32_t slot, const char *why, int flush)
{
    srv_req *r = S->active[slot];
    if (flush) {
        const char *b;
        uint64_t n;
        k3_tok_stream_flush(r->ts, &b, &n);
        if (!put_text(r, r->channel, b, n) && r->hold_len) {
            put_out(r, SRV_CH_CONTENT, r->hold, r->hold_len);   /* no stop string came */
            r->hold_len = 0;
        }
    }
    r->finish = why;
    r->state = SRV_DONE;
    S->m.completed++;
    pthread_cond_broadcast(&r->cv);
    release(S, slot);
}

static void fail(srv *S, uint32_t slot, int status, const char *msg)
{
    srv_req *r = S->active[slot];
    r->err_status = status;
    snprintf(r->err_msg, sizeof r->err_msg, "%s", msg);
    S->m.failed++;
    release(S, slot);
}

static int is_eos(const srv *S, uint32_t id)
{
    for (uint32_t k = 0; k < S->n_eos; k++)
        if (S->eos[k] == id)
            return 1;
    return 0;
}

/* One sampled id of the request in slot (mutex held). */
static void take(srv *S, uint32_t slot, uint32_t id)
{
    srv_req *r = S->active[slot];
    const char *b;
    uint64_t n;
    k3_err e = {0};
    r->n_gen++;
    S->m.gen_tokens++;
    if (r->n_gen == 1)
        r->t_first = k3_now_s();
    if (!r->chat) {
        if (is_eos(S, id)) {
            finish(S, slot, "stop", 1);
            return;
        }
        if (k3_tok_stream_push(r->ts, id, &b, &n, &e) == 0 && put_text(r, SRV_CH_CONTENT, b, n)) {
            finish(S, slot, "stop", 0);
            return;
        }
    } else {
        int ev = k3_chat_turn_push(r->turn, id, &e);
        if (ev < 0 || ev == K3_CHAT_EV_END) {
            /* the end of the turn, or a malformed one: the answer ends there */
            finish(S, slot, "stop", 1);
            return;
        }
        int stopped = 0;
        if (ev == K3_CHAT_EV_REASONING || ev == K3_CHAT_EV_ANSWER) {
            int ch = ev == K3_CHAT_EV_ANSWER ? SRV_CH_CONTENT : SRV_CH_REASONING;
            if (ch != r->channel) {   /* what the decoder holds belongs to the old channel */
                k3_tok_stream_flush(r->ts, &b, &n);
                stopped = put_text(r, r->channel, b, n);
                r->channel = ch;
            }
            if (!stopped && k3_tok_stream_push(r->ts, id, &b, &n, &e) == 0)
                stopped = put_text(r, ch, b, n);
        } else {
            k3_tok_stream_flush(r->ts, &b, &n);
            stopped = put_text(r, r->channel, b, n);
        }
        if (stopped) {
            finish(S, slot, "stop", 0);
            return;
        }
    }
    if (r->n_gen >= r->max_tokens) {
        finish(S, slot, "length", 1);
        return;
    }
    r->next_id = id;
    r->have_next = 1;
}

/* Move queued requests into free slots (mutex held). */
static void admit(srv *S)
{
    while (S->qhead && S->n_active < S->cfg.parallel) {
        srv_req *r = S->qhead;
        S->qhead = r->next;
        if (!S->qhead)
            S->qtail = NULL;
        S->n_queued--;
        r->next = NULL;
        if (r->cancel || S->fatal) {
            if (S->fatal && !r->cancel) {
                r->err_status = 500;
                snprintf(r->err_msg, sizeof r->err_msg, "%s", S->fatal_msg);
            }
            r->state = SRV_DONE;
            pthread_cond_broadcast(&r->cv);
            srv_req_unref(S, r);
            continue;
        }
        uint32_t slot = 0;
        while (S->active[slot])
            slot++;
        k3_err e = {0};
        int rc = k3_sampler_create(&r->smp, S->V, (float)r->temperature, r->top_k, (float)r->top_p, r->seed, &e);
        if (rc == 0 && S->tok)
            rc = k3_tok_stream_create(&r->ts, S->tok, &e);
        if (rc == 0 && r->chat)
            rc = k3_chat_turn_create(&r->turn, S->tok, &r->fmt, &e);
        S->active[slot] = r;
        S->n_active++;
        if (rc < 0) {
            fail(S, slot, 500, e.msg);
            continue;
        }
        if (S->specs) {   /* --spec: the slot's verifier holds its sequences */
            k3_spec_reset(S->specs[slot]);
            r->seq = k3_spec_seq(S->specs[slot]);
            r->spec = r->speculative ? S->specs[slot] : NULL;
            r->spec_begun = 0;
        } else {
            r->seq = S->seqs[slot];
            k3_seq_reset(r->seq);
        }
        r->channel = r->chat && r->fmt.thinking ? SRV_CH_REASONING : SRV_CH_CONTENT;
        r->state = SRV_ACTIVE;
        S->m.prompt_tokens += r->n_prompt;
    }
}

static void *engine_main(void *arg)
{
    srv *S = arg;
    const uint32_t P = S->cfg.parallel, V = S->V;
    uint32_t *sampled = calloc(P, sizeof *sampled);
    pthread_mutex_lock(&S->mu);
    for (;;) {
        for (uint32_t s = 0; s < P; s++)
            if (S->active[s] && S->active[s]->cancel) {
                S->m.cancelled++;
                release(S, s);
            }
        admit(S);
        if (S->n_active == 0) {
            if (S->stop && !S->qhead)
                break;
            pthread_cond_wait(&S->wake, &S->mu);
            continue;
        }
        /* the step: a prompt chunk for each sequence still reading its prompt,
         * the last sampled id for each decoding one */
        uint32_t n = 0, tokens = 0;
        for (uint32_t s = 0; s < P; s++) {
            srv_req *r = S->active[s];
            if (!r)
                continue;
            k3_step_seq *q = &S->step[n];
            if (r->fed < r->n_prompt) {
                uint32_t c = r->n_prompt - r->fed;
                if (c > S->cfg.chunk)
                    c = S->cfg.chunk;
                q->ids = r->prompt + r->fed;
                q->n = c;
                r->fed += c;
                q->logits = r->fed == r->n_prompt ? K3_LOGITS_LAST : K3_LOGITS_NONE;
            } else if (r->spec) {
                /* the ids not yet fed and the guesses, into the verifier's rows */
                k3_err se = {0};
                int src = r->spec_begun ? 0 : k3_spec_begin(r->spec, r->prompt, r->n_prompt, r->next_id, &se);
                r->spec_begun = 1;
                if (src == 0)
                    src = k3_spec_plan(r->spec, r->max_tokens - r->n_gen - 1, q, &se);
                if (src < 0) {
                    fail(S, s, 500, se.msg);
                    continue;
                }
                r->have_next = 0;
                S->slot_of[n++] = s;
                tokens += q->n;
                continue;
            } else {
                q->ids = &r->next_id;
                q->n = 1;
                q->logits = K3_LOGITS_LAST;
                r->have_next = 0;
            }
            q->seq = r->seq;
            q->out = q->logits ? S->logits + (size_t)s * V : NULL;
            S->slot_of[n++] = s;
            tokens += q->n;
        }
        k3_stream_stats st0, st1;
        k3_engine_stream_stats(S->en, &st0);
        pthread_mutex_unlock(&S->mu);
        double t0 = k3_now_s();
        k3_err e = {0};
        int rc = k3_engine_step(S->en, S->step, n, &e);
        double dt = k3_now_s() - t0;
        /* sampling outside the lock: the samplers are the engine thread's */
        if (rc == 0)
            for (uint32_t i = 0; i < n; i++) {
                const uint32_t slot = S->slot_of[i];
                const srv_req *q = S->active[slot];
                if (q->spec && q->spec_begun) {
                    /* the pass's ids in order, each drawn as plain decoding draws it,
                       while the guesses hold (the verifier says when to stop) */
                    uint32_t *d = S->drawn + (size_t)slot * (S->cfg.spec_k + 1), nd = 0;
                    for (int more = 1; more && nd <= S->cfg.spec_k && q->n_gen + nd < q->max_tokens;) {
                        float *row = k3_spec_row(q->spec, nd);
                        for (uint32_t b = 0; b < q->n_bias; b++)
                            row[q->bias_id[b]] += q->bias[b];
                        d[nd] = k3_sampler_next(q->smp, row);
                        more = k3_spec_take(q->spec, d[nd]) && !is_eos(S, d[nd]);
                        nd++;
                    }
                    k3_spec_end(q->spec);
                    S->n_drawn[slot] = nd;
                } else if (S->step[i].logits) {
                    for (uint32_t b = 0; b < q->n_bias; b++)
                        S->step[i].out[q->bias_id[b]] += q->bias[b];
                    sampled[i] = k3_sampler_next(q->smp, S->step[i].out);
                }
            }
        k3_engine_stream_stats(S->en, &st1);
        pthread_mutex_lock(&S->mu);
        S->m.steps++;
        S->m.step_s += dt;
        S->m.last_step_s = dt;
        S->m.last_step_tokens = tokens;
        S->m.last_step_bytes = (st1.trunk_bytes + st1.expert_bytes) - (st0.trunk_bytes + st0.expert_bytes);
        if (rc < 0) {
            /* every sequence of a failed step is unspecified, and a streamed
             * engine fails every later step the same way */
            S->fatal = 1;
            snprintf(S->fatal_msg, sizeof S->fatal_msg, "the engine failed: %s", e.msg);
            fprintf(stderr, "k3-serve: error: %s\n", S->fatal_msg);
            for (uint32_t s = 0; s < P; s++)
                if (S->active[s])
                    fail(S, s, 500, S->fatal_msg);
            continue;
        }
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t slot = S->slot_of[i];
            srv_req *r = S->active[slot];
            if (r && r->spec && r->spec_begun) {
                const uint32_t *d = S->drawn + (size_t)slot * (S->cfg.spec_k + 1);
                for (uint32_t k = 0; k < S->n_drawn[slot] && S->active[slot] == r; k++)
                    take(S, slot, d[k]);   /* ends the request at eos, a stop string or max_tokens */
            } else if (S->step[i].logits && r)
                take(S, slot, sampled[i]);
        }
    }
    pthread_mutex_unlock(&S->mu);
    free(sampled);
    return NULL;
}

int srv_engine_start(srv *S, k3_err *e)
{
    int rc = k3_engine_load(S->en, e);
    if (rc < 0)
        return rc;
    const uint32_t P = S->cfg.parallel;
    S->active = calloc(P, sizeof *S->active);
    S->seqs = calloc(P, sizeof *S->seqs);
    S->step = calloc(P, sizeof *S->step);
    S->slot_of = calloc(P, sizeof *S->slot_of);
    S->logits = malloc((size_t)P * S->V * sizeof *S->logits);
    if (!S->active || !S->seqs || !S->step || !S->slot_of || !S->logits)
        return k3_err_set(e, K3_ENOMEM, "out of memory for %u sequences", P);
    if (S->cfg.drafter) {
        S->specs = calloc(P, sizeof *S->specs);
        S->drawn = calloc((size_t)P * (S->cfg.spec_k + 1), sizeof *S->drawn);
        S->n_drawn = calloc(P, sizeof *S->n_drawn);
        if (!S->specs || !S->drawn || !S->n_drawn)
            return k3_err_set(e, K3_ENOMEM, "out of memory for %u sequences", P);
        for (uint32_t i = 0; i < P; i++)
            if ((rc = k3_spec_create(&S->specs[i], S->en, S->cfg.ctx, S->cfg.drafter, S->cfg.spec_k, e)) < 0)
                return rc;
    } else {
        for (uint32_t i = 0; i < P; i++)
            if ((rc = k3_seq_create(&S->seqs[i], S->en, S->cfg.ctx, e)) < 0)
                return rc;
    }
    if (pthread_create(&S->thread, NULL, engine_main, S) != 0)
        return k3_err_set(e, K3_ENOMEM, "cannot start the engine thread");
    pthread_mutex_lock(&S->mu);
    S->ready = 1;
    pthread_mutex_unlock(&S->mu);
    return 0;
}

int srv_submit(srv *S, srv_req *r, char *msg, uint32_t cap)
{
    pthread_mutex_lock(&S->mu);
    int rc = 0;
    if (!S->ready) {
        snprintf(msg, cap, "the model is still loading");
        rc = 503;
    } else if (S->draining) {
        snprintf(msg, cap, "the server is shutting down");
        rc = 503;
    } else if (S->fatal) {
        snprintf(msg, cap, "%s", S->fatal_msg);
        rc = 500;
    } else if (S->n_queued >= S->cfg.queue && S->n_active + S->n_queued >= S->cfg.parallel) {
        snprintf(msg, cap, "the queue is full (%u waiting, --queue %u): try again later", S->n_queued,
                 S->cfg.queue);
        S->m.rejected_full++;
        rc = 503;
    } else {
        r->state = SRV_QUEUED;
        r->refs++;   /* the engine's */
        r->t_queued = k3_now_s();
        if (S->qtail)
            S->qtail->next = r;
        else
            S->qhead = r;
        S->qtail = r;
        S->n_queued++;
        pthread_cond_signal(&S->wake);
    }
    pthread_mutex_unlock(&S->mu);
    return rc;
}

void srv_engine_stop(srv *S, int cancel_all)
{
    pthread_mutex_lock(&S->mu);
    S->draining = 1;
    if (cancel_all) {
        for (srv_req *r = S->qhead; r; r = r->next)
            r->cancel = 1;
        for (uint32_t s = 0; S->active && s < S->cfg.parallel; s++)
            if (S->active[s]) {
                S->active[s]->cancel = 1;
                S->active[s]->err_status = 503;
                snprintf(S->active[s]->err_msg, sizeof S->active[s]->err_msg, "the server is shutting down");
            }
    }
    int started = S->ready;
    S->stop = 1;
    pthread_cond_signal(&S->wake);
    pthread_mutex_unlock(&S->mu);
    if (started)
        pthread_join(S->thread, NULL);
}

char *srv_metrics_text(srv *S)
{
    pthread_mutex_lock(&S->mu);
    srv_metrics m = S->m;
    uint32_t q = S->n_queued, a = S->n_active;
    int ready = S->ready;
    pthread_mutex_unlock(&S->mu);
    k3_stream_stats st;
    int streams = ready && k3_engine_stream_stats(S->en, &st) == 0;
    enum { CAP = 8192 };
    char *s = malloc(CAP);
    if (!s)
        return NULL;
    double tps = m.step_s > 0 ? (double)m.gen_tokens / m.step_s : 0;
    double hit = streams && st.expert_requests ? (double)st.expert_hits / (double)st.expert_requests : 1;
    int n = snprintf(s, CAP,
             "# HELP k3_requests_total Completion requests received (each counted once).\n"
             "# TYPE k3_requests_total counter\nk3_requests_total %llu\n"
             "# HELP k3_requests_rejected_total Requests answered with an error, by reason.\n"
             "# TYPE k3_requests_rejected_total counter\n"
             "k3_requests_rejected_total{reason=\"queue_full\"} %llu\n"
             "k3_requests_rejected_total{reason=\"bad_request\"} %llu\n"
             "k3_requests_rejected_total{reason=\"unauthorized\"} %llu\n"
             "k3_requests_rejected_total{reason=\"too_large\"} %llu\n"
             "k3_requests_rejected_total{reason=\"not_found\"} %llu\n"
             "k3_requests_rejected_total{reason=\"engine\"} %llu\n"
             "# TYPE k3_requests_completed_total counter\nk3_requests_completed_total %llu\n"
             "# HELP k3_requests_cancelled_total Sequences freed because the client went away.\n"
             "# TYPE k3_requests_cancelled_total counter\nk3_requests_cancelled_total %llu\n"
             "# TYPE k3_queue_depth gauge\nk3_queue_depth %u\n"
             "# TYPE k3_active_sequences gauge\nk3_active_sequences %u\n"
             "# TYPE k3_prompt_tokens_total counter\nk3_prompt_tokens_total %llu\n"
             "# TYPE k3_generated_tokens_total counter\nk3_generated_tokens_total %llu\n"
             "# TYPE k3_steps_total counter\nk3_steps_total %llu\n"
             "# HELP k3_step_seconds_total Time spent in engine steps.\n"
             "# TYPE k3_step_seconds_total counter\nk3_step_seconds_total %.6f\n"
             "# HELP k3_tokens_per_second Generated tokens per second of stepping.\n"
             "# TYPE k3_tokens_per_second gauge\nk3_tokens_per_second %.3f\n"
             "# HELP k3_last_step_tokens Tokens (prompt and decode) of the last step.\n"
             "# TYPE k3_last_step_tokens gauge\nk3_last_step_tokens %llu\n"
             "# HELP k3_bytes_read_per_step Weight bytes read from disk by the last step (0 resident).\n"
             "# TYPE k3_bytes_read_per_step gauge\nk3_bytes_read_per_step %llu\n"
             "# TYPE k3_bytes_read_total counter\nk3_bytes_read_total %llu\n"
             "# HELP k3_trunk_bytes_read_total Trunk bytes read from disk (0 resident).\n"
             "# TYPE k3_trunk_bytes_read_total counter\nk3_trunk_bytes_read_total %llu\n"
             "# HELP k3_expert_bytes_read_total Expert bytes read from disk (0 resident).\n"
             "# TYPE k3_expert_bytes_read_total counter\nk3_expert_bytes_read_total %llu\n"
             "# HELP k3_expert_requests_total Experts the steps needed: per step and MoE layer the union of the rows' routes.\n"
             "# TYPE k3_expert_requests_total counter\nk3_expert_requests_total %llu\n"
             "# TYPE k3_expert_hits_total counter\nk3_expert_hits_total %llu\n"
             "# HELP k3_spec_passes_total Steps in which a sequence checked guessed ids (counted as requests end).\n"
             "# TYPE k3_spec_passes_total counter\nk3_spec_passes_total %llu\n"
             "# TYPE k3_spec_drafted_total counter\nk3_spec_drafted_total %llu\n"
             "# TYPE k3_spec_accepted_total counter\nk3_spec_accepted_total %llu\n"
             "# HELP k3_expert_hit_rate Expert requests served from memory (1 resident).\n"
             "# TYPE k3_expert_hit_rate gauge\nk3_expert_hit_rate %.6f\n"
             "# TYPE k3_ready gauge\nk3_ready %d\n",
             (unsigned long long)m.requests, (unsigned long long)m.rejected_full,
             (unsigned long long)m.bad_requests, (unsigned long long)m.unauthorized,
             (unsigned long long)m.too_large, (unsigned long long)m.not_found, (unsigned long long)m.failed,
             (unsigned long long)m.completed, (unsigned long long)m.cancelled, q, a,
             (unsigned long long)m.prompt_tokens, (unsigned long long)m.gen_tokens, (unsigned long long)m.steps,
             m.step_s, tps, (unsigned long long)m.last_step_tokens, (unsigned long long)m.last_step_bytes,
             (unsigned long long)(streams ? st.trunk_bytes + st.expert_bytes : 0),
             (unsigned long long)(streams ? st.trunk_bytes : 0), (unsigned long long)(streams ? st.expert_bytes : 0),
             (unsigned long long)(streams ? st.expert_requests : 0), (unsigned long long)(streams ? st.expert_hits : 0),
             (unsigned long long)m.spec_passes, (unsigned long long)m.spec_drafted,
             (unsigned long long)m.spec_accepted,
             hit, ready);
    if (n < 0 || n >= CAP) {   /* never a cut-off page */
        free(s);
        return NULL;
    }
    return s;
}
