/*
 * serve.h - k3-serve's parts (serve/SERVE.md):
 *
 *   api.c    requests: the JSON bodies of /v1/completions and
 *            /v1/chat/completions parsed into a srv_req (every field checked,
 *            400 with an OpenAI error object otherwise); responses and
 *            stream chunks built as JSON
 *   sched.c  the engine thread: queue, admission, the continuous-batching
 *            step, sampling, incremental detokenization, stop strings, the
 *            chat parser; counters for /metrics
 *   http.c   libmicrohttpd: routes, API key, body limit, waiting for a
 *            request's output, server-sent events, disconnects
 *   main.c   the command line, startup, signals
 *
 * Threads: libmicrohttpd runs one thread per connection; one engine thread
 * steps the model. They meet only in a srv_req, under the server's mutex:
 * the engine appends output, the connection thread reads it.
 */
#ifndef K3_SERVE_H
#define K3_SERVE_H

#include <pthread.h>
#include <stdint.h>

#include "k3_chat.h"
#include "k3_engine.h"
#include "k3_gen.h"
#include "k3_spec.h"

#define SRV_AUTO_MAX 64         /* --parallel auto: at most this many sequences */
#define SRV_AUTO_RESIDENT 8     /* --parallel auto with the weights resident (no budget) */
#define SRV_MAX_STOP 4          /* stop strings per request (as OpenAI) */
#define SRV_MAX_BIAS 1024       /* logit_bias entries per request */
#define SRV_STOP_MAX_BYTES 256  /* bytes per stop string */

enum { SRV_QUEUED = 0, SRV_ACTIVE = 1, SRV_DONE = 2 };
enum { SRV_CH_CONTENT = 0, SRV_CH_REASONING = 1 };

/* One piece of output, in order (channel + offset/length into the text of
 * that channel). */
typedef struct srv_piece {
    uint8_t ch;
    uint32_t off, len;
} srv_piece;

typedef struct srv_req {
    /* what was asked (api.c); immutable once queued */
    int chat;                  /* /v1/chat/completions */
    int stream, include_usage;
    uint32_t *prompt;          /* heap */
    uint32_t n_prompt;
    uint32_t max_tokens;
    double temperature, top_p;
    uint32_t top_k;
    uint64_t seed;
    char *stop[SRV_MAX_STOP];
    uint32_t n_stop;
    uint32_t *bias_id;         /* logit_bias: added to these ids' logits before sampling (heap) */
    float *bias;
    uint32_t n_bias;
    k3_chat_opts fmt;          /* chat: thinking, effort */
    int speculative;           /* -1: the server's default (--spec), 0 off, 1 on */
    char id[40];
    int64_t created;

    /* what the engine made (sched.c), under the server's mutex */
    int state;
    int cancel;                /* the client went away: free the sequence */
    char *text[2];             /* content, reasoning (valid UTF-8) */
    uint32_t len[2], cap[2];
    srv_piece *pieces;
    uint32_t n_pieces, cap_pieces;
    uint32_t n_gen;
    const char *finish;        /* "stop", "length"; NULL while running */
    int err_status;            /* != 0: the request failed (HTTP status) */
    char err_msg[K3_ERR_MSG_MAX + 64];
    pthread_cond_t cv;
    double t_queued, t_first;
    struct srv_req *next;      /* queue */
    int refs;                  /* connection + engine */

    /* the engine thread's own (sched.c) */
    k3_seq *seq;
    k3_sampler *smp;
    k3_tok_stream *ts;
    k3_chat_turn *turn;
    uint32_t fed;              /* prompt ids fed so far */
    uint32_t next_id;          /* the last sampled id, fed next */
    int have_next;
    k3_spec *spec;             /* speculating: the slot's verifier (NULL: plain decoding) */
    int spec_begun;            /* the verifier has the prompt and the first id */
    int channel;               /* chat: the channel the decoder's bytes belong to */
    char *hold;                /* content held back: may begin a stop string */
    uint32_t hold_len, hold_cap;
} srv_req;

