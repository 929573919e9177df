/*
 * util.c - helpers shared by the fuzz targets (see k3_fuzz.h): the work
 * directory, in-memory files, and the error-contract check.
 *
 * Harness failures (cannot create a memfd, cannot write the work directory)
 * abort: they are not findings about the input, and silently skipping the
 * input would hide that nothing was tested.
 */
#include "k3_fuzz.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char workdir[1024];

void k3_fuzz_fail(const char *fmt, ...)
{
    va_list ap;
    fputs("k3-fuzz: contract breach: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

void k3_fuzz_set_workdir(const char *dir)
{
    if (strlen(dir) >= sizeof workdir)
        k3_fuzz_fail("work directory path too long: %s", dir);
    memcpy(workdir, dir, strlen(dir) + 1);
}

const char *k3_fuzz_workdir(void)
{
    if (!workdir[0])
        k3_fuzz_fail("no work directory set by the driver");
    return workdir;
}

int k3_fuzz_memfd(const uint8_t *data, size_t size)
{
    int fd = memfd_create("k3-fuzz", MFD_CLOEXEC);
    if (fd < 0)
        k3_fuzz_fail("memfd_create: %s", strerror(errno));
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, data + done, size - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            k3_fuzz_fail("write to memfd: %s", strerror(errno));
        done += (size_t)w;
    }
    return fd;
}

void k3_fuzz_write(const char *name, const void *data, size_t size, char *out, size_t cap)
{
    char path[2048];
    int n = snprintf(path, sizeof path, "%s/%s", k3_fuzz_workdir(), name);
    if (n < 0 || (size_t)n >= sizeof path)
        k3_fuzz_fail("path too long: %s", name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        k3_fuzz_fail("cannot create %s: %s", path, strerror(errno));
    size_t done = 0;
    while (done < size) {
        ssize_t w = write(fd, (const char *)data + done, size - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            k3_fuzz_fail("write %s: %s", path, strerror(errno));
        done += (size_t)w;
    }
    close(fd);
    if (out) {
        if ((size_t)n >= cap)
            k3_fuzz_fail("path buffer too small for %s", path);
        memcpy(out, path, (size_t)n + 1);
    }
}

void k3_fuzz_unlink(const char *name)
{
    char path[2048];
    int n = snprintf(path, sizeof path, "%s/%s", k3_fuzz_workdir(), name);
    if (n > 0 && (size_t)n < sizeof path)
        unlink(path);
}

void k3_fuzz_check_result(int rc, const k3_err *e, const char *what)
{
    if (rc == 0)
        return;
    if (rc < K3_EINTERNAL || rc > 0)
        k3_fuzz_fail("%s returned %d, not 0 or a K3_E* code", what, rc);
    if (rc == K3_EINTERNAL)
        k3_fuzz_fail("%s reported an internal error: %s", what, e->msg);
    if (e->code == 0)
        k3_fuzz_fail("%s returned %d (%s) without filling the error record", what, rc,
                     k3_err_name(rc));
    if (!e->msg[0])
        k3_fuzz_fail("%s returned %d (%s) with an empty message", what, rc, k3_err_name(rc));
    if (strchr(e->msg, '\n') || strchr(e->msg, '\r'))
        k3_fuzz_fail("%s: message is not one line", what);
}

void k3_fuzz_split(const uint8_t *data, size_t size, const uint8_t **a, size_t *a_len,
                   const uint8_t **b, size_t *b_len)
{
    static const char sep[] = K3_FUZZ_SEP;
    const size_t sl = sizeof sep - 1;
    *a = data;
    *a_len = size;
    *b = data + size;
    *b_len = 0;
    if (size < sl)
        return;
    for (size_t i = 0; i + sl <= size; i++) {
        if (data[i] == '\n' && !memcmp(data + i, sep, sl)) {
            *a_len = i;
            *b = data + i + sl;
            *b_len = size - i - sl;
            return;
        }
    }
}
