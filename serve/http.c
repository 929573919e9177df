/*
 * http.c - k3-serve's HTTP side over libmicrohttpd (one thread per
 * connection, so a connection may wait for its request's output): routes,
 * the API key, the body limit, answers and server-sent events, and the
 * client that goes away (its request is cancelled; the engine frees the
 * sequence at its next step).
 */
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <microhttpd.h>

#include "serve.h"

struct srv_http {
    struct MHD_Daemon *d;
};

enum { R_NONE = 0, R_COMPLETIONS, R_CHAT, R_MODELS, R_HEALTH, R_METRICS };

typedef struct conn {
    srv *S;
    int route, is_post;
    char *body;
    size_t len, cap;
    int too_large, answered;   /* answered: a response was queued before the body */
    srv_req *r;
    MHD_socket fd;
    /* streaming */
    uint32_t cursor;           /* pieces sent */
    int sent_role, sent_end;
    char *out;                 /* bytes of the current event not yet written */
    size_t out_len, out_off;
} conn;

/* ------------------------------------------------------------ answers */

static enum MHD_Result answer(struct MHD_Connection *c, int status, const char *type, char *body)
{
    if (!body) {
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,"
                      "\"code\":\"500\"}}");
        status = 500;
        if (!body)
            return MHD_NO;
    }
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", type);
    if (status == 503)
        MHD_add_response_header(resp, "Retry-After", "1");
    if (status == 401)
        MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return ok;
}

static enum MHD_Result answer_error(struct MHD_Connection *c, int status, const char *msg, const char *param)
{
    return answer(c, status, "application/json", srv_error_json(status, msg, param));
}

/* 1 when the client has closed its end. */
static int gone(MHD_socket fd)
{
    if (fd == MHD_INVALID_SOCKET)
        return 0;
    struct pollfd p = {fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static void wait_a_bit(srv *S, srv_req *r)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 50 * 1000 * 1000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&r->cv, &S->mu, &ts);
}

static void cancel(srv *S, srv_req *r)
{
    if (r->state != SRV_DONE && !r->cancel) {
        r->cancel = 1;
        pthread_cond_signal(&S->wake);
    }
}

/* --------------------------------------------------------- streaming */

static char *done_events(conn *k)
{
    srv *S = k->S;
    srv_req *r = k->r;
    if (r->err_status) {
        char *j = srv_error_json(r->err_status, r->err_msg, NULL);
        if (!j)
            return NULL;
        size_t n = strlen(j) + 32;
        char *s = malloc(n);
        if (s)
            snprintf(s, n, "data: %s\n\ndata: [DONE]\n\n", j);
        free(j);
        return s;
    }
    char *f = srv_chunk_json(S, r, NULL, r->finish ? r->finish : "stop");
    char *u = r->include_usage ? srv_usage_chunk(S, r) : strdup("");
    char *s = NULL;
    if (f && u) {
        size_t n = strlen(f) + strlen(u) + 16;
        if ((s = malloc(n)))
            snprintf(s, n, "%s%sdata: [DONE]\n\n", f, u);
    }
    free(f);
    free(u);
    return s;
}

/* The next event(s) to write, or NULL at the end (mutex held). */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    conn *k = cls;
    srv *S = k->S;
    if (k->out_off < k->out_len) {
        size_t n = k->out_len - k->out_off;
        if (n > max)
            n = max;
        memcpy(buf, k->out + k->out_off, n);
        k->out_off += n;
        return (ssize_t)n;
    }
    free(k->out);
    k->out = NULL;
    k->out_len = k->out_off = 0;
    if (k->sent_end)
        return MHD_CONTENT_READER_END_OF_STREAM;
    srv_req *r = k->r;
    pthread_mutex_lock(&S->mu);
    for (;;) {
        if (!k->sent_role && r->chat) {
            k->out = srv_chunk_json(S, r, NULL, NULL);
            k->sent_role = 1;
            break;
        }
        if (k->cursor < r->n_pieces) {
            srv_piece p = r->pieces[k->cursor++];
            if (p.len == 0)
                continue;
            k->out = srv_chunk_json(S, r, &p, NULL);
            break;
        }
        if (r->state == SRV_DONE) {
            k->out = done_events(k);
            k->sent_end = 1;
            break;
        }
        if (gone(k->fd)) {
            cancel(S, r);
            pthread_mutex_unlock(&S->mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        wait_a_bit(S, r);
    }
    pthread_mutex_unlock(&S->mu);
    if (!k->out)
        return MHD_CONTENT_READER_END_WITH_ERROR;   /* out of memory: the client sees a cut stream */
    k->out_len = strlen(k->out);
    return stream_reader(cls, pos, buf, max);
}

/* ------------------------------------------------------------ requests */

static int authorized(const srv *S, struct MHD_Connection *c)
{
    if (!S->cfg.api_key)
        return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7))
        return 0;
    h += 7;
    size_t a = strlen(h), b = strlen(S->cfg.api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++)
        diff |= (unsigned char)h[i] ^ (unsigned char)S->cfg.api_key[i % (b ? b : 1)];
    return diff == 0;
}

