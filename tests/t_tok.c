/*
 * t_tok.c - the tokenizer: hostile tiktoken.model / tokenizer_config.json,
 * special tokens only when asked, the streaming decoder on partial UTF-8,
 * the pre-tokenization pattern's edge cases, the two rank-merge paths
 * agreeing, and parity with tiktoken itself on a generated 1.2 MB corpus
 * (tests/tok/: npm's tiktoken with the o200k_base ranks and the pattern of docs/MODEL.md §5).
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "k3_test.h"
#include "k3_tok.h"
#include "../runtime/tok_int.h"

static char *slurp(const char *path, size_t *n);

/* ---- tiny vocabularies ------------------------------------------------------ */

static void b64(const uint8_t *s, size_t n, char *out)
{
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0) | (i + 2 < n ? s[i + 2] : 0);
        out[o++] = A[w >> 18 & 63];
        out[o++] = A[w >> 12 & 63];
        out[o++] = i + 1 < n ? A[w >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? A[w & 63] : '=';
    }
    out[o] = 0;
}

static void write_file(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    CHECK(fwrite(data, 1, n, f) == n);
    CHECK(fclose(f) == 0);
}

static char *path_in(const char *name)
{
    static char buf[4][4096];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 4096, "%s/%s", k3t_tmpdir(), name);
    return p;
}

/* The merges of the tiny vocabulary, in rank order after the 256 bytes. */
static const char *const tiny_merges[] = {"ab", "abc", "  ", "he", "hel", "hell", "hello", " w", " wo", "rl",
                                          " worl", " world", "aa", "aaa", "\xc3\xa9", "ba", "\x1c\x1c"};
#define N_TINY (256 + sizeof tiny_merges / sizeof tiny_merges[0])

/* Writes dir/tiktoken.model (bytes 0..255 then tiny_merges) and, if config is
 * not NULL, dir/tokenizer_config.json with that text. */
static const char *tiny_dir(const char *config)
{
    const char *dir = k3t_tmpdir();
    size_t cap = 1 << 16, len = 0;
    char *m = malloc(cap), enc[64];
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        len += (size_t)snprintf(m + len, cap - len, "%s %d\n", enc, b);
    }
    for (size_t i = 0; i < N_TINY - 256; i++) {
        b64((const uint8_t *)tiny_merges[i], strlen(tiny_merges[i]), enc);
        len += (size_t)snprintf(m + len, cap - len, "%s %zu\n", enc, 256 + i);
    }
    write_file(path_in("tiktoken.model"), m, len);
    free(m);
    if (config)
        write_file(path_in("tokenizer_config.json"), config, strlen(config));
    return dir;
}

static const char *tiny_config =
    "{\n"
    "  \"added_tokens_decoder\": {\n"
    "    \"300\": {\"content\": \"[BOS]\", \"special\": true},\n"
    "    \"301\": {\"content\": \"[EOS]\", \"special\": true},\n"
    "    \"302\": {\"content\": \"<|im_end|>\", \"special\": true},\n"
    "    \"303\": {\"content\": \"<|im_end|>x\", \"special\": true}\n"
    "  },\n"
    "  \"bos_token\": \"[BOS]\",\n"
    "  \"eos_token\": {\"content\": \"[EOS]\", \"lstrip\": false}\n"
    "}\n";

static k3_tok *open_tiny(void)
{
    k3_tok *tok = NULL;
    k3_err e = {0};
    int rc = k3_tok_open(&tok, tiny_dir(tiny_config), &e);
    if (rc)
        k3t_fail(__FILE__, __LINE__, "open: %s", e.msg);
    return tok;
}

/* ---- loading ---------------------------------------------------------------- */

K3_TEST(tok_loads_ranks_specials_eos_and_bos)
{
    k3_tok *tok = open_tiny();
    CHECK_EQ_INT(k3_tok_rank_count(tok), N_TINY);
    CHECK_EQ_INT(k3_tok_vocab_size(tok), 304);
    const uint32_t *eos;
    uint32_t neos;
    k3_tok_eos_ids(tok, &eos, &neos);
    CHECK_EQ_INT(neos, 2);
    CHECK_EQ_INT(eos[0], 301);
    CHECK_EQ_INT(eos[1], 302);
    CHECK_EQ_INT(k3_tok_bos_id(tok), 300);
    uint64_t len;
    const uint8_t *b = k3_tok_token_bytes(tok, 256 + 6, &len);
    CHECK(b && len == 5 && memcmp(b, "hello", 5) == 0);
    b = k3_tok_token_bytes(tok, 302, &len);
    CHECK(b && len == 10 && memcmp(b, "<|im_end|>", 10) == 0);
    CHECK(k3_tok_token_bytes(tok, 299, &len) == NULL); /* a gap between ranks and specials */
    CHECK(k3_tok_token_bytes(tok, 304, &len) == NULL);
    CHECK(k3_tok_is_special(tok, 301) && !k3_tok_is_special(tok, 5) && !k3_tok_is_special(tok, 299));
    k3_tok_close(tok);
    k3_tok_close(NULL);
}

