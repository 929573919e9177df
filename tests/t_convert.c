/*
 * t_convert.c - k3-convert end to end on tiny synthetic checkpoints: the
 * round trip (MXFP4 bytes unchanged, float experts quantized by the
 * reference rule, trunk bytes as stored), determinism across threads and
 * chunk sizes, crash + --resume byte-identity, sparse output, refusals.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_kern.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_st.h"
#include "k3_test.h"

static char *path_in(const char *name)
{
    static char buf[4][4096];
    static int i;
    char *p = buf[i++ & 3];
    snprintf(p, 4096, "%s/%s", k3t_tmpdir(), name);
    return p;
}

static void synth(const char *dir, const char *args)
{
    int st = k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet %s", dir, args);
    CHECK_EQ_INT(st, 0);
}

static void convert_ok(const char *src, const char *dst, const char *args)
{
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "k3-convert --quiet %s %s %s", args, src, dst);
    if (st != 0)
        fprintf(stderr, "k3-convert failed: %s\n", err ? err : "");
    CHECK_EQ_INT(st, 0);
    free(err);
}

static void verify_ok(const char *dir)
{
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "k3-verify %s", dir);
    if (st != 0)
        fprintf(stderr, "k3-verify: %s\n", out ? out : "");
    CHECK_EQ_INT(st, 0);
    free(out);
}

static void same_tree(const char *a, const char *b)
{
    char *out = NULL;
    int st = k3t_runf(&out, NULL, "diff -r %s %s", a, b);
    if (st != 0)
        fprintf(stderr, "diff: %s\n", out ? out : "");
    CHECK_EQ_INT(st, 0);
    free(out);
}

static const uint8_t *section_of(const k3_pk_expert_layout *xl, const uint8_t *rec, int which, int scale)
{
    uint64_t off = which == 0   ? (scale ? xl->w1_scales : xl->w1_packed)
                   : which == 1 ? (scale ? xl->w2_scales : xl->w2_packed)
                                : (scale ? xl->w3_scales : xl->w3_packed);
    return rec + off;
}

K3_TEST(convert_roundtrip_keeps_mxfp4_nibbles_and_scales_and_trunk_bytes)
{
    const char *src = path_in("src"), *dst = path_in("dst");
    synth(src, "");
    convert_ok(src, dst, "");
    verify_ok(dst);
    k3_err e = {0};
    k3_st *st = NULL;
    k3_pk *pk = NULL;
    CHECK_EQ_INT(k3_st_open(&st, src, 0, &e), 0);
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), 0);
    if (!st || !pk)
        return;
    const k3_cfg *c = k3_pk_cfg(pk);
    const k3_pk_expert_layout *xl = k3_pk_experts(pk);
    CHECK(xl != NULL);
    uint8_t *rec = k3_io_alloc_aligned(xl->stride, 4096);
    uint8_t *want = malloc(xl->stride);
    static const char *wn[3] = {"w1", "w2", "w3"};
    uint64_t compared = 0;
    for (uint32_t L = c->first_k_dense_replace; L < c->num_hidden_layers; L++)
        for (uint32_t x = 0; x < c->num_experts; x++) {
            CHECK_EQ_INT(k3_pk_read_record(pk, L, x, rec, 1, &e), 0);
            for (int w = 0; w < 3; w++)
                for (int sc = 0; sc < 2; sc++) {
                    char name[256];
                    snprintf(name, sizeof name, K3_MAN_PREFIX "layers.%u.block_sparse_moe.experts.%u.%s.%s", L, x,
                             wn[w], sc ? "weight_scale" : "weight_packed");
                    const k3_st_tensor *t = k3_st_find(st, name);
                    CHECK(t != NULL);
                    if (!t)
                        continue;
                    CHECK_EQ_INT(k3_st_read(st, t, want, &e), 0);
                    if (memcmp(section_of(xl, rec, w, sc), want, t->nbytes)) {
                        k3t_fail(__FILE__, __LINE__, "%s differs in the packed record", name);
                        return;
                    }
                    compared += t->nbytes;
                }
        }
    CHECK(compared > 0);
    /* trunk: every tensor stored as BF16 bytes equal to a BF16 source, and
     * the unit CRC holds */
    for (uint32_t i = 0; i < k3_pk_tensor_count(pk); i++) {
        const k3_pk_tensor *t = k3_pk_tensor_at(pk, i);
        const k3_st_tensor *s = k3_st_find(st, t->name);
        CHECK(s != NULL);
        if (!s || s->dtype != t->dtype)
            continue;
        uint8_t *a = malloc(s->nbytes), *b = malloc(t->nbytes);
        CHECK_EQ_INT(k3_st_read(st, s, a, &e), 0);
        CHECK_EQ_INT(k3_pk_read(pk, k3_pk_unit_at(pk, t->pieces[0].unit)->file, b, t->nbytes, t->pieces[0].offset, NULL,
                                0, &e), 0);
        CHECK(s->nbytes == t->nbytes && !memcmp(a, b, t->nbytes));
        free(a);
        free(b);
    }
    for (uint32_t u = 0; u < k3_pk_unit_count(pk); u++) {
        uint8_t *b = k3_io_alloc_aligned(k3_pk_unit_at(pk, u)->nbytes, 4096);
        CHECK_EQ_INT(k3_pk_read_unit(pk, u, b, 1, &e), 0);
        k3_io_free_aligned(b);
    }
    /* one layer = one unit = one read, also for layers whose tensors straddle
     * a shard boundary (the tiny checkpoint has some); embedding and head too */
    for (int32_t L = K3_PK_LAYER_HEAD; L < (int32_t)c->num_hidden_layers; L++) {
        const uint32_t *ids;
        uint32_t n;
        k3_pk_layer_units(pk, L, &ids, &n);
        CHECK_EQ_INT(n, 1);
    }
    CHECK_EQ_INT(k3_pk_unit_count(pk), c->num_hidden_layers + 2);
    k3_io_free_aligned(rec);
    free(want);
    k3_pk_close(pk);
    k3_st_close(st);
}

