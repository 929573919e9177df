/*
 * pack_plan.c - plan a repack (pack.h): the new unit layout, the pinned set
 * and floor (from the streaming runtime's planner run on that layout), the
 * expert files (linked or reordered from a trace), the new manifest with
 * every hash that is known before writing, and the plan record.
 *
 * Invariants of a plan: every tensor of the source appears once with the
 * same name, dtype and shape; its new pieces cover its rows in order; each
 * piece lies in a unit of the tensor's own layer; units are 4096-aligned,
 * laid out back to back in one trunk file (pinned groups first, in group
 * order); the new manifest passes k3_man_parse before anything is written.
 * A plan depends only on the source manifest and the options, never on the
 * machine, so a resumed repack writes the same bytes.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_io.h"
#include "k3_json.h"
#include "k3_ws.h"
#include "pack.h"

#define GIB (1ull << 30)

const k3_pack_preset k3_pack_presets[] = {
    {"laptop", 8ull * GIB},
    {"workstation", 64ull * GIB},
    {"server", 512ull * GIB},
    {NULL, 0},
};

void k3_pack_opts_init(k3_pack_opts *o)
{
    memset(o, 0, sizeof *o);
    o->budget = K3_STREAM_DOUBLE;
    snprintf(o->budget_arg, sizeof o->budget_arg, "double");
    o->max_ctx = 4096;
    o->max_chunk = 64;
    o->nthreads = 1;
    o->baseline = K3_PACK_BASELINE;
    o->piece_bytes = K3_STREAM_PIECE_DEFAULT;
}

int k3_pack_parse_budget(const char *s, uint64_t *out, k3_err *e)
{
    for (const k3_pack_preset *p = k3_pack_presets; s && p->name; p++)
        if (!strcmp(s, p->name)) {
            *out = p->bytes;
            return 0;
        }
    return k3_stream_parse_budget(s, out, e);
}

static int parse_layer(const char *s, const char *end, uint32_t nl, uint32_t *out)
{
    if (end - s == 4 && !strncmp(s, "head", 4)) {
        *out = nl;
        return 0;
    }
    if (s == end || end - s > 9)
        return -1;
    uint32_t v = 0;
    for (const char *c = s; c < end; c++) {
        if (!isdigit((unsigned char)*c))
            return -1;
        v = v * 10 + (uint32_t)(*c - '0');
    }
    if (v >= nl)
        return -1;
    *out = v;
    return 0;
}

int k3_pack_parse_pin(const char *s, uint32_t ngroups, k3_pack_opts *o, k3_err *e)
{
    memset(o->pin, 0, sizeof o->pin);
    if (!strcmp(s, "none")) {
        o->pin_mode = K3_PACK_PIN_NONE;
        return 0;
    }
    if (!strcmp(s, "all")) {
        o->pin_mode = K3_PACK_PIN_ALL;
        return 0;
    }
    if (!strcmp(s, "auto")) {
        o->pin_mode = K3_PACK_PIN_AUTO;
        return 0;
    }
    const uint32_t nl = ngroups - 1;
    const char *p = s;
    while (*p) {
        const char *comma = strchr(p, ',');
        const char *end = comma ? comma : p + strlen(p);
        const char *dash = memchr(p, '-', (size_t)(end - p));
        uint32_t a, b;
        if (dash) {
            if (parse_layer(p, dash, nl, &a) || parse_layer(dash + 1, end, nl, &b) || a > b || b == nl)
                goto bad;
        } else {
            if (parse_layer(p, end, nl, &a))
                goto bad;
            b = a;
        }
        for (uint32_t g = a; g <= b; g++)
            o->pin[g] = 1;
        if (!comma)
            break;
        p = comma + 1;
        if (!*p)
            goto bad;
    }
    o->pin_mode = K3_PACK_PIN_LIST;
    return 0;
bad:
    return k3_err_set(e, K3_EARG,
                      "--pin '%s': expected none, all, auto or a comma list of layers 0..%u, ranges A-B and 'head'",
                      s, nl ? nl - 1 : 0);
}

/* ------------------------------------------------------------ layout */

static uint64_t up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

