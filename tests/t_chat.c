/*
 * t_chat.c - the K3 chat format on the tiny synthetic tokenizer: rendered ids
 * equal hand-written ones (thinking on and off, a system message, a user
 * typing "<|open|>"), role order and effort errors, the turn parser (good
 * turns, control tokens inside text, wrong closings, cut turns), and history
 * files (round trip, strict reader).
 *
 * The expected ids were written down once from the tiny tokenizer (ranks
 * 0..583; [BOS] 584, [EOS] 585, <|end_of_msg|> 586, <|open|> 587, <|close|>
 * 588, <|sep|> 589) piece by piece; they do not come from the renderer.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_chat.h"
#include "k3_test.h"

#define EOS 585
#define EOM 586
#define OPN 587
#define CLS 588
#define SEP 589

/* text pieces, each encoded alone with special matching off */
#define H_USER 109, 279, 115, 97, 391, 324, 111, 485, 61, 34, 344, 260, 34
#define H_SYSTEM 109, 279, 115, 97, 391, 324, 111, 485, 61, 34, 115, 121, 115, 116, 101, 109, 34
#define H_ASSISTANT 109, 279, 115, 97, 391, 324, 111, 485, 61, 34, 342, 115, 280, 116, 276, 116, 34
#define H_EFFORT                                                                                               \
    109, 279, 115, 97, 391, 324, 111, 485, 61, 34, 115, 121, 115, 116, 101, 109, 34, 256, 121, 112, 101, 61, 34, \
        116, 104, 264, 482, 45, 354, 102, 274, 116, 34
#define T_THINK 116, 104, 264, 107
#define T_RESPONSE 410, 112, 263, 115, 101
#define T_MESSAGE 109, 279, 115, 97, 391
#define X_BE_BRIEF 66, 101, 266, 114, 105, 354, 46                        /* "Be brief." */
#define X_SAY_OPEN 83, 325, 32, 60, 124, 111, 493, 124, 62, 323, 305      /* "Say <|open|> now" */
#define X_HI_THERE 72, 105, 259, 261, 46                                  /* "Hi there." */
#define X_HELLO 72, 389, 299, 33                                          /* "Hello!" */
#define X_LET_ME 76, 101, 116, 370, 368, 264, 107, 46                     /* "Let me think." */
/* the thinking-effort body up to "=", then "low`." */
#define X_EFFORT_HEAD                                                                                          \
    96, 116, 104, 264, 482, 95, 354, 102, 274, 116, 96, 309, 117, 327, 279, 290, 289, 305, 269, 117, 388, 281, \
        368, 264, 107, 337, 453, 557, 368, 264, 482, 333, 276, 110, 389, 32, 40, 110, 362, 337, 99, 108, 117,  \
        100, 286, 259, 351, 115, 112, 263, 115, 101, 333, 276, 110, 389, 41, 44, 265, 117, 397, 274, 116, 298, \
        32, 118, 340, 345, 337, 99, 108, 117, 100, 101, 32, 96, 299, 119, 96, 44, 32, 96, 109, 298, 105, 402,  \
        96, 44, 32, 96, 104, 313, 96, 44, 285, 32, 96, 109, 97, 120, 96, 46, 10, 78, 305, 259, 265, 121, 115,  \
        116, 101, 109, 302, 337, 118, 111, 483, 331, 32, 96, 116, 104, 264, 482, 95, 354, 102, 274, 116, 61
#define X_EFFORT_LOW X_EFFORT_HEAD, 299, 119, 96, 46
#define X_EFFORT_MAX X_EFFORT_HEAD, 109, 97, 120, 96, 46

#define END_MSG CLS, T_MESSAGE, SEP, EOM

static k3_tok *tiny_tok(void)
{
    static char dir[4096];
    snprintf(dir, sizeof dir, "%s/tiny", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet", dir), 0);
    k3_tok *tok = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_open(&tok, dir, &e), 0);
    return tok;
}

