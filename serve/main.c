/*
 * main.c - k3-serve: an OpenAI-compatible HTTP server over the k3 engine,
 * with continuous batching (serve/SERVE.md).
 *
 *   k3-serve MODEL_DIR [--ram SIZE] [--host 127.0.0.1] [--port 8080] ...
 *
 * Startup: open the model and make the memory plan for --parallel (auto: as many as --ram holds)
 * sequences of --ctx tokens (refused budgets exit 6 before anything is
 * served), listen (GET /health says "loading"), load, serve. SIGINT or
 * SIGTERM: stop taking requests (503), let the ones in flight finish, exit 0;
 * a second signal cancels them.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3_cli.h"
#include "k3_engine.h"
#include "k3_out.h"
#include "k3_plan.h"
#include "serve.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: k3-serve MODEL_DIR [options]\n"
            "\n"
            "Serve Kimi K3 (or a checkpoint of the same shape) over HTTP with the OpenAI API:\n"
            "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,\n"
            "GET /metrics. Requests are batched continuously: every step of the engine advances\n"
            "every running request (serve/SERVE.md).\n"
            "\n"
            "network:\n"
            "  --host ADDR            address to listen on (default 127.0.0.1: this machine only)\n"
            "  --port N               TCP port (default 8080; 0: any free port, printed)\n"
            "  --api-key KEY          require \"Authorization: Bearer KEY\" (all but /health)\n"
            "  --max-body SIZE        largest request body in bytes (default 4194304; more: 413)\n"
            "  --timeout S            close a connection idle for S seconds (default 60)\n"
            "  --max-connections N    connections at once (default 1024)\n"
            "scheduling:\n"
            "  --parallel N|auto      sequences stepped together (default auto: as many\n"
            "                         of --ctx tokens as --ram holds, at most 64; 8 resident)\n"
            "  --queue N              requests waiting for a sequence (default 64; more: 503)\n"
            "  --ctx N                tokens per sequence, prompt and answer (default 4096)\n"
            "  --chunk N              prompt tokens per sequence per step (default 64)\n"
            "  --spec ngram[:K]       speculative decoding by default (a request's\n"
            "                         \"speculative\": false turns it off): up to K guessed\n"
            "                         ids (default 8) checked per step, the same output;\n"
            "                         each slot takes two sequences of --ctx tokens\n"
            "engine:\n"
            "  --ram SIZE             stream the weights within SIZE bytes of RAM (K/M/G/T\n"
            "                         suffixes) or a preset: floor, double, resident; the plan\n"
            "                         counts --parallel sequences of --ctx tokens\n"
            "  --threads N            compute threads (default: all cores)\n"
            "  --name NAME            the model id /v1/models reports (default: the directory's\n"
            "                         last component)\n"
            "  --quiet                no startup or shutdown lines on stderr\n"
            "  --version, --help\n"
            "\n"
            "Exit: 0 ok (also after SIGINT/SIGTERM), 2 usage, 3 bad format, 4 I/O error (also:\n"
            "cannot listen), 5 corrupt, 6 limit/memory (a plan over the memory available),\n"
            "9 internal error.\n");
}

static int usage_error(const char *fmt, const char *arg)
{
    char b[K3_ERR_MSG_MAX + 256];   /* room for a whole error message and its context */
    snprintf(b, sizeof b, fmt, arg);
    return k3_out_error(K3_EARG, "%s (k3-serve --help)", b);
}

static int parse_u32(const char *opt, const char *v, uint64_t lo, uint64_t hi, uint32_t *out)
{
    uint64_t x;
    if (!v || k3_cli_parse_u64(v, lo, hi, &x) < 0) {
        char b[256];
        snprintf(b, sizeof b, "%s needs a whole number from %llu to %llu", opt, (unsigned long long)lo,
                 (unsigned long long)hi);
        return usage_error("%s", b);
    }
    *out = (uint32_t)x;
    return 0;
}

