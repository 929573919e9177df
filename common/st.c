/*
 * st.c - safetensors shards: header parsing, the checkpoint-wide tensor index,
 * and tensor reads (see k3_st.h).
 *
 * Invariants:
 * - A parsed header is fully validated before anything is returned: every
 *   tensor has a known dtype, at most K3_ST_MAX_DIMS dims, a byte size equal
 *   to product(shape) * dtype size computed without overflow, and the
 *   tensors tile the data area exactly: no overlap, no hole, nothing after
 *   the last tensor (the safetensors format requires the byte buffer to be
 *   entirely indexed). Tensors are kept sorted by offset.
 * - A k3_st's tensor array is the concatenation of its shards' sorted arrays
 *   (shards in name order), so it is sorted by (shard, offset); it is never
 *   reallocated after k3_st_open returns, so borrowed pointers stay valid.
 * - Names are unique in the whole checkpoint (one open-addressing table,
 *   power-of-two sized, at most half full, a word-at-a-time hash).
 * - With an index file, the index and the shards agree exactly (same tensor
 *   set, same tensor -> shard map, no unreferenced shard file in the folder).
 * - k3_st_open parses the index and the headers on worker threads that touch
 *   only their own shard slot and error record; everything after (merging,
 *   the table, cross-checks, the choice of error) runs on the caller's thread
 *   in a fixed order, so results never depend on timing.
 */
#include "k3_st.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"
#include "st_json.h"

#define INDEX_NAME "model.safetensors.index.json"
#define MAX_SHARD_NAME 255u
#define DIRECT_CHUNK (4u << 20)

/* ---- dtypes --------------------------------------------------------------- */

static const struct {
    const char *name;
    uint32_t size;
} dtypes[K3_DT_COUNT] = {
    [K3_DT_BF16] = {"BF16", 2},    [K3_DT_F16] = {"F16", 2},          [K3_DT_F32] = {"F32", 4},
    [K3_DT_U8] = {"U8", 1},        [K3_DT_I8] = {"I8", 1},            [K3_DT_I32] = {"I32", 4},
    [K3_DT_F8_E4M3] = {"F8_E4M3", 1}, [K3_DT_F8_E5M2] = {"F8_E5M2", 1},
};

const char *k3_dtype_name(k3_dtype t)
{
    return (unsigned)t < K3_DT_COUNT ? dtypes[t].name : "?";
}

int k3_dtype_from_name(const char *s, k3_dtype *t)
{
    for (int i = 0; i < K3_DT_COUNT; i++)
        if (!strcmp(s, dtypes[i].name)) {
            *t = (k3_dtype)i;
            return 0;
        }
    return K3_EFORMAT;
}

uint32_t k3_dtype_size(k3_dtype t)
{
    return (unsigned)t < K3_DT_COUNT ? dtypes[t].size : 0;
}

/* ---- name table ----------------------------------------------------------- */

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
static uint32_t name_hash(const char *s)
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
static int ntab_init(ntab *t, uint64_t count)
{
    uint64_t n = 16;
    while (n < 2 * count)
        n <<= 1;
    t->slot = calloc((size_t)n, sizeof *t->slot);
    t->mask = n - 1;
    return t->slot ? 0 : K3_ENOMEM;
}

static void ntab_free(ntab *t)
{
    free(t->slot);
    t->slot = NULL;
}

/* Insert index i (name s, hash h); returns -1 if inserted, else the index
 * already holding the same name. */
static int64_t ntab_insert_h(ntab *t, const char *s, uint32_t h, uint32_t i)
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

static int64_t ntab_find_h(const ntab *t, const char *s, uint32_t h)
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

static int64_t ntab_insert(ntab *t, const char *s, uint32_t i)
{
    return ntab_insert_h(t, s, name_hash(s), i);
}

static int64_t ntab_find(const ntab *t, const char *s)
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

static void ring_push(hash_ring *r, const ntab *t, const char *s, uint64_t i)
{
    uint32_t h = name_hash(s);
    r->h[i % PREFETCH_AHEAD] = h;
    __builtin_prefetch(&t->slot[h & t->mask]);
}

/* ---- one shard header ----------------------------------------------------- */

void k3_st_header_free(k3_st_header *h)
{
    if (!h)
        return;
    free(h->tensors);
    free(h->names);
    memset(h, 0, sizeof *h);
}

