/*
 * tok.c - the tokenizer handle: loading tiktoken.model and
 * tokenizer_config.json (both hostile: every size is bounded before it is
 * allocated, every error is one line naming the file and line), the byte
 * string -> rank hash map, rank merging, special tokens, encode and decode.
 *
 * Invariants after open: ranks are 0..n_ranks-1 and line r of tiktoken.model
 * holds rank r; token byte strings are distinct and non-empty; all 256 single
 * bytes have a rank (so any piece can be encoded); special ids are >= n_ranks,
 * distinct, with distinct non-empty contents. The handle is read-only.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_io.h"
#include "k3_unicode_tables.h"
#include "tok_int.h"

struct special {
    uint32_t id;
    uint32_t len;
    const uint8_t *s; /* into tok->special_bytes */
};

struct short_ent {
    uint64_t key;   /* the bytes, zero padded */
    uint32_t rank1; /* rank + 1; 0 = empty */
    uint32_t len;
};

/* A trie node: its byte, first child and next sibling (0 = none; node 0 is
 * the root and never a child), and the special ending here (-1 = none). */
struct trie_node {
    uint32_t first_child, next_sibling;
    int32_t special;
    uint8_t byte;
};

struct k3_tok {
    uint32_t n_ranks;
    uint32_t vocab;          /* max(n_ranks, largest special id + 1) */
    uint8_t *bytes;          /* token byte strings, back to back */
    uint32_t *off;           /* n_ranks + 1 offsets into bytes */
    uint64_t *table;         /* (hash >> 32) << 32 | (rank + 1); 0 = empty */
    uint64_t table_mask;
    struct short_ent *stable; /* tokens of <= 8 bytes again, keyed by value: one
                               * cache line per lookup in the merge loop */
    uint64_t stable_mask;
    uint32_t byte_rank[256];
    uint32_t *pair_rank;     /* 65536: rank of every two-byte string (merges start there) */
    uint32_t max_token_len;  /* over ranks and specials */

    uint32_t n_special;
    struct special *specials;      /* sorted by first byte, then longest first */
    uint8_t *special_bytes;
    int32_t *special_of_id;        /* vocab - n_ranks entries: index or -1 */
    uint32_t first_lo[257];        /* specials[first_lo[b] .. first_lo[b+1]) start with b */
    struct trie_node *trie;        /* the specials' contents as a byte trie, node 0 the root */
    uint32_t trie_root[256];       /* root's child for each first byte, 0 = none */

    uint32_t eos[K3_TOK_MAX_EOS];
    uint32_t n_eos;
    int64_t bos;
};

/* ---- hashing ------------------------------------------------------------ */

static inline uint64_t mix(uint64_t h)
{
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    return h;
}

static inline uint64_t hash_bytes(const uint8_t *s, uint64_t len)
{
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (len * 0xff51afd7ed558ccdull);
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        s += 8;
        len -= 8;
    }
    if (len) {
        uint64_t w = 0;
        memcpy(&w, s, len);
        h = (h ^ w) * 0x94d049bb133111ebull;
    }
    return mix(h);
}

static inline uint64_t hash_short(uint64_t key, uint64_t len)
{
    return mix((key ^ len << 61) * 0xbf58476d1ce4e5b9ull);
}

uint32_t k3_tok_rank_of(const k3_tok *tok, const uint8_t *s, uint64_t len)
{
    if (len <= 8) {
        uint64_t key = 0;
        memcpy(&key, s, len);
        for (uint64_t i = hash_short(key, len) & tok->stable_mask;; i = (i + 1) & tok->stable_mask) {
            const struct short_ent *se = &tok->stable[i];
            if (!se->rank1)
                return UINT32_MAX;
            if (se->key == key && se->len == len)
                return se->rank1 - 1;
        }
    }
    uint64_t h = hash_bytes(s, len);
    uint64_t tag = h >> 32;
    for (uint64_t i = h & tok->table_mask;; i = (i + 1) & tok->table_mask) {
        uint64_t v = tok->table[i];
        if (!v)
            return UINT32_MAX;
        if ((v >> 32) == tag) {
            uint32_t r = (uint32_t)v - 1;
            uint32_t a = tok->off[r], b = tok->off[r + 1];
            if (b - a == len && memcmp(tok->bytes + a, s, len) == 0)
                return r;
        }
    }
}

/* Insert rank r; returns the rank already holding the same bytes, or UINT32_MAX. */
static uint32_t table_insert(k3_tok *tok, uint32_t r)
{
    const uint8_t *s = tok->bytes + tok->off[r];
    uint64_t len = tok->off[r + 1] - tok->off[r];
    uint64_t h = hash_bytes(s, len);
    uint64_t tag = h >> 32;
    for (uint64_t i = h & tok->table_mask;; i = (i + 1) & tok->table_mask) {
        uint64_t v = tok->table[i];
        if (!v) {
            tok->table[i] = tag << 32 | (uint64_t)(r + 1);
            return UINT32_MAX;
        }
        if ((v >> 32) == tag) {
            uint32_t o = (uint32_t)v - 1;
            uint32_t a = tok->off[o], b = tok->off[o + 1];
            if (b - a == len && memcmp(tok->bytes + a, s, len) == 0)
                return o;
        }
    }
}

