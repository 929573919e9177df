/*
 * t_man.c - the manifest (k3_man) and the read API (k3_pk): the record
 * layout at K3 size, serialise/parse round trip, every consistency rule
 * refusing a broken table, the self hash, experts.idx validation, and
 * k3_pk_open refusing an incomplete directory.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_io.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_test.h"

K3_TEST(man_record_layout_at_k3_size_is_one_aligned_17547264_byte_read)
{
    k3_pk_expert_layout xl;
    k3_err e = {0};
    CHECK_EQ_INT(k3_man_expert_layout(&xl, 3072, 3584, &e), 0);
    CHECK_EQ_U64(xl.record_bytes, 17547264);
    CHECK_EQ_U64(xl.stride, 17547264);
    CHECK_EQ_U64(xl.w1_packed, 0);
    CHECK_EQ_U64(xl.w1_scales, 3072ull * 3584 / 2);
    CHECK_EQ_U64(xl.w3_packed, xl.w1_scales + 3072ull * 3584 / 32);
    CHECK_EQ_U64(xl.w2_scales + 3584ull * 3072 / 32, xl.record_bytes);
    uint64_t off[6] = {xl.w1_packed, xl.w1_scales, xl.w3_packed, xl.w3_scales, xl.w2_packed, xl.w2_scales};
    for (int i = 0; i < 6; i++)
        CHECK_EQ_U64(off[i] % 64, 0);
    /* tiny: padding between sections, stride rounded to 4096 */
    CHECK_EQ_INT(k3_man_expert_layout(&xl, 32, 64, &e), 0);
    CHECK_EQ_U64(xl.record_bytes, 3264);
    CHECK_EQ_U64(xl.stride, 4096);
    CHECK_EQ_INT(k3_man_expert_layout(&xl, 33, 64, &e), K3_EFORMAT);
}

/* A converted tiny model to take a valid manifest from. */
static char *load_manifest(k3_man *m, uint64_t *len)
{
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/m", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/up --preset tiny --quiet && k3-convert --quiet %s/up %s",
                          k3t_tmpdir(), k3t_tmpdir(), dir), 0);
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    char *txt = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_io_read_file(path, 1u << 26, &txt, len, &e), 0);
    CHECK_EQ_INT(k3_man_parse(m, txt, *len, "manifest.json", &e), 0);
    return txt;
}

K3_TEST(man_serialise_then_parse_gives_the_same_text)
{
    k3_man m;
    uint64_t len;
    char *txt = load_manifest(&m, &len);
    char *again = k3_man_to_json(&m);
    CHECK_STR_EQ(txt, again);
    free(again);
    free(txt);
    k3_man_free(&m);
    k3_man_free(NULL);
}

/* Re-serialise a modified manifest (with a correct self hash) and expect the
 * parser to refuse it with a message containing `needle`. */
static void expect_refused(k3_man *m, const char *needle)
{
    char *t = k3_man_to_json(m);
    k3_man m2;
    k3_err e = {0};
    CHECK(t != NULL);
    int rc = k3_man_parse(&m2, t, strlen(t), "manifest.json", &e);
    if (rc == 0) {
        k3t_fail(__FILE__, __LINE__, "accepted a manifest that should fail with \"%s\"", needle);
        k3_man_free(&m2);
    } else {
        CHECK_STR_CONTAINS(e.msg, needle);
    }
    free(t);
}

K3_TEST(man_refuses_overlaps_misalignment_and_out_of_file_units)
{
    k3_man m;
    uint64_t len;
    char *txt = load_manifest(&m, &len);
    CHECK(m.nunits >= 2 && m.units[0].file == m.units[1].file);
    k3_pk_unit save = m.units[1];
    k3_pk_unit save0 = m.units[0];
    m.units[0].nbytes += 4096;
    expect_refused(&m, "overlaps");
    m.units[0] = save0;
    m.units[1] = save;
    m.units[1].offset += 100;
    expect_refused(&m, "multiples of 4096");
    m.units[1] = save;
    m.units[1].offset = m.files[m.units[1].file].size;
    expect_refused(&m, "lies outside");
    m.units[1] = save;
    k3_pk_piece *pc = (k3_pk_piece *)m.tensors[0].pieces;
    k3_pk_piece psave = *pc;
    pc->offset += 2;
    expect_refused(&m, "not 64-aligned inside unit");
    *pc = psave;
    pc->row_end -= 1;
    expect_refused(&m, "piece nbytes");
    *pc = psave;
    m.xl.w2_scales += 64;
    expect_refused(&m, "the layout says");
    free(txt);
    k3_man_free(&m);
}

K3_TEST(man_detects_a_hand_edit_by_its_self_hash)
{
    k3_man m;
    uint64_t len;
    char *txt = load_manifest(&m, &len);
    k3_man_free(&m);
    char *p = strstr(txt, "\"producer\"");
    CHECK(p != NULL);
    if (p)
        p[3] = 'R';
    k3_err e = {0};
    CHECK_EQ_INT(k3_man_parse(&m, txt, len, "manifest.json", &e), K3_ECORRUPT);
    CHECK_STR_CONTAINS(e.msg, "edited or corrupted");
    free(txt);
}

