/*
 * t_lossless.c - a packed model computes exactly what its upstream
 * checkpoint computes: trunk tensors keep their stored dtype through
 * k3-convert and k3-pack, rounding to BF16 happens only on request and is
 * recorded, packed models of schema 1 (which rounded silently) are refused,
 * and what the converter left out is recorded.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_err.h"
#include "k3_io.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_st.h"
#include "k3_test.h"

static char *path_in(const char *name)
{
    static char buf[8][4096];
    static int i;
    char *p = buf[i++ & 7];
    snprintf(p, 4096, "%s/%s", k3t_tmpdir(), name);
    return p;
}

static void run_ok(const char *what, const char *cmd)
{
    char *err = NULL;
    int st = k3t_run(cmd, NULL, &err);
    if (st != 0)
        k3t_fail(__FILE__, __LINE__, "%s: exit %d: %s (%s)", what, st, err ? err : "", cmd);
    free(err);
}

/* A schema-1 manifest (whose trunk may have been rounded to BF16 without a
 * record) is never read: every tool that reads models says to convert
 * again; k3-run and k3-pack exit 3, k3-verify lists it as its problem. */
K3_TEST(lossless_schema1_packed_models_are_refused_with_convert_again)
{
    const char *up = path_in("up"), *pk = path_in("pk");
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", up, up, pk);
    run_ok("synth + convert", cmd);
    snprintf(cmd, sizeof cmd, "sed -i 's/\"schema_version\":\\([[:space:]]*\\)2,/\"schema_version\":\\11,/' %s/manifest.json && "
             "grep -c '\"schema_version\":[[:space:]]*1,' %s/manifest.json", pk, pk);
    run_ok("edit schema_version", cmd);
    static const char *const tools[] = {"k3-run %s --ids 1,2 --gen 1", "k3-pack %s %s/re --ram floor --quiet"};
    for (int i = 0; i < 2; i++) {
        char *err = NULL;
        CHECK_EQ_INT(k3t_runf(NULL, &err, tools[i], pk, k3t_tmpdir()), 3);
        CHECK_STR_CONTAINS(err, "schema_version 1");
        CHECK_STR_CONTAINS(err, "convert the checkpoint again");
        CHECK(err && strchr(err, '\n') == err + strlen(err) - 1);       /* one line */
        free(err);
    }
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s 2>&1", pk), 1);
    CHECK_STR_CONTAINS(out, "convert the checkpoint again");
    free(out);
}

/* --trunk-dtype bf16 is lossy and says so in the manifest; the default is
 * as stored; anything else is a usage error. */
K3_TEST(lossless_trunk_dtype_bf16_is_recorded_as_lossy)
{
    const char *up = path_in("up"), *a = path_in("a"), *b = path_in("b");
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s && "
             "k3-convert --quiet --trunk-dtype bf16 %s %s", up, up, a, up, b);
    run_ok("synth + convert twice", cmd);
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-convert --trunk-dtype f8 %s %s/c", up, k3t_tmpdir()), 2);
    CHECK_STR_CONTAINS(err, "k3-convert: error: --trunk-dtype needs source or bf16");
    free(err);
    k3_st *st = NULL;
    k3_err e = {0};
    CHECK_EQ_INT(k3_st_open(&st, up, 0, &e), 0);
    for (int pass = 0; pass < 2 && st; pass++) {
        k3_pk *pk = NULL;
        CHECK_EQ_INT(k3_pk_open(&pk, pass ? b : a, 0, &e), 0);
        if (!pk)
            break;
        uint32_t rounded = 0, nonbf16 = 0;
        for (uint32_t i = 0; i < k3_pk_tensor_count(pk); i++) {
            const k3_pk_tensor *t = k3_pk_tensor_at(pk, i);
            const k3_st_tensor *s = k3_st_find(st, t->name);
            CHECK(s != NULL);
            if (!s)
                continue;
            nonbf16 += s->dtype != K3_DT_BF16;
            CHECK_EQ_INT(t->src_dtype, s->dtype);
            CHECK_EQ_INT(t->dtype, pass ? K3_DT_BF16 : s->dtype);
            rounded += t->dtype != t->src_dtype;
        }
        CHECK(nonbf16 > 0);
        CHECK_EQ_INT(rounded, pass ? nonbf16 : 0);
        k3_pk_close(pk);
        char path[4200], *txt = NULL;
        uint64_t len = 0;
        snprintf(path, sizeof path, "%s/manifest.json", pass ? b : a);
        CHECK_EQ_INT(k3_io_read_file(path, 1u << 26, &txt, &len, &e), 0);
        CHECK_STR_CONTAINS(txt, pass ? "\"lossy\":\ttrue" : "\"lossy\":\tfalse");
        CHECK_STR_CONTAINS(txt, pass ? "\"dtypes\":\t\"bf16\"" : "\"dtypes\":\t\"source\"");
        free(txt);
    }
    k3_st_close(st);
}