static void add(k3_chat *c, k3_chat_role r, const char *text, const char *reasoning)
{
    k3_err e = {0};
    int rc = k3_chat_add(c, r, text, strlen(text), reasoning, reasoning ? strlen(reasoning) : 0, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
}

static void check_ids(const uint32_t *got, uint64_t n, const uint32_t *want, uint64_t wn)
{
    uint64_t i = 0;
    while (i < n && i < wn && got[i] == want[i])
        i++;
    if (i < n || i < wn)
        fprintf(stderr, "ids differ at %llu: got %lld, want %lld (lengths %llu, %llu)\n", (unsigned long long)i,
                i < n ? (long long)got[i] : -1LL, i < wn ? (long long)want[i] : -1LL, (unsigned long long)n,
                (unsigned long long)wn);
    CHECK_EQ_U64(n, wn);
    CHECK(i == n);
}

K3_TEST(chat_renders_thinking_off_with_system_and_typed_control_text)
{
    k3_tok *tok = tiny_tok();
    k3_chat c = {0};
    add(&c, K3_CHAT_SYSTEM, "Be brief.", NULL);
    add(&c, K3_CHAT_USER, "Say <|open|> now", NULL);
    add(&c, K3_CHAT_ASSISTANT, "Hi there.", "dropped with thinking off");
    add(&c, K3_CHAT_USER, "Hello!", NULL);
    static const uint32_t want[] = {
        OPN, H_SYSTEM, SEP, X_BE_BRIEF, END_MSG,
        OPN, H_USER, SEP, X_SAY_OPEN, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_RESPONSE, SEP, X_HI_THERE, CLS, T_RESPONSE, SEP, END_MSG,
        OPN, H_USER, SEP, X_HELLO, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_RESPONSE, SEP,
    };
    k3_chat_opts o = {0, K3_CHAT_MAX};
    uint32_t *ids;
    uint64_t n;
    k3_err e = {0};
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 1, &ids, &n, &e), 0);
    check_ids(ids, n, want, sizeof want / sizeof want[0]);
    free(ids);
    k3_chat_free(&c);
    k3_tok_close(tok);
}

K3_TEST(chat_renders_thinking_on_with_effort_and_reasoning)
{
    k3_tok *tok = tiny_tok();
    k3_chat c = {0};
    add(&c, K3_CHAT_USER, "Hello!", NULL);
    add(&c, K3_CHAT_ASSISTANT, "Hi there.", "Let me think.");
    add(&c, K3_CHAT_USER, "Say <|open|> now", NULL);
    add(&c, K3_CHAT_ASSISTANT, "Hi there.", NULL);   /* no reasoning: an empty think element */
    add(&c, K3_CHAT_USER, "Hello!", NULL);
    static const uint32_t want_low[] = {
        OPN, H_EFFORT, SEP, X_EFFORT_LOW, END_MSG,
        OPN, H_USER, SEP, X_HELLO, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_THINK, SEP, X_LET_ME, CLS, T_THINK, SEP,
        OPN, T_RESPONSE, SEP, X_HI_THERE, CLS, T_RESPONSE, SEP, END_MSG,
        OPN, H_USER, SEP, X_SAY_OPEN, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_THINK, SEP, CLS, T_THINK, SEP,
        OPN, T_RESPONSE, SEP, X_HI_THERE, CLS, T_RESPONSE, SEP, END_MSG,
        OPN, H_USER, SEP, X_HELLO, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_THINK, SEP,
    };
    k3_chat_opts o = {1, K3_CHAT_LOW};
    uint32_t *ids;
    uint64_t n;
    k3_err e = {0};
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 1, &ids, &n, &e), 0);
    check_ids(ids, n, want_low, sizeof want_low / sizeof want_low[0]);
    free(ids);
    /* effort max (the default), one user message */
    k3_chat_clear(&c);
    add(&c, K3_CHAT_SYSTEM, "Be brief.", NULL);
    add(&c, K3_CHAT_USER, "Hello!", NULL);
    static const uint32_t want_max[] = {
        OPN, H_EFFORT, SEP, X_EFFORT_MAX, END_MSG,
        OPN, H_SYSTEM, SEP, X_BE_BRIEF, END_MSG,
        OPN, H_USER, SEP, X_HELLO, END_MSG,
        OPN, H_ASSISTANT, SEP, OPN, T_THINK, SEP,
    };
    o.effort = K3_CHAT_MAX;
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 1, &ids, &n, &e), 0);
    check_ids(ids, n, want_max, sizeof want_max / sizeof want_max[0]);
    free(ids);
    k3_chat_free(&c);
    k3_tok_close(tok);
}

