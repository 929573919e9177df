/*
 * man.c - manifest.json of a packed model: parse + validate, serialise
 * (manifests/FORMAT.md §2).
 *
 * Invariant: a k3_man returned by k3_man_parse satisfies every rule of
 * FORMAT.md §2 that does not need the data files: schema, types, integer
 * ranges, alignment, units and pieces inside their files/units and not
 * overlapping, tensor tables consistent, experts layout equal to the one the
 * config implies. Every rejection names the manifest and the item.
 */
#include "k3_man.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_EXACT ((double)(1ull << 53))
#define ZERO_HEX "0000000000000000000000000000000000000000000000000000000000000000"

static const char *kind_names[K3_PK_FILE_KIND_COUNT] = {"trunk", "experts", "expert_index", "tokenizer",
                                                               "embed_row_crcs"};

void k3_man_hex(const uint8_t sha[32], char out[65])
{
    static const char d[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        out[2 * i] = d[sha[i] >> 4];
        out[2 * i + 1] = d[sha[i] & 15];
    }
    out[64] = '\0';
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int k3_man_unhex(const char *s, uint8_t sha[32])
{
    if (!s || strlen(s) != 64)
        return -1;
    for (int i = 0; i < 32; i++) {
        int h = hexval(s[2 * i]), l = hexval(s[2 * i + 1]);
        if (h < 0 || l < 0)
            return -1;
        sha[i] = (uint8_t)(h << 4 | l);
    }
    return 0;
}

char *k3_man_seal(const char *body, size_t len, size_t *out_len)
{
    char *txt = malloc(65 + len);
    uint8_t sha[32];
    if (!txt || EVP_Digest(body, len, sha, NULL, EVP_sha256(), NULL) != 1) {
        free(txt);
        return NULL;
    }
    k3_man_hex(sha, txt);
    txt[64] = '\n';
    memcpy(txt + 65, body, len);
    *out_len = 65 + len;
    return txt;
}

const char *k3_man_unseal(const char *txt, uint64_t len, size_t *body_len)
{
    char hex[65];
    uint8_t want[32], got[32];
    if (len < 65 || txt[64] != '\n')
        return NULL;
    memcpy(hex, txt, 64);
    hex[64] = '\0';
    if (k3_man_unhex(hex, want) ||
        EVP_Digest(txt + 65, (size_t)(len - 65), got, NULL, EVP_sha256(), NULL) != 1 || memcmp(want, got, 32))
        return NULL;
    *body_len = (size_t)(len - 65);
    return txt + 65;
}

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

int k3_man_expert_layout(k3_pk_expert_layout *xl, uint64_t I, uint64_t L, k3_err *e)
{
    memset(xl, 0, sizeof *xl);
    if (I == 0 || L == 0 || I % 32 || L % 32 || I > (1u << 20) || L > (1u << 20))
        return k3_err_set(e, K3_EFORMAT, "expert shape I=%" PRIu64 " L=%" PRIu64
                          " is not a positive multiple of 32 below 2^20", I, L);
    xl->rows_w13 = (uint32_t)I;
    xl->cols_w13 = (uint32_t)L;
    xl->rows_w2 = (uint32_t)L;
    xl->cols_w2 = (uint32_t)I;
    xl->w13_packed_bytes = I * L / 2;
    xl->w13_scales_bytes = I * L / 32;
    xl->w2_packed_bytes = L * I / 2;
    xl->w2_scales_bytes = L * I / 32;
    const uint64_t A = K3_PK_SECTION_ALIGN;
    uint64_t o = 0;
    xl->w1_packed = o;
    o = align_up(o + xl->w13_packed_bytes, A);
    xl->w1_scales = o;
    o = align_up(o + xl->w13_scales_bytes, A);
    xl->w3_packed = o;
    o = align_up(o + xl->w13_packed_bytes, A);
    xl->w3_scales = o;
    o = align_up(o + xl->w13_scales_bytes, A);
    xl->w2_packed = o;
    o = align_up(o + xl->w2_packed_bytes, A);
    xl->w2_scales = o;
    xl->record_bytes = o + xl->w2_scales_bytes;
    xl->stride = align_up(xl->record_bytes, K3_PK_ALIGN);
    return 0;
}

uint32_t k3_man_moe_layers(const k3_cfg *cfg)
{
    return cfg->num_hidden_layers > cfg->first_k_dense_replace
               ? cfg->num_hidden_layers - cfg->first_k_dense_replace
               : 0;
}

void k3_man_free(k3_man *m)
{
    if (!m)
        return;
    free(m->producer);
    free(m->cfg_json);
    for (uint32_t i = 0; i < m->nfiles; i++)
        free((char *)m->files[i].name);
    free(m->files);
    for (uint32_t i = 0; i < m->nsrc_shards; i++)
        free(m->src_shards[i].name);
    free(m->src_shards);
    for (uint32_t i = 0; i < m->nsrc_files; i++)
        free(m->src_files[i].name);
    free(m->src_files);
    free(m->units);
    for (uint32_t i = 0; i < m->ntensors; i++) {
        free((char *)m->tensors[i].name);
        free((k3_pk_piece *)m->tensors[i].pieces);
    }
    free(m->tensors);
    free(m->plan_json);
    memset(m, 0, sizeof *m);
}

/* ---- parsing helpers ------------------------------------------------------ */

typedef struct pctx {
    const char *path;
    k3_err *e;
} pctx;

/* The trunk dtypes of a manifest: "BF16", "F16", "F32". 0, or -1 for anything else. */
static int dtype_of(const char *s, k3_dtype *t)
{
    if (!strcmp(s, "BF16"))
        *t = K3_DT_BF16;
    else if (!strcmp(s, "F16"))
        *t = K3_DT_F16;
    else if (!strcmp(s, "F32"))
        *t = K3_DT_F32;
    else
        return -1;
    return 0;
}

static const char *dtype_str(k3_dtype t)
{
    return t == K3_DT_F32 ? "F32" : t == K3_DT_F16 ? "F16" : "BF16";
}

static int bad(pctx *p, const char *what, const char *detail)
{
    return k3_err_set(p->e, K3_EFORMAT, "%s: %s: %s", p->path, what, detail);
}

static const cJSON *need(pctx *p, const cJSON *obj, const char *key, const char *where, int *rc)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v && *rc == 0) {
        char w[256];
        snprintf(w, sizeof w, "%s", where);
        *rc = k3_err_set(p->e, K3_EFORMAT, "%s: %s: missing key \"%s\"", p->path, w, key);
    }
    return v;
}

