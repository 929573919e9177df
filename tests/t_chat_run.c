/*
 * t_chat_run.c - k3-run --chat on the tiny checkpoint: through a pipe and
 * through a pseudo-terminal (script(1) from util-linux/bsdutils), two turns,
 * /save, a restart with --history giving the same answers as the
 * uninterrupted conversation; turn two computing only the tokens the
 * sequence does not hold; Ctrl-C (SIGINT) stopping a turn and not the
 * program; errors as one line with the documented exit status.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_test.h"

static const char *tiny(void)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/tiny", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", dir), 0);
    return dir;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++)
        n += *s == '\n';
    return n;
}

/* The value of "key": N in the k-th JSON line (from 0) of s, or -1. */
static long json_num(const char *s, int k, const char *key)
{
    for (; k > 0 && s; k--)
        if ((s = strchr(s, '\n')))
            s++;
    if (!s)
        return -1;
    const char *eol = strchr(s, '\n');
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(s, pat);
    if (!p || (eol && p > eol))
        return -1;
    return strtol(p + strlen(pat), NULL, 10);
}

/* The k-th line of s (heap copy). */
static char *line_of(const char *s, int k)
{
    for (; k > 0 && s; k--)
        if ((s = strchr(s, '\n')))
            s++;
    if (!s)
        return strdup("");
    size_t n = strcspn(s, "\n");
    char *l = malloc(n + 1);
    memcpy(l, s, n);
    l[n] = 0;
    return l;
}

/* everything of a turn's JSON line but the timings */
static char *turn_body(const char *s, int k)
{
    char *l = line_of(s, k);
    char *t = strstr(l, ",\"prompt_s\"");
    if (t)
        *t = 0;
    char *g = strstr(l, "\"generated_ids\"");   /* from here on: ids, reasoning, answer, stop */
    char *r = strdup(g ? g : l);
    free(l);
    return r;
}

K3_TEST(chat_pipe_two_turns_save_restart_with_history_gives_the_same_answers)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    char *a = NULL, *c = NULL, *err = NULL;
    /* uninterrupted: three turns */
    CHECK_EQ_INT(k3t_runf(&a, &err,
                          "printf 'Hello!\\nSay <|open|> now.\\n/save %s/A\\nAnd a third?\\n/save %s/A3\\n' | "
                          "k3-run %s --chat --gen 24 --json --system 'Be brief.'", tmp, tmp, ck), 0);
    CHECK_EQ_INT(count_lines(a), 3);
    CHECK_STR_CONTAINS(err, "saved");
    free(err);
    /* two turns, then a new process continues from the saved history */
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "printf 'Hello!\\nSay <|open|> now.\\n/save %s/B\\n' | "
                          "k3-run %s --chat --gen 24 --json --system 'Be brief.'", tmp, ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/A %s/B", tmp, tmp), 0);
    CHECK_EQ_INT(k3t_runf(&c, NULL, "printf 'And a third?\\n/save %s/C3\\n' | k3-run %s --chat --gen 24 --json "
                                    "--history %s/B", tmp, ck, tmp), 0);
    CHECK_EQ_INT(count_lines(c), 1);
    char *t3a = turn_body(a, 2), *t3c = turn_body(c, 0);
    CHECK_STR_EQ(t3c, t3a);
    free(t3a);
    free(t3c);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/A3 %s/C3", tmp, tmp), 0);
    /* the history holds the system message and the user's text as typed */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "grep -q '\"content\":\"Say <|open|> now.\"' %s/A", tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "head -1 %s/A | grep -q '\"role\":\"system\"'", tmp), 0);

    /* turn one computes its whole prompt; turn two only what the sequence does
     * not hold: everything after the end of turn one's prompt (the random model's
     * turn is not well-formed, so its assistant message is computed once in its
     * stored form), never the prompt again */
    long p1 = json_num(a, 0, "prompt_tokens"), p2 = json_num(a, 1, "prompt_tokens");
    CHECK(p1 > 100 && p2 > p1);
    CHECK_EQ_INT(json_num(a, 0, "reused_tokens"), 0);
    CHECK_EQ_INT(json_num(a, 0, "computed_tokens"), p1);
    CHECK_EQ_INT(json_num(a, 1, "reused_tokens"), p1);
    CHECK_EQ_INT(json_num(a, 1, "computed_tokens"), p2 - p1);
    CHECK_EQ_INT(json_num(a, 2, "reused_tokens"), p2);
    /* the restarted process computes the whole history once */
    CHECK_EQ_INT(json_num(c, 0, "reused_tokens"), 0);
    CHECK_EQ_INT(json_num(c, 0, "computed_tokens"), json_num(a, 2, "prompt_tokens"));
    free(a);
    free(c);
}

