/*
 * tok_stream.c - the streaming decoder: ids in, bytes out on character
 * boundaries. Invariant: held[0..nheld) is a proper prefix of a well-formed
 * UTF-8 sequence (0..3 bytes) that has not been emitted yet; everything else
 * pushed so far has been emitted, in order. All memory is taken at create.
 */
#include <stdlib.h>
#include <string.h>

#include "tok_int.h"

struct k3_tok_stream {
    const k3_tok *tok;
    uint8_t held[4];
    unsigned nheld;
    uint8_t *out;      /* 3 held bytes + the longest token */
    uint64_t out_cap;
};

int k3_tok_stream_create(k3_tok_stream **out, const k3_tok *tok, k3_err *e)
{
    *out = NULL;
    uint64_t longest = 0;
    for (uint32_t id = 0; id < k3_tok_vocab_size(tok); id++) {
        uint64_t len;
        if (k3_tok_token_bytes(tok, id, &len) && len > longest)
            longest = len;
    }
    k3_tok_stream *s = calloc(1, sizeof *s);
    if (s)
        s->out = malloc(longest + 4);
    if (!s || !s->out) {
        free(s);
        return k3_err_set(e, K3_ENOMEM, "tokenizer: out of memory for a stream decoder");
    }
    s->tok = tok;
    s->out_cap = longest + 4;
    *out = s;
    return 0;
}

int k3_tok_stream_push(k3_tok_stream *s, uint32_t id, const char **bytes, uint64_t *len, k3_err *e)
{
    uint64_t tl;
    const uint8_t *t = k3_tok_token_bytes(s->tok, id, &tl);
    *bytes = (const char *)s->out;
    *len = 0;
    if (!t)
        return k3_err_set(e, K3_EARG, "tokenizer: id %u is not a token (vocabulary of %u)", id,
                          k3_tok_vocab_size(s->tok));
    uint64_t n = s->nheld;
    memcpy(s->out, s->held, n);
    memcpy(s->out + n, t, tl);
    n += tl;
    unsigned hold = k3_tok_utf8_incomplete_tail(s->out, n);
    memcpy(s->held, s->out + n - hold, hold);
    s->nheld = hold;
    *len = n - hold;
    return 0;
}

void k3_tok_stream_flush(k3_tok_stream *s, const char **bytes, uint64_t *len)
{
    memcpy(s->out, s->held, s->nheld);
    *bytes = (const char *)s->out;
    *len = s->nheld;
    s->nheld = 0;
}

void k3_tok_stream_free(k3_tok_stream *s)
{
    if (!s)
        return;
    free(s->out);
    free(s);
}