static int get_u64(pctx *p, const cJSON *obj, const char *key, const char *where, uint64_t *out)
{
    int rc = 0;
    const cJSON *v = need(p, obj, key, where, &rc);
    if (rc)
        return rc;
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d < 0 || d >= MAX_EXACT || d != (double)(uint64_t)d)
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: \"%s\" is not a non-negative integer below 2^53",
                          p->path, where, key);
    *out = (uint64_t)d;
    return 0;
}

static int get_i64(pctx *p, const cJSON *obj, const char *key, const char *where, int64_t *out)
{
    int rc = 0;
    const cJSON *v = need(p, obj, key, where, &rc);
    if (rc)
        return rc;
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d <= -MAX_EXACT || d >= MAX_EXACT || d != (double)(int64_t)d)
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: \"%s\" is not an integer", p->path, where, key);
    *out = (int64_t)d;
    return 0;
}

static int get_str(pctx *p, const cJSON *obj, const char *key, const char *where, const char **out)
{
    int rc = 0;
    const cJSON *v = need(p, obj, key, where, &rc);
    if (rc)
        return rc;
    if (!cJSON_IsString(v) || !v->valuestring)
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: \"%s\" is not a string", p->path, where, key);
    *out = v->valuestring;
    return 0;
}

static int get_sha(pctx *p, const cJSON *obj, const char *where, uint8_t sha[32])
{
    const char *s;
    int rc = get_str(p, obj, "sha256", where, &s);
    if (rc)
        return rc;
    if (k3_man_unhex(s, sha))
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: sha256 is not 64 lower-case hex digits", p->path, where);
    return 0;
}

static int get_array(pctx *p, const cJSON *obj, const char *key, const char *where, const cJSON **arr,
                     uint32_t *n, uint32_t max)
{
    int rc = 0;
    const cJSON *v = need(p, obj, key, where, &rc);
    if (rc)
        return rc;
    if (!cJSON_IsArray(v))
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: \"%s\" is not an array", p->path, where, key);
    int c = cJSON_GetArraySize(v);
    if (c < 0 || (uint32_t)c > max)
        return k3_err_set(p->e, K3_ELIMIT, "%s: %s: \"%s\" has %d entries, limit %u", p->path, where, key,
                          c, max);
    *arr = v;
    *n = (uint32_t)c;
    return 0;
}

static int valid_fname(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > K3_MAN_MAX_FNAME || s[0] == '.' || strchr(s, '/') || !strcmp(s, "manifest.json"))
        return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20)
            return 0;
    return 1;
}

static int parse_src(pctx *p, const cJSON *arr, uint32_t n, const char *what, k3_man_src **out)
{
    k3_man_src *s = calloc(n ? n : 1, sizeof *s);
    if (!s)
        return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
    *out = s;
    uint32_t i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        char where[96];
        snprintf(where, sizeof where, "source.%s[%u]", what, i);
        const char *name;
        int rc = get_str(p, it, "name", where, &name);
        if (!rc)
            rc = get_u64(p, it, "size", where, &s[i].size);
        if (!rc)
            rc = get_sha(p, it, where, s[i].sha256);
        if (rc)
            return rc;
        if (!(s[i].name = strdup(name)))
            return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
    }
    return 0;
}

typedef struct span {
    uint32_t file;
    uint64_t off, len;
    const char *what;
    uint64_t id;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->file != y->file)
        return x->file < y->file ? -1 : 1;
    if (x->off != y->off)
        return x->off < y->off ? -1 : 1;
    return 0;
}

/* Sort spans and report the first overlap. */
static int check_overlaps(pctx *p, span *s, uint64_t n, const char *(*fname)(void *, uint32_t), void *ctx)
{
    qsort(s, n, sizeof *s, span_cmp);
    for (uint64_t i = 1; i < n; i++)
        if (s[i].file == s[i - 1].file && s[i - 1].off + s[i - 1].len > s[i].off)
            return k3_err_set(p->e, K3_EFORMAT,
                              "%s: %s %" PRIu64 " [%" PRIu64 ", +%" PRIu64 ") overlaps %s %" PRIu64
                              " at offset %" PRIu64 " in %s",
                              p->path, s[i].what, s[i].id, s[i].off, s[i].len, s[i - 1].what, s[i - 1].id,
                              s[i - 1].off, fname ? fname(ctx, s[i].file) : "?");
    return 0;
}

static const char *man_fname(void *ctx, uint32_t f)
{
    const k3_man *m = ctx;
    return f < m->nfiles ? m->files[f].name : "?";
}

