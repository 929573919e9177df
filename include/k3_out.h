/*
 * k3_out.h - checked output: no write error passes silently.
 *
 * Everything a tool writes goes through one of three paths, each checked:
 *
 * - stdout: k3_out_init (first thing in main) makes sure descriptors 0-2 are
 *   open (a closed one is reserved on /dev/null, read-only for 1 and 2, so
 *   that writes to a closed stdout fail with EBADF instead of landing in a
 *   file the tool opens later) and registers a check at exit: if any write
 *   to stdout failed (fflush / ferror / fclose), the tool prints one line
 *   "k3-TOOL: error: stdout: write failed: <reason>" and exits 8 (disk full:
 *   ENOSPC, EDQUOT) or 4 (any other error: EPIPE, EBADF, EIO), whatever
 *   main returned, unless the tool already reported an error through
 *   k3_out_error. Loops that stream to stdout call k3_out_check after each
 *   piece and stop on the first failure (k3-run's generation).
 * - files written whole: k3_io_write_file_atomic (k3_io.h).
 * - files written as a stream (k3-run --trace): k3_outf_* below, a
 *   "<path>.tmp" renamed over PATH only when every write, the flush, the
 *   fsync and the close succeeded; on failure nothing is left.
 *
 * SIGPIPE keeps its default action (a tool writing into a closed pipe ends
 * quietly, as Unix filters do); where the caller ignores SIGPIPE the write
 * fails with EPIPE and the rules above apply (exit 4).
 */
#ifndef K3_OUT_H
#define K3_OUT_H

#include <stdio.h>

#include "k3_err.h"

/* Name the tool ("k3-run") for messages, reserve descriptors 0-2, register
 * the stdout check at exit. Call once, first thing in main. */
void k3_out_init(const char *tool);

/* Flush f and report any write error on it so far: 0, or K3_ENOSPC / K3_EIO
 * with "NAME: write failed: <strerror>" in e. */
int k3_out_check(FILE *f, const char *name, k3_err *e);

/* Print "k3-TOOL: error: MSG" on stderr (one line), remember that the run
 * failed (the exit check then prints nothing more) and return the exit
 * status of code (k3_err_exit_status). */
int k3_out_error(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Mark the run as failed without printing (the tool printed its error). */
void k3_out_failed(void);

/* A file written as a stream and published atomically. */
typedef struct k3_outf {
    FILE *f;            /* write through this */
    char path[4096];
    char tmp[4104];
    int direct;         /* PATH is not a regular file (a device, a pipe): written in place */
} k3_outf;

/* Create "<path>.tmp" (replacing a stale one) for writing. A PATH that
 * exists and is not a regular file (/dev/stdout, a pipe, a device) is
 * written in place: never renamed over. */
int k3_outf_open(k3_outf *o, const char *path, k3_err *e);
/* Flush, fsync, close and rename over path. On failure the temporary is
 * removed and the error (K3_ENOSPC for a full disk) returned. */
int k3_outf_commit(k3_outf *o, k3_err *e);
/* Close and remove the temporary (error paths). Accepts an unopened o. */
void k3_outf_abort(k3_outf *o);

#endif