/* Write a model file with the given text, open it, expect code and message. */
static void expect_model_error(const char *model, size_t n, int code, const char *msg1, const char *msg2)
{
    write_file(path_in("tiktoken.model"), model, n);
    k3_tok *tok = (k3_tok *)1;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_open_files(&tok, path_in("tiktoken.model"), NULL, &e), code);
    CHECK(tok == NULL);
    CHECK_STR_CONTAINS(e.msg, "tiktoken.model");
    CHECK_STR_CONTAINS(e.msg, msg1);
    if (msg2)
        CHECK_STR_CONTAINS(e.msg, msg2);
    CHECK(strchr(e.msg, '\n') == NULL);
}

/* The 256 single bytes as model lines, then extra (rank numbers as given). */
static char *bytes_model(const char *extra, size_t *n)
{
    size_t cap = 8192 + strlen(extra), len = 0;
    char *m = malloc(cap), enc[16];
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        len += (size_t)snprintf(m + len, cap - len, "%s %d\n", enc, b);
    }
    len += (size_t)snprintf(m + len, cap - len, "%s", extra);
    *n = len;
    return m;
}

K3_TEST(tok_rejects_hostile_model_files_naming_file_and_line)
{
    size_t n;
    char *m;
    m = bytes_model("YWI 256\n", &n); /* "ab" without padding */
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad base64");
    free(m);
    m = bytes_model("YW*= 256\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad base64");
    free(m);
    m = bytes_model("YWJ= 256\n", &n); /* non-canonical trailing bits */
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad base64");
    free(m);
    m = bytes_model("YWI= 256\nYWI= 257\n", &n); /* duplicate bytes */
    expect_model_error(m, n, K3_EFORMAT, "line 258", "same bytes as line 257");
    free(m);
    m = bytes_model("YWI= 257\n", &n); /* gap */
    expect_model_error(m, n, K3_EFORMAT, "line 257", "rank 257 where 256 was expected");
    free(m);
    m = bytes_model("YWI= 256\nYWJj 256\n", &n); /* repeated rank */
    expect_model_error(m, n, K3_EFORMAT, "line 258", "rank 256 where 257");
    free(m);
    m = bytes_model("YWI= -1\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad rank");
    free(m);
    m = bytes_model("YWI= 0256\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad rank");
    free(m);
    m = bytes_model("YWI=256\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "no space");
    free(m);
    m = bytes_model("\nYWI= 256\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "empty line");
    free(m);
    m = bytes_model("YWI= 99999999999999999999\n", &n);
    expect_model_error(m, n, K3_EFORMAT, "line 257", "bad rank");
    free(m);
    /* a huge line is refused before anything is decoded or allocated for it */
    size_t big = 1 << 20;
    char *huge = malloc(big + 16);
    memset(huge, 'A', big);
    memcpy(huge + big, " 256\n", 6);
    m = bytes_model(huge, &n);
    expect_model_error(m, n, K3_ELIMIT, "line 257", "longer than");
    free(m);
    free(huge);
    /* a byte without a token */
    m = bytes_model("", &n);
    char *cut = strstr(m, "/w== 255\n"); /* 0xFF */
    CHECK(cut != NULL);
    expect_model_error(m, (size_t)(cut - m), K3_EFORMAT, "byte 0xFF has no token", NULL);
    free(m);
    expect_model_error("", 0, K3_EFORMAT, "empty file", NULL);
    /* missing file */
    k3_tok *tok;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_open(&tok, path_in("nowhere"), &e), K3_ENOENT);
    CHECK_STR_CONTAINS(e.msg, "tiktoken.model");
}

static void expect_config_error(const char *config, int code, const char *msg1, const char *msg2)
{
    tiny_dir(config);
    k3_tok *tok = (k3_tok *)1;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_open(&tok, k3t_tmpdir(), &e), code);
    CHECK(tok == NULL);
    CHECK_STR_CONTAINS(e.msg, "tokenizer_config.json");
    CHECK_STR_CONTAINS(e.msg, msg1);
    if (msg2)
        CHECK_STR_CONTAINS(e.msg, msg2);
}

K3_TEST(tok_rejects_hostile_config_files_naming_file_and_line)
{
    expect_config_error("{\n  \"added_tokens_decoder\": {\n    \"300\": {\"content\": \"x\",}\n  }\n}\n", K3_EFORMAT,
                        "line 3", "invalid JSON");
    expect_config_error("[1, 2]", K3_EFORMAT, "not a JSON object", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\n\"100\": {\"content\": \"[X]\"}}}", K3_EFORMAT, "line 2",
                        "collides with BPE rank 100");
    expect_config_error("{\"added_tokens_decoder\": {\n\"300\": {\"content\": \"[X]\"},\n\"301\": {\"content\": \"[X]\"}}}",
                        K3_EFORMAT, "same content", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"300\": {\"content\": \"[X]\"},\n\"300\": {\"content\": \"[Y]\"}}}",
                        K3_EFORMAT, "300 appears twice", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"3x0\": {\"content\": \"[X]\"}}}", K3_EFORMAT,
                        "not a decimal id", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"300\": {\"content\": 5}}}", K3_EFORMAT, "no string", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"300\": {\"content\": \"\"}}}", K3_EFORMAT, "content of 0", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"99999999\": {\"content\": \"[X]\"}}}", K3_ELIMIT,
                        "past the last rank", NULL);
    expect_config_error("{\"added_tokens_decoder\": [],\n \"x\": 1}", K3_EFORMAT, "not an object", NULL);
    expect_config_error("{\"added_tokens_decoder\": {\"300\": {\"content\": \"[X]\"}},\n\"eos_token\": \"[EOS]\"}",
                        K3_EFORMAT, "line 2", "eos_token \"[EOS]\" is not an added token");
    expect_config_error("{\"eos_token\": 7}", K3_EFORMAT, "eos_token is neither", NULL);
    /* 1,100 specials of 1,000 bytes: over the 1 MiB total */
    size_t cap = 1200 * 1100 + 64, o = 0;
    char *many = malloc(cap);
    o += (size_t)snprintf(many + o, cap - o, "{\"added_tokens_decoder\": {");
    for (int i = 0; i < 1100; i++)
        o += (size_t)snprintf(many + o, cap - o, "%s\"%d\": {\"content\": \"%04d%0996d\"}", i ? ", " : "", 300 + i,
                              i, 0);
    snprintf(many + o, cap - o, "}}");
    expect_config_error(many, K3_ELIMIT, "more than 1048576 bytes in all", NULL);
    free(many);
    /* nesting far deeper than any config: an error, not a stack overflow */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 1);
    memset(deep, '[', depth);
    memset(deep + depth, ']', depth);
    deep[2 * depth] = 0;
    expect_config_error(deep, K3_EFORMAT, "invalid JSON", NULL);
    free(deep);
}