/* Parse the value of a tensor entry into t; j->tensor is set. */
static int parse_tensor_entry(k3_jc *j, k3_st_tensor *t, uint64_t data_size)
{
    int rc;
    k3_jc_ws(j);
    if (j->p >= j->end || *j->p != '{')
        return k3_jc_fail(j, NULL, K3_EFORMAT, "entry must be an object, found %s", k3_jc_kind(j));
    const uint8_t *entry = j->p++;
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    uint64_t begin = 0, end = 0;
    k3_jc_ws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        goto check;
    }
    for (;;) {
        char key[32];
        const uint8_t *kpos;
        k3_jc_ws(j);
        kpos = j->p;
        rc = k3_jc_string(j, key, sizeof key, NULL, "entry key");
        if (rc == K3_ELIMIT) {
            k3_err_clear(j->e);
            return k3_jc_fail(j, kpos, K3_EFORMAT, "unexpected key in entry (only dtype, shape, data_offsets)");
        }
        if (rc || (rc = k3_jc_expect(j, ':', "after a key")))
            return rc;
        if (!strcmp(key, "dtype")) {
            if (have_dtype++)
                return k3_jc_fail(j, kpos, K3_EFORMAT, "dtype given twice");
            char dt[32];
            k3_jc_ws(j);
            const uint8_t *vpos = j->p;
            rc = k3_jc_string(j, dt, sizeof dt, NULL, "dtype");
            if (rc == K3_ELIMIT) {
                k3_err_clear(j->e);
                return k3_jc_fail(j, vpos, K3_EFORMAT, "unknown dtype (a string of 32 bytes or more)");
            }
            if (rc)
                return rc;
            if (k3_dtype_from_name(dt, &t->dtype))
                return k3_jc_fail(j, vpos, K3_EFORMAT,
                                  "unknown dtype \"%s\" (known: BF16 F16 F32 U8 I8 I32 F8_E4M3 F8_E5M2)", dt);
        } else if (!strcmp(key, "shape")) {
            if (have_shape++)
                return k3_jc_fail(j, kpos, K3_EFORMAT, "shape given twice");
            k3_jc_ws(j);
            if (j->p >= j->end || *j->p != '[')
                return k3_jc_fail(j, NULL, K3_EFORMAT, "shape must be an array, found %s", k3_jc_kind(j));
            j->p++;
            t->ndim = 0;
            k3_jc_ws(j);
            if (j->p < j->end && *j->p == ']') {
                j->p++;
            } else {
                for (;;) {
                    uint64_t d;
                    if (t->ndim == K3_ST_MAX_DIMS)
                        return k3_jc_fail(j, NULL, K3_EFORMAT, "shape has more than %u dims", K3_ST_MAX_DIMS);
                    if ((rc = k3_jc_uint(j, &d, "shape dim")))
                        return rc;
                    t->shape[t->ndim++] = d;
                    k3_jc_ws(j);
                    if (j->p < j->end && *j->p == ']') {
                        j->p++;
                        break;
                    }
                    if ((rc = k3_jc_expect(j, ',', "between shape dims")))
                        return rc;
                }
            }
        } else if (!strcmp(key, "data_offsets")) {
            if (have_offsets++)
                return k3_jc_fail(j, kpos, K3_EFORMAT, "data_offsets given twice");
            k3_jc_ws(j);
            if (j->p >= j->end || *j->p != '[')
                return k3_jc_fail(j, NULL, K3_EFORMAT, "data_offsets must be an array, found %s", k3_jc_kind(j));
            j->p++;
            if ((rc = k3_jc_uint(j, &begin, "data_offsets begin")) ||
                (rc = k3_jc_expect(j, ',', "in data_offsets [begin, end]")) ||
                (rc = k3_jc_uint(j, &end, "data_offsets end")))
                return rc;
            k3_jc_ws(j);
            if (j->p >= j->end || *j->p != ']')
                return k3_jc_fail(j, NULL, K3_EFORMAT, "data_offsets must hold exactly two integers");
            j->p++;
        } else {
            return k3_jc_fail(j, kpos, K3_EFORMAT, "unexpected key \"%s\" in entry (only dtype, shape, data_offsets)",
                              key);
        }
        k3_jc_ws(j);
        if (j->p < j->end && *j->p == '}') {
            j->p++;
            break;
        }
        if ((rc = k3_jc_expect(j, ',', "or '}' in entry")))
            return rc;
    }
check:
    if (!have_dtype || !have_shape || !have_offsets)
        return k3_jc_fail(j, entry, K3_EFORMAT, "entry lacks %s%s%s", !have_dtype ? "dtype " : "",
                          !have_shape ? "shape " : "", !have_offsets ? "data_offsets" : "");
    if (begin > end)
        return k3_jc_fail(j, entry, K3_EFORMAT, "data_offsets begin %" PRIu64 " > end %" PRIu64, begin, end);
    if (end > data_size)   /* the header is whole, the data is not: a truncated file (README: exit 4) */
        return k3_jc_fail(j, entry, K3_EIO,
                          "data_offsets [%" PRIu64 ", %" PRIu64 ") run past the data area (%" PRIu64
                          " bytes): the file is truncated",
                          begin, end, data_size);
    uint64_t n = k3_dtype_size(t->dtype);
    for (uint32_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] && n > UINT64_MAX / t->shape[d])
            return k3_jc_fail(j, entry, K3_EFORMAT, "shape product overflows 64 bits");
        n *= t->shape[d];
    }
    if (n != end - begin)
        return k3_jc_fail(j, entry, K3_EFORMAT,
                          "size %" PRIu64 " bytes from data_offsets != %" PRIu64 " from shape x %s",
                          end - begin, n, k3_dtype_name(t->dtype));
    t->offset = begin;
    t->nbytes = n;
    return 0;
}

/* __metadata__: an object of string -> string. */
static int parse_metadata(k3_jc *j)
{
    int rc;
    k3_jc_ws(j);
    if (j->p >= j->end || *j->p != '{')
        return k3_jc_fail(j, NULL, K3_EFORMAT, "__metadata__ must be an object, found %s", k3_jc_kind(j));
    j->p++;
    k3_jc_ws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        return 0;
    }
    for (;;) {
        if ((rc = k3_jc_string(j, NULL, 0, NULL, "__metadata__ key")) || (rc = k3_jc_expect(j, ':', "after a key")) ||
            (rc = k3_jc_string(j, NULL, 0, NULL, "__metadata__ value")))
            return rc;
        k3_jc_ws(j);
        if (j->p < j->end && *j->p == '}') {
            j->p++;
            return 0;
        }
        if ((rc = k3_jc_expect(j, ',', "or '}' in __metadata__")))
            return rc;
    }
}

static int cmp_offset(const void *a, const void *b)
{
    const k3_st_tensor *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes)
        return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