K3_TEST(convert_quantizes_bf16_experts_by_the_reference_rule)
{
    const char *src = path_in("src"), *dst = path_in("dst");
    synth(src, "--experts bf16");
    convert_ok(src, dst, "");
    verify_ok(dst);
    k3_err e = {0};
    k3_st *st = NULL;
    k3_pk *pk = NULL;
    CHECK_EQ_INT(k3_st_open(&st, src, 0, &e), 0);
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), 0);
    if (!st || !pk)
        return;
    k3_kern_init();
    const k3_cfg *c = k3_pk_cfg(pk);
    const k3_pk_expert_layout *xl = k3_pk_experts(pk);
    uint8_t *rec = k3_io_alloc_aligned(xl->stride, 4096);
    static const char *wn[3] = {"w1", "w2", "w3"};
    uint32_t L = c->num_hidden_layers - 1, x = c->num_experts - 1;
    CHECK_EQ_INT(k3_pk_read_record(pk, L, x, rec, 1, &e), 0);
    for (int w = 0; w < 3; w++) {
        char name[256];
        snprintf(name, sizeof name, K3_MAN_PREFIX "layers.%u.block_sparse_moe.experts.%u.%s.weight", L, x, wn[w]);
        const k3_st_tensor *t = k3_st_find(st, name);
        CHECK(t != NULL && t->dtype == K3_DT_BF16);
        if (!t)
            continue;
        uint64_t n = t->shape[0] * t->shape[1];
        uint16_t *raw = malloc(n * 2);
        float *f = malloc(n * 4);
        uint8_t *packed = malloc(n / 2), *scales = malloc(n / 32);
        CHECK_EQ_INT(k3_st_read(st, t, raw, &e), 0);
        k3_bf16_to_f32_n(raw, f, n);
        k3_mx_quantize(f, n, packed, scales); /* rows are whole groups: row-by-row = all at once */
        CHECK(!memcmp(section_of(xl, rec, w, 0), packed, n / 2));
        CHECK(!memcmp(section_of(xl, rec, w, 1), scales, n / 32));
        free(raw);
        free(f);
        free(packed);
        free(scales);
    }
    k3_io_free_aligned(rec);
    k3_pk_close(pk);
    k3_st_close(st);
}

K3_TEST(convert_output_is_identical_for_any_thread_count_and_chunk_size)
{
    const char *src = path_in("src"), *a = path_in("a"), *b = path_in("b");
    synth(src, "--experts bf16");
    convert_ok(src, a, "--threads 1");
    char args[256];
    snprintf(args, sizeof args, "--threads 2");
    setenv("K3_CONVERT_CHUNK", "8192", 1);
    convert_ok(src, b, args);
    unsetenv("K3_CONVERT_CHUNK");
    same_tree(a, b);
}

/* Kill k3-convert (SIGKILL) at a point, then --resume: the result must be
 * byte-identical to an uninterrupted run, and finished groups not redone. */
static void crash_and_resume(const char *point)
{
    const char *src = path_in("src"), *ref = path_in("ref"), *dst = path_in("dst");
    if (access(src, F_OK) != 0) {
        synth(src, "");
        convert_ok(src, ref, "");
    }
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "K3_CONVERT_CRASH=%s k3-convert --quiet %s %s", point, src, dst);
    CHECK_EQ_INT(st, 128 + 9);
    free(err);
    char man[4200];
    snprintf(man, sizeof man, "%s/manifest.json", dst);
    CHECK(access(man, F_OK) != 0);
    /* an interrupted directory is refused by readers and flagged by k3-verify */
    k3_pk *pk = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), K3_ENOENT);
    CHECK_STR_CONTAINS(e.msg, "incomplete packed model: no manifest.json");
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s", dst), 1);
    CHECK_STR_CONTAINS(out, "no manifest.json");
    free(out);
    /* without --resume a non-empty DST is refused */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --quiet %s %s", src, dst), 7);
    free(err);
    out = NULL;
    st = k3t_runf(&out, &err, "k3-convert --quiet --resume --json %s %s", src, dst);
    CHECK_EQ_INT(st, 0);
    if (strncmp(point, "chunk:0", 7) && strncmp(point, "published:0", 11))
        CHECK(out && !strstr(out, "\"groups_skipped\": 0,"));
    free(out);
    free(err);
    same_tree(ref, dst);
    verify_ok(dst);
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dst);
    CHECK_EQ_INT(system(cmd), 0);
}