K3_TEST(man_index_rejects_records_outside_or_overlapping)
{
    k3_man m;
    uint64_t len;
    char *txt = load_manifest(&m, &len);
    uint64_t n = (uint64_t)k3_man_moe_layers(&m.cfg) * m.cfg.num_experts;
    k3_pk_record *r = calloc(n, sizeof *r);
    uint8_t *buf = malloc(k3_man_idx_size(&m.cfg));
    k3_err e = {0};
    /* a valid table: every record in the first experts file would overflow it,
     * so use distinct slots in the files the manifest lists */
    uint32_t xf = UINT32_MAX;
    for (uint32_t i = 0; i < m.nfiles; i++)
        if (m.files[i].kind == K3_PK_FILE_EXPERTS && xf == UINT32_MAX)
            xf = i;
    for (uint64_t i = 0; i < n; i++)
        r[i] = (k3_pk_record){xf, 0, 0};
    k3_man_idx_encode(buf, &m.cfg, m.xl.stride, r);
    CHECK_EQ_INT(k3_man_idx_decode(&m, buf, k3_man_idx_size(&m.cfg), r, "experts.idx", &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "overlaps");
    k3_err_clear(&e);
    r[0] = (k3_pk_record){xf, 0, m.files[xf].size};
    k3_man_idx_encode(buf, &m.cfg, m.xl.stride, r);
    CHECK_EQ_INT(k3_man_idx_decode(&m, buf, k3_man_idx_size(&m.cfg), r, "experts.idx", &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "4096-aligned inside");
    k3_err_clear(&e);
    r[0] = (k3_pk_record){0, 0, 0}; /* file 0 is a trunk file */
    k3_man_idx_encode(buf, &m.cfg, m.xl.stride, r);
    CHECK_EQ_INT(k3_man_idx_decode(&m, buf, k3_man_idx_size(&m.cfg), r, "experts.idx", &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "is not an experts file");
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_man_idx_decode(&m, buf, 10, r, "experts.idx", &e), K3_EFORMAT);
    free(buf);
    free(r);
    free(txt);
    k3_man_free(&m);
}

K3_TEST(pk_open_refuses_a_directory_without_manifest)
{
    k3_pk *pk = (k3_pk *)1;
    k3_err e = {0};
    CHECK_EQ_INT(k3_pk_open(&pk, k3t_tmpdir(), 0, &e), K3_ENOENT);
    CHECK(pk == NULL);
    CHECK_STR_CONTAINS(e.msg, "incomplete packed model: no manifest.json");
    k3_pk_close(NULL);
}

K3_TEST(pk_open_checks_file_sizes_and_the_record_table_hash)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/m", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/up --preset tiny --quiet && k3-convert --quiet %s/up %s",
                          k3t_tmpdir(), k3t_tmpdir(), dir), 0);
    k3_pk *pk = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_pk_open(&pk, dir, K3_PK_DIRECT, &e), 0);
    if (pk) {
        CHECK(k3_pk_tokenizer_file(pk, "tiktoken.model") != NULL);
        CHECK(k3_pk_tokenizer_file(pk, "nope") == NULL);
        CHECK(k3_pk_tensor_find(pk, K3_MAN_HEAD_NAME) != NULL);
        CHECK(k3_pk_record_find(pk, 0, 0) == NULL); /* layer 0 is dense */
        const k3_pk_record *r = k3_pk_record_find(pk, 1, 0);
        CHECK(r != NULL);
        /* a record read through the fault hook: a flipped bit is a CRC error */
        uint8_t *buf = k3_io_alloc_aligned(k3_pk_experts(pk)->stride, 4096);
        CHECK_EQ_INT(k3_pk_read_record(pk, 1, 0, buf, 1, &e), 0);
        char fault[256];
        snprintf(fault, sizeof fault, "flip:%s:%llu", k3_pk_file_at(pk, r->file)->name,
                 (unsigned long long)r->offset + 7);
        setenv("K3_FAULT", fault, 1);
        k3_io_fault_reset();
        CHECK_EQ_INT(k3_pk_read_record(pk, 1, 0, buf, 1, &e), K3_ECORRUPT);
        CHECK_STR_CONTAINS(e.msg, "layer 1 expert 0");
        unsetenv("K3_FAULT");
        k3_io_fault_reset();
        k3_io_free_aligned(buf);
        k3_pk_close(pk);
    }
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "truncate -s 4096 %s/trunk-0001.k3t", dir), 0);
    k3_err_clear(&e);
    CHECK_EQ_INT(k3_pk_open(&pk, dir, 0, &e), K3_EIO);
    CHECK_STR_CONTAINS(e.msg, "trunk-0001.k3t");
}