int k3_st_header_parse(k3_st_header *h, const char *shard_name, const uint8_t *hdr, uint64_t hdr_len,
                       uint64_t file_size, k3_err *e)
{
    memset(h, 0, sizeof *h);
    if (hdr_len > K3_ST_MAX_HEADER)
        return k3_err_set(e, K3_ELIMIT, "%s: byte 0: header length %" PRIu64 " exceeds the %u-byte limit",
                          shard_name, hdr_len, K3_ST_MAX_HEADER);
    if (file_size < 8 || hdr_len > file_size - 8)
        return k3_err_set(e, K3_EIO, "%s: byte 0: header length %" PRIu64 " runs past end of file (%" PRIu64
                          " bytes): the file is truncated", shard_name, hdr_len, file_size);
    h->data_start = 8 + hdr_len;
    uint64_t data_size = file_size - h->data_start;
    k3_jc j = {.start = hdr, .p = hdr, .end = hdr + hdr_len, .base = 8, .file = shard_name, .e = e};
    if (hdr_len == 0 || hdr[0] != '{')
        return k3_jc_fail(&j, NULL, K3_EFORMAT, "header is not a JSON object (it must start with '{')");

    /* decoded names never outgrow their encoded form (quotes included) */
    h->names = malloc((size_t)hdr_len + 1);
    uint64_t cap = 64, used = 0;
    h->tensors = malloc(cap * sizeof *h->tensors);
    uint64_t *entry_pos = malloc(cap * sizeof *entry_pos);
    char *names_end = h->names;
    int rc = 0, seen_meta = 0;
    if (!h->names || !h->tensors || !entry_pos) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for a %" PRIu64 "-byte header", shard_name, hdr_len);
        goto out;
    }
    j.p++;
    k3_jc_ws(&j);
    if (j.p < j.end && *j.p == '}') {
        j.p++;
        goto trailer;
    }
    for (;;) {
        k3_jc_ws(&j);
        const uint8_t *kpos = j.p;
        size_t nlen;
        j.tensor = NULL;
        rc = k3_jc_string(&j, names_end, (size_t)(h->names + hdr_len + 1 - names_end), &nlen, "tensor name");
        if (rc)
            goto out;
        if (nlen > K3_ST_MAX_NAME) {
            rc = k3_jc_fail(&j, kpos, K3_EFORMAT, "tensor name is longer than %u bytes", K3_ST_MAX_NAME);
            goto out;
        }
        if ((rc = k3_jc_expect(&j, ':', "after a tensor name")))
            goto out;
        if (!strcmp(names_end, "__metadata__")) {
            if (seen_meta++) {
                rc = k3_jc_fail(&j, kpos, K3_EFORMAT, "__metadata__ given twice");
                goto out;
            }
            if ((rc = parse_metadata(&j)))
                goto out;
        } else {
            if (nlen == 0) {
                rc = k3_jc_fail(&j, kpos, K3_EFORMAT, "empty tensor name");
                goto out;
            }
            if (used == cap) {
                if (used >= K3_ST_MAX_TENSORS) {
                    rc = k3_jc_fail(&j, kpos, K3_ELIMIT, "more than %llu tensors", (unsigned long long)K3_ST_MAX_TENSORS);
                    goto out;
                }
                cap *= 2;
                k3_st_tensor *nt = realloc(h->tensors, cap * sizeof *nt);
                if (nt)
                    h->tensors = nt;
                uint64_t *np = realloc(entry_pos, cap * sizeof *np);
                if (np)
                    entry_pos = np;
                if (!nt || !np) {
                    rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " tensors", shard_name, cap);
                    goto out;
                }
            }
            k3_st_tensor *t = &h->tensors[used];
            memset(t, 0, sizeof *t);
            t->name = names_end;
            j.tensor = names_end;
            if ((rc = parse_tensor_entry(&j, t, data_size)))
                goto out;
            entry_pos[used] = 8 + (uint64_t)(kpos - hdr);
            names_end += nlen + 1;
            used++;
        }
        k3_jc_ws(&j);
        j.tensor = NULL;
        if (j.p < j.end && *j.p == '}') {
            j.p++;
            break;
        }
        if ((rc = k3_jc_expect(&j, ',', "or '}' after a tensor entry")))
            goto out;
    }
trailer:
    /* writers pad the header with spaces; JSON whitespace is accepted */
    k3_jc_ws(&j);
    if (j.p != j.end) {
        rc = k3_jc_fail(&j, NULL, K3_EFORMAT, "bytes after the header JSON (byte 0x%02x; only whitespace padding may follow it)",
                        *j.p);
        goto out;
    }
    h->count = used;

    /* the names block was sized for the worst case (the whole header): keep
     * only what the names use */
    {
        size_t used_bytes = (size_t)(names_end - h->names);
        char *exact = malloc(used_bytes ? used_bytes : 1);
        if (!exact) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for tensor names", shard_name);
            goto out;
        }
        memcpy(exact, h->names, used_bytes);
        for (uint64_t i = 0; i < used; i++)
            h->tensors[i].name = exact + (h->tensors[i].name - h->names);
        free(h->names);
        h->names = exact;
    }

    /* duplicate names: the table indexes h->tensors before sorting */
    if (used) {
        ntab tab;
        if (ntab_init(&tab, used)) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for the name table", shard_name);
            goto out;
        }
        for (uint64_t i = 0; i < used && !rc; i++) {
            int64_t prev = ntab_insert(&tab, h->tensors[i].name, (uint32_t)i);
            if (prev >= 0)
                rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": duplicate name (first at byte %"
                                PRIu64 ")", shard_name, entry_pos[i], h->tensors[i].name, entry_pos[prev]);
        }
        ntab_free(&tab);
        if (rc)
            goto out;
    }

    /* the tensors must tile [0, data_size) exactly */
    /* writers usually list tensors in data order: sort only if needed */
    uint64_t sorted = 1;
    while (sorted < used && cmp_offset(&h->tensors[sorted - 1], &h->tensors[sorted]) <= 0)
        sorted++;
    if (sorted < used)
        qsort(h->tensors, used, sizeof *h->tensors, cmp_offset);
    uint64_t expect = 0;
    for (uint64_t i = 0; i < used; i++) {
        k3_st_tensor *t = &h->tensors[i];
        if (t->offset < expect) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": data [%" PRIu64 ", %" PRIu64
                            ") overlaps tensor \"%.200s\" which ends at %" PRIu64, shard_name, h->data_start + t->offset,
                            t->name, t->offset, t->offset + t->nbytes, h->tensors[i - 1].name, expect);
            goto out;
        }
        if (t->offset > expect) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": hole in the data: bytes [%" PRIu64
                            ", %" PRIu64 ") belong to no tensor", shard_name, h->data_start + expect, t->name, expect,
                            t->offset);
            goto out;
        }
        expect = t->offset + t->nbytes;
        t->offset += h->data_start;
    }
    if (expect != data_size) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": %" PRIu64 " bytes after the last tensor belong to no tensor"
                        " (data area is %" PRIu64 " bytes, tensors cover %" PRIu64 ")", shard_name,
                        h->data_start + expect, data_size - expect, data_size, expect);
        goto out;
    }