K3_TEST_TIMEOUT(convert_resume_after_kill_is_byte_identical, 240)
{
    static const char *points[] = {"chunk:0", "chunk:2", "published:1", "journaled:0", "journaled:2", "index:0"};
    for (size_t i = 0; i < sizeof points / sizeof *points; i++)
        crash_and_resume(points[i]);
}

/* The embedding's row CRCs of a kept group wait in the journal
 * (embed-crc.bin, its SHA-256 in the group's entry): read back wrong, they
 * must not reach embed.crc - the group is redone and the result is the
 * uninterrupted one. */
K3_TEST(convert_resume_redoes_the_embedding_group_when_its_row_crcs_read_back_wrong)
{
    const char *src = path_in("src"), *ref = path_in("ref"), *dst = path_in("dst");
    synth(src, "");
    convert_ok(src, ref, "");
    char *err = NULL, *out = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_CONVERT_CRASH=journaled:2 k3-convert --quiet %s %s", src, dst), 128 + 9);
    free(err);
    char jf[4400];
    snprintf(jf, sizeof jf, "%s/.k3-convert-journal/embed-crc.bin", dst);
    CHECK(access(jf, F_OK) == 0);
    CHECK_EQ_INT(k3t_runf(&out, &err, "K3_FAULT=flip:embed-crc.bin:9 k3-convert --json --resume %s %s", src, dst), 0);
    CHECK_STR_CONTAINS(err, "row CRCs in the journal");
    CHECK(out && strstr(out, "\"groups_skipped\": 2,"));
    free(out);
    free(err);
    same_tree(ref, dst);
    verify_ok(dst);
}

K3_TEST(convert_refuses_existing_dst_and_force_replaces_it)
{
    const char *src = path_in("src"), *dst = path_in("dst");
    synth(src, "");
    convert_ok(src, dst, "");
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --quiet %s %s", src, dst), 7);
    CHECK_STR_CONTAINS(err, "k3-convert: error:");
    CHECK_STR_CONTAINS(err, "--force");
    free(err);
    convert_ok(src, dst, "--force");
    verify_ok(dst);
    /* --resume on a finished directory does nothing and succeeds */
    convert_ok(src, dst, "--resume");
    verify_ok(dst);
}

K3_TEST(convert_leaves_zero_blocks_as_holes_and_hashes_logical_bytes)
{
    const char *src = path_in("src"), *dst = path_in("dst"), *dense = path_in("dense");
    synth(src, "--sparse");
    convert_ok(src, dst, "");
    verify_ok(dst);
    /* a dense copy verifies identically */
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "cp -r --sparse=never %s %s", dst, dense);
    CHECK_EQ_INT(system(cmd), 0);
    verify_ok(dense);
    /* the sparse output occupies less than its logical size */
    uint64_t logical = 0, allocated = 0;
    k3_pk *pk = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), 0);
    for (uint32_t i = 0; pk && i < k3_pk_file_count(pk); i++) {
        struct stat st;
        CHECK_EQ_INT(stat(k3_pk_file_at(pk, i)->path, &st), 0);
        logical += (uint64_t)st.st_size;
        allocated += (uint64_t)st.st_blocks * 512;
    }
    k3_pk_close(pk);
    if (allocated >= logical)
        fprintf(stderr, "note: %llu allocated of %llu logical bytes\n", (unsigned long long)allocated,
                (unsigned long long)logical);
    CHECK(allocated < logical);
    /* --dense gives the same bytes and hashes */
    const char *d2 = path_in("d2");
    convert_ok(src, d2, "--dense");
    same_tree(dst, d2);
}

K3_TEST(convert_rejects_bad_arguments_with_usage_status)
{
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert"), 2);
    CHECK_STR_CONTAINS(err, "k3-convert: error:");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --threads 0 a b"), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --bogus a b"), 2);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert %s/none %s/out", k3t_tmpdir(), k3t_tmpdir()), 4);
    free(err);
}

K3_TEST(convert_names_a_missing_trunk_tensor)
{
    const char *src = path_in("src"), *dst = path_in("dst");
    synth(src, "--no-index");
    /* drop the last shard: its tensors (the head) go missing */
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm %s/model-00005-of-00005.safetensors", src);
    CHECK_EQ_INT(system(cmd), 0);
    char *err = NULL;
    int st = k3t_runf(NULL, &err, "k3-convert --quiet %s %s", src, dst);
    CHECK(st == 4 || st == 3);
    CHECK_STR_CONTAINS(err, "missing");
    free(err);
    char man[4200];
    snprintf(man, sizeof man, "%s/manifest.json", dst);
    CHECK(access(man, F_OK) != 0);
}

