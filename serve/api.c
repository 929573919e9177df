/*
 * api.c - the OpenAI request bodies k3-serve takes and the JSON it answers
 * (serve/SERVE.md lists every field). Parsing is strict about what it reads
 * (a wrong type or a value out of range is 400 naming the field) and ignores
 * fields it does not know, as OpenAI's clients send some.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "k3_cli.h"
#include "serve.h"

#define FAIL(p, ...)                                   \
    do {                                               \
        snprintf(msg, cap, __VA_ARGS__);               \
        *param = (p);                                  \
        rc = 400;                                      \
        goto out;                                      \
    } while (0)

/* A JSON number that is an integer in [lo, hi]. */
static int get_int(const cJSON *v, double lo, double hi, double *out)
{
    if (!cJSON_IsNumber(v))
        return -1;
    double d = v->valuedouble;
    if (!(d >= lo && d <= hi) || floor(d) != d)
        return -1;
    *out = d;
    return 0;
}

static int is_set(const cJSON *v) { return v && !cJSON_IsNull(v); }

/* A message's content: a string, or an array of {"type":"text","text":...}
 * parts (joined). Heap string in *out. */
static int content_text(const cJSON *c, char **out, uint64_t *len)
{
    *out = NULL;
    *len = 0;
    if (!c || cJSON_IsNull(c)) {
        *out = strdup("");
        return *out ? 0 : -2;
    }
    if (cJSON_IsString(c)) {
        *len = strlen(c->valuestring);
        *out = strdup(c->valuestring);
        return *out ? 0 : -2;
    }
    if (!cJSON_IsArray(c))
        return -1;
    uint64_t n = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, c) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "type"), *x = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") || !cJSON_IsString(x))
            return -1;
        n += strlen(x->valuestring);
    }
    char *s = malloc(n + 1);
    if (!s)
        return -2;
    uint64_t at = 0;
    cJSON_ArrayForEach(p, c) {
        const char *x = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
        size_t l = strlen(x);
        memcpy(s + at, x, l);
        at += l;
    }
    s[at] = 0;
    *out = s;
    *len = at;
    return 0;
}

static int parse_messages(srv *S, const cJSON *msgs, srv_req *r, char *msg, uint32_t cap, const char **param)
{
    int rc = 0;
    k3_chat c = {0};
    k3_err e = {0};
    char *content = NULL, *reasoning = NULL;
    if (!S->can_chat)
        FAIL("messages", "this model's tokenizer has no chat control tokens");
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0)
        FAIL("messages", "'messages' must be a non-empty array");
    const cJSON *m;
    int i = 0;
    cJSON_ArrayForEach(m, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsObject(m) || !cJSON_IsString(role))
            FAIL("messages", "messages[%d] must be an object with a string 'role'", i);
        k3_chat_role rl;
        if (!strcmp(role->valuestring, "system") || !strcmp(role->valuestring, "developer"))
            rl = K3_CHAT_SYSTEM;
        else if (!strcmp(role->valuestring, "user"))
            rl = K3_CHAT_USER;
        else if (!strcmp(role->valuestring, "assistant"))
            rl = K3_CHAT_ASSISTANT;
        else
            FAIL("messages", "messages[%d].role '%.40s' is not system, user or assistant", i, role->valuestring);
        uint64_t cl, rlen = 0;
        int k = content_text(cJSON_GetObjectItemCaseSensitive(m, "content"), &content, &cl);
        if (k == -2) {
            rc = 500;
            snprintf(msg, cap, "out of memory");
            goto out;
        }
        if (k < 0)
            FAIL("messages", "messages[%d].content must be a string or an array of text parts", i);
        const cJSON *rc_ = cJSON_GetObjectItemCaseSensitive(m, "reasoning_content");
        if (is_set(rc_)) {
            if (!cJSON_IsString(rc_) || rl != K3_CHAT_ASSISTANT)
                FAIL("messages", "messages[%d].reasoning_content must be a string, on an assistant message", i);
            rlen = strlen(rc_->valuestring);
            reasoning = strdup(rc_->valuestring);
        }
        char *clean;
        uint64_t clean_len;
        if (k3_chat_utf8_clean(content, cl, &clean, &clean_len, &e) < 0) {
            rc = 500;
            snprintf(msg, cap, "%s", e.msg);
            goto out;
        }
        free(content);
        content = clean;
        if (k3_chat_add(&c, rl, content, clean_len, reasoning, rlen, &e) < 0)
            FAIL("messages", "messages[%d]: %s", i, e.msg);
        free(content);
        free(reasoning);
        content = reasoning = NULL;
        i++;
    }
    if (c.msgs[c.n - 1].role != K3_CHAT_USER)
        FAIL("messages", "the last message must be a user message");
    uint32_t *ids;
    uint64_t n;
    if (k3_chat_render(S->tok, &r->fmt, &c, 1, &ids, &n, &e) < 0)
        FAIL("messages", "%s", e.msg);
    if (n > S->cfg.ctx) {
        free(ids);
        FAIL("messages", "the conversation is %llu tokens, over the context of %u", (unsigned long long)n,
             S->cfg.ctx);
    }
    r->prompt = ids;
    r->n_prompt = (uint32_t)n;