static uint64_t gcd64(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

typedef struct lpiece {
    uint32_t tensor;
    uint64_t row_begin, row_end;
    uint32_t unit;              /* index into lay.units (creation order) */
    uint64_t off;               /* in the unit */
    uint64_t nbytes;
} lpiece;

typedef struct lunit {
    uint32_t group;             /* 0..NL-1 layers, NL head, NL+1 embed */
    uint64_t fill;
} lunit;

typedef struct layout {
    lunit *units;
    uint32_t nunits, cunits;
    lpiece *pieces;
    uint32_t npieces, cpieces;
    uint64_t group_bytes[K3_CFG_MAX_LAYERS + 2];
    uint64_t largest_unit;      /* of streamable groups (not the embedding) */
    uint32_t split;
} layout;

static void layout_free(layout *l)
{
    free(l->units);
    free(l->pieces);
    memset(l, 0, sizeof *l);
}

static int new_unit(layout *l, uint32_t group)
{
    if (l->nunits == l->cunits) {
        uint32_t c = l->cunits ? l->cunits * 2 : 64;
        lunit *u = realloc(l->units, (size_t)c * sizeof *u);
        if (!u)
            return -1;
        l->units = u;
        l->cunits = c;
    }
    l->units[l->nunits++] = (lunit){group, 0};
    return 0;
}

static int add_piece(layout *l, lpiece pc)
{
    if (l->npieces == l->cpieces) {
        uint32_t c = l->cpieces ? l->cpieces * 2 : 256;
        lpiece *p = realloc(l->pieces, (size_t)c * sizeof *p);
        if (!p)
            return -1;
        l->pieces = p;
        l->cpieces = c;
    }
    l->pieces[l->npieces++] = pc;
    return 0;
}

/* Group of a source tensor: the layer of its first piece's unit. */
static uint32_t tensor_group(const k3_man *m, uint32_t t)
{
    int32_t layer = m->units[m->tensors[t].pieces[0].unit].layer;
    uint32_t nl = m->cfg.num_hidden_layers;
    return layer == K3_PK_LAYER_HEAD ? nl : layer == K3_PK_LAYER_EMBED ? nl + 1 : (uint32_t)layer;
}

/* Source position of a tensor (file, offset of its first piece): the order
 * tensors are laid out in within a group. */
static const k3_man *g_sort_man;
static int by_src_pos(const void *a, const void *b)
{
    const k3_man *m = g_sort_man;
    const k3_pk_piece *x = &m->tensors[*(const uint32_t *)a].pieces[0];
    const k3_pk_piece *y = &m->tensors[*(const uint32_t *)b].pieces[0];
    uint32_t fx = m->units[x->unit].file, fy = m->units[y->unit].file;
    if (fx != fy)
        return fx < fy ? -1 : 1;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Lay out every group with units of at most U bytes (0: one per group);
 * with split_rows, tensors larger than U are cut by rows, else they get a
 * unit of their own. */
static int make_layout(const k3_man *m, const uint32_t *torder, uint64_t U, int split_rows, layout *l,
                       k3_err *e)
{
    memset(l, 0, sizeof *l);
    const uint32_t nl = m->cfg.num_hidden_layers;
    uint32_t t = 0;
    for (uint32_t g = 0; g < nl + 2; g++) {
        int open = 0;
        for (; t < m->ntensors && tensor_group(m, torder[t]) == g; t++) {
            const uint32_t ti = torder[t];
            const k3_pk_tensor *x = &m->tensors[ti];
            const uint64_t nb = x->nbytes, rows = x->shape[0], rb = rows ? nb / rows : nb;
            const int whole = U == 0 || g == nl + 1;
            lunit *cu = open ? &l->units[l->nunits - 1] : NULL;
            if (whole || nb <= U || x->ndim < 2 || rows < 2 || !split_rows) {
                if (!cu || (!whole && up(cu->fill, K3_PK_ALIGN) + nb > U && cu->fill > 0)) {
                    if (new_unit(l, g))
                        goto oom;
                    open = 1;
                    cu = &l->units[l->nunits - 1];
                }
                /* large tensors start on a page: their bytes are then written
                 * (and can be read) with O_DIRECT; at most 4 KiB of padding each */
                uint64_t off = up(cu->fill, nb >= K3_PACK_PAGE_ALIGN_MIN ? K3_PK_ALIGN : K3_PK_SECTION_ALIGN);
                if (add_piece(l, (lpiece){ti, 0, rows ? rows : 1, l->nunits - 1, off, nb}))
                    goto oom;
                cu->fill = off + nb;
                continue;
            }
            /* split by rows: pieces of q-multiples of rows, each a multiple of
             * 4096 bytes, from offset 0 of a fresh unit */
            const uint64_t q = K3_PK_ALIGN / gcd64(rb, K3_PK_ALIGN);
            uint64_t r = U / rb / q * q;
            if (r == 0)
                r = q;
            l->split++;
            for (uint64_t a = 0; a < rows;) {
                uint64_t b = rows - a > r ? a + r : rows;
                if (new_unit(l, g))
                    goto oom;
                open = 1;
                if (add_piece(l, (lpiece){ti, a, b, l->nunits - 1, 0, (b - a) * rb}))
                    goto oom;
                l->units[l->nunits - 1].fill = (b - a) * rb;
                a = b;
            }
        }
    }
    if (t != m->ntensors)
        return k3_err_set(e, K3_EINTERNAL, "layout: %u of %u tensors placed", t, m->ntensors);
    for (uint32_t u = 0; u < l->nunits; u++) {
        uint64_t nb = up(l->units[u].fill ? l->units[u].fill : 1, K3_PK_ALIGN);
        l->group_bytes[l->units[u].group] += nb;
        if (l->units[u].group != nl + 1 && nb > l->largest_unit)
            l->largest_unit = nb;
    }
    return 0;
oom:
    layout_free(l);
    return k3_err_set(e, K3_ENOMEM, "out of memory planning the layout");
}

/* ------------------------------------------------------------- experts */

static const uint64_t *g_sort_counts;
static int by_count(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    if (g_sort_counts[x] != g_sort_counts[y])
        return g_sort_counts[x] > g_sort_counts[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* ------------------------------------------------------------- plan */

static char *xstrdup(const char *s, int *fail)
{
    char *d = strdup(s ? s : "");
    if (!d)
        *fail = 1;
    return d;
}

static int add_file(k3_man *m, const char *name, k3_pk_file_kind kind, uint64_t size, const uint8_t *sha,
                    int *fail)
{
    k3_pk_file *f = &m->files[m->nfiles++];
    memset(f, 0, sizeof *f);
    f->name = xstrdup(name, fail);
    f->kind = kind;
    f->size = size;
    if (sha)
        memcpy(f->sha256, sha, 32);
    return (int)m->nfiles - 1;
}

static cJSON *u32_array(const uint32_t *v, uint32_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

static char *plan_record(const k3_pack_plan *p, const k3_pack_opts *o)
{
    const uint32_t nl = p->cfg.num_hidden_layers, NE = p->cfg.num_experts, nmoe = k3_man_moe_layers(&p->cfg);
    cJSON *r = cJSON_CreateObject();
    if (!r)
        return NULL;
    cJSON_AddStringToObject(r, "tool", "k3-pack");
    cJSON_AddNumberToObject(r, "version", 1);
    cJSON_AddStringToObject(r, "ram_arg", o->budget_arg);
    cJSON_AddNumberToObject(r, "ram", (double)(p->sp_ok ? p->sp.budget : 0));
    cJSON_AddStringToObject(r, "units", p->unit_bytes ? "row-range" : "layer");
    cJSON_AddNumberToObject(r, "unit_bytes", (double)p->unit_bytes);
    cJSON_AddNumberToObject(r, "largest_unit", (double)p->largest_unit);
    cJSON_AddNumberToObject(r, "split_tensors", p->split_tensors);
    cJSON *pin = cJSON_AddArrayToObject(r, "pinned_groups");
    for (uint32_t g = 0; g <= nl; g++)
        if (p->pinned[g])
            cJSON_AddItemToArray(pin, g == nl ? cJSON_CreateString("head") : cJSON_CreateNumber(g));
    cJSON_AddNumberToObject(r, "pinned_bytes", (double)p->pinned_bytes);
    cJSON *k = cJSON_AddObjectToObject(r, "k3_run");
    cJSON_AddNumberToObject(k, "ram", (double)(p->sp_ok ? p->sp.budget : p->sp_floor.floor));
    cJSON_AddBoolToObject(k, "streams", !p->stream_refused);
    cJSON_AddNumberToObject(k, "floor", (double)p->sp_floor.floor);
    cJSON_AddNumberToObject(k, "floor_double", (double)p->sp_floor.floor_double);
    cJSON_AddNumberToObject(k, "resident", (double)p->sp_floor.resident);
    cJSON_AddNumberToObject(k, "assumed_baseline", (double)o->baseline);
    cJSON_AddNumberToObject(k, "max_ctx", o->max_ctx);
    cJSON_AddNumberToObject(k, "max_chunk", o->max_chunk);
    cJSON_AddNumberToObject(k, "threads", o->nthreads);
    cJSON_AddNumberToObject(k, "ram_piece", (double)o->piece_bytes);
    cJSON_AddNumberToObject(k, "piece_max", (double)p->sp_floor.piece_max);
    cJSON *s = cJSON_AddObjectToObject(r, "source");
    char hex[65];
    k3_man_hex(p->src_manifest_sha, hex);
    char *u = k3_json_utf8_dup(p->src);   /* valid UTF-8 whatever the path (k3_json.h) */
    cJSON_AddStringToObject(s, "dir", u ? u : "");
    free(u);
    cJSON_AddStringToObject(s, "manifest_sha256", hex);
    cJSON_AddStringToObject(s, "producer", p->src_man.producer ? p->src_man.producer : "");
    cJSON *sp = cJSON_Parse(p->src_man.plan_json ? p->src_man.plan_json : "{}");
    cJSON_AddItemToObject(s, "plan", sp ? sp : cJSON_CreateObject());
    cJSON *x = cJSON_AddObjectToObject(r, "experts");
    cJSON_AddStringToObject(x, "records", p->reorder ? "reordered" : "linked");
    if (p->reorder) {
    {
        char *t = k3_json_utf8_dup(o->trace_path);
        cJSON_AddStringToObject(x, "trace", t ? t : "");
        free(t);
    }
        cJSON_AddNumberToObject(x, "hot_share", K3_PACK_HOT_SHARE);
        cJSON *ord = cJSON_AddArrayToObject(x, "order");
        cJSON *hot = cJSON_AddArrayToObject(x, "hot");
        cJSON *cnt = cJSON_AddArrayToObject(x, "counts");
        for (uint32_t m = 0; m < nmoe; m++) {
            cJSON_AddItemToArray(ord, u32_array(p->order + (uint64_t)m * NE, NE));
            cJSON_AddItemToArray(hot, u32_array(p->order + (uint64_t)m * NE, p->hot_n[m]));
            cJSON *c = cJSON_CreateArray();
            for (uint32_t i = 0; c && i < NE; i++)
                cJSON_AddItemToArray(c, cJSON_CreateNumber((double)p->counts[(uint64_t)m * NE + p->order[(uint64_t)m * NE + i]]));
            cJSON_AddItemToArray(cnt, c);
        }
    }
    char *txt = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    return txt;
}

/* Build the new manifest (hashes of unwritten files as placeholders), the
 * output list and the copy order for layout lay and p->pinned. */
static int assemble(k3_pack_plan *p, const layout *lay_, const k3_pack_opts *o, k3_err *e)
{
    const layout lay = *lay_;
    const k3_man *sm = &p->src_man;
    const k3_cfg *c = &p->cfg;
    const uint32_t nl = c->num_hidden_layers, ng = nl + 1, NE = c->num_experts;
    const uint32_t nmoe = k3_man_moe_layers(c);
    const k3_pk_expert_layout *xl = k3_pk_experts(p->pk);
    k3_man *m = &p->man;
    uint32_t *place = NULL, *newidx = NULL;
    uint64_t *uoff = NULL;
    unsigned int hl = 0;
    int rc = 0, fail = 0;
    k3_man_free(m);
    free(p->outs);
    free(p->copies);
    free(p->unit_group);
    free(p->records);
    p->outs = NULL;
    p->copies = NULL;
    p->unit_group = NULL;
    p->records = NULL;
    p->nouts = p->ncopies = 0;
    p->expert_bytes_linked = p->expert_bytes_copied = 0;
    /* placement: pinned groups first (group order), then the embedding, then the rest */
    place = malloc((lay.nunits ? lay.nunits : 1) * sizeof *place);
    newidx = malloc((lay.nunits ? lay.nunits : 1) * sizeof *newidx);
    uoff = malloc((lay.nunits ? lay.nunits : 1) * sizeof *uoff);
    if (!place || !newidx || !uoff)
        goto oom;
    uint32_t np = 0;
    for (int pass = 0; pass < 3; pass++)
        for (uint32_t u = 0; u < lay.nunits; u++) {
            uint32_t g = lay.units[u].group;
            int pinned = g < ng && p->pinned[g];
            if ((pass == 0 && pinned) || (pass == 1 && g == nl + 1) || (pass == 2 && !pinned && g != nl + 1))
                place[np++] = u;
        }
    uint64_t at = 0;
    for (uint32_t i = 0; i < np; i++) {
        newidx[place[i]] = i;
        uoff[place[i]] = at;
        at += up(lay.units[place[i]].fill ? lay.units[place[i]].fill : 1, K3_PK_ALIGN);
    }
    p->trunk_bytes = at;

    /* the new manifest */
    m->schema_version = K3_PK_SCHEMA_VERSION;
    m->producer = xstrdup("k3-pack 1", &fail);
    m->cfg = sm->cfg;
    m->cfg_json = xstrdup(sm->cfg_json, &fail);
    snprintf(m->expert_format, sizeof m->expert_format, "%s", sm->expert_format);
    /* what the source's conversion did and left out travels with the model */
    snprintf(m->trunk_dtypes, sizeof m->trunk_dtypes, "%s", sm->trunk_dtypes);
    m->trunk_rounded = sm->trunk_rounded;
    m->left_outside_n = sm->left_outside_n;
    m->left_outside_bytes = sm->left_outside_bytes;
    m->left_unused_n = sm->left_unused_n;
    m->left_unused_bytes = sm->left_unused_bytes;
    m->src_shards = calloc(sm->nsrc_shards + 1, sizeof *m->src_shards);
    m->src_files = calloc(sm->nsrc_files + 1, sizeof *m->src_files);
    if (!m->src_shards || !m->src_files)
        goto oom;
    for (uint32_t i = 0; i < sm->nsrc_shards; i++, m->nsrc_shards++) {
        m->src_shards[i] = sm->src_shards[i];
        m->src_shards[i].name = xstrdup(sm->src_shards[i].name, &fail);
    }
    for (uint32_t i = 0; i < sm->nsrc_files; i++, m->nsrc_files++) {
        m->src_files[i] = sm->src_files[i];
        m->src_files[i].name = xstrdup(sm->src_files[i].name, &fail);
    }

    /* files: the trunk, the expert files, experts.idx, the tokenizer files */
    uint32_t nsrc_x = 0;
    for (uint32_t i = 0; i < sm->nfiles; i++)
        nsrc_x += sm->files[i].kind == K3_PK_FILE_EXPERTS;
    const uint32_t maxfiles = sm->nfiles + nmoe + 2;
    m->files = calloc(maxfiles, sizeof *m->files);
    p->outs = calloc(maxfiles, sizeof *p->outs);
    if (!m->files || !p->outs)
        goto oom;
    p->trunk_file = (uint32_t)add_file(m, "trunk-0000.k3t", K3_PK_FILE_TRUNK, p->trunk_bytes, NULL, &fail);
    p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_TRUNK, p->trunk_file, 0, 0};

    /* experts: order from the trace, or linked as they are */
    uint32_t *src_to_new = calloc(sm->nfiles + 1, sizeof *src_to_new);
    if (!src_to_new)
        goto oom;
    if (xl && o->trace_path && !p->counts) {
        p->counts = calloc((uint64_t)nmoe * NE, sizeof *p->counts);
        p->order = malloc((uint64_t)nmoe * NE * sizeof *p->order);
        p->hot_n = calloc(nmoe, sizeof *p->hot_n);
        if (!p->counts || !p->order || !p->hot_n) {
            free(src_to_new);
            goto oom;
        }
        uint64_t nreq = 0;
        if ((rc = k3_pack_trace_read(o->trace_path, c, p->counts, &nreq, e))) {
            free(src_to_new);
            goto out;
        }
        for (uint32_t mi = 0; mi < nmoe; mi++) {
            uint32_t *ord = p->order + (uint64_t)mi * NE;
            const uint64_t *cnt = p->counts + (uint64_t)mi * NE;
            uint64_t total = 0, run = 0;
            for (uint32_t x = 0; x < NE; x++) {
                ord[x] = x;
                total += cnt[x];
            }
            g_sort_counts = cnt;
            qsort(ord, NE, sizeof *ord, by_count);
            for (uint32_t i = 0; i < NE && total && run < (uint64_t)(K3_PACK_HOT_SHARE * (double)total + 0.5) &&
                                 cnt[ord[i]];
                 i++) {
                run += cnt[ord[i]];
                p->hot_n[mi] = i + 1;
            }
        }
        p->reorder = 1;
    }
    if (p->counts)
        p->reorder = 1;
    if (xl) {
        p->records = calloc((uint64_t)nmoe * NE, sizeof *p->records);
        if (!p->records) {
            free(src_to_new);
            goto oom;
        }
        if (p->reorder) {
            for (uint32_t mi = 0; mi < nmoe; mi++) {
                char name[64];
                snprintf(name, sizeof name, "experts-%04u.k3e", mi);
                uint32_t f = (uint32_t)add_file(m, name, K3_PK_FILE_EXPERTS, (uint64_t)NE * xl->stride, NULL, &fail);
                p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_EXPERTS, f, 0, mi};
                for (uint32_t i = 0; i < NE; i++) {
                    uint32_t x = p->order[(uint64_t)mi * NE + i];
                    const k3_pk_record *r = k3_pk_record_find(p->pk, c->first_k_dense_replace + mi, x);
                    p->records[(uint64_t)mi * NE + x] = (k3_pk_record){f, r->crc32, (uint64_t)i * xl->stride};
                }
                p->expert_bytes_copied += (uint64_t)NE * xl->stride;
            }
        } else {
            for (uint32_t i = 0; i < sm->nfiles; i++)
                if (sm->files[i].kind == K3_PK_FILE_EXPERTS) {
                    uint32_t f = (uint32_t)add_file(m, sm->files[i].name, K3_PK_FILE_EXPERTS, sm->files[i].size,
                                                    sm->files[i].sha256, &fail);
                    src_to_new[i] = f;
                    p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_LINK, f, i, 0};
                    p->expert_bytes_linked += sm->files[i].size;
                }
            for (uint32_t mi = 0; mi < nmoe; mi++)
                for (uint32_t x = 0; x < NE; x++) {
                    k3_pk_record r = *k3_pk_record_find(p->pk, c->first_k_dense_replace + mi, x);
                    r.file = src_to_new[r.file];
                    p->records[(uint64_t)mi * NE + x] = r;
                }
        }
        /* experts.idx: content known now */
        uint64_t isz = k3_man_idx_size(c);
        uint8_t *buf = calloc(isz, 1), sha[32];
        if (!buf) {
            free(src_to_new);
            goto oom;
        }
        k3_man_idx_encode(buf, c, xl->stride, p->records);
        EVP_Digest(buf, isz, sha, &hl, EVP_sha256(), NULL);
        free(buf);
        uint32_t f = (uint32_t)add_file(m, "experts.idx", K3_PK_FILE_EXPERT_INDEX, isz, sha, &fail);
        p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_INDEX, f, 0, 0};
        m->has_experts = 1;
        m->expert_index_file = f;
        m->xl = *xl;
    }
    for (uint32_t i = 0; i < sm->nfiles; i++)
        if (sm->files[i].kind == K3_PK_FILE_TOKENIZER) {
            uint32_t f = (uint32_t)add_file(m, sm->files[i].name, K3_PK_FILE_TOKENIZER, sm->files[i].size,
                                            sm->files[i].sha256, &fail);
            p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_LINK, f, i, 0};
        }
    /* embed.crc: per-row CRCs of the embedding by row id, valid whatever the layout */
    {
        const k3_pk_file *sf = &sm->files[sm->embed_crc_file];
        uint32_t f = (uint32_t)add_file(m, sf->name, K3_PK_FILE_EMBED_CRC, sf->size, sf->sha256, &fail);
        m->embed_crc_file = f;
        p->outs[p->nouts++] = (k3_pack_out){K3_PACK_OUT_LINK, f, sm->embed_crc_file, 0};
    }
    free(src_to_new);

    /* units and tensors */
    m->units = calloc(lay.nunits + 1, sizeof *m->units);
    p->unit_group = calloc(lay.nunits + 1, sizeof *p->unit_group);
    m->tensors = calloc(sm->ntensors + 1, sizeof *m->tensors);
    p->copies = calloc(lay.npieces + 1, sizeof *p->copies);
    if (!m->units || !p->unit_group || !m->tensors || !p->copies)
        goto oom;
    m->nunits = lay.nunits;
    for (uint32_t u = 0; u < lay.nunits; u++) {
        uint32_t g = lay.units[u].group, i = newidx[u];
        m->units[i] = (k3_pk_unit){p->trunk_file, uoff[u], up(lay.units[u].fill ? lay.units[u].fill : 1, K3_PK_ALIGN),
                                   g == nl + 1 ? K3_PK_LAYER_EMBED : g == nl ? K3_PK_LAYER_HEAD : (int32_t)g,
                                   g < ng && p->pinned[g] ? K3_PK_UNIT_PINNED : 0, 0};
        p->unit_group[i] = g;
    }
    m->ntensors = sm->ntensors;
    for (uint32_t t = 0; t < sm->ntensors; t++) {
        k3_pk_tensor *nt = &m->tensors[t];
        *nt = sm->tensors[t];
        nt->name = xstrdup(sm->tensors[t].name, &fail);
        nt->pieces = NULL;
        nt->npieces = 0;
    }
    /* pieces: count per tensor, then fill (layout order is row order per tensor) */
    for (uint32_t i = 0; i < lay.npieces; i++)
        m->tensors[lay.pieces[i].tensor].npieces++;
    for (uint32_t t = 0; t < m->ntensors; t++) {
        m->tensors[t].pieces = calloc(m->tensors[t].npieces ? m->tensors[t].npieces : 1, sizeof(k3_pk_piece));
        if (!m->tensors[t].pieces)
            goto oom;
        m->tensors[t].npieces = 0;
    }
    for (uint32_t i = 0; i < lay.npieces; i++) {
        const lpiece *lp = &lay.pieces[i];
        k3_pk_tensor *nt = &m->tensors[lp->tensor];
        k3_pk_piece *pc = (k3_pk_piece *)&nt->pieces[nt->npieces++];
        *pc = (k3_pk_piece){newidx[lp->unit], lp->row_begin, lp->row_end, uoff[lp->unit] + lp->off, lp->nbytes};
    }
    /* copy order: pieces in file order */
    p->ncopies = 0;
    for (uint32_t t = 0; t < m->ntensors; t++)
        for (uint32_t j = 0; j < m->tensors[t].npieces; j++)
            p->copies[p->ncopies++] = (k3_pack_copy){t, j};
    {
        /* insertion into file order by piece offset (one trunk file) */
        k3_pack_copy *cp = p->copies;
        const k3_man *mm = m;
        for (uint32_t i = 1; i < p->ncopies; i++) {
            k3_pack_copy v = cp[i];
            uint64_t key = mm->tensors[v.tensor].pieces[v.piece].offset;
            uint32_t j = i;
            /* binary search for the insertion point keeps this O(n log n) compares */
            uint32_t lo = 0, hi = i;
            while (lo < hi) {
                uint32_t mid = (lo + hi) / 2;
                if (mm->tensors[cp[mid].tensor].pieces[cp[mid].piece].offset <= key)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            for (j = i; j > lo; j--)
                cp[j] = cp[j - 1];
            cp[lo] = v;
        }
    }
    for (uint32_t i = 0; i < p->nouts; i++)
        if (p->outs[i].how == K3_PACK_OUT_TRUNK || p->outs[i].how == K3_PACK_OUT_EXPERTS)
            memset(m->files[p->outs[i].file].sha256, 0x5a, 32);
    if (fail)
        goto oom;
    goto out;
oom:
    rc = k3_err_set(e, K3_ENOMEM, "out of memory planning the repack");
out:
    free(place);
    free(newidx);
    free(uoff);
    return rc;
}

/* k3-run's plan on the planned layout, computed by k3-run's own code: the
 * planned model is laid down as a stand-in of sparse files (no data, so no
 * disk space) with the real manifest and experts.idx in a scratch directory,
 * opened with k3_ws_stream_open and planned with k3_ws_stream_plan (the
 * group, core and piece split k3-run makes), at the floor and at the
 * budget, then removed. */
static int probe_one(const char *dir, const k3_pack_opts *o, const k3_cfg *c, uint64_t budget, k3_stream_plan *sp,
                     k3_err *e)
{
    k3_ws *ws = NULL;
    int rc = k3_ws_stream_open(&ws, dir, 1, e);
    if (rc)
        return rc;
    k3_stream_opts so;
    k3_stream_opts_init(&so);
    so.budget = budget;
    so.max_chunk = o->max_chunk;
    so.max_ctx = o->max_ctx;
    so.nthreads = o->nthreads;
    so.baseline = o->baseline ? o->baseline : 1;   /* 0 would mean "measure now" */
    so.piece_bytes = o->piece_bytes;
    so.extra_bytes = 2ull * 4 * c->vocab_size;   /* k3-run's two logits rows (without --logits-all) */
    rc = k3_ws_stream_plan(ws, &so, sp, e);
    k3_ws_close(ws);
    return rc;
}

static int probe(k3_pack_plan *p, const k3_pack_opts *o, k3_err *e)
{
    /* next to DST when there is one (a run on DST removes what a kill left
     * there), else in $TMPDIR */
    const char *tmpd = getenv("TMPDIR");
    char dir[4096], path[4400];
    if (p->dst)
        snprintf(dir, sizeof dir, "%s" K3_PACK_PROBE_SUFFIX "XXXXXX", p->dst);
    else
        snprintf(dir, sizeof dir, "%s/k3-pack-probe.XXXXXX", tmpd && *tmpd ? tmpd : "/tmp");
    if (!mkdtemp(dir))
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot create a scratch directory", dir);
    const k3_man *m = &p->man;
    int rc = 0;
    char *txt = NULL;
    uint8_t *idx = NULL;
    for (uint32_t i = 0; i < m->nfiles && !rc; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, m->files[i].name);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot create", path);
            break;
        }
        if (m->has_experts && i == m->expert_index_file) {
            idx = calloc(m->files[i].size, 1);
            if (!idx)
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            else {
                k3_man_idx_encode(idx, &p->cfg, m->xl.stride, p->records);
                rc = k3_io_pwrite(fd, idx, m->files[i].size, 0, path, e);
            }
        } else if (i == m->embed_crc_file) { /* checked against its SHA-256 at open */
            const uint32_t *rc32 = k3_pk_embed_row_crcs(p->pk);
            uint8_t *b = malloc(m->files[i].size ? m->files[i].size : 1);
            if (!b)
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            for (uint64_t r = 0; b && r < m->files[i].size / 4; r++)
                for (int j = 0; j < 4; j++)
                    b[4 * r + j] = (uint8_t)(rc32[r] >> (8 * j));
            if (b)
                rc = k3_io_pwrite(fd, b, m->files[i].size, 0, path, e);
            free(b);
        } else if (ftruncate(fd, (off_t)m->files[i].size) != 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot size", path);
        }
        close(fd);
    }
    if (!rc && !(txt = k3_man_to_json(m)))
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    if (!rc) {
        snprintf(path, sizeof path, "%s/manifest.json", dir);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot create", path);
        else {
            rc = k3_io_pwrite(fd, txt, strlen(txt), 0, path, e);
            close(fd);
        }
    }
    if (!rc && p->split_tensors) {
        /* k3-run --ram refuses row-split tensors (it streams row pieces of
         * whole tensors itself): no plan, nothing pinned automatically */
        p->stream_refused = 1;
        memset(&p->sp_floor, 0, sizeof p->sp_floor);
        memset(&p->sp, 0, sizeof p->sp);
        p->sp.budget = o->budget;
        p->sp_ok = 0;
    } else if (!rc) {
        rc = probe_one(dir, o, &p->cfg, K3_STREAM_FLOOR, &p->sp_floor, e);
    }
    if (!rc && !p->stream_refused) {
        k3_err pe = {0};
        p->sp_ok = probe_one(dir, o, &p->cfg, o->budget, &p->sp, &pe) == 0;
        if (!p->sp_ok) {
            memset(&p->sp, 0, sizeof p->sp);
            p->sp.budget = o->budget;
        }
    }
    free(txt);
    free(idx);
    /* remove the stand-in */
    for (uint32_t i = 0; i < m->nfiles; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, m->files[i].name);
        unlink(path);
    }
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    unlink(path);
    rmdir(dir);
    return rc;
}