/* The output writer hashes in file order whatever the write order: extents
 * written ahead of the hash frontier are read back when it reaches them. */
#include <openssl/evp.h>
#include <zlib.h>

#include "k3_outfile.h"

K3_TEST(convert_writer_hashes_out_of_order_writes_as_the_final_file)
{
    k3_conv_ext ext[4] = {{0, 5000}, {8192, 3000}, {12288, 4096}, {20480, 100}};
    k3_conv_ext reg[2] = {{0, 12288}, {12288, 12288}};
    uint32_t crc[2] = {0, 0};
    k3_conv_ofile of = {.size = 24576, .ext = ext, .next = 4, .regions = reg, .nregions = 2, .region_crc = crc};
    snprintf(of.name, sizeof of.name, "out.bin");
    uint8_t *data = calloc(1, of.size);
    for (uint32_t i = 0; i < 4; i++)
        for (uint64_t j = 0; j < ext[i].len; j++)
            data[ext[i].off + j] = (uint8_t)(i == 2 && j < 4096 ? 0 : 1 + (j * 31 + i) % 251); /* extent 2: a hole */
    k3_conv_w w;
    k3_err e = {0};
    CHECK_EQ_INT(k3_conv_w_open(&w, k3t_tmpdir(), &of, 0, &e), 0);
    /* order: 3, 1 (in two pieces), 0 (in three), 2 */
    CHECK_EQ_INT(k3_conv_w_write(&w, 3, 0, data + 20480, 100, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 1, 0, data + 8192, 1000, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 1, 1000, data + 9192, 2000, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 0, 0, data, 10, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 0, 10, data + 10, 4000, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 0, 4010, data + 4010, 990, &e), 0);
    CHECK_EQ_INT(k3_conv_w_write(&w, 2, 0, data + 12288, 4096, &e), 0);
    CHECK(w.readback > 0);
    CHECK(w.holes >= 4096);
    uint8_t sha[32], want[32];
    unsigned int hl;
    CHECK_EQ_INT(k3_conv_w_finish(&w, sha, &e), 0);
    CHECK_EQ_INT(k3_conv_w_publish(&w, &e), 0);
    k3_conv_w_close(&w, 0);
    EVP_Digest(data, of.size, want, &hl, EVP_sha256(), NULL);
    CHECK(!memcmp(sha, want, 32));
    CHECK_EQ_U64(crc[0], crc32(crc32(0, Z_NULL, 0), data, 12288));
    CHECK_EQ_U64(crc[1], crc32(crc32(0, Z_NULL, 0), data + 12288, 12288));
    /* and the file holds exactly those bytes */
    char path[4200];
    snprintf(path, sizeof path, "%s/out.bin", k3t_tmpdir());
    char *got = NULL;
    uint64_t len = 0;
    CHECK_EQ_INT(k3_io_read_file(path, 1 << 20, &got, &len, &e), 0);
    CHECK(len == of.size && !memcmp(got, data, of.size));
    free(got);
    free(data);
}

/* F8_E4M3 experts with DeepSeek-style 128x128 block scales: the converter
 * dequantizes (f8 * scale_inv of the block) and quantizes by docs/MODEL.md §2.6. The
 * checkpoint is written here from a BF16-expert one, experts replaced. */
#include "k3_stw.h"

static uint8_t f8_byte(uint64_t i, int w)
{
    uint8_t b = (uint8_t)((i * 37u + (uint64_t)w * 11u) & 0xff);
    return (b & 0x7f) == 0x7f ? (uint8_t)(b ^ 1) : b; /* no NaN */
}

