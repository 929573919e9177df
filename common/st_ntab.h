/*
 * st_ntab.h - the name table of common/st.c and common/st_header.c (private):
 * open addressing over borrowed names, and a prefetching hash ring for bulk
 * operations. Inline: the probes run half a million times per checkpoint.
 */
#ifndef K3_ST_NTAB_H
#define K3_ST_NTAB_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Open addressing: a slot holds the name, index + 1 (0 = empty) and the
 * name's hash, so a probe is one cache line plus one string compare on a
 * hash match. Names are borrowed and must outlive the table. */
typedef struct nslot {
    const char *name;
    uint32_t idx;
    uint32_t hash;
} nslot;

typedef struct ntab {
    nslot *slot;
    uint64_t mask;
} ntab;

/* A word-at-a-time multiplicative hash (FNV-1a byte by byte was a third of
 * k3_st_open's time on K3's 80-byte names: one multiply per byte). */
static inline uint32_t name_hash(const char *s)
{
    size_t n = strlen(s);
    uint64_t h = 0x243F6A8885A308D3ull ^ n;
    uint64_t w;
    for (; n >= 8; n -= 8, s += 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return (uint32_t)h;
}
static inline int ntab_init(ntab *t, uint64_t count)
{
    uint64_t n = 16;
    while (n < 2 * count)
        n <<= 1;
    t->slot = calloc((size_t)n, sizeof *t->slot);
    t->mask = n - 1;
    return t->slot ? 0 : K3_ENOMEM;
}

static inline void ntab_free(ntab *t)
{
    free(t->slot);
    t->slot = NULL;
}

/* Insert index i (name s, hash h); returns -1 if inserted, else the index
 * already holding the same name. */
static inline int64_t ntab_insert_h(ntab *t, const char *s, uint32_t h, uint32_t i)
{
    for (uint64_t k = h & t->mask;; k = (k + 1) & t->mask) {
        nslot *q = &t->slot[k];
        if (!q->idx) {
            q->name = s;
            q->idx = i + 1;
            q->hash = h;
            return -1;
        }
        if (q->hash == h && !strcmp(q->name, s))
            return q->idx - 1;
    }
}

static inline int64_t ntab_find_h(const ntab *t, const char *s, uint32_t h)
{
    if (!t->slot)
        return -1;
    for (uint64_t k = h & t->mask;; k = (k + 1) & t->mask) {
        const nslot *q = &t->slot[k];
        if (!q->idx)
            return -1;
        if (q->hash == h && !strcmp(q->name, s))
            return q->idx - 1;
    }
}

static inline int64_t ntab_insert(ntab *t, const char *s, uint32_t i)
{
    return ntab_insert_h(t, s, name_hash(s), i);
}

static inline int64_t ntab_find(const ntab *t, const char *s)
{
    return ntab_find_h(t, s, name_hash(s));
}

/* Bulk operations hash PREFETCH_AHEAD names ahead and prefetch their slots:
 * with half a million names the table is far larger than the caches and a
 * probe is otherwise one memory latency. */
#define PREFETCH_AHEAD 16

typedef struct hash_ring {
    uint32_t h[PREFETCH_AHEAD];
} hash_ring;

static inline void ring_push(hash_ring *r, const ntab *t, const char *s, uint64_t i)
{
    uint32_t h = name_hash(s);
    r->h[i % PREFETCH_AHEAD] = h;
    __builtin_prefetch(&t->slot[h & t->mask]);
}

#endif