out:
    free(entry_pos);
    if (rc)
        k3_st_header_free(h);
    return rc;
}

/* 1 if bytes [from, to) of the file hold no control byte but whitespace
 * (JSON text), 0 if they do, negative on a read error. to - from is below
 * the header bound, so this reads at most K3_ST_MAX_HEADER bytes. */
static int tail_is_text(int fd, int direct, uint64_t from, uint64_t to, const char *path, k3_err *e)
{
    const uint64_t C = 1u << 20;
    uint8_t *buf = k3_io_alloc_aligned(C + 2 * K3_IO_DIRECT_ALIGN, K3_IO_DIRECT_ALIGN);
    uint8_t *bounce = direct ? k3_io_alloc_aligned(C + 2 * K3_IO_DIRECT_ALIGN, K3_IO_DIRECT_ALIGN) : NULL;
    int rc = buf && (!direct || bounce) ? 1 : k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
    for (uint64_t at = from; rc == 1 && at < to;) {
        uint64_t k = to - at < C ? to - at : C;
        int r = direct ? k3_io_pread_direct(fd, buf, k, at, bounce, C + 2 * K3_IO_DIRECT_ALIGN, path, e)
                       : k3_io_pread(fd, buf, k, at, path, e);
        if (r < 0) {
            rc = r;
            break;
        }
        for (uint64_t i = 0; i < k; i++)
            if (buf[i] < 0x20 && buf[i] != ' ' && buf[i] != '\t' && buf[i] != '\n' && buf[i] != '\r') {
                rc = 0;
                break;
            }
        at += k;
    }
    k3_io_free_aligned(buf);
    k3_io_free_aligned(bounce);
    return rc;
}