K3_TEST(chat_pty_two_turns_save_restart_with_history_gives_the_same_answers)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    char *out = NULL;
    /* on a terminal: libedit reads the lines, the answer streams; /save then /quit */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Hello!\\nHow are you?\\n/save %s/T\\n/quit\\n' > %s/in1", tmp, tmp), 0);
    CHECK_EQ_INT(k3t_runf(&out, NULL, "script -qec 'k3-run %s --chat --gen 24 --show-reasoning' /dev/null < %s/in1",
                          ck, tmp), 0);
    CHECK_STR_CONTAINS(out, "> ");
    CHECK_STR_CONTAINS(out, "\033[2m");   /* the reasoning, dimmed */
    CHECK_STR_CONTAINS(out, "saved");
    free(out);
    /* the same conversation through a pipe saves the same file */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Hello!\\nHow are you?\\n/save %s/P\\n' | k3-run %s --chat --gen 24",
                          tmp, ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/T %s/P", tmp, tmp), 0);
    /* restart on the terminal with --history: turn three as without the restart */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Third.\\n/save %s/T3\\n/quit\\n' > %s/in2", tmp, tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "script -qec 'k3-run %s --chat --gen 24 --history %s/T' /dev/null < %s/in2",
                          ck, tmp, tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Hello!\\nHow are you?\\nThird.\\n/save %s/P3\\n' | k3-run %s --chat "
                                      "--gen 24", tmp, ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/T3 %s/P3", tmp, tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test $(wc -l < %s/T3) = 6", tmp), 0);
}

K3_TEST(chat_sigint_stops_the_turn_not_the_program)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    /* a long first message (thousands of tokens, one per step) is interrupted;
     * the next line is answered and the program ends normally */
    CHECK_EQ_INT(k3t_runf(NULL, NULL,
                          "for i in $(seq 600); do printf 'alpha beta gamma delta the model '; done > %s/in; "
                          "printf '\\nHello!\\n/save %s/H\\n' >> %s/in", tmp, tmp, tmp), 0);
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err,
                      "k3-run %s --chat --gen 8 --ctx 20000 --chunk 1 --threads 1 --json < %s/in & p=$!; "
                      "sleep 2; kill -INT $p; wait $p", ck, tmp);
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(err, "interrupted: the message was not sent");
    CHECK_EQ_INT(count_lines(out), 1);
    CHECK_STR_CONTAINS(out, "\"turn\":1,");
    /* the history has only the answered turn */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test $(wc -l < %s/H) = 2 && grep -q Hello %s/H", tmp, tmp), 0);
    free(out);
    free(err);
}

