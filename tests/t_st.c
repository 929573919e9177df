/*
 * t_st.c - the safetensors reader: every dtype, single file, multi-shard with
 * and without an index, byte ranges buffered and O_DIRECT, and hostile
 * headers and indexes, each rejected with its own message naming the file
 * and the byte offset.
 *
 * Shards are written here by a tiny helper (raw header text + patterned
 * data); the real writer lives elsewhere and is not used, so these tests
 * check the reader against the format, not against our own writer.
 */
#include "k3_io.h"
#include "k3_st.h"
#include "k3_test.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers -------------------------------------------------------------- */

static uint8_t pattern(const char *name, uint64_t k)
{
    uint32_t h = 2166136261u;
    for (; *name; name++)
        h = (h ^ (uint8_t)*name) * 16777619u;
    return (uint8_t)(h + k * 13 + (k >> 8) * 7);
}

/* Write u64 len (declared) + hdr + data_len bytes of data. When names is given
 * (n tensors with their data offsets) the data follows pattern(). */
static void write_raw(const char *path, uint64_t declared, const char *hdr, size_t hdr_len, uint64_t data_len,
                      const char **names, const uint64_t *begins, int n)
{
    size_t total = 8 + hdr_len + data_len;
    uint8_t *buf = calloc(1, total ? total : 1);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(declared >> (8 * i));
    memcpy(buf + 8, hdr, hdr_len);
    uint8_t *data = buf + 8 + hdr_len;
    for (int t = 0; t < n; t++) {
        uint64_t end = t + 1 < n ? begins[t + 1] : data_len;
        for (uint64_t k = begins[t]; k < end; k++)
            data[k] = pattern(names[t], k - begins[t]);
    }
    k3_err e = {0};
    int rc = k3_io_write_file_atomic(path, buf, total, &e);
    if (rc)
        k3t_fail(__FILE__, __LINE__, "writing %s: %s", path, e.msg);
    free(buf);
}

static void write_bad(const char *path, const char *hdr, uint64_t data_len)
{
    write_raw(path, strlen(hdr), hdr, strlen(hdr), data_len, NULL, NULL, 0);
}

typedef struct tspec {
    const char *name;
    const char *dtype;
    int nd;
    uint64_t shape[4];
} tspec;

static uint64_t spec_bytes(const tspec *t)
{
    k3_dtype d;
    if (k3_dtype_from_name(t->dtype, &d))
        k3t_fail(__FILE__, __LINE__, "bad dtype in test spec");
    uint64_t n = k3_dtype_size(d);
    for (int i = 0; i < t->nd; i++)
        n *= t->shape[i];
    return n;
}

/* A valid shard holding tensors in the given order, header space-padded to a
 * multiple of 8 as common writers do. */
static void write_shard(const char *path, const tspec *ts, int n)
{
    char *hdr = malloc(65536);
    size_t len = 0;
    uint64_t off = 0;
    const char *names[64];
    uint64_t begins[64];
    len += (size_t)sprintf(hdr + len, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        uint64_t nb = spec_bytes(&ts[i]);
        len += (size_t)sprintf(hdr + len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name, ts[i].dtype);
        for (int d = 0; d < ts[i].nd; d++)
            len += (size_t)sprintf(hdr + len, "%s%llu", d ? "," : "", (unsigned long long)ts[i].shape[d]);
        len += (size_t)sprintf(hdr + len, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                               (unsigned long long)(off + nb));
        names[i] = ts[i].name;
        begins[i] = off;
        off += nb;
    }
    hdr[len++] = '}';
    while (len % 8)
        hdr[len++] = ' ';
    write_raw(path, len, hdr, len, off, names, begins, n);
    free(hdr);
}

static void write_text(const char *path, const char *text)
{
    k3_err e = {0};
    CHECK_EQ_INT(k3_io_write_file_atomic(path, text, strlen(text), &e), 0);
}

static char *pathf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *pathf(const char *fmt, ...)
{
    static char bufs[8][4096];
    static int next;
    char *b = bufs[next++ % 8];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, 4096, fmt, ap);
    va_end(ap);
    return b;
}

static void check_tensor_bytes(const k3_st *st, const char *name, int direct)
{
    k3_err e = {0};
    const k3_st_tensor *t = k3_st_find(st, name);
    CHECK(t != NULL);
    uint8_t *buf = direct ? k3_io_alloc_aligned(t->nbytes + 4096, 4096) : malloc(t->nbytes + 1);
    CHECK_EQ_INT(k3_st_read(st, t, buf, &e), 0);
    for (uint64_t k = 0; k < t->nbytes; k++)
        if (buf[k] != pattern(name, k))
            k3t_fail(__FILE__, __LINE__, "%s byte %llu: %u != %u", name, (unsigned long long)k, buf[k], pattern(name, k));
    if (direct)
        k3_io_free_aligned(buf);
    else
        free(buf);
}

static const tspec all_dtypes[] = {
    {"a.bf16", "BF16", 2, {3, 5}},  {"b.f16", "F16", 1, {7}},      {"c.f32", "F32", 3, {2, 3, 4}},
    {"d.u8", "U8", 2, {4, 33}},     {"e.i8", "I8", 1, {9}},        {"f.i32", "I32", 2, {3, 3}},
    {"g.f8e4m3", "F8_E4M3", 1, {17}}, {"h.f8e5m2", "F8_E5M2", 2, {2, 2}}, {"i.scalar", "F32", 0, {0}},
    {"j.empty", "BF16", 2, {0, 4}},
};

/* ---- valid checkpoints ---------------------------------------------------- */