static int parse_trunk(pctx *p, k3_man *m, const cJSON *trunk)
{
    const cJSON *arr;
    uint32_t n;
    int rc = get_array(p, trunk, "units", "trunk", &arr, &n, K3_MAN_MAX_ITEMS);
    if (rc)
        return rc;
    m->units = calloc(n ? n : 1, sizeof *m->units);
    if (!m->units)
        return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
    m->nunits = n;
    uint32_t i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "trunk.units[%u]", i);
        k3_pk_unit *u = &m->units[i];
        uint64_t file = 0;
        int64_t layer = 0;
        const char *crc = NULL;
        if ((rc = get_u64(p, it, "file", where, &file)) || (rc = get_u64(p, it, "offset", where, &u->offset)) ||
            (rc = get_u64(p, it, "nbytes", where, &u->nbytes)) || (rc = get_i64(p, it, "layer", where, &layer)) ||
            (rc = get_str(p, it, "crc32", where, &crc)))
            return rc;
        if (file >= m->nfiles || m->files[file].kind != K3_PK_FILE_TRUNK)
            return bad(p, where, "\"file\" is not the index of a trunk file");
        u->file = (uint32_t)file;
        if (u->offset % K3_PK_ALIGN || u->nbytes % K3_PK_ALIGN || u->nbytes == 0)
            return bad(p, where, "offset and nbytes must be positive multiples of 4096");
        if (u->offset > m->files[file].size || u->nbytes > m->files[file].size - u->offset)
            return k3_err_set(p->e, K3_EFORMAT, "%s: %s: [%" PRIu64 ", +%" PRIu64 ") lies outside %s (%" PRIu64
                              " bytes)", p->path, where, u->offset, u->nbytes, m->files[file].name,
                              m->files[file].size);
        if (layer < K3_PK_LAYER_HEAD || layer >= (int64_t)m->cfg.num_hidden_layers)
            return bad(p, where, "\"layer\" out of range");
        u->layer = (int32_t)layer;
        char *end;
        if (strlen(crc) != 8 || hexval(crc[0]) < 0)
            return bad(p, where, "crc32 is not 8 hex digits");
        unsigned long c = strtoul(crc, &end, 16);
        if (*end)
            return bad(p, where, "crc32 is not 8 hex digits");
        u->crc32 = (uint32_t)c;
        const cJSON *pin = cJSON_GetObjectItemCaseSensitive(it, "pinned");
        if (pin && !cJSON_IsBool(pin))
            return bad(p, where, "\"pinned\" is not a boolean");
        u->flags = cJSON_IsTrue(pin) ? K3_PK_UNIT_PINNED : 0;
    }

    const char *dts;
    if ((rc = get_str(p, trunk, "dtypes", "trunk", &dts)))
        return rc;
    if (strcmp(dts, "source") && strcmp(dts, "bf16"))
        return bad(p, "trunk", "\"dtypes\" must be \"source\" or \"bf16\"");
    snprintf(m->trunk_dtypes, sizeof m->trunk_dtypes, "%s", dts);
    uint64_t rounded, nrounded = 0;
    if ((rc = get_u64(p, trunk, "rounded_tensors", "trunk", &rounded)))
        return rc;
    const cJSON *lossy = need(p, trunk, "lossy", "trunk", &rc);
    if (rc)
        return rc;
    if (!cJSON_IsBool(lossy) || cJSON_IsTrue(lossy) != (rounded > 0))
        return bad(p, "trunk", "\"lossy\" must be a boolean, true exactly when rounded_tensors > 0");
    if ((rc = get_array(p, trunk, "tensors", "trunk", &arr, &n, K3_MAN_MAX_ITEMS)))
        return rc;
    m->tensors = calloc(n ? n : 1, sizeof *m->tensors);
    if (!m->tensors)
        return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
    uint64_t npieces_total = 0;
    i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        char where[K3_ST_MAX_NAME + 64];
        k3_pk_tensor *t = &m->tensors[i];
        m->ntensors = i + 1;
        const char *name, *dt;
        snprintf(where, sizeof where, "trunk.tensors[%u]", i);
        if ((rc = get_str(p, it, "name", where, &name)))
            return rc;
        if (strlen(name) == 0 || strlen(name) > K3_ST_MAX_NAME)
            return bad(p, where, "bad tensor name length");
        if (!(t->name = strdup(name)))
            return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
        snprintf(where, sizeof where, "tensor %s", name);
        if ((rc = get_str(p, it, "dtype", where, &dt)))
            return rc;
        if (dtype_of(dt, &t->dtype))
            return bad(p, where, "dtype must be BF16, F16 or F32");
        t->src_dtype = t->dtype;
        const cJSON *sdt = cJSON_GetObjectItemCaseSensitive(it, "source_dtype");
        if (sdt) {
            /* only rounding to BF16 is ever recorded; the entry is absent
             * when the tensor is as stored */
            if (!cJSON_IsString(sdt) || dtype_of(sdt->valuestring, &t->src_dtype) ||
                t->src_dtype == t->dtype || t->dtype != K3_DT_BF16)
                return bad(p, where, "source_dtype must be F16 or F32 on a BF16 tensor");
            if (strcmp(m->trunk_dtypes, "bf16"))
                return bad(p, where, "source_dtype given but trunk.dtypes is not \"bf16\"");
            nrounded++;
        }
        const cJSON *shape;
        uint32_t nd;
        if ((rc = get_array(p, it, "shape", where, &shape, &nd, K3_ST_MAX_DIMS)))
            return rc;
        if (nd == 0)
            return bad(p, where, "empty shape");
        t->ndim = nd;
        uint64_t elems = 1;
        uint32_t d = 0;
        for (const cJSON *s = shape->child; s; s = s->next, d++) {
            double v = s->valuedouble;
            if (!cJSON_IsNumber(s) || v < 1 || v >= MAX_EXACT || v != (double)(uint64_t)v)
                return bad(p, where, "shape entries must be positive integers");
            t->shape[d] = (uint64_t)v;
            if (t->shape[d] > UINT64_MAX / 4 / elems)
                return bad(p, where, "shape product overflows");
            elems *= t->shape[d];
        }
        uint64_t esz = t->dtype == K3_DT_F32 ? 4 : 2;
        t->nbytes = elems * esz;
        uint64_t row_bytes = t->nbytes / t->shape[0];
        const cJSON *pcs;
        uint32_t np;
        if ((rc = get_array(p, it, "pieces", where, &pcs, &np, K3_MAN_MAX_ITEMS)))
            return rc;
        if (np == 0)
            return bad(p, where, "no pieces");
        k3_pk_piece *pc = calloc(np, sizeof *pc);
        if (!pc)
            return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
        t->pieces = pc;
        t->npieces = np;
        npieces_total += np;
        uint64_t next_row = 0;
        uint32_t j = 0;
        for (const cJSON *q = pcs->child; q; q = q->next, j++) {
            uint64_t unit;
            const cJSON *rows;
            uint32_t nr;
            if ((rc = get_u64(p, q, "unit", where, &unit)) || (rc = get_u64(p, q, "offset", where, &pc[j].offset)) ||
                (rc = get_u64(p, q, "nbytes", where, &pc[j].nbytes)) ||
                (rc = get_array(p, q, "rows", where, &rows, &nr, 2)))
                return rc;
            if (nr != 2 || !cJSON_IsNumber(rows->child) || !cJSON_IsNumber(rows->child->next))
                return bad(p, where, "piece rows must be [begin, end]");
            double rb = rows->child->valuedouble, re = rows->child->next->valuedouble;
            if (rb < 0 || re > (double)t->shape[0] || rb >= re || rb != (double)(uint64_t)rb ||
                re != (double)(uint64_t)re)
                return bad(p, where, "piece rows out of range");
            pc[j].row_begin = (uint64_t)rb;
            pc[j].row_end = (uint64_t)re;
            if (pc[j].row_begin != next_row)
                return bad(p, where, "pieces do not cover the rows exactly once in order");
            next_row = pc[j].row_end;
            if (unit >= m->nunits)
                return bad(p, where, "piece unit out of range");
            pc[j].unit = (uint32_t)unit;
            if (pc[j].nbytes != (pc[j].row_end - pc[j].row_begin) * row_bytes)
                return bad(p, where, "piece nbytes is not rows x row size");
            const k3_pk_unit *u = &m->units[unit];
            if (pc[j].offset < u->offset || (pc[j].offset - u->offset) % K3_PK_SECTION_ALIGN ||
                pc[j].nbytes > u->nbytes || pc[j].offset - u->offset > u->nbytes - pc[j].nbytes)
                return k3_err_set(p->e, K3_EFORMAT, "%s: %s: piece at offset %" PRIu64 " (+%" PRIu64
                                  ") is not 64-aligned inside unit %" PRIu64,
                                  p->path, where, pc[j].offset, pc[j].nbytes, unit);
        }
        if (next_row != t->shape[0])
            return bad(p, where, "pieces do not cover all rows");
    }
    if (nrounded != rounded)
        return k3_err_set(p->e, K3_EFORMAT, "%s: trunk: rounded_tensors is %" PRIu64 " but %" PRIu64
                          " tensors have a source_dtype", p->path, rounded, nrounded);
    m->trunk_rounded = (uint32_t)rounded;
    for (uint32_t k = 1; k < m->ntensors; k++)
        if (strcmp(m->tensors[k - 1].name, m->tensors[k].name) >= 0)
            return k3_err_set(p->e, K3_EFORMAT, "%s: trunk.tensors not sorted by name or duplicate at %s",
                              p->path, m->tensors[k].name);

    /* units must not overlap each other; pieces must not overlap each other */
    span *s = malloc((size_t)(m->nunits > npieces_total ? m->nunits : npieces_total) * sizeof *s + 1);
    if (!s)
        return k3_err_set(p->e, K3_ENOMEM, "%s: out of memory", p->path);
    for (uint32_t k = 0; k < m->nunits; k++)
        s[k] = (span){m->units[k].file, m->units[k].offset, m->units[k].nbytes, "unit", k};
    rc = check_overlaps(p, s, m->nunits, man_fname, m);
    uint64_t k = 0;
    for (uint32_t t = 0; rc == 0 && t < m->ntensors; t++)
        for (uint32_t j = 0; j < m->tensors[t].npieces; j++)
            s[k++] = (span){m->units[m->tensors[t].pieces[j].unit].file, m->tensors[t].pieces[j].offset,
                            m->tensors[t].pieces[j].nbytes, "tensor piece", t};
    if (rc == 0)
        rc = check_overlaps(p, s, k, man_fname, m);
    free(s);
    return rc;
}