/* ---- encode / decode -------------------------------------------------------- */

static void encode(const k3_tok *tok, const char *s, int allow, uint32_t **ids, uint64_t *n)
{
    k3_err e = {0};
    int rc = k3_tok_encode(tok, s, strlen(s), allow, ids, n, &e);
    if (rc)
        k3t_fail(__FILE__, __LINE__, "encode: %s", e.msg);
}

K3_TEST(tok_merges_lowest_rank_first_and_round_trips)
{
    k3_tok *tok = open_tiny();
    uint32_t *ids;
    uint64_t n;
    encode(tok, "hello world", 0, &ids, &n);
    CHECK_EQ_U64(n, 2);
    CHECK_EQ_INT(ids[0], 256 + 6);  /* "hello" */
    CHECK_EQ_INT(ids[1], 256 + 11); /* " world" */
    free(ids);
    /* "abab": ab(256) twice; "aaaa": aa (268) twice, leftmost first: aa|aa */
    encode(tok, "aaaa", 0, &ids, &n);
    CHECK_EQ_U64(n, 2);
    CHECK_EQ_INT(ids[0], 268);
    CHECK_EQ_INT(ids[1], 268);
    free(ids);
    encode(tok, "aaaaa", 0, &ids, &n);
    CHECK_EQ_U64(n, 2);
    CHECK_EQ_INT(ids[0], 268); /* aa|a|a|a -> aa|aa|a -> aa|aaa */
    CHECK_EQ_INT(ids[1], 269);
    char *back;
    uint64_t blen;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_decode(tok, ids, n, &back, &blen, &e), 0);
    CHECK_EQ_U64(blen, 5);
    CHECK_STR_EQ(back, "aaaaa");
    free(back);
    free(ids);
    uint32_t badid[2] = {5, 304};
    CHECK_EQ_INT(k3_tok_decode(tok, badid, 2, &back, &blen, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "id 304 at position 1");
    encode(tok, "", 0, &ids, &n);
    CHECK(ids != NULL && n == 0);
    free(ids);
    k3_tok_close(tok);
}

K3_TEST(tok_special_tokens_are_matched_only_when_asked)
{
    k3_tok *tok = open_tiny();
    const char *text = "ab[EOS]<|im_end|>x<|im_end|>";
    uint32_t *ids;
    uint64_t n;
    encode(tok, text, 1, &ids, &n);
    /* ab | [EOS] | <|im_end|>x (longest special at its position) | <|im_end|> */
    CHECK_EQ_U64(n, 4);
    CHECK_EQ_INT(ids[0], 256);
    CHECK_EQ_INT(ids[1], 301);
    CHECK_EQ_INT(ids[2], 303);
    CHECK_EQ_INT(ids[3], 302);
    free(ids);
    /* a special cut short by the end of the text, or by a different byte */
    encode(tok, "x<|im_end", 1, &ids, &n);
    for (uint64_t i = 0; i < n; i++)
        CHECK(ids[i] < 300);
    free(ids);
    encode(tok, "[EO[EOS]<|im_end|", 1, &ids, &n);
    CHECK(n >= 2);
    uint64_t found = 0;
    for (uint64_t i = 0; i < n; i++)
        found += ids[i] >= 300;
    CHECK_EQ_U64(found, 1);
    free(ids);
    encode(tok, text, 0, &ids, &n);
    for (uint64_t i = 0; i < n; i++)
        CHECK(ids[i] < 300);
    char *back;
    uint64_t blen;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_decode(tok, ids, n, &back, &blen, &e), 0);
    CHECK_STR_EQ(back, text);
    free(back);
    free(ids);
    k3_tok_close(tok);
}

K3_TEST(tok_invalid_utf8_bytes_are_kept_verbatim)
{
    k3_tok *tok = open_tiny();
    const char text[] = "ab\xff\xc3 \xe2\x82\xed\xa0\x80\xc0\xaf hello\xf0\x9f\x98";
    uint32_t *ids;
    uint64_t n;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_encode(tok, text, sizeof text - 1, 0, &ids, &n, &e), 0);
    char *back;
    uint64_t blen;
    CHECK_EQ_INT(k3_tok_decode(tok, ids, n, &back, &blen, &e), 0);
    CHECK_EQ_U64(blen, sizeof text - 1);
    CHECK(memcmp(back, text, blen) == 0);
    free(back);
    free(ids);
    k3_tok_close(tok);
}

