/*
 * t_serve_hostile.c - k3-serve against clients that misbehave: malformed
 * JSON, wrong types, values out of range, a huge max_tokens, a 10 MB body,
 * unknown routes, wrong keys, a client that never reads its stream, one that
 * hangs up mid-stream (its sequence is freed), 200 requests against
 * --queue 4. Each gets its status (never 500), nothing crashes, and the
 * server still answers afterwards and exits 0 on SIGINT. Also the command
 * line's errors.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "k3_engine.h"
#include "k3_test.h"
#include "serve_util.h"

static const char *tiny(void)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/m", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", dir), 0);
    return dir;
}

static void expect(const k3t_server *s, const char *path, const char *body, const char *extra, int status,
                   const char *param)
{
    char *resp = NULL;
    int st = k3t_http(s, path, body, extra, &resp);
    if (st != status)
        k3t_fail(__FILE__, __LINE__, "%s %s: want %d, got %d: %s", path, body ? body : "(GET)", status, st, resp);
    if (status >= 400) {
        CHECK_STR_CONTAINS(resp, "{\"error\":{\"message\":\"");
        if (param) {
            char p[128];
            snprintf(p, sizeof p, "\"param\":\"%s\"", param);
            CHECK_STR_CONTAINS(resp, p);
        }
    }
    free(resp);
}

static void still_serves(const k3t_server *s)
{
    expect(s, "/v1/completions", "{\"prompt\":\"still here\",\"max_tokens\":3,\"temperature\":0}",
           "-H 'Authorization: Bearer k'", 200, NULL);
}

/* Poll a metric until it equals want (at most 20 s). */
static void wait_metric(const k3t_server *s, const char *name, double want)
{
    double v = -1;
    for (int i = 0; i < 400; i++) {
        if ((v = k3t_metric(s, name)) == want)
            return;
        usleep(50 * 1000);
    }
    k3t_fail(__FILE__, __LINE__, "%s stayed %g, want %g", name, v, want);
}

