/*
 * serve_util.c - what the k3-serve tests share (serve_util.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_engine.h"
#include "k3_test.h"
#include "serve_util.h"

static char *slurp_path(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return strdup("");
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    size_t k;
    while ((k = fread(b + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 == cap)
            b = realloc(b, cap *= 2);
    }
    fclose(f);
    b[n] = 0;
    return b;
}

char *k3t_serve_log(const k3t_server *s) { return slurp_path(s->log); }

void k3t_serve_start(k3t_server *s, const char *model, const char *args)
{
    k3t_serve_start_with(s, "", "k3-serve", model, args);
}

void k3t_serve_start_with(k3t_server *s, const char *launcher, const char *tool, const char *model, const char *args)
{
    static int counter;
    memset(s, 0, sizeof *s);
    snprintf(s->log, sizeof s->log, "%s/serve%d.log", k3t_tmpdir(), counter++);
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "exec %s '%s/%s' '%s' --port 0 %s", launcher, k3t_bindir(), tool, model,
             args ? args : "");
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int nul = open("/dev/null", O_RDWR), lf = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(nul, 0);
        dup2(nul, 1);
        dup2(lf, 2);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < 1200; i++) {
        char *log = k3t_serve_log(s);
        const char *p = strstr(log, "listening on http://127.0.0.1:");
        if (p) {
            s->port = atoi(p + strlen("listening on http://127.0.0.1:"));
            free(log);
            return;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            k3t_fail(__FILE__, __LINE__, "k3-serve exited (status %d) before listening: %s", st, log);
        free(log);
        usleep(50 * 1000);
    }
    kill(pid, SIGKILL);
    k3t_fail(__FILE__, __LINE__, "k3-serve did not listen within 60 s");
}

int k3t_serve_stop(k3t_server *s, int sig)
{
    kill(s->pid, sig);
    for (int i = 0; i < 1200; i++) {
        int st;
        pid_t r = waitpid(s->pid, &st, WNOHANG);
        if (r == s->pid) {
            s->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        usleep(50 * 1000);
    }
    kill(s->pid, SIGKILL);
    k3t_fail(__FILE__, __LINE__, "k3-serve did not stop within 60 s of signal %d", sig);
    return -1;
}

int k3t_http(const k3t_server *s, const char *path, const char *body, const char *extra, char **resp)
{
    static int counter;
    char bf[4200], cmd[16384];
    bf[0] = 0;
    if (body) {
        snprintf(bf, sizeof bf, "%s/body%d.json", k3t_tmpdir(), counter++);
        FILE *f = fopen(bf, "wb");
        CHECK(f && fwrite(body, 1, strlen(body), f) == strlen(body) && fclose(f) == 0);
    }
    snprintf(cmd, sizeof cmd,
             "curl -sS -N --max-time 300 -o - -w '\\n%%{http_code}' %s %s%s%s 'http://127.0.0.1:%d%s'",
             extra ? extra : "", body ? "-H 'Content-Type: application/json' --data-binary '@" : "", bf,
             body ? "'" : "", s->port, path);
    char *out = NULL;
    int rc = k3t_run(cmd, &out, NULL);
    if (rc != 0) {
        free(out);
        if (resp)
            *resp = strdup("");
        return -rc;
    }
    char *nl = strrchr(out, '\n');
    int status = nl ? atoi(nl + 1) : -1;
    if (nl)
        *nl = 0;
    if (resp)
        *resp = out;
    else
        free(out);
    return status;
}

void k3t_http_all(const k3t_server *s, int n, const char *const *path, char *const *body, char **resp)
{
    static int counter;
    const char *t = k3t_tmpdir();
    const int c = counter++;
    size_t cap = 512 + (size_t)n * 256, at = 0;
    char *cmd = malloc(cap);
    CHECK(cmd != NULL);
    at += (size_t)snprintf(cmd, cap, "cd '%s'; ", t);
    for (int i = 0; i < n; i++) {
        char f[4200];
        snprintf(f, sizeof f, "%s/all%d-%d.json", t, c, i);
        FILE *fp = fopen(f, "wb");
        CHECK(fp && fputs(body[i], fp) >= 0 && fclose(fp) == 0);
        at += (size_t)snprintf(cmd + at, cap - at,
                               "curl -sS -N --max-time 600 -o all%d-%d.out -H 'Content-Type: application/json' "
                               "--data-binary @all%d-%d.json http://127.0.0.1:%d%s & ",
                               c, i, c, i, s->port, path[i]);
    }
    snprintf(cmd + at, cap - at, "wait");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "%s", cmd), 0);
    free(cmd);
    for (int i = 0; i < n; i++) {
        char f[4200];
        snprintf(f, sizeof f, "%s/all%d-%d.out", t, c, i);
        resp[i] = slurp_path(f);
    }
}

static char *dup_str(const cJSON *v) { return cJSON_IsString(v) ? strdup(v->valuestring) : NULL; }

char *k3t_resp_text(const char *body, char **reasoning, char **finish)
{
    cJSON *o = cJSON_Parse(body);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "choices"), 0);
    char *t = dup_str(cJSON_GetObjectItemCaseSensitive(c, "text"));
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(c, "message");
    if (m)
        t = dup_str(cJSON_GetObjectItemCaseSensitive(m, "content"));
    if (reasoning)
        *reasoning = m ? dup_str(cJSON_GetObjectItemCaseSensitive(m, "reasoning_content")) : NULL;
    if (finish)
        *finish = dup_str(cJSON_GetObjectItemCaseSensitive(c, "finish_reason"));
    cJSON_Delete(o);
    return t;
}

static void cat(char **s, const char *t)
{
    size_t a = *s ? strlen(*s) : 0, b = strlen(t);
    *s = realloc(*s, a + b + 1);
    memcpy(*s + a, t, b + 1);
}

char *k3t_sse_text(const char *body, char **reasoning, char **finish, int *done, int *n_events)
{
    char *t = strdup(""), *r = strdup("");
    *done = 0;
    *n_events = 0;
    if (finish)
        *finish = NULL;
    for (const char *p = body; p && *p;) {
        const char *e = strstr(p, "\n\n");
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char *ev = strndup(p, n);
        if (!strncmp(ev, "data: ", 6)) {
            if (!strcmp(ev + 6, "[DONE]")) {
                *done = 1;
            } else {
                cJSON *o = cJSON_Parse(ev + 6);
                const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "choices"), 0);
                const cJSON *d = cJSON_GetObjectItemCaseSensitive(c, "delta");
                const cJSON *x = d ? cJSON_GetObjectItemCaseSensitive(d, "content")
                                   : cJSON_GetObjectItemCaseSensitive(c, "text");
                if (cJSON_IsString(x))
                    cat(&t, x->valuestring);
                x = cJSON_GetObjectItemCaseSensitive(d, "reasoning_content");
                if (cJSON_IsString(x))
                    cat(&r, x->valuestring);
                x = cJSON_GetObjectItemCaseSensitive(c, "finish_reason");
                if (finish && cJSON_IsString(x)) {
                    free(*finish);
                    *finish = strdup(x->valuestring);
                }
                if (!o)
                    cat(&t, "<not JSON>");
                cJSON_Delete(o);
                (*n_events)++;
            }
        }
        free(ev);
        p = e ? e + 2 : NULL;
    }
    if (reasoning)
        *reasoning = r;
    else
        free(r);
    return t;
}

char *k3t_resp_strip(const char *body)
{
    cJSON *o = cJSON_Parse(body);
    if (!o)
        return strdup(body);
    cJSON_DeleteItemFromObjectCaseSensitive(o, "id");
    cJSON_DeleteItemFromObjectCaseSensitive(o, "created");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

double k3t_metric(const k3t_server *s, const char *name)
{
    char *m = NULL, auth[256] = "";
    if (s->key)
        snprintf(auth, sizeof auth, "-H 'Authorization: Bearer %s'", s->key);
    if (k3t_http(s, "/metrics", NULL, auth, &m) != 200) {
        free(m);
        return -1;
    }
    double v = -1;
    size_t n = strlen(name);
    for (const char *p = m; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, name, n) && p[n] == ' ') {
            v = strtod(p + n + 1, NULL);
            break;
        }
    free(m);
    return v;
}

/* "\"logit_bias\":{...}" banning the ids that end a completion (the
 * tokenizer's end-of-sequence ids), so that a request runs to max_tokens
 * whatever the random model would have sampled */
void k3t_no_eos_bias(const char *model, char *out, size_t cap)
{
    k3_tok *tok = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_engine_tok_open(&tok, model, &e), 0);
    const uint32_t *ids;
    uint32_t n;
    k3_tok_eos_ids(tok, &ids, &n);
    CHECK(n >= 1);
    size_t o = (size_t)snprintf(out, cap, "\"logit_bias\":{");
    for (uint32_t i = 0; i < n && o < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%s\"%u\":-100", i ? "," : "", ids[i]);
    if (o < cap)
        snprintf(out + o, cap - o, "}");
    k3_tok_close(tok);
}