/* Random byte strings (letters, marks, spaces, CR/LF, multi-byte and broken
 * UTF-8, special-token text) round trip, and their pieces tile the input. */
K3_TEST(tok_random_bytes_round_trip)
{
    k3_tok *tok = open_tiny();
    static const char *const atoms[] = {"a", "b", "hello", " ", "  ", "\t", "\r", "\n", "\r\n", "'s", "'LL", "1",
                                        "\xc3\xa9", "\xcc\x81", "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "\xff", "\xc3",
                                        "\xe2\x82", "\xed\xa0\x80", "!", "[EOS]", "<|im_end|>", "\xc5\xbf", "A", "\xc7\x85"};
    const size_t natoms = sizeof atoms / sizeof atoms[0];
    uint32_t x = 777;
    char buf[4096];
    for (int trial = 0; trial < 2000; trial++) {
        size_t n = 0;
        x = x * 1103515245u + 12345u;
        int count = (int)((x >> 16) % 60);
        for (int k = 0; k < count; k++) {
            x = x * 1103515245u + 12345u;
            const char *a = atoms[(x >> 16) % natoms];
            memcpy(buf + n, a, strlen(a));
            n += strlen(a);
        }
        for (uint64_t pos = 0; pos < n;) {
            uint64_t end = k3_tok_split_next(buf, n, pos);
            CHECK(end > pos && end <= n);
            pos = end;
        }
        for (int allow = 0; allow < 2; allow++) {
            uint32_t *ids;
            uint64_t nids, blen;
            char *back;
            k3_err e = {0};
            CHECK_EQ_INT(k3_tok_encode(tok, buf, n, allow, &ids, &nids, &e), 0);
            CHECK_EQ_INT(k3_tok_decode(tok, ids, nids, &back, &blen, &e), 0);
            CHECK(blen == n && memcmp(back, buf, n) == 0);
            free(back);
            free(ids);
        }
    }
    k3_tok_close(tok);
}

/* Flipped, inserted and cut bytes in both files: open either succeeds or
 * fails with a message naming the file; never a crash (run under make asan). */
K3_TEST(tok_mutated_files_fail_cleanly)
{
    tiny_dir(tiny_config);
    size_t mlen, clen;
    char *model = slurp(path_in("tiktoken.model"), &mlen);
    const char *config = tiny_config;
    clen = strlen(config);
    char *buf = malloc(mlen + clen + 64);
    uint32_t x = 4242;
    int opened = 0, failed = 0;
    for (int trial = 0; trial < 400; trial++) {
        int which = trial & 1;
        const char *src = which ? config : model;
        size_t n = which ? clen : mlen;
        memcpy(buf, src, n);
        for (int k = 0; k < 3; k++) {
            x = x * 1103515245u + 12345u;
            size_t at = (x >> 8) % n;
            x = x * 1103515245u + 12345u;
            switch ((x >> 16) % 4) {
            case 0: buf[at] ^= (char)(1u << ((x >> 8) % 8)); break;
            case 1: n = at + 1; break;
            case 2: buf[at] = "\n =\"{}:,0A/+\\"[(x >> 20) % 14]; break;
            default:
                memmove(buf + at + 1, buf + at, n - at);
                buf[at] = (char)(x >> 24);
                n++;
            }
        }
        write_file(path_in(which ? "tokenizer_config.json" : "tiktoken.model"), buf, n);
        write_file(path_in(which ? "tiktoken.model" : "tokenizer_config.json"), which ? model : config,
                   which ? mlen : clen);
        k3_tok *tok = NULL;
        k3_err e = {0};
        int rc = k3_tok_open(&tok, k3t_tmpdir(), &e);
        if (rc == 0) {
            opened++;
            CHECK(tok != NULL);
            uint32_t *ids;
            uint64_t nids;
            CHECK_EQ_INT(k3_tok_encode(tok, "hello [EOS] world", 17, 1, &ids, &nids, &e), 0);
            free(ids);
            k3_tok_close(tok);
        } else {
            failed++;
            CHECK(tok == NULL);
            CHECK(rc < 0);
            CHECK(strstr(e.msg, which ? "tokenizer_config.json" : "tiktoken.model") != NULL);
            CHECK(strchr(e.msg, '\n') == NULL);
        }
    }
    CHECK(failed > 100);
    free(buf);
    free(model);
}

/* ids of a ++ ids of b, each encoded alone */
static void encode_concat(const k3_tok *tok, const char *a, size_t na, const char *b, size_t nb, uint32_t **ids,
                          uint64_t *n)
{
    uint32_t *x, *y;
    uint64_t nx, ny;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_encode(tok, a, na, 0, &x, &nx, &e), 0);
    CHECK_EQ_INT(k3_tok_encode(tok, b, nb, 0, &y, &ny, &e), 0);
    *ids = realloc(x, (nx + ny + 1) * sizeof *x);
    memcpy(*ids + nx, y, ny * sizeof *y);
    *n = nx + ny;
    free(y);
}

static void check_same_ids(const uint32_t *a, uint64_t na, const uint32_t *b, uint64_t nb)
{
    CHECK_EQ_U64(na, nb);
    CHECK(memcmp(a, b, na * sizeof *a) == 0);
}