K3_TEST(chat_errors_are_one_line_with_their_exit_status)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    struct {
        const char *args;
        int code;
        const char *msg;
    } cases[] = {
        {"--effort medium", 2, "'medium' is not supported"},
        {"--effort none", 2, "not one of low, high, max"},
        {"--bogus", 2, "unknown option --bogus"},
        {"--gen 0", 2, "--gen"},
        {"--history /nonexistent/h.jsonl", 4, "/nonexistent/h.jsonl"},
        {"--history BAD", 3, "line 1"},
        {"--history GOOD --system x", 2, "exclude each other"},
    };
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf '{\"role\":\"assistant\",\"content\":\"a\"}\\n' > %s/BAD; "
                                      "printf '{\"role\":\"user\",\"content\":\"a\"}\\n' > %s/GOOD", tmp, tmp), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[512], *a = args;
        snprintf(args, sizeof args, "%s", cases[i].args);
        char buf[1024];
        char *p = strstr(a, "BAD") ? strstr(a, "BAD") : strstr(a, "GOOD");
        if (p) {
            snprintf(buf, sizeof buf, "%.*s%s/%s", (int)(p - a), a, tmp, p);
            a = buf;
        }
        char *out = NULL, *err = NULL;
        int rc = k3t_runf(&out, &err, "echo hi | k3-run %s --chat %s", ck, a);
        if (rc != cases[i].code)
            fprintf(stderr, "case %s: %d %s\n", a, rc, err);
        CHECK_EQ_INT(rc, cases[i].code);
        CHECK(strncmp(err, "k3-run: error: ", 15) == 0);
        CHECK_EQ_INT(count_lines(err), 1);
        CHECK_STR_CONTAINS(err, cases[i].msg);
        CHECK_STR_EQ(out, "");
        free(out);
        free(err);
    }
    /* a tokenizer without the K3 control tokens cannot chat */
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir %s/tok && cp %s/tiktoken.model %s/tok/ && "
                                      "sed 's/<|sep|>/<|other|>/' %s/tokenizer_config.json > %s/tok/tokenizer_config.json",
                          tmp, ck, tmp, ck, tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "echo hi | k3-run %s --chat --tok %s/tok", ck, tmp), 3);
    CHECK_STR_CONTAINS(err, "no <|sep|> special token");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    /* /save does not overwrite a file it did not write; /load of a bad file goes on */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "printf '/save %s/GOOD\\n/load %s/BAD\\n/nope\\nHello!\\n' | "
                                      "k3-run %s --chat --gen 4", tmp, tmp, ck), 0);
    CHECK_STR_CONTAINS(err, "exists: not overwritten");
    CHECK_STR_CONTAINS(err, "line 1: message 1 is an assistant message");
    CHECK_STR_CONTAINS(err, "unknown command /nope");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf '{\"role\":\"user\",\"content\":\"a\"}\\n' | cmp - %s/GOOD", tmp), 0);
    free(err);
}

K3_TEST(chat_streamed_at_the_floor_answers_as_resident)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert %s %s/pk", ck, tmp), 0);
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "printf 'Hello!\\nAgain.\\n/save %s/R\\n' | k3-run %s --chat --gen 16", tmp,
                          ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "printf 'Hello!\\nAgain.\\n/save %s/F\\n' | k3-run %s/pk --chat --gen 16 "
                                      "--ram floor", tmp, tmp), 0);
    CHECK_STR_CONTAINS(err, "plan");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/R %s/F", tmp, tmp), 0);
    free(err);
}

K3_TEST(chat_state_file_lets_a_restart_compute_only_new_tokens)
{
    const char *ck = tiny(), *tmp = k3t_tmpdir();
    char *a = NULL, *b = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(&a, NULL, "printf 'Hello!\\nSecond.\\n/save %s/A\\n' | k3-run %s --chat --gen 24 --json", tmp,
                          ck), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "printf 'Hello!\\n/save %s/H\\n' | k3-run %s --chat --gen 24 --state-save %s/S",
                          tmp, ck, tmp), 0);
    CHECK_STR_CONTAINS(err, "saved the state of");
    free(err);
    CHECK_EQ_INT(k3t_runf(&b, NULL, "printf 'Second.\\n/save %s/B\\n' | k3-run %s --chat --gen 24 --json --history %s/H "
                                    "--state-load %s/S", tmp, ck, tmp, tmp), 0);
    char *ta = turn_body(a, 1), *tb = turn_body(b, 0);
    CHECK_STR_EQ(tb, ta);
    free(ta);
    free(tb);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/A %s/B", tmp, tmp), 0);
    CHECK_EQ_INT(json_num(b, 0, "reused_tokens"), json_num(a, 1, "reused_tokens"));
    CHECK_EQ_INT(json_num(b, 0, "computed_tokens"), json_num(a, 1, "computed_tokens"));
    CHECK(json_num(b, 0, "computed_tokens") < json_num(b, 0, "prompt_tokens") / 2);
    free(a);
    free(b);
    /* the state is refused by another model, and --state-save keeps an existing file */
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/other --preset tiny --seed 7 --quiet", tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "echo hi | k3-run %s/other --chat --state-load %s/S", tmp, tmp), 3);
    CHECK_STR_CONTAINS(err, "a state of another model");
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "echo hi | k3-run %s --chat --state-save %s/S", ck, tmp), 7);
    CHECK_EQ_INT(count_lines(err), 1);
    free(err);
}
