/*
 * chat_loop.c - k3-run MODEL --chat: a conversation in the K3 chat format.
 *
 * On a terminal the user's lines are read with libedit (editing, history),
 * the answer is streamed as it is produced and the reasoning is dimmed (or
 * hidden unless --show-reasoning). From a pipe each line is one user turn and
 * stdout gets each answer followed by a newline (with --json one JSON object
 * per turn instead). Commands: /reset, /save FILE, /load FILE, /quit.
 *
 * State reuse (the invariant that makes turn N+1 cost only its new tokens):
 * the live conversation is always the rendering of the message list, and
 * `state_ids` are the ids the sequence has consumed. Each turn renders the
 * whole conversation and computes only what follows the longest prefix the
 * sequence (or the copy kept at the end of the last prompt) already holds.
 * When the model's turn re-renders to the ids it generated (a well-formed
 * turn in canonical tokens) the next turn starts right after them;
 * otherwise from the copy at the end of the last prompt, so the assistant
 * message is computed once in its stored form and the conversation still
 * equals what a history file re-renders to.
 *
 * Ctrl-C stops the current answer (or prompt computation), never the
 * program; at the input line it clears the line. The answer so far is kept.
 */
#include <errno.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <editline/readline.h>

#include "chat_loop.h"
#include "k3_chat.h"
#include "k3_cli.h"
#include "k3_engine.h"
#include "k3_gen.h"
#include "k3_io.h"
#include "k3_stream.h"
#include "k3_tok.h"
#include "state_file.h"

#define INPUT_MAX (1u << 20)   /* bytes of one user line (LIMITS.md) */

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

int k3_chat_wanted(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--chat"))
            return 1;
    return 0;
}

typedef struct chat_args {
    const char *model, *system, *history, *tok_dir, *ram, *state_save, *state_load;
    int force;
    uint64_t gen, ctx, chunk, threads, top_k, seed, ram_bytes;
    double temperature, top_p;
    int show_reasoning, json;
    k3_chat_opts fmt;
} chat_args;

/* ------------------------------------------------------------ the model */

/* The model and one sequence with the ids it has consumed. */
typedef struct backend {
    k3_engine *en;
    k3_seq *s;
    const k3_tok *tok;
    uint32_t V;
    float *logits;
    uint32_t *ids;        /* state_ids: what s has consumed */
    uint32_t n_ids;
    int logits_valid;     /* logits are those after ids[n_ids - 1] */
    /* the sequence as it was at the end of the last prompt */
    k3_seq *snap;
    float *snap_logits;
    uint32_t *snap_ids;
    uint32_t n_snap;
} backend;

static int backend_open(backend *b, const chat_args *a, k3_err *e)
{
    memset(b, 0, sizeof *b);
    k3_engine_opts eo;
    k3_engine_opts_init(&eo);
    eo.ram = a->ram;
    eo.max_chunk = (uint32_t)a->chunk;
    eo.tok_dir = a->tok_dir;
    int rc = k3_engine_open(&b->en, a->model, &eo, e);
    if (rc < 0)
        return rc;
    b->tok = k3_engine_tok(b->en);
    if (!b->tok)
        return k3_err_set(e, K3_ENOENT, "%s: chat needs the tokenizer files (tiktoken.model); use --tok DIR",
                          a->model);
    b->V = k3_engine_cfg(b->en)->vocab_size;
    k3_engine_info info;
    k3_engine_get_info(b->en, &info);
    if (info.streams) {
        /* two sequences: the live one and the copy kept at the end of each prompt */
        k3_engine_size sz = {(uint32_t)a->ctx, 2, 4 * 4ull * b->V};
        const k3_stream_plan *plan;
        if ((rc = k3_engine_plan(b->en, &sz, &plan, e)) < 0)
            return rc;
        k3_stream_plan_print(plan, stderr, "k3-run: ");
    }
    if ((rc = k3_engine_load(b->en, e)) < 0 || (rc = k3_seq_create(&b->s, b->en, (uint32_t)a->ctx, e)) < 0 ||
        (rc = k3_seq_create(&b->snap, b->en, (uint32_t)a->ctx, e)) < 0)
        return rc;
    b->logits = malloc((size_t)b->V * sizeof(float));
    b->snap_logits = malloc((size_t)b->V * sizeof(float));
    b->ids = malloc((size_t)a->ctx * sizeof(uint32_t));
    b->snap_ids = malloc((size_t)a->ctx * sizeof(uint32_t));
    if (!b->logits || !b->ids || !b->snap_logits || !b->snap_ids)
        return k3_err_set(e, K3_ENOMEM, "out of memory for the logits");
    return 0;
}