K3_TEST(tok_kimi_slices_cut_long_runs_and_windows)
{
    k3_tok *tok = open_tiny();
    k3_err e = {0};
    uint32_t *got, *want;
    uint64_t ngot, nwant;
    /* 25,001 letters: cut before the last one; 25,000: no cut */
    size_t big = 400100 * 2 + 64;
    char *t = malloc(big);
    memset(t, 'a', 25001);
    CHECK_EQ_INT(k3_tok_encode(tok, t, 25001, K3_TOK_KIMI_SLICES, &got, &ngot, &e), 0);
    encode_concat(tok, t, 25000, t, 1, &want, &nwant);
    check_same_ids(got, ngot, want, nwant);
    free(want);
    CHECK_EQ_INT(k3_tok_encode(tok, t, 25001, 0, &want, &nwant, &e), 0);
    CHECK(ngot != nwant || memcmp(got, want, ngot * sizeof *got) != 0); /* the cut changes the ids */
    free(want);
    free(got);
    CHECK_EQ_INT(k3_tok_encode(tok, t, 25000, K3_TOK_KIMI_SLICES, &got, &ngot, &e), 0);
    CHECK_EQ_INT(k3_tok_encode(tok, t, 25000, 0, &want, &nwant, &e), 0);
    check_same_ids(got, ngot, want, nwant);
    free(want);
    free(got);
    /* a space run of 30,000 after a word (U+001C counts: Python's isspace
     * has bidi class B, White_Space does not): the slice is not restarted at
     * the word/space change, the run is cut after its 25,000th character. An
     * odd number of U+001C in the first slice makes the cut visible through
     * the "\x1c\x1c" merge. */
    memcpy(t, "ab ", 3);
    memset(t + 3, '\x1c', 29999);
    t[30002] = 'b';
    CHECK_EQ_INT(k3_tok_encode(tok, t, 30003, K3_TOK_KIMI_SLICES, &got, &ngot, &e), 0);
    encode_concat(tok, t, 25002, t + 25002, 5001, &want, &nwant);
    check_same_ids(got, ngot, want, nwant);
    free(want);
    CHECK_EQ_INT(k3_tok_encode(tok, t, 30003, 0, &want, &nwant, &e), 0);
    CHECK(ngot != nwant || memcmp(got, want, ngot * sizeof *got) != 0);
    free(want);
    free(got);
    /* windows of 400,000 characters, not bytes: "\xc3\xa9 hello" is 7
     * characters in 8 bytes; character 400,000 is the 'o' of a "hello", so
     * the cut changes the ids */
    size_t n = 0;
    for (size_t c = 0; c < 400100; c += 7) {
        memcpy(t + n, "\xc3\xa9 hello", 8);
        n += 8;
    }
    CHECK_EQ_INT(k3_tok_encode(tok, t, n, K3_TOK_KIMI_SLICES | K3_TOK_ALLOW_SPECIAL, &got, &ngot, &e), 0);
    encode_concat(tok, t, 57142 * 8 + 7, t + 57142 * 8 + 7, n - (57142 * 8 + 7), &want, &nwant);
    check_same_ids(got, ngot, want, nwant);
    free(want);
    free(got);
    /* a run that straddles a window boundary is counted afresh in the new
     * window: 10,002 + 19,999 letters, no 25,000 cut after the boundary */
    n = 0;
    for (size_t u = 0; u < 55714; u++) {
        memcpy(t + n, "\xc3\xa9 hello", 8);
        n += 8;
    }
    memset(t + n, 'a', 30001);
    n += 30001;
    CHECK_EQ_INT(k3_tok_encode(tok, t, n, K3_TOK_KIMI_SLICES, &got, &ngot, &e), 0);
    encode_concat(tok, t, 55714 * 8 + 10002, t + 55714 * 8 + 10002, n - (55714 * 8 + 10002), &want, &nwant);
    check_same_ids(got, ngot, want, nwant);
    free(want);
    free(got);
    CHECK_EQ_INT(k3_tok_encode(tok, t, n, 8, &got, &ngot, &e), K3_EARG);
    free(t);
    k3_tok_close(tok);
}

/* ---- streaming decoder ------------------------------------------------------- */

