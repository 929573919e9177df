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