/* ---- tiktoken.model ------------------------------------------------------- */

static int b64_value(uint8_t c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

/* Strict base64 (padded, canonical) of s[0..n) into out; returns the decoded
 * length or -1. */
static int64_t b64_decode(const uint8_t *s, uint64_t n, uint8_t *out)
{
    if (n == 0 || n % 4)
        return -1;
    uint64_t o = 0;
    for (uint64_t i = 0; i < n; i += 4) {
        int v[4];
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) /* '=' followed by data */
                    return -1;
                v[k] = b64_value(s[i + k]);
                if (v[k] < 0)
                    return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        if ((pad == 1 && (w & 0xFF)) || (pad == 2 && (w & 0xFFFF)))
            return -1; /* non-canonical: bits set past the last byte */
        out[o++] = (uint8_t)(w >> 16);
        if (pad < 2)
            out[o++] = (uint8_t)(w >> 8);
        if (pad < 1)
            out[o++] = (uint8_t)w;
    }
    return (int64_t)o;
}

#define B64_MAX_CHARS (((K3_TOK_MAX_TOKEN_BYTES + 2) / 3) * 4)

/* Compare the bytes as read (the ones parsed) with the SHA-256 the caller
 * expects; want NULL: nothing to compare. The loaders compute it first and
 * report a mismatch only once the bytes parsed: a file that does not parse is
 * a format error (exit 3) as for any tokenizer, one that parses into other
 * tokens is corrupt (exit 5). */
static int check_sha256(const char *path, const char *buf, uint64_t len, const uint8_t *want, k3_err *e)
{
    if (!want)
        return 0;
    uint8_t got[32];
    unsigned int hl = 0;
    if (EVP_Digest(buf, (size_t)len, got, &hl, EVP_sha256(), NULL) != 1 || hl != 32)
        return k3_err_set(e, K3_EINTERNAL, "%s: SHA-256 failed", path);
    if (memcmp(got, want, 32)) {
        char w[65], g[65];
        for (int i = 0; i < 32; i++) {
            snprintf(w + 2 * i, 3, "%02x", want[i]);
            snprintf(g + 2 * i, 3, "%02x", got[i]);
        }
        return k3_err_set(e, K3_ECORRUPT, "%s: SHA-256 mismatch: the bytes read are not the ones the manifest "
                                          "names (expected %s, computed %s)", path, w, g);
    }
    return 0;
}