K3_TEST(tok_stream_holds_back_incomplete_utf8)
{
    k3_tok *tok = open_tiny();
    k3_tok_stream *s;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_stream_create(&s, tok, &e), 0);
    /* single-byte tokens: rank == byte value in the tiny vocabulary */
    const uint8_t text[] = "a\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80z";
    /* after each byte: how many bytes come out */
    const int expect[] = {1, 0, 2, 0, 0, 3, 0, 0, 0, 4, 1};
    char got[64];
    size_t glen = 0;
    for (size_t i = 0; i < sizeof expect / sizeof expect[0]; i++) {
        const char *b;
        uint64_t len;
        CHECK_EQ_INT(k3_tok_stream_push(s, text[i], &b, &len, &e), 0);
        CHECK_EQ_U64(len, expect[i]);
        memcpy(got + glen, b, len);
        glen += len;
    }
    CHECK(glen == sizeof text - 1 && memcmp(got, text, glen) == 0);
    /* a sequence that can no longer complete is emitted at once, verbatim */
    const char *b;
    uint64_t len;
    CHECK_EQ_INT(k3_tok_stream_push(s, 0xe4, &b, &len, &e), 0);
    CHECK_EQ_U64(len, 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 'x', &b, &len, &e), 0);
    CHECK(len == 2 && memcmp(b, "\xe4x", 2) == 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 0xed, &b, &len, &e), 0); /* ED A0 would be a surrogate */
    CHECK_EQ_U64(len, 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 0xa0, &b, &len, &e), 0);
    CHECK(len == 2 && memcmp(b, "\xed\xa0", 2) == 0);
    /* a multi-byte token completing a held lead byte, then leaving its own tail */
    CHECK_EQ_INT(k3_tok_stream_push(s, 0xc3, &b, &len, &e), 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 256 + 14, &b, &len, &e), 0); /* "\xc3\xa9" */
    CHECK(len == 3 && memcmp(b, "\xc3\xc3\xa9", 3) == 0); /* the first C3 is dead, C3 A9 complete */
    k3_tok_stream_flush(s, &b, &len);
    CHECK_EQ_U64(len, 0);
    /* flush gives the incomplete tail verbatim */
    CHECK_EQ_INT(k3_tok_stream_push(s, 0xf0, &b, &len, &e), 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 0x9f, &b, &len, &e), 0);
    CHECK_EQ_U64(len, 0);
    k3_tok_stream_flush(s, &b, &len);
    CHECK(len == 2 && memcmp(b, "\xf0\x9f", 2) == 0);
    k3_tok_stream_flush(s, &b, &len);
    CHECK_EQ_U64(len, 0);
    CHECK_EQ_INT(k3_tok_stream_push(s, 999, &b, &len, &e), K3_EARG);
    k3_tok_stream_free(s);
    k3_tok_stream_free(NULL);
    k3_tok_close(tok);
}

/* ---- the pattern -------------------------------------------------------------- */

/* Split s and join the pieces with '|'. */
static const char *split(const char *s)
{
    static char out[4096];
    size_t o = 0, n = strlen(s);
    for (uint64_t pos = 0; pos < n;) {
        uint64_t end = k3_tok_split_next(s, n, pos);
        CHECK(end > pos && end <= n);
        if (pos)
            out[o++] = '|';
        memcpy(out + o, s + pos, end - pos);
        o += end - pos;
        pos = end;
    }
    out[o] = 0;
    return out;
}

K3_TEST(tok_split_contractions_are_case_insensitive)
{
    CHECK_STR_EQ(split("don't DON'T we'Re I'LL it's HE'S you'VE"),
                 "don't| DON'T| we'Re| I'LL| it's| HE'S| you'VE");
    CHECK_STR_EQ(split("HE'\xc5\xbf"), "HE'\xc5\xbf"); /* U+017F folds to s */
    CHECK_STR_EQ(split("x'rx'l"), "x|'rx|'l");
    CHECK_STR_EQ(split("ab'dd"), "ab'd|d");
    CHECK_STR_EQ(split("O'Neil"), "O|'Neil");
}

K3_TEST(tok_split_numbers_come_in_groups_of_three)
{
    CHECK_STR_EQ(split("1234567"), "123|456|7");
    CHECK_STR_EQ(split("x12"), "x|12");
    CHECK_STR_EQ(split("3.14159"), "3|.|141|59");
    CHECK_STR_EQ(split("\xd9\xa3\xd9\xa4\xd9\xa5\xd9\xa6"), "\xd9\xa3\xd9\xa4\xd9\xa5|\xd9\xa6"); /* Arabic-Indic */
}

K3_TEST(tok_split_han_runs_and_letters)
{
    CHECK_STR_EQ(split("我们的中文abc"), "我们的中文|abc");
    CHECK_STR_EQ(split("東京タワー"), "東京|タワー");
    CHECK_STR_EQ(split("〇一二々"), "〇一二々"); /* Han numeral and iteration mark are Han */
    CHECK_STR_EQ(split("a々b"), "a|々|b");
    CHECK_STR_EQ(split("HTTPServer getHTTPResponse"), "HTTPServer| get|HTTPResponse");
    CHECK_STR_EQ(split("\xc7\x85" "emal"), "\xc7\x85" "emal"); /* Lt then Ll */
    CHECK_STR_EQ(split("e\xcc\x81" "t\xcc\x81"), "e\xcc\x81t\xcc\x81");
    CHECK_STR_EQ(split("\xcc\x81start"), "\xcc\x81start"); /* a mark as the optional prefix */
    CHECK_STR_EQ(split("ab\xff" "cd"), "ab|\xff" "cd");  /* an invalid byte is a prefix like U+FFFD */
}

K3_TEST(tok_split_whitespace_gives_back_one_space)
{
    CHECK_STR_EQ(split("a   b"), "a|  | b");
    CHECK_STR_EQ(split("x   "), "x|   ");
    CHECK_STR_EQ(split("a \tb"), "a| |\tb");
    CHECK_STR_EQ(split("a  \n\n  b"), "a|  \n\n| | b");
    CHECK_STR_EQ(split(" ?x"), " ?|x");
    CHECK_STR_EQ(split("a ! b"), "a| !| b");
    CHECK_STR_EQ(split("  !"), " | !");
}

K3_TEST(tok_split_crlf_handling)
{
    CHECK_STR_EQ(split("foo\r\nbar"), "foo|\r\n|bar");
    CHECK_STR_EQ(split("!!\r\n\r\nx"), "!!\r\n\r\n|x");
    CHECK_STR_EQ(split(" \r\n\r\n  bar"), " \r\n\r\n| | bar");
    CHECK_STR_EQ(split("a\r\rb"), "a|\r\r|b");
    CHECK_STR_EQ(split("x\r\n  \r\n y"), "x|\r\n  \r\n| y");
}

