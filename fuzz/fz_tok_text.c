/*
 * fz_tok_text.c - text through a fixed tokenizer: the pre-tokenizer (a hand
 * written matcher of the docs/MODEL.md §5 pattern), rank BPE, special-token matching,
 * decode and the streaming decoder. This is what a prompt file or --prompt
 * goes through.
 *
 * Input: any bytes, encoded as text. The tokenizer is written to the work
 * directory once per process: the 256 single bytes, a few dozen merges
 * (English, digits, whitespace, two- and three-byte UTF-8) and four specials,
 * two of which share a prefix. Checks: see tok_check.h.
 */
#include "k3_fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_tok.h"
#include "tok_check.h"

static const char *const merges[] = {
    "th", "he", "in", "er", "an", " t", " a", "the", " the", "re", "on", "at", "en", "nd",
    "ing", "ed", "es", "or", "is", "it", " i", "ou", "  ", "    ", "\n\n", "12", "123", "00",
    "'s", "'t", "ll", "'ll", "\xc3\xa9", "caf\xc3\xa9", "\xe4\xb8", "\xe4\xb8\xad", " \xe4\xb8\xad",
    "<|", "|>", "im", "_end", "\r\n", "!!", "...", "He", "Hel", "Hello",
};

static const char config[] =
    "{\"added_tokens_decoder\": {"
    "\"400\": {\"content\": \"<|im_end|>\", \"special\": true},"
    "\"401\": {\"content\": \"<|im_end|>x\", \"special\": true},"
    "\"402\": {\"content\": \"<|endoftext|>\", \"special\": true},"
    "\"405\": {\"content\": \"[BOS]\", \"special\": true}},"
    "\"eos_token\": \"<|endoftext|>\", \"bos_token\": {\"content\": \"[BOS]\"}}";

static size_t b64(const uint8_t *in, size_t n, char *out)
{
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0) |
                     (i + 2 < n ? in[i + 2] : 0);
        out[o++] = a[v >> 18 & 63];
        out[o++] = a[v >> 12 & 63];
        out[o++] = i + 1 < n ? a[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? a[v & 63] : '=';
    }
    return o;
}

static k3_tok *fixed_tokenizer(void)
{
    static k3_tok *tok;
    if (tok)
        return tok;
    char *model = malloc(64 << 10);
    if (!model)
        k3_fuzz_fail("out of memory in the harness");
    size_t at = 0;
    uint32_t rank = 0;
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        at += b64(&byte, 1, model + at);
        at += (size_t)sprintf(model + at, " %u\n", rank++);
    }
    for (size_t i = 0; i < sizeof merges / sizeof merges[0]; i++) {
        at += b64((const uint8_t *)merges[i], strlen(merges[i]), model + at);
        at += (size_t)sprintf(model + at, " %u\n", rank++);
    }
    char model_path[2048], config_path[2048];
    k3_fuzz_write("tiktoken.model", model, at, model_path, sizeof model_path);
    k3_fuzz_write("tokenizer_config.json", config, sizeof config - 1, config_path, sizeof config_path);
    free(model);
    k3_err e = {0};
    if (k3_tok_open_files(&tok, model_path, config_path, &e))
        k3_fuzz_fail("the fixed tokenizer does not open: %s", e.msg);
    return tok;
}

K3_FUZZ_TARGET(tok_text)
{
    k3_fuzz_tok_check_text(fixed_tokenizer(), data, size);
    return 0;
}
