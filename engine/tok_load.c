/*
 * tok_load.c - loading the tokenizer's files into the handle: tiktoken.model
 * (base64 token, rank per line; ranks 0..n-1 in order, distinct non-empty
 * byte strings, all 256 single bytes) and tokenizer_config.json (the special
 * tokens, bos and eos). Both are hostile input: every size is bounded before
 * it is allocated, every error is one line naming the file and line.
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
#include "tok_data.h"

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

int k3_tok_load_model(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e)
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

int k3_tok_load_config(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e)
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