int k3_st_header_read(k3_st_header *h, int fd, const char *path, k3_err *e)
{
    memset(h, 0, sizeof *h);
    uint64_t size;
    int rc = k3_io_file_size(fd, &size, path, e);
    if (rc)
        return rc;
    if (size < 8)
        return k3_err_set(e, K3_EIO, "%s: byte 0: file is %" PRIu64 " bytes, too short for the 8-byte header length: "
                          "the file is truncated", path, size);
    int flags = fcntl(fd, F_GETFL);
    int direct = flags >= 0 && (flags & O_DIRECT);
    uint8_t *bounce = NULL;
    uint64_t bounce_cap = 0;
    uint8_t len8[8];
    if (direct) {
        bounce_cap = 2 * K3_IO_DIRECT_ALIGN;
        bounce = k3_io_alloc_aligned(bounce_cap, K3_IO_DIRECT_ALIGN);
        if (!bounce)
            return k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
        rc = k3_io_pread_direct(fd, len8, 8, 0, bounce, bounce_cap, path, e);
    } else {
        rc = k3_io_pread(fd, len8, 8, 0, path, e);
    }
    if (rc) {
        k3_io_free_aligned(bounce);
        return rc;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | len8[i];
    if (n > K3_ST_MAX_HEADER) {
        k3_io_free_aligned(bounce);
        return k3_err_set(e, K3_ELIMIT, "%s: byte 0: header length %" PRIu64 " exceeds the %u-byte limit", path, n,
                          K3_ST_MAX_HEADER);
    }
    if (n > size - 8) {
        /* cut inside the header (what follows the length is all text), or a
         * corrupt length (the header text is followed by tensor bytes) */
        k3_io_free_aligned(bounce);
        int text = tail_is_text(fd, direct, 8, size, path, e);
        if (text < 0)
            return text;
        if (!text)
            return k3_err_set(e, K3_EFORMAT, "%s: byte 0: header length %" PRIu64 " runs past end of file (%" PRIu64
                              " bytes), and binary data follows the header text: a corrupt length", path, n, size);
        return k3_err_set(e, K3_EIO, "%s: byte 0: header length %" PRIu64 " runs past end of file (%" PRIu64
                          " bytes): the file is truncated", path, n, size);
    }
    uint8_t *text = malloc(n ? (size_t)n : 1);
    if (!text) {
        k3_io_free_aligned(bounce);
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory for a %" PRIu64 "-byte header", path, n);
    }
    if (direct) {
        /* the header is read in bounded aligned pieces */
        uint64_t done = 0;
        k3_io_free_aligned(bounce);
        bounce_cap = DIRECT_CHUNK + 2 * K3_IO_DIRECT_ALIGN;
        bounce = k3_io_alloc_aligned(bounce_cap, K3_IO_DIRECT_ALIGN);
        if (!bounce)
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
        while (!rc && done < n) {
            uint64_t k = n - done < DIRECT_CHUNK ? n - done : DIRECT_CHUNK;
            rc = k3_io_pread_direct(fd, text + done, k, 8 + done, bounce, bounce_cap, path, e);
            done += k;
        }
    } else {
        rc = k3_io_pread(fd, text, n, 8, path, e);
    }
    k3_io_free_aligned(bounce);
    if (!rc)
        rc = k3_st_header_parse(h, path, text, n, size, e);
    free(text);
    return rc;
}

/* ---- the checkpoint ------------------------------------------------------- */

typedef struct shard {
    char *path;
    const char *name;   /* points into path */
    int fd;
    int direct;
    uint64_t size;
    uint64_t data_start;
    char *names;        /* the names block of its header */
} shard;

struct k3_st {
    shard *shards;
    uint32_t nshards;
    k3_st_tensor *tensors;
    uint64_t count;
    ntab table;
};

void k3_st_close(k3_st *st)
{
    if (!st)
        return;
    for (uint32_t i = 0; i < st->nshards; i++) {
        if (st->shards[i].fd >= 0)
            close(st->shards[i].fd);
        free(st->shards[i].path);
        free(st->shards[i].names);
    }
    free(st->shards);
    free(st->tensors);
    ntab_free(&st->table);
    free(st);
}

/* The index: tensor -> shard, decoded in place in its own text. */
typedef struct index_entry {
    const char *tensor;
    uint32_t shard;   /* into index_map.shard_names, later remapped to sorted order */
    uint64_t pos;     /* byte offset in the index file */
} index_entry;

typedef struct index_map {
    char *text;
    index_entry *entries;
    uint64_t count;
    const char **shard_names;
    uint32_t nshards;
} index_map;

static void index_free(index_map *m)
{
    free(m->text);
    free(m->entries);
    free(m->shard_names);
    memset(m, 0, sizeof *m);
}

static int shard_name_ok(const char *s)
{
    size_t n = strlen(s);
    static const char suffix[] = ".safetensors";
    return n > sizeof suffix - 1 && n <= MAX_SHARD_NAME && !strchr(s, '/') && !strchr(s, '\\') && s[0] != '.' &&
           !strcmp(s + n - (sizeof suffix - 1), suffix);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int parse_weight_map(k3_jc *j, index_map *m, ntab *shard_tab)
{
    int rc;
    uint64_t cap = 1024;
    uint32_t last = 0;
    k3_jc_ws(j);
    if (j->p >= j->end || *j->p != '{')
        return k3_jc_fail(j, NULL, K3_EFORMAT, "weight_map must be an object, found %s", k3_jc_kind(j));
    j->p++;
    m->entries = malloc(cap * sizeof *m->entries);
    m->shard_names = malloc(K3_ST_MAX_SHARDS * sizeof *m->shard_names);
    if (!m->entries || !m->shard_names || ntab_init(shard_tab, K3_ST_MAX_SHARDS))
        return k3_err_set(j->e, K3_ENOMEM, "%s: out of memory", j->file);
    k3_jc_ws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        return 0;
    }
    for (;;) {
        k3_jc_ws(j);
        const uint8_t *kpos = j->p;
        char *name = (char *)j->p;
        size_t nlen;
        /* in place: the decoded string lands where its quote was */
        if ((rc = k3_jc_string(j, name, (size_t)(j->end - j->p), &nlen, "tensor name")))
            return rc;
        if (nlen == 0)
            return k3_jc_fail(j, kpos, K3_EFORMAT, "empty tensor name");
        if (nlen > K3_ST_MAX_NAME)
            return k3_jc_fail(j, kpos, K3_EFORMAT, "tensor name is longer than %u bytes", K3_ST_MAX_NAME);
        if ((rc = k3_jc_expect(j, ':', "after a tensor name")))
            return rc;
        j->tensor = name;
        k3_jc_ws(j);
        const uint8_t *vpos = j->p;
        char *sname = (char *)j->p;
        size_t slen;
        if ((rc = k3_jc_string(j, sname, (size_t)(j->end - j->p), &slen, "shard name")))
            return rc;
        if (!shard_name_ok(sname))
            return k3_jc_fail(j, vpos, K3_EFORMAT,
                              "shard name \"%.300s\" is not a plain file name ending in .safetensors", sname);
        if (m->count == cap) {
            if (cap >= K3_ST_MAX_TENSORS)
                return k3_jc_fail(j, kpos, K3_ELIMIT, "more than %llu tensors", (unsigned long long)K3_ST_MAX_TENSORS);
            cap *= 2;
            index_entry *ne = realloc(m->entries, cap * sizeof *ne);
            if (!ne)
                return k3_err_set(j->e, K3_ENOMEM, "%s: out of memory", j->file);
            m->entries = ne;
        }
        /* consecutive entries mostly name the same shard */
        int64_t s = m->nshards && !strcmp(m->shard_names[last], sname) ? (int64_t)last
                                                                         : ntab_find(shard_tab, sname);
        if (s < 0) {
            if (m->nshards == K3_ST_MAX_SHARDS)
                return k3_jc_fail(j, vpos, K3_ELIMIT, "more than %u shards", K3_ST_MAX_SHARDS);
            s = m->nshards;
            m->shard_names[m->nshards++] = sname;
            ntab_insert(shard_tab, sname, (uint32_t)s);
        }
        last = (uint32_t)s;
        m->entries[m->count].tensor = name;
        m->entries[m->count].shard = (uint32_t)s;
        m->entries[m->count].pos = (uint64_t)(kpos - j->start);
        m->count++;
        j->tensor = NULL;
        k3_jc_ws(j);
        if (j->p < j->end && *j->p == '}') {
            j->p++;
            return 0;
        }
        if ((rc = k3_jc_expect(j, ',', "or '}' in weight_map")))
            return rc;
    }
}

static int index_load(index_map *m, const char *path, k3_err *e)
{
    uint64_t len;
    int rc = k3_io_read_file(path, K3_ST_MAX_INDEX, &m->text, &len, e);
    if (rc)
        return rc;
    ntab shard_tab = {0};
    k3_jc j = {.start = (uint8_t *)m->text, .p = (uint8_t *)m->text, .end = (uint8_t *)m->text + len, .file = path, .e = e};
    int have_map = 0;
    k3_jc_ws(&j);
    if (j.p >= j.end || *j.p != '{') {
        rc = k3_jc_fail(&j, NULL, K3_EFORMAT, "index is not a JSON object (found %s)", k3_jc_kind(&j));
        goto out;
    }
    j.p++;
    k3_jc_ws(&j);
    if (j.p < j.end && *j.p == '}') {
        j.p++;
    } else {
        for (;;) {
            char key[64];
            k3_jc_ws(&j);
            const uint8_t *kpos = j.p;
            rc = k3_jc_string(&j, key, sizeof key, NULL, "index key");
            if (rc == K3_ELIMIT) {
                k3_err_clear(e);
                key[0] = '\0';
                j.p = kpos;
                rc = k3_jc_string(&j, NULL, 0, NULL, "index key");
            }
            if (rc || (rc = k3_jc_expect(&j, ':', "after a key")))
                goto out;
            if (!strcmp(key, "weight_map")) {
                if (have_map++) {
                    rc = k3_jc_fail(&j, kpos, K3_EFORMAT, "weight_map given twice");
                    goto out;
                }
                if ((rc = parse_weight_map(&j, m, &shard_tab)))
                    goto out;
            } else if ((rc = k3_jc_skip(&j))) {
                goto out;
            }
            k3_jc_ws(&j);
            if (j.p < j.end && *j.p == '}') {
                j.p++;
                break;
            }
            if ((rc = k3_jc_expect(&j, ',', "or '}' in the index")))
                goto out;
        }
    }
    k3_jc_ws(&j);
    if (j.p != j.end) {
        rc = k3_jc_fail(&j, NULL, K3_EFORMAT, "bytes after the index JSON");
        goto out;
    }
    if (!have_map) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: no weight_map object", path);
        goto out;
    }
    if (m->nshards == 0) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: weight_map is empty", path);
        goto out;
    }
    /* shards in name order; entries follow */
    {
        const char **sorted = malloc(m->nshards * sizeof *sorted);
        uint32_t *remap = malloc(m->nshards * sizeof *remap);
        if (!sorted || !remap) {
            free(sorted);
            free(remap);
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
            goto out;
        }
        memcpy(sorted, m->shard_names, m->nshards * sizeof *sorted);
        qsort(sorted, m->nshards, sizeof *sorted, cmp_str);
        for (uint32_t i = 0; i < m->nshards; i++)
            remap[ntab_find(&shard_tab, sorted[i])] = i;
        for (uint64_t i = 0; i < m->count; i++)
            m->entries[i].shard = remap[m->entries[i].shard];
        memcpy(m->shard_names, sorted, m->nshards * sizeof *sorted);
        free(sorted);
        free(remap);
    }