static int parse_experts(pctx *p, k3_man *m, const cJSON *x)
{
    uint32_t moe = k3_man_moe_layers(&m->cfg);
    if (cJSON_IsNull(x)) {
        if (moe && m->cfg.num_experts)
            return bad(p, "experts", "is null but the config has MoE layers");
        return 0;
    }
    if (!cJSON_IsObject(x))
        return bad(p, "experts", "is not an object");
    if (moe == 0)
        return bad(p, "experts", "present but the config has no MoE layer");
    int rc;
    uint64_t idx, stride, rb, I, L;
    if ((rc = get_u64(p, x, "index", "experts", &idx)) || (rc = get_u64(p, x, "stride", "experts", &stride)) ||
        (rc = get_u64(p, x, "record_bytes", "experts", &rb)) || (rc = get_u64(p, x, "I", "experts", &I)) ||
        (rc = get_u64(p, x, "L", "experts", &L)))
        return rc;
    if (idx >= m->nfiles || m->files[idx].kind != K3_PK_FILE_EXPERT_INDEX)
        return bad(p, "experts", "\"index\" is not the index of the expert_index file");
    m->expert_index_file = (uint32_t)idx;
    if (I != m->cfg.moe_intermediate_size || L != m->cfg.routed_expert_hidden_size)
        return bad(p, "experts", "I and L differ from the config");
    if ((rc = k3_man_expert_layout(&m->xl, I, L, p->e)))
        return rc;
    const cJSON *sec = cJSON_GetObjectItemCaseSensitive(x, "sections");
    if (!cJSON_IsObject(sec))
        return bad(p, "experts", "\"sections\" missing or not an object");
    const char *names[6] = {"w1_packed", "w1_scales", "w3_packed", "w3_scales", "w2_packed", "w2_scales"};
    uint64_t want[6] = {m->xl.w1_packed, m->xl.w1_scales, m->xl.w3_packed,
                        m->xl.w3_scales, m->xl.w2_packed, m->xl.w2_scales};
    for (int i = 0; i < 6; i++) {
        uint64_t v;
        if ((rc = get_u64(p, sec, names[i], "experts.sections", &v)))
            return rc;
        if (v != want[i])
            return k3_err_set(p->e, K3_EFORMAT, "%s: experts.sections.%s is %" PRIu64 ", the layout says %" PRIu64,
                              p->path, names[i], v, want[i]);
    }
    if (stride != m->xl.stride || rb != m->xl.record_bytes)
        return bad(p, "experts", "stride or record_bytes differ from the layout");
    m->has_experts = 1;
    if (m->files[idx].size != k3_man_idx_size(&m->cfg))
        return k3_err_set(p->e, K3_EFORMAT, "%s: %s: size %" PRIu64 " in the manifest, the config implies %" PRIu64,
                          p->path, m->files[idx].name, m->files[idx].size, k3_man_idx_size(&m->cfg));
    return 0;
}

