/*
 * t_fuzz_regress.c - the fuzz corpora as regression tests.
 *
 * Every fuzz target linked into the test binary (fuzz/module.mk adds those
 * whose parser exists) registers here through k3_fuzz_register and becomes a
 * test "fuzz_<name>_corpus_replays_cleanly" that feeds every file of
 * fuzz/corpus/<name>/ (the seeds and every crash input ever found) to the
 * target in a normal build. A crash, an abort from a contract check, or (under
 * `make asan`) a sanitizer report or a leak fails the test and names the file.
 */
#include "../fuzz/k3_fuzz.h"
#include "k3_test.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include "k3_io.h"

#if defined(__SANITIZE_ADDRESS__)
#define K3T_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3T_ASAN 1
#endif
#endif
#ifdef K3T_ASAN
#include <sanitizer/common_interface_defs.h>
#include <sanitizer/lsan_interface.h>
#endif

#define MAX_TARGETS 16
#define MAX_CORPUS_FILES 4096
#define REPLAY_MAX_INPUT (1u << 20)

static struct {
    const char *name;
    k3_fuzz_fn fn;
    char test_name[96];
} targets[MAX_TARGETS];
static int ntargets;

static char current_input[1024];

/* Tell which input killed us, whatever killed us. */
static void say_current(void)
{
    static const char pre[] = "  fuzz replay: died on input ";
    if (!current_input[0])
        return;
    if (write(2, pre, sizeof pre - 1) < 0 || write(2, current_input, strlen(current_input)) < 0 ||
        write(2, "\n", 1) < 0)
        return;
}

static void on_signal(int sig)
{
    say_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void replay(int idx)
{
    const char *name = targets[idx].name;
    /* K3_FUZZ_CORPUS=fuzz/pending replays the inputs of known, unfixed bugs
     * (make fuzz-pending); a target with none there has nothing to replay. */
    const char *corpus = getenv("K3_FUZZ_CORPUS");
    int pending = corpus && *corpus;
    char dir[2048];
    snprintf(dir, sizeof dir, "%s/%s/%s", k3t_root(), pending ? corpus : "fuzz/corpus", name);
    DIR *d = opendir(dir);
    if (!d && pending && errno == ENOENT)
        return;
    if (!d)
        k3t_fail(__FILE__, __LINE__, "target %s has no corpus directory %s: %s", name, dir,
                 strerror(errno));
    char *files[MAX_CORPUS_FILES];
    int nfiles = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        CHECK(nfiles < MAX_CORPUS_FILES);
        files[nfiles++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(files, (size_t)nfiles, sizeof files[0], cmp_str);
    CHECK(nfiles > 0); /* a target with no seeds tests nothing */

    k3_fuzz_set_workdir(k3t_tmpdir());
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGABRT, on_signal);
    signal(SIGILL, on_signal);
    signal(SIGFPE, on_signal);
#ifdef K3T_ASAN
    __sanitizer_set_death_callback(say_current);
#else
    /* No sanitizer to catch a runaway allocation: cap the address space so an
     * allocation sized by a hostile header fails here instead of passing. */
    struct rlimit rl = {2ull << 30, 2ull << 30};
    setrlimit(RLIMIT_AS, &rl);
#endif
    for (int i = 0; i < nfiles; i++) {
        char path[3200];
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        snprintf(current_input, sizeof current_input, "%s/%s/%s", pending ? corpus : "fuzz/corpus",
                 name, files[i]);
        char *buf = NULL;
        uint64_t len = 0;
        k3_err e = {0};
        CHECK_EQ_INT(k3_io_read_file(path, REPLAY_MAX_INPUT, &buf, &len, &e), 0);
        /* an exact-size copy, so ASan sees any read past the end */
        uint8_t *exact = malloc(len ? len : 1);
        CHECK(exact != NULL);
        memcpy(exact, buf, len);
        free(buf);
        targets[idx].fn(exact, len);
        free(exact);
        free(files[i]);
    }
    current_input[0] = '\0';
#ifdef K3T_ASAN
    /* The test driver ends children with _exit, which skips LeakSanitizer's
     * exit-time check: run it here so a parser that leaks fails the test. */
    CHECK_EQ_INT(__lsan_do_recoverable_leak_check(), 0);
#endif
}

#define TRAMPOLINE(i) static void replay_##i(void) { replay(i); }
TRAMPOLINE(0) TRAMPOLINE(1) TRAMPOLINE(2) TRAMPOLINE(3) TRAMPOLINE(4) TRAMPOLINE(5)
TRAMPOLINE(6) TRAMPOLINE(7) TRAMPOLINE(8) TRAMPOLINE(9) TRAMPOLINE(10) TRAMPOLINE(11)
TRAMPOLINE(12) TRAMPOLINE(13) TRAMPOLINE(14) TRAMPOLINE(15)
static const k3t_fn trampolines[MAX_TARGETS] = {
    replay_0, replay_1, replay_2,  replay_3,  replay_4,  replay_5,  replay_6,  replay_7,
    replay_8, replay_9, replay_10, replay_11, replay_12, replay_13, replay_14, replay_15,
};

void k3_fuzz_register(const char *name, k3_fuzz_fn fn)
{
    if (ntargets == MAX_TARGETS) {
        fprintf(stderr, "k3-test: too many fuzz targets (raise MAX_TARGETS)\n");
        exit(2);
    }
    int i = ntargets++;
    targets[i].name = name;
    targets[i].fn = fn;
    snprintf(targets[i].test_name, sizeof targets[i].test_name, "fuzz_%s_corpus_replays_cleanly",
             name);
    k3t_register(targets[i].test_name, __FILE__, trampolines[i], 120);
}

static int registered(const char *name)
{
    for (int i = 0; i < ntargets; i++)
        if (!strcmp(targets[i].name, name))
            return 1;
    return 0;
}

/* No target may drop out silently: every fuzz/fz_<name>.c and every
 * fuzz/corpus/<name>/ has its target in this binary. */
K3_TEST(fuzz_every_target_is_built_and_has_a_corpus)
{
    const char *sub[2] = {"fuzz", "fuzz/corpus"};
    int seen = 0;
    for (int k = 0; k < 2; k++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", k3t_root(), sub[k]);
        DIR *d = opendir(dir);
        CHECK(d != NULL);
        if (!d)
            return;
        struct dirent *de;
        while ((de = readdir(d))) {
            char name[256];
            size_t n = strlen(de->d_name);
            if (k == 0) {
                if (strncmp(de->d_name, "fz_", 3) || n < 6 || strcmp(de->d_name + n - 2, ".c"))
                    continue;
                snprintf(name, sizeof name, "%.*s", (int)(n - 5), de->d_name + 3);
            } else {
                if (de->d_name[0] == '.')
                    continue;
                snprintf(name, sizeof name, "%s", de->d_name);
            }
            seen++;
            if (!registered(name))
                k3t_fail(__FILE__, __LINE__, "%s/%s: no fuzz target \"%s\" in the test binary", sub[k], de->d_name,
                         name);
        }
        closedir(d);
    }
    CHECK(seen >= 2 * ntargets);
}
