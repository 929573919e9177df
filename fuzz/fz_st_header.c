/*
 * fz_st_header.c - one safetensors shard header (k3_st_header_read and
 * k3_st_header_parse).
 *
 * Input: either a whole shard file (u64 little-endian header length, header
 * JSON, data), read through an in-memory file so the length prefix is fuzzed
 * too; or, when the input starts with '{', the header JSON alone, parsed as if
 * followed by 4096 bytes of data (mutations that change the JSON's length then
 * stay meaningful).
 *
 * Beyond "no crash, no leak", an accepted header must keep the reader's
 * promises: every tensor lies inside the file after the header, its byte size
 * is shape x dtype size, the dtype and rank are in range, names are non-empty
 * and unique, and no two tensors overlap.
 */
#include "k3_fuzz.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "k3_st.h"

#define JSON_TAIL 4096u

static int by_offset(const void *a, const void *b)
{
    const k3_st_tensor *x = *(const k3_st_tensor *const *)a, *y = *(const k3_st_tensor *const *)b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

static int by_name(const void *a, const void *b)
{
    return strcmp((*(const k3_st_tensor *const *)a)->name, (*(const k3_st_tensor *const *)b)->name);
}

static void check_header(const k3_st_header *h, uint64_t file_size)
{
    if (h->data_start < 8 || h->data_start > file_size)
        k3_fuzz_fail("data_start %llu outside a %llu-byte file", (unsigned long long)h->data_start,
                     (unsigned long long)file_size);
    if (h->count && !h->tensors)
        k3_fuzz_fail("%llu tensors but no array", (unsigned long long)h->count);
    const k3_st_tensor **order = malloc((h->count ? h->count : 1) * sizeof *order);
    if (!order)
        k3_fuzz_fail("out of memory in the harness");
    for (uint64_t i = 0; i < h->count; i++) {
        const k3_st_tensor *t = &h->tensors[i];
        order[i] = t;
        if (!t->name || !t->name[0])
            k3_fuzz_fail("tensor %llu has no name", (unsigned long long)i);
        if ((unsigned)t->dtype >= K3_DT_COUNT || t->ndim > K3_ST_MAX_DIMS)
            k3_fuzz_fail("%s: dtype %d / rank %u out of range", t->name, (int)t->dtype, t->ndim);
        unsigned __int128 bytes = k3_dtype_size(t->dtype);
        for (uint32_t d = 0; d < t->ndim; d++) {
            bytes *= t->shape[d];
            if (bytes > file_size)
                bytes = (unsigned __int128)file_size + 1; /* saturate: already wrong */
        }
        if (bytes != t->nbytes)
            k3_fuzz_fail("%s: nbytes %llu is not shape x dtype", t->name,
                         (unsigned long long)t->nbytes);
        if (t->offset < h->data_start || t->offset > file_size || t->nbytes > file_size - t->offset)
            k3_fuzz_fail("%s: [%llu, +%llu) is outside the data of a %llu-byte file", t->name,
                         (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                         (unsigned long long)file_size);
    }
    qsort(order, h->count, sizeof *order, by_offset);
    for (uint64_t i = 1; i < h->count; i++)
        if (order[i - 1]->nbytes && order[i]->nbytes &&
            order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
            k3_fuzz_fail("%s and %s overlap", order[i - 1]->name, order[i]->name);
    qsort(order, h->count, sizeof *order, by_name);
    for (uint64_t i = 1; i < h->count; i++)
        if (!strcmp(order[i - 1]->name, order[i]->name))
            k3_fuzz_fail("duplicate name %s accepted", order[i]->name);
    free(order);
}

K3_FUZZ_TARGET(st_header)
{
    k3_st_header h;
    k3_err e = {0};
    int rc;
    uint64_t file_size;
    memset(&h, 0, sizeof h);
    if (size > 0 && data[0] == '{') {
        file_size = 8 + (uint64_t)size + JSON_TAIL;
        rc = k3_st_header_parse(&h, "fuzz.safetensors", data, size, file_size, &e);
        k3_fuzz_check_result(rc, &e, "k3_st_header_parse");
    } else {
        int fd = k3_fuzz_memfd(data, size);
        file_size = size;
        rc = k3_st_header_read(&h, fd, "fuzz.safetensors", &e);
        close(fd);
        k3_fuzz_check_result(rc, &e, "k3_st_header_read");
    }
    if (rc == 0) {
        check_header(&h, file_size);
        k3_st_header_free(&h);
    }
    return 0;
}
