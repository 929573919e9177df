/*
 * chat.c - the K3 chat format (k3_chat.h): conversations, rendering to ids,
 * the parser of the model's turn. History files are in chat_history.c.
 *
 * Invariant: a control token id is only ever appended by put_ctl; every text
 * piece goes through put_text, one k3_tok_encode call with flags 0 (special
 * matching off) per piece, so the ids of a piece are those of its bytes as
 * one unit and nothing typed can become a control token.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_chat.h"
#include "k3_json.h"

static const char effort_text[] =
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=";

static const char *const effort_names[] = {"low", "high", "max"};
static const char *const role_names[] = {"system", "user", "assistant"};

const char *k3_chat_effort_name(k3_chat_effort effort) { return effort_names[effort]; }
const char *k3_chat_role_name(k3_chat_role role) { return role_names[role]; }

int k3_chat_effort_parse(const char *s, k3_chat_effort *out, k3_err *e)
{
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, effort_names[i])) {
            *out = (k3_chat_effort)i;
            return 0;
        }
    if (!strcmp(s, "medium"))
        return k3_err_set(e, K3_EARG, "thinking effort 'medium' is not supported by K3's chat encoder "
                                      "(use low, high or max)");
    return k3_err_set(e, K3_EARG, "thinking effort '%.64s' is not one of low, high, max", s);
}

int k3_chat_ctl_find(const k3_tok *tok, k3_chat_ctl *ctl, k3_err *e)
{
    static const char *const names[] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"};
    uint32_t *dst[] = {&ctl->open, &ctl->close, &ctl->sep, &ctl->end_of_msg, &ctl->eos};
    for (int i = 0; i < 5; i++) {
        int64_t id = k3_tok_special_id(tok, names[i], strlen(names[i]));
        if (id < 0)
            return k3_err_set(e, K3_EFORMAT, "the tokenizer has no %s special token: it cannot chat in the K3 format",
                              names[i]);
        *dst[i] = (uint32_t)id;
    }
    return 0;
}

/* ------------------------------------------------------------ conversation */

k3_chat_role k3_chat_next_role(const k3_chat *c)
{
    if (c->n == 0)
        return K3_CHAT_USER;   /* or a system message */
    return c->msgs[c->n - 1].role == K3_CHAT_USER ? K3_CHAT_ASSISTANT : K3_CHAT_USER;
}

static char *dupn(const char *s, uint64_t n)
{
    char *p = malloc((size_t)n + 1);
    if (p) {
        if (n)
            memcpy(p, s, (size_t)n);
        p[n] = 0;
    }
    return p;
}

int k3_chat_add(k3_chat *c, k3_chat_role role, const char *content, uint64_t content_len, const char *reasoning,
                uint64_t reasoning_len, k3_err *e)
{
    k3_chat_role want = k3_chat_next_role(c);
    if (role == K3_CHAT_SYSTEM ? c->n != 0 : role != want)
        return k3_err_set(e, K3_EARG, "message %u is %s %s message, expected %s", c->n + 1,
                          role == K3_CHAT_ASSISTANT ? "an" : "a", role_names[role],
                          c->n == 0 ? "a system or user message" : want == K3_CHAT_USER ? "a user message"
                                                                                        : "an assistant message");
    if (reasoning && role != K3_CHAT_ASSISTANT)
        return k3_err_set(e, K3_EARG, "message %u: only an assistant message has reasoning", c->n + 1);
    if (c->n == K3_CHAT_MAX_MSGS)
        return k3_err_set(e, K3_ELIMIT, "a conversation holds at most %u messages", K3_CHAT_MAX_MSGS);
    if (c->n == c->cap) {
        uint32_t cap = c->cap ? c->cap * 2 : 16;
        k3_chat_msg *m = realloc(c->msgs, (size_t)cap * sizeof *m);
        if (!m)
            return k3_err_set(e, K3_ENOMEM, "out of memory for the conversation");
        c->msgs = m;
        c->cap = cap;
    }
    k3_chat_msg *m = &c->msgs[c->n];
    memset(m, 0, sizeof *m);
    m->role = role;
    m->content = dupn(content ? content : "", content_len);
    m->content_len = content_len;
    if (reasoning) {
        m->reasoning = dupn(reasoning, reasoning_len);
        m->reasoning_len = reasoning_len;
    }
    if (!m->content || (reasoning && !m->reasoning)) {
        free(m->content);
        free(m->reasoning);
        return k3_err_set(e, K3_ENOMEM, "out of memory for the conversation");
    }
    c->n++;
    return 0;
}