/* ---- the matrix: every trunk-dtype mode x {flat, nested} x {MXFP4, BF16
 * experts}: the upstream directory and its packed model give bit-identical
 * logits at every prompt position and the same 32 greedy tokens; so do the
 * packed model streamed at its floor, and a k3-pack --ram floor layout of it
 * at its recorded budget. */

#define MATRIX_IDS "1,5,9,100,200,300,17,42,7,7,7,8,450,3,2,1,99,98,97,500,501"

static void matrix_case(const char *mode, const char *form, const char *experts)
{
    char d[4200], cmd[32768];
    snprintf(d, sizeof d, "%s/%s-%s-%s", k3t_tmpdir(), mode, form, experts);
    /* the nested (multimodal) form also carries a vision tower, which the
     * converter leaves out */
    snprintf(cmd, sizeof cmd,
             "set -e; D=%s; mkdir -p $D; "
             "k3-synth $D/up --preset tiny --trunk-dtype %s --config-form %s --experts %s %s --no-tokenizer --quiet; "
             "k3-convert --quiet $D/up $D/pk; "
             "k3-pack $D/pk $D/pf --ram floor --quiet; "
             "R='--ids " MATRIX_IDS " --gen 32 --threads 2'; "
             "k3-run $D/up $R --logits-all $D/up.la > $D/up.ids; "
             "k3-run $D/pk $R --logits-all $D/pk.la > $D/pk.ids; "
             "k3-run $D/pk $R --ram floor --logits-all $D/pkf.la > $D/pkf.ids 2>/dev/null; "
             "k3-run $D/pf $R --logits-all $D/pf.la > $D/pf.ids 2>/dev/null; "
             "for x in pk pkf pf; do "
             "  cmp $D/up.la $D/$x.la >&2 || { echo \"$x: logits differ from upstream\" >&2; exit 11; }; "
             "  cmp $D/up.ids $D/$x.ids >&2 || { echo \"$x: tokens differ from upstream\" >&2; exit 12; }; "
             "done; "
             "test $(tr ',' '\\n' < $D/up.ids | grep -c .) -eq 32 || { echo 'not 32 tokens' >&2; exit 13; }; "
             "test $(stat -c %%s $D/up.la) -eq $((21 * 4 * $(grep -o '\"vocab_size\":[[:space:]]*[0-9]*' $D/up/config.json | "
             "grep -o '[0-9]*$'))) || { echo 'logits-all size' >&2; exit 14; }",
             d, mode, form, experts, strcmp(form, "nested") ? "" : "--vision");
    char *err = NULL;
    int rc = k3t_run(cmd, NULL, &err);
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "%s %s %s experts: exit %d: %s", mode, form, experts, rc, err ? err : "");
    free(err);
}

static void matrix_mode(const char *mode)
{
    static const char *const forms[] = {"flat", "nested"}, *const experts[] = {"mxfp4", "bf16"};
    for (int f = 0; f < 2; f++)
        for (int x = 0; x < 2; x++)
            matrix_case(mode, forms[f], experts[x]);
}

