/*
 * t_run_plan.c - k3-run on a k3-pack layout uses the budget recorded in its
 * manifest by default, and the answer is the same bits as a resident run.
 */
#include "k3_test.h"

#include <stdlib.h>

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
