/*
 * tok_check.c - see tok_check.h. Every allocation here is the harness's own
 * and bounded by the input size.
 */
#include "tok_check.h"

#include <stdlib.h>
#include <string.h>

#include "k3_fuzz.h"

static void check_split(const uint8_t *text, size_t len)
{
    uint64_t pos = 0;
    while (pos < len) {
        uint64_t next = k3_tok_split_next((const char *)text, len, pos);
        if (next <= pos || next > len)
            k3_fuzz_fail("split_next(%llu) = %llu in a %zu-byte text", (unsigned long long)pos,
                         (unsigned long long)next, len);
        pos = next;
    }
}

static void check_stream(const k3_tok *tok, const uint32_t *ids, uint64_t n, const uint8_t *text,
                         size_t len)
{
    k3_tok_stream *s = NULL;
    k3_err e = {0};
    int rc = k3_tok_stream_create(&s, tok, &e);
    k3_fuzz_check_result(rc, &e, "k3_tok_stream_create");
    if (rc)
        return;
    size_t at = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *b;
        uint64_t bl;
        rc = k3_tok_stream_push(s, ids[i], &b, &bl, &e);
        if (rc)
            k3_fuzz_fail("stream rejects id %u that encode produced: %s", ids[i], e.msg);
        if (bl > len - at || memcmp(b, text + at, bl))
            k3_fuzz_fail("streaming decode differs from the text at byte %zu", at);
        at += bl;
    }
    const char *b;
    uint64_t bl;
    k3_tok_stream_flush(s, &b, &bl);
    if (bl > len - at || memcmp(b, text + at, bl) || at + bl != len)
        k3_fuzz_fail("streaming decode after flush is not the text (%zu + %llu of %zu bytes)", at,
                     (unsigned long long)bl, len);
    k3_tok_stream_free(s);
}

void k3_fuzz_tok_check_text(const k3_tok *tok, const uint8_t *text, size_t len)
{
    check_split(text, len);
    uint32_t vocab = k3_tok_vocab_size(tok);
    for (int special = 0; special < 2; special++) {
        uint32_t *ids = NULL;
        uint64_t n = 0;
        k3_err e = {0};
        int rc = k3_tok_encode(tok, (const char *)text, len, special, &ids, &n, &e);
        k3_fuzz_check_result(rc, &e, "k3_tok_encode");
        if (rc)
            continue; /* e.g. out of memory: reported, nothing to check */
        if (!ids)
            k3_fuzz_fail("k3_tok_encode returned a NULL id array");
        if (n > len)
            k3_fuzz_fail("%llu ids for %zu bytes", (unsigned long long)n, len);
        for (uint64_t i = 0; i < n; i++) {
            if (ids[i] >= vocab)
                k3_fuzz_fail("id %u outside the vocabulary of %u", ids[i], vocab);
            if (!special && k3_tok_is_special(tok, ids[i]))
                k3_fuzz_fail("special id %u produced without allow_special", ids[i]);
        }
        char *out = NULL;
        uint64_t out_len = 0;
        rc = k3_tok_decode(tok, ids, n, &out, &out_len, &e);
        if (rc)
            k3_fuzz_fail("decode rejects what encode produced: %s", e.msg);
        if (out_len != len || memcmp(out, text, len))
            k3_fuzz_fail("decode(encode(text)) != text (allow_special %d, %zu -> %llu bytes)",
                         special, len, (unsigned long long)out_len);
        free(out);
        check_stream(tok, ids, n, text, len);
        free(ids);
    }
}