void k3_pack_plan_free(k3_pack_plan *p)
{
    if (!p)
        return;
    free(p->src);
    free(p->dst);
    k3_pk_close(p->pk);
    k3_man_free(&p->src_man);
    k3_man_free(&p->man);
    free(p->unit_group);
    free(p->outs);
    free(p->copies);
    free(p->order);
    free(p->hot_n);
    free(p->counts);
    free(p->records);
    memset(p, 0, sizeof *p);
}

int k3_pack_plan_build(k3_pack_plan *p, const char *src, const char *dst, const k3_pack_opts *o, k3_err *e)
{
    memset(p, 0, sizeof *p);
    int rc, fail = 0;
    char *txt = NULL;
    uint32_t *tord = NULL;
    layout lay = {0};
    /* an upstream checkpoint, a file, an unreadable directory: said exactly */
    if ((rc = k3_io_dir_expect(src, K3_DIR_PACKED, "k3-pack", e)) < 0)
        return rc;
    p->src = realpath(src, NULL);
    if (!p->src)
        return k3_err_sys(e, K3_ENOENT, errno, "%s: cannot resolve the source directory", src);
    if (dst && !(p->dst = strdup(dst)))
        return k3_err_set(e, K3_ENOMEM, "out of memory");

    /* the source: manifest text (hashed for provenance), parsed, and opened */
    char mpath[4200];
    uint64_t mlen;
    if ((rc = k3_io_path_join(mpath, sizeof mpath, p->src, "manifest.json", e)))
        return rc;
    struct stat mst;
    if (stat(mpath, &mst) != 0)
        return k3_err_set(e, K3_ENOENT, "%s: incomplete packed model: no manifest.json", src);
    rc = k3_io_read_file(mpath, K3_MAN_MAX_BYTES, &txt, &mlen, e);
    if (rc)
        return rc;
    unsigned int hl = 0;
    EVP_Digest(txt, (size_t)mlen, p->src_manifest_sha, &hl, EVP_sha256(), NULL);
    rc = k3_man_parse(&p->src_man, txt, mlen, mpath, e);
    free(txt);
    txt = NULL;
    if (rc)
        return rc;
    if ((rc = k3_pk_open(&p->pk, p->src, K3_PK_DIRECT, e)))
        return rc;
    p->cfg = p->src_man.cfg;
    const k3_man *sm = &p->src_man;
    const k3_cfg *c = &p->cfg;
    const uint32_t nl = c->num_hidden_layers, ng = nl + 1;

    /* tensors in group order, source order within a group */
    tord = malloc((sm->ntensors ? sm->ntensors : 1) * sizeof *tord);
    if (!tord)
        goto oom;
    for (uint32_t t = 0; t < sm->ntensors; t++)
        tord[t] = t;
    g_sort_man = sm;
    qsort(tord, sm->ntensors, sizeof *tord, by_src_pos);
    {   /* stable bucket by group, keeping source order inside */
        uint32_t *tmp = malloc((sm->ntensors ? sm->ntensors : 1) * sizeof *tmp), k = 0;
        if (!tmp)
            goto oom;
        for (uint32_t g = 0; g < nl + 2; g++)
            for (uint32_t t = 0; t < sm->ntensors; t++)
                if (tensor_group(sm, tord[t]) == g)
                    tmp[k++] = tord[t];
        free(tord);
        tord = tmp;
    }
    for (uint32_t t = 0; t < sm->ntensors; t++)
        if (sm->tensors[t].nbytes == 0 || sm->tensors[t].shape[0] == 0)
            return k3_err_set(e, K3_EFORMAT, "%s: tensor %s is empty", src, sm->tensors[t].name);

    /* units: whole layers unless asked (k3-run --ram streams the big matrices
     * in row pieces itself, from whole tensors, and refuses split ones) */
    const uint64_t U = o->unit_explicit ? o->unit_bytes : 0;
    if ((rc = make_layout(sm, tord, U, o->split_rows, &lay, e)))
        goto out;
    p->unit_bytes = U;
    p->piece_bytes = o->piece_bytes;
    p->split_tensors = lay.split;
    p->largest_unit = lay.largest_unit;

    /* k3-run's own plan on this layout (pinned flags do not change it), then
     * the pinned set, then the final manifest */
    if ((rc = assemble(p, &lay, o, e)) || (rc = probe(p, o, e)))
        goto out;
    switch (o->pin_mode) {
    case K3_PACK_PIN_NONE:
        break;
    case K3_PACK_PIN_ALL:
        memset(p->pinned, 1, ng);
        break;
    case K3_PACK_PIN_LIST:
        memcpy(p->pinned, o->pin, ng);
        break;
    default:
        if (p->sp_ok)
            memcpy(p->pinned, p->sp.pinned, ng);
    }
    for (uint32_t g = 0; g < ng; g++)
        if (p->pinned[g])
            p->pinned_bytes += lay.group_bytes[g];
    if ((rc = assemble(p, &lay, o, e)))
        goto out;
    k3_man *m = &p->man;
    if (fail)
        goto oom;
    if (!(m->plan_json = plan_record(p, o)))
        goto oom;

    /* the planned manifest (placeholder hashes for files not yet written)
     * must pass our own reader; its text is the fingerprint a resume compares */
    txt = k3_man_to_json(m);
    if (!txt)
        goto oom;
    {
        k3_man check;
        k3_err ce = {0};
        if (k3_man_parse(&check, txt, strlen(txt), "planned manifest", &ce)) {
            rc = k3_err_set(e, K3_EINTERNAL, "the layout k3-pack planned is invalid: %s", ce.msg);
            goto out;
        }
        k3_man_free(&check);
    }
    EVP_Digest(txt, strlen(txt), p->fingerprint, &hl, EVP_sha256(), NULL);
    rc = 0;
    goto out;
oom:
    rc = k3_err_set(e, K3_ENOMEM, "out of memory planning the repack");
out:
    free(txt);
    free(tord);
    layout_free(&lay);
    if (rc)
        k3_pack_plan_free(p);
    return rc;
}

