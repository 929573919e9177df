/*
 * t_arch.c - the same bits on every architecture. K3_OTHER_BIN names the
 * tools of a build for another architecture (make test-arm64 runs the
 * aarch64 suite under qemu with the x86-64 build there, and the x86-64 test
 * with the aarch64 tools, wrapped for qemu): the tiny model that either
 * build's k3-synth writes is the same bytes, and its --logits-all from every
 * exact kernel path of both builds (x86-64: scalar, avx2, avx512; aarch64:
 * scalar, neon; each where the CPU or emulator runs it) are cmp-equal.
 * Without K3_OTHER_BIN the test is skipped and says so.
 */
#include "k3_test.h"

#include <stdlib.h>

static const char *const isas[] = {"scalar", "avx2", "avx512", "neon"};

/* Whether the k3-run at prefix (empty: this build's, on PATH) takes K3_ISA=isa
 * as asked, i.e. its --version names exactly that path. */
static int runs_isa(const char *prefix, const char *isa)
{
    char *out = NULL, want[64];
    snprintf(want, sizeof want, "kernels: %s (K3_ISA)", isa);
    int ok = k3t_runf(&out, NULL, "K3_ISA=%s %sk3-run --version", isa, prefix) == 0 && out && strstr(out, want);
    free(out);
    return ok;
}

K3_TEST_TIMEOUT(arch_tiny_model_and_logits_identical_to_the_other_architecture, 300)
{
    const char *other = getenv("K3_OTHER_BIN");
    if (!other || !*other)
        k3t_skip("K3_OTHER_BIN is not set: make test-arm64 runs this against the other architecture's build");
    const char *tmp = k3t_tmpdir();
    char prefix[2][1100] = {"", ""};
    snprintf(prefix[1], sizeof prefix[1], "%s/", other);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s/tiny --preset tiny --quiet", tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "%sk3-synth %s/tiny-other --preset tiny --quiet", prefix[1], tmp), 0);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "diff -r %s/tiny %s/tiny-other", tmp, tmp), 0);
    int ran[2] = {0, 0};
    char first[1200] = "";
    for (int b = 0; b < 2; b++)
        for (size_t i = 0; i < sizeof isas / sizeof *isas; i++) {
            if (!runs_isa(prefix[b], isas[i]))
                continue;
            char out[1200];
            snprintf(out, sizeof out, "%s/%s-%s.bin", tmp, b ? "other" : "here", isas[i]);
            CHECK_EQ_INT(k3t_runf(NULL, NULL, "K3_ISA=%s %sk3-run %s/tiny --ids 1,2,3,4,5,6,7 --gen 0 "
                                  "--logits-all %s", isas[i], prefix[b], tmp, out), 0);
            if (!first[0])
                snprintf(first, sizeof first, "%s", out);
            else if (k3t_runf(NULL, NULL, "cmp %s %s", first, out) != 0)
                k3t_fail(__FILE__, __LINE__, "%s differs from %s", out, first);
            ran[b]++;
        }
    /* each build ran its scalar path and at least one SIMD path */
    CHECK(ran[0] >= 2);
    CHECK(ran[1] >= 2);
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "test -s %s", first), 0);
}
