/*
 * ws.c - what every weight source shares: k3_ws_open choosing the source for
 * a directory. The slots' names and where they appear are the tensor schema
 * (common/schema.c).
 */
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>

#include "k3_io.h"
#include "k3_ws.h"

int k3_ws_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    int k = k3_io_dir_kind(dir, e);   /* permission, a file, missing: said exactly */
    if (k < 0)
        return k;
    if (k == K3_DIR_PACKED)
        return k3_ws_pk_open(out, dir, flags, e);
    if (k == K3_DIR_UPSTREAM)
        return k3_ws_st_open(out, dir, flags, e);
    return k3_io_dir_expect(dir, K3_DIR_PACKED, "k3-run", e);  /* unfinished, or not a model */
}

void k3_ws_close(k3_ws *ws)
{
    if (ws)
        ws->ops->close(ws);
}