static void backend_close(backend *b)
{
    k3_seq_free(b->s);
    k3_seq_free(b->snap);
    k3_engine_close(b->en);
    free(b->snap_logits);
    free(b->snap_ids);
    free(b->logits);
    free(b->ids);
}

static void backend_reset(backend *b)
{
    k3_seq_reset(b->s);
    b->n_ids = 0;
    b->logits_valid = 0;
}

/* Feed ids (appending them to state_ids); logits of the last one. */
static int backend_feed(backend *b, const uint32_t *ids, uint32_t n, k3_err *e)
{
    k3_step_seq one = {b->s, ids, n, K3_LOGITS_LAST, b->logits};
    int rc = k3_engine_step(b->en, &one, 1, e);
    if (rc < 0) {
        backend_reset(b);   /* the sequence is unspecified after a failure */
        return rc;
    }
    memcpy(b->ids + b->n_ids, ids, (size_t)n * sizeof *ids);
    b->n_ids += n;
    b->logits_valid = 1;
    return 0;
}

/* ------------------------------------------------------------ one turn */

typedef struct turn_stats {
    uint32_t prompt_tokens, reused, computed, generated;
    double prompt_s, decode_s;
    const char *stop;
} turn_stats;

typedef struct chat {
    const chat_args *a;
    backend b;
    k3_chat conv;
    k3_chat_turn *parser;
    k3_tok_stream *ts;
    uint32_t *gen_ids;
    int tty_in, tty_out;
    uint32_t turns;
} chat;

/* Bring the sequence to the rendered prompt P, computing only what it does
 * not hold yet. */
static int prepare(chat *c, const uint32_t *P, uint32_t n, turn_stats *ts, k3_err *e)
{
    backend *b = &c->b;
    uint32_t keep = 0;
    if (b->n_ids <= n && memcmp(b->ids, P, (size_t)b->n_ids * sizeof *P) == 0 && (b->n_ids < n || b->logits_valid))
        keep = b->n_ids;
    if (keep == 0 && b->n_snap && b->n_snap <= n && memcmp(b->snap_ids, P, (size_t)b->n_snap * sizeof *P) == 0) {
        int rc = k3_seq_copy(b->s, b->snap, e);
        if (rc < 0)
            return rc;
        memcpy(b->ids, b->snap_ids, (size_t)b->n_snap * sizeof *P);
        memcpy(b->logits, b->snap_logits, (size_t)b->V * sizeof(float));
        b->n_ids = keep = b->n_snap;
        b->logits_valid = 1;
    }
    if (keep == 0)
        backend_reset(b);
    ts->reused = keep;
    ts->computed = 0;
    /* in chunks, so that Ctrl-C stops a long prompt */
    const uint32_t step = (uint32_t)c->a->chunk;
    for (uint32_t off = keep; off < n;) {
        if (interrupted)
            return K3_EINTR;
        uint32_t k = n - off < step ? n - off : step;
        int rc = backend_feed(b, P + off, k, e);
        if (rc < 0)
            return rc;
        off += k;
        ts->computed += k;
    }
    /* keep this point: the model's turn may not re-render to what it generates */
    int rc = k3_seq_copy(b->snap, b->s, e);
    if (rc < 0)
        return rc;
    memcpy(b->snap_ids, b->ids, (size_t)b->n_ids * sizeof *P);
    memcpy(b->snap_logits, b->logits, (size_t)b->V * sizeof(float));
    b->n_snap = b->n_ids;
    return 0;
}

