/*
 * serve_util.h - what the k3-serve tests share: a server started on a free
 * loopback port (--port 0, the port read from its "listening on" line) and
 * stopped by the test, requests through curl, and the text of a response or
 * of a stream of server-sent events.
 */
#ifndef K3_SERVE_UTIL_H
#define K3_SERVE_UTIL_H

#include <sys/types.h>

typedef struct k3t_server {
    pid_t pid;
    int port;
    char log[4096];
    const char *key;           /* the --api-key, sent by k3t_metric (NULL: none) */
} k3t_server;

/* Start k3-serve MODEL --port 0 ARGS (stderr to a log in the test's
 * directory) and wait until it listens. */
void k3t_serve_start(k3t_server *s, const char *model, const char *args);
/* The same with another build of the server (tool, e.g. "k3-serve-mpi")
 * under a launcher command line (e.g. "mpirun -np 2"; "" for none). */
void k3t_serve_start_with(k3t_server *s, const char *launcher, const char *tool, const char *model, const char *args);
/* Send sig and wait for the exit (at most 60 s): the exit status. */
int k3t_serve_stop(k3t_server *s, int sig);
/* The server's log so far (heap). */
char *k3t_serve_log(const k3t_server *s);

/* curl -X POST (body non-NULL) or GET PATH: the HTTP status, *resp the body
 * (heap). extra: more curl options (may be NULL). */
int k3t_http(const k3t_server *s, const char *path, const char *body, const char *extra, char **resp);

/* The generated text of a response body: choices[0].text, or
 * .message.content (and .message.reasoning_content into *reasoning).
 * Heap strings; NULL if the body is not such a response. *finish: the
 * finish_reason (heap). */
char *k3t_resp_text(const char *body, char **reasoning, char **finish);
/* The same for an event stream: the concatenated texts; *done is 1 when the
 * stream ended with "data: [DONE]"; *n_events counts the chunks. */
char *k3t_sse_text(const char *body, char **reasoning, char **finish, int *done, int *n_events);
/* The body without its "id" and "created" values (heap), to compare
 * responses of different requests. */
char *k3t_resp_strip(const char *body);
/* POST body[i] to path[i] for i < n, all at once (one shell, n curls in the
 * background): resp[i] the bodies received (heap). */
void k3t_http_all(const k3t_server *s, int n, const char *const *path, char *const *body, char **resp);
/* A value from /metrics (-1 if absent). */
double k3t_metric(const k3t_server *s, const char *name);
/* "\"logit_bias\":{...}" banning the model's end-of-sequence ids: a request
 * with it runs to max_tokens whatever the random model would sample. */
void k3t_no_eos_bias(const char *model, char *out, size_t cap);

#endif