/* "12.345 GiB" / "12.345 MiB" / "12.0 KiB" */
static const char *hsz(char *b, uint64_t n)
{
    if (n >= GIB)
        snprintf(b, 32, "%.3f GiB", (double)n / GIB);
    else if (n >= (1u << 20))
        snprintf(b, 32, "%.3f MiB", (double)n / (1u << 20));
    else
        snprintf(b, 32, "%.1f KiB", (double)n / 1024);
    return b;
}

void k3_pack_plan_print(const k3_pack_plan *p, FILE *f, const char *pre)
{
    char a[32], b[32], c2[32];
    const uint32_t nl = p->cfg.num_hidden_layers;
    fprintf(f, "%ssource %s (%s)\n", pre, p->src, p->src_man.producer ? p->src_man.producer : "?");
    fprintf(f, "%sbudget %llu bytes (%s)\n", pre, (unsigned long long)p->sp.budget, hsz(a, p->sp.budget));
    if (p->unit_bytes)
        fprintf(f, "%sunits  at most %s each: %u units, largest %s, %u tensors split by rows\n", pre,
                hsz(a, p->unit_bytes), p->man.nunits, hsz(b, p->largest_unit), p->split_tensors);
    else
        fprintf(f, "%sunits  one per layer: %u units, largest %s\n", pre, p->man.nunits, hsz(b, p->largest_unit));
    fprintf(f, "%strunk  %s in trunk-0000.k3t, pinned prefix %s (", pre, hsz(a, p->trunk_bytes),
            hsz(b, p->pinned_bytes));
    uint32_t npin = 0;
    for (uint32_t g = 0; g <= nl; g++)
        if (p->pinned[g]) {
            if (npin++)
                fputc(',', f);
            if (g == nl)
                fputs("head", f);
            else
                fprintf(f, "%u", g);
        }
    fprintf(f, "%s)\n", npin ? "" : "none");
    if (p->reorder)
        fprintf(f, "%sexperts %s rewritten in trace order (one file per MoE layer)\n", pre,
                hsz(a, p->expert_bytes_copied));
    else
        fprintf(f, "%sexperts %s linked from the source (not copied)\n", pre, hsz(a, p->expert_bytes_linked));
    fprintf(f, "%sfloor  k3-run --ram on this layout (--ram-piece %llu): %llu bytes (%s), double-buffered %s, "
               "resident %s\n",
            pre, (unsigned long long)p->piece_bytes, (unsigned long long)p->sp_floor.floor,
            hsz(a, p->sp_floor.floor), hsz(b, p->sp_floor.floor_double), hsz(c2, p->sp_floor.resident));
    if (p->stream_refused)
        fprintf(f, "%sk3-run --ram does not run row-split layouts (it streams row pieces of whole tensors "
                   "itself): run this one without --ram\n",
                pre);
    else if (!p->sp_ok)
        fprintf(f, "%sthe budget is below k3-run's floor on this layout: k3-run --ram needs at least %llu bytes\n",
                pre, (unsigned long long)p->sp_floor.floor);
    else
        k3_stream_plan_print(&p->sp, f, pre);
}
