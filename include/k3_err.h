/*
 * k3_err.h - error codes and the caller-owned error record.
 *
 * Every fallible library function returns int: 0 on success, a negative
 * K3_E* code otherwise. The library never prints and never exits; it fills a
 * k3_err that the caller owns, whose message names the file, the tensor or
 * layer/expert, the byte offset and what was expected against what was found.
 * Tools turn the code into a documented exit status with k3_err_exit_status().
 */
#ifndef K3_ERR_H
#define K3_ERR_H

#include <stddef.h>

enum {
    K3_OK        = 0,
    K3_EARG      = -1,  /* bad argument or usage (command line, API misuse by caller) */
    K3_EFORMAT   = -2,  /* input does not follow its format: bad header, bad JSON, bad shape */
    K3_EIO       = -3,  /* read/write/open failed, short read, truncated file */
    K3_ECORRUPT  = -4,  /* checksum or hash mismatch: bytes are not what they should be */
    K3_ENOMEM    = -5,  /* allocation failed */
    K3_ELIMIT    = -6,  /* a size read from a file exceeds a documented bound */
    K3_EBUDGET   = -7,  /* a RAM budget cannot be honoured */
    K3_EEXIST    = -8,  /* destination exists and --force was not given */
    K3_ENOSPC    = -9,  /* disk full */
    K3_EINTR     = -10, /* interrupted by a signal */
    K3_ENOENT    = -11, /* a required file or tensor is missing */
    K3_EINTERNAL = -12, /* a bug in k3 */
};

#define K3_ERR_MSG_MAX 1024

typedef struct k3_err {
    int code;                   /* K3_E* of the first error recorded, 0 if none */
    int sys_errno;              /* errno at the failure, 0 if not a system error */
    char msg[K3_ERR_MSG_MAX];   /* one line, no trailing newline */
} k3_err;

/* Reset e to "no error". Accepts NULL. */
void k3_err_clear(k3_err *e);

/* Record an error (printf-style message) and return code, so that callers can
 * write `return k3_err_set(e, K3_EFORMAT, "%s: ...", path);`. e may be NULL. */
int k3_err_set(k3_err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Like k3_err_set, appending ": strerror(errnum)" and keeping errnum. ENOSPC and
 * EDQUOT become K3_ENOSPC whatever code is given; EINTR is kept as K3_EIO. */
int k3_err_sys(k3_err *e, int code, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Short stable name of a code ("format", "io", ...). */
const char *k3_err_name(int code);

/*
 * Process exit status for a code. Documented in README.md and every --help:
 *   0 success          1 verification found problems (k3-verify)
 *   2 usage            3 bad input format     4 I/O error
 *   5 corrupt data     6 out of memory / over a limit or budget
 *   7 destination exists   8 disk full    9 internal error   130 interrupted
 */
int k3_err_exit_status(int code);

#define K3_EXIT_OK       0
#define K3_EXIT_PROBLEMS 1
#define K3_EXIT_USAGE    2
#define K3_EXIT_FORMAT   3
#define K3_EXIT_IO       4
#define K3_EXIT_CORRUPT  5
#define K3_EXIT_LIMIT    6
#define K3_EXIT_EXISTS   7
#define K3_EXIT_NOSPC    8
#define K3_EXIT_INTERNAL 9
#define K3_EXIT_INTR     130

#endif
