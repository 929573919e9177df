/*
 * err.c - the k3_err record: formatting and the code -> exit status table.
 * The first error recorded wins the code; a later k3_err_set overwrites the
 * message only when the record is empty, so the root cause is what is shown.
 */
#include "k3_err.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void k3_err_clear(k3_err *e)
{
    if (!e)
        return;
    e->code = 0;
    e->sys_errno = 0;
    e->msg[0] = '\0';
}

static int vset(k3_err *e, int code, int errnum, const char *fmt, va_list ap)
{
    if (!e || e->code != 0)
        return code;
    e->code = code;
    e->sys_errno = errnum;
    int n = vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    if (n < 0)
        e->msg[0] = '\0';
    if (errnum) {
        size_t len = strlen(e->msg);
        snprintf(e->msg + len, sizeof e->msg - len, ": %s", strerror(errnum));
    }
    /* one line: a message is printed after "tool: error: " */
    for (char *p = e->msg; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    return code;
}

int k3_err_set(k3_err *e, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vset(e, code, 0, fmt, ap);
    va_end(ap);
    return code;
}

int k3_err_sys(k3_err *e, int code, int errnum, const char *fmt, ...)
{
    if (errnum == ENOSPC
#ifdef EDQUOT
        || errnum == EDQUOT
#endif
    )
        code = K3_ENOSPC;
    else if (errnum == ENOMEM)
        code = K3_ENOMEM;
    va_list ap;
    va_start(ap, fmt);
    vset(e, code, errnum, fmt, ap);
    va_end(ap);
    return code;
}

const char *k3_err_name(int code)
{
    switch (code) {
    case K3_OK: return "ok";
    case K3_EARG: return "usage";
    case K3_EFORMAT: return "format";
    case K3_EIO: return "io";
    case K3_ECORRUPT: return "corrupt";
    case K3_ENOMEM: return "nomem";
    case K3_ELIMIT: return "limit";
    case K3_EBUDGET: return "budget";
    case K3_EEXIST: return "exists";
    case K3_ENOSPC: return "nospace";
    case K3_EINTR: return "interrupted";
    case K3_ENOENT: return "missing";
    case K3_EINTERNAL: return "internal";
    }
    return "unknown";
}

int k3_err_exit_status(int code)
{
    switch (code) {
    case K3_OK: return K3_EXIT_OK;
    case K3_EARG: return K3_EXIT_USAGE;
    case K3_EFORMAT: return K3_EXIT_FORMAT;
    case K3_ENOENT: return K3_EXIT_IO;
    case K3_EIO: return K3_EXIT_IO;
    case K3_ECORRUPT: return K3_EXIT_CORRUPT;
    case K3_ENOMEM:
    case K3_ELIMIT:
    case K3_EBUDGET: return K3_EXIT_LIMIT;
    case K3_EEXIST: return K3_EXIT_EXISTS;
    case K3_ENOSPC: return K3_EXIT_NOSPC;
    case K3_EINTR: return K3_EXIT_INTR;
    }
    return K3_EXIT_INTERNAL;
}