static int load_model(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e)
{
    char *buf;
    uint64_t len;
    int rc = k3_io_read_file(path, K3_TOK_MODEL_MAX_BYTES, &buf, &len, e);
    if (rc)
        return rc;
    k3_err he = {0};
    int hrc = check_sha256(path, buf, len, want, &he);
    const uint8_t *s = (const uint8_t *)buf;
    /* count lines to bound every allocation below by the file's size */
    uint64_t lines = 0;
    for (uint64_t i = 0; i < len; i++)
        if (s[i] == '\n')
            lines++;
    if (len && s[len - 1] != '\n')
        lines++;
    if (lines == 0) {
        free(buf);
        return k3_err_set(e, K3_EFORMAT, "%s: empty file: no tokens", path);
    }
    if (lines > K3_TOK_MAX_RANKS) {
        free(buf);
        return k3_err_set(e, K3_ELIMIT, "%s: %" PRIu64 " lines is more than the %u-token limit",
                          path, lines, K3_TOK_MAX_RANKS);
    }
    uint64_t table_size = 1024;
    while (table_size < 2 * lines)
        table_size *= 2;
    tok->bytes = malloc(len ? len : 1); /* decoded bytes are fewer than the file's */
    tok->off = malloc((lines + 1) * sizeof *tok->off);
    tok->table = calloc(table_size, sizeof *tok->table);
    tok->table_mask = table_size - 1;
    tok->stable = calloc(table_size, sizeof *tok->stable);
    tok->stable_mask = table_size - 1;
    tok->pair_rank = malloc(65536 * sizeof *tok->pair_rank);
    if (!tok->bytes || !tok->off || !tok->table || !tok->stable || !tok->pair_rank) {
        free(buf);
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " tokens", path, lines);
    }
    for (int b = 0; b < 256; b++)
        tok->byte_rank[b] = UINT32_MAX;
    for (int b = 0; b < 65536; b++)
        tok->pair_rank[b] = UINT32_MAX;
    uint64_t pos = 0, used = 0, line = 0;
    tok->off[0] = 0;
    rc = 0;
    while (pos < len && rc == 0) {
        line++;
        uint64_t eol = pos;
        while (eol < len && s[eol] != '\n' && eol - pos <= B64_MAX_CHARS + 16)
            eol++;
        if (eol < len && s[eol] != '\n') {
            rc = k3_err_set(e, K3_ELIMIT, "%s: line %" PRIu64 ": longer than %u bytes (a token is at most %u bytes)",
                            path, line, B64_MAX_CHARS + 16, K3_TOK_MAX_TOKEN_BYTES);
            break;
        }
        uint64_t end = eol;
        if (end > pos && s[end - 1] == '\r')
            end--;
        uint64_t sp = pos;
        while (sp < end && s[sp] != ' ')
            sp++;
        if (end == pos) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": empty line (expected \"base64 rank\")", path, line);
            break;
        }
        if (sp == end) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": no space between token and rank", path, line);
            break;
        }
        if (sp - pos > B64_MAX_CHARS) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: line %" PRIu64 ": token longer than %u bytes", path, line,
                            K3_TOK_MAX_TOKEN_BYTES);
            break;
        }
        int64_t tl = b64_decode(s + pos, sp - pos, tok->bytes + used);
        if (tl < 0) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": bad base64 \"%.*s\"", path, line,
                            (int)(sp - pos > 40 ? 40 : sp - pos), (const char *)s + pos);
            break;
        }
        /* the rank: decimal digits, no sign, no leading zero, must be line-1 */
        uint64_t rank = 0, d = sp + 1;
        int ok = d < end && (s[d] != '0' || d + 1 == end) && end - d <= 10;
        for (; ok && d < end; d++) {
            if (s[d] < '0' || s[d] > '9')
                ok = 0;
            else
                rank = rank * 10 + (uint64_t)(s[d] - '0');
        }
        if (!ok) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": bad rank \"%.*s\" (expected a decimal number)",
                            path, line, (int)(end - sp - 1 > 20 ? 20 : end - sp - 1), (const char *)s + sp + 1);
            break;
        }
        uint32_t r = (uint32_t)(line - 1);
        if (rank != r) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": rank %" PRIu64 " where %u was expected "
                            "(ranks must be 0, 1, 2, ... with no gap, repeat or disorder)", path, line, rank, r);
            break;
        }
        used += (uint64_t)tl;
        tok->off[r + 1] = (uint32_t)used;
        uint32_t dup = table_insert(tok, r);
        if (dup != UINT32_MAX) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": token has the same bytes as line %u (rank %u)",
                            path, line, dup + 1, dup);
            break;
        }
        if (tl == 1)
            tok->byte_rank[tok->bytes[tok->off[r]]] = r;
        if (tl == 2)
            tok->pair_rank[tok->bytes[tok->off[r]] << 8 | tok->bytes[tok->off[r] + 1]] = r;
        if (tl <= 8) {
            uint64_t key = 0;
            memcpy(&key, tok->bytes + tok->off[r], (size_t)tl);
            uint64_t i = hash_short(key, (uint64_t)tl) & tok->stable_mask;
            while (tok->stable[i].rank1)
                i = (i + 1) & tok->stable_mask;
            tok->stable[i] = (struct short_ent){key, r + 1, (uint32_t)tl};
        }
        if ((uint32_t)tl > tok->max_token_len)
            tok->max_token_len = (uint32_t)tl;
        tok->n_ranks = r + 1;
        pos = eol + 1;
    }
    free(buf);
    if (rc)
        return rc;
    for (int b = 0; b < 256; b++)
        if (tok->byte_rank[b] == UINT32_MAX)
            return k3_err_set(e, K3_EFORMAT, "%s: byte 0x%02X has no token (byte-level BPE needs all 256 bytes)",
                              path, b);
    tok->vocab = tok->n_ranks;
    if (hrc)
        *e = he;
    return hrc;
}

/* ---- tokenizer_config.json ------------------------------------------------ */

/* Line (1-based) of byte offset off in text. */
static uint64_t line_of(const char *text, uint64_t len, uint64_t off)
{
    uint64_t line = 1;
    for (uint64_t i = 0; i < off && i < len; i++)
        line += text[i] == '\n';
    return line;
}

/* Line of the first occurrence of "key" (quoted) in text, for messages. */
static uint64_t line_of_key(const char *text, uint64_t len, const char *key)
{
    char q[96];
    snprintf(q, sizeof q, "\"%s\"", key);
    const char *p = memmem(text, len, q, strlen(q));
    return p ? line_of(text, len, (uint64_t)(p - text)) : 0;
}

static int cmp_special(const void *a, const void *b)
{
    const struct special *x = a, *y = b;
    if (x->s[0] != y->s[0])
        return x->s[0] < y->s[0] ? -1 : 1;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1; /* longest first */
    return memcmp(x->s, y->s, x->len);
}

/* The content of a field that may be a string or {"content": "..."}; NULL
 * if absent or null. *bad is set if present with another type. */
static const char *token_name(const cJSON *root, const char *field, int *bad)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    *bad = 0;
    if (!v || cJSON_IsNull(v))
        return NULL;
    if (cJSON_IsString(v))
        return v->valuestring;
    if (cJSON_IsObject(v)) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(c))
            return c->valuestring;
    }
    *bad = 1;
    return NULL;
}