K3_TEST(st_reads_every_dtype_from_a_single_file)
{
    const char *path = pathf("%s/model.safetensors", k3t_tmpdir());
    int n = (int)(sizeof all_dtypes / sizeof all_dtypes[0]);
    write_shard(path, all_dtypes, n);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), 0);
    CHECK_EQ_U64(k3_st_tensor_count(st), n);
    CHECK_EQ_INT(k3_st_shard_count(st), 1);
    CHECK_STR_EQ(k3_st_shard_name(st, 0), "model.safetensors");
    for (int i = 0; i < n; i++) {
        const k3_st_tensor *t = k3_st_find(st, all_dtypes[i].name);
        CHECK(t != NULL);
        CHECK_STR_EQ(k3_dtype_name(t->dtype), all_dtypes[i].dtype);
        CHECK_EQ_INT(t->ndim, all_dtypes[i].nd);
        for (int d = 0; d < all_dtypes[i].nd; d++)
            CHECK_EQ_U64(t->shape[d], all_dtypes[i].shape[d]);
        CHECK_EQ_U64(t->nbytes, spec_bytes(&all_dtypes[i]));
        check_tensor_bytes(st, all_dtypes[i].name, 0);
    }
    /* sorted by offset, the first tensor right after the header */
    CHECK_EQ_U64(k3_st_tensor_at(st, 0)->offset, k3_st_shard_data_start(st, 0));
    for (uint64_t i = 1; i < k3_st_tensor_count(st); i++)
        CHECK(k3_st_tensor_at(st, i)->offset >= k3_st_tensor_at(st, i - 1)->offset + k3_st_tensor_at(st, i - 1)->nbytes);
    CHECK(k3_st_tensor_at(st, (uint64_t)n) == NULL);
    CHECK(k3_st_find(st, "nope") == NULL);
    CHECK(k3_st_find(st, "__metadata__") == NULL);
    k3_st_close(st);
    k3_st_close(NULL);
}

K3_TEST(st_dtype_names_round_trip_and_unknown_is_rejected)
{
    for (int i = 0; i < K3_DT_COUNT; i++) {
        k3_dtype t;
        CHECK_EQ_INT(k3_dtype_from_name(k3_dtype_name((k3_dtype)i), &t), 0);
        CHECK_EQ_INT(t, i);
    }
    k3_dtype t;
    CHECK_EQ_INT(k3_dtype_from_name("F64", &t), K3_EFORMAT);
    CHECK_EQ_INT(k3_dtype_size(K3_DT_BF16), 2);
    CHECK_EQ_INT(k3_dtype_size(K3_DT_I32), 4);
    CHECK_EQ_INT(k3_dtype_size(K3_DT_F8_E5M2), 1);
}

static const tspec shard_a[] = {{"model.embed_tokens.weight", "BF16", 2, {16, 8}}, {"model.norm.weight", "F32", 1, {8}}};
static const tspec shard_b[] = {{"model.layers.0.mlp.up_proj.weight", "BF16", 2, {4, 8}},
                                {"model.layers.0.experts.0.w1.weight_packed", "U8", 2, {4, 4}},
                                {"model.layers.0.experts.0.w1.weight_scale", "U8", 2, {4, 1}}};
static const tspec shard_c[] = {{"lm_head.weight", "BF16", 2, {16, 8}}};

static void write_three_shards(const char *dir)
{
    /* written out of name order on purpose */
    write_shard(pathf("%s/model-00003-of-00003.safetensors", dir), shard_c, 1);
    write_shard(pathf("%s/model-00001-of-00003.safetensors", dir), shard_a, 2);
    write_shard(pathf("%s/model-00002-of-00003.safetensors", dir), shard_b, 3);
}

static void write_index(const char *dir, const char *extra_entry, const char *skip)
{
    char text[8192];
    size_t len = (size_t)sprintf(text, "{\"metadata\": {\"total_size\": 123, \"x\": [1, {\"y\": null}]},\n \"weight_map\": {");
    const struct {
        const tspec *t;
        int n;
        const char *file;
    } sh[] = {{shard_a, 2, "model-00001-of-00003.safetensors"},
              {shard_b, 3, "model-00002-of-00003.safetensors"},
              {shard_c, 1, "model-00003-of-00003.safetensors"}};
    int first = 1;
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < sh[s].n; i++) {
            if (skip && !strcmp(skip, sh[s].t[i].name))
                continue;
            len += (size_t)sprintf(text + len, "%s\n  \"%s\": \"%s\"", first ? "" : ",", sh[s].t[i].name, sh[s].file);
            first = 0;
        }
    if (extra_entry)
        len += (size_t)sprintf(text + len, ",\n  %s", extra_entry);
    sprintf(text + len, "\n}}\n");
    write_text(pathf("%s/model.safetensors.index.json", dir), text);
}

static void check_three_shards(const char *dir, unsigned flags)
{
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, flags, &e), 0);
    CHECK_STR_EQ(e.msg, "");
    CHECK_EQ_INT(k3_st_shard_count(st), 3);
    CHECK_STR_EQ(k3_st_shard_name(st, 0), "model-00001-of-00003.safetensors");
    CHECK_STR_EQ(k3_st_shard_name(st, 2), "model-00003-of-00003.safetensors");
    CHECK_STR_CONTAINS(k3_st_shard_path(st, 1), "/model-00002-of-00003.safetensors");
    CHECK_EQ_U64(k3_st_tensor_count(st), 6);
    const k3_st_tensor *t = k3_st_find(st, "model.layers.0.experts.0.w1.weight_scale");
    CHECK(t != NULL);
    CHECK_EQ_INT(t->shard, 1);
    CHECK_EQ_INT(k3_st_find(st, "lm_head.weight")->shard, 2);
    /* (shard, offset) order */
    for (uint64_t i = 1; i < 6; i++) {
        const k3_st_tensor *p = k3_st_tensor_at(st, i - 1), *q = k3_st_tensor_at(st, i);
        CHECK(p->shard < q->shard || (p->shard == q->shard && p->offset < q->offset));
    }
    for (int i = 0; i < 2; i++)
        check_tensor_bytes(st, shard_a[i].name, (flags & K3_ST_DIRECT) != 0);
    for (int i = 0; i < 3; i++)
        check_tensor_bytes(st, shard_b[i].name, (flags & K3_ST_DIRECT) != 0);
    check_tensor_bytes(st, "lm_head.weight", (flags & K3_ST_DIRECT) != 0);
    CHECK(k3_st_shard_size(st, 0) > k3_st_shard_data_start(st, 0));
    CHECK(k3_st_shard_fd(st, 0) >= 0);
    k3_st_close(st);
}

