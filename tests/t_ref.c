/*
 * t_ref.c - runs the self-tests of the float64 NumPy reference (tests/ref/),
 * so that a broken reference fails `make test` instead of silently judging
 * the runtime. The reference is Python run only by /usr/bin/python3 (Debian's
 * interpreter with python3-numpy); it never runs at k3 run time.
 */
#include "k3_test.h"

#include <stdlib.h>
#include <unistd.h>

K3_TEST(ref_reference_passes_its_own_selftests)
{
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "/usr/bin/python3 %s/tests/ref/selftest.py", k3t_root());
    if (rc != 0)
        fprintf(stderr, "%s%s", out ? out : "", err ? err : "");
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(out, " 0 failed");
    free(out);
    free(err);
}

/* The planted bugs must be far outside the logit gate on the checkpoint the
 * runtime is compared on (k3-synth --preset tiny): a plant that is a no-op
 * there (e.g. a preset with no more layers than one AttnRes block) would let a
 * broken runtime pass. Needs bin/k3-synth; says so and passes without it. */
K3_TEST(ref_planted_bugs_break_the_logit_gate_on_the_tiny_preset)
{
    char synth[4096];
    snprintf(synth, sizeof synth, "%s/k3-synth", k3t_bindir());
    if (access(synth, X_OK) != 0) {
        fprintf(stderr, "  skipped: %s not built\n", synth);
        return;
    }
    const char *dir = k3t_tmpdir(), *root = k3t_root();
    const char *ids = "1,2,3,4,5,6,7,8,9,10,11,12";
    char *out = NULL, *err = NULL;
    CHECK_EQ_INT(k3t_runf(NULL, &err, "k3-synth %s/tiny --preset tiny --quiet", dir), 0);
    free(err);
    int rc = k3t_runf(&out, &err, "/usr/bin/python3 %s/tests/ref/k3ref.py %s/tiny --ids %s --logits-all %s/good.bin",
                      root, dir, ids, dir);
    if (rc != 0)
        fprintf(stderr, "%s", err ? err : "");
    CHECK_EQ_INT(rc, 0);
    CHECK_STR_CONTAINS(out, "\"prompt_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]");
    free(out);
    free(err);
    static const char *const plants[] = {"nibble_swap", "biased_combine", "no_attnres_reset", "conv_reverse"};
    for (size_t i = 0; i < sizeof plants / sizeof plants[0]; i++) {
        CHECK_EQ_INT(k3t_runf(NULL, NULL,
                              "/usr/bin/python3 %s/tests/ref/k3ref.py %s/tiny --ids %s --plant %s --logits-all %s/%s.bin",
                              root, dir, ids, plants[i], dir, plants[i]), 0);
        out = NULL;
        rc = k3t_runf(&out, NULL, "/usr/bin/python3 %s/tests/ref/cmp_logits.py %s/%s.bin %s/good.bin --ckpt %s/tiny",
                      root, dir, plants[i], dir, dir);
        fprintf(stderr, "  plant %s: %s", plants[i], out ? out : "(no output)\n");
        CHECK_EQ_INT(rc, 1); /* 1 = outside the 1e-4 gate */
        free(out);
    }
}