out:
    ntab_free(&shard_tab);
    return rc;
}

static int has_suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && !strcmp(s + n - k, suf);
}

/* The sorted *.safetensors file names in dir (heap array of heap strings). */
static int list_shards(const char *dir, char ***names, uint32_t *count, k3_err *e)
{
    *names = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, errno == ENOENT ? K3_ENOENT : K3_EIO, errno, "%s: cannot open directory", dir);
    uint32_t cap = 16, n = 0;
    char **v = malloc(cap * sizeof *v);
    int rc = v ? 0 : k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, ".safetensors"))
            continue;
        if (n == K3_ST_MAX_SHARDS) {
            rc = k3_err_set(e, K3_ELIMIT, "%s: more than %u *.safetensors files", dir, K3_ST_MAX_SHARDS);
            break;
        }
        if (n == cap) {
            char **nv = realloc(v, 2 * cap * sizeof *v);
            if (!nv) {
                rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
                break;
            }
            v = nv;
            cap *= 2;
        }
        if (!(v[n] = strdup(de->d_name))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            break;
        }
        n++;
    }
    closedir(d);
    if (rc) {
        for (uint32_t i = 0; i < n; i++)
            free(v[i]);
        free(v);
        return rc;
    }
    qsort(v, n, sizeof *v, cmp_str);
    *names = v;
    *count = n;
    return 0;
}

static void free_names(char **v, uint32_t n)
{
    if (!v)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

/* One shard opened and its header parsed: the parallel part of k3_st_open.
 * On error the fd stays in s (closed with the k3_st). */
typedef struct shard_load {
    k3_st_header h;
    k3_err err;
    int rc;
} shard_load;

static void load_shard(shard *s, shard_load *l, unsigned flags)
{
    k3_err_clear(&l->err);
    int fd = k3_io_open_read(s->path, (flags & K3_ST_DIRECT) != 0, &s->direct, &l->err);
    if (fd < 0) {
        l->rc = fd;
        return;
    }
    s->fd = fd;
    l->rc = k3_io_file_size(fd, &s->size, s->path, &l->err);
    if (!l->rc)
        l->rc = k3_st_header_read(&l->h, fd, s->path, &l->err);
    if (!l->rc)
        s->data_start = l->h.data_start;
}

/* The parallel phase of k3_st_open: job 0 is the index (if any), jobs 1..n
 * the shards. Plain threads that exit when the work is done (an OpenMP team
 * would leave threads spinning after every open, which costs a loaded
 * machine more than the parsing). */
typedef struct open_job {
    k3_st *st;
    shard_load *loads;
    unsigned flags;
    uint32_t nfiles;
    int have_index;
    index_map *m;
    const char *index_path;
    k3_err *index_err;
    int *index_rc;
    uint32_t next; /* atomic */
} open_job;

static void *open_worker(void *arg)
{
    open_job *j = arg;
    for (;;) {
        uint32_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k == 0) {
            if (j->have_index)
                *j->index_rc = index_load(j->m, j->index_path, j->index_err);
        } else if (k - 1 < j->nfiles) {
            load_shard(&j->st->shards[k - 1], &j->loads[k - 1], j->flags);
        } else {
            return NULL;
        }
    }
}

static void run_open_jobs(open_job *j)
{
    /* OMP_NUM_THREADS, as everywhere in k3, else the CPU count */
    long cpus = omp_get_max_threads();
    uint32_t jobs = j->nfiles + (j->have_index ? 1 : 0);
    uint32_t nthreads = cpus > 1 ? (uint32_t)(cpus < 16 ? cpus : 16) : 1;
    if (nthreads > jobs)
        nthreads = jobs ? jobs : 1;
    /* Fault injection (K3_FAULT) counts reads in a process-wide record: keep
     * it deterministic and race-free by loading shards one by one when it is
     * armed. A zero-byte read makes the hook load its settings now, before
     * any thread could race to do it. */
    const char *fault = getenv("K3_FAULT");
    if (fault && *fault)
        nthreads = 1;
    k3_io_pread(-1, NULL, 0, 0, "", NULL);
    pthread_t tid[16];
    uint32_t started = 0;
    for (uint32_t t = 1; t < nthreads; t++)
        if (pthread_create(&tid[started], NULL, open_worker, j) == 0)
            started++;
    open_worker(j); /* the caller works too; if no thread started it does all */
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
}

