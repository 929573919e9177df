/*
 * run_trunk.c - the trunk dtypes of a model as k3-run reports them (see
 * run_trunk.h). A packed model's manifest records each tensor's stored dtype
 * and the rounding k3-convert was asked for; an upstream checkpoint's
 * headers give the dtypes directly (nothing there is ever rounded).
 */
#include "run_trunk.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_man.h"
#include "k3_st.h"

static int slot_of(k3_dtype d)
{
    return d == K3_DT_F32 ? 2 : d == K3_DT_F16 ? 1 : 0;
}

int k3_run_trunk_read(const char *dir, k3_run_trunk *t, k3_err *e)
{
    memset(t, 0, sizeof *t);
    char mp[4200];
    struct stat sb;
    int rc = k3_io_path_join(mp, sizeof mp, dir, "manifest.json", e);
    if (rc < 0)
        return rc;
    if (stat(mp, &sb) == 0) {
        char *txt;
        uint64_t len;
        k3_man m;
        memset(&m, 0, sizeof m);
        if ((rc = k3_io_read_file(mp, K3_MAN_MAX_BYTES, &txt, &len, e)) < 0)
            return rc;
        rc = k3_man_parse(&m, txt, len, mp, e);
        free(txt);
        if (rc < 0)
            return rc;
        t->packed = 1;
        for (uint32_t i = 0; i < m.ntensors; i++)
            t->n[slot_of(m.tensors[i].dtype)]++;
        t->rounded = m.trunk_rounded;
        k3_man_free(&m);
        return 0;
    }
    k3_cfg cfg;
    if ((rc = k3_io_path_join(mp, sizeof mp, dir, "config.json", e)) < 0 || (rc = k3_cfg_load(&cfg, mp, e)) < 0)
        return rc;
    k3_st *st = NULL;
    k3_man_expect *ex = NULL;
    uint32_t nex = 0;
    if ((rc = k3_st_open(&st, dir, 0, e)) < 0)
        return rc;
    if ((rc = k3_man_expect_trunk(&cfg, &ex, &nex, e)) < 0) {
        k3_st_close(st);
        return rc;
    }
    for (uint32_t i = 0; i < nex; i++) {
        const k3_st_tensor *s = k3_st_find(st, ex[i].name);
        if (s)
            t->n[slot_of(s->dtype)]++;
    }
    k3_man_expect_free(ex, nex);
    k3_st_close(st);
    return 0;
}

void k3_run_trunk_text(const k3_run_trunk *t, char *buf, size_t cap)
{
    uint32_t n = t->n[0] + t->n[1] + t->n[2];
    if (t->rounded)
        snprintf(buf, cap, "trunk: %u tensors, %u BF16, %u F16, %u F32; LOSSY: %u rounded to BF16 by "
                 "k3-convert --trunk-dtype bf16", n, t->n[0], t->n[1], t->n[2], t->rounded);
    else
        snprintf(buf, cap, "trunk: %u tensors, %u BF16, %u F16, %u F32, %s", n, t->n[0], t->n[1], t->n[2],
                 t->packed ? "as stored upstream (lossless)" : "the upstream checkpoint's own");
}

void k3_run_trunk_json(const k3_run_trunk *t, char *buf, size_t cap)
{
    snprintf(buf, cap, "{\"BF16\":%u,\"F16\":%u,\"F32\":%u,\"rounded\":%u,\"lossy\":%s}", t->n[0], t->n[1], t->n[2],
             t->rounded, t->rounded ? "true" : "false");
}