K3_TEST_TIMEOUT(serve_hostile_clients_get_their_status_and_later_requests_are_served, 240)
{
    const char *m = tiny(), *tmp = k3t_tmpdir();
    k3t_server s;
    k3t_serve_start(&s, m, "--parallel 2 --queue 8 --ctx 4096 --api-key k --timeout 2");
    s.key = "k";
    const char *K = "-H 'Authorization: Bearer k'";
    const char *C = "/v1/completions", *H = "/v1/chat/completions";
    /* keys */
    expect(&s, C, "{\"prompt\":\"x\"}", NULL, 401, NULL);
    expect(&s, C, "{\"prompt\":\"x\"}", "-H 'Authorization: Bearer kk'", 401, NULL);
    expect(&s, C, "{\"prompt\":\"x\"}", "-H 'Authorization: Bearer '", 401, NULL);
    expect(&s, "/metrics", NULL, NULL, 401, NULL);
    expect(&s, "/health", NULL, NULL, 200, NULL);
    /* routes and methods */
    expect(&s, "/v1/nothing", "{}", K, 404, NULL);
    expect(&s, "/", NULL, K, 404, NULL);
    expect(&s, C, NULL, K, 405, NULL);
    expect(&s, "/v1/models", "{}", K, 405, NULL);
    /* malformed bodies */
    expect(&s, C, "{\"prompt\":", K, 400, NULL);
    expect(&s, C, "", K, 400, NULL);
    expect(&s, C, "[1,2]", K, 400, NULL);
    expect(&s, C, "{\"prompt\":\"x\"} trailing", K, 400, NULL);
    expect(&s, C, "{\"max_tokens\":3}", K, 400, "prompt");
    /* wrong types and values */
    expect(&s, C, "{\"prompt\":5}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":[]}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":[1,-2]}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":[1,99999999]}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":[1.5]}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":[\"a\",\"b\"]}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":\"\"}", K, 400, "prompt");
    expect(&s, C, "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", K, 400, "max_tokens");
    expect(&s, C, "{\"prompt\":\"x\",\"max_tokens\":0}", K, 400, "max_tokens");
    expect(&s, C, "{\"prompt\":\"x\",\"max_tokens\":1000000000000}", K, 400, "max_tokens");
    expect(&s, C, "{\"prompt\":\"x\",\"max_tokens\":1e300}", K, 400, "max_tokens");
    expect(&s, C, "{\"prompt\":\"x\",\"max_tokens\":4096}", K, 400, "max_tokens");
    expect(&s, C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", K, 400, "temperature");
    expect(&s, C, "{\"prompt\":\"x\",\"temperature\":-1}", K, 400, "temperature");
    expect(&s, C, "{\"prompt\":\"x\",\"top_p\":0}", K, 400, "top_p");
    expect(&s, C, "{\"prompt\":\"x\",\"top_k\":-3}", K, 400, "top_k");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":[1]}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":{\"abc\":1}}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":{\"-1\":1}}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":{\"99999999\":1}}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":101}}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"logit_bias\":{\"5\":\"1\"}}", K, 400, "logit_bias");
    expect(&s, C, "{\"prompt\":\"x\",\"seed\":0.5}", K, 400, "seed");
    expect(&s, C, "{\"prompt\":\"x\",\"n\":2}", K, 400, "n");
    expect(&s, C, "{\"prompt\":\"x\",\"stream\":\"yes\"}", K, 400, "stream");
    expect(&s, C, "{\"prompt\":\"x\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", K, 400, "stop");
    expect(&s, C, "{\"prompt\":\"x\",\"stop\":[3]}", K, 400, "stop");
    expect(&s, C, "{\"prompt\":\"x\",\"stop\":\"\"}", K, 400, "stop");
    expect(&s, C, "{\"prompt\":\"x\",\"stream_options\":5}", K, 400, "stream_options");
    expect(&s, C, "{\"prompt\":\"a\\u0000b\"}", K, 400, NULL);
    expect(&s, C, "{\"prompt\":\"x\",\"stop\":\"\xff\"}", K, 400, "stop");
    expect(&s, H, "{\"messages\":\"hi\"}", K, 400, "messages");
    expect(&s, H, "{\"messages\":[]}", K, 400, "messages");
    expect(&s, H, "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", K, 400, "messages");
    expect(&s, H, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", K, 400, "messages");
    expect(&s, H, "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\"}]}", K, 400, "messages");
    expect(&s, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\"}]}", K,
           400, "messages");
    expect(&s, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"reasoning_effort\":\"medium\"}", K, 400,
           "reasoning_effort");
    /* deep nesting, and a 10 MB body (Content-Length, and chunked) */
    char *deep = malloc(20001);
    memset(deep, '[', 20000);
    deep[20000] = 0;
    expect(&s, C, deep, K, 400, NULL);
    free(deep);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "head -c 10485760 /dev/zero | tr '\\0' 'a' > %s/big", tmp), 0);
    char extra[8192];
    snprintf(extra, sizeof extra, "%s --data-binary @%s/big", K, tmp);
    expect(&s, C, NULL, extra, 413, NULL);
    snprintf(extra, sizeof extra, "%s -H 'Transfer-Encoding: chunked' --data-binary @%s/big", K, tmp);
    expect(&s, C, NULL, extra, 413, NULL);
    still_serves(&s);

    /* a client that sends a streamed request and never reads: the engine
     * never waits for it (others are served while it generates its 4000
     * tokens into its own buffer); its connection ends when it closes */
    double cancelled = k3t_metric(&s, "k3_requests_cancelled_total");
    CHECK(cancelled >= 0);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    int small = 1024;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)s.port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK_EQ_INT(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char bias[512], b[768];
    k3t_no_eos_bias(m, bias, sizeof bias);
    snprintf(b, sizeof b, "{\"prompt\":\"slow\",\"max_tokens\":4000,\"stream\":true,%s}", bias);
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(b), b);
    CHECK_EQ_INT(write(fd, req, (size_t)n), n);
    still_serves(&s);
    still_serves(&s);
    CHECK(k3t_metric(&s, "k3_active_sequences") >= 1);   /* still generating */
    close(fd);
    wait_metric(&s, "k3_active_sequences", 0);
    still_serves(&s);

    /* a client that hangs up mid-stream: its sequence is freed */
    cancelled = k3t_metric(&s, "k3_requests_cancelled_total");
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "curl -sS -N -H 'Authorization: Bearer k' --data-binary "
                          "'{\"prompt\":\"go on\",\"max_tokens\":4000,\"stream\":true,%s}' "
                          "http://127.0.0.1:%d/v1/completions | head -c 600 > /dev/null; true",
                          bias, s.port), 0);
    wait_metric(&s, "k3_active_sequences", 0);
    CHECK(k3t_metric(&s, "k3_requests_cancelled_total") >= cancelled + 1);
    still_serves(&s);
    CHECK_EQ_INT(k3t_metric(&s, "k3_requests_rejected_total{reason=\"engine\"}"), 0);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGINT), 0);
}

