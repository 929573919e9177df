/*
 * t_serve.c - k3-serve with real clients on loopback: curl (streamed and
 * not) against k3-run's own answers, token-id prompts, stop strings that
 * span tokens, chat completions, the official openai npm client, 16
 * concurrent clients each getting exactly its solo answer within --ram, and
 * SIGTERM ending the server with 0. Hostile clients are t_serve_hostile.c.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "k3_test.h"
#include "serve_util.h"

static const char *tiny(const char *name, int packed)
{
    static char dir[2][4096];
    char *d = dir[packed];
    snprintf(d, sizeof dir[0], "%s/%s", k3t_tmpdir(), name);
    if (packed)
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s.up --preset tiny --quiet && k3-convert --quiet %s.up %s", d,
                              d, d), 0);
    else
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", d), 0);
    return d;
}

/* k3-run's text and ids for a prompt (--json). */
static char *run_text(const char *model, const char *args, cJSON **ids)
{
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s %s --json --quiet", model, args), 0);
    cJSON *o = cJSON_Parse(out);
    CHECK(o != NULL);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "text");
    CHECK(cJSON_IsString(t));
    char *s = strdup(t->valuestring);
    if (ids)
        *ids = cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(o, "generated_ids"), 1);
    cJSON_Delete(o);
    free(out);
    return s;
}

static char *post_text(const k3t_server *s, const char *path, const char *body, char **finish)
{
    char *resp = NULL;
    int st = k3t_http(s, path, body, NULL, &resp);
    if (st != 200)
        k3t_fail(__FILE__, __LINE__, "POST %s %s: status %d: %s", path, body, st, resp);
    char *t = k3t_resp_text(resp, NULL, finish);
    CHECK(t != NULL);
    free(resp);
    return t;
}

static char *post_stream(const k3t_server *s, const char *path, const char *body, char **reasoning, char **finish)
{
    char *resp = NULL;
    int st = k3t_http(s, path, body, NULL, &resp), done, n;
    if (st != 200)
        k3t_fail(__FILE__, __LINE__, "POST %s %s: status %d: %s", path, body, st, resp);
    char *t = k3t_sse_text(resp, reasoning, finish, &done, &n);
    if (!done)
        k3t_fail(__FILE__, __LINE__, "the stream of %s does not end with data: [DONE]: %s", body, resp);
    free(resp);
    return t;
}