/* Append the parsed shards to st in shard order; the first failed shard (in
 * name order, whatever order the threads finished in) is the error. */
static int merge_shards(k3_st *st, shard_load *loads, k3_err *e)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < st->nshards; i++) {
        if (loads[i].rc) {
            if (e && !e->code)
                *e = loads[i].err;
            return loads[i].rc;
        }
        total += loads[i].h.count;
    }
    if (total > K3_ST_MAX_TENSORS)
        return k3_err_set(e, K3_ELIMIT, "%s: the checkpoint has %" PRIu64 " tensors, more than %llu",
                          st->shards[0].path, total, (unsigned long long)K3_ST_MAX_TENSORS);
    st->tensors = malloc((total ? total : 1) * sizeof *st->tensors);
    if (!st->tensors)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory for %" PRIu64 " tensors", st->shards[0].path, total);
    for (uint32_t i = 0; i < st->nshards; i++) {
        k3_st_header *h = &loads[i].h;
        for (uint64_t k = 0; k < h->count; k++) {
            h->tensors[k].shard = i;
            st->tensors[st->count + k] = h->tensors[k];
        }
        st->count += h->count;
        st->shards[i].names = h->names;
        h->names = NULL;
        k3_st_header_free(h);
    }
    return 0;
}

/* The index and the shards must list the same tensors in the same shards.
 * Each index entry is looked up in the checkpoint table; a tensor found twice
 * is a duplicate index entry, a tensor never found is missing from the index. */
static int check_against_index(k3_st *st, const index_map *m, const char *index_path, k3_err *e)
{
    uint8_t *seen = calloc((size_t)st->count + 1, 1);
    if (!seen)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", index_path);
    int rc = 0;
    uint64_t matched = 0;
    hash_ring ring;
    for (uint64_t k = 0; k < m->count && k < PREFETCH_AHEAD; k++)
        ring_push(&ring, &st->table, m->entries[k].tensor, k);
    for (uint64_t k = 0; k < m->count && !rc; k++) {
        const index_entry *x = &m->entries[k];
        uint32_t h = ring.h[k % PREFETCH_AHEAD];
        if (k + PREFETCH_AHEAD < m->count)
            ring_push(&ring, &st->table, m->entries[k + PREFETCH_AHEAD].tensor, k + PREFETCH_AHEAD);
        int64_t i = ntab_find_h(&st->table, x->tensor, h);
        if (i < 0)
            rc = k3_err_set(e, K3_ENOENT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is listed for %s but missing from it",
                            index_path, x->pos, x->tensor, m->shard_names[x->shard]);
        else if (seen[i])
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": listed twice in weight_map",
                            index_path, x->pos, x->tensor);
        else if (st->tensors[i].shard != x->shard)
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\": the index puts it in %s, it is in %s",
                            index_path, x->pos, x->tensor, m->shard_names[x->shard],
                            st->shards[st->tensors[i].shard].name);
        else
            seen[i] = 1, matched++;
    }
    for (uint64_t i = 0; !rc && matched < st->count && i < st->count; i++)
        if (!seen[i])
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is in the shard but not in %s",
                            st->shards[st->tensors[i].shard].path, st->tensors[i].offset, st->tensors[i].name,
                            INDEX_NAME);
    free(seen);
    return rc;
}

int k3_st_open(k3_st **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return k3_err_sys(e, errno == ENOENT ? K3_ENOENT : K3_EIO, errno, "%s: cannot open", dir);
    k3_st *st = calloc(1, sizeof *st);
    if (!st)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
    int rc = 0, have_index = 0, index_rc = 0;
    index_map m = {0};
    k3_err index_err = {0};
    char **files = NULL;
    uint32_t nfiles = 0;
    shard_load *loads = NULL;
    char index_path[4096] = "";

    /* the shards: the file itself, or the directory's *.safetensors in name
     * order (with an index, these must be exactly the files it names) */
    if (!S_ISDIR(sb.st_mode)) {
        nfiles = 1;
        if (!(files = malloc(sizeof *files)) || !(files[0] = strdup(dir))) {
            nfiles = 0;
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            goto out;
        }
    } else {
        if ((rc = list_shards(dir, &files, &nfiles, e)))
            goto out;
        if ((rc = k3_io_path_join(index_path, sizeof index_path, dir, INDEX_NAME, e)))
            goto out;
        have_index = access(index_path, F_OK) == 0;
        if (!have_index && nfiles == 0) {
            rc = k3_err_set(e, K3_ENOENT, "%s: no *.safetensors files and no %s", dir, INDEX_NAME);
            goto out;
        }
    }
    st->shards = calloc(nfiles ? nfiles : 1, sizeof *st->shards);
    loads = calloc(nfiles ? nfiles : 1, sizeof *loads);
    if (!st->shards || !loads) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
        goto out;
    }
    for (uint32_t i = 0; i < nfiles; i++) {
        shard *s = &st->shards[i];
        s->fd = -1;
        st->nshards++;
        char path[4096];
        if (S_ISDIR(sb.st_mode) && (rc = k3_io_path_join(path, sizeof path, dir, files[i], e)))
            goto out;
        if (!(s->path = strdup(S_ISDIR(sb.st_mode) ? path : dir))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", dir);
            goto out;
        }
        const char *slash = strrchr(s->path, '/');
        s->name = slash ? slash + 1 : s->path;
    }

    /* the index and every header are parsed in parallel (headers are most
     * of the work: 76 MB of JSON for K3); results are used in a fixed order */
    {
        open_job job = {.st = st, .loads = loads, .flags = flags, .nfiles = nfiles, .have_index = have_index,
                        .m = &m, .index_path = index_path, .index_err = &index_err, .index_rc = &index_rc};
        run_open_jobs(&job);
    }

    if (have_index) {
        if (index_rc) {
            *e = index_err;
            rc = index_rc;
            goto out;
        }
        /* the index names exactly the shard files present */
        for (uint32_t i = 0; i < m.nshards; i++) {
            const char *key = m.shard_names[i];
            if (!bsearch(&key, files, nfiles, sizeof *files, cmp_str)) {
                rc = k3_err_set(e, K3_ENOENT, "%s/%s: shard named by %s is missing", dir, key, INDEX_NAME);
                goto out;
            }
        }
        for (uint32_t i = 0; i < nfiles; i++) {
            const char *key = files[i];
            if (!bsearch(&key, m.shard_names, m.nshards, sizeof *m.shard_names, cmp_str)) {
                rc = k3_err_set(e, K3_EFORMAT, "%s/%s: shard file is not referenced by %s", dir, files[i], INDEX_NAME);
                goto out;
            }
        }
        /* same sorted sets: shard numbers agree between index and files */
    }
    if ((rc = merge_shards(st, loads, e)))
        goto out;

    /* one table for the whole checkpoint */
    if (ntab_init(&st->table, st->count)) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory for the tensor table", dir);
        goto out;
    }
    hash_ring ring;
    for (uint64_t i = 0; i < st->count && i < PREFETCH_AHEAD; i++)
        ring_push(&ring, &st->table, st->tensors[i].name, i);
    for (uint64_t i = 0; i < st->count; i++) {
        uint32_t h = ring.h[i % PREFETCH_AHEAD];
        if (i + PREFETCH_AHEAD < st->count)
            ring_push(&ring, &st->table, st->tensors[i + PREFETCH_AHEAD].name, i + PREFETCH_AHEAD);
        int64_t prev = ntab_insert_h(&st->table, st->tensors[i].name, h, (uint32_t)i);
        if (prev >= 0) {
            const k3_st_tensor *t = &st->tensors[i], *p = &st->tensors[prev];
            rc = k3_err_set(e, K3_EFORMAT, "%s: byte %" PRIu64 ": tensor \"%.200s\" is also in %s (byte %" PRIu64 ")",
                            st->shards[t->shard].path, t->offset, t->name, st->shards[p->shard].name, p->offset);
            goto out;
        }
    }
    if (have_index && (rc = check_against_index(st, &m, index_path, e)))
        goto out;