static void put_out(const char *s, uint64_t n)
{
    if (n) {
        fwrite(s, 1, (size_t)n, stdout);
        fflush(stdout);
    }
}

static int print_json_turn(chat *c, const turn_stats *ts, const char *reasoning, const char *answer)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *g = cJSON_CreateArray();
    if (!o || !g) {
        cJSON_Delete(o);
        cJSON_Delete(g);
        return -1;
    }
    for (uint32_t i = 0; i < ts->generated; i++)
        cJSON_AddItemToArray(g, cJSON_CreateNumber(c->gen_ids[i]));
    cJSON_AddNumberToObject(o, "turn", c->turns);
    cJSON_AddNumberToObject(o, "prompt_tokens", ts->prompt_tokens);
    cJSON_AddNumberToObject(o, "reused_tokens", ts->reused);
    cJSON_AddNumberToObject(o, "computed_tokens", ts->computed);
    cJSON_AddItemToObject(o, "generated_ids", g);
    cJSON_AddStringToObject(o, "reasoning", reasoning);
    cJSON_AddStringToObject(o, "answer", answer);
    cJSON_AddStringToObject(o, "stop", ts->stop);
    cJSON_AddNumberToObject(o, "prompt_s", ts->prompt_s);
    cJSON_AddNumberToObject(o, "decode_s", ts->decode_s);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s)
        return -1;
    int rc = printf("%s\n", s) < 0 || fflush(stdout) != 0 ? -1 : 0;
    free(s);
    return rc;
}

/* Show bytes of one channel: the answer on stdout; the reasoning only with
 * --show-reasoning, dimmed on a terminal, else on stderr (stdout carries only
 * answers). *in_reasoning tracks the dim attribute. */
static void emit(chat *c, int ev, const char *bytes, uint64_t n, int *in_reasoning)
{
    if (c->a->json || n == 0 || (ev == K3_CHAT_EV_REASONING && !c->a->show_reasoning))
        return;
    if (ev == K3_CHAT_EV_REASONING && !c->tty_out) {
        fwrite(bytes, 1, (size_t)n, stderr);
        return;
    }
    if (ev == K3_CHAT_EV_REASONING && !*in_reasoning && c->tty_out)
        put_out("\033[2m", 4);
    if (ev == K3_CHAT_EV_ANSWER && *in_reasoning && c->tty_out)
        put_out("\033[0m\n", 5);
    *in_reasoning = ev == K3_CHAT_EV_REASONING;
    put_out(bytes, n);
}