K3_TEST(st_opens_multi_shard_dir_without_index_in_name_order)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_text(pathf("%s/config.json", dir), "{}"); /* other files are ignored */
    check_three_shards(dir, 0);
}

K3_TEST(st_opens_multi_shard_dir_with_index)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, NULL);
    check_three_shards(dir, 0);
}

/* The Hugging Face cache layout: the snapshot holds symlinks to blobs. */
K3_TEST(st_opens_a_snapshot_of_symlinked_shards)
{
    const char *root = k3t_tmpdir();
    char blobs[4096], snap[4096];
    snprintf(blobs, sizeof blobs, "%s/blobs", root);
    snprintf(snap, sizeof snap, "%s/snap", root);
    CHECK_EQ_INT(mkdir(blobs, 0755), 0);
    CHECK_EQ_INT(mkdir(snap, 0755), 0);
    write_three_shards(blobs);
    write_index(blobs, NULL, NULL);
    const char *names[] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "model.safetensors.index.json"};
    for (int i = 0; i < 4; i++)
        CHECK_EQ_INT(symlink(pathf("../blobs/%s", names[i]), pathf("%s/%s", snap, names[i])), 0);
    check_three_shards(snap, 0);
}

K3_TEST(st_opens_with_o_direct_and_reads_the_same_bytes)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, NULL);
    check_three_shards(dir, K3_ST_DIRECT);
}

/* A tensor spanning several 4 KiB blocks, read in ranges that start and end
 * everywhere, into aligned and unaligned buffers. */
static void check_ranges(unsigned flags)
{
    const char *path = pathf("%s/big.safetensors", k3t_tmpdir());
    const tspec ts[] = {{"small", "U8", 1, {13}}, {"big", "BF16", 2, {5, 2000}}, {"tail", "F32", 1, {3}}};
    write_shard(path, ts, 3);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, flags, &e), 0);
    if (flags & K3_ST_DIRECT)
        fprintf(stderr, "  (O_DIRECT %s on this filesystem)\n", k3_st_shard_is_direct(st, 0) ? "in use" : "refused");
    const k3_st_tensor *t = k3_st_find(st, "big");
    CHECK_EQ_U64(t->nbytes, 20000);
    uint8_t *buf = k3_io_alloc_aligned(32768, 4096);
    const uint64_t starts[] = {0, 1, 4095, 4096, 4097, 8000, 12288, 19999};
    const uint64_t lens[] = {0, 1, 7, 4096, 5000, 8192};
    for (size_t a = 0; a < sizeof starts / sizeof *starts; a++)
        for (size_t b = 0; b < sizeof lens / sizeof *lens; b++)
            for (int shift = 0; shift < 2; shift++) {
                uint64_t off = starts[a], n = lens[b];
                if (off + n > t->nbytes)
                    n = t->nbytes - off;
                uint8_t *dst = buf + shift * 3;
                memset(buf, 0xEE, 32768);
                CHECK_EQ_INT(k3_st_read_range(st, t, off, n, dst, &e), 0);
                for (uint64_t k = 0; k < n; k++)
                    if (dst[k] != pattern("big", off + k))
                        k3t_fail(__FILE__, __LINE__, "range %llu+%llu byte %llu", (unsigned long long)off,
                                 (unsigned long long)n, (unsigned long long)k);
                CHECK_EQ_INT(dst[n], 0xEE); /* nothing written past the range */
            }
    /* the whole tail tensor, which ends at EOF */
    CHECK_EQ_INT(k3_st_read(st, k3_st_find(st, "tail"), buf + 1, &e), 0);
    CHECK_EQ_INT(buf[1 + 11], pattern("tail", 11));
    /* ranges outside the tensor are refused, not clamped */
    CHECK_EQ_INT(k3_st_read_range(st, t, 19999, 2, buf, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "outside its 20000 bytes");
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_st_read_range(st, t, UINT64_MAX, 2, buf, &e), K3_EARG);
    k3_io_free_aligned(buf);
    k3_st_close(st);
}

K3_TEST(st_reads_byte_ranges_buffered)
{
    check_ranges(0);
}

K3_TEST(st_reads_byte_ranges_with_o_direct)
{
    check_ranges(K3_ST_DIRECT);
}

/* A range longer than the reader's O_DIRECT bounce chunk (4 MiB), unaligned
 * at both ends and in memory, so it is read in several pieces. */
K3_TEST(st_reads_a_long_unaligned_range_with_o_direct)
{
    const char *path = pathf("%s/long.safetensors", k3t_tmpdir());
    const tspec ts[] = {{"head", "U8", 1, {5}}, {"long", "BF16", 2, {1300, 2000}}};
    write_shard(path, ts, 2);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, K3_ST_DIRECT, &e), 0);
    const k3_st_tensor *t = k3_st_find(st, "long");
    uint64_t off = 4095, n = t->nbytes - off - 3;
    uint8_t *buf = malloc(n + 1);
    CHECK_EQ_INT(k3_st_read_range(st, t, off, n, buf + 1, &e), 0);
    for (uint64_t k = 0; k < n; k++)
        if (buf[1 + k] != pattern("long", off + k))
            k3t_fail(__FILE__, __LINE__, "byte %llu", (unsigned long long)k);
    /* the same through a small caller bounce buffer: many pieces */
    void *bounce = k3_io_alloc_aligned(3 * 4096, 4096);
    memset(buf, 0, n + 1);
    CHECK_EQ_INT(k3_st_read_range_bounce(st, t, off, n, buf + 1, bounce, 3 * 4096, &e), 0);
    for (uint64_t k = 0; k < n; k += 997)
        CHECK_EQ_INT(buf[1 + k], pattern("long", off + k));
    CHECK_EQ_INT(buf[n], pattern("long", off + n - 1));
    CHECK_EQ_INT(k3_st_read_range_bounce(st, t, off, n, buf + 1, bounce, 2 * 4096, &e), K3_EARG);
    k3_io_free_aligned(bounce);
    free(buf);
    k3_st_close(st);
}