out:
    if (loads)
        for (uint32_t i = 0; i < nfiles; i++)
            k3_st_header_free(&loads[i].h);
    free(loads);
    index_free(&m);
    free_names(files, nfiles);
    if (rc) {
        k3_st_close(st);
        return rc;
    }
    *out = st;
    return 0;
}

uint64_t k3_st_tensor_count(const k3_st *st)
{
    return st->count;
}

const k3_st_tensor *k3_st_tensor_at(const k3_st *st, uint64_t i)
{
    return i < st->count ? &st->tensors[i] : NULL;
}

const k3_st_tensor *k3_st_find(const k3_st *st, const char *name)
{
    int64_t i = ntab_find(&st->table, name);
    return i < 0 ? NULL : &st->tensors[i];
}

uint32_t k3_st_shard_count(const k3_st *st)
{
    return st->nshards;
}

const char *k3_st_shard_path(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].path : NULL;
}

const char *k3_st_shard_name(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].name : NULL;
}

uint64_t k3_st_shard_size(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].size : 0;
}

int k3_st_shard_fd(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].fd : -1;
}

int k3_st_shard_is_direct(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].direct : 0;
}

uint64_t k3_st_shard_data_start(const k3_st *st, uint32_t i)
{
    return i < st->nshards ? st->shards[i].data_start : 0;
}

int k3_st_read_range_bounce(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n, void *dst,
                            void *bounce, uint64_t bounce_cap, k3_err *e)
{
    if (!t || t->shard >= st->nshards)
        return k3_err_set(e, K3_EARG, "k3_st_read: tensor does not belong to this checkpoint");
    const shard *s = &st->shards[t->shard];
    if (off > t->nbytes || n > t->nbytes - off)
        return k3_err_set(e, K3_EARG, "%s: tensor \"%.200s\": range [%" PRIu64 ", +%" PRIu64 ") is outside its %" PRIu64
                          " bytes", s->path, t->name, off, n, t->nbytes);
    if (n == 0)
        return 0;
    uint64_t at = t->offset + off;
    if (!s->direct)
        return k3_io_pread(s->fd, dst, n, at, s->path, e);
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    if ((uintptr_t)dst % A == 0 && at % A == 0 && n % A == 0)
        return k3_io_pread_direct(s->fd, dst, n, at, NULL, 0, s->path, e);
    /* unaligned: aligned pieces through a bounce buffer, the caller's or
     * one sized for this read (at most DIRECT_CHUNK + 2 blocks) */
    void *own = NULL;
    if (bounce) {
        if ((uintptr_t)bounce % A || bounce_cap < 3 * A)
            return k3_err_set(e, K3_EARG, "%s: bounce buffer must be %" PRIu64 "-aligned and hold 3 blocks", s->path, A);
    } else {
        bounce_cap = (n < DIRECT_CHUNK ? (n + A - 1) / A * A : DIRECT_CHUNK) + 2 * A;
        bounce = own = k3_io_alloc_aligned(bounce_cap, A);
        if (!bounce)
            return k3_err_set(e, K3_ENOMEM, "%s: out of memory for a read buffer", s->path);
    }
    /* a piece of `chunk` bytes at any offset widens to at most chunk + 2 blocks */
    uint64_t chunk = (bounce_cap - 2 * A) / A * A;
    int rc = 0;
    for (uint64_t done = 0; !rc && done < n;) {
        uint64_t k = n - done < chunk ? n - done : chunk;
        rc = k3_io_pread_direct(s->fd, (char *)dst + done, k, at + done, bounce, bounce_cap, s->path, e);
        done += k;
    }
    k3_io_free_aligned(own);
    return rc;
}

int k3_st_read_range(const k3_st *st, const k3_st_tensor *t, uint64_t off, uint64_t n, void *dst, k3_err *e)
{
    return k3_st_read_range_bounce(st, t, off, n, dst, NULL, 0, e);
}

int k3_st_read(const k3_st *st, const k3_st_tensor *t, void *dst, k3_err *e)
{
    return k3_st_read_range(st, t, 0, t ? t->nbytes : 0, dst, e);
}