int main(int argc, char **argv)
{
    k3_out_init("k3-serve");
    static srv server;   /* static: every early exit leaves nothing allocated */
    srv *S = &server;
    srv_cfg *c = &S->cfg;
    c->host = "127.0.0.1";
    c->port = 8080;
    c->parallel = 0;   /* auto */
    c->queue = 64;
    c->ctx = 4096;
    c->chunk = 64;
    c->max_body = 4u << 20;
    c->timeout_s = 60;
    c->max_conn = 1024;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--version")) {
            k3_cli_print_version("k3-serve");
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            c->quiet = 1;
            continue;
        } else if (a[0] == '-' && a[1] == '-') {
            if (!v)
                return usage_error("%s needs a value", a);
            i++;
            if (!strcmp(a, "--host"))
                c->host = v;
            else if (!strcmp(a, "--port"))
                rc = parse_u32(a, v, 0, 65535, &c->port);
            else if (!strcmp(a, "--api-key")) {
                if (!*v)
                    return usage_error("%s: the key is empty", a);
                c->api_key = v;
            } else if (!strcmp(a, "--max-body")) {
                k3_err e = {0};
                if (k3_stream_parse_budget(v, &c->max_body, &e) < 0 || c->max_body == 0 || c->max_body > (1ull << 32))
                    return usage_error("--max-body needs a size from 1 byte to 4G, not '%s'", v);
            } else if (!strcmp(a, "--timeout"))
                rc = parse_u32(a, v, 1, 86400, &c->timeout_s);
            else if (!strcmp(a, "--max-connections"))
                rc = parse_u32(a, v, 1, 65536, &c->max_conn);
            else if (!strcmp(a, "--parallel")) {
                if (strcmp(v, "auto"))
                    rc = parse_u32(a, v, 1, 1024, &c->parallel);
                else
                    c->parallel = 0;
            }
            else if (!strcmp(a, "--queue"))
                rc = parse_u32(a, v, 0, 1u << 20, &c->queue);
            else if (!strcmp(a, "--ctx"))
                rc = parse_u32(a, v, 2, 1u << 24, &c->ctx);
            else if (!strcmp(a, "--chunk"))
                rc = parse_u32(a, v, 1, 4096, &c->chunk);
            else if (!strcmp(a, "--threads"))
                rc = parse_u32(a, v, 1, 4096, &c->threads);
            else if (!strcmp(a, "--ram"))
                c->ram = v;
            else if (!strcmp(a, "--spec")) {
                k3_err se = {0};
                k3_drafter_free(c->drafter);
                if (k3_spec_parse(v, &c->drafter, &c->spec_k, &se) < 0)
                    return usage_error("%s", se.msg);
                c->spec = v;
            }
            else if (!strcmp(a, "--name"))
                c->model_name = v;
            else
                return usage_error("unknown option %s", a);
            if (rc)
                return rc;
        } else if (!c->model_dir) {
            c->model_dir = a;
        } else {
            return usage_error("one model directory only (also got '%s')", a);
        }
    }
    if (!c->model_dir)
        return usage_error("%s", "no model directory: k3-serve MODEL_DIR [options]");
    static char name[256];
    if (!c->model_name) {   /* the directory's last component */
        snprintf(name, sizeof name, "%s", c->model_dir);
        size_t n = strlen(name);
        while (n > 1 && name[n - 1] == '/')
            name[--n] = 0;
        const char *s = strrchr(name, '/');
        c->model_name = s && s[1] ? s + 1 : name;
    }

    /* every thread started from here on leaves these signals to sigwait */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    pthread_mutex_init(&S->mu, NULL);
    pthread_cond_init(&S->wake, NULL);

    k3_err e = {0};
    k3_engine_opts eo;
    k3_engine_opts_init(&eo);
    eo.ram = c->ram;
    eo.threads = c->threads;
    eo.max_chunk = c->chunk;
    srv_http *h = NULL;
    int rc = k3_engine_open(&S->en, c->model_dir, &eo, &e);
    if (rc == 0) {
        S->V = k3_engine_cfg(S->en)->vocab_size;
        S->tok = k3_engine_tok(S->en);
        if (!S->tok)   /* the API speaks text: answers are text even for id prompts */
            rc = k3_err_set(&e, K3_ENOENT, "%s: no tokenizer (tiktoken.model): k3-serve answers in text",
                            c->model_dir);
        else {
            k3_tok_eos_ids(S->tok, &S->eos, &S->n_eos);
            k3_err ce = {0};
            S->can_chat = k3_chat_ctl_find(S->tok, &S->ctl, &ce) == 0;
        }
        /* auto: as many sequences as the budget holds (the logits of the
           most there can be counted as the caller's buffers) */
        const uint32_t want = c->parallel ? c->parallel : SRV_AUTO_MAX;
        const uint32_t per_slot = c->drafter ? 2 : 1;   /* --spec: the rollback copy */
        const uint64_t rows = c->drafter ? 2 * c->spec_k + 1 : 0;
        k3_engine_size sz = {c->ctx, c->parallel ? c->parallel * per_slot : K3_ENGINE_SEQS_FIT,
                             (uint64_t)want * S->V * 4 * (1 + rows)};
        const k3_stream_plan *plan = NULL;
        if (rc == 0)
            rc = k3_engine_plan(S->en, &sz, &plan, &e);
        if (rc == K3_EBUDGET && c->parallel > 1) {
            char msg[sizeof e.msg];
            snprintf(msg, sizeof msg, "%s", e.msg);
            k3_err_clear(&e);
            k3_err_set(&e, K3_EBUDGET,
                       "--parallel %u sequences of %u tokens do not fit: %s; ask for fewer, a smaller --ctx, or "
                       "--parallel auto (as many as the budget holds)",
                       c->parallel, c->ctx, msg);
        }
        k3_engine_mem mem = {0};
        if (rc == 0 && plan)
            rc = k3_engine_mem_get(S->en, &mem, &e);
        if (rc == 0 && !c->parallel) {
            const uint32_t fit = plan ? mem.planned_seqs / per_slot : SRV_AUTO_RESIDENT;
            c->parallel = fit < 1 ? 1 : fit < SRV_AUTO_MAX ? fit : SRV_AUTO_MAX;
            if (plan && fit < 1)
                rc = k3_err_set(&e, K3_EBUDGET, "--spec needs two sequences of %u tokens per slot, and the budget "
                                "holds one: a larger --ram or a smaller --ctx", c->ctx);
        }
        if (rc == 0 && plan && !c->quiet) {
            k3_stream_plan_print(plan, stderr, "k3-serve: ");
            /* what each --parallel slot costs, and how many the budget holds */
            fprintf(stderr,
                    "k3-serve: per sequence of %u tokens %.3f MiB (state %.3f, latents %.3f, scores %.3f); "
                    "the budget admits at most %u, %u stepped together (--parallel%s); more requests wait in "
                    "the queue\n",
                    mem.max_ctx, mem.seq_bytes / 1048576.0, mem.seq_state / 1048576.0, mem.seq_kv / 1048576.0,
                    mem.seq_scores / 1048576.0, mem.max_seqs, c->parallel, sz.max_seqs == K3_ENGINE_SEQS_FIT ? " auto" : "");
            if (c->drafter)
                fprintf(stderr, "k3-serve: --spec %s: each slot holds two sequences (the rollback copy)\n", c->spec);
        }
    }
    uint32_t port = 0;
    if (rc == 0)
        rc = srv_http_start(S, &h, &port, &e);
    if (rc == 0) {
        if (!c->quiet)
            fprintf(stderr, "k3-serve: loading %s\n", c->model_dir);
        rc = srv_engine_start(S, &e);
    }
    if (rc < 0) {
        srv_http_stop(h);
        srv_engine_stop(S, 1);
        k3_engine_close(S->en);
        return k3_out_error(rc, "%s", e.msg);
    }
    /* the line a supervisor (or a test) waits for */
    fprintf(stderr, "k3-serve: listening on http://%s:%u (%u parallel, queue %u, context %u)\n", c->host, port,
            c->parallel, c->queue, c->ctx);
    fflush(stderr);

    int sig = 0;
    while (sigwait(&sigs, &sig) != 0 || (sig != SIGINT && sig != SIGTERM))
        ;
    if (!c->quiet)
        fprintf(stderr, "k3-serve: %s: finishing the requests in flight (again to cancel them)\n",
                sig == SIGINT ? "SIGINT" : "SIGTERM");
    pthread_mutex_lock(&S->mu);
    S->draining = 1;
    pthread_mutex_unlock(&S->mu);
    /* drain; a second signal cancels what is left */
    int cancel = 0;
    for (;;) {
        pthread_mutex_lock(&S->mu);
        int left = S->n_active + S->n_queued;
        pthread_mutex_unlock(&S->mu);
        if (!left)
            break;
        struct timespec ts = {0, 50 * 1000 * 1000};
        if (sigtimedwait(&sigs, NULL, &ts) > 0) {
            cancel = 1;
            break;
        }
    }
    srv_engine_stop(S, cancel);
    /* every request is done: let the connections write their last events
     * (at most 5 s: a client that does not read is not waited for) */
    for (int i = 0; i < 100; i++) {
        pthread_mutex_lock(&S->mu);
        uint32_t n = S->n_answering;
        pthread_mutex_unlock(&S->mu);
        if (!n)
            break;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    srv_http_stop(h);
    k3_err fe = {0};
    rc = k3_engine_stream_finish(S->en, &fe);
    for (uint32_t i = 0; S->seqs && i < c->parallel; i++)
        k3_seq_free(S->seqs[i]);
    for (uint32_t i = 0; S->specs && i < c->parallel; i++)
        k3_spec_free(S->specs[i]);
    k3_engine_close(S->en);
    if (!c->quiet)
        fprintf(stderr, "k3-serve: stopped after %llu requests (%llu tokens generated)\n",
                (unsigned long long)S->m.requests, (unsigned long long)S->m.gen_tokens);
    free(S->active);
    free(S->seqs);
    free(S->specs);
    free(S->drawn);
    free(S->n_drawn);
    k3_drafter_free(c->drafter);
    free(S->step);
    free(S->slot_of);
    free(S->logits);
    pthread_mutex_destroy(&S->mu);
    pthread_cond_destroy(&S->wake);
    if (rc < 0)
        return k3_out_error(rc, "%s", fe.msg);
    return 0;
}