K3_TEST(convert_dequantizes_f8_block_scaled_experts_then_quantizes)
{
    const char *bf = path_in("bf"), *src = path_in("src"), *dst = path_in("dst");
    synth(bf, "--experts bf16 --no-index --no-tokenizer");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir -p %s && cp %s/config.json %s/", src, bf, src), 0);
    k3_err e = {0};
    k3_st *st = NULL;
    CHECK_EQ_INT(k3_st_open(&st, bf, 0, &e), 0);
    if (!st)
        return;
    char out[4200];
    snprintf(out, sizeof out, "%s/model-00001-of-00001.safetensors", src);
    k3_stw *w = NULL;
    CHECK_EQ_INT(k3_stw_create(&w, out, &e), 0);
    uint64_t n = k3_st_tensor_count(st);
    /* declare: expert .weight becomes F8 + F32 scale_inv */
    for (uint64_t i = 0; i < n; i++) {
        const k3_st_tensor *t = k3_st_tensor_at(st, i);
        uint32_t L, x;
        int which, part;
        if (k3_man_expert_name(t->name, &L, &x, &which, &part) && part == K3_MAN_XP_WEIGHT) {
            CHECK_EQ_INT(k3_stw_add(w, t->name, K3_DT_F8_E4M3, 2, t->shape, &e), 0);
            char sn[512];
            snprintf(sn, sizeof sn, "%s_scale_inv", t->name);
            uint64_t ss[2] = {(t->shape[0] + 127) / 128, (t->shape[1] + 127) / 128};
            CHECK_EQ_INT(k3_stw_add(w, sn, K3_DT_F32, 2, ss, &e), 0);
        } else {
            CHECK_EQ_INT(k3_stw_add(w, t->name, t->dtype, t->ndim, t->shape, &e), 0);
        }
    }
    CHECK_EQ_INT(k3_stw_begin(w, 1, &e), 0);
    uint64_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        const k3_st_tensor *t = k3_st_tensor_at(st, i);
        uint32_t L, x;
        int which, part;
        if (k3_man_expert_name(t->name, &L, &x, &which, &part) && part == K3_MAN_XP_WEIGHT) {
            uint64_t cnt = t->shape[0] * t->shape[1];
            uint8_t *b = malloc(cnt);
            for (uint64_t j = 0; j < cnt; j++)
                b[j] = f8_byte(j, which);
            CHECK_EQ_INT(k3_stw_write(w, k++, 0, b, cnt, &e), 0);
            free(b);
            uint64_t ns = ((t->shape[0] + 127) / 128) * ((t->shape[1] + 127) / 128);
            float *s = malloc(ns * 4);
            for (uint64_t j = 0; j < ns; j++)
                s[j] = 0.25f * (float)(j + 1 + (uint64_t)which);
            CHECK_EQ_INT(k3_stw_write(w, k++, 0, s, ns * 4, &e), 0);
            free(s);
        } else {
            uint8_t *b = malloc(t->nbytes ? t->nbytes : 1);
            CHECK_EQ_INT(k3_st_read(st, t, b, &e), 0);
            CHECK_EQ_INT(k3_stw_write(w, k++, 0, b, t->nbytes, &e), 0);
            free(b);
        }
    }
    CHECK_EQ_INT(k3_stw_finish(w, &e), 0);
    k3_stw_free(w);
    k3_st_close(st);
    convert_ok(src, dst, "");
    verify_ok(dst);
    k3_pk *pk = NULL;
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), 0);
    if (!pk)
        return;
    k3_kern_init();
    const k3_cfg *c = k3_pk_cfg(pk);
    const k3_pk_expert_layout *xl = k3_pk_experts(pk);
    uint8_t *rec = k3_io_alloc_aligned(xl->stride, 4096);
    CHECK_EQ_INT(k3_pk_read_record(pk, c->first_k_dense_replace, 3, rec, 1, &e), 0);
    for (int wh = 0; wh < 3; wh++) {
        uint64_t rows = wh == 1 ? xl->rows_w2 : xl->rows_w13, cols = wh == 1 ? xl->cols_w2 : xl->cols_w13;
        uint64_t cnt = rows * cols, bc = (cols + 127) / 128;
        float *f = malloc(cnt * 4);
        for (uint64_t r = 0; r < rows; r++)
            for (uint64_t col = 0; col < cols; col++) {
                uint64_t j = r * cols + col;
                f[j] = k3_f8e4m3_to_f32(f8_byte(j, wh)) * (0.25f * (float)((r / 128) * bc + col / 128 + 1 + (uint64_t)wh));
            }
        uint8_t *packed = malloc(cnt / 2), *scales = malloc(cnt / 32);
        k3_mx_quantize(f, cnt, packed, scales);
        CHECK(!memcmp(section_of(xl, rec, wh, 0), packed, cnt / 2));
        CHECK(!memcmp(section_of(xl, rec, wh, 1), scales, cnt / 32));
        free(f);
        free(packed);
        free(scales);
    }
    k3_io_free_aligned(rec);
    k3_pk_close(pk);
}

K3_TEST(convert_interrupted_by_sigint_exits_130_removes_temporaries_and_resumes)
{
    const char *src = path_in("src"), *ref = path_in("ref"), *dst = path_in("dst");
    synth(src, "");
    convert_ok(src, ref, "");
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_CONVERT_CRASH=interrupt:1 k3-convert --quiet %s %s", src, dst), 130);
    CHECK_STR_CONTAINS(err, "k3-convert: error: interrupted");
    free(err);
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "ls %s | grep -c '\\.tmp$'", dst), 1); /* grep finds none */
    free(out);
    convert_ok(src, dst, "--resume");
    same_tree(ref, dst);
}

/* F32 trunk matrices stay F32, bytes unchanged; with --trunk-dtype bf16
 * they become BF16 by round-to-nearest-even: a BF16 matrix widened to F32
 * must come back bit for bit, also when the tensors start at odd offsets so
 * that elements straddle the read chunks. */