K3_TEST(st_read_errors_from_the_disk_are_reported)
{
    const char *path = pathf("%s/victim.safetensors", k3t_tmpdir());
    const tspec ts[] = {{"w", "BF16", 2, {64, 64}}};
    write_shard(path, ts, 1);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), 0);
    const k3_st_tensor *t = k3_st_find(st, "w");
    setenv("K3_FAULT", "eio:victim.safetensors:3000", 1);
    k3_io_fault_reset();
    uint8_t *buf = malloc(t->nbytes);
    CHECK_EQ_INT(k3_st_read(st, t, buf, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "victim.safetensors");
    free(buf);
    k3_st_close(st);
    unsetenv("K3_FAULT");
    k3_io_fault_reset();
}

K3_TEST(st_accepts_empty_header_scalars_and_zero_size_tensors)
{
    const char *dir = k3t_tmpdir();
    write_bad(pathf("%s/a.safetensors", dir), "{}", 0);
    write_bad(pathf("%s/b.safetensors", dir),
              "{\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
              "\"z\":{\"dtype\":\"BF16\",\"shape\":[0,3],\"data_offsets\":[4,4]},"
              "\"__metadata__\":{}}   ", 4);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), 0);
    CHECK_EQ_U64(k3_st_tensor_count(st), 2);
    CHECK_EQ_INT(k3_st_find(st, "s")->ndim, 0);
    CHECK_EQ_U64(k3_st_find(st, "z")->nbytes, 0);
    uint8_t b[4];
    CHECK_EQ_INT(k3_st_read(st, k3_st_find(st, "z"), b, &e), 0);
    k3_st_close(st);
}

K3_TEST(st_accepts_tensors_listed_out_of_data_order_and_sorts_them)
{
    const char *path = pathf("%s/rev.safetensors", k3t_tmpdir());
    write_bad(path, "{\"c\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[5,8]},"
                    "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                    "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[2,5]}}", 8);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), 0);
    CHECK_STR_EQ(k3_st_tensor_at(st, 0)->name, "a");
    CHECK_STR_EQ(k3_st_tensor_at(st, 1)->name, "b");
    CHECK_STR_EQ(k3_st_tensor_at(st, 2)->name, "c");
    CHECK_EQ_U64(k3_st_find(st, "c")->offset, k3_st_shard_data_start(st, 0) + 5);
    k3_st_close(st);
    /* and a hole is still found when the order is scrambled */
    write_bad(path, "{\"c\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[5,8]},"
                    "\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                    "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}", 8);
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tensor \"c\": hole in the data: bytes [4, 5) belong to no tensor");
}

K3_TEST(st_decodes_escaped_and_unicode_names)
{
    const char *path = pathf("%s/u.safetensors", k3t_tmpdir());
    write_bad(path, "{\"caf\\u00e9.\\ud83d\\ude00.\\\"q\\\"\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                    "\"na\xc3\xafve\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), 0);
    CHECK(k3_st_find(st, "caf\xc3\xa9.\xf0\x9f\x98\x80.\"q\"") != NULL);
    CHECK(k3_st_find(st, "na\xc3\xafve") != NULL);
    k3_st_close(st);
}

/* The string scanner looks at eight bytes at a time: put each kind of
 * special byte at every position of a long name. */
K3_TEST(st_names_decode_the_same_whatever_the_position_of_special_bytes)
{
    const char *kinds[] = {"\\\"", "\\\\", "\xc3\xa9", "\\u00e9", "\x01", "\xff", "\x7f"};
    const char *decoded[] = {"\"", "\\", "\xc3\xa9", "\xc3\xa9", NULL, NULL, "\x7f"};
    for (int k = 0; k < 7; k++)
        for (int pos = 0; pos < 24; pos++) {
            char name[64], want[64], hdr[256];
            snprintf(name, sizeof name, "%.*s%s%.*s", pos, "abcdefghijklmnopqrstuvwxyz", kinds[k], 24 - pos,
                     "ABCDEFGHIJKLMNOPQRSTUVWXYZ");
            sprintf(hdr, "{\"%s\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", name);
            k3_st_header h;
            k3_err e = {0};
            int rc = k3_st_header_parse(&h, "mem", (const uint8_t *)hdr, strlen(hdr), 8 + strlen(hdr) + 4, &e);
            if (!decoded[k]) {
                CHECK_EQ_INT(rc, K3_EFORMAT);
                CHECK_STR_CONTAINS(e.msg, k == 4 ? "control byte 0x01" : "not valid UTF-8: byte 0xff");
                char at[32];
                snprintf(at, sizeof at, "byte %d:", 8 + 2 + pos);
                CHECK_STR_CONTAINS(e.msg, at);
                continue;
            }
            CHECK_EQ_INT(rc, 0);
            snprintf(want, sizeof want, "%.*s%s%.*s", pos, "abcdefghijklmnopqrstuvwxyz", decoded[k], 24 - pos,
                     "ABCDEFGHIJKLMNOPQRSTUVWXYZ");
            CHECK_STR_EQ(h.tensors[0].name, want);
            k3_st_header_free(&h);
        }
}

K3_TEST(st_header_parse_works_on_memory_and_header_read_on_an_fd)
{
    const char *hdr = "{\"x\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    k3_st_header h;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_header_parse(&h, "mem", (const uint8_t *)hdr, strlen(hdr), 8 + strlen(hdr) + 8, &e), 0);
    CHECK_EQ_U64(h.count, 1);
    CHECK_EQ_U64(h.data_start, 8 + strlen(hdr));
    CHECK_EQ_U64(h.tensors[0].offset, 8 + strlen(hdr));
    CHECK_STR_EQ(h.tensors[0].name, "x");
    k3_st_header_free(&h);
    k3_st_header_free(NULL);
    /* the same header against a file 1 byte too short */
    CHECK_EQ_INT(k3_st_header_parse(&h, "mem", (const uint8_t *)hdr, strlen(hdr), 8 + strlen(hdr) + 7, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "run past the data area");
    CHECK(h.tensors == NULL && h.names == NULL);

    const char *path = pathf("%s/one.safetensors", k3t_tmpdir());
    write_bad(path, hdr, 8);
    k3_err_clear(&e);
    int fd = open(path, O_RDONLY);
    CHECK_EQ_INT(k3_st_header_read(&h, fd, path, &e), 0);
    CHECK_EQ_U64(h.count, 1);
    k3_st_header_free(&h);
    close(fd);
}

/* ---- hostile shards ------------------------------------------------------- */

/* Write the header as a shard, open it both through k3_st_open and through
 * k3_st_header_parse, expect the same code and a message naming the file and
 * a byte offset plus the given substring. */
static void check_bad_header(const char *hdr, uint64_t data_len, int code, const char *substr)
{
    const char *path = pathf("%s/bad-shard.safetensors", k3t_tmpdir());
    write_bad(path, hdr, data_len);
    k3_st *st = (k3_st *)1;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), code);
    CHECK(st == NULL);
    CHECK_STR_CONTAINS(e.msg, "bad-shard.safetensors: byte ");
    CHECK_STR_CONTAINS(e.msg, substr);
    CHECK(strchr(e.msg, '\n') == NULL);
    k3_st_header h;
    k3_err e2 = {0};
    CHECK_EQ_INT(k3_st_header_parse(&h, "mem", (const uint8_t *)hdr, strlen(hdr), 8 + strlen(hdr) + data_len, &e2),
                 code);
    CHECK_STR_CONTAINS(e2.msg, substr);
}

