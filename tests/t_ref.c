/*
 * t_ref.c - runs the self-tests of the float64 NumPy reference (tests/ref/),
 * so that a broken reference fails `make test` instead of silently judging
 * the runtime. The reference is Python run only by /usr/bin/python3 (Debian's
 * interpreter with python3-numpy); it never runs at k3 run time.
 */
#include "k3_test.h"

#include <stdlib.h>

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