K3_TEST_TIMEOUT(serve_curl_answers_as_k3_run_streamed_or_not_with_ids_stop_strings_and_chat, 180)
{
    const char *m = tiny("m", 0);
    cJSON *ids = NULL;
    char *want = run_text(m, "--prompt 'Hello there' --gen 12", NULL);
    char *want_seeded = run_text(m, "--prompt 'Hello there' --gen 12 --temperature 0.9 --top-k 40 --seed 7", &ids);
    char *prompt_ids = NULL;
    {
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run --tokenize --prompt 'Hello there' --tok %s", m), 0);
        out[strcspn(out, "\n")] = 0;
        prompt_ids = out;
    }
    k3t_server s;
    k3t_serve_start(&s, m, "--parallel 2");
    char *fin = NULL, body[4096];

    /* greedy, seeded, and the prompt as ids: k3-run's text */
    char *t = post_text(&s, "/v1/completions", "{\"prompt\":\"Hello there\",\"max_tokens\":12,\"temperature\":0}", &fin);
    CHECK_STR_EQ(t, want);
    CHECK_STR_EQ(fin, "length");
    free(t);
    free(fin);
    t = post_text(&s, "/v1/completions",
                  "{\"prompt\":\"Hello there\",\"max_tokens\":12,\"temperature\":0.9,\"top_k\":40,\"seed\":7}", NULL);
    CHECK_STR_EQ(t, want_seeded);
    free(t);
    snprintf(body, sizeof body, "{\"prompt\":[%s],\"max_tokens\":12,\"temperature\":0}", prompt_ids);
    t = post_text(&s, "/v1/completions", body, NULL);
    CHECK_STR_EQ(t, want);
    free(t);
    /* streamed: the same text in chunks, finish_reason, [DONE] */
    t = post_stream(&s, "/v1/completions",
                    "{\"prompt\":\"Hello there\",\"max_tokens\":12,\"temperature\":0,\"stream\":true}", NULL, &fin);
    CHECK_STR_EQ(t, want);
    CHECK_STR_EQ(fin, "length");
    free(t);
    free(fin);

    /* a stop string across the boundary of two generated tokens (of the
     * seeded run; the first pair whose bytes there are plain ASCII): the text
     * ends before it */
    char stop[16] = "", *prefix = NULL;
    for (int k = 1; k + 1 < cJSON_GetArraySize(ids) && !prefix; k++) {
        char *p2 = NULL, *p3 = NULL;
        CHECK_EQ_INT(k3t_runf(&p2, NULL, "k3-run --detokenize --ids %d --tok %s",
                              cJSON_GetArrayItem(ids, k)->valueint, m), 0);
        CHECK_EQ_INT(k3t_runf(&p3, NULL, "k3-run --detokenize --ids %d --tok %s",
                              cJSON_GetArrayItem(ids, k + 1)->valueint, m), 0);
        size_t l2 = strlen(p2);
        if (l2 >= 1 && p3[0] > ' ' && p3[0] < 127 && p2[l2 - 1] > ' ' && p2[l2 - 1] < 127) {
            snprintf(stop, sizeof stop, "%c%c", p2[l2 - 1], p3[0]);
            const char *at = strstr(want_seeded, stop);
            CHECK(at != NULL);
            prefix = strndup(want_seeded, (size_t)(at - want_seeded));
        }
        free(p2);
        free(p3);
    }
    CHECK(prefix != NULL);
    cJSON *sj = cJSON_CreateString(stop);
    char *stop_json = cJSON_PrintUnformatted(sj);
    cJSON_Delete(sj);
    for (int stream = 0; stream < 2; stream++) {
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Hello there\",\"max_tokens\":12,\"temperature\":0.9,\"top_k\":40,\"seed\":7,"
                 "\"stop\":[\"never here\",%s],\"stream\":%s}",
                 stop_json, stream ? "true" : "false");
        t = stream ? post_stream(&s, "/v1/completions", body, NULL, &fin) : post_text(&s, "/v1/completions", body, &fin);
        CHECK_STR_EQ(t, prefix);
        CHECK_STR_EQ(fin, "stop");
        free(t);
        free(fin);
    }

    /* chat: content and reasoning_content, streamed or not, the same */
    const char *chat = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":\"Hi <|open|>\"}],\"max_tokens\":24,\"temperature\":0%s}";
    char *resp = NULL;
    snprintf(body, sizeof body, chat, "");
    CHECK_EQ_INT(k3t_http(&s, "/v1/chat/completions", body, NULL, &resp), 200);
    char *r1 = NULL, *r2 = NULL, *f1 = NULL, *f2 = NULL;
    char *c1 = k3t_resp_text(resp, &r1, &f1);
    CHECK(c1 && r1 && f1);
    CHECK(strlen(c1) + strlen(r1) > 0);
    CHECK_STR_CONTAINS(resp, "\"usage\":{\"prompt_tokens\":");
    free(resp);
    snprintf(body, sizeof body, chat, ",\"stream\":true");
    char *c2 = post_stream(&s, "/v1/chat/completions", body, &r2, &f2);
    CHECK_STR_EQ(c2, c1);
    CHECK_STR_EQ(r2, r1);
    CHECK_STR_EQ(f2, f1);

    /* models, health, metrics */
    CHECK_EQ_INT(k3t_http(&s, "/v1/models", NULL, NULL, &resp), 200);
    CHECK_STR_CONTAINS(resp, "\"id\":\"m\"");
    free(resp);
    CHECK_EQ_INT(k3t_http(&s, "/health", NULL, NULL, &resp), 200);
    CHECK_STR_CONTAINS(resp, "\"ok\"");
    free(resp);
    CHECK(k3t_metric(&s, "k3_requests_total") >= 8);
    CHECK(k3t_metric(&s, "k3_generated_tokens_total") > 0);
    CHECK_EQ_INT(k3t_metric(&s, "k3_active_sequences"), 0);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGTERM), 0);
    free(c1), free(c2), free(r1), free(r2), free(f1), free(f2), free(prefix), free(stop_json);
    free(want), free(want_seeded), free(prompt_ids);
    cJSON_Delete(ids);
}