/* The user said text: render, compute, generate, stream, add the answer. */
static int turn(chat *c, const char *text, uint64_t len, k3_err *e)
{
    const chat_args *a = c->a;
    backend *b = &c->b;
    char *clean;
    uint64_t clean_len;
    int rc = k3_chat_utf8_clean(text, len, &clean, &clean_len, e);
    if (rc < 0)
        return rc;
    rc = k3_chat_add(&c->conv, K3_CHAT_USER, clean, clean_len, NULL, 0, e);
    free(clean);
    if (rc < 0)
        return rc;
    uint32_t *P = NULL;
    uint64_t n = 0;
    turn_stats ts = {0};
    ts.stop = "length";
    rc = k3_chat_render(b->tok, &a->fmt, &c->conv, 1, &P, &n, e);
    if (rc == 0 && n + a->gen > a->ctx)
        rc = k3_err_set(e, K3_ELIMIT, "the conversation (%llu tokens) and an answer of up to %llu tokens do not fit "
                                      "the context of %llu (--ctx)", (unsigned long long)n,
                        (unsigned long long)a->gen, (unsigned long long)a->ctx);
    if (rc < 0) {
        free(P);
        c->conv.n--;   /* the user message goes again: the conversation stays as it was */
        free(c->conv.msgs[c->conv.n].content);
        return rc;
    }
    ts.prompt_tokens = (uint32_t)n;
    double t0 = k3_now_s();
    rc = prepare(c, P, (uint32_t)n, &ts, e);
    free(P);
    ts.prompt_s = k3_now_s() - t0;
    if (rc == K3_EINTR) {
        interrupted = 0;
        c->conv.n--;
        free(c->conv.msgs[c->conv.n].content);
        fprintf(stderr, "k3-run: interrupted: the message was not sent\n");
        return 0;
    }
    if (rc < 0)
        return rc;

    k3_sampler *smp;
    /* one seed per assistant message: a conversation continued from its
     * history samples as the uninterrupted one did */
    rc = k3_sampler_create(&smp, b->V, (float)a->temperature, (uint32_t)a->top_k, (float)a->top_p,
                           a->seed + c->conv.n, e);
    if (rc < 0)
        return rc;
    k3_chat_turn_reset(c->parser);
    int in_reasoning = 0, channel = K3_CHAT_EV_REASONING;
    k3_err pe = {0};   /* why the turn is malformed */
    t0 = k3_now_s();
    for (uint32_t i = 0; i < a->gen; i++) {
        if (interrupted) {
            ts.stop = "interrupted";
            break;
        }
        uint32_t id = k3_sampler_next(smp, b->logits);
        c->gen_ids[ts.generated++] = id;
        int ev = k3_chat_turn_push(c->parser, id, &pe);
        if (ev < 0) {
            ts.stop = "malformed";
            break;
        }
        if (ev == K3_CHAT_EV_END) {
            ts.stop = "end";
            break;
        }
        const char *bytes;
        uint64_t nb;
        if (ev == K3_CHAT_EV_REASONING || ev == K3_CHAT_EV_ANSWER) {
            if ((rc = k3_tok_stream_push(c->ts, id, &bytes, &nb, e)) < 0)
                break;
            channel = ev;
            emit(c, ev, bytes, nb, &in_reasoning);
        } else {
            /* markup ends a channel: what the decoder holds back belongs to it */
            k3_tok_stream_flush(c->ts, &bytes, &nb);
            emit(c, channel, bytes, nb, &in_reasoning);
        }
        if (i + 1 == a->gen)
            break;
        if ((rc = backend_feed(b, &id, 1, e)) < 0)
            break;
    }
    ts.decode_s = k3_now_s() - t0;
    k3_sampler_free(smp);
    if (interrupted) {
        interrupted = 0;
        if (!strcmp(ts.stop, "length"))
            ts.stop = "interrupted";
    }
    const char *bytes;
    uint64_t nb;
    k3_tok_stream_flush(c->ts, &bytes, &nb);
    if (rc < 0)
        return rc;
    emit(c, channel, bytes, nb, &in_reasoning);
    if (!a->json) {
        if (in_reasoning && c->tty_out)
            put_out("\033[0m", 4);
        put_out("\n", 1);
    }
    if (!strcmp(ts.stop, "malformed"))
        fprintf(stderr, "k3-run: warning: %s; the answer ends there\n", pe.msg);
    else if (strcmp(ts.stop, "end"))
        fprintf(stderr, "k3-run: the answer was cut (%s after %u tokens)\n", ts.stop, ts.generated);
    uint64_t rl, al;
    const char *r = k3_chat_turn_reasoning(c->parser, &rl), *an = k3_chat_turn_answer(c->parser, &al);
    char *rc_, *ac;
    uint64_t rcl, acl;
    if ((rc = k3_chat_utf8_clean(r, rl, &rc_, &rcl, e)) < 0)
        return rc;
    if ((rc = k3_chat_utf8_clean(an, al, &ac, &acl, e)) < 0) {
        free(rc_);
        return rc;
    }
    rc = k3_chat_add(&c->conv, K3_CHAT_ASSISTANT, ac, acl, a->fmt.thinking ? rc_ : NULL, rcl, e);
    c->turns++;
    if (rc == 0 && a->json && print_json_turn(c, &ts, rc_, ac) < 0)
        rc = k3_err_sys(e, K3_EIO, errno, "stdout: write failed");
    free(rc_);
    free(ac);
    return rc;
}

/* ------------------------------------------------------------ input */