K3_TEST(lossless_bf16_trunk_upstream_packed_floor_bit_identical) { matrix_mode("bf16"); }
K3_TEST(lossless_real_trunk_upstream_packed_floor_bit_identical) { matrix_mode("real"); }
K3_TEST(lossless_f32_trunk_upstream_packed_floor_bit_identical) { matrix_mode("f32"); }
K3_TEST(lossless_f16_trunk_upstream_packed_floor_bit_identical) { matrix_mode("f16"); }
K3_TEST(lossless_mixed_trunk_upstream_packed_floor_bit_identical) { matrix_mode("mixed"); }

/* What each k3-synth trunk mode writes: real puts the routers, conv taps
 * and AttnRes projections ([1][E]) in F32 and leaves the other matrices
 * BF16; f32 and f16 everything; mixed all three dtypes among matrices and
 * among vectors (the tiny default); the experts are never affected. */
K3_TEST(lossless_synth_trunk_modes_write_the_dtypes_they_promise)
{
    static const char *const modes[] = {"real", "f32", "f16", "mixed", "tiny-default"};
    for (int mi = 0; mi < 5; mi++) {
        char dir[4200], cmd[8800];
        snprintf(dir, sizeof dir, "%s/%s", k3t_tmpdir(), modes[mi]);
        snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --quiet --no-tokenizer %s%s", dir,
                 mi < 4 ? "--trunk-dtype " : "", mi < 4 ? modes[mi] : "");
        run_ok(modes[mi], cmd);
        k3_st *st = NULL;
        k3_err e = {0};
        CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), 0);
        if (!st)
            return;
        uint32_t mat[3] = {0}, vec[3] = {0}, router_f32 = 0, routers = 0, taps_f32 = 0, res1 = 0, other_f32 = 0;
        for (uint64_t i = 0; i < k3_st_tensor_count(st); i++) {
            const k3_st_tensor *t = k3_st_tensor_at(st, i);
            if (strstr(t->name, ".experts.")) {
                CHECK(t->dtype == K3_DT_U8);
                continue;
            }
            int d = t->dtype == K3_DT_BF16 ? 0 : t->dtype == K3_DT_F16 ? 1 : t->dtype == K3_DT_F32 ? 2 : -1;
            CHECK(d >= 0);
            if (d < 0)
                continue;
            int is_router = strstr(t->name, "block_sparse_moe.gate.weight") != NULL;
            int is_tap = strstr(t->name, "_conv1d.weight") != NULL;
            int is_res = strstr(t->name, "_res_proj.weight") != NULL;
            routers += is_router;
            router_f32 += is_router && d == 2;
            taps_f32 += is_tap && d == 2;
            res1 += is_res && t->ndim == 2 && t->shape[0] == 1;
            int matrix = t->ndim >= 2 && !is_res;
            (matrix ? mat : vec)[d]++;
            if (matrix && d == 2 && !is_router && !is_tap)
                other_f32++;
        }
        CHECK(routers > 0);
        switch (mi) {
        case 0:
            CHECK_EQ_INT(router_f32, routers);
            CHECK(taps_f32 > 0 && res1 > 0);
            CHECK_EQ_INT(other_f32, 0);
            CHECK(mat[0] > 0 && mat[1] == 0);
            break;
        case 1: CHECK(mat[0] == 0 && mat[1] == 0 && vec[0] == 0 && vec[1] == 0); break;
        case 2: CHECK(mat[0] == 0 && mat[2] == 0 && vec[0] == 0 && vec[2] == 0); break;
        default:
            for (int k = 0; k < 3; k++)
                CHECK(mat[k] > 0 && vec[k] > 0);
            CHECK(router_f32 > 0 && res1 > 0);
        }
        k3_st_close(st);
    }
}

/* The tools say what the conversion did: k3-verify of a packed model names
 * the stored dtypes, LOSSY when k3-convert rounded, and the tensors it left
 * out (a vision tower), in its text and its --json; k3-run --version MODEL
 * and --json say the same. */