#define BAD_HEADER(name, hdr, data_len, code, substr)                                \
    K3_TEST(st_rejects_##name)                                                       \
    {                                                                                \
        check_bad_header(hdr, data_len, code, substr);                               \
    }

#define E1(body) "{\"w\":{" body "}}"
#define OK_ENTRY "\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]"

BAD_HEADER(header_that_is_not_json, "hello world", 0, K3_EFORMAT, "it must start with '{'")
BAD_HEADER(header_that_is_an_array, "[1,2,3]", 0, K3_EFORMAT, "header is not a JSON object")
BAD_HEADER(header_with_leading_garbage_before_the_object, " {}", 0, K3_EFORMAT, "must start with '{'")
BAD_HEADER(truncated_json, "{\"w\":{\"dtype\":\"U8\",\"sha", 0, K3_EFORMAT, "unterminated string")
BAD_HEADER(json_missing_colon, "{\"w\" {}}", 0, K3_EFORMAT, "expected ':' after a tensor name")
BAD_HEADER(json_missing_comma_between_tensors, "{\"w\":{" OK_ENTRY "} \"v\":{}}", 4, K3_EFORMAT,
           "expected ',' or '}' after a tensor entry")
BAD_HEADER(invalid_utf8_in_a_name, "{\"w\xff\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "not valid UTF-8: byte 0xff")
BAD_HEADER(overlong_utf8_in_a_name, "{\"w\xc0\xaf\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "not valid UTF-8: byte 0xc0")
BAD_HEADER(overlong_three_byte_utf8_in_a_name, "{\"w\xe0\x80\xaf\":{" OK_ENTRY "}}", 4, K3_EFORMAT,
           "not valid UTF-8: byte 0xe0")
BAD_HEADER(utf8_above_u10ffff_in_a_name, "{\"w\xf4\x90\x80\x80\":{" OK_ENTRY "}}", 4, K3_EFORMAT,
           "not valid UTF-8: byte 0xf4")
BAD_HEADER(utf8_encoded_surrogate_in_a_name, "{\"w\xed\xa0\x80\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "not valid UTF-8")
BAD_HEADER(unpaired_surrogate_escape, "{\"w\\ud800x\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "unpaired surrogate")
BAD_HEADER(nul_escape_in_a_name, "{\"w\\u0000x\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "tensor name contains a NUL")
BAD_HEADER(raw_control_byte_in_a_string, "{\"w\x01\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "control byte 0x01")
BAD_HEADER(bad_escape, "{\"w\\q\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "bad escape '\\q'")
BAD_HEADER(deep_json_as_an_entry, "{\"w\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", 0,
           K3_EFORMAT, "entry must be an object, found an array")
BAD_HEADER(deep_json_in_a_shape, E1("\"dtype\":\"U8\",\"shape\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["), 0,
           K3_EFORMAT, "shape dim must be an integer, found an array")
BAD_HEADER(entry_that_is_a_string, "{\"w\":\"U8\"}", 0, K3_EFORMAT, "tensor \"w\": entry must be an object, found a string")
BAD_HEADER(entry_without_dtype, E1("\"shape\":[4],\"data_offsets\":[0,4]"), 4, K3_EFORMAT, "entry lacks dtype")
BAD_HEADER(entry_without_shape_and_offsets, E1("\"dtype\":\"U8\""), 4, K3_EFORMAT, "entry lacks shape data_offsets")
BAD_HEADER(entry_with_an_extra_key, E1(OK_ENTRY ",\"stride\":[1]"), 4, K3_EFORMAT, "unexpected key \"stride\" in entry")
BAD_HEADER(entry_with_dtype_twice, E1(OK_ENTRY ",\"dtype\":\"U8\""), 4, K3_EFORMAT, "dtype given twice")
BAD_HEADER(dtype_that_is_a_number, E1("\"dtype\":8,\"shape\":[4],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "dtype must be a string, found a number")
BAD_HEADER(unknown_dtype, E1("\"dtype\":\"F64\",\"shape\":[4],\"data_offsets\":[0,32]"), 32, K3_EFORMAT,
           "unknown dtype \"F64\"")
BAD_HEADER(shape_that_is_an_object, E1("\"dtype\":\"U8\",\"shape\":{},\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "shape must be an array, found an object")
BAD_HEADER(negative_dim, E1("\"dtype\":\"U8\",\"shape\":[-4],\"data_offsets\":[0,4]"), 4, K3_EFORMAT, "shape dim is negative")
BAD_HEADER(fractional_dim, E1("\"dtype\":\"U8\",\"shape\":[4.0],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "shape dim is not an integer")
BAD_HEADER(exponent_offset, E1("\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4e0]"), 4, K3_EFORMAT,
           "data_offsets end is not an integer")
BAD_HEADER(dim_above_2_pow_53, E1("\"dtype\":\"U8\",\"shape\":[9007199254740993],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "shape dim is larger than 2^53")
BAD_HEADER(huge_dim_with_many_digits, E1("\"dtype\":\"U8\",\"shape\":[99999999999999999999999999999999999],"
                                         "\"data_offsets\":[0,4]"), 4, K3_EFORMAT, "larger than 2^53")
BAD_HEADER(leading_zero_number, E1("\"dtype\":\"U8\",\"shape\":[04],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "leading zero")
BAD_HEADER(dim_that_is_a_string, E1("\"dtype\":\"U8\",\"shape\":[\"4\"],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "shape dim must be an integer, found a string")
BAD_HEADER(too_many_dims, E1("\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]"), 1, K3_EFORMAT,
           "shape has more than 8 dims")
BAD_HEADER(three_data_offsets, E1("\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4,8]"), 4, K3_EFORMAT,
           "data_offsets must hold exactly two integers")
BAD_HEADER(one_data_offset, E1("\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4]"), 4, K3_EFORMAT,
           "expected ',' in data_offsets")
BAD_HEADER(offsets_past_the_data, E1("\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]"), 4, K3_EIO,
           "data_offsets [0, 8) run past the data area (4 bytes)")
BAD_HEADER(begin_after_end, E1("\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,2]"), 4, K3_EFORMAT,
           "data_offsets begin 4 > end 2")
BAD_HEADER(size_not_shape_times_dtype, E1("\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "size 4 bytes from data_offsets != 8 from shape x BF16")
BAD_HEADER(size_larger_than_shape_times_dtype, E1("\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,4]"), 4, K3_EFORMAT,
           "size 4 bytes from data_offsets != 2 from shape x U8")
BAD_HEADER(shape_product_overflow, E1("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]"), 0,
           K3_EFORMAT, "shape product overflows 64 bits")
BAD_HEADER(shape_product_overflow_by_dtype_size, E1("\"dtype\":\"F32\",\"shape\":[4611686018427387,4096],"
                                                    "\"data_offsets\":[0,0]"), 0, K3_EFORMAT, "overflows 64 bits")
BAD_HEADER(overlapping_tensors, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}", 6, K3_EFORMAT,
           "tensor \"b\": data [2, 6) overlaps tensor \"a\" which ends at 4")
BAD_HEADER(two_tensors_sharing_bytes, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                      "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, K3_EFORMAT,
           "overlaps tensor \"a\"")
BAD_HEADER(hole_between_tensors, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                 "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[8,12]}}", 12, K3_EFORMAT,
           "hole in the data: bytes [4, 8) belong to no tensor")
BAD_HEADER(hole_at_the_start, E1("\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]"), 6, K3_EFORMAT,
           "hole in the data: bytes [0, 2)")
BAD_HEADER(bytes_after_the_last_tensor, E1(OK_ENTRY), 9, K3_EFORMAT, "5 bytes after the last tensor belong to no tensor")
BAD_HEADER(duplicate_names_in_a_shard, "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                       "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8, K3_EFORMAT,
           "tensor \"a\": duplicate name (first at byte 9)")
BAD_HEADER(empty_tensor_name, "{\"\":{" OK_ENTRY "}}", 4, K3_EFORMAT, "empty tensor name")
BAD_HEADER(metadata_that_is_a_string, "{\"__metadata__\":\"pt\"}", 0, K3_EFORMAT, "__metadata__ must be an object")
BAD_HEADER(metadata_with_a_number_value, "{\"__metadata__\":{\"format\":1}}", 0, K3_EFORMAT,
           "__metadata__ value must be a string, found a number")
BAD_HEADER(metadata_with_nested_object, "{\"__metadata__\":{\"a\":{\"b\":{}}}}", 0, K3_EFORMAT,
           "__metadata__ value must be a string, found an object")
BAD_HEADER(metadata_twice, "{\"__metadata__\":{},\"__metadata__\":{}}", 0, K3_EFORMAT, "__metadata__ given twice")
BAD_HEADER(a_second_json_value_after_the_header, "{} {}", 0, K3_EFORMAT, "bytes after the header JSON")

K3_TEST(st_rejects_nul_padding_after_the_json_bytes)
{
    /* strlen() stops at NUL, so write this one by hand */
    const char hdr[] = "{}\0\0\0";
    const char *path = pathf("%s/nul.safetensors", k3t_tmpdir());
    write_raw(path, 5, hdr, 5, 0, NULL, NULL, 0);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "nul.safetensors: byte 10: bytes after the header JSON (byte 0x00");
}

K3_TEST(st_rejects_a_name_longer_than_the_limit)
{
    char *hdr = malloc(4096);
    char name[K3_ST_MAX_NAME + 2];
    memset(name, 'n', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    sprintf(hdr, "{\"%s\":{" OK_ENTRY "}}", name);
    check_bad_header(hdr, 4, K3_EFORMAT, "tensor name is longer than 1024 bytes");
    /* exactly at the limit is fine */
    name[K3_ST_MAX_NAME] = '\0';
    sprintf(hdr, "{\"%s\":{" OK_ENTRY "}}", name);
    k3_st_header h;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_header_parse(&h, "mem", (const uint8_t *)hdr, strlen(hdr), 8 + strlen(hdr) + 4, &e), 0);
    k3_st_header_free(&h);
    free(hdr);
}

K3_TEST(st_rejects_header_length_past_eof)
{
    const char *path = pathf("%s/short.safetensors", k3t_tmpdir());
    write_raw(path, 1000, "{}", 2, 0, NULL, NULL, 0);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "short.safetensors: byte 0: header length 1000 runs past end of file (10 bytes)");
}

K3_TEST(st_rejects_huge_header_length_without_allocating)
{
    const char *path = pathf("%s/huge.safetensors", k3t_tmpdir());
    write_raw(path, UINT64_MAX - 3, "{}", 2, 0, NULL, NULL, 0);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_ELIMIT);
    CHECK_STR_CONTAINS(e.msg, "huge.safetensors: byte 0: header length 18446744073709551612 exceeds the 104857600-byte limit");
    k3_err_clear(&e);
    write_raw(path, (uint64_t)K3_ST_MAX_HEADER + 1, "{}", 2, 0, NULL, NULL, 0);
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_ELIMIT);
}

K3_TEST(st_rejects_a_file_shorter_than_the_length_prefix)
{
    const char *path = pathf("%s/tiny.safetensors", k3t_tmpdir());
    write_text(path, "{}");
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, path, 0, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "tiny.safetensors: byte 0: file is 2 bytes, too short");
}

/* ---- hostile checkpoints and indexes -------------------------------------- */

K3_TEST(st_rejects_a_tensor_present_in_two_shards)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_shard(pathf("%s/model-00004-of-00003.safetensors", dir), shard_c, 1);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "model-00004-of-00003.safetensors: byte ");
    CHECK_STR_CONTAINS(e.msg, "tensor \"lm_head.weight\" is also in model-00003-of-00003.safetensors");
}

K3_TEST(st_rejects_a_bad_shard_in_a_directory_naming_it)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_bad(pathf("%s/model-00002-of-00003.safetensors", dir), E1("\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,5]"), 5);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "/model-00002-of-00003.safetensors: byte 13: tensor \"w\": size 5 bytes");
}

K3_TEST(st_rejects_a_directory_with_no_shards)
{
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, k3t_tmpdir(), 0, &e), K3_ENOENT);
    CHECK_STR_CONTAINS(e.msg, "no *.safetensors files");
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_st_open(&st, pathf("%s/absent", k3t_tmpdir()), 0, &e), K3_ENOENT);
}

static void check_bad_index(const char *index_text, int code, const char *substr)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_text(pathf("%s/model.safetensors.index.json", dir), index_text);
    k3_st *st = (k3_st *)1;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), code);
    CHECK(st == NULL);
    CHECK_STR_CONTAINS(e.msg, substr);
}

K3_TEST(st_rejects_an_index_that_is_not_json)
{
    check_bad_index("weight_map = {}", K3_EFORMAT, "model.safetensors.index.json: byte 0: index is not a JSON object");
}

K3_TEST(st_rejects_an_index_that_is_truncated)
{
    check_bad_index("{\"weight_map\": {\"a\": \"model-00001-of-00003.safetensors\"", K3_EFORMAT,
                    "text ends where ',' was expected or '}' in weight_map");
}

K3_TEST(st_rejects_an_index_without_weight_map)
{
    check_bad_index("{\"metadata\": {\"total_size\": 0}}", K3_EFORMAT, "index.json: no weight_map object");
}

K3_TEST(st_rejects_an_index_whose_weight_map_is_not_an_object)
{
    check_bad_index("{\"weight_map\": [\"model-00001-of-00003.safetensors\"]}", K3_EFORMAT,
                    "weight_map must be an object, found an array");
}

K3_TEST(st_rejects_an_index_with_deep_json)
{
    char text[4096];
    size_t n = (size_t)sprintf(text, "{\"metadata\": ");
    for (int i = 0; i < 2000 && n < sizeof text - 10; i++)
        text[n++] = '[';
    text[n] = '\0';
    check_bad_index(text, K3_ELIMIT, "JSON nested deeper than 64 levels");
}

K3_TEST(st_rejects_an_index_with_a_non_string_shard)
{
    check_bad_index("{\"weight_map\": {\"lm_head.weight\": 3}}", K3_EFORMAT,
                    "tensor \"lm_head.weight\": shard name must be a string, found a number");
}

K3_TEST(st_rejects_index_path_traversal_in_shard_names)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, "\"evil\": \"../model-00001-of-00003.safetensors\"", NULL);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tensor \"evil\": shard name \"../model-00001-of-00003.safetensors\" is not a plain file name");
    write_index(dir, "\"evil\": \"/etc/passwd.safetensors\"", NULL);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "shard name \"/etc/passwd.safetensors\" is not a plain file name");
    write_index(dir, "\"evil\": \"model.bin\"", NULL);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "shard name \"model.bin\" is not a plain file name ending in .safetensors");
}

K3_TEST(st_rejects_an_index_tensor_missing_from_its_shard)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, "\"ghost.weight\": \"model-00002-of-00003.safetensors\"", NULL);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_ENOENT);
    CHECK_STR_CONTAINS(e.msg, "model.safetensors.index.json: byte ");
    CHECK_STR_CONTAINS(e.msg, "tensor \"ghost.weight\" is listed for model-00002-of-00003.safetensors but missing from it");
}