/* The manifest carries the SHA-256 of its own text (with that hash replaced
 * by 64 zeros), so that any edit by hand is detected. */
static int check_self_hash(pctx *p, const cJSON *root, const char *text, uint64_t len)
{
    const char *hex;
    int rc = get_str(p, root, "self_sha256", "manifest", &hex);
    if (rc)
        return rc;
    uint8_t want[32], got[32];
    if (k3_man_unhex(hex, want))
        return bad(p, "self_sha256", "is not 64 lower-case hex digits");
    /* the value is the one after the last "self_sha256" key of the text */
    static const char key[] = "\"self_sha256\"";
    const char *k = NULL, *at = NULL;
    for (const char *q = text; (q = memmem(q, (size_t)(text + len - q), key, sizeof key - 1)); q++)
        k = q;
    if (k)
        at = memmem(k, (size_t)(text + len - k), hex, 64);
    char *copy = malloc((size_t)len + 1);
    if (!copy || !at) {
        free(copy);
        return copy ? bad(p, "self_sha256", "not found in the text") : k3_err_set(p->e, K3_ENOMEM, "out of memory");
    }
    memcpy(copy, text, (size_t)len);
    memset(copy + (at - text), '0', 64);
    unsigned int hl = 0;
    int ok = EVP_Digest(copy, (size_t)len, got, &hl, EVP_sha256(), NULL) == 1 && !memcmp(got, want, 32);
    free(copy);
    if (!ok)
        return k3_err_set(p->e, K3_ECORRUPT, "%s: edited or corrupted: its self_sha256 does not match its content",
                          p->path);
    return 0;
}