/* One line from a pipe, without its newline; NULL at EOF. *too_long when
 * the line exceeds INPUT_MAX (the rest of it is skipped). */
static char *read_pipe_line(uint64_t *len, int *too_long, int *err)
{
    static char *buf;
    static uint64_t cap;
    uint64_t n = 0;
    int ch;
    *too_long = 0;
    *err = 0;
    while ((ch = getchar()) != EOF && ch != '\n') {
        if (n >= INPUT_MAX) {
            *too_long = 1;
            continue;
        }
        if (n + 2 > cap) {
            uint64_t nc = cap ? cap * 2 : 4096;
            char *p = realloc(buf, (size_t)nc);
            if (!p) {
                *err = 1;
                return NULL;
            }
            buf = p;
            cap = nc;
        }
        buf[n++] = (char)ch;
    }
    if (ch == EOF && n == 0 && !*too_long) {
        if (ferror(stdin))
            *err = 1;
        return NULL;
    }
    if (!buf && !(buf = malloc(1))) {
        *err = 1;
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* ------------------------------------------------------------ commands */

static int file_exists(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

/* Files this loop wrote (it may write them again). */
typedef struct saved {
    char **paths;
    uint32_t n;
} saved;

static int was_saved(const saved *s, const char *p)
{
    for (uint32_t i = 0; i < s->n; i++)
        if (!strcmp(s->paths[i], p))
            return 1;
    return 0;
}

static void say(chat *c, const char *fmt, const char *arg)
{
    fprintf(stderr, "k3-run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    (void)c;
}

static const char *skip_space(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    return s;
}

/* A command line (starts with '/'). Returns 1 to quit, 0 to go on, or a
 * negative error that ends the program. Errors the user can fix (a bad file)
 * are reported and the loop goes on. */
static int command(chat *c, saved *sv, const char *line)
{
    k3_err e = {0};
    if (!strcmp(line, "/quit") || !strcmp(line, "/exit"))
        return 1;
    if (!strcmp(line, "/reset")) {
        k3_chat_clear(&c->conv);
        if (c->a->system)
            k3_chat_add(&c->conv, K3_CHAT_SYSTEM, c->a->system, strlen(c->a->system), NULL, 0, &e);
        say(c, "%s", "a new conversation");
        return 0;
    }
    if (!strncmp(line, "/save ", 6) || !strncmp(line, "/load ", 6)) {
        const char *path = skip_space(line + 6);
        if (!*path) {
            say(c, "error: %s needs a file name", line[1] == 's' ? "/save" : "/load");
            return 0;
        }
        if (line[1] == 's') {
            if (file_exists(path) && !was_saved(sv, path)) {
                say(c, "error: %s exists: not overwritten (save to a new file)", path);
                return 0;
            }
            if (k3_chat_history_write(&c->conv, path, &e) < 0) {
                say(c, "error: %s", e.msg);
                return 0;
            }
            if (!was_saved(sv, path)) {
                char **p = realloc(sv->paths, (sv->n + 1) * sizeof *p);
                if (p && (p[sv->n] = strdup(path)) != NULL) {
                    sv->paths = p;
                    sv->n++;
                } else if (p) {
                    sv->paths = p;
                }
            }
            say(c, "saved %s", path);
            return 0;
        }
        k3_chat loaded = {0};
        if (k3_chat_history_read(&loaded, path, &e) < 0) {
            say(c, "error: %s", e.msg);
            return 0;
        }
        k3_chat_free(&c->conv);
        c->conv = loaded;
        say(c, "loaded %s", path);
        return 0;
    }
    say(c, "unknown command %s (/reset, /save FILE, /load FILE, /quit)", line);
    return 0;
}

/* ------------------------------------------------------------ options */

static void usage(FILE *f)
{
    fprintf(f, "usage: k3-run MODEL_DIR --chat [options]\n"
               "\n"
               "A conversation in the K3 chat format. On a terminal: line editing, the answer\n"
               "streamed, the reasoning dimmed; from a pipe: one user turn per line, each answer\n"
               "on stdout followed by a newline. Commands: /reset, /save FILE, /load FILE, /quit.\n"
               "Ctrl-C stops the current answer.\n"
               "\n"
               "  --system TEXT          a system message first\n"
               "  --history FILE         continue the conversation of FILE (JSON lines, as /save\n"
               "                         writes them)\n"
               "  --no-thinking          no thinking channel (default: thinking on)\n"
               "  --effort E             thinking effort: low, high, max (default max)\n"
               "  --show-reasoning       show the reasoning (dimmed; on stderr when stdout is not\n"
               "                         a terminal)\n"
               "  --json                 one JSON object per turn on stdout (reasoning, answer,\n"
               "                         generated ids, tokens reused and computed, timings)\n"
               "  --gen N                at most N tokens per answer (default 512)\n"
               "  --ctx N                tokens of the whole conversation (default 4096)\n"
               "  --state-load FILE      start from a saved sequence (k3-run --state-save, or a\n"
               "                         chat's): its ids are reused as far as they begin the\n"
               "                         conversation (with --history: turn one computes only\n"
               "                         its new tokens)\n"
               "  --state-save FILE      at the end, save the sequence of the conversation\n"
               "                         (--force: replace FILE)\n"
               "  --temperature T, --top-k K, --top-p P, --seed S   as without --chat; answer k\n"
               "                         of a conversation samples with seed S + its message index\n"
               "  --ram SIZE|floor|double|resident, --threads N, --chunk N, --tok DIR\n"
               "                         as without --chat\n");
}

static int die(int code, const char *msg)
{
    fflush(stdout);
    fprintf(stderr, "k3-run: error: %s\n", msg);
    return k3_err_exit_status(code);
}

static int dief(int code, const char *fmt, const char *arg)
{
    char buf[2048];
    snprintf(buf, sizeof buf, fmt, arg);
    return die(code, buf);
}

static int parse_f(const char *s, double lo, double hi, double *out)
{
    if (!s || !*s || *s == ' ')
        return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= lo && v <= hi))
        return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, chat_args *a)
{
    memset(a, 0, sizeof *a);
    a->gen = 512;
    a->ctx = 4096;
    a->chunk = 64;
    a->top_p = 1.0;
    a->fmt.thinking = 1;
    a->fmt.effort = K3_CHAT_MAX;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDV()                                                              \
    do {                                                                     \
        if (!v)                                                              \
            return dief(K3_EARG, "option %s needs a value (see --help)", o); \
        i++;                                                                 \
    } while (0)
        if (!strcmp(o, "--chat")) {
        } else if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            usage(stdout);
            return 1;
        } else if (!strcmp(o, "--system")) {
            NEEDV();
            a->system = v;
        } else if (!strcmp(o, "--history")) {
            NEEDV();
            a->history = v;
        } else if (!strcmp(o, "--state-save")) {
            NEEDV();
            a->state_save = v;
        } else if (!strcmp(o, "--state-load")) {
            NEEDV();
            a->state_load = v;
        } else if (!strcmp(o, "--force")) {
            a->force = 1;
        } else if (!strcmp(o, "--tok")) {
            NEEDV();
            a->tok_dir = v;
        } else if (!strcmp(o, "--no-thinking")) {
            a->fmt.thinking = 0;
        } else if (!strcmp(o, "--effort")) {
            NEEDV();
            k3_err e = {0};
            if (k3_chat_effort_parse(v, &a->fmt.effort, &e) < 0)
                return die(K3_EARG, e.msg);
        } else if (!strcmp(o, "--show-reasoning")) {
            a->show_reasoning = 1;
        } else if (!strcmp(o, "--json")) {
            a->json = 1;
        } else if (!strcmp(o, "--gen")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 1, 1u << 20, &a->gen))
                return dief(K3_EARG, "--gen: '%s' is not a count from 1 to 1048576", v);
        } else if (!strcmp(o, "--ctx")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 2, 1u << 24, &a->ctx))
                return dief(K3_EARG, "--ctx: '%s' is not a count from 2 to 16777216", v);
        } else if (!strcmp(o, "--chunk")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 1, 1u << 16, &a->chunk))
                return dief(K3_EARG, "--chunk: '%s' is not a count from 1 to 65536", v);
        } else if (!strcmp(o, "--threads")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 1, 1024, &a->threads))
                return dief(K3_EARG, "--threads: '%s' is not a count from 1 to 1024", v);
        } else if (!strcmp(o, "--top-k")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 0, UINT32_MAX, &a->top_k))
                return dief(K3_EARG, "--top-k: '%s' is not a count", v);
        } else if (!strcmp(o, "--seed")) {
            NEEDV();
            if (k3_cli_parse_u64(v, 0, UINT64_MAX, &a->seed))
                return dief(K3_EARG, "--seed: '%s' is not an unsigned 64-bit number", v);
        } else if (!strcmp(o, "--temperature")) {
            NEEDV();
            if (parse_f(v, 0.0, 1e6, &a->temperature))
                return dief(K3_EARG, "--temperature: '%s' is not a number from 0 to 1e6", v);
        } else if (!strcmp(o, "--top-p")) {
            NEEDV();
            if (parse_f(v, 0.0, 1.0, &a->top_p) || a->top_p <= 0.0)
                return dief(K3_EARG, "--top-p: '%s' is not a number in (0, 1]", v);
        } else if (!strcmp(o, "--ram")) {
            NEEDV();
            a->ram = v;
            if (k3_stream_parse_budget(v, &a->ram_bytes, NULL) < 0)
                return dief(K3_EARG, "--ram: '%s' is not a size (bytes, K/M/G/T) or a preset (floor, double, "
                                     "resident)", v);
        } else if (o[0] == '-' && o[1]) {
            return dief(K3_EARG, "unknown option %s with --chat (see k3-run --chat --help)", o);
        } else if (!a->model) {
            a->model = o;
        } else {
            return dief(K3_EARG, "unexpected argument '%s': one MODEL_DIR only", o);
        }
