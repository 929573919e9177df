/*
 * t_run_plan.c - k3-run on a k3-pack layout uses the budget recorded in its
 * manifest by default, and the answer is the same bits as a resident run.
 */
#include "k3_test.h"

#include <stdlib.h>
#include <string.h>

K3_TEST(run_uses_the_budget_a_pack_layout_records_by_default)
{
    const char *d = k3t_tmpdir();
    char *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/up --preset tiny --seed 3 --quiet", d), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-convert --quiet %s/up %s/pk", d, d), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-pack --quiet --ram floor %s/pk %s/small", d, d), 0);

    /* converted model: no recorded budget, resident, nothing on stderr */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/pk --ids 5,6,7,8 --gen 6 --logits %s/a.f32", d, d), 0);
    CHECK(err && !strstr(err, "memory plan"));
    free(err);

    /* packed for the floor: streams within the recorded budget by default */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/small --ids 5,6,7,8 --gen 6 --logits %s/b.f32", d, d), 0);
    CHECK_STR_CONTAINS(err, "memory plan");
    CHECK_STR_CONTAINS(err, ": within");
    free(err);

    /* an explicit budget overrides it */
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s/small --ids 5,6,7,8 --gen 6 --ram resident --logits %s/c.f32",
                          d, d), 0);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/a.f32 %s/b.f32 && cmp %s/a.f32 %s/c.f32", d, d, d, d), 0);
}

/* --plan --probe measures the reads and products and prints a prediction for
 * the floor, the budget asked and everything resident; --probe alone is a
 * usage error. */
K3_TEST(run_plan_probe_predicts_every_budget_it_can_hold)
{
    char up[4096], pk[4096], *out = NULL, *err = NULL;
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", up, up, pk), 0);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 1,2,3 --ram floor --plan --probe", pk), 0);
    CHECK_STR_EQ(out, "");
    CHECK_STR_CONTAINS(err, "k3-run: probe (");
    CHECK_STR_CONTAINS(err, "GB/s trunk");
    CHECK_STR_CONTAINS(err, "O_DIRECT");
    CHECK_STR_CONTAINS(err, "predicted s/token");
    CHECK_STR_CONTAINS(err, "probe: routes of the 3 prompt ids by the routers of");
    CHECK_STR_CONTAINS(err, "chunk experts     prompt bound");
    CHECK_STR_CONTAINS(err, "floor (this budget)");
    CHECK_STR_CONTAINS(err, "resident");
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids 1,2,3 --ram 64M --plan --probe", pk), 0);
    CHECK_STR_CONTAINS(err, "this budget");
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 1,2,3 --ram floor --probe", pk), 2);
    CHECK_STR_CONTAINS(err, "--probe goes with --plan");
    free(err);
}

/* Without --chunk a size budget takes the longest pass it holds (256 ids
 * here), the floor keeps 64, --chunk wins; the logits are the same bits. */
K3_TEST(run_chunk_is_chosen_from_the_budget_with_the_same_bits)
{
    char up[4096], pk[4096], *err = NULL, *out = NULL;
    const char *t = k3t_tmpdir();
    snprintf(up, sizeof up, "%s/up", t);
    snprintf(pk, sizeof pk, "%s/pk", t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", up, up, pk), 0);
    char ids[2048] = "";
    for (int i = 1; i <= 300; i++)
        snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", i > 1 ? "," : "", i % 500);
    static const struct { const char *args; int chunk; } c[] = {
        {"--ram 1G", 256}, {"--ram floor", 64}, {"--ram 1G --chunk 16", 16}, {"--ram 1G --chunk 64", 64}};
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids %s --gen 4 %s --json --logits-all %s/l%zu", pk, ids,
                              c[i].args, t, i),
                     0);
        char want[64];
        snprintf(want, sizeof want, "\"chunk\":%d", c[i].chunk);
        CHECK_STR_CONTAINS(out, want);
        snprintf(want, sizeof want, "chunk          %9d ids per pass", c[i].chunk);
        CHECK_STR_CONTAINS(err, want);
        free(out);
        free(err);
        if (i)
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/l0 %s/l%zu", t, t, i), 0);
    }
}

/* A size budget that holds a pass of 128 but not 256 plans the streaming
 * source twice (256 first); the second layout must start over (it once
 * appended to the first's parts, past their array) and give the same bits. */
K3_TEST(run_replanned_for_a_shorter_chunk_lays_out_afresh)
{
    char up[4096], pk[4096], *err = NULL;
    const char *t = k3t_tmpdir();
    snprintf(up, sizeof up, "%s/up", t);
    snprintf(pk, sizeof pk, "%s/pk", t);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --quiet && k3-convert --quiet %s %s", up, up, pk), 0);
    unsigned long long f[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 5,6,7,8 --ram floor --chunk %d --ram-piece 8K --plan", pk,
                              i ? 256 : 128), 0);
        const char *s = err ? strstr(err, "floor  ") : NULL;
        s = s ? strchr(s, '(') : NULL;
        f[i] = s ? strtoull(s + 1, NULL, 10) : 0;
        free(err);
    }
    CHECK(f[0] > 0 && f[1] > f[0]);
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-run %s --ids 5,6,7,8 --gen 4 --ram %llu --ram-piece 8K --logits-all %s/a",
                          pk, (f[0] + f[1]) / 2, t), 0);
    CHECK_STR_CONTAINS(err, "chunk                128 ids per pass");
    free(err);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-run %s --ids 5,6,7,8 --gen 4 --logits-all %s/b", pk, t), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "cmp %s/a %s/b", t, t), 0);
}