int k3_man_parse(k3_man *m, const char *text, uint64_t len, const char *path, k3_err *e)
{
    memset(m, 0, sizeof *m);
    pctx pc = {path, e}, *p = &pc;
    if (len > K3_MAN_MAX_BYTES)
        return k3_err_set(e, K3_ELIMIT, "%s: %" PRIu64 " bytes, limit %u", path, len, K3_MAN_MAX_BYTES);
    cJSON *root = cJSON_ParseWithLength(text, (size_t)len);
    if (!root)
        return k3_err_set(e, K3_EFORMAT, "%s: not valid JSON (near byte %td)", path,
                          cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - text : (ptrdiff_t)-1);
    int rc = 0;
    const char *s;
    uint64_t v;
    if (!cJSON_IsObject(root)) {
        rc = bad(p, "manifest", "not a JSON object");
        goto out;
    }
    if ((rc = get_str(p, root, "format", "manifest", &s)))
        goto out;
    if (strcmp(s, "k3-packed")) {
        rc = bad(p, "format", "is not \"k3-packed\"");
        goto out;
    }
    if ((rc = get_u64(p, root, "schema_version", "manifest", &v)))
        goto out;
    if (v == 1) {
        /* schema 1 rounded every F16/F32 matrix to BF16 without saying so:
         * its numbers may differ from the checkpoint's; never read it */
        rc = k3_err_set(e, K3_EFORMAT, "%s: packed by an older k3-convert (schema_version 1, trunk may be "
                        "rounded to BF16); convert the checkpoint again", path);
        goto out;
    }
    if (v != K3_PK_SCHEMA_VERSION) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: schema_version %" PRIu64 " is not supported (this build reads %d)",
                        path, v, K3_PK_SCHEMA_VERSION);
        goto out;
    }
    m->schema_version = (uint32_t)v;
    if ((rc = check_self_hash(p, root, text, len)))
        goto out;
    if ((rc = get_str(p, root, "producer", "manifest", &s)))
        goto out;
    m->producer = strdup(s);
    const cJSON *cfg = need(p, root, "config", "manifest", &rc);
    if (rc)
        goto out;
    if (!cJSON_IsObject(cfg)) {
        rc = bad(p, "config", "is not an object");
        goto out;
    }
    m->cfg_json = cJSON_PrintUnformatted(cfg);
    if (!m->cfg_json || !m->producer) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    {
        char cpath[4200];
        snprintf(cpath, sizeof cpath, "%s: config", path);
        if ((rc = k3_cfg_parse(&m->cfg, m->cfg_json, strlen(m->cfg_json), cpath, e)))
            goto out;
    }

    const cJSON *arr;
    uint32_t n;
    if ((rc = get_array(p, root, "files", "manifest", &arr, &n, K3_MAN_MAX_FILES)))
        goto out;
    m->files = calloc(n ? n : 1, sizeof *m->files);
    if (!m->files) {
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (const cJSON *it = arr->child; it; it = it->next) {
        char where[64];
        snprintf(where, sizeof where, "files[%u]", m->nfiles);
        k3_pk_file *f = &m->files[m->nfiles];
        const char *name, *kind;
        if ((rc = get_str(p, it, "name", where, &name)) || (rc = get_str(p, it, "kind", where, &kind)) ||
            (rc = get_u64(p, it, "size", where, &f->size)) || (rc = get_sha(p, it, where, f->sha256)))
            goto out;
        if (!valid_fname(name)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: %s: \"%s\" is not a valid file name", path, where, name);
            goto out;
        }
        int k;
        for (k = 0; k < K3_PK_FILE_KIND_COUNT; k++)
            if (!strcmp(kind, kind_names[k]))
                break;
        if (k == K3_PK_FILE_KIND_COUNT) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: %s: unknown kind \"%s\"", path, where, kind);
            goto out;
        }
        f->kind = (k3_pk_file_kind)k;
        for (uint32_t j = 0; j < m->nfiles; j++)
            if (!strcmp(m->files[j].name, name)) {
                rc = k3_err_set(e, K3_EFORMAT, "%s: file %s listed twice", path, name);
                goto out;
            }
        if (!(f->name = strdup(name))) {
            rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
            goto out;
        }
        m->nfiles++;
    }

    const cJSON *src = need(p, root, "source", "manifest", &rc);
    if (rc)
        goto out;
    if ((rc = get_array(p, src, "shards", "source", &arr, &n, K3_ST_MAX_SHARDS)))
        goto out;
    m->nsrc_shards = n;
    if ((rc = parse_src(p, arr, n, "shards", &m->src_shards)))
        goto out;
    if ((rc = get_array(p, src, "files", "source", &arr, &n, 64)))
        goto out;
    m->nsrc_files = n;
    if ((rc = parse_src(p, arr, n, "files", &m->src_files)))
        goto out;
    if ((rc = get_str(p, src, "expert_format", "source", &s)))
        goto out;
    snprintf(m->expert_format, sizeof m->expert_format, "%s", s);
    {
        const cJSON *lo = need(p, src, "left_out", "source", &rc), *a, *b;
        if (rc)
            goto out;
        if (!cJSON_IsObject(lo) || !cJSON_IsObject(a = cJSON_GetObjectItemCaseSensitive(lo, "outside_language_model")) ||
            !cJSON_IsObject(b = cJSON_GetObjectItemCaseSensitive(lo, "unused"))) {
            rc = bad(p, "source.left_out", "must be {\"outside_language_model\": {...}, \"unused\": {...}}");
            goto out;
        }
        if ((rc = get_u64(p, a, "tensors", "source.left_out.outside_language_model", &m->left_outside_n)) ||
            (rc = get_u64(p, a, "bytes", "source.left_out.outside_language_model", &m->left_outside_bytes)) ||
            (rc = get_u64(p, b, "tensors", "source.left_out.unused", &m->left_unused_n)) ||
            (rc = get_u64(p, b, "bytes", "source.left_out.unused", &m->left_unused_bytes)))
            goto out;
    }

    const cJSON *trunk = need(p, root, "trunk", "manifest", &rc);
    if (rc || (rc = parse_trunk(p, m, trunk)))
        goto out;
    const cJSON *x = need(p, root, "experts", "manifest", &rc);
    if (rc || (rc = parse_experts(p, m, x)))
        goto out;
    /* exactly one per-row CRC table of the embedding, of the config's size */
    m->embed_crc_file = UINT32_MAX;
    for (uint32_t i = 0; i < m->nfiles; i++) {
        if (m->files[i].kind != K3_PK_FILE_EMBED_CRC)
            continue;
        if (m->embed_crc_file != UINT32_MAX) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: two files of kind embed_row_crcs", path);
            goto out;
        }
        m->embed_crc_file = i;
        if (m->files[i].size != k3_man_embed_crc_size(&m->cfg)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: %s: %" PRIu64 " bytes, want %" PRIu64 " (4 per vocabulary row)", path,
                            m->files[i].name, m->files[i].size, k3_man_embed_crc_size(&m->cfg));
            goto out;
        }
    }
    if (m->embed_crc_file == UINT32_MAX) {
        rc = k3_err_set(e, K3_EFORMAT, "%s: no file of kind embed_row_crcs (the embedding's per-row CRC32 table)",
                        path);
        goto out;
    }
    const cJSON *plan = need(p, root, "plan", "manifest", &rc);
    if (rc)
        goto out;
    if (!cJSON_IsObject(plan)) {
        rc = bad(p, "plan", "is not an object");
        goto out;
    }
    if (!(m->plan_json = cJSON_PrintUnformatted(plan)))
        rc = k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
out:
    cJSON_Delete(root);
    if (rc)
        k3_man_free(m);
    return rc;
}

/* ---- serialising ---------------------------------------------------------- */

static cJSON *src_json(const k3_man_src *s, uint32_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t i = 0; a && i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        char hex[65];
        k3_man_hex(s[i].sha256, hex);
        cJSON_AddStringToObject(o, "name", s[i].name);
        cJSON_AddNumberToObject(o, "size", (double)s[i].size);
        cJSON_AddStringToObject(o, "sha256", hex);
        cJSON_AddItemToArray(a, o);
    }
    return a;
}