K3_TEST(st_rejects_a_shard_tensor_missing_from_the_index)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, "model.norm.weight");
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "model-00001-of-00003.safetensors: byte ");
    CHECK_STR_CONTAINS(e.msg, "tensor \"model.norm.weight\" is in the shard but not in model.safetensors.index.json");
}

K3_TEST(st_rejects_an_index_that_puts_a_tensor_in_the_wrong_shard)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, "\"model.norm.weight\": \"model-00003-of-00003.safetensors\"", "model.norm.weight");
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tensor \"model.norm.weight\": the index puts it in model-00003-of-00003.safetensors, "
                              "it is in model-00001-of-00003.safetensors");
}

K3_TEST(st_rejects_an_index_listing_a_tensor_twice)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, "\"lm_head.weight\": \"model-00003-of-00003.safetensors\"", NULL);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "tensor \"lm_head.weight\": listed twice in weight_map");
}

K3_TEST(st_rejects_a_missing_shard_named_by_the_index)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, NULL);
    CHECK_EQ_INT(unlink(pathf("%s/model-00002-of-00003.safetensors", dir)), 0);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_ENOENT);
    CHECK_STR_CONTAINS(e.msg, "/model-00002-of-00003.safetensors: shard named by model.safetensors.index.json is missing");
}