static int load_config(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e)
{
    char *buf;
    uint64_t len;
    int rc = k3_io_read_file(path, K3_TOK_CONFIG_MAX_BYTES, &buf, &len, e);
    if (rc)
        return rc;
    k3_err he = {0};
    int hrc = check_sha256(path, buf, len, want, &he);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, (size_t)len, &end, 0);
    if (!root) {
        uint64_t off = end && end >= buf ? (uint64_t)(end - buf) : 0;
        const char *ep = cJSON_GetErrorPtr();
        if (!end && ep && ep >= buf && ep <= buf + len)
            off = (uint64_t)(ep - buf);
        rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": invalid JSON (near byte %" PRIu64 ")", path,
                        line_of(buf, len, off), off);
        free(buf);
        return rc;
    }
    if (!cJSON_IsObject(root)) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: line 1: top level is not a JSON object", path);
        goto out;
    }
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder");
    uint32_t n = 0;
    uint64_t total = 0;
    if (dec && !cJSON_IsObject(dec)) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": added_tokens_decoder is not an object", path,
                        line_of_key(buf, len, "added_tokens_decoder"));
        goto out;
    }
    for (const cJSON *it = dec ? dec->child : NULL; it; it = it->next) {
        if (++n > K3_TOK_MAX_SPECIALS) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: more than %u added tokens", path, K3_TOK_MAX_SPECIALS);
            goto out;
        }
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(it, "content");
        const char *key = it->string ? it->string : "";
        uint64_t kl = strlen(key) > 60 ? 60 : strlen(key);
        char kshort[64];
        memcpy(kshort, key, kl);
        kshort[kl] = 0;
        if (!cJSON_IsObject(it) || !cJSON_IsString(c)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": added token \"%s\" has no string \"content\"",
                            path, line_of_key(buf, len, kshort), kshort);
            goto out;
        }
        uint64_t cl = strlen(c->valuestring);
        if (cl == 0 || cl > K3_TOK_MAX_SPECIAL_BYTES) {
            rc = k3_err_set(e, cl ? K3_ELIMIT : K3_EFORMAT,
                            "%s: line %" PRIu64 ": added token \"%s\": content of %" PRIu64 " bytes (1..%u allowed)",
                            path, line_of_key(buf, len, kshort), kshort, cl, K3_TOK_MAX_SPECIAL_BYTES);
            goto out;
        }
        /* the id: the key, decimal, no sign, no leading zero */
        uint64_t id = 0;
        int ok = key[0] && (key[0] != '0' || !key[1]) && strlen(key) <= 10;
        for (const char *p = key; ok && *p; p++) {
            if (*p < '0' || *p > '9')
                ok = 0;
            else
                id = id * 10 + (uint64_t)(*p - '0');
        }
        if (!ok) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": added token key \"%s\" is not a decimal id", path,
                            line_of_key(buf, len, kshort), kshort);
            goto out;
        }
        if (id < tok->n_ranks) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": added token %" PRIu64 " (\"%.40s\") collides with "
                            "BPE rank %" PRIu64 " (specials must come after the %u ranks)", path,
                            line_of_key(buf, len, kshort), id, c->valuestring, id, tok->n_ranks);
            goto out;
        }
        if (id - tok->n_ranks >= K3_TOK_MAX_SPECIALS) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: line %" PRIu64 ": added token id %" PRIu64 " is more than %u past "
                            "the last rank", path, line_of_key(buf, len, kshort), id, K3_TOK_MAX_SPECIALS);
            goto out;
        }
        total += cl;
        if (total > K3_TOK_MAX_SPECIAL_TOTAL) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: added tokens hold more than %u bytes in all", path,
                            K3_TOK_MAX_SPECIAL_TOTAL);
            goto out;
        }
        if (id + 1 > tok->vocab)
            tok->vocab = (uint32_t)id + 1;
    }
    tok->specials = calloc(n ? n : 1, sizeof *tok->specials);
    tok->special_bytes = malloc(total ? total : 1);
    tok->special_of_id = malloc((uint64_t)(tok->vocab - tok->n_ranks + 1) * sizeof *tok->special_of_id);
    tok->trie = calloc(total + 1, sizeof *tok->trie); /* at most one node per content byte */
    if (!tok->specials || !tok->special_bytes || !tok->special_of_id || !tok->trie) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for %u added tokens", path, n);
        goto out;
    }
    for (uint32_t i = 0; i <= tok->vocab - tok->n_ranks; i++)
        tok->special_of_id[i] = -1;
    uint64_t used = 0;
    for (const cJSON *it = dec ? dec->child : NULL; it; it = it->next) {
        const char *content = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
        uint32_t id = (uint32_t)strtoul(it->string, NULL, 10); /* validated above */
        uint32_t cl = (uint32_t)strlen(content);
        if (tok->special_of_id[id - tok->n_ranks] >= 0) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": added token id %u appears twice", path,
                            line_of_key(buf, len, it->string), id);
            goto out;
        }
        memcpy(tok->special_bytes + used, content, cl);
        tok->specials[tok->n_special] = (struct special){id, cl, tok->special_bytes + used};
        tok->special_of_id[id - tok->n_ranks] = (int32_t)tok->n_special;
        tok->n_special++;
        used += cl;
        if (cl > tok->max_token_len)
            tok->max_token_len = cl;
    }
    qsort(tok->specials, tok->n_special, sizeof *tok->specials, cmp_special);
    for (uint32_t i = 0; i < tok->n_special; i++) {
        tok->special_of_id[tok->specials[i].id - tok->n_ranks] = (int32_t)i;
        if (i && tok->specials[i].len == tok->specials[i - 1].len &&
            memcmp(tok->specials[i].s, tok->specials[i - 1].s, tok->specials[i].len) == 0) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: added tokens %u and %u have the same content \"%.*s\"", path,
                            tok->specials[i - 1].id, tok->specials[i].id,
                            (int)(tok->specials[i].len < 40 ? tok->specials[i].len : 40),
                            (const char *)tok->specials[i].s);
            goto out;
        }
    }
    for (unsigned b = 0, i = 0; b <= 256; b++) {
        while (i < tok->n_special && tok->specials[i].s[0] < b)
            i++;
        tok->first_lo[b] = i;
    }
    uint32_t nodes = 1;
    tok->trie[0].special = -1;
    for (uint32_t i = 0; i < tok->n_special; i++) {
        const struct special *sp = &tok->specials[i];
        uint32_t node = 0;
        for (uint32_t k = 0; k < sp->len; k++) {
            uint32_t c = node ? tok->trie[node].first_child : tok->trie_root[sp->s[k]];
            while (c && tok->trie[c].byte != sp->s[k])
                c = tok->trie[c].next_sibling;
            if (!c) {
                c = nodes++;
                tok->trie[c] = (struct trie_node){0, 0, -1, sp->s[k]};
                if (node) {
                    tok->trie[c].next_sibling = tok->trie[node].first_child;
                    tok->trie[node].first_child = c;
                } else {
                    tok->trie_root[sp->s[k]] = c;
                }
            }
            node = c;
        }
        tok->trie[node].special = (int32_t)i;
    }
    /* eos / bos */
    static const char *const fields[2] = {"eos_token", "bos_token"};
    for (int f = 0; f < 2; f++) {
        int bad;
        const char *name = token_name(root, fields[f], &bad);
        if (bad) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": %s is neither a string nor {\"content\": ...}",
                            path, line_of_key(buf, len, fields[f]), fields[f]);
            goto out;
        }
        if (!name)
            continue;
        int64_t id = k3_tok_special_id(tok, name, strlen(name));
        if (id < 0) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %" PRIu64 ": %s \"%.40s\" is not an added token", path,
                            line_of_key(buf, len, fields[f]), fields[f], name);
            goto out;
        }
        if (f == 0)
            tok->eos[tok->n_eos++] = (uint32_t)id;
        else
            tok->bos = id;
    }
    /* chat models end a turn with one of these (K3: <|end_of_msg|>) */
    static const char *const turn_end[] = {"<|end_of_msg|>", "<|im_end|>"};
    for (unsigned k = 0; k < sizeof turn_end / sizeof turn_end[0]; k++) {
        int64_t id = k3_tok_special_id(tok, turn_end[k], strlen(turn_end[k]));
        int seen = id < 0;
        for (uint32_t j = 0; j < tok->n_eos && !seen; j++)
            seen = tok->eos[j] == (uint32_t)id;
        if (!seen)
            tok->eos[tok->n_eos++] = (uint32_t)id;
    }