out:
    free(content);
    free(reasoning);
    k3_chat_free(&c);
    return rc;
}

static int parse_prompt(srv *S, const cJSON *p, srv_req *r, char *msg, uint32_t cap, const char **param)
{
    int rc = 0;
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
        p = cJSON_GetArrayItem(p, 0);   /* one prompt in a list */
    if (cJSON_IsString(p)) {
        if (!S->tok)
            FAIL("prompt", "this model has no tokenizer");
        uint32_t *ids;
        uint64_t n;
        k3_err e = {0};
        if (k3_tok_encode(S->tok, p->valuestring, strlen(p->valuestring), K3_TOK_ALLOW_SPECIAL, &ids, &n, &e) < 0)
            FAIL("prompt", "%s", e.msg);
        r->prompt = ids;
        if (n > S->cfg.ctx)
            FAIL("prompt", "the prompt is %llu tokens, over the context of %u", (unsigned long long)n, S->cfg.ctx);
        r->n_prompt = (uint32_t)n;
    } else if (cJSON_IsArray(p)) {
        int n = cJSON_GetArraySize(p);
        if ((uint32_t)n > S->cfg.ctx)
            FAIL("prompt", "the prompt is %d tokens, over the context of %u", n, S->cfg.ctx);
        r->prompt = malloc(((size_t)n + 1) * sizeof *r->prompt);
        if (!r->prompt) {
            snprintf(msg, cap, "out of memory");
            return 500;
        }
        const cJSON *x;
        int i = 0;
        cJSON_ArrayForEach(x, p) {
            double d;
            if (get_int(x, 0, (double)S->V - 1, &d) < 0)
                FAIL("prompt", "prompt[%d] is not a token id below the vocabulary (%u)", i, S->V);
            r->prompt[i++] = (uint32_t)d;
        }
        r->n_prompt = (uint32_t)n;
    } else {
        FAIL("prompt", "'prompt' must be a string, one string in a list, or a list of token ids");
    }
    if (r->n_prompt == 0)
        FAIL("prompt", "the prompt is empty");
out:
    return rc;
}

/* 1 if the JSON text escapes a NUL (\u0000 after an odd run of
 * backslashes): cJSON would cut the string there, so it is refused. */
static int escapes_nul(const char *body)
{
    for (const char *p = strstr(body, "u0000"); p; p = strstr(p + 1, "u0000")) {
        size_t bs = 0;
        while (p - bs > body && p[-1 - (ptrdiff_t)bs] == '\\')
            bs++;
        if (bs % 2)
            return 1;
    }
    return 0;
}