void k3_chat_clear(k3_chat *c)
{
    for (uint32_t i = 0; i < c->n; i++) {
        free(c->msgs[i].content);
        free(c->msgs[i].reasoning);
    }
    c->n = 0;
}

void k3_chat_free(k3_chat *c)
{
    if (!c)
        return;
    k3_chat_clear(c);
    free(c->msgs);
    memset(c, 0, sizeof *c);
}

/* --------------------------------------------------------------- rendering */

typedef struct idbuf {
    uint32_t *ids;
    uint64_t n, cap;
    const k3_tok *tok;
    k3_err *e;
} idbuf;

static int reserve(idbuf *b, uint64_t more)
{
    if (b->n + more <= b->cap)
        return 0;
    uint64_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more)
        cap *= 2;
    uint32_t *p = realloc(b->ids, (size_t)cap * sizeof *p);
    if (!p)
        return k3_err_set(b->e, K3_ENOMEM, "out of memory rendering the conversation");
    b->ids = p;
    b->cap = cap;
    return 0;
}

static int put_ctl(idbuf *b, uint32_t id)
{
    int rc = reserve(b, 1);
    if (rc == 0)
        b->ids[b->n++] = id;
    return rc;
}

static int put_text(idbuf *b, const char *s, uint64_t len)
{
    if (len == 0)
        return 0;
    uint32_t *ids;
    uint64_t n;
    int rc = k3_tok_encode(b->tok, s, len, 0, &ids, &n, b->e);
    if (rc < 0)
        return rc;
    rc = reserve(b, n);
    if (rc == 0) {
        memcpy(b->ids + b->n, ids, (size_t)n * sizeof *ids);
        b->n += n;
    }
    free(ids);
    return rc;
}

static int put_str(idbuf *b, const char *s) { return put_text(b, s, strlen(s)); }

/* <|open|> head <|sep|>: head is "tag attrs", one text piece */
static int open_el(idbuf *b, const k3_chat_ctl *c, const char *head)
{
    int rc = put_ctl(b, c->open);
    if (rc == 0)
        rc = put_str(b, head);
    if (rc == 0)
        rc = put_ctl(b, c->sep);
    return rc;
}

/* <|close|> tag <|sep|> */
static int close_el(idbuf *b, const k3_chat_ctl *c, const char *tag)
{
    int rc = put_ctl(b, c->close);
    if (rc == 0)
        rc = put_str(b, tag);
    if (rc == 0)
        rc = put_ctl(b, c->sep);
    return rc;
}

static int element(idbuf *b, const k3_chat_ctl *c, const char *head, const char *tag, const char *body,
                   uint64_t len)
{
    int rc = open_el(b, c, head);
    if (rc == 0)
        rc = put_text(b, body, len);
    if (rc == 0)
        rc = close_el(b, c, tag);
    return rc;
}

static int message(idbuf *b, const k3_chat_ctl *c, const char *head, const char *body, uint64_t len)
{
    int rc = element(b, c, head, "message", body, len);
    if (rc == 0)
        rc = put_ctl(b, c->end_of_msg);
    return rc;
}