/* The same request with curl and with the official openai client (Node),
 * completions and chat, streamed and not. */
K3_TEST_TIMEOUT(serve_openai_npm_client_gets_what_curl_gets, 240)
{
    const char *root = k3t_root();
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err,
                      "cd '%s/tests/openai' && { node -e 'const f = require(\"fs\"), v = (p) => "
                      "JSON.parse(f.readFileSync(p)); process.exit(v(\"node_modules/openai/package.json\").version === "
                      "v(\"package.json\").dependencies.openai ? 0 : 1)' 2>/dev/null || "
                      "npm ci --no-audit --no-fund --loglevel=error; }",
                      root);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "npm ci in tests/openai failed (%d): %s %s", rc, out, err);
    free(out);
    free(err);
    const char *m = tiny("m", 0);
    k3t_server s;
    k3t_serve_start(&s, m, "--parallel 2 --api-key sekrit");
    rc = k3t_runf(&out, &err, "node '%s/tests/openai/client.js' %d sekrit", root, s.port);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "tests/openai/client.js failed (%d): %s %s", rc, out, err);
    cJSON *o = cJSON_Parse(out);
    CHECK(o != NULL);
    const char *keys[] = {"completion", "completion_stream", "chat", "chat_stream", "chat_reasoning",
                          "chat_stream_reasoning"};
    const char *curl[] = {
        "/v1/completions", "{\"prompt\":\"Once upon\",\"max_tokens\":10,\"temperature\":0.7,\"seed\":3}",
        "/v1/chat/completions",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me\"}],\"max_tokens\":16,\"temperature\":0.7,\"seed\":3}"};
    char *want[4], *why = NULL;
    for (int i = 0; i < 2; i++) {
        char *resp = NULL, *reason = NULL;
        CHECK_EQ_INT(k3t_http(&s, curl[2 * i], curl[2 * i + 1], "-H 'Authorization: Bearer sekrit'", &resp), 200);
        want[i] = k3t_resp_text(resp, &reason, &why);
        want[2 + i] = reason ? reason : strdup("");
        free(why);
        free(resp);
    }
    for (int k = 0; k < 6; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[k]);
        if (!cJSON_IsString(v))
            k3t_fail(__FILE__, __LINE__, "client.js printed no %s: %s", keys[k], out);
        const char *w = k < 2 ? want[0] : k < 4 ? want[1] : want[3];
        if (strcmp(v->valuestring, w))
            k3t_fail(__FILE__, __LINE__, "%s: openai client got \"%s\", curl got \"%s\"", keys[k], v->valuestring, w);
    }
    CHECK_EQ_INT(cJSON_GetObjectItemCaseSensitive(o, "unauthorized_status")->valueint, 401);
    cJSON_Delete(o);
    for (int i = 0; i < 4; i++)
        free(want[i]);
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGINT), 0);
}

/* --parallel auto (the default) steps as many sequences as the budget holds
 * (at most 64), and --ram floor holds one; an explicit --parallel the budget
 * cannot hold is one line and exit 6, never a server that runs past --ram. */
K3_TEST_TIMEOUT(serve_parallel_auto_admits_what_the_budget_holds, 120)
{
    const char *m = tiny("pk", 1);
    struct { const char *args; int lo, hi; } c[] = {
        {"--ram floor --ctx 1024", 1, 1},
        {"--ram 64M --ctx 1024", 5, 64},
        {"--ram 1G --ctx 1024", 64, 64},
        {"--ctx 1024", 8, 8},   /* resident: no budget to fill */
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        k3t_server s;
        k3t_serve_start(&s, m, c[i].args);
        char *log = k3t_serve_log(&s);
        const char *l = strstr(log, "listening on http://");
        const char *p = l ? strstr(l, " (") : NULL;
        int n = p ? atoi(p + 2) : -1;
        if (n < c[i].lo || n > c[i].hi)
            k3t_fail(__FILE__, __LINE__, "k3-serve %s: %d parallel, want %d to %d:\n%s", c[i].args, n, c[i].lo,
                     c[i].hi, log);
        if (strstr(c[i].args, "--ram")) {   /* the plan says how many it holds, and this is them */
            const char *a = strstr(log, "the budget admits at most ");
            CHECK(a != NULL);
            char want[64];
            snprintf(want, sizeof want, "%d stepped together (--parallel auto)", n);
            CHECK_STR_CONTAINS(log, want);
            if (a && n < 64)
                CHECK_EQ_INT(atoi(a + strlen("the budget admits at most ")), n);
        }
        free(log);
        CHECK_EQ_INT(k3t_serve_stop(&s, SIGINT), 0);
    }
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-serve %s --ram 64M --ctx 1024 --parallel 1000 --port 0", m), 6);
    CHECK_STR_CONTAINS(err, "k3-serve: error: --parallel 1000 sequences of 1024 tokens do not fit: ");
    CHECK_STR_CONTAINS(err, "--parallel auto");
    CHECK(strchr(err, '\n') == err + strlen(err) - 1);
    free(err);
}