K3_TEST(convert_f32_trunk_matrices_round_to_the_same_bf16_across_chunk_edges)
{
    const char *bf = path_in("bf"), *src = path_in("src"), *dst = path_in("dst"), *kept = path_in("kept");
    synth(bf, "--no-index --no-tokenizer");
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "mkdir -p %s && cp %s/config.json %s/", src, bf, src), 0);
    k3_err e = {0};
    k3_st *st = NULL;
    CHECK_EQ_INT(k3_st_open(&st, bf, 0, &e), 0);
    if (!st)
        return;
    char out[4200];
    snprintf(out, sizeof out, "%s/model-00001-of-00001.safetensors", src);
    k3_stw *w = NULL;
    CHECK_EQ_INT(k3_stw_create(&w, out, &e), 0);
    uint64_t n = k3_st_tensor_count(st);
    uint64_t three = 3;
    /* an ignored 3-byte tensor first: everything after it is misaligned */
    CHECK_EQ_INT(k3_stw_add(w, "junk.pad", K3_DT_U8, 1, &three, &e), 0);
    for (uint64_t i = 0; i < n; i++) {
        const k3_st_tensor *t = k3_st_tensor_at(st, i);
        k3_dtype dt = t->dtype == K3_DT_BF16 && t->ndim >= 2 ? K3_DT_F32 : t->dtype;
        CHECK_EQ_INT(k3_stw_add(w, t->name, dt, t->ndim, t->shape, &e), 0);
    }
    CHECK_EQ_INT(k3_stw_begin(w, 1, &e), 0);
    uint8_t pad[3] = {1, 2, 3};
    CHECK_EQ_INT(k3_stw_write(w, 0, 0, pad, 3, &e), 0);
    for (uint64_t i = 0; i < n; i++) {
        const k3_st_tensor *t = k3_st_tensor_at(st, i);
        uint8_t *b = malloc(t->nbytes ? t->nbytes : 1);
        CHECK_EQ_INT(k3_st_read(st, t, b, &e), 0);
        if (t->dtype == K3_DT_BF16 && t->ndim >= 2) {
            uint64_t cnt = t->nbytes / 2;
            float *f = malloc(cnt * 4);
            k3_bf16_to_f32_n((const uint16_t *)b, f, cnt);
            CHECK_EQ_INT(k3_stw_write(w, i + 1, 0, f, cnt * 4, &e), 0);
            free(f);
        } else {
            CHECK_EQ_INT(k3_stw_write(w, i + 1, 0, b, t->nbytes, &e), 0);
        }
        free(b);
    }
    CHECK_EQ_INT(k3_stw_finish(w, &e), 0);
    k3_stw_free(w);
    setenv("K3_CONVERT_CHUNK", "4096", 1);
    convert_ok(src, dst, "--trunk-dtype bf16");
    convert_ok(src, kept, "");
    unsetenv("K3_CONVERT_CHUNK");
    verify_ok(dst);
    verify_ok(kept);
    k3_pk *pk = NULL;
    k3_st *sf = NULL;
    CHECK_EQ_INT(k3_st_open(&sf, src, 0, &e), 0);
    CHECK_EQ_INT(k3_pk_open(&pk, kept, 0, &e), 0);
    uint32_t same = 0;
    for (uint32_t i = 0; pk && sf && i < k3_pk_tensor_count(pk); i++) {
        const k3_pk_tensor *t = k3_pk_tensor_at(pk, i);
        const k3_st_tensor *s = k3_st_find(sf, t->name);
        CHECK(s != NULL);
        if (!s)
            continue;
        CHECK_EQ_INT(t->dtype, s->dtype);                             /* as stored, never rounded */
        CHECK_EQ_INT(t->src_dtype, s->dtype);
        uint8_t *a = malloc(s->nbytes), *b = malloc(t->nbytes);
        CHECK_EQ_INT(k3_st_read(sf, s, a, &e), 0);
        CHECK_EQ_INT(k3_pk_read(pk, k3_pk_unit_at(pk, t->pieces[0].unit)->file, b, t->nbytes, t->pieces[0].offset,
                                NULL, 0, &e), 0);
        if (s->nbytes != t->nbytes || memcmp(a, b, t->nbytes))
            k3t_fail(__FILE__, __LINE__, "%s: not the upstream bytes", t->name);
        same += s->dtype == K3_DT_F32 && s->ndim >= 2;
        free(a);
        free(b);
    }
    CHECK(same > 10);
    k3_pk_close(pk);
    k3_st_close(sf);
    pk = NULL;
    CHECK_EQ_INT(k3_pk_open(&pk, dst, 0, &e), 0);
    uint32_t compared = 0;
    for (uint32_t i = 0; pk && i < k3_pk_tensor_count(pk); i++) {
        const k3_pk_tensor *t = k3_pk_tensor_at(pk, i);
        const k3_st_tensor *s = k3_st_find(st, t->name);
        CHECK(s != NULL);
        if (!s || s->dtype != K3_DT_BF16 || s->ndim < 2)
            continue;
        CHECK_EQ_INT(t->dtype, K3_DT_BF16);
        uint8_t *a = malloc(s->nbytes), *b = malloc(t->nbytes);
        CHECK_EQ_INT(k3_st_read(st, s, a, &e), 0);
        CHECK_EQ_INT(k3_pk_read(pk, k3_pk_unit_at(pk, t->pieces[0].unit)->file, b, t->nbytes, t->pieces[0].offset,
                                NULL, 0, &e), 0);
        if (s->nbytes != t->nbytes || memcmp(a, b, t->nbytes))
            k3t_fail(__FILE__, __LINE__, "%s: F32 -> BF16 did not give the original bytes", t->name);
        compared++;
        free(a);
        free(b);
    }
    CHECK(compared > 10);
    k3_pk_close(pk);
    k3_st_close(st);
}

