/*
 * t_valgrind.c - scripts/valgrind-check as part of make test: every built
 * tool, on a tiny model, success and error paths, under memcheck with leak
 * checking. Skipped (with a note) under make asan, whose binaries valgrind
 * cannot run, where valgrind is not installed, and for an emulated build
 * (make test-arm64), whose tools are qemu processes.
 */
#include "k3_test.h"

#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__)
#define K3T_VG_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3T_VG_ASAN 1
#endif
#endif

K3_TEST_TIMEOUT(tools_leak_nothing_under_valgrind, 600)
{
#ifdef K3T_VG_ASAN
    fprintf(stderr, "  (skipped: valgrind cannot run ASan binaries)\n");
    return;
#endif
    if (k3t_emulated())
        k3t_skip("valgrind cannot run this emulated build's tools (an aarch64 build under qemu on %s)",
                 k3t_emulated());
    if (k3t_run("command -v valgrind", NULL, NULL) != 0) {
        fprintf(stderr, "  (skipped: valgrind is not installed)\n");
        return;
    }
    char *out = NULL, *err = NULL;
    int rc = k3t_runf(&out, &err, "TMPDIR=%s %s/scripts/valgrind-check %s", k3t_tmpdir(), k3t_root(),
                      k3t_bindir());
    if (rc != 0)
        k3t_fail(__FILE__, __LINE__, "valgrind-check exited %d:\n%s%s", rc, out ? out : "",
                 err ? err : "");
    CHECK_STR_CONTAINS(out, "clean");
    free(out);
    free(err);
}