out:
    cJSON_Delete(root);
    free(buf);
    if (rc == 0 && hrc) {
        *e = he;
        rc = hrc;
    }
    return rc;
}

/* ---- open / close --------------------------------------------------------- */

static int open_files(k3_tok **out, const char *model_path, const uint8_t *model_sha256, const char *config_path,
                      const uint8_t *config_sha256, k3_err *e)
{
    *out = NULL;
    k3_tok *tok = calloc(1, sizeof *tok);
    if (!tok)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", model_path);
    tok->bos = -1;
    int rc = load_model(tok, model_path, model_sha256, e);
    if (rc == 0 && config_path)
        rc = load_config(tok, config_path, config_sha256, e);
    if (rc == 0 && !tok->special_of_id) {
        tok->special_of_id = malloc(sizeof *tok->special_of_id);
        if (!tok->special_of_id)
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", model_path);
        else
            tok->special_of_id[0] = -1;
    }
    if (rc) {
        k3_tok_close(tok);
        return rc;
    }
    *out = tok;
    return 0;
}

int k3_tok_open_files(k3_tok **out, const char *model_path, const char *config_path, k3_err *e)
{
    return open_files(out, model_path, NULL, config_path, NULL, e);
}

int k3_tok_open_checked(k3_tok **out, const char *dir, const uint8_t *model_sha256, const uint8_t *config_sha256,
                        k3_err *e)
{
    char model[4096], config[4096];
    *out = NULL;
    int rc = k3_io_path_join(model, sizeof model, dir, "tiktoken.model", e);
    if (rc == 0)
        rc = k3_io_path_join(config, sizeof config, dir, "tokenizer_config.json", e);
    if (rc)
        return rc;
    return open_files(out, model, model_sha256, config, config_sha256, e);
}

int k3_tok_open(k3_tok **out, const char *dir, k3_err *e)
{
    return k3_tok_open_checked(out, dir, NULL, NULL, e);
}