/* k3_conv_crc32_zeros is zlib's crc32 over that many zero bytes, for any
 * starting CRC and length (odd, block-sized, large), and composes. */
K3_TEST(convert_crc32_of_zeros_is_crc32_over_zero_bytes)
{
    static const uint64_t lens[] = {0, 1, 2, 3, 7, 64, 4095, 4096, 4097, 65536 + 13, 1u << 20, (3u << 20) + 5};
    uint8_t *z = calloc(1, (3u << 20) + 5);
    const uint8_t msg[] = "k3";
    const uint32_t starts[] = {0, 0xdeadbeefu, 0xffffffffu, (uint32_t)crc32(0, msg, 2)};
    for (size_t i = 0; i < sizeof starts / sizeof *starts; i++)
        for (size_t j = 0; j < sizeof lens / sizeof *lens; j++)
            CHECK_EQ_U64(k3_conv_crc32_zeros(starts[i], lens[j]), (uint32_t)crc32(starts[i], z, (uInt)lens[j]));
    free(z);
    /* past 4 GiB (beyond one crc32 call): zeros(a) then zeros(b) = zeros(a + b) */
    uint64_t a = (5ull << 30) + 3, b = (3ull << 30) + 4093;
    CHECK_EQ_U64(k3_conv_crc32_zeros(k3_conv_crc32_zeros(0x1234u, a), b), k3_conv_crc32_zeros(0x1234u, a + b));
}

/* A source whose shards have holes and data at odd boundaries (holes punched
 * into a dense tiny checkpoint) converts to exactly the output of a dense
 * copy of itself (cp --sparse=never), with small and default read chunks;
 * the sparse run skips the holes, the dense one reads everything. */
#include <fcntl.h>

static void punch_holes(const char *dir)
{
    char path[4400];
    for (int s = 1; s <= 5; s++) {
        snprintf(path, sizeof path, "%s/model-%05d-of-00005.safetensors", dir, s);
        int fd = open(path, O_RDWR);
        CHECK(fd >= 0);
        uint8_t h[8];
        CHECK_EQ_INT(pread(fd, h, 8, 0), 8);
        uint64_t hdr = 8, size = (uint64_t)lseek(fd, 0, SEEK_END);
        for (int i = 0; i < 8; i++)
            hdr += (uint64_t)h[i] << (8 * i);
        /* odd offsets and lengths: blocks wholly inside become holes, the
         * partial ends are zeroed in place (data that reads as zeros) */
        uint64_t off = hdr + 1 + (uint64_t)s * 777, k = 0;
        while (off < size) {
            uint64_t len = k % 5 == 4 ? 70001 : 4096 * (k % 3) + 1234 + 11 * k;
            len = len > size - off ? size - off : len;
            CHECK_EQ_INT(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len), 0);
            off += len + 4096 * (k % 4) + 333;
            k++;
        }
        close(fd);
    }
}

static uint64_t json_u64(const char *js, const char *key)
{
    const char *p = js ? strstr(js, key) : NULL;
    return p ? strtoull(p + strlen(key) + 3, NULL, 10) : ~0ull;
}

K3_TEST(convert_sparse_source_gives_the_output_of_its_dense_copy)
{
    char src[4096], dense[4096]; /* path_in's buffers are reused */
    snprintf(src, sizeof src, "%s", path_in("src"));
    snprintf(dense, sizeof dense, "%s", path_in("dense"));
    synth(src, "");
    punch_holes(src);
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "cp -r --sparse=never %s %s", src, dense);
    CHECK_EQ_INT(system(cmd), 0);
    static const char *chunks[] = {"8192", NULL};
    for (int c = 0; c < 2; c++) {
        if (chunks[c])
            setenv("K3_CONVERT_CHUNK", chunks[c], 1);
        else
            unsetenv("K3_CONVERT_CHUNK");
        char *o1 = NULL, *o2 = NULL, *err = NULL;
        const char *a = path_in(c ? "a1" : "a0"), *b = path_in(c ? "b1" : "b0");
        int st = k3t_runf(&o1, &err, "k3-convert --quiet --json %s %s", src, a);
        if (st)
            fprintf(stderr, "%s\n", err ? err : "");
        CHECK_EQ_INT(st, 0);
        free(err);
        CHECK_EQ_INT(k3t_runf(&o2, &err, "k3-convert --quiet --json %s %s", dense, b), 0);
        free(err);
        uint64_t skipped = json_u64(o1, "src_hole_bytes");
        if (skipped == 0 || skipped == ~0ull)
            fprintf(stderr, "sparse run: %s\n", o1 ? o1 : "");
        CHECK(skipped > 0 && skipped < json_u64(o1, "bytes_read"));
        CHECK_EQ_U64(json_u64(o2, "src_hole_bytes"), 0);
        free(o1);
        free(o2);
        same_tree(a, b);
        verify_ok(a);
    }
}

