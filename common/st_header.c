/*
 * st_header.c - one safetensors shard header: dtypes, parsing and full
 * validation (the invariants of common/st.c: known dtypes, at most
 * K3_ST_MAX_DIMS dims, exact byte sizes, tensors tiling the data area), and
 * reading it from a shard file.
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
#include "st_ntab.h"

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