char *k3_man_to_json(const k3_man *m)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    cJSON_AddStringToObject(root, "format", "k3-packed");
    cJSON_AddNumberToObject(root, "schema_version", K3_PK_SCHEMA_VERSION);
    cJSON_AddStringToObject(root, "producer", m->producer ? m->producer : "k3");
    cJSON *cfg = cJSON_Parse(m->cfg_json ? m->cfg_json : "{}");
    cJSON_AddItemToObject(root, "config", cfg ? cfg : cJSON_CreateObject());

    cJSON *files = cJSON_AddArrayToObject(root, "files");
    for (uint32_t i = 0; i < m->nfiles; i++) {
        cJSON *o = cJSON_CreateObject();
        char hex[65];
        k3_man_hex(m->files[i].sha256, hex);
        cJSON_AddStringToObject(o, "name", m->files[i].name);
        cJSON_AddStringToObject(o, "kind", kind_names[m->files[i].kind]);
        cJSON_AddNumberToObject(o, "size", (double)m->files[i].size);
        cJSON_AddStringToObject(o, "sha256", hex);
        cJSON_AddItemToArray(files, o);
    }
    cJSON *src = cJSON_AddObjectToObject(root, "source");
    cJSON_AddItemToObject(src, "shards", src_json(m->src_shards, m->nsrc_shards));
    cJSON_AddItemToObject(src, "files", src_json(m->src_files, m->nsrc_files));
    cJSON_AddStringToObject(src, "expert_format", m->expert_format[0] ? m->expert_format : "none");
    cJSON *lo = cJSON_AddObjectToObject(src, "left_out");
    cJSON *loa = cJSON_AddObjectToObject(lo, "outside_language_model");
    cJSON_AddNumberToObject(loa, "tensors", (double)m->left_outside_n);
    cJSON_AddNumberToObject(loa, "bytes", (double)m->left_outside_bytes);
    cJSON *lob = cJSON_AddObjectToObject(lo, "unused");
    cJSON_AddNumberToObject(lob, "tensors", (double)m->left_unused_n);
    cJSON_AddNumberToObject(lob, "bytes", (double)m->left_unused_bytes);

    cJSON *trunk = cJSON_AddObjectToObject(root, "trunk");
    cJSON_AddStringToObject(trunk, "dtypes", m->trunk_dtypes[0] ? m->trunk_dtypes : "source");
    cJSON_AddBoolToObject(trunk, "lossy", m->trunk_rounded > 0);
    cJSON_AddNumberToObject(trunk, "rounded_tensors", m->trunk_rounded);
    cJSON *units = cJSON_AddArrayToObject(trunk, "units");
    for (uint32_t i = 0; i < m->nunits; i++) {
        const k3_pk_unit *u = &m->units[i];
        cJSON *o = cJSON_CreateObject();
        char crc[9];
        snprintf(crc, sizeof crc, "%08x", u->crc32);
        cJSON_AddNumberToObject(o, "file", u->file);
        cJSON_AddNumberToObject(o, "offset", (double)u->offset);
        cJSON_AddNumberToObject(o, "nbytes", (double)u->nbytes);
        cJSON_AddNumberToObject(o, "layer", u->layer);
        cJSON_AddStringToObject(o, "crc32", crc);
        cJSON_AddBoolToObject(o, "pinned", (u->flags & K3_PK_UNIT_PINNED) != 0);
        cJSON_AddItemToArray(units, o);
    }
    cJSON *tensors = cJSON_AddArrayToObject(trunk, "tensors");
    for (uint32_t i = 0; i < m->ntensors; i++) {
        const k3_pk_tensor *t = &m->tensors[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", t->name);
        cJSON_AddStringToObject(o, "dtype", dtype_str(t->dtype));
        if (t->dtype == K3_DT_BF16 && (t->src_dtype == K3_DT_F16 || t->src_dtype == K3_DT_F32))
            cJSON_AddStringToObject(o, "source_dtype", dtype_str(t->src_dtype));
        cJSON *sh = cJSON_AddArrayToObject(o, "shape");
        for (uint32_t d = 0; d < t->ndim; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)t->shape[d]));
        cJSON *pcs = cJSON_AddArrayToObject(o, "pieces");
        for (uint32_t j = 0; j < t->npieces; j++) {
            const k3_pk_piece *pc = &t->pieces[j];
            cJSON *q = cJSON_CreateObject();
            cJSON_AddNumberToObject(q, "unit", pc->unit);
            cJSON *rows = cJSON_AddArrayToObject(q, "rows");
            cJSON_AddItemToArray(rows, cJSON_CreateNumber((double)pc->row_begin));
            cJSON_AddItemToArray(rows, cJSON_CreateNumber((double)pc->row_end));
            cJSON_AddNumberToObject(q, "offset", (double)pc->offset);
            cJSON_AddNumberToObject(q, "nbytes", (double)pc->nbytes);
            cJSON_AddItemToArray(pcs, q);
        }
        cJSON_AddItemToArray(tensors, o);
    }
    if (m->has_experts) {
        cJSON *x = cJSON_AddObjectToObject(root, "experts");
        cJSON_AddNumberToObject(x, "index", m->expert_index_file);
        cJSON_AddNumberToObject(x, "stride", (double)m->xl.stride);
        cJSON_AddNumberToObject(x, "record_bytes", (double)m->xl.record_bytes);
        cJSON_AddNumberToObject(x, "I", m->xl.rows_w13);
        cJSON_AddNumberToObject(x, "L", m->xl.cols_w13);
        cJSON *sec = cJSON_AddObjectToObject(x, "sections");
        cJSON_AddNumberToObject(sec, "w1_packed", (double)m->xl.w1_packed);
        cJSON_AddNumberToObject(sec, "w1_scales", (double)m->xl.w1_scales);
        cJSON_AddNumberToObject(sec, "w3_packed", (double)m->xl.w3_packed);
        cJSON_AddNumberToObject(sec, "w3_scales", (double)m->xl.w3_scales);
        cJSON_AddNumberToObject(sec, "w2_packed", (double)m->xl.w2_packed);
        cJSON_AddNumberToObject(sec, "w2_scales", (double)m->xl.w2_scales);
    } else {
        cJSON_AddNullToObject(root, "experts");
    }
    cJSON *plan = cJSON_Parse(m->plan_json ? m->plan_json : "{}");
    cJSON_AddItemToObject(root, "plan", plan ? plan : cJSON_CreateObject());
    cJSON_AddStringToObject(root, "self_sha256", ZERO_HEX);
    char *txt = cJSON_Print(root);
    cJSON_Delete(root);
    if (!txt)
        return NULL;
    /* the hash of the text with 64 zeros in place of the hash itself; the
     * slot is the value after the (last) "self_sha256" key */
    char *key = NULL;
    for (char *q = txt; (q = strstr(q, "\"self_sha256\"")); q++)
        key = q;
    char *slot = key ? strstr(key, ZERO_HEX) : NULL;
    uint8_t sha[32];
    unsigned int hl = 0;
    if (!slot || EVP_Digest(txt, strlen(txt), sha, &hl, EVP_sha256(), NULL) != 1) {
        free(txt);
        return NULL;
    }
    char hex[65];
    k3_man_hex(sha, hex);
    memcpy(slot, hex, 64);
    return txt;
}

