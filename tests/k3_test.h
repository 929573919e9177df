/*
 * k3_test.h - the test harness: tests register themselves (no central table
 * to edit), each runs in its own child process with a timeout, and failures
 * print both values with file:line.
 *
 *   K3_TEST(st_rejects_header_past_eof) {
 *       CHECK_EQ_INT(k3_st_open(&st, dir, 0, &e), K3_EFORMAT);
 *       CHECK_STR_CONTAINS(e.msg, "past end of file");
 *   }
 *
 * Helpers: k3t_tmpdir() is a fresh empty directory for the current test
 * (removed after it passes); k3t_run() runs a shell command line with the
 * built binaries first on PATH and captures exit status, stdout and stderr.
 */
#ifndef K3_TEST_H
#define K3_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef void (*k3t_fn)(void);

void k3t_register(const char *name, const char *file, k3t_fn fn, int timeout_s);
void k3t_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define K3_TEST_TIMEOUT(name, secs)                                                  \
    static void k3t_##name(void);                                                    \
    __attribute__((constructor)) static void k3t_reg_##name(void)                    \
    {                                                                                \
        k3t_register(#name, __FILE__, k3t_##name, secs);                             \
    }                                                                                \
    static void k3t_##name(void)

#define K3_TEST(name) K3_TEST_TIMEOUT(name, 120)

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond))                                                                 \
            k3t_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);                        \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                           \
    do {                                                                             \
        long long k3t_a = (long long)(a), k3t_b = (long long)(b);                    \
        if (k3t_a != k3t_b)                                                          \
            k3t_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, k3t_a, k3t_b); \
    } while (0)

#define CHECK_EQ_U64(a, b)                                                           \
    do {                                                                             \
        unsigned long long k3t_a = (unsigned long long)(a), k3t_b = (unsigned long long)(b); \
        if (k3t_a != k3t_b)                                                          \
            k3t_fail(__FILE__, __LINE__, "%s == %s: %llu != %llu", #a, #b, k3t_a, k3t_b); \
    } while (0)

#define CHECK_STR_EQ(a, b)                                                           \
    do {                                                                             \
        const char *k3t_a = (a), *k3t_b = (b);                                       \
        if (!k3t_a || !k3t_b || strcmp(k3t_a, k3t_b))                                \
            k3t_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b,       \
                     k3t_a ? k3t_a : "(null)", k3t_b ? k3t_b : "(null)");            \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                              \
    do {                                                                             \
        const char *k3t_h = (hay), *k3t_n = (needle);                                \
        if (!k3t_h || !strstr(k3t_h, k3t_n))                                         \
            k3t_fail(__FILE__, __LINE__, "%s contains \"%s\": it is \"%s\"", #hay,   \
                     k3t_n, k3t_h ? k3t_h : "(null)");                               \
    } while (0)

/* A fresh empty directory for this test; removed when the test passes. */
const char *k3t_tmpdir(void);

/* Run `cmd` with /bin/sh. *out and *err (either may be NULL) receive heap,
 * NUL-terminated copies of stdout and stderr (caller frees). Returns the exit
 * status, 128+signal if killed by a signal, -1 if it could not run. */
int k3t_run(const char *cmd, char **out, char **err);
/* printf-style convenience: k3t_runf(&out, &err, "k3-verify %s", dir). */
int k3t_runf(char **out, char **err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Path of the repository root (tests run from it) and of the built binaries. */
const char *k3t_root(void);
const char *k3t_bindir(void);

/* End the current test as skipped, with the reason (printf-style): the driver
 * prints "skip NAME (reason)" and counts it in its closing line. Only for a
 * test that cannot mean anything here (say, valgrind on an emulated build),
 * never to hide a failure. */
void k3t_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* The host architecture when this test binary runs under user-mode emulation
 * (an aarch64 build under qemu-aarch64 on x86-64, see k3_kern_emulated), or
 * NULL when it runs natively. */
const char *k3t_emulated(void);

/* The tests' xorshift64 generator (13, 7, 17): the next value of *state.
 * Each file keeps its own state and seed, so its cases stay what they were. */
static inline uint64_t k3t_xorshift(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

#endif