K3_TEST(st_rejects_a_shard_file_the_index_does_not_reference)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, NULL);
    write_bad(pathf("%s/stray.safetensors", dir), "{}", 0);
    k3_st *st;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "/stray.safetensors: shard file is not referenced by model.safetensors.index.json");
}

/* ---- mutation fuzzing ----------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) { return k3t_xorshift(&rng_state); }

/* One random edit of buf (length *n, capacity cap). */
static void mutate(uint8_t *buf, size_t *n, size_t cap)
{
    static const char special[] = "\"{}[],:\\0123456789-+.eE ntfu\x80\xff\xc3\xed";
    size_t len = *n;
    size_t at = len ? rnd() % len : 0;
    switch (rnd() % 6) {
    case 0: /* overwrite with a random byte */
        if (len)
            buf[at] = (uint8_t)rnd();
        break;
    case 1: /* overwrite with a JSON-significant byte */
        if (len)
            buf[at] = (uint8_t)special[rnd() % (sizeof special - 1)];
        break;
    case 2: { /* delete a range */
        size_t k = 1 + rnd() % 8;
        if (at + k > len)
            k = len - at;
        memmove(buf + at, buf + at + k, len - at - k);
        *n = len - k;
        break;
    }
    case 3: { /* duplicate a range */
        size_t k = 1 + rnd() % 16;
        if (at + k > len)
            k = len - at;
        if (len + k <= cap) {
            memmove(buf + at + k, buf + at, len - at);
            *n = len + k;
        }
        break;
    }
    case 4: /* truncate */
        *n = at;
        break;
    default: /* change a digit, so offsets and shapes drift */
        for (size_t i = at; i < len; i++)
            if (buf[i] >= '0' && buf[i] <= '9') {
                buf[i] = (uint8_t)('0' + rnd() % 10);
                break;
            }
        break;
    }
}

