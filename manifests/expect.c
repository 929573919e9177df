/*
 * expect.c - the trunk tensors a config implies (the tensor schema,
 * common/schema.c) and the parser of routed-expert tensor names.
 *
 * Matrices are checked shape for shape; vectors by element count only (an
 * exporter may write [E] or [1, E]); A_log may hold H or D values.
 */
#include "k3_man.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct builder {
    k3_man_expect *v;
    uint32_t n, cap;
    int oom;
} builder;

static void add(builder *b, int32_t layer, k3_man_tkind kind, uint32_t ndim, uint64_t d0, uint64_t d1,
                uint64_t d2, const char *fmt, ...) __attribute__((format(printf, 8, 9)));

#include <stdarg.h>
static void add(builder *b, int32_t layer, k3_man_tkind kind, uint32_t ndim, uint64_t d0, uint64_t d1,
                uint64_t d2, const char *fmt, ...)
{
    if (b->oom)
        return;
    if (b->n == b->cap) {
        uint32_t nc = b->cap ? b->cap * 2 : 64;
        k3_man_expect *nv = realloc(b->v, nc * sizeof *nv);
        if (!nv) {
            b->oom = 1;
            return;
        }
        b->v = nv;
        b->cap = nc;
    }
    char name[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    k3_man_expect *x = &b->v[b->n];
    memset(x, 0, sizeof *x);
    x->name = strdup(name);
    if (!x->name) {
        b->oom = 1;
        return;
    }
    x->kind = kind;
    x->layer = layer;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->shape[2] = d2;
    b->n++;
}

static int expect_cmp(const void *a, const void *b)
{
    return strcmp(((const k3_man_expect *)a)->name, ((const k3_man_expect *)b)->name);
}

/* one expected tensor per schema row of the group (layer L, the head or the embedding) */
static void add_row(builder *b, const k3_cfg *c, const k3_sch_row *r, int32_t layer, uint32_t g)
{
    uint64_t sh[3];
    k3_schema_shape(c, r, sh);
    char name[512];
    k3_schema_name(name, sizeof name, r->slot, g, 1);
    switch (r->cls) {
    case K3_SCH_MATRIX:
    case K3_SCH_CONV:     /* [n][1][cw], shape for shape */
        add(b, layer, K3_MAN_T_MATRIX, r->ndim, sh[0], sh[1], sh[2], "%s", name);
        break;
    case K3_SCH_VECTOR:
        add(b, layer, K3_MAN_T_VECTOR, 1, sh[0], 0, 0, "%s", name);
        break;
    case K3_SCH_ALOG:     /* H values, or D */
        add(b, layer, K3_MAN_T_ALOG, 1, sh[0], k3_schema_dim(c, K3_SD_D), 0, "%s", name);
        break;
    }
}

int k3_man_expect_trunk(const k3_cfg *c, k3_man_expect **out, uint32_t *n, k3_err *e)
{
    builder b = {0};
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    const uint32_t NL = c->num_hidden_layers;
    for (uint32_t i = 0; i < nrows; i++) {
        if (rows[i].where == K3_SCH_IN_EMBED)
            add_row(&b, c, &rows[i], K3_PK_LAYER_EMBED, 0);
        else if (k3_schema_in_group(c, &rows[i], NL))
            add_row(&b, c, &rows[i], K3_PK_LAYER_HEAD, NL);
    }
    for (uint32_t L = 0; L < NL; L++)
        for (uint32_t i = 0; i < nrows; i++)
            if (k3_schema_in_group(c, &rows[i], L))
                add_row(&b, c, &rows[i], (int32_t)L, L);
    if (b.oom) {
        k3_man_expect_free(b.v, b.n);
        return k3_err_set(e, K3_ENOMEM, "out of memory listing the expected tensors");
    }
    qsort(b.v, b.n, sizeof *b.v, expect_cmp);
    *out = b.v;
    *n = b.n;
    return 0;
}

void k3_man_expect_free(k3_man_expect *x, uint32_t n)
{
    if (!x)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(x[i].name);
    free(x);
}

const k3_man_expect *k3_man_expect_find(const k3_man_expect *x, uint32_t n, const char *name)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(x[mid].name, name);
        if (c == 0)
            return &x[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int k3_man_expect_match(const k3_man_expect *x, const k3_st_tensor *t)
{
    uint64_t count = 1;
    for (uint32_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] && count > UINT64_MAX / t->shape[d])
            return 0;
        count *= t->shape[d];
    }
    switch (x->kind) {
    case K3_MAN_T_MATRIX:
        if (t->ndim != x->ndim)
            return 0;
        for (uint32_t d = 0; d < x->ndim; d++)
            if (t->shape[d] != x->shape[d])
                return 0;
        return 1;
    case K3_MAN_T_VECTOR:
        return count == x->shape[0];
    case K3_MAN_T_ALOG:
        return count == x->shape[0] || count == x->shape[1];
    }
    return 0;
}

/* Parse a decimal index without sign or leading zeros; advances *s. */
static int parse_index(const char **s, uint32_t *v)
{
    const char *p = *s;
    if (*p < '0' || *p > '9' || (*p == '0' && p[1] >= '0' && p[1] <= '9'))
        return 0;
    uint64_t x = 0;
    while (*p >= '0' && *p <= '9') {
        x = x * 10 + (uint64_t)(*p - '0');
        if (x > UINT32_MAX)
            return 0;
        p++;
    }
    *v = (uint32_t)x;
    *s = p;
    return 1;
}

int k3_man_expert_name(const char *name, uint32_t *layer, uint32_t *expert, int *which, int *part)
{
    static const char pre[] = K3_SCH_PREFIX "layers.";
    static const char mid[] = K3_SCH_EXPERTS;
    if (strncmp(name, pre, sizeof pre - 1))
        return 0;
    const char *s = name + sizeof pre - 1;
    if (!parse_index(&s, layer) || strncmp(s, mid, sizeof mid - 1))
        return 0;
    s += sizeof mid - 1;
    if (!parse_index(&s, expert) || s[0] != '.' || s[1] != 'w' || s[2] < '1' || s[2] > '3' || s[3] != '.')
        return 0;
    *which = s[2] - '1';
    s += 4;
    static const char *parts[K3_MAN_XP_COUNT] = {K3_SCH_XP_PACKED, K3_SCH_XP_SCALE, K3_SCH_XP_WEIGHT,
                                                          K3_SCH_XP_SCALE_INV};
    for (int i = 0; i < K3_MAN_XP_COUNT; i++)
        if (!strcmp(s, parts[i])) {
            *part = i;
            return 1;
        }
    return 0;
}