/* 16 requests at once (completions and chat, greedy and seeded, streamed and
 * not, prompts of different lengths) each get byte for byte the answer they
 * get alone; the server stays within its --ram. */
#define NCONC 16
K3_TEST_TIMEOUT(serve_16_concurrent_clients_each_get_their_solo_answer_within_ram, 600)
{
    const char *m = tiny("pk", 1);
    char args[256];
    snprintf(args, sizeof args, "--ram floor --parallel %d --queue 64 --ctx 1024 --chunk 16", NCONC);
    k3t_server s;
    k3t_serve_start(&s, m, args);
    /* the budget the plan resolved the floor to */
    char *log = k3t_serve_log(&s);
    const char *bl = strstr(log, "memory plan for a budget of ");
    CHECK(bl != NULL);
    const uint64_t ram = strtoull(bl + strlen("memory plan for a budget of "), NULL, 10);
    CHECK(ram > 0);
    /* and what each sequence costs, with the most the budget admits */
    const char *ps = strstr(log, "per sequence of 1024 tokens ");
    CHECK(ps != NULL);
    char want[64];
    snprintf(want, sizeof want, "the budget admits at most %d, %d stepped together (--parallel)", NCONC, NCONC);
    CHECK_STR_CONTAINS(log, want);
    free(log);
    char *body[NCONC], *solo[NCONC];
    const char *path[NCONC];
    for (int i = 0; i < NCONC; i++) {
        char words[600] = "";
        for (int w = 0; w < 1 + 2 * i; w++)
            strcat(words, w % 3 ? "river " : "stone ");
        char samp[96];
        if (i % 2)
            snprintf(samp, sizeof samp, "\"temperature\":0.8,\"top_p\":0.9,\"seed\":%d", 100 + i);
        else
            snprintf(samp, sizeof samp, "\"temperature\":0");
        body[i] = malloc(2048);
        path[i] = i % 4 == 3 ? "/v1/chat/completions" : "/v1/completions";
        if (i % 4 == 3)
            snprintf(body[i], 2048, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":%d,%s%s}",
                     words, 4 + i / 2, samp, i % 8 == 7 ? ",\"stream\":true" : "");
        else
            snprintf(body[i], 2048, "{\"prompt\":\"%s\",\"max_tokens\":%d,%s%s}", words, 4 + i / 2, samp,
                     i % 8 == 2 ? ",\"stream\":true" : "");
        char *resp = NULL;
        int st = k3t_http(&s, path[i], body[i], NULL, &resp);
        if (st != 200)
            k3t_fail(__FILE__, __LINE__, "request %d alone: %d %s", i, st, resp);
        solo[i] = resp;
    }
    /* all at once: one shell, sixteen curls in the background */
    char *all[NCONC];
    k3t_http_all(&s, NCONC, path, body, all);
    for (int i = 0; i < NCONC; i++) {
        char *got = all[i];
        int streamed = strstr(body[i], "\"stream\":true") != NULL;
        char *a, *b;
        if (streamed) {
            int d1, d2, n1, n2;
            char *r1 = NULL, *r2 = NULL;
            a = k3t_sse_text(solo[i], &r1, NULL, &d1, &n1);
            b = k3t_sse_text(got, &r2, NULL, &d2, &n2);
            CHECK(d1 && d2);
            CHECK_EQ_INT(n1, n2);
            CHECK_STR_EQ(r2, r1);
            free(r1);
            free(r2);
        } else {
            a = k3t_resp_strip(solo[i]);
            b = k3t_resp_strip(got);
        }
        if (strcmp(a, b))
            k3t_fail(__FILE__, __LINE__, "request %d: alone %s, with 15 others %s", i, a, b);
        free(a);
        free(b);
        free(got);
        free(solo[i]);
        free(body[i]);
    }
    CHECK(k3t_metric(&s, "k3_steps_total") > 0);
    /* streamed: the read counters add up, and the experts were asked for */
    CHECK(k3t_metric(&s, "k3_expert_requests_total") > 0);
    CHECK(k3t_metric(&s, "k3_expert_hits_total") <= k3t_metric(&s, "k3_expert_requests_total"));
    CHECK(k3t_metric(&s, "k3_trunk_bytes_read_total") > 0);
    CHECK(k3t_metric(&s, "k3_trunk_bytes_read_total") + k3t_metric(&s, "k3_expert_bytes_read_total") ==
          k3t_metric(&s, "k3_bytes_read_total"));
    /* the peak resident set of the server, within --ram */
    char *hwm = NULL;
    CHECK_EQ_INT(k3t_runf(&hwm, NULL, "awk '/^VmHWM:/ {print $2 * 1024}' /proc/%d/status", (int)s.pid), 0);
    uint64_t peak = strtoull(hwm, NULL, 10);
    free(hwm);
    if (!(peak > 0 && peak <= ram))
        k3t_fail(__FILE__, __LINE__, "peak RSS %llu bytes, --ram %llu", (unsigned long long)peak,
                 (unsigned long long)ram);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGTERM), 0);
}