K3_TEST_TIMEOUT(st_header_parser_survives_mutated_headers, 600)
{
    const char base[] =
        "{\"__metadata__\":{\"format\":\"pt\",\"k\\u00e9y\":\"v\\n\"},"
        "\"a.weight\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},"
        "\"b.\\u00e9\\ud83d\\ude00\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[12,16]},"
        "\"c\":{\"dtype\":\"U8\",\"shape\":[0,7],\"data_offsets\":[16,16]},"
        "\"d\":{\"dtype\":\"F8_E4M3\",\"shape\":[4,1,1],\"data_offsets\":[16,20]}}    ";
    const uint64_t data_len = 20;
    k3_st_header h;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_header_parse(&h, "fuzz", (const uint8_t *)base, strlen(base), 8 + strlen(base) + data_len, &e), 0);
    CHECK_EQ_U64(h.count, 4);
    k3_st_header_free(&h);
    uint8_t buf[1024];
    int accepted = 0;
    /* K3_FUZZ_ITERS=N runs a longer session (and K3_FUZZ_SEED another one) */
    long iters = getenv("K3_FUZZ_ITERS") ? strtol(getenv("K3_FUZZ_ITERS"), NULL, 10) : 30000;
    if (getenv("K3_FUZZ_SEED"))
        rng_state ^= (uint64_t)strtoull(getenv("K3_FUZZ_SEED"), NULL, 10) * 0x9E3779B97F4A7C15ull;
    for (long iter = 0; iter < iters; iter++) {
        size_t n = strlen(base);
        memcpy(buf, base, n);
        int edits = 1 + (int)(rnd() % 3);
        for (int k = 0; k < edits; k++)
            mutate(buf, &n, sizeof buf);
        /* exact-size heap copy, so a read past the end is caught by ASan */
        uint8_t *text = malloc(n ? n : 1);
        memcpy(text, buf, n);
        uint64_t fsize = 8 + n + (rnd() % 4 ? data_len : rnd() % 64);
        k3_err_clear(&e);
        int rc = k3_st_header_parse(&h, "fuzz", text, n, fsize, &e);
        if (rc == 0) {
            accepted++;
            /* whatever was accepted tiles the data area */
            uint64_t at = h.data_start;
            for (uint64_t i = 0; i < h.count; i++) {
                CHECK_EQ_U64(h.tensors[i].offset, at);
                CHECK(h.tensors[i].name[0] != '\0');
                at += h.tensors[i].nbytes;
            }
            CHECK_EQ_U64(at, fsize);
        } else {
            CHECK(rc == K3_EFORMAT || rc == K3_ELIMIT || rc == K3_EIO);   /* K3_EIO: data past the file (truncated) */
            CHECK_STR_CONTAINS(e.msg, "fuzz: byte ");
            CHECK(h.tensors == NULL && h.names == NULL);
        }
        k3_st_header_free(&h);
        free(text);
    }
    fprintf(stderr, "  (%d of %ld mutated headers accepted, all tiling their data)\n", accepted, iters);
}

K3_TEST(st_index_parser_survives_mutated_indexes)
{
    const char *dir = k3t_tmpdir();
    write_three_shards(dir);
    write_index(dir, NULL, NULL);
    char *path = pathf("%s/model.safetensors.index.json", dir);
    char *base;
    uint64_t blen;
    k3_err e = {0};
    CHECK_EQ_INT(k3_io_read_file(path, 1 << 20, &base, &blen, &e), 0);
    uint8_t *buf = malloc(blen + 4096);
    int opened = 0;
    for (int iter = 0; iter < 200; iter++) {
        size_t n = blen;
        memcpy(buf, base, n);
        mutate(buf, &n, blen + 4096);
        FILE *f = fopen(path, "w");
        CHECK(f != NULL);
        CHECK_EQ_U64(fwrite(buf, 1, n, f), n);
        CHECK_EQ_INT(fclose(f), 0);
        k3_st *st = NULL;
        k3_err_clear(&e);
        int rc = k3_st_open(&st, dir, 0, &e);
        if (rc == 0) {
            opened++;
            CHECK_EQ_U64(k3_st_tensor_count(st), 6);
            k3_st_close(st);
        } else {
            CHECK(st == NULL);
            CHECK(e.msg[0] != '\0');
        }
    }
    free(buf);
    free(base);
    fprintf(stderr, "  (%d of 200 mutated indexes accepted)\n", opened);
}