void k3_tok_close(k3_tok *tok)
{
    if (!tok)
        return;
    free(tok->bytes);
    free(tok->off);
    free(tok->table);
    free(tok->stable);
    free(tok->pair_rank);
    free(tok->specials);
    free(tok->special_bytes);
    free(tok->special_of_id);
    free(tok->trie);
    free(tok);
}

uint32_t k3_tok_vocab_size(const k3_tok *tok) { return tok->vocab; }
uint32_t k3_tok_rank_count(const k3_tok *tok) { return tok->n_ranks; }
int64_t k3_tok_bos_id(const k3_tok *tok) { return tok->bos; }

void k3_tok_eos_ids(const k3_tok *tok, const uint32_t **ids, uint32_t *n)
{
    *ids = tok->eos;
    *n = tok->n_eos;
}

int k3_tok_is_special(const k3_tok *tok, uint32_t id)
{
    return id >= tok->n_ranks && id < tok->vocab && tok->special_of_id[id - tok->n_ranks] >= 0;
}

int64_t k3_tok_special_id(const k3_tok *tok, const char *s, uint64_t len)
{
    if (len == 0 || !tok->specials)
        return -1;
    uint8_t b = (uint8_t)s[0];
    for (uint32_t i = tok->first_lo[b]; i < tok->first_lo[b + 1]; i++)
        if (tok->specials[i].len == len && memcmp(tok->specials[i].s, s, len) == 0)
            return tok->specials[i].id;
    return -1;
}

const uint8_t *k3_tok_token_bytes(const k3_tok *tok, uint32_t id, uint64_t *len)
{
    if (id < tok->n_ranks) {
        *len = tok->off[id + 1] - tok->off[id];
        return tok->bytes + tok->off[id];
    }
    if (k3_tok_is_special(tok, id)) {
        const struct special *sp = &tok->specials[tok->special_of_id[id - tok->n_ranks]];
        *len = sp->len;
        return sp->s;
    }
    *len = 0;
    return NULL;
}

/* ---- rank merging ----------------------------------------------------------- */

uint64_t k3_tok_bpe_quadratic(const k3_tok *tok, const uint8_t *p, uint64_t len, uint32_t *out,
                              uint32_t *scratch)
{
    /* start[i] is where part i begins; rank[i] the rank of parts i and i+1
     * joined. Each step joins the lowest-ranked pair, the leftmost on ties. */
    uint32_t *start = scratch, *rank = scratch + len + 1;
    uint64_t parts = len;
    for (uint64_t i = 0; i <= len; i++)
        start[i] = (uint32_t)i;
    for (uint64_t i = 0; i + 1 < parts; i++)
        rank[i] = tok->pair_rank[p[i] << 8 | p[i + 1]];
    while (parts > 1) {
        uint32_t best = UINT32_MAX;
        uint64_t bi = 0;
        for (uint64_t i = 0; i + 1 < parts; i++)
            if (rank[i] < best) {
                best = rank[i];
                bi = i;
            }
        if (best == UINT32_MAX)
            break;
        memmove(start + bi + 1, start + bi + 2, (parts - bi - 1) * sizeof *start);
        if (parts >= bi + 3)
            memmove(rank + bi + 1, rank + bi + 2, (parts - bi - 3) * sizeof *rank);
        parts--;
        if (bi + 1 < parts)
            rank[bi] = k3_tok_rank_of(tok, p + start[bi], start[bi + 2] - start[bi]);
        if (bi > 0)
            rank[bi - 1] = k3_tok_rank_of(tok, p + start[bi - 1], start[bi + 1] - start[bi - 1]);
    }
    for (uint64_t i = 0; i < parts; i++)
        out[i] = start[i + 1] - start[i] == 1 ? tok->byte_rank[p[start[i]]]
                                              : k3_tok_rank_of(tok, p + start[i], start[i + 1] - start[i]);
    return parts;
}

/* Heap of candidate pairs ordered by (rank, left byte offset): the same
 * choice as the quadratic scan. Parts are a linked list over byte offsets
 * (next[i] is where the part starting at i ends; 0 marks a merged-away
 * start). An entry is stale when its left part no longer ends where it did
 * or its right part grew. */
struct hent {
    uint32_t rank, left, right_end;
};

