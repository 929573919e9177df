/*
 * t_serve_spec.c - k3-serve --spec: speculative decoding inside the batched
 * step never changes a request's answer.
 *
 *   - kjv-tiny (a trained model: its text repeats, so guesses are kept),
 *     streamed at the floor and resident: eight requests at once (greedy and
 *     seeded, completions and chat, streamed and not), each speculating,
 *     each answered exactly as the same request with "speculative": false
 *     sent alone; /metrics shows guesses were checked and kept.
 *   - "speculative" must be a boolean, and true needs a server with --spec.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_test.h"
#include "serve_util.h"

#define NSPEC 8

static const char *kjv_packed(void)
{
    static char d[4096];
    snprintf(d, sizeof d, "%s/kjv", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s/models/kjv-tiny %s", k3t_root(), d), 0);
    return d;
}

/* The answer text of a response or a stream (heap). */
static char *answer(const char *body, int streamed)
{
    char *r = NULL, *f = NULL, *t;
    if (streamed) {
        int done = 0, n = 0;
        t = k3t_sse_text(body, &r, &f, &done, &n);
        CHECK(done);
    } else {
        t = k3t_resp_text(body, &r, &f);
    }
    CHECK(t != NULL);
    char *out = NULL;
    CHECK(asprintf(&out, "%s|%s|%s", t ? t : "", r ? r : "", f ? f : "") > 0);
    free(t);
    free(r);
    free(f);
    return out;
}

static void spec_round(const char *model, const char *args)
{
    k3t_server s;
    k3t_serve_start(&s, model, args);
    static const char *const prompts[] = {
        "In the beginning God created the heaven and the earth. And the earth was without form, and void. "
        "In the beginning God created",
        "And God said, Let there be light: and there was light. And God said, Let there be",
        "The LORD is my shepherd; I shall not want. The LORD is my",
        "Blessed are the",
    };
    char *body[NSPEC], *plain[NSPEC];
    const char *path[NSPEC];
    int streamed[NSPEC];
    for (int i = 0; i < NSPEC; i++) {
        char samp[96];
        if (i % 2)
            snprintf(samp, sizeof samp, "\"temperature\":0.8,\"seed\":%d", 7 + i);
        else
            snprintf(samp, sizeof samp, "\"temperature\":0");
        streamed[i] = i % 3 == 1;
        path[i] = i % 4 == 3 ? "/v1/chat/completions" : "/v1/completions";
        body[i] = malloc(2048);
        if (i % 4 == 3)
            snprintf(body[i], 2048, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":%d,%s%s",
                     prompts[i % 4], 24 + 3 * i, samp, streamed[i] ? ",\"stream\":true" : "");
        else
            snprintf(body[i], 2048, "{\"prompt\":\"%s\",\"max_tokens\":%d,%s%s", prompts[i % 4], 24 + 3 * i, samp,
                     streamed[i] ? ",\"stream\":true" : "");
        /* the reference: the same request alone, without speculation */
        char ref[2200];
        snprintf(ref, sizeof ref, "%s,\"speculative\":false}", body[i]);
        strcat(body[i], "}");
        char *resp = NULL;
        int st = k3t_http(&s, path[i], ref, NULL, &resp);
        if (st != 200)
            k3t_fail(__FILE__, __LINE__, "request %d without speculation: %d %s", i, st, resp);
        plain[i] = answer(resp, streamed[i]);
        free(resp);
    }
    CHECK_EQ_INT((int)k3t_metric(&s, "k3_spec_passes_total"), 0);
    /* all at once, speculating (the server's default) */
    char *all[NSPEC];
    k3t_http_all(&s, NSPEC, path, body, all);
    for (int i = 0; i < NSPEC; i++) {
        char *got = all[i];
        char *a = answer(got, streamed[i]);
        if (strcmp(a, plain[i]))
            k3t_fail(__FILE__, __LINE__, "%s: request %d: without speculation %s, speculating with 7 others %s", args,
                     i, plain[i], a);
        free(a);
        free(got);
        free(plain[i]);
        free(body[i]);
    }
    /* it did speculate, and guesses were kept */
    double passes = k3t_metric(&s, "k3_spec_passes_total"), acc = k3t_metric(&s, "k3_spec_accepted_total");
    if (!(passes > 0 && acc > 0 && acc <= k3t_metric(&s, "k3_spec_drafted_total")))
        k3t_fail(__FILE__, __LINE__, "%s: %g passes with guesses, %g kept", args, passes, acc);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGINT), 0);
}

K3_TEST_TIMEOUT(serve_spec_answers_each_request_as_plain_decoding_in_a_batch, 600)
{
    const char *m = kjv_packed();
    spec_round(m, "--spec ngram:4 --parallel 4 --ram floor --ctx 512 --chunk 16");
    spec_round(m, "--spec ngram --parallel 8 --ctx 512");
}

K3_TEST_TIMEOUT(serve_spec_field_is_checked, 120)
{
    char m[4096];
    snprintf(m, sizeof m, "%s/models/kjv-tiny", k3t_root());
    k3t_server s;
    k3t_serve_start(&s, m, "--parallel 1 --ctx 256");
    char *resp = NULL;
    CHECK_EQ_INT(k3t_http(&s, "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":2,\"speculative\":true}", NULL,
                          &resp),
                 400);
    CHECK_STR_CONTAINS(resp, "--spec");
    CHECK_STR_CONTAINS(resp, "\"param\":\"speculative\"");
    free(resp);
    CHECK_EQ_INT(k3t_http(&s, "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":2,\"speculative\":\"yes\"}", NULL,
                          &resp),
                 400);
    free(resp);
    CHECK_EQ_INT(k3t_http(&s, "/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":2,\"speculative\":false}", NULL,
                          &resp),
                 200);
    free(resp);
    CHECK_EQ_INT(k3t_serve_stop(&s, SIGINT), 0);
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-serve %s --spec bogus --port 0", m), 2);
    CHECK_STR_CONTAINS(err, "--spec");
    free(err);
}