int srv_parse_request(srv *S, int chat, const char *body, uint64_t len, srv_req *r, char *msg, uint32_t cap,
                      const char **param)
{
    int rc = 0;
    double d;
    *param = NULL;
    /* body is NUL-terminated: with it counted, cJSON refuses anything after the value */
    cJSON *root = memchr(body, 0, (size_t)len) ? NULL : cJSON_ParseWithLengthOpts(body, (size_t)len + 1, NULL, 1);
    r->chat = chat;
    r->temperature = 1.0;
    r->top_p = 1.0;
    r->fmt.thinking = 1;
    r->fmt.effort = K3_CHAT_MAX;
    if (!root) {
        snprintf(msg, cap, "the body is not valid JSON");
        rc = 400;
        goto out;
    }
    if (!cJSON_IsObject(root))
        FAIL(NULL, "the body must be a JSON object");
    if (escapes_nul(body))
        FAIL(NULL, "a string of the body holds \\u0000 (NUL), which k3 does not take");
    const cJSON *v;
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "model")) && !cJSON_IsString(v))
        FAIL("model", "'model' must be a string");
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "n")) && (get_int(v, 1, 1, &d) < 0))
        FAIL("n", "only n = 1 is supported");
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "stream"))) {
        if (!cJSON_IsBool(v))
            FAIL("stream", "'stream' must be a boolean");
        r->stream = cJSON_IsTrue(v);
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "stream_options"))) {
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(v, "include_usage");
        if (!cJSON_IsObject(v) || (is_set(u) && !cJSON_IsBool(u)))
            FAIL("stream_options", "'stream_options' must be an object with a boolean 'include_usage'");
        r->include_usage = cJSON_IsTrue(u);
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "temperature"))) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 2))
            FAIL("temperature", "'temperature' must be a number from 0 to 2");
        r->temperature = v->valuedouble;
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "top_p"))) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1))
            FAIL("top_p", "'top_p' must be a number above 0, at most 1");
        r->top_p = v->valuedouble;
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "top_k"))) {
        if (get_int(v, 0, 0x1p32 - 1, &d) < 0)
            FAIL("top_k", "'top_k' must be a whole number >= 0");
        r->top_k = (uint32_t)d;
    }
    r->speculative = -1;
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "speculative"))) {
        if (!cJSON_IsBool(v))
            FAIL("speculative", "'speculative' must be a boolean");
        if (cJSON_IsTrue(v) && !S->cfg.drafter)
            FAIL("speculative", "this server decodes without speculation: start it with --spec ngram[:K]");
        r->speculative = cJSON_IsTrue(v);
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "seed"))) {
        if (get_int(v, -0x1p63, 0x1p64 - 1, &d) < 0)
            FAIL("seed", "'seed' must be a whole number");
        r->seed = d < 0 ? (uint64_t)(int64_t)d : (uint64_t)d;
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "stop"))) {
        if (cJSON_IsString(v)) {
            if (!*v->valuestring || strlen(v->valuestring) > SRV_STOP_MAX_BYTES ||
                !k3_chat_utf8_valid(v->valuestring, strlen(v->valuestring)))
                FAIL("stop", "a stop string must be 1 to %d bytes of UTF-8", SRV_STOP_MAX_BYTES);
            r->stop[r->n_stop++] = strdup(v->valuestring);
        } else if (cJSON_IsArray(v) && cJSON_GetArraySize(v) <= SRV_MAX_STOP) {
            const cJSON *x;
            cJSON_ArrayForEach(x, v) {
                if (!cJSON_IsString(x) || !*x->valuestring || strlen(x->valuestring) > SRV_STOP_MAX_BYTES ||
                    !k3_chat_utf8_valid(x->valuestring, strlen(x->valuestring)))
                    FAIL("stop", "each stop string must be 1 to %d bytes of UTF-8", SRV_STOP_MAX_BYTES);
                r->stop[r->n_stop++] = strdup(x->valuestring);
            }
        } else {
            FAIL("stop", "'stop' must be a string or a list of at most %d strings", SRV_MAX_STOP);
        }
        for (uint32_t i = 0; i < r->n_stop; i++)
            if (!r->stop[i]) {
                snprintf(msg, cap, "out of memory");
                rc = 500;
                goto out;
            }
    }
    if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "logit_bias"))) {
        /* {"ID": BIAS, ...}: BIAS from -100 to 100 added to the logit of
         * token ID before sampling (-100 in effect bans it) */
        if (!cJSON_IsObject(v) || cJSON_GetArraySize(v) > SRV_MAX_BIAS)
            FAIL("logit_bias", "'logit_bias' must be an object of at most %d token ids", SRV_MAX_BIAS);
        uint32_t n = (uint32_t)cJSON_GetArraySize(v);
        r->bias_id = malloc((n ? n : 1) * sizeof *r->bias_id);
        r->bias = malloc((n ? n : 1) * sizeof *r->bias);
        if (!r->bias_id || !r->bias) {
            snprintf(msg, cap, "out of memory");
            rc = 500;
            goto out;
        }
        const cJSON *x;
        cJSON_ArrayForEach(x, v) {
            char *end;
            errno = 0;
            unsigned long id = strtoul(x->string, &end, 10);
            if (!x->string[0] || *end || x->string[0] < '0' || x->string[0] > '9' || errno || id >= S->V)
                FAIL("logit_bias", "a 'logit_bias' key must be a token id below %u, as a decimal string", S->V);
            if (!cJSON_IsNumber(x) || !(x->valuedouble >= -100 && x->valuedouble <= 100))
                FAIL("logit_bias", "a 'logit_bias' value must be a number from -100 to 100");
            r->bias_id[r->n_bias] = (uint32_t)id;
            r->bias[r->n_bias++] = (float)x->valuedouble;
        }
    }
    if (chat) {
        if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "thinking"))) {
            if (!cJSON_IsBool(v))
                FAIL("thinking", "'thinking' must be a boolean");
            r->fmt.thinking = cJSON_IsTrue(v);
        }
        if (is_set(v = cJSON_GetObjectItemCaseSensitive(root, "reasoning_effort"))) {
            k3_err e = {0};
            if (!cJSON_IsString(v) || k3_chat_effort_parse(v->valuestring, &r->fmt.effort, &e) < 0)
                FAIL("reasoning_effort", "'reasoning_effort' must be \"low\", \"high\" or \"max\"");
        }
        if ((rc = parse_messages(S, cJSON_GetObjectItemCaseSensitive(root, "messages"), r, msg, cap, param)))
            goto out;
    } else {
        v = cJSON_GetObjectItemCaseSensitive(root, "prompt");
        if (!v)
            FAIL("prompt", "'prompt' is required");
        if ((rc = parse_prompt(S, v, r, msg, cap, param)))
            goto out;
    }
    uint32_t room = S->cfg.ctx - r->n_prompt;
    r->max_tokens = chat ? room : (room < 16 ? room : 16);
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "max_tokens");
    if (!is_set(mt))
        mt = cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens");
    if (is_set(mt)) {
        if (get_int(mt, 1, 0x1p53, &d) < 0)
            FAIL("max_tokens", "'max_tokens' must be a whole number >= 1");
        if (d > room)
            FAIL("max_tokens",
                 "the context is %u tokens: %u of the prompt and max_tokens %.0f do not fit (at most %u)",
                 S->cfg.ctx, r->n_prompt, d, room);
        r->max_tokens = (uint32_t)d;
    }
    if (r->max_tokens == 0)
        FAIL("prompt", "the prompt fills the context of %u tokens: no room to generate", S->cfg.ctx);