int k3_chat_render(const k3_tok *tok, const k3_chat_opts *o, const k3_chat *c, int gen_prompt, uint32_t **ids,
                   uint64_t *n_ids, k3_err *e)
{
    *ids = NULL;
    *n_ids = 0;
    k3_chat_ctl ctl;
    int rc = k3_chat_ctl_find(tok, &ctl, e);
    if (rc < 0)
        return rc;
    /* the order, checked again: a caller may have built msgs by hand */
    for (uint32_t i = 0; i < c->n; i++) {
        k3_chat_role r = c->msgs[i].role, want;
        uint32_t k = c->n && c->msgs[0].role == K3_CHAT_SYSTEM ? i - 1 : i;
        if (r == K3_CHAT_SYSTEM && i == 0)
            continue;
        want = k % 2 ? K3_CHAT_ASSISTANT : K3_CHAT_USER;
        if (r != want)
            return k3_err_set(e, K3_EARG, "message %u is %s %s message, expected %s", i + 1,
                              r == K3_CHAT_ASSISTANT ? "an" : "a", role_names[r],
                              want == K3_CHAT_USER ? "a user message" : "an assistant message");
    }
    if (gen_prompt && (c->n == 0 || c->msgs[c->n - 1].role != K3_CHAT_USER))
        return k3_err_set(e, K3_EARG, "a generation prompt follows a user message: the conversation ends with %s",
                          c->n ? role_names[c->msgs[c->n - 1].role] : "no message");
    idbuf b = {NULL, 0, 0, tok, e};
    if (o->thinking) {
        char body[sizeof effort_text + 16];
        int len = snprintf(body, sizeof body, "%s%s`.", effort_text, effort_names[o->effort]);
        rc = message(&b, &ctl, "message role=\"system\" type=\"thinking-effort\"", body, (uint64_t)len);
    }
    for (uint32_t i = 0; i < c->n && rc == 0; i++) {
        const k3_chat_msg *m = &c->msgs[i];
        if (m->role != K3_CHAT_ASSISTANT) {
            rc = message(&b, &ctl, m->role == K3_CHAT_USER ? "message role=\"user\"" : "message role=\"system\"",
                         m->content, m->content_len);
            continue;
        }
        rc = open_el(&b, &ctl, "message role=\"assistant\"");
        if (rc == 0 && o->thinking)
            rc = element(&b, &ctl, "think", "think", m->reasoning ? m->reasoning : "", m->reasoning_len);
        if (rc == 0)
            rc = element(&b, &ctl, "response", "response", m->content, m->content_len);
        if (rc == 0)
            rc = close_el(&b, &ctl, "message");
        if (rc == 0)
            rc = put_ctl(&b, ctl.end_of_msg);
    }
    if (rc == 0 && gen_prompt) {
        rc = open_el(&b, &ctl, "message role=\"assistant\"");
        if (rc == 0)
            rc = open_el(&b, &ctl, o->thinking ? "think" : "response");
    }
    if (rc < 0) {
        free(b.ids);
        return rc;
    }
    if (!b.ids && (rc = reserve(&b, 1)) < 0)
        return rc;
    *ids = b.ids;
    *n_ids = b.n;
    return 0;
}

/* ------------------------------------------------------------- turn parser */

/* Where the parser is. TAG states read a tag name up to <|sep|>. */
enum {
    ST_REASONING,     /* think body */
    ST_THINK_CLOSE,   /* after <|close|>: "think" <|sep|> */
    ST_RESP_OPEN,     /* expect <|open|> */
    ST_RESP_TAG,      /* "response" <|sep|> */
    ST_ANSWER,        /* response body */
    ST_RESP_CLOSE,    /* after <|close|>: "response" <|sep|> */
    ST_MSG_CLOSE_TOK, /* expect <|close|> */
    ST_MSG_CLOSE,     /* "message" <|sep|> */
    ST_END,           /* expect [EOS] or <|end_of_msg|> */
    ST_DONE,
    ST_FAILED,
};

typedef struct sbuf {
    char *p;
    uint64_t n, cap;
} sbuf;

struct k3_chat_turn {
    const k3_tok *tok;
    k3_chat_ctl ctl;
    int thinking;
    int st;
    uint64_t count;        /* ids pushed */
    sbuf reasoning, answer;
    char tag[16];          /* tag name read so far */
    uint32_t tag_len;
};