typedef struct srv_cfg {
    const char *model_dir;
    const char *model_name;    /* /v1/models id */
    const char *host;
    uint32_t port;
    uint32_t parallel, queue, ctx, threads, chunk;   /* parallel 0: auto (until the plan) */
    uint64_t max_body;
    const char *api_key;
    const char *ram;
    uint32_t timeout_s;        /* idle connection timeout */
    uint32_t max_conn;         /* connections at once */
    int quiet;
    const char *spec;          /* --spec ngram[:K]: speculative decoding by default */
    k3_drafter *drafter;
    uint32_t spec_k;
} srv_cfg;

typedef struct srv_metrics {
    uint64_t requests, rejected_full, bad_requests, unauthorized, not_found, too_large, failed;
    uint64_t completed, cancelled;
    uint64_t prompt_tokens, gen_tokens, steps;
    double step_s, last_step_s;
    uint64_t last_step_tokens, last_step_bytes;
    uint64_t spec_passes, spec_drafted, spec_accepted;
} srv_metrics;

typedef struct srv {
    srv_cfg cfg;
    k3_engine *en;
    const k3_tok *tok;
    k3_chat_ctl ctl;
    int can_chat;
    uint32_t V;
    const uint32_t *eos;
    uint32_t n_eos;

    pthread_mutex_t mu;
    pthread_cond_t wake;       /* the engine thread waits here */
    pthread_t thread;
    int ready;                 /* loaded */
    int draining;              /* no new requests */
    int stop;                  /* the engine thread ends */
    int fatal;                 /* a failed step: every later request fails */
    char fatal_msg[K3_ERR_MSG_MAX + 64];
    srv_req *qhead, *qtail;
    uint32_t n_queued, n_active;
    uint32_t n_answering;      /* requests whose connection has not ended yet */
    srv_req **active;          /* parallel slots */
    k3_seq **seqs;             /* one per slot, made at load */
    k3_spec **specs;           /* --spec: one verifier per slot (its two sequences), made at load */
    uint32_t *drawn, *n_drawn; /* --spec: the ids each slot's entry drew in a step (slot x (K + 1)) */
    float *logits;             /* parallel x V */
    k3_step_seq *step;
    uint32_t *slot_of;         /* step entry -> slot */
    uint64_t ids_counter;
    srv_metrics m;
} srv;

/* ---- api.c ---- */

/* Parse a request body into r (zeroed by the caller). 0, or the HTTP status
 * (400) with a message in msg (and the offending field in *param). */
int srv_parse_request(srv *S, int chat, const char *body, uint64_t len, srv_req *r, char *msg, uint32_t cap,
                      const char **param);
/* An OpenAI error object. Heap string. */
char *srv_error_json(int status, const char *msg, const char *param);
/* The whole response of a finished request (non-streamed). Heap string. */
char *srv_response_json(const srv *S, const srv_req *r);
/* One stream chunk for a piece of output (or the first chunk with the role
 * when piece is NULL and fin is NULL; the last with finish_reason fin).
 * Heap string "data: {...}\n\n". */
char *srv_chunk_json(const srv *S, const srv_req *r, const srv_piece *piece, const char *fin);
/* The usage chunk (stream_options.include_usage). */
char *srv_usage_chunk(const srv *S, const srv_req *r);
char *srv_models_json(const srv *S);
void srv_req_free_fields(srv_req *r);

/* ---- sched.c ---- */

int srv_engine_start(srv *S, k3_err *e);   /* load, slots, the engine thread */
/* Queue r (owned by the caller's reference and, once queued, the engine's).
 * 0, or 503 (queue full / draining / not ready) with a message. */
int srv_submit(srv *S, srv_req *r, char *msg, uint32_t cap);
/* Drop one reference (the connection's or the engine's); the last frees r. Mutex held. */
void srv_req_unref(srv *S, srv_req *r);
/* Stop admitting; let the active requests finish (cancel_all: cancel them
 * too); wait for the engine thread to end. */
void srv_engine_stop(srv *S, int cancel_all);
/* Prometheus text. Heap string. */
char *srv_metrics_text(srv *S);

/* ---- http.c ---- */

typedef struct srv_http srv_http;
int srv_http_start(srv *S, srv_http **out, uint32_t *port, k3_err *e);
void srv_http_stop(srv_http *h);


#endif
