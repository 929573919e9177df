/*
 * tok_data.h - the tokenizer handle's structure and its hash (private to
 * engine/tok.c and engine/tok_load.c).
 */
#ifndef K3_TOK_DATA_H
#define K3_TOK_DATA_H

#include <stdint.h>
#include <string.h>

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

/* tok_load.c: tiktoken.model (ranks, the hash tables) and
 * tokenizer_config.json (specials, bos/eos) into tok; want: the SHA-256 the
 * file must have (NULL: not checked). */
int k3_tok_load_model(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e);
int k3_tok_load_config(k3_tok *tok, const char *path, const uint8_t *want, k3_err *e);

#endif
