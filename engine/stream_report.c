/*
 * stream_report.c - the run report of the streaming source (text and JSON):
 * per phase (prompt = up to the first token, decode = after it) the seconds
 * per token and the bytes read per token, the share of the wall time the
 * model waited for reads, the expert cache hit rate, how the reads ahead on
 * the model's guess went, and the peak RSS against the budget. Only arithmetic over k3_stream_run; owns nothing.
 */
#include <cjson/cJSON.h>
#include <stdio.h>

#include "k3_stream.h"

typedef struct phase {
    double tokens, s, trunk, experts, wait, req, hits;
    double gq, gright, gdrop;   /* guesses queued, right, dropped unread */
    double ahead;               /* records taken ahead past the cache */
    double idle, depth;         /* device idle seconds, reads in flight x seconds */
} phase;

static void phases(const k3_stream_run *r, phase *pp, phase *dp)
{
    const k3_stream_stats *a = r->have_first ? &r->at_first : &r->end, *b = &r->end;
    pp->tokens = r->n_prompt;
    pp->s = r->prompt_s;
    pp->trunk = (double)(a->trunk_stream_bytes + a->embed_bytes);
    pp->experts = (double)a->expert_bytes;
    pp->wait = a->trunk_wait_s + a->expert_wait_s;
    pp->req = (double)a->expert_requests;
    pp->hits = (double)a->expert_hits;
    pp->gq = (double)a->guess_queued;
    pp->gright = (double)a->guess_right;
    pp->gdrop = (double)a->guess_dropped;
    pp->ahead = (double)a->read_ahead;
    pp->idle = a->io_idle_s;
    pp->depth = a->io_depth_s;
    dp->tokens = (double)(b->forwards - a->forwards);
    dp->s = r->decode_s;
    dp->trunk = (double)(b->trunk_stream_bytes + b->embed_bytes - a->trunk_stream_bytes - a->embed_bytes);
    dp->experts = (double)(b->expert_bytes - a->expert_bytes);
    dp->wait = b->trunk_wait_s + b->expert_wait_s - pp->wait;
    dp->req = (double)(b->expert_requests - a->expert_requests);
    dp->hits = (double)(b->expert_hits - a->expert_hits);
    dp->gq = (double)(b->guess_queued - a->guess_queued);
    dp->gright = (double)(b->guess_right - a->guess_right);
    dp->gdrop = (double)(b->guess_dropped - a->guess_dropped);
    dp->ahead = (double)(b->read_ahead - a->read_ahead);
    dp->idle = b->io_idle_s - a->io_idle_s;
    dp->depth = b->io_depth_s - a->io_depth_s;
}

static double per(double x, double n) { return n > 0 ? x / n : 0.0; }

void k3_stream_report_print(const k3_stream_run *r, FILE *f, const char *pre)
{
    phase p, d;
    phases(r, &p, &d);
    const double MB = 1e6;
    fprintf(f, "%sstream report (%s reads):\n", pre, r->direct ? "O_DIRECT" : "buffered");
    const phase *ph[2] = {&p, &d};
    const char *nm[2] = {"prompt", "decode"};
    for (int i = 0; i < 2; i++) {
        fprintf(f,
                "%s  %s %4.0f tokens  %9.4f s/token  read/token: trunk %10.3f MB, experts %10.3f MB  "
                "I/O wait %5.1f%%  expert hits %5.1f%% (%.0f/%.0f)\n",
                pre, nm[i], ph[i]->tokens, per(ph[i]->s, ph[i]->tokens), per(ph[i]->trunk, ph[i]->tokens) / MB,
                per(ph[i]->experts, ph[i]->tokens) / MB, 100.0 * per(ph[i]->wait, ph[i]->s),
                100.0 * per(ph[i]->hits, ph[i]->req), ph[i]->hits, ph[i]->req);
        if (ph[i]->gq > 0)
            fprintf(f, "%s  %s read ahead on a guess: %.0f records, %.0f right (%.1f%%), %.0f wrong dropped unread\n",
                    pre, nm[i], ph[i]->gq, ph[i]->gright, 100.0 * per(ph[i]->gright, ph[i]->gq), ph[i]->gdrop);
        if (ph[i]->ahead > 0)
            fprintf(f, "%s  %s read ahead past the cache: %.0f records (a layer needed more than it holds)\n", pre,
                    nm[i], ph[i]->ahead);
    }
    /* decode only: the prompt's counters start with the source, load included */
    if (d.tokens > 0 && d.s > 0)
        fprintf(f, "%s  decode device: no read in flight %.1f%% of the time; %.2f reads in flight while busy\n", pre,
                100.0 * per(d.idle, d.s), per(d.depth, d.s - d.idle));
    fprintf(f, "%s  pinned at start %.3f MB in %.3f s; ring groups dropped %llu\n", pre,
            (double)r->end.pinned_bytes / MB, r->end.load_s, (unsigned long long)r->end.ring_drops);
    fprintf(f, "%s  peak RSS %llu bytes (%.3f GiB) of a budget of %llu (%.3f GiB): %s\n", pre,
            (unsigned long long)r->peak_rss, r->peak_rss / 1073741824.0, (unsigned long long)r->plan.budget,
            r->plan.budget / 1073741824.0, r->peak_rss <= r->plan.budget ? "within" : "OVER");
}