static int route_of(const char *url)
{
    static const struct { const char *p; int r; } t[] = {
        {"/v1/completions", R_COMPLETIONS}, {"/v1/chat/completions", R_CHAT}, {"/v1/models", R_MODELS},
        {"/health", R_HEALTH},              {"/metrics", R_METRICS},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(url, t[i].p))
            return t[i].r;
    return R_NONE;
}

static void count(srv *S, uint64_t *what)
{
    pthread_mutex_lock(&S->mu);
    (*what)++;
    pthread_mutex_unlock(&S->mu);
}

static enum MHD_Result get_route(srv *S, struct MHD_Connection *c, int route)
{
    if (route == R_HEALTH) {
        pthread_mutex_lock(&S->mu);
        int ready = S->ready, fatal = S->fatal, draining = S->draining;
        pthread_mutex_unlock(&S->mu);
        const char *st = !ready ? "loading" : fatal ? "failed" : draining ? "draining" : "ok";
        char body[64];
        snprintf(body, sizeof body, "{\"status\":\"%s\"}", st);
        return answer(c, ready && !fatal && !draining ? 200 : 503, "application/json", strdup(body));
    }
    if (route == R_METRICS)
        return answer(c, 200, "text/plain; version=0.0.4", srv_metrics_text(S));
    return answer(c, 200, "application/json", srv_models_json(S));
}