out:
    cJSON_Delete(root);
    return rc;
}

void srv_req_free_fields(srv_req *r)
{
    free(r->prompt);
    for (uint32_t i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->bias_id);
    free(r->bias);
    free(r->text[0]);
    free(r->text[1]);
    free(r->pieces);
    free(r->hold);
}

/* ------------------------------------------------------------ responses */

static char *print_free(cJSON *o)
{
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return s;
}

char *srv_error_json(int status, const char *msg, const char *param)
{
    const char *type = status == 401   ? "authentication_error"
                       : status == 404 ? "not_found_error"
                       : status == 429 || status == 503 ? "server_overloaded"
                       : status >= 500 ? "server_error"
                                       : "invalid_request_error";
    cJSON *o = cJSON_CreateObject(), *er = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(er, "message", msg);
    cJSON_AddStringToObject(er, "type", type);
    if (param)
        cJSON_AddStringToObject(er, "param", param);
    else
        cJSON_AddNullToObject(er, "param");
    char code[16];
    snprintf(code, sizeof code, "%d", status);
    cJSON_AddStringToObject(er, "code", code);
    return print_free(o);
}

static cJSON *head(const srv *S, const srv_req *r, const char *object)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", r->id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)r->created);
    cJSON_AddStringToObject(o, "model", S->cfg.model_name);
    return o;
}