/* ---- rank merging: the heap path equals tiktoken's quadratic scan ------------- */

K3_TEST(tok_heap_merge_equals_quadratic_merge)
{
    /* a vocabulary dense in merges over {a, b, c}: most strings of length 2..5 */
    size_t cap = 1 << 20, len = 0;
    char *m = malloc(cap), enc[32];
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        len += (size_t)snprintf(m + len, cap - len, "%s %d\n", enc, b);
    }
    int rank = 256;
    uint32_t x = 12345;
    for (int l = 2; l <= 5; l++) {
        int count = 1;
        for (int k = 0; k < l; k++)
            count *= 3;
        for (int v = 0; v < count; v++) {
            x = x * 1103515245u + 12345u;
            if ((x >> 16) % 4 == 0)
                continue; /* leave holes so merges get stuck sometimes */
            char s[8];
            for (int k = 0, w = v; k < l; k++, w /= 3)
                s[k] = (char)('a' + w % 3);
            b64((const uint8_t *)s, (size_t)l, enc);
            len += (size_t)snprintf(m + len, cap - len, "%s %d\n", enc, rank++);
        }
    }
    write_file(path_in("tiktoken.model"), m, len);
    free(m);
    k3_tok *tok;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_open_files(&tok, path_in("tiktoken.model"), NULL, &e), 0);
    uint8_t piece[600];
    uint32_t a[600], b[600], *scratch = malloc(K3_TOK_SCRATCH(600) * sizeof *scratch);
    for (int trial = 0; trial < 3000; trial++) {
        x = x * 1103515245u + 12345u;
        size_t pl = 1 + (x >> 8) % (trial < 2500 ? 40 : 600);
        for (size_t i = 0; i < pl; i++) {
            x = x * 1103515245u + 12345u;
            piece[i] = (uint8_t)((x >> 16) % 7 == 0 ? 'z' : 'a' + (x >> 16) % 3);
        }
        uint64_t na = k3_tok_bpe_quadratic(tok, piece, pl, a, scratch);
        uint64_t nb = k3_tok_bpe_heap(tok, piece, pl, b, scratch);
        CHECK_EQ_U64(na, nb);
        CHECK(memcmp(a, b, na * sizeof *a) == 0);
    }
    free(scratch);
    k3_tok_close(tok);
}

/* ---- parity with tiktoken ------------------------------------------------------ */

static char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        k3t_fail(__FILE__, __LINE__, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    CHECK(fread(b, 1, (size_t)sz, f) == (size_t)sz);
    fclose(f);
    b[sz] = 0;
    *n = (size_t)sz;
    return b;
}

/* Encode text, write NAME.txt and NAME.ids (uint32 LE) for parity.js. */
static void write_case(const k3_tok *tok, const char *dir, const char *name, const char *text, size_t n,
                       int allow)
{
    char p[4096];
    uint32_t *ids;
    uint64_t nids;
    k3_err e = {0};
    CHECK_EQ_INT(k3_tok_encode(tok, text, n, allow, &ids, &nids, &e), 0);
    snprintf(p, sizeof p, "%s/%s.txt", dir, name);
    write_file(p, text, n);
    snprintf(p, sizeof p, "%s/%s.ids", dir, name);
    write_file(p, (const char *)ids, nids * sizeof *ids);
    char *back;
    uint64_t blen;
    CHECK_EQ_INT(k3_tok_decode(tok, ids, nids, &back, &blen, &e), 0);
    CHECK(blen == n && memcmp(back, text, n) == 0);
    free(back);
    free(ids);
}

/* Split check, independent of any BPE: a vocabulary made of the 256 bytes and
 * every distinct piece k3 cuts the text into. tiktoken looks a whole piece up
 * before merging, so it gives exactly one id per k3 piece (that piece's rank)
 * if and only if it cuts the text where k3 does. Writes pieces.model,
 * pieces.txt and pieces.ids. */
static const char *piece_text;
static const uint64_t *piece_at; /* start, end pairs */

static int cmp_piece(const void *a, const void *b)
{
    uint64_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    uint64_t li = piece_at[2 * i + 1] - piece_at[2 * i], lj = piece_at[2 * j + 1] - piece_at[2 * j];
    int c = memcmp(piece_text + piece_at[2 * i], piece_text + piece_at[2 * j], li < lj ? li : lj);
    return c ? c : li < lj ? -1 : li > lj;
}

