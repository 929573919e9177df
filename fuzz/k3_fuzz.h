/*
 * k3_fuzz.h - fuzz targets for every parser of untrusted input.
 *
 * A target is one function `int k3_fuzz_<name>(const uint8_t *data, size_t size)`
 * written with K3_FUZZ_TARGET(name). It feeds the bytes to a parser, checks the
 * parser's contract (0 or a known negative code, a one-line message on every
 * error, round trips where the API promises them) and aborts on any breach.
 * A constructor registers it with k3_fuzz_register, which two programs
 * implement:
 *   - fuzz/entry.c: the libFuzzer driver (one target per binary, built with
 *     clang -fsanitize=fuzzer by `make fuzz`);
 *   - tests/t_fuzz_regress.c: the test binary, where every registered target
 *     becomes a test replaying fuzz/corpus/<name>/ (seeds and every crash ever
 *     found), so the regression corpus is part of `make test` and `make asan`.
 *
 * Targets that need files get them from k3_fuzz_workdir(): a private directory
 * the driver owns (a test's tmpdir, or a fresh directory in $TMPDIR).
 */
#ifndef K3_FUZZ_H
#define K3_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#include "k3_err.h"

typedef int (*k3_fuzz_fn)(const uint8_t *data, size_t size);

/* Implemented by the driver (fuzz/entry.c or tests/t_fuzz_regress.c). */
void k3_fuzz_register(const char *name, k3_fuzz_fn fn);

#define K3_FUZZ_TARGET(name)                                                        \
    int k3_fuzz_##name(const uint8_t *data, size_t size);                           \
    __attribute__((constructor)) static void k3_fuzz_reg_##name(void)               \
    {                                                                               \
        k3_fuzz_register(#name, k3_fuzz_##name);                                    \
    }                                                                               \
    int k3_fuzz_##name(const uint8_t *data, size_t size)

/* ---- helpers (fuzz/util.c) ------------------------------------------------- */

/* The directory targets may write into; set by the driver before the first
 * input. Never NULL once set; k3_fuzz_workdir aborts if it was not set. */
void k3_fuzz_set_workdir(const char *dir);
const char *k3_fuzz_workdir(void);

/* An anonymous in-memory file (memfd) holding data; the caller closes it.
 * Aborts if the kernel refuses (that is the harness's fault, not the input's). */
int k3_fuzz_memfd(const uint8_t *data, size_t size);

/* Write data to workdir/name (created or truncated); aborts on failure.
 * out (capacity cap) receives the full path when not NULL. */
void k3_fuzz_write(const char *name, const void *data, size_t size, char *out, size_t cap);

/* Remove workdir/name if present. */
void k3_fuzz_unlink(const char *name);

/*
 * The contract every parser owes its caller, checked after each call:
 * rc is 0 or one of the K3_E* codes; on failure the error record is set
 * (code, non-empty one-line message). Aborts with a message naming what on a
 * breach.
 */
void k3_fuzz_check_result(int rc, const k3_err *e, const char *what);

/* Abort with a message (a contract breach the sanitizers cannot see). */
void k3_fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* Split an input in two at the first occurrence of the separator line
 * "\n--8<--\n" (for targets that take two files). Without a separator the
 * whole input is the first part and the second is empty. */
void k3_fuzz_split(const uint8_t *data, size_t size, const uint8_t **a, size_t *a_len,
                   const uint8_t **b, size_t *b_len);

#define K3_FUZZ_SEP "\n--8<--\n"

#endif
