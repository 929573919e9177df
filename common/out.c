/*
 * out.c - checked output (see k3_out.h): the stdout check at exit, the
 * one-line error, and stream files published by rename.
 *
 * Invariant: a tool that called k3_out_init never exits 0 after a failed
 * write to stdout, and prints at most one error line.
 */
#include "k3_out.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_io.h"

static const char *out_tool = "k3";
static int out_failed;      /* an error line was printed already */

/* errno of a failed write on f: fflush retries what is pending and says
 * why; a stream whose data was already lost reports EIO. */
static int write_errno(FILE *f)
{
    errno = 0;
    if (fflush(f) != 0)
        return errno ? errno : EIO;
    return ferror(f) ? EIO : 0;
}

int k3_out_check(FILE *f, const char *name, k3_err *e)
{
    int en = write_errno(f);
    if (!en)
        return 0;
    return k3_err_sys(e, K3_EIO, en, "%s: write failed", name);
}

static void at_exit(void)
{
    if (out_failed)
        return;
    k3_err e = {0};
    int rc = k3_out_check(stdout, "stdout", &e);
    /* close reports what a network or delayed-allocation filesystem kept
     * back; a stdout that was never written to cannot fail here */
    if (rc == 0 && fclose(stdout) != 0 && errno != EBADF)
        rc = k3_err_sys(&e, K3_EIO, errno, "stdout: write failed at close");
    if (rc == 0)
        return;
    fprintf(stderr, "%s: error: %s\n", out_tool, e.msg);
    fflush(stderr);
    _exit(k3_err_exit_status(rc));
}

void k3_out_init(const char *tool)
{
    static int done;
    out_tool = tool;
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) >= 0 || errno != EBADF)
            continue;
        /* read-only even for 1 and 2: a write to it fails (EBADF) */
        int n = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (n >= 0 && n != fd) {
            dup2(n, fd);
            close(n);
        }
    }
    /* Off a terminal, one buffer for all a tool prints between checks (help,
     * a JSON object): a write that fails inside stdio's own flush leaves
     * only the error flag, not its errno, and "disk full" must be told as
     * such (exit 8), not as an I/O error. Streamed text is checked, and so
     * flushed, after every piece anyway. */
    static char buf[1 << 20];
    if (!done && !isatty(1))
        setvbuf(stdout, buf, _IOFBF, sizeof buf);
    if (!done && atexit(at_exit) == 0)
        done = 1;
}

void k3_out_failed(void)
{
    out_failed = 1;
}

int k3_out_error(int code, const char *fmt, ...)
{
    /* what was written to stdout goes out before the error line */
    fflush(stdout);
    fprintf(stderr, "%s: error: ", out_tool);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    out_failed = 1;
    return k3_err_exit_status(code);
}

/* ---- stream files ---------------------------------------------------------- */

int k3_outf_open(k3_outf *o, const char *path, k3_err *e)
{
    memset(o, 0, sizeof *o);
    if (snprintf(o->path, sizeof o->path, "%s", path) >= (int)sizeof o->path)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", path);
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        /* a device, a pipe, /dev/stdout: written in place, never replaced */
        if (S_ISDIR(st.st_mode))
            return k3_err_set(e, K3_EARG, "%s: is a directory", path);
        o->direct = 1;
        o->f = fopen(path, "w");
        if (!o->f)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot open for writing", path);
        return 0;
    }
    snprintf(o->tmp, sizeof o->tmp, "%s.tmp", path);
    o->f = fopen(o->tmp, "w");
    if (!o->f)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", o->tmp);
    return 0;
}

int k3_outf_commit(k3_outf *o, k3_err *e)
{
    if (!o->f)
        return k3_err_set(e, K3_EINTERNAL, "%s: not open", o->path);
    int rc = k3_out_check(o->f, o->path, e);
    if (o->direct) {
        if (fclose(o->f) != 0 && rc == 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: close", o->path);
        o->f = NULL;
        return rc;
    }
    if (rc == 0 && fsync(fileno(o->f)) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: fsync", o->path);
    if (fclose(o->f) != 0 && rc == 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: close", o->path);
    o->f = NULL;
    if (rc == 0 && rename(o->tmp, o->path) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot rename to %s", o->tmp, o->path);
    if (rc == 0)
        rc = k3_io_fsync_dir(o->path, e);
    if (rc)
        unlink(o->tmp);
    return rc;
}

void k3_outf_abort(k3_outf *o)
{
    if (!o || !o->f)
        return;
    fclose(o->f);
    o->f = NULL;
    if (!o->direct)
        unlink(o->tmp);
}