static cJSON *phase_json(const phase *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    cJSON_AddNumberToObject(o, "tokens", p->tokens);
    cJSON_AddNumberToObject(o, "s_per_token", per(p->s, p->tokens));
    cJSON_AddNumberToObject(o, "trunk_bytes_per_token", per(p->trunk, p->tokens));
    cJSON_AddNumberToObject(o, "expert_bytes_per_token", per(p->experts, p->tokens));
    cJSON_AddNumberToObject(o, "io_wait_share", per(p->wait, p->s));
    cJSON_AddNumberToObject(o, "expert_requests", p->req);
    cJSON_AddNumberToObject(o, "expert_hit_rate", per(p->hits, p->req));
    cJSON_AddNumberToObject(o, "guess_queued", p->gq);
    cJSON_AddNumberToObject(o, "guess_right", p->gright);
    cJSON_AddNumberToObject(o, "guess_dropped", p->gdrop);
    cJSON_AddNumberToObject(o, "read_ahead", p->ahead);
    return o;
}

/* The decode phase's device side (see k3_stream_report_print). */
static void device_json(cJSON *o, const phase *d)
{
    if (!o || d->s <= 0)
        return;
    cJSON_AddNumberToObject(o, "io_idle_share", per(d->idle, d->s));
    cJSON_AddNumberToObject(o, "io_depth", per(d->depth, d->s - d->idle));
}

static cJSON *report_obj(const k3_stream_run *r)
{
    phase p, d;
    phases(r, &p, &d);
    cJSON *o = cJSON_CreateObject(), *pl = cJSON_CreateObject();
    if (!o || !pl) {
        cJSON_Delete(o);
        cJSON_Delete(pl);
        return NULL;
    }
    const k3_stream_plan *q = &r->plan;
    cJSON_AddNumberToObject(pl, "budget", (double)q->budget);
    cJSON_AddNumberToObject(pl, "total", (double)q->total);
    cJSON_AddNumberToObject(pl, "floor", (double)q->floor);
    cJSON_AddNumberToObject(pl, "floor_double", (double)q->floor_double);
    cJSON_AddNumberToObject(pl, "resident", (double)q->resident);
    cJSON_AddNumberToObject(pl, "trunk_pinned", (double)q->mapped_pinned);
    cJSON_AddNumberToObject(pl, "trunk_streamed", (double)q->trunk_streamed);
    cJSON_AddNumberToObject(pl, "pinned_groups", q->n_pinned);
    cJSON_AddNumberToObject(pl, "ring", (double)q->mapped_ring);
    cJSON_AddBoolToObject(pl, "double_buffered", q->double_buffered);
    cJSON_AddNumberToObject(pl, "piece_ring", (double)k3_stream_arena_bytes(q->piece_ring));
    cJSON_AddNumberToObject(pl, "expert_slots", q->expert_slots);
    cJSON_AddNumberToObject(pl, "expert_cache", (double)q->expert_bytes);
    cJSON_AddNumberToObject(pl, "kv", (double)q->kv);
    cJSON_AddNumberToObject(pl, "state", (double)q->state);
    cJSON_AddNumberToObject(pl, "scratch", (double)q->scratch);
    cJSON_AddNumberToObject(pl, "runtime", (double)q->runtime);
    cJSON_AddItemToObject(o, "plan", pl);
    cJSON_AddItemToObject(o, "prompt", phase_json(&p));
    cJSON *dj = phase_json(&d);
    device_json(dj, &d);
    cJSON_AddItemToObject(o, "decode", dj);
    cJSON_AddBoolToObject(o, "direct", r->direct);
    cJSON_AddNumberToObject(o, "pinned_bytes_read", (double)r->end.pinned_bytes);
    cJSON_AddNumberToObject(o, "load_s", r->end.load_s);
    cJSON_AddNumberToObject(o, "ring_drops", (double)r->end.ring_drops);
    cJSON_AddNumberToObject(o, "peak_rss", (double)r->peak_rss);
    return o;
}

char *k3_stream_report_json(const k3_stream_run *r)
{
    cJSON *o = report_obj(r);
    char *t = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return t;
}