/* SIGTERM with a request in flight: new requests get 503, the running one
 * ends normally ([DONE], finish_reason length), then exit 0. A second signal
 * cancels what is left, still exit 0. */
K3_TEST_TIMEOUT(serve_sigterm_drains_the_request_in_flight_and_exits_0, 180)
{
    const char *m = tiny("m", 0), *tmp = k3t_tmpdir();
    char bias[1024];   /* without it the random model may end the request before it is seen running */
    k3t_no_eos_bias(m, bias, sizeof bias);
    for (int second = 0; second < 2; second++) {
        k3t_server s;
        k3t_serve_start(&s, m, "--parallel 2 --ctx 4096");
        char cmd[8192];
        snprintf(cmd, sizeof cmd,
                 "curl -sS -N --max-time 120 --data-binary '{\"prompt\":\"go\",\"max_tokens\":3000,\"stream\":true,%s}' "
                 "http://127.0.0.1:%d/v1/completions > %s/drain%d.out 2>&1 &",
                 bias, s.port, tmp, second);
        CHECK_EQ_INT(k3t_runf(NULL, NULL, "%s", cmd), 0);
        int i;
        for (i = 0; i < 400 && k3t_metric(&s, "k3_active_sequences") < 1; i++)
            usleep(25 * 1000);
        CHECK(i < 400);
        CHECK_EQ_INT(kill(s.pid, SIGTERM), 0);
        usleep(100 * 1000);
        char *resp = NULL;
        int st = k3t_http(&s, "/v1/completions", "{\"prompt\":\"late\",\"max_tokens\":2}", NULL, &resp);
        CHECK(st == 503 || st < 0);   /* refused, or the server has already gone */
        free(resp);
        if (second)
            CHECK_EQ_INT(kill(s.pid, SIGINT), 0);
        CHECK_EQ_INT(k3t_serve_stop(&s, 0), 0);
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "sleep 0.5; cat %s/drain%d.out", tmp, second), 0);
        int done, n;
        char *fin = NULL;
        char *t = k3t_sse_text(out, NULL, &fin, &done, &n);
        CHECK(done);
        /* drained: it ended as it would have (length, or the model's end
         * id); cancelled: an error event, unless it ended before the signal */
        if (!second || !strstr(out, "shutting down")) {
            CHECK(fin && (!strcmp(fin, "length") || !strcmp(fin, "stop")));
            CHECK(!strstr(out, "\"error\""));
        }
        free(t);
        free(fin);
        free(out);
    }
}