static void add_usage(cJSON *o, const srv_req *r)
{
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", r->n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", r->n_gen);
    cJSON_AddNumberToObject(u, "total_tokens", (double)r->n_prompt + r->n_gen);
}

static const char *text_of(const srv_req *r, int ch) { return r->text[ch] ? r->text[ch] : ""; }

char *srv_response_json(const srv *S, const srv_req *r)
{
    cJSON *o = head(S, r, r->chat ? "chat.completion" : "text_completion");
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (r->chat) {
        cJSON *m = cJSON_AddObjectToObject(c, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", text_of(r, SRV_CH_CONTENT));
        if (r->fmt.thinking)
            cJSON_AddStringToObject(m, "reasoning_content", text_of(r, SRV_CH_REASONING));
    } else {
        cJSON_AddStringToObject(c, "text", text_of(r, SRV_CH_CONTENT));
    }
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", r->finish ? r->finish : "stop");
    add_usage(o, r);
    return print_free(o);
}

static char *sse(cJSON *o)
{
    char *j = print_free(o);
    if (!j)
        return NULL;
    size_t n = strlen(j);
    char *s = malloc(n + 9);
    if (s)
        snprintf(s, n + 9, "data: %s\n\n", j);
    free(j);
    return s;
}

char *srv_chunk_json(const srv *S, const srv_req *r, const srv_piece *piece, const char *fin)
{
    cJSON *o = head(S, r, r->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *ch = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(ch, c);
    cJSON_AddNumberToObject(c, "index", 0);
    char *t = NULL;
    if (piece) {
        t = malloc((size_t)piece->len + 1);
        if (!t) {
            cJSON_Delete(o);
            return NULL;
        }
        memcpy(t, r->text[piece->ch] + piece->off, piece->len);
        t[piece->len] = 0;
    }
    if (r->chat) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        if (!piece && !fin) {
            cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddStringToObject(d, "content", "");
        } else if (piece) {
            cJSON_AddStringToObject(d, piece->ch == SRV_CH_CONTENT ? "content" : "reasoning_content", t);
        }
    } else {
        cJSON_AddStringToObject(c, "text", t ? t : "");
        cJSON_AddNullToObject(c, "logprobs");
    }
    free(t);
    if (fin)
        cJSON_AddStringToObject(c, "finish_reason", fin);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    return sse(o);
}

char *srv_usage_chunk(const srv *S, const srv_req *r)
{
    cJSON *o = head(S, r, r->chat ? "chat.completion.chunk" : "text_completion");
    cJSON_AddArrayToObject(o, "choices");
    add_usage(o, r);
    return sse(o);
}

char *srv_models_json(const srv *S)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *d = cJSON_AddArrayToObject(o, "data"), *m = cJSON_CreateObject();
    cJSON_AddItemToArray(d, m);
    cJSON_AddStringToObject(m, "id", S->cfg.model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "k3");
    cJSON_AddNumberToObject(m, "context_length", S->cfg.ctx);
    return print_free(o);
}
