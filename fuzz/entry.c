/*
 * entry.c - the libFuzzer driver: each fuzz binary links this file with
 * exactly one fuzz/fz_<name>.c, whose constructor registers its target here.
 * Built only by `make fuzz` (clang -fsanitize=fuzzer); never part of the
 * test binary, which has its own k3_fuzz_register (tests/t_fuzz_regress.c).
 *
 * The work directory is a fresh k3-fuzz.XXXXXX in $TMPDIR (default /dev/shm,
 * so per-input files cost no disk I/O), removed at normal exit.
 */
#include "k3_fuzz.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *target_name;
static k3_fuzz_fn target;
static char dir[1024];

void k3_fuzz_register(const char *name, k3_fuzz_fn fn)
{
    if (target) {
        fprintf(stderr, "k3-fuzz: two targets in one binary: %s and %s\n", target_name, name);
        abort();
    }
    target_name = name;
    target = fn;
}

static void remove_dir(void)
{
    char cmd[1100];
    if (!dir[0])
        return;
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "k3-fuzz: could not remove %s\n", dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    if (!target) {
        fprintf(stderr, "k3-fuzz: no target linked\n");
        abort();
    }
    const char *t = getenv("TMPDIR");
    if (!t || !*t || strlen(t) > 900)
        t = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/k3-fuzz.XXXXXX", t);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "k3-fuzz: mkdtemp %s: %s\n", dir, strerror(errno));
        abort();
    }
    k3_fuzz_set_workdir(dir);
    atexit(remove_dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    target(data, size);
    return 0;
}