static int sbuf_add(sbuf *b, const uint8_t *s, uint64_t n, k3_err *e)
{
    if (b->n + n + 1 > b->cap) {
        uint64_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, (size_t)cap);
        if (!p)
            return k3_err_set(e, K3_ENOMEM, "out of memory for the model's turn");
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, (size_t)n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int k3_chat_turn_create(k3_chat_turn **out, const k3_tok *tok, const k3_chat_opts *o, k3_err *e)
{
    *out = NULL;
    k3_chat_turn *t = calloc(1, sizeof *t);
    if (!t)
        return k3_err_set(e, K3_ENOMEM, "out of memory for the turn parser");
    int rc = k3_chat_ctl_find(tok, &t->ctl, e);
    if (rc < 0) {
        free(t);
        return rc;
    }
    t->tok = tok;
    t->thinking = o->thinking;
    k3_chat_turn_reset(t);
    *out = t;
    return 0;
}

void k3_chat_turn_free(k3_chat_turn *t)
{
    if (!t)
        return;
    free(t->reasoning.p);
    free(t->answer.p);
    free(t);
}

void k3_chat_turn_reset(k3_chat_turn *t)
{
    t->st = t->thinking ? ST_REASONING : ST_ANSWER;
    t->count = 0;
    t->reasoning.n = t->answer.n = 0;
    if (t->reasoning.p)
        t->reasoning.p[0] = 0;
    if (t->answer.p)
        t->answer.p[0] = 0;
    t->tag_len = 0;
}

int k3_chat_turn_done(const k3_chat_turn *t) { return t->st == ST_DONE; }

const char *k3_chat_turn_reasoning(const k3_chat_turn *t, uint64_t *len)
{
    *len = t->reasoning.n;
    return t->reasoning.p ? t->reasoning.p : "";
}

const char *k3_chat_turn_answer(const k3_chat_turn *t, uint64_t *len)
{
    *len = t->answer.n;
    return t->answer.p ? t->answer.p : "";
}

static const char *where(int st)
{
    switch (st) {
    case ST_REASONING: return "inside the reasoning";
    case ST_ANSWER: return "inside the answer";
    case ST_THINK_CLOSE: case ST_RESP_TAG: case ST_RESP_CLOSE: case ST_MSG_CLOSE: return "inside a tag name";
    case ST_RESP_OPEN: return "where <|open|>response<|sep|> must follow the reasoning";
    case ST_MSG_CLOSE_TOK: return "where <|close|>message<|sep|> must follow the answer";
    case ST_END: return "where an end id ([EOS] or <|end_of_msg|>) must end the turn";
    default: return "after the end of the turn";
    }
}

static int fail(k3_chat_turn *t, uint32_t id, const char *what, k3_err *e)
{
    int st = t->st;
    t->st = ST_FAILED;
    uint64_t len = 0;
    const uint8_t *b = k3_tok_token_bytes(t->tok, id, &len);
    return k3_err_set(e, K3_EFORMAT, "malformed turn: %s %s%.*s%s (id %u, token %llu of the turn) %s", what,
                      b ? "'" : "", b ? (int)(len > 40 ? 40 : len) : 0, b ? (const char *)b : "", b ? "'" : "",
                      id, (unsigned long long)t->count, where(st));
}

/* A tag-name state: ordinary ids extend the name, <|sep|> ends it. */
static int tag_step(k3_chat_turn *t, uint32_t id, const char *want, int next, k3_err *e)
{
    if (id == t->ctl.sep) {
        if (t->tag_len != strlen(want) || memcmp(t->tag, want, t->tag_len))
            return fail(t, id, "tag name ended by", e);
        t->st = next;
        t->tag_len = 0;
        return K3_CHAT_EV_MARKUP;
    }
    if (k3_tok_is_special(t->tok, id))
        return fail(t, id, "special token", e);
    uint64_t len;
    const uint8_t *b = k3_tok_token_bytes(t->tok, id, &len);
    if (!b || t->tag_len + len > strlen(want) || memcmp(want + t->tag_len, b, (size_t)len)) {
        char what[64];
        snprintf(what, sizeof what, "tag name is not '%s':", want);
        return fail(t, id, what, e);
    }
    memcpy(t->tag + t->tag_len, b, (size_t)len);
    t->tag_len += (uint32_t)len;
    return K3_CHAT_EV_MARKUP;
}

int k3_chat_turn_push(k3_chat_turn *t, uint32_t id, k3_err *e)
{
    if (t->st == ST_FAILED)
        return k3_err_set(e, K3_EFORMAT, "malformed turn: the parser already failed");
    t->count++;
    const k3_chat_ctl *c = &t->ctl;
    int special = k3_tok_is_special(t->tok, id);
    switch (t->st) {
    case ST_REASONING:
    case ST_ANSWER: {
        if (id == c->close) {
            t->st = t->st == ST_REASONING ? ST_THINK_CLOSE : ST_RESP_CLOSE;
            t->tag_len = 0;
            return K3_CHAT_EV_MARKUP;
        }
        if (special)
            return fail(t, id, "control token", e);
        uint64_t len;
        const uint8_t *b = k3_tok_token_bytes(t->tok, id, &len);
        if (!b)
            return fail(t, id, "id outside the vocabulary", e);
        int rc = sbuf_add(t->st == ST_REASONING ? &t->reasoning : &t->answer, b, len, e);
        if (rc < 0)
            return rc;
        return t->st == ST_REASONING ? K3_CHAT_EV_REASONING : K3_CHAT_EV_ANSWER;
    }
    case ST_THINK_CLOSE: return tag_step(t, id, "think", ST_RESP_OPEN, e);
    case ST_RESP_OPEN:
        if (id != c->open)
            return fail(t, id, "unexpected token", e);
        t->st = ST_RESP_TAG;
        return K3_CHAT_EV_MARKUP;
    case ST_RESP_TAG: return tag_step(t, id, "response", ST_ANSWER, e);
    case ST_RESP_CLOSE: return tag_step(t, id, "response", ST_MSG_CLOSE_TOK, e);
    case ST_MSG_CLOSE_TOK:
        if (id != c->close)
            return fail(t, id, "unexpected token", e);
        t->st = ST_MSG_CLOSE;
        return K3_CHAT_EV_MARKUP;
    case ST_MSG_CLOSE: return tag_step(t, id, "message", ST_END, e);
    case ST_END:
        if (id != c->eos && id != c->end_of_msg)
            return fail(t, id, "unexpected token", e);
        t->st = ST_DONE;
        return K3_CHAT_EV_END;
    default:
        return fail(t, id, "token", e);
    }
}

int k3_chat_parse(const k3_tok *tok, const k3_chat_opts *o, const uint32_t *ids, uint64_t n, char **reasoning,
                  uint64_t *reasoning_len, char **answer, uint64_t *answer_len, k3_err *e)
{
    *reasoning = *answer = NULL;
    k3_chat_turn *t;
    int rc = k3_chat_turn_create(&t, tok, o, e);
    for (uint64_t i = 0; i < n && rc >= 0; i++)
        rc = k3_chat_turn_push(t, ids[i], e);
    if (rc >= 0 && t->st != ST_DONE)
        rc = k3_err_set(e, K3_EFORMAT, "malformed turn: it ends after %llu tokens %s, before its closing",
                        (unsigned long long)n, where(t->st));
    if (rc >= 0) {
        uint64_t rl, al;
        const char *r = k3_chat_turn_reasoning(t, &rl), *a = k3_chat_turn_answer(t, &al);
        *reasoning = dupn(r, rl);
        *answer = dupn(a, al);
        if (!*reasoning || !*answer) {
            free(*reasoning);
            free(*answer);
            *reasoning = *answer = NULL;
            rc = k3_err_set(e, K3_ENOMEM, "out of memory for the model's turn");
        } else {
            *reasoning_len = rl;
            *answer_len = al;
            rc = 0;
        }
    }
    k3_chat_turn_free(t);
    return rc;
}

/* ------------------------------------------------------------------ UTF-8 */

int k3_chat_utf8_valid(const char *s, uint64_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    for (uint64_t i = 0; i < len;) {
        int l = k3_utf8_len(u + i, len - i);
        if (l == 0 || u[i] == 0)
            return 0;
        i += (uint64_t)l;
    }
    return 1;
}

int k3_chat_utf8_clean(const char *s, uint64_t len, char **out, uint64_t *out_len, k3_err *e)
{
    if (len > (UINT64_MAX - 1) / 3)
        return k3_err_set(e, K3_ELIMIT, "text too long");
    char *p = malloc((size_t)len * 3 + 1);
    if (!p)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    const unsigned char *u = (const unsigned char *)s;
    uint64_t n = 0;
    for (uint64_t i = 0; i < len;) {
        int l = k3_utf8_len(u + i, len - i);
        if (l == 0 || u[i] == 0) {
            memcpy(p + n, "\xEF\xBF\xBD", 3);
            n += 3;
            i++;
        } else {
            memcpy(p + n, u + i, (size_t)l);
            n += (uint64_t)l;
            i += (uint64_t)l;
        }
    }
    p[n] = 0;
    *out = p;
    *out_len = n;
    return 0;
}