static enum MHD_Result start_request(conn *k, struct MHD_Connection *c)
{
    srv *S = k->S;
    char msg[512];
    const char *param = NULL;
    count(S, &S->m.requests);
    if (k->too_large) {
        count(S, &S->m.too_large);
        snprintf(msg, sizeof msg, "the body is over %llu bytes (--max-body)", (unsigned long long)S->cfg.max_body);
        return answer_error(c, 413, msg, NULL);
    }
    srv_req *r = calloc(1, sizeof *r);
    if (!r)
        return answer_error(c, 500, "out of memory", NULL);
    pthread_cond_init(&r->cv, NULL);
    r->refs = 1;
    k->r = r;
    pthread_mutex_lock(&S->mu);
    S->n_answering++;
    pthread_mutex_unlock(&S->mu);
    int st = srv_parse_request(S, k->route == R_CHAT, k->body ? k->body : "", k->len, r, msg, sizeof msg, &param);
    if (st) {
        count(S, &S->m.bad_requests);
        return answer_error(c, st, msg, param);
    }
    pthread_mutex_lock(&S->mu);
    snprintf(r->id, sizeof r->id, "%s-%llu", r->chat ? "chatcmpl" : "cmpl", (unsigned long long)++S->ids_counter);
    pthread_mutex_unlock(&S->mu);
    r->created = (int64_t)time(NULL);
    if ((st = srv_submit(S, r, msg, sizeof msg)))
        return answer_error(c, st, msg, NULL);
    if (r->stream) {
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, k, NULL);
        if (!resp)
            return MHD_NO;
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ok;
    }
    /* this connection's own thread waits for the whole answer */
    pthread_mutex_lock(&S->mu);
    while (r->state != SRV_DONE) {
        if (gone(k->fd)) {
            cancel(S, r);
            pthread_mutex_unlock(&S->mu);
            return MHD_NO;
        }
        wait_a_bit(S, r);
    }
    pthread_mutex_unlock(&S->mu);
    if (r->err_status)
        return answer_error(c, r->err_status, r->err_msg, NULL);
    return answer(c, 200, "application/json", srv_response_json(S, r));
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    srv *S = cls;
    conn *k = *con_cls;
    if (!k) {
        k = calloc(1, sizeof *k);
        if (!k)
            return MHD_NO;
        *con_cls = k;
        k->S = S;
        k->fd = MHD_INVALID_SOCKET;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci)
            k->fd = ci->connect_fd;
        k->route = route_of(url);
        k->is_post = !strcmp(method, "POST");
        int post_route = k->route == R_COMPLETIONS || k->route == R_CHAT;
        k->answered = 1;   /* unless the body is wanted (below) */
        if (k->route == R_NONE) {
            count(S, &S->m.not_found);
            char msg[256];
            snprintf(msg, sizeof msg, "no route %.8s %.160s", method, url);
            return answer_error(c, 404, msg, NULL);
        }
        if (post_route != k->is_post || (!k->is_post && strcmp(method, "GET") && strcmp(method, "HEAD"))) {
            char msg[256];
            snprintf(msg, sizeof msg, "%.160s takes %s, not %.8s", url, post_route ? "POST" : "GET", method);
            return answer_error(c, 405, msg, NULL);
        }
        if (k->route != R_HEALTH && !authorized(S, c)) {
            count(S, &S->m.unauthorized);
            return answer_error(c, 401, "a valid API key is required (Authorization: Bearer KEY)", NULL);
        }
        if (!k->is_post)
            return get_route(S, c, k->route);
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl && strtoull(cl, NULL, 10) > S->cfg.max_body) {
            count(S, &S->m.requests);
            count(S, &S->m.too_large);
            char msg[256];
            snprintf(msg, sizeof msg, "the body is over %llu bytes (--max-body)",
                     (unsigned long long)S->cfg.max_body);
            return answer_error(c, 413, msg, NULL);
        }
        k->answered = 0;
        return MHD_YES;
    }
    if (k->answered) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!k->too_large) {
            if (k->len + *upload_size > S->cfg.max_body) {
                k->too_large = 1;
                free(k->body);
                k->body = NULL;
                k->len = k->cap = 0;
            } else {
                if (k->len + *upload_size + 1 > k->cap) {
                    size_t cap = k->cap ? k->cap : 4096;
                    while (cap < k->len + *upload_size + 1)
                        cap *= 2;
                    char *b = realloc(k->body, cap);
                    if (!b)
                        return MHD_NO;
                    k->body = b;
                    k->cap = cap;
                }
                memcpy(k->body + k->len, upload, *upload_size);
                k->len += *upload_size;
                k->body[k->len] = 0;   /* the parser checks nothing follows the value */
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    k->answered = 1;
    return start_request(k, c);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode why)
{
    srv *S = cls;
    conn *k = *con_cls;
    if (!k)
        return;
    if (k->r) {
        pthread_mutex_lock(&S->mu);
        cancel(S, k->r);   /* nothing if it is done */
        srv_req_unref(S, k->r);
        S->n_answering--;
        pthread_mutex_unlock(&S->mu);
    }
    free(k->out);
    free(k->body);
    free(k);
    *con_cls = NULL;
}

static void on_log(void *cls, const char *fmt, va_list ap)
{
    srv *S = cls;
    if (S->cfg.quiet)
        return;
    fputs("k3-serve: http: ", stderr);
    vfprintf(stderr, fmt, ap);
}

int srv_http_start(srv *S, srv_http **out, uint32_t *port, k3_err *e)
{
    *out = NULL;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char ps[16];
    snprintf(ps, sizeof ps, "%u", S->cfg.port);
    int g = getaddrinfo(S->cfg.host, ps, &hints, &ai);
    if (g != 0)
        return k3_err_set(e, K3_EARG, "--host %s: %s", S->cfg.host, gai_strerror(g));
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG | (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    struct MHD_Daemon *d =
        MHD_start_daemon(flags, (uint16_t)S->cfg.port, NULL, NULL, on_request, S, MHD_OPTION_EXTERNAL_LOGGER, on_log, S,
                         MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                         MHD_OPTION_NOTIFY_COMPLETED, on_completed, S, MHD_OPTION_CONNECTION_TIMEOUT,
                         (unsigned)S->cfg.timeout_s, MHD_OPTION_CONNECTION_LIMIT, (unsigned)S->cfg.max_conn,
                         MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512u << 10), MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!d)
        return k3_err_set(e, K3_EIO, "cannot listen on %s port %u (in use, or not an address of this machine)",
                          S->cfg.host, S->cfg.port);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    *port = di ? di->port : S->cfg.port;
    srv_http *h = calloc(1, sizeof *h);
    if (!h) {
        MHD_stop_daemon(d);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    h->d = d;
    *out = h;
    return 0;
}

void srv_http_stop(srv_http *h)
{
    if (!h)
        return;
    MHD_stop_daemon(h->d);
    free(h);
}