#undef NEEDV
    }
    if (!a->model)
        return die(K3_EARG, "no MODEL_DIR given (see k3-run --chat --help)");
    return 0;
}

/* --state-save at the end: the held sequence that begins the rendering of
 * the conversation (the live one, else the copy at the last prompt). */
static int save_state(chat *c, const uint8_t *fp, k3_err *e)
{
    backend *b = &c->b;
    uint32_t *R;
    uint64_t n;
    int rc = k3_chat_render(b->tok, &c->a->fmt, &c->conv, 0, &R, &n, e);
    if (rc < 0)
        return rc;
    const k3_seq *s = NULL;
    const uint32_t *ids = NULL;
    uint32_t k = 0;
    if (b->n_ids && b->n_ids <= n && !memcmp(b->ids, R, (size_t)b->n_ids * sizeof *R))
        s = b->s, ids = b->ids, k = b->n_ids;
    else if (b->n_snap && b->n_snap <= n && !memcmp(b->snap_ids, R, (size_t)b->n_snap * sizeof *R))
        s = b->snap, ids = b->snap_ids, k = b->n_snap;
    free(R);
    if (!s) {
        fprintf(stderr, "k3-run: warning: no computed state begins this conversation: %s not written\n",
                c->a->state_save);
        return 0;
    }
    rc = k3_state_save(c->a->state_save, c->a->force, fp, s, ids, k, e);
    if (rc == 0)
        fprintf(stderr, "k3-run: saved the state of %u tokens to %s\n", k, c->a->state_save);
    return rc;
}