K3_TEST(lossless_verify_and_run_report_dtypes_lossy_and_left_out)
{
    const char *up = path_in("up"), *a = path_in("a"), *b = path_in("b");
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "k3-synth %s --preset tiny --config-form nested --vision --quiet && "
             "k3-convert --quiet %s %s && k3-convert --quiet --trunk-dtype bf16 %s %s", up, up, a, up, b);
    run_ok("synth + convert twice", cmd);
    for (int pass = 0; pass < 2; pass++) {
        const char *d = pass ? b : a;
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify %s", d), 0);
        CHECK_STR_CONTAINS(out, "left out: 3 tensors outside language_model. (");
        CHECK_STR_CONTAINS(out, pass ? "LOSSY: " : "all as stored upstream (lossless)");
        if (pass)
            CHECK_STR_CONTAINS(out, " 0 F16, 0 F32; LOSSY");
        free(out);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-verify --json %s", d), 0);
        CHECK_STR_CONTAINS(out, "\"left_out\":{\"outside_language_model\":3,");
        CHECK_STR_CONTAINS(out, pass ? "\"lossy\":true" : "\"lossy\":false");
        if (pass)
            CHECK_STR_CONTAINS(out, "\"f16\":0,\"f32\":0,");
        free(out);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --version", d), 0);
        CHECK_STR_CONTAINS(out, pass ? "LOSSY: " : "as stored upstream (lossless)");
        free(out);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --ids 1,2 --gen 1 --json", d), 0);
        CHECK_STR_CONTAINS(out, pass ? "\"lossy\":true" : "\"lossy\":false");
        free(out);
    }
    /* the upstream checkpoint's own dtypes, from its headers */
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-run %s --version", up), 0);
    CHECK_STR_CONTAINS(out, "the upstream checkpoint's own");
    free(out);
    /* k3-pack keeps the records */
    out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "k3-pack %s %s/p --ram floor --quiet && k3-verify --quick %s/p", b,
                          k3t_tmpdir(), k3t_tmpdir()), 0);
    CHECK_STR_CONTAINS(out, "LOSSY: ");
    CHECK_STR_CONTAINS(out, "left out: 3 tensors outside language_model. (");
    free(out);
}

/* The independent float64 reference (tests/ref/k3ref.py, on the upstream
 * files) against k3-run on the packed model, for the trunk modes the gate
 * tests (tiny = mixed, flat) do not run: within the 1e-4 logit gate. Seed 4:
 * seed 1 in real mode has one ill-conditioned position where even the
 * reference's own float32 mode is 1.8e-4 from its float64. */
K3_TEST_TIMEOUT(lossless_trunk_modes_stay_within_the_reference_gate, 300)
{
    static const char *const cases[][2] = {{"real", "flat"}, {"f32", "flat"}, {"f16", "nested"}, {"mixed", "nested"}};
    for (int i = 0; i < 4; i++) {
        char cmd[16384];
        snprintf(cmd, sizeof cmd,
                 "set -e; D=%s/%s-%s; k3-synth $D --preset tiny --seed 4 --trunk-dtype %s --config-form %s --quiet; "
                 "k3-convert --quiet $D $D.k3; "
                 "k3-run $D.k3 --ids " MATRIX_IDS " --gen 0 --logits-all $D.got > /dev/null; "
                 "/usr/bin/python3 %s/tests/ref/k3ref.py $D --ids " MATRIX_IDS " --logits-all $D.ref > /dev/null; "
                 "/usr/bin/python3 %s/tests/ref/cmp_logits.py $D.got $D.ref --ckpt $D",
                 k3t_tmpdir(), cases[i][0], cases[i][1], cases[i][0], cases[i][1], k3t_root(), k3t_root());
        char *out = NULL, *err = NULL;
        int rc = k3t_run(cmd, &out, &err);
        if (rc != 0)
            k3t_fail(__FILE__, __LINE__, "%s %s: exit %d: %s%s", cases[i][0], cases[i][1], rc, out ? out : "",
                     err ? err : "");
        else
            fprintf(stderr, "%s %s: %s", cases[i][0], cases[i][1], out ? out : "");
        free(out);
        free(err);
    }
}