K3_TEST(chat_refuses_wrong_role_order_and_medium_effort)
{
    k3_chat c = {0};
    k3_err e = {0};
#define CLR k3_err_clear(&e)
    CHECK_EQ_INT(k3_chat_add(&c, K3_CHAT_ASSISTANT, "x", 1, NULL, 0, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "expected a system or user message");
    add(&c, K3_CHAT_USER, "a", NULL);
    CLR;
    CHECK_EQ_INT(k3_chat_add(&c, K3_CHAT_USER, "x", 1, NULL, 0, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "expected an assistant message");
    CLR;
    CHECK_EQ_INT(k3_chat_add(&c, K3_CHAT_SYSTEM, "x", 1, NULL, 0, &e), K3_EARG);
    CHECK_EQ_INT(k3_chat_add(&c, K3_CHAT_ASSISTANT, "x", 1, NULL, 0, &e), 0);
    CLR;
    CHECK_EQ_INT(k3_chat_add(&c, K3_CHAT_USER, "x", 1, "r", 1, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "only an assistant message has reasoning");
    /* a generation prompt needs a last user message */
    k3_tok *tok = tiny_tok();
    k3_chat_opts o = {1, K3_CHAT_MAX};
    uint32_t *ids;
    uint64_t n;
    CLR;
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 1, &ids, &n, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "generation prompt follows a user message");
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 0, &ids, &n, &e), 0);
    free(ids);
    /* order checked in render too (a conversation built by hand) */
    c.msgs[1].role = K3_CHAT_USER;
    CLR;
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 0, &ids, &n, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "message 2 is a user message");
    k3_chat_free(&c);
    k3_tok_close(tok);
    k3_chat_effort ef;
    CLR;
    CHECK_EQ_INT(k3_chat_effort_parse("medium", &ef, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "'medium' is not supported");
    CLR;
    CHECK_EQ_INT(k3_chat_effort_parse("huge", &ef, &e), K3_EARG);
    CHECK_EQ_INT(k3_chat_effort_parse("high", &ef, &e), 0);
    CHECK_EQ_INT(ef, K3_CHAT_HIGH);
}

static int parse(k3_tok *tok, int thinking, const uint32_t *ids, uint64_t n, char **r, char **a, k3_err *e)
{
    k3_chat_opts o = {thinking, K3_CHAT_MAX};
    uint64_t rl, al;
    k3_err_clear(e);
    return k3_chat_parse(tok, &o, ids, n, r, &rl, a, &al, e);
}