/* ---- experts.idx ---------------------------------------------------------- */

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

uint64_t k3_man_idx_size(const k3_cfg *cfg)
{
    return K3_MAN_IDX_HEADER + (uint64_t)K3_MAN_IDX_ENTRY * k3_man_moe_layers(cfg) * cfg->num_experts;
}

void k3_man_idx_encode(uint8_t *buf, const k3_cfg *cfg, uint64_t stride, const k3_pk_record *recs)
{
    memset(buf, 0, K3_MAN_IDX_HEADER);
    memcpy(buf, K3_MAN_IDX_MAGIC, 8);
    put32(buf + 8, 1);
    put32(buf + 12, K3_MAN_IDX_ENTRY);
    put32(buf + 16, k3_man_moe_layers(cfg));
    put32(buf + 20, cfg->num_experts);
    put64(buf + 24, stride);
    uint64_t n = (uint64_t)k3_man_moe_layers(cfg) * cfg->num_experts;
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *q = buf + K3_MAN_IDX_HEADER + i * K3_MAN_IDX_ENTRY;
        put32(q, recs[i].file);
        put32(q + 4, recs[i].crc32);
        put64(q + 8, recs[i].offset);
    }
}

int k3_man_idx_decode(const k3_man *m, const uint8_t *buf, uint64_t len, k3_pk_record *recs,
                      const char *path, k3_err *e)
{
    const k3_cfg *cfg = &m->cfg;
    if (len != k3_man_idx_size(cfg) || len < K3_MAN_IDX_HEADER)
        return k3_err_set(e, K3_EFORMAT, "%s: %" PRIu64 " bytes, expected %" PRIu64, path, len,
                          k3_man_idx_size(cfg));
    if (memcmp(buf, K3_MAN_IDX_MAGIC, 8) || get32(buf + 8) != 1 || get32(buf + 12) != K3_MAN_IDX_ENTRY)
        return k3_err_set(e, K3_EFORMAT, "%s: bad magic, version or entry size", path);
    if (get32(buf + 16) != k3_man_moe_layers(cfg) || get32(buf + 20) != cfg->num_experts ||
        get64(buf + 24) != m->xl.stride)
        return k3_err_set(e, K3_EFORMAT, "%s: header (layers %u, experts %u, stride %" PRIu64
                          ") disagrees with the manifest", path, get32(buf + 16), get32(buf + 20), get64(buf + 24));
    uint64_t n = (uint64_t)k3_man_moe_layers(cfg) * cfg->num_experts;
    span *s = malloc((size_t)(n + m->nunits) * sizeof *s + 1);
    if (!s)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", path);
    int rc = 0;
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        const uint8_t *q = buf + K3_MAN_IDX_HEADER + i * K3_MAN_IDX_ENTRY;
        recs[i].file = get32(q);
        recs[i].crc32 = get32(q + 4);
        recs[i].offset = get64(q + 8);
        uint32_t layer = (uint32_t)(i / cfg->num_experts) + cfg->first_k_dense_replace;
        uint32_t ex = (uint32_t)(i % cfg->num_experts);
        const k3_pk_file *f = recs[i].file < m->nfiles ? &m->files[recs[i].file] : NULL;
        if (!f || f->kind != K3_PK_FILE_EXPERTS)
            rc = k3_err_set(e, K3_EFORMAT, "%s: layer %u expert %u: file %u is not an experts file", path, layer,
                            ex, recs[i].file);
        else if (recs[i].offset % K3_PK_ALIGN || recs[i].offset > f->size || f->size - recs[i].offset < m->xl.stride)
            rc = k3_err_set(e, K3_EFORMAT, "%s: layer %u expert %u: record at offset %" PRIu64
                            " is not 4096-aligned inside %s (%" PRIu64 " bytes)",
                            path, layer, ex, recs[i].offset, f->name, f->size);
        s[i] = (span){recs[i].file, recs[i].offset, m->xl.stride, "record", i};
    }
    for (uint32_t u = 0; rc == 0 && u < m->nunits; u++)
        s[n + u] = (span){m->units[u].file, m->units[u].offset, m->units[u].nbytes, "unit", u};
    if (rc == 0) {
        pctx pc = {path, e};
        rc = check_overlaps(&pc, s, n + m->nunits, man_fname, (void *)m);
    }
    free(s);
    return rc;
}