K3_TEST_TIMEOUT(serve_200_requests_against_queue_4_get_200_or_503_and_the_server_goes_on, 240)
{
    const char *m = tiny(), *tmp = k3t_tmpdir();
    k3t_server s;
    k3t_serve_start(&s, m, "--parallel 2 --queue 4 --ctx 256");
    char *out = NULL;
    /* 200 requests, 100 at a time; each prints its status */
    CHECK_EQ_INT(k3t_runf(&out, NULL,
                          "cd %s; seq 200 | xargs -P 100 -I{} curl -sS -o /dev/null -w '%%{http_code}\\n' --max-time 120 "
                          "--data-binary '{\"prompt\":\"request {}\",\"max_tokens\":40,\"temperature\":0}' "
                          "http://127.0.0.1:%d/v1/completions | sort | uniq -c",
                          tmp, s.port), 0);
    int ok = 0, full = 0, other = 0;
    for (char *p = out; p && *p;) {
        int cnt, code;
        if (sscanf(p, "%d %d", &cnt, &code) == 2) {
            if (code == 200)
                ok += cnt;
            else if (code == 503)
                full += cnt;
            else
                other += cnt;
        }
        p = strchr(p, '\n');
        p = p ? p + 1 : NULL;
    }
    if (other || ok + full != 200 || ok < 6 || full < 1)
        k3t_fail(__FILE__, __LINE__, "200 requests against --queue 4: %d ok, %d 503, %d other:\n%s", ok, full, other,
                 out);
    free(out);
    CHECK(k3t_metric(&s, "k3_requests_rejected_total{reason=\"queue_full\"}") == full);
    wait_metric(&s, "k3_queue_depth", 0);
    expect(&s, "/v1/completions", "{\"prompt\":\"after\",\"max_tokens\":3}", NULL, 200, NULL);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGTERM), 0);
}

K3_TEST(serve_command_line_errors_are_one_line_with_the_documented_status)
{
    const char *m = tiny();
    char *err = NULL;
    struct {
        const char *args;
        int code;
        const char *msg;
    } c[] = {
        {"", 2, "no model directory"},
        {"%s --bogus 1", 2, "unknown option --bogus"},
        {"%s --port 70000", 2, "--port"},
        {"%s --parallel 0", 2, "--parallel"},
        {"%s --api-key ''", 2, "the key is empty"},
        {"%s --max-body 0", 2, "--max-body"},
        {"%s --host no.such.host.invalid", 2, "--host"},
        {"%s/nothing", 4, "nothing"},
        {"%s --ram 1K", 2, "needs a packed model"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        char args[4200];
        snprintf(args, sizeof args, c[i].args, m);
        int rc = k3t_runf(NULL, &err, "k3-serve %s --port 0 --quiet", args);
        if (rc != c[i].code || strncmp(err, "k3-serve: error: ", 17) || strchr(err, '\n') != err + strlen(err) - 1 ||
            !strstr(err, c[i].msg))
            k3t_fail(__FILE__, __LINE__, "k3-serve %s: want exit %d and one line naming '%s', got %d: %s", args,
                     c[i].code, c[i].msg, rc, err);
        free(err);
    }
    /* a port in use: 4 */
    k3t_server s;
    k3t_serve_start(&s, m, NULL);
    int rc = k3t_runf(NULL, &err, "k3-serve %s --port %d --quiet", m, s.port);
    CHECK_EQ_INT(rc, 4);
    CHECK_STR_CONTAINS(err, "cannot listen");
    free(err);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGTERM), 0);
}