K3_TEST(chat_parses_a_turn_and_rejects_malformed_ones)
{
    k3_tok *tok = tiny_tok();
    char *r = NULL, *a = NULL;
    k3_err e = {0};
    static const uint32_t good[] = {X_LET_ME, CLS, T_THINK, SEP, OPN, T_RESPONSE, SEP, X_HI_THERE,
                                    CLS, T_RESPONSE, SEP, CLS, T_MESSAGE, SEP, EOS};
    CHECK_EQ_INT(parse(tok, 1, good, sizeof good / 4, &r, &a, &e), 0);
    CHECK_STR_EQ(r, "Let me think.");
    CHECK_STR_EQ(a, "Hi there.");
    free(r);
    free(a);
    /* thinking off, <|end_of_msg|> as the end id */
    static const uint32_t off[] = {X_HI_THERE, CLS, T_RESPONSE, SEP, CLS, T_MESSAGE, SEP, EOM};
    CHECK_EQ_INT(parse(tok, 0, off, sizeof off / 4, &r, &a, &e), 0);
    CHECK_STR_EQ(r, "");
    CHECK_STR_EQ(a, "Hi there.");
    free(r);
    free(a);
    /* a control token inside the answer */
    static const uint32_t ctl_in_answer[] = {X_HI_THERE, OPN, CLS, T_RESPONSE, SEP, CLS, T_MESSAGE, SEP, EOS};
    CHECK_EQ_INT(parse(tok, 0, ctl_in_answer, sizeof ctl_in_answer / 4, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "control token '<|open|>' (id 587, token 6 of the turn) inside the answer");
    static const uint32_t eos_in_reasoning[] = {X_LET_ME, EOS};
    CHECK_EQ_INT(parse(tok, 1, eos_in_reasoning, 9, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "inside the reasoning");
    /* wrong closing: </response> where </think> belongs, and a misspelt tag */
    static const uint32_t wrong_close[] = {X_LET_ME, CLS, T_RESPONSE, SEP};
    CHECK_EQ_INT(parse(tok, 1, wrong_close, sizeof wrong_close / 4, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tag name is not 'think'");
    static const uint32_t no_open[] = {X_LET_ME, CLS, T_THINK, SEP, X_HI_THERE};
    CHECK_EQ_INT(parse(tok, 1, no_open, sizeof no_open / 4, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "must follow the reasoning");
    static const uint32_t short_tag[] = {X_HI_THERE, CLS, 410, SEP};   /* "resp" */
    CHECK_EQ_INT(parse(tok, 0, short_tag, sizeof short_tag / 4, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tag name ended by '<|sep|>'");
    /* cut short, and something after the end */
    CHECK_EQ_INT(parse(tok, 1, good, sizeof good / 4 - 1, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "before its closing");
    static const uint32_t after[] = {X_HI_THERE, CLS, T_RESPONSE, SEP, CLS, T_MESSAGE, SEP, EOM, 72};
    CHECK_EQ_INT(parse(tok, 0, after, sizeof after / 4, &r, &a, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "after the end of the turn");
    /* the streaming classes */
    k3_chat_turn *t;
    k3_chat_opts o = {1, K3_CHAT_MAX};
    CHECK_EQ_INT(k3_chat_turn_create(&t, tok, &o, &e), 0);
    CHECK_EQ_INT(k3_chat_turn_push(t, 76, &e), K3_CHAT_EV_REASONING);
    CHECK_EQ_INT(k3_chat_turn_push(t, CLS, &e), K3_CHAT_EV_MARKUP);
    for (int i = 0; i < 4; i++)
        CHECK_EQ_INT(k3_chat_turn_push(t, (uint32_t[]){T_THINK}[i], &e), K3_CHAT_EV_MARKUP);
    CHECK_EQ_INT(k3_chat_turn_push(t, SEP, &e), K3_CHAT_EV_MARKUP);
    CHECK_EQ_INT(k3_chat_turn_push(t, OPN, &e), K3_CHAT_EV_MARKUP);
    for (int i = 0; i < 5; i++)
        CHECK_EQ_INT(k3_chat_turn_push(t, (uint32_t[]){T_RESPONSE}[i], &e), K3_CHAT_EV_MARKUP);
    CHECK_EQ_INT(k3_chat_turn_push(t, SEP, &e), K3_CHAT_EV_MARKUP);
    CHECK_EQ_INT(k3_chat_turn_push(t, 72, &e), K3_CHAT_EV_ANSWER);
    CHECK(!k3_chat_turn_done(t));
    k3_chat_turn_free(t);
    k3_tok_close(tok);
}

static void write_text(const char *path, const char *s, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    CHECK(fwrite(s, 1, n, f) == n);
    CHECK(fclose(f) == 0);
}

static void history_error(const char *text, const char *want, int code)
{
    static int k;
    char path[4096];
    snprintf(path, sizeof path, "%s/bad%d.jsonl", k3t_tmpdir(), k++);
    write_text(path, text, strlen(text));
    k3_chat c = {0};
    k3_err e = {0};
    int rc = k3_chat_history_read(&c, path, &e);
    if (rc != code || !strstr(e.msg, want))
        fprintf(stderr, "history %s: %d %s\n", text, rc, e.msg);
    CHECK_EQ_INT(rc, code);
    CHECK_STR_CONTAINS(e.msg, want);
    CHECK_STR_CONTAINS(e.msg, path);
    CHECK_EQ_INT(c.n, 0);
    k3_chat_free(&c);
}

K3_TEST(chat_history_round_trips_and_reader_is_strict)
{
    k3_tok *tok = tiny_tok();
    k3_chat c = {0}, d = {0};
    add(&c, K3_CHAT_SYSTEM, "Be \"brief\".\n\ttab", NULL);
    add(&c, K3_CHAT_USER, "Say <|open|> now \xc3\xa9 \xf0\x9f\x99\x82", NULL);
    add(&c, K3_CHAT_ASSISTANT, "Hi there.", "Let me\nthink.");
    add(&c, K3_CHAT_USER, "", NULL);
    char path[4096];
    snprintf(path, sizeof path, "%s/h.jsonl", k3t_tmpdir());
    k3_err e = {0};
    CHECK_EQ_INT(k3_chat_history_write(&c, path, &e), 0);
    CHECK_EQ_INT(k3_chat_history_read(&d, path, &e), 0);
    CHECK_EQ_INT(d.n, 4);
    k3_chat_opts o = {1, K3_CHAT_HIGH};
    uint32_t *a, *b;
    uint64_t na, nb;
    CHECK_EQ_INT(k3_chat_render(tok, &o, &c, 1, &a, &na, &e), 0);
    CHECK_EQ_INT(k3_chat_render(tok, &o, &d, 1, &b, &nb, &e), 0);
    check_ids(b, nb, a, na);
    free(a);
    free(b);
    CHECK_STR_EQ(d.msgs[2].reasoning, "Let me\nthink.");
    k3_chat_free(&c);
    k3_chat_free(&d);
    k3_tok_close(tok);

    history_error("{\"role\":\"user\",\"content\":\"a\"}", "no newline at the end", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\"}\n\n", "line 2: empty line", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\",\"x\":1}\n", "unknown key \"x\"", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\",\"content\":\"b\"}\n", "appears twice", K3_EFORMAT);
    history_error("{\"role\":\"assistant\",\"content\":\"a\"}\n", "line 1: message 1 is an assistant", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"user\",\"content\":\"a\"}\n",
                  "line 2: message 2 is a user message, expected an assistant", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\",\"reasoning_content\":\"r\"}\n", "only an assistant",
                  K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"\xff\"}\n", "not valid UTF-8", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\\u0000b\"}\n", "escapes NUL", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":3}\n", "must be strings", K3_EFORMAT);
    history_error("{\"role\":\"bot\",\"content\":\"a\"}\n", "is not system, user or assistant", K3_EFORMAT);
    history_error("[1]\n", "not a JSON object", K3_EFORMAT);
    history_error("{\"role\":\"user\",\"content\":\"a\"} x\n", "not one JSON value", K3_EFORMAT);
    /* "\\u0000" is a backslash then u0000: allowed */
    snprintf(path, sizeof path, "%s/ok.jsonl", k3t_tmpdir());
    const char *esc = "{\"role\":\"user\",\"content\":\"a\\\\u0000\"}\n";
    write_text(path, esc, strlen(esc));
    CHECK_EQ_INT(k3_chat_history_read(&d, path, &e), 0);
    CHECK_STR_EQ(d.msgs[0].content, "a\\u0000");
    k3_chat_free(&d);
    /* a line over the bound is refused before it is parsed */
    size_t big = K3_CHAT_LINE_MAX + 2;
    char *s = malloc(big + 1);
    CHECK(s != NULL);
    memset(s, 'a', big);
    s[big - 1] = '\n';
    snprintf(path, sizeof path, "%s/big.jsonl", k3t_tmpdir());
    write_text(path, s, big);
    free(s);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_chat_history_read(&d, path, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "line 1: longer than 16777216 bytes");
}