static void write_piece_vocab(const char *dir, const char *text, uint64_t n)
{
    uint64_t np = 0, cap = n + 1;
    uint64_t *at = malloc(2 * cap * sizeof *at);
    for (uint64_t pos = 0; pos < n; np++) {
        uint64_t end = k3_tok_split_next(text, n, pos);
        at[2 * np] = pos;
        at[2 * np + 1] = end;
        pos = end;
    }
    uint32_t *order = malloc(np * sizeof *order), *rank = malloc(np * sizeof *rank);
    for (uint64_t i = 0; i < np; i++)
        order[i] = (uint32_t)i;
    piece_text = text;
    piece_at = at;
    qsort(order, np, sizeof *order, cmp_piece);
    char p[4096];
    snprintf(p, sizeof p, "%s/pieces.model", dir);
    FILE *f = fopen(p, "wb");
    CHECK(f != NULL);
    char enc[16];
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        fprintf(f, "%s %d\n", enc, b);
    }
    char *big = malloc(4 * (n + 3) / 3 + 8);
    uint32_t next = 256;
    for (uint64_t k = 0; k < np; k++) {
        uint64_t i = order[k], len = at[2 * i + 1] - at[2 * i];
        if (len == 1) {
            rank[i] = (uint8_t)text[at[2 * i]];
            continue;
        }
        if (k && cmp_piece(&order[k - 1], &order[k]) == 0) {
            rank[i] = rank[order[k - 1]];
            continue;
        }
        rank[i] = next++;
        b64((const uint8_t *)text + at[2 * i], len, big);
        fprintf(f, "%s %u\n", big, rank[i]);
    }
    CHECK(fclose(f) == 0);
    snprintf(p, sizeof p, "%s/pieces.txt", dir);
    write_file(p, text, n);
    snprintf(p, sizeof p, "%s/pieces.ids", dir);
    write_file(p, (const char *)rank, np * sizeof *rank);
    free(big);
    free(order);
    free(rank);
    free(at);
}

K3_TEST_TIMEOUT(tok_matches_tiktoken_on_generated_corpus, 400)
{
    const char *root = k3t_root(), *dir = k3t_tmpdir();
    char *out = NULL, *err = NULL;
    /* the pinned tiktoken, installed once into tests/tok/node_modules */
    int rc = k3t_runf(&out, &err,
                      "cd '%s/tests/tok' && { node -e 'process.exit(require(\"tiktoken/package.json\").version"
                      " === require(\"./package.json\").dependencies.tiktoken ? 0 : 1)' 2>/dev/null ||"
                      " npm ci --no-audit --no-fund --loglevel=error; }", root);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "npm ci in tests/tok failed (%d): %s %s", rc, out, err);
    free(out);
    free(err);
    rc = k3t_runf(&out, &err, "node '%s/tests/tok/make_vocab.js' '%s' && node '%s/tests/tok/gen_corpus.js' '%s/corpus.bin'",
                  root, dir, root, dir);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "vocabulary/corpus generation failed (%d): %s %s", rc, out, err);
    free(out);
    free(err);

    k3_tok *tok;
    k3_err e = {0};
    rc = k3_tok_open(&tok, dir, &e);
    if (rc)
        k3t_fail(__FILE__, __LINE__, "open o200k_base: %s", e.msg);
    CHECK_EQ_INT(k3_tok_rank_count(tok), 199998);
    size_t n;
    char *raw = slurp(path_in("corpus.bin"), &n);
    CHECK(n >= 1000000);

    /* invalid bytes -> U+FFFD each: the text tiktoken can be given */
    char *valid = malloc(3 * n + 1);
    size_t vn = 0, invalid = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        unsigned l = k3_tok_utf8_next((const uint8_t *)raw, n, i, &cp);
        if (cp == K3_TOK_CP_INVALID) {
            memcpy(valid + vn, "\xef\xbf\xbd", 3);
            vn += 3;
            invalid++;
        } else {
            memcpy(valid + vn, raw + i, l);
            vn += l;
        }
        i += l;
    }
    CHECK(invalid > 1000);
    /* the raw text splits exactly as its replaced form: same pieces, byte
     * for byte once each invalid byte is replaced */
    uint64_t pr = 0, pv = 0, pieces = 0;
    while (pr < n) {
        uint64_t er = k3_tok_split_next(raw, n, pr), ev = k3_tok_split_next(valid, vn, pv);
        uint64_t expect_v = pv;
        for (uint64_t i = pr; i < er;) {
            uint32_t cp;
            unsigned l = k3_tok_utf8_next((const uint8_t *)raw, n, i, &cp);
            expect_v += cp == K3_TOK_CP_INVALID ? 3 : l;
            i += l;
        }
        if (ev != expect_v)
            k3t_fail(__FILE__, __LINE__, "piece %llu at raw byte %llu splits differently from its replaced form",
                     (unsigned long long)pieces, (unsigned long long)pr);
        pr = er;
        pv = ev;
        pieces++;
    }
    CHECK_EQ_U64(pv, vn);

    /* round trip on the raw bytes, invalid UTF-8 included */
    uint32_t *ids;
    uint64_t nids;
    CHECK_EQ_INT(k3_tok_encode(tok, raw, n, 0, &ids, &nids, &e), 0);
    char *back;
    uint64_t blen;
    CHECK_EQ_INT(k3_tok_decode(tok, ids, nids, &back, &blen, &e), 0);
    CHECK(blen == n && memcmp(back, raw, n) == 0);
    free(back);
    free(ids);

    write_case(tok, dir, "plain", valid, vn, 0);
    write_piece_vocab(dir, valid, vn);
    const char *sp = "Hello<|endoftext|>world <|endofprompt|><|endoftext|> <|endoftext|x <|endoftext|>";
    write_case(tok, dir, "special", sp, strlen(sp), 1);
    k3_tok_close(tok);
    free(raw);
    free(valid);

    rc = k3t_runf(&out, &err, "node '%s/tests/tok/parity.js' '%s'", root, dir);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "parity.js (%d):\n%s%s", rc, out, err);
    fprintf(stderr, "%s", out);
    free(out);
    free(err);
}