/* k3_conv_w_write_zeros is k3_conv_w_write of a zero buffer: same file
 * bytes, SHA-256 and region CRCs, whether the zeros land at the hash
 * frontier or ahead of it (read back), sparse or --dense. */
K3_TEST(convert_writer_zero_writes_equal_writes_of_zero_buffers)
{
    k3_conv_ext ext[4] = {{0, 5000}, {8192, 3000}, {12288, 9000}, {24576, 100}};
    k3_conv_ext reg[2] = {{0, 12289}, {12289, 12387}};
    uint8_t *data = calloc(1, 24676);
    for (uint64_t j = 0; j < 5000; j++)
        data[j] = (uint8_t)(1 + j % 251);
    for (uint64_t j = 0; j < 100; j++)
        data[24576 + j] = (uint8_t)(7 + j);
    uint8_t want[32];
    unsigned int hl;
    EVP_Digest(data, 24676, want, &hl, EVP_sha256(), NULL);
    for (int dense = 0; dense < 2; dense++) {
        uint32_t crc[2] = {0, 0};
        k3_conv_ofile of = {.size = 24676, .ext = ext, .next = 4, .regions = reg, .nregions = 2, .region_crc = crc};
        snprintf(of.name, sizeof of.name, "z%d.bin", dense);
        k3_conv_w w;
        k3_err e = {0};
        CHECK_EQ_INT(k3_conv_w_open(&w, k3t_tmpdir(), &of, dense, &e), 0);
        /* extent 2 (zeros) ahead of the frontier, then 0, 1 (zeros, at it), 3 */
        CHECK_EQ_INT(k3_conv_w_write_zeros(&w, 2, 0, 4000, &e), 0);
        CHECK_EQ_INT(k3_conv_w_write_zeros(&w, 2, 4000, 5000, &e), 0);
        CHECK_EQ_INT(k3_conv_w_write(&w, 0, 0, data, 5000, &e), 0);
        CHECK_EQ_INT(k3_conv_w_write_zeros(&w, 1, 0, 3000, &e), 0);
        CHECK_EQ_INT(k3_conv_w_write(&w, 3, 0, data + 24576, 100, &e), 0);
        CHECK_EQ_U64(w.holes, dense ? 0 : 12000);
        uint8_t sha[32];
        CHECK_EQ_INT(k3_conv_w_finish(&w, sha, &e), 0);
        CHECK_EQ_INT(k3_conv_w_publish(&w, &e), 0);
        k3_conv_w_close(&w, 0);
        CHECK(!memcmp(sha, want, 32));
        CHECK_EQ_U64(crc[0], crc32(crc32(0, Z_NULL, 0), data, 12289));
        CHECK_EQ_U64(crc[1], crc32(crc32(0, Z_NULL, 0), data + 12289, 12387));
        char path[4200];
        snprintf(path, sizeof path, "%s/z%d.bin", k3t_tmpdir(), dense);
        char *got = NULL;
        uint64_t len = 0;
        CHECK_EQ_INT(k3_io_read_file(path, 1 << 20, &got, &len, &e), 0);
        CHECK(len == 24676 && !memcmp(got, data, len));
        free(got);
    }
    free(data);
}

K3_TEST(convert_progress_only_on_a_terminal_or_when_asked)
{
    char *err = NULL;
    const char *src = path_in("prog-src");
    synth(src, "");
    /* off a terminal, --progress gives plain lines (every one due at once here) */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-convert --progress %s %s", src, path_in("prog-a")), 0);
    CHECK_STR_CONTAINS(err, "k3-convert: ");
    CHECK_STR_CONTAINS(err, "(100.0%)");
    CHECK(strchr(err, '\r') == NULL);
    free(err);
    /* without it, none; with --quiet, nothing at all */
    err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-convert %s %s", src, path_in("prog-b")), 0);
    CHECK(err == NULL || strstr(err, "%)") == NULL);
    free(err);
    err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "K3_PROGRESS_EVERY_MS=0 k3-convert --quiet --progress %s %s", src, path_in("prog-c")), 0);
    CHECK(err == NULL || err[0] == 0);
    free(err);
}
