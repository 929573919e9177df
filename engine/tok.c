/*
 * tok.c - the tokenizer handle: open (the files are loaded by tok_load.c:
 * tiktoken.model and tokenizer_config.json, both hostile: every size is
 * bounded before it is allocated, every error is one line naming the file
 * and line), the byte string -> rank hash map, rank merging, special
 * tokens, encode and decode.
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
#include "tok_data.h"

/* ---- hashing ------------------------------------------------------------ */

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

/* ---- open / close --------------------------------------------------------- */

static int open_files(k3_tok **out, const char *model_path, const uint8_t *model_sha256, const char *config_path,
                      const uint8_t *config_sha256, k3_err *e)
{
    *out = NULL;
    k3_tok *tok = calloc(1, sizeof *tok);
    if (!tok)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", model_path);
    tok->bos = -1;
    int rc = k3_tok_load_model(tok, model_path, model_sha256, e);
    if (rc == 0 && config_path)
        rc = k3_tok_load_config(tok, config_path, config_sha256, e);
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