/* ------------------------------------------------------------ main */

int k3_chat_main(int argc, char **argv)
{
    chat_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : rc;
    if (a.threads)
        omp_set_num_threads((int)a.threads);
    k3_err e = {0};
    chat c;
    memset(&c, 0, sizeof c);
    c.a = &a;
    c.tty_in = isatty(STDIN_FILENO);
    c.tty_out = isatty(STDOUT_FILENO);
    saved sv = {0};
    if (a.history)
        rc = k3_chat_history_read(&c.conv, a.history, &e);
    else if (a.system)
        rc = k3_chat_add(&c.conv, K3_CHAT_SYSTEM, a.system, strlen(a.system), NULL, 0, &e);
    if (rc == 0 && a.history && a.system)
        rc = k3_err_set(&e, K3_EARG, "--system and --history exclude each other (the history has its own)");
    if (rc == 0)
        rc = backend_open(&c.b, &a, &e);
    if (rc == 0)
        rc = k3_chat_turn_create(&c.parser, c.b.tok, &a.fmt, &e);
    if (rc == 0)
        rc = k3_tok_stream_create(&c.ts, c.b.tok, &e);
    if (rc == 0 && !(c.gen_ids = malloc((size_t)a.gen * sizeof(uint32_t))))
        rc = k3_err_set(&e, K3_ENOMEM, "out of memory");
    uint8_t fp[32];
    if (rc == 0 && (a.state_load || a.state_save))
        rc = k3_state_fingerprint(a.model, fp, &e);
    if (rc == 0 && a.state_save && !a.force && access(a.state_save, F_OK) == 0)
        rc = k3_err_set(&e, K3_EEXIST, "%s exists (use --force to replace it)", a.state_save);
    if (rc == 0 && a.state_load) {
        uint32_t *ids = NULL, n = 0;
        rc = k3_state_load(a.state_load, fp, c.b.s, &ids, &n, &e);
        if (rc == 0) {
            memcpy(c.b.ids, ids, (size_t)n * sizeof *ids);
            c.b.n_ids = n;
            c.b.logits_valid = 0;   /* a continuation computes at least one id */
        }
        free(ids);
    }
    if (rc < 0)
        goto out;

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);   /* no SA_RESTART: a read at the prompt returns */
    if (c.tty_in) {
        rl_initialize();
        using_history();
    }
    uint64_t line_no = 0;
    for (;;) {
        char *line = NULL;
        uint64_t len = 0;
        if (c.tty_in) {
            interrupted = 0;
            line = readline("> ");
            if (!line) {
                if (interrupted) {   /* Ctrl-C at the prompt: a fresh line */
                    interrupted = 0;
                    putchar('\n');
                    continue;
                }
                break;   /* EOF */
            }
            len = strlen(line);
            if (len > INPUT_MAX) {
                say(&c, "error: the line is longer than %s bytes: not sent", "1048576");
                free(line);
                continue;
            }
            if (len)
                add_history(line);
        } else {
            int too_long, err;
            char *l = read_pipe_line(&len, &too_long, &err);
            line_no++;
            if (err) {
                rc = k3_err_sys(&e, K3_EIO, errno, "stdin: read failed at line %llu", (unsigned long long)line_no);
                break;
            }
            if (!l)
                break;
            if (too_long) {
                rc = k3_err_set(&e, K3_ELIMIT, "stdin: line %llu is longer than %u bytes", (unsigned long long)line_no,
                                INPUT_MAX);
                break;
            }
            line = strdup(l);
            if (!line) {
                rc = k3_err_set(&e, K3_ENOMEM, "out of memory");
                break;
            }
        }
        int quit = 0;
        if (len == 0) {
        } else if (line[0] == '/') {
            quit = command(&c, &sv, line);
        } else {
            rc = turn(&c, line, len, &e);
        }
        free(line);
        if (rc < 0 && (rc == K3_EARG || rc == K3_ELIMIT) && c.tty_in) {
            say(&c, "error: %s", e.msg);   /* the user can fix it: go on */
            k3_err_clear(&e);
            rc = 0;
        }
        if (rc < 0 || quit)
            break;
    }
    if (rc == 0 && a.state_save)
        rc = save_state(&c, fp, &e);
out:
    for (uint32_t i = 0; i < sv.n; i++)
        free(sv.paths[i]);
    free(sv.paths);
    free(c.gen_ids);
    k3_tok_stream_free(c.ts);
    k3_chat_turn_free(c.parser);
    k3_chat_free(&c.conv);
    backend_close(&c.b);
    if (rc < 0)
        return die(rc, e.msg);
    return 0;
}