static inline int hless(const struct hent *a, const struct hent *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void hpush(struct hent *h, uint64_t *n, struct hent v)
{
    uint64_t i = (*n)++;
    while (i > 0) {
        uint64_t parent = (i - 1) / 2;
        if (!hless(&v, &h[parent]))
            break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = v;
}

static struct hent hpop(struct hent *h, uint64_t *n)
{
    struct hent top = h[0], v = h[--(*n)];
    uint64_t i = 0;
    for (;;) {
        uint64_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && hless(&h[c + 1], &h[c]))
            c++;
        if (!hless(&h[c], &v))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
    return top;
}

uint64_t k3_tok_bpe_heap(const k3_tok *tok, const uint8_t *p, uint64_t len, uint32_t *out,
                         uint32_t *scratch)
{
    /* scratch: next[len+1], prev[len+1], then the heap: len-1 entries at the
     * start, each merge pops one and pushes at most two, and there are at most
     * len-1 merges, so 2*len entries (6*len uint32_t) always suffice */
    uint32_t *next = scratch, *prev = scratch + len + 1;
    struct hent *heap = (struct hent *)(scratch + 2 * (len + 1));
    uint64_t hn = 0, hcap = 2 * (uint64_t)len;
    for (uint64_t i = 0; i < len; i++) {
        next[i] = (uint32_t)(i + 1);
        prev[i] = (uint32_t)(i ? i - 1 : UINT32_MAX);
    }
    for (uint64_t i = 0; i + 1 < len; i++) {
        uint32_t r = tok->pair_rank[p[i] << 8 | p[i + 1]];
        if (r != UINT32_MAX)
            hpush(heap, &hn, (struct hent){r, (uint32_t)i, (uint32_t)(i + 2)});
    }
    while (hn) {
        struct hent t = hpop(heap, &hn);
        uint32_t l = t.left, m = next[l];
        if (m == 0 || m >= len || next[m] != t.right_end)
            continue; /* stale */
        next[l] = next[m];
        next[m] = 0;
        if (next[l] < len)
            prev[next[l]] = l;
        /* new candidates: (prev, l) and (l, next) */
        if (prev[l] != UINT32_MAX && hn + 2 <= hcap) {
            uint32_t a = prev[l];
            uint32_t r = k3_tok_rank_of(tok, p + a, next[l] - a);
            if (r != UINT32_MAX)
                hpush(heap, &hn, (struct hent){r, a, next[l]});
        }
        if (next[l] < len && hn + 2 <= hcap) {
            uint32_t b = next[l];
            uint32_t r = k3_tok_rank_of(tok, p + l, next[b] - l);
            if (r != UINT32_MAX)
                hpush(heap, &hn, (struct hent){r, l, next[b]});
        }
    }
    uint64_t k = 0;
    for (uint32_t i = 0; i < len; i = next[i])
        out[k++] = next[i] - i == 1 ? tok->byte_rank[p[i]] : k3_tok_rank_of(tok, p + i, next[i] - i);
    return k;
}

/* ---- encode / decode ------------------------------------------------------- */

#define BPE_HEAP_FROM 128 /* pieces at least this long merge through the heap */

struct enc {
    uint32_t *ids;
    uint64_t n, cap;
    uint32_t *scratch;
    uint64_t scratch_cap; /* in uint32_t */
};

static int enc_reserve(struct enc *en, uint64_t more, k3_err *e)
{
    if (en->n + more > en->cap) {
        uint64_t cap = en->cap * 2;
        if (cap < en->n + more)
            cap = en->n + more;
        if (cap > SIZE_MAX / sizeof *en->ids)
            return k3_err_set(e, K3_ENOMEM, "tokenizer: output of %" PRIu64 " ids is too large", cap);
        uint32_t *p = realloc(en->ids, cap * sizeof *p);
        if (!p)
            return k3_err_set(e, K3_ENOMEM, "tokenizer: out of memory for %" PRIu64 " ids", cap);
        en->ids = p;
        en->cap = cap;
    }
    return 0;
}

static int encode_ordinary(const k3_tok *tok, const uint8_t *s, uint64_t len, struct enc *en, k3_err *e)
{
    uint64_t pos = 0;
    while (pos < len) {
        uint64_t end = k3_tok_split_next((const char *)s, len, pos);
        uint64_t pl = end - pos;
        const uint8_t *p = s + pos;
        pos = end;
        uint32_t r = pl <= tok->max_token_len ? k3_tok_rank_of(tok, p, pl) : UINT32_MAX;
        if (r != UINT32_MAX) {
            int rc = enc_reserve(en, 1, e);
            if (rc)
                return rc;
            en->ids[en->n++] = r;
            continue;
        }
        int rc = enc_reserve(en, pl, e);
        if (rc)
            return rc;
        if (K3_TOK_SCRATCH(pl) > en->scratch_cap) {
            uint64_t cap = K3_TOK_SCRATCH(pl);
            if (cap > SIZE_MAX / sizeof(uint32_t) || pl >= UINT32_MAX)
                return k3_err_set(e, K3_ELIMIT, "tokenizer: a piece of %" PRIu64 " bytes is too long", pl);
            uint32_t *sc = realloc(en->scratch, cap * sizeof *sc);
            if (!sc)
                return k3_err_set(e, K3_ENOMEM, "tokenizer: out of memory for a %" PRIu64 "-byte piece", pl);
            en->scratch = sc;
            en->scratch_cap = cap;
        }
        en->n += pl < BPE_HEAP_FROM ? k3_tok_bpe_quadratic(tok, p, pl, en->ids + en->n, en->scratch)
                                    : k3_tok_bpe_heap(tok, p, pl, en->ids + en->n, en->scratch);
    }
    return 0;
}

/* The earliest special token in s[from..len), longest at that position. */
static const struct special *find_special(const k3_tok *tok, const uint8_t *s, uint64_t len, uint64_t from,
                                          uint64_t *at)
{
    for (uint64_t i = from; i < len; i++) {
        uint32_t node = tok->trie_root[s[i]];
        int32_t best = -1;
        for (uint64_t j = i + 1; node; j++) {
            if (tok->trie[node].special >= 0)
                best = tok->trie[node].special;
            if (j == len)
                break;
            uint32_t c = tok->trie[node].first_child;
            while (c && tok->trie[c].byte != s[j])
                c = tok->trie[c].next_sibling;
            node = c;
        }
        if (best >= 0) {
            *at = i;
            return &tok->specials[best];
        }
    }
    return NULL;
}

/* s[0..len) as tiktoken's encode does: specials (if allowed) between
 * ordinarily encoded stretches. */
static int encode_slice(const k3_tok *tok, const uint8_t *s, uint64_t len, int allow_special, struct enc *en,
                        k3_err *e)
{
    uint64_t pos = 0;
    int rc = 0;
    while (rc == 0 && pos < len) {
        uint64_t at = len;
        const struct special *sp = allow_special && tok->n_special ? find_special(tok, s, len, pos, &at) : NULL;
        rc = encode_ordinary(tok, s + pos, at - pos, en, e);
        if (rc == 0 && sp) {
            rc = enc_reserve(en, 1, e);
            if (rc == 0)
                en->ids[en->n++] = sp->id;
            at += sp->len;
        }
        pos = at;
    }
    return rc;
}

#define KIMI_WINDOW_CHARS 400000u
#define KIMI_RUN_CHARS    25000u

/* Kimi's wrapper: windows of KIMI_WINDOW_CHARS characters; inside each, a
 * slice ends before the character that would make the current run of
 * all-space or all-non-space characters longer than KIMI_RUN_CHARS. An
 * invalid byte is one non-space character (as its U+FFFD would be). */
static int encode_kimi_slices(const k3_tok *tok, const uint8_t *s, uint64_t len, int allow_special,
                              struct enc *en, k3_err *e)
{
    uint64_t start = 0, i = 0, window = 0, run = 0;
    int cur = -1, rc = 0;
    while (rc == 0 && i < len) {
        if (window == KIMI_WINDOW_CHARS) {
            rc = encode_slice(tok, s + start, i - start, allow_special, en, e);
            start = i;
            window = 0;
            cur = -1;
            continue;
        }
        uint32_t cp;
        unsigned l = k3_tok_utf8_next(s, len, i, &cp);
        int space = (k3_tok_class(cp) & K3_UC_PYSPACE) != 0;
        if (cur != space) {
            cur = space;
            run = 1;
        } else if (++run > KIMI_RUN_CHARS) {
            rc = encode_slice(tok, s + start, i - start, allow_special, en, e);
            start = i;
            run = 1;
        }
        window++;
        i += l;
    }
    if (rc == 0)
        rc = encode_slice(tok, s + start, len - start, allow_special, en, e);
    return rc;
}

int k3_tok_encode(const k3_tok *tok, const char *text, uint64_t len, unsigned flags, uint32_t **ids,
                  uint64_t *n, k3_err *e)
{
    *ids = NULL;
    *n = 0;
    const uint8_t *s = (const uint8_t *)text;
    struct enc en = {0};
    int allow = (flags & K3_TOK_ALLOW_SPECIAL) != 0;
    /* about one id per 3-4 bytes of text; grown by doubling past 1M ids */
    int rc = enc_reserve(&en, len / 3 < (1u << 20) ? len / 3 + 16 : (1u << 20), e);
    if (rc == 0 && (flags & ~(K3_TOK_ALLOW_SPECIAL | K3_TOK_KIMI_SLICES)))
        rc = k3_err_set(e, K3_EARG, "tokenizer: unknown encode flags 0x%x", flags);
    if (rc == 0)
        rc = (flags & K3_TOK_KIMI_SLICES) ? encode_kimi_slices(tok, s, len, allow, &en, e)
                                          : encode_slice(tok, s, len, allow, &en, e);
    free(en.scratch);
    if (rc) {
        free(en.ids);
        return rc;
    }
    *ids = en.ids;
    *n = en.n;
    return 0;
}

int k3_tok_decode(const k3_tok *tok, const uint32_t *ids, uint64_t n, char **out, uint64_t *len, k3_err *e)
{
    *out = NULL;
    *len = 0;
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t tl;
        if (!k3_tok_token_bytes(tok, ids[i], &tl))
            return k3_err_set(e, K3_EARG, "tokenizer: id %u at position %" PRIu64 " is not a token "
                              "(vocabulary of %u)", ids[i], i, tok->vocab);
        total += tl; /* <= n * 2048: cannot overflow for any n that fits in memory */
    }
    if (total >= SIZE_MAX)
        return k3_err_set(e, K3_ENOMEM, "tokenizer: decoded text of %" PRIu64 " bytes is too large", total);
    char *buf = malloc((size_t)total + 1);
    if (!buf)
        return k3_err_set(e, K3_ENOMEM, "tokenizer: out of memory for %" PRIu64 " decoded bytes", total);
    uint64_t o = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t tl;
        const uint8_t *b = k3_tok_token_bytes(tok, ids[i], &tl);
        memcpy(buf + o, b, tl);
        o += tl;
    }
    buf[o] = 0;
    *out = buf;
    *len = o;
    return 0;
}
