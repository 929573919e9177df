/*
 * conv_plan.c - everything k3-convert decides before reading a data byte:
 * tensor roles, expert source format, shard groups, output layout, the
 * manifest skeleton and the plan fingerprint (see conv.h).
 *
 * Invariant: when k3_conv_plan_build succeeds, every tensor the config needs
 * is present with the right shape and a dtype we can convert, every expert
 * record has all its parts in one format, and every output byte position is
 * fixed; conversion can then only fail on I/O or on interruption.
 */
#include "conv.h"

#include "k3_io.h"

#include <inttypes.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

void k3_conv_plan_free(k3_conv_plan *p)
{
    if (!p)
        return;
    for (uint32_t g = 0; g < p->ngroups; g++) {
        k3_conv_ofile *fs[2] = {&p->groups[g].trunk, &p->groups[g].experts};
        for (int i = 0; i < 2; i++) {
            free(fs[i]->ext);
            free(fs[i]->regions);
            free(fs[i]->region_crc);
        }
    }
    free(p->groups);
    free(p->slot_group);
    free(p->slot_first);
    free(p->slot_tensors);
    free(p->recs);
    free(p->tensors);
    free(p->records);
    k3_man_free(&p->man);
    k3_st_close(p->st);
    free(p->src);
    free(p->dst);
    memset(p, 0, sizeof *p);
}

static int is_float(k3_dtype t)
{
    return t == K3_DT_BF16 || t == K3_DT_F16 || t == K3_DT_F32;
}

/* Classify one expert part; fills rec->parts. */
static int add_expert_part(k3_conv_plan *p, uint64_t ti, uint32_t layer, uint32_t ex, int which, int part,
                           k3_err *e)
{
    const k3_cfg *c = &p->cfg;
    const k3_st_tensor *t = p->tensors[ti].st;
    if (layer >= c->num_hidden_layers || k3_cfg_layer_is_dense(c, layer))
        return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: layer %u is not a MoE layer",
                          k3_st_shard_name(p->st, t->shard), t->name, layer);
    if (ex >= c->num_experts)
        return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: expert %u out of range (num_experts %u)",
                          k3_st_shard_name(p->st, t->shard), t->name, ex, c->num_experts);
    uint64_t r = (uint64_t)(layer - c->first_k_dense_replace) * c->num_experts + ex;
    p->recs[r].parts[which][part] = (int32_t)ti;
    p->tensors[ti].role = K3_CONV_T_EXPERT;
    p->tensors[ti].rec = r;
    p->tensors[ti].which = which;
    p->tensors[ti].part = part;
    return 0;
}

static int shape2(const k3_st_tensor *t, uint64_t r, uint64_t c)
{
    return t->ndim == 2 && t->shape[0] == r && t->shape[1] == c;
}

/* Check a record's parts; decide/confirm the expert source format. */
static int check_record(k3_conv_plan *p, uint64_t r, k3_err *e)
{
    const k3_cfg *c = &p->cfg;
    k3_conv_rec *rec = &p->recs[r];
    uint32_t layer = (uint32_t)(r / c->num_experts) + c->first_k_dense_replace;
    uint32_t ex = (uint32_t)(r % c->num_experts);
    const uint64_t I = c->moe_intermediate_size, L = c->routed_expert_hidden_size;
    static const char *wn[3] = {"w1", "w2", "w3"};
    static const char *pn[K3_MAN_XP_COUNT] = {K3_SCH_XP_PACKED, K3_SCH_XP_SCALE, K3_SCH_XP_WEIGHT,
                                              K3_SCH_XP_SCALE_INV};
    int fmt = K3_CONV_X_NONE;
    if (rec->parts[0][K3_MAN_XP_PACKED] >= 0 || rec->parts[0][K3_MAN_XP_SCALE] >= 0)
        fmt = K3_CONV_X_MXFP4;
    else if (rec->parts[0][K3_MAN_XP_WEIGHT] >= 0)
        fmt = p->tensors[rec->parts[0][K3_MAN_XP_WEIGHT]].st->dtype == K3_DT_F8_E4M3 ? K3_CONV_X_F8 : K3_CONV_X_FLOAT;
    int need[K3_MAN_XP_COUNT] = {0};
    if (fmt == K3_CONV_X_MXFP4)
        need[K3_MAN_XP_PACKED] = need[K3_MAN_XP_SCALE] = 1;
    else if (fmt == K3_CONV_X_FLOAT)
        need[K3_MAN_XP_WEIGHT] = 1;
    else if (fmt == K3_CONV_X_F8)
        need[K3_MAN_XP_WEIGHT] = need[K3_MAN_XP_SCALE_INV] = 1;
    else
        return k3_err_set(e, K3_ENOENT, "%s: layer %u expert %u: missing (no w1 tensor)", p->src, layer, ex);
    if (p->xfmt == K3_CONV_X_NONE)
        p->xfmt = fmt;
    else if (p->xfmt != fmt)
        return k3_err_set(e, K3_EFORMAT, "%s: layer %u expert %u: experts stored in two different formats", p->src,
                          layer, ex);
    rec->nparts_need = 0;
    for (int w = 0; w < 3; w++) {
        uint64_t rows = w == 1 ? L : I, cols = w == 1 ? I : L;
        for (int q = 0; q < K3_MAN_XP_COUNT; q++) {
            int32_t ti = rec->parts[w][q];
            if (!need[q]) {
                if (ti >= 0)
                    return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: unexpected next to the %s format", p->src,
                                      p->tensors[ti].st->name, fmt == K3_CONV_X_MXFP4 ? "MXFP4" : "float");
                continue;
            }
            if (ti < 0)
                return k3_err_set(e, K3_ENOENT, "%s: missing tensor " K3_MAN_PREFIX
                                  "layers.%u.block_sparse_moe.experts.%u.%s.%s", p->src, layer, ex, wn[w], pn[q]);
            const k3_st_tensor *t = p->tensors[ti].st;
            int ok;
            if (q == K3_MAN_XP_PACKED)
                ok = t->dtype == K3_DT_U8 && shape2(t, rows, cols / 2);
            else if (q == K3_MAN_XP_SCALE)
                ok = t->dtype == K3_DT_U8 && shape2(t, rows, cols / 32);
            else if (q == K3_MAN_XP_WEIGHT)
                ok = (fmt == K3_CONV_X_F8 ? t->dtype == K3_DT_F8_E4M3 : is_float(t->dtype)) &&
                     shape2(t, rows, cols);
            else
                ok = (t->dtype == K3_DT_F32 || t->dtype == K3_DT_BF16) &&
                     shape2(t, (rows + 127) / 128, (cols + 127) / 128);
            if (!ok)
                return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: dtype %s or shape does not fit an expert of I=%" PRIu64
                                  " L=%" PRIu64, k3_st_shard_name(p->st, t->shard), t->name, k3_dtype_name(t->dtype),
                                  I, L);
            if (q == K3_MAN_XP_WEIGHT) {
                if (t->nbytes > K3_CONV_MAX_EXPERT_TENSOR)
                    return k3_err_set(e, K3_ELIMIT, "%s: tensor %s: %" PRIu64 " bytes, limit %llu", p->src, t->name,
                                      t->nbytes, K3_CONV_MAX_EXPERT_TENSOR);
                if (p->xdtype != t->dtype && r > 0 && p->xdtype != K3_DT_COUNT)
                    return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: experts in two float dtypes", p->src, t->name);
                p->xdtype = t->dtype;
            }
            rec->nparts_need++;
        }
    }
    return 0;
}

static void fp_add(EVP_MD_CTX *md, const void *p, size_t n)
{
    EVP_DigestUpdate(md, p, n);
}

static void fp_u64(EVP_MD_CTX *md, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    fp_add(md, b, 8);
}

static int fingerprint(k3_conv_plan *p, k3_err *e)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        return k3_err_set(e, K3_ENOMEM, "cannot create a SHA-256 context");
    }
    static const char tag[] = "k3-convert plan 2";
    fp_add(md, tag, sizeof tag);
    fp_add(md, p->man.trunk_dtypes, strlen(p->man.trunk_dtypes) + 1);
    fp_add(md, p->man.cfg_json, strlen(p->man.cfg_json) + 1);
    for (uint32_t s = 0; s < k3_st_shard_count(p->st); s++) {
        const char *n = k3_st_shard_name(p->st, s);
        fp_add(md, n, strlen(n) + 1);
        fp_u64(md, k3_st_shard_size(p->st, s));
    }
    for (uint64_t i = 0; i < p->ntensors; i++) {
        const k3_st_tensor *t = p->tensors[i].st;
        fp_add(md, t->name, strlen(t->name) + 1);
        fp_u64(md, (uint64_t)t->dtype);
        fp_u64(md, t->ndim);
        for (uint32_t d = 0; d < t->ndim; d++)
            fp_u64(md, t->shape[d]);
        fp_u64(md, t->shard);
        fp_u64(md, t->offset);
        fp_u64(md, t->nbytes);
    }
    unsigned int len = 0;
    EVP_DigestFinal_ex(md, p->fingerprint, &len);
    EVP_MD_CTX_free(md);
    return 0;
}

/* One group per shard. An expert (or a layer's trunk) whose tensors
 * straddle a shard boundary belongs to the group of its last tensor; that
 * group fetches the earlier parts with direct reads before streaming its
 * shard (conv_run.c), so no group depends on another and every shard is
 * resumable on its own. */
static int make_groups(k3_conv_plan *p, k3_err *e)
{
    uint32_t ns = k3_st_shard_count(p->st);
    p->groups = calloc(ns ? ns : 1, sizeof *p->groups);
    if (!p->groups)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint32_t s = 0; s < ns; s++) {
        k3_conv_group *g = &p->groups[p->ngroups++];
        g->shard_first = s;
        g->shard_end = s + 1;
        g->input_bytes = k3_st_shard_size(p->st, s);
    }
    return 0;
}

/* Lay out group g's trunk file and experts file. A layer's trunk (one slot)
 * is one unit, written by the group holding its last trunk tensor
 * (p->slot_group); units in order of their first tensor in the input,
 * tensors in input order. Records in order of completion. Appends units to
 * p->man.units. */
static int layout_group(k3_conv_plan *p, uint32_t g, uint64_t t_first, uint64_t t_end, k3_err *e)
{
    k3_conv_group *G = &p->groups[g];
    const k3_cfg *c = &p->cfg;
    uint32_t nslots = c->num_hidden_layers + 2;
    int32_t *slot_order = malloc(nslots * sizeof *slot_order);
    uint64_t ntr = 0;
    (void)t_first;
    (void)t_end;
    if (!slot_order) {
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    uint32_t nused = 0;
    /* the slots this group writes, in order of their first tensor */
    for (uint32_t s = 0; s < nslots; s++)
        if (p->slot_group[s] == g && p->slot_first[s + 1] > p->slot_first[s]) {
            slot_order[nused++] = (int32_t)s;
            ntr += p->slot_first[s + 1] - p->slot_first[s];
        }
    for (uint32_t a = 1; a < nused; a++) /* insertion sort: nused <= layers + 2 */
        for (uint32_t b = a; b > 0 && p->slot_tensors[p->slot_first[slot_order[b]]] <
                                       p->slot_tensors[p->slot_first[slot_order[b - 1]]]; b--) {
            int32_t t = slot_order[b];
            slot_order[b] = slot_order[b - 1];
            slot_order[b - 1] = t;
        }
    k3_conv_ofile *tf = &G->trunk;
    if (ntr) {
        snprintf(tf->name, sizeof tf->name, "trunk-%04u.k3t", g);
        tf->ext = calloc(ntr, sizeof *tf->ext);
        tf->regions = calloc(nused, sizeof *tf->regions);
        tf->region_crc = calloc(nused, sizeof *tf->region_crc);
        k3_pk_unit *nu = realloc(p->man.units, (p->man.nunits + nused) * sizeof *nu);
        if (!tf->ext || !tf->regions || !tf->region_crc || !nu) {
            free(slot_order);
            if (nu)
                p->man.units = nu;
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        }
        p->man.units = nu;
        G->unit_first = p->man.nunits;
        uint64_t off = 0;
        uint32_t next = 0;
        for (uint32_t k = 0; k < nused; k++) {
            uint32_t s = (uint32_t)slot_order[k];
            uint32_t uid = p->man.nunits++;
            k3_pk_unit *u = &p->man.units[uid];
            memset(u, 0, sizeof *u);
            u->offset = off;
            u->layer = (int32_t)s - 2;
            uint64_t in = 0;
            for (uint64_t j = p->slot_first[s]; j < p->slot_first[s + 1]; j++) {
                uint64_t i = p->slot_tensors[j];
                k3_pk_tensor *ot = &p->man.tensors[p->tensors[i].out_tensor];
                k3_pk_piece *pc = (k3_pk_piece *)ot->pieces;
                in = align_up(in, K3_PK_SECTION_ALIGN);
                pc->offset = off + in;
                pc->nbytes = ot->nbytes;
                pc->row_begin = 0;
                pc->row_end = ot->shape[0];
                pc->unit = UINT32_MAX - uid; /* marked laid out; fixed below */
                p->tensors[i].ext = next;
                tf->ext[next++] = (k3_conv_ext){pc->offset, pc->nbytes};
                in += ot->nbytes;
            }
            u->nbytes = align_up(in ? in : 1, K3_PK_ALIGN);
            tf->regions[k] = (k3_conv_ext){u->offset, u->nbytes};
            off += u->nbytes;
        }
        tf->nregions = nused;
        tf->next = next;
        tf->size = off;
        G->unit_end = p->man.nunits;
        /* extents must be in offset order: pieces were placed in stream order
         * per unit, units in order, so they are */
    }
    free(slot_order);

    /* experts: records whose last part lies in this group, by completion order */
    uint32_t nrec = 0;
    for (uint64_t i = t_first; i < t_end; i++) {
        if (p->tensors[i].role != K3_CONV_T_EXPERT)
            continue;
        k3_conv_rec *r = &p->recs[p->tensors[i].rec];
        /* the record completes at its last part in stream order */
        int last = 1;
        for (int w = 0; w < 3; w++)
            for (int q = 0; q < K3_MAN_XP_COUNT; q++)
                if (r->parts[w][q] > (int32_t)i)
                    last = 0;
        if (last) {
            r->group = g;
            r->slot = nrec++;
        }
    }
    k3_conv_ofile *xf = &G->experts;
    if (nrec) {
        uint64_t stride = p->man.xl.stride;
        snprintf(xf->name, sizeof xf->name, "experts-%04u.k3e", g);
        xf->ext = calloc(nrec, sizeof *xf->ext);
        xf->regions = calloc(nrec, sizeof *xf->regions);
        xf->region_crc = calloc(nrec, sizeof *xf->region_crc);
        if (!xf->ext || !xf->regions || !xf->region_crc)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        for (uint32_t k = 0; k < nrec; k++)
            xf->ext[k] = xf->regions[k] = (k3_conv_ext){(uint64_t)k * stride, stride};
        xf->nregions = nrec;
        xf->next = nrec;
        xf->size = (uint64_t)nrec * stride;
    }
    return 0;
}

static int load_tensors(k3_conv_plan *p, k3_man_expect *ex, uint32_t nex, int trunk_bf16, k3_err *e)
{
    const k3_cfg *c = &p->cfg;
    p->ntensors = k3_st_tensor_count(p->st);
    p->tensors = calloc(p->ntensors ? p->ntensors : 1, sizeof *p->tensors);
    p->nrecs = (uint64_t)k3_man_moe_layers(c) * c->num_experts;
    p->recs = calloc(p->nrecs ? p->nrecs : 1, sizeof *p->recs);
    p->man.tensors = calloc(nex ? nex : 1, sizeof *p->man.tensors);
    if (!p->tensors || !p->recs || !p->man.tensors)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint64_t r = 0; r < p->nrecs; r++)
        for (int w = 0; w < 3; w++)
            for (int q = 0; q < K3_MAN_XP_COUNT; q++)
                p->recs[r].parts[w][q] = -1;
    p->man.ntensors = nex;
    for (uint32_t i = 0; i < nex; i++) {
        k3_pk_tensor *ot = &p->man.tensors[i];
        ot->name = strdup(ex[i].name);
        k3_pk_piece *pc = calloc(1, sizeof *pc);
        if (!ot->name || !pc) {
            free(pc);
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        }
        ot->pieces = pc;
        ot->npieces = 1;
        pc->offset = UINT64_MAX;     /* "not laid out yet" */
        pc->unit = UINT32_MAX;       /* "not present yet" */
    }
    int rc;
    for (uint64_t i = 0; i < p->ntensors; i++) {
        const k3_st_tensor *t = k3_st_tensor_at(p->st, i);
        p->tensors[i].st = t;
        uint32_t layer, exn;
        int which, part;
        if (k3_man_expert_name(t->name, &layer, &exn, &which, &part)) {
            if ((rc = add_expert_part(p, i, layer, exn, which, part, e)))
                return rc;
            continue;
        }
        const k3_man_expect *x = k3_man_expect_find(ex, nex, t->name);
        if (!x) {
            /* read and hashed with its shard, not written; the manifest
             * says how many and how big (FORMAT.md §2, source.left_out) */
            p->nskipped++;
            if (strncmp(t->name, "language_model.", 15)) {
                p->man.left_outside_n++;
                p->man.left_outside_bytes += t->nbytes;
            } else {
                p->man.left_unused_n++;
                p->man.left_unused_bytes += t->nbytes;
            }
            continue;
        }
        const char *shard = k3_st_shard_name(p->st, t->shard);
        if (!is_float(t->dtype))
            return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: dtype %s is not supported for a trunk tensor "
                              "(BF16, F16 or F32)", shard, t->name, k3_dtype_name(t->dtype));
        if (!k3_man_expect_match(x, t))
            return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: shape does not match the config", shard, t->name);
        uint32_t oi = (uint32_t)(x - ex);
        k3_pk_tensor *ot = &p->man.tensors[oi];
        p->tensors[i].role = K3_CONV_T_TRUNK;
        p->tensors[i].out_tensor = oi;
        /* as stored upstream, bytes copied; rounded to BF16 only on request */
        p->tensors[i].out_dtype = trunk_bf16 ? K3_DT_BF16 : t->dtype;
        ot->dtype = p->tensors[i].out_dtype;
        ot->src_dtype = t->dtype;
        p->man.trunk_rounded += ot->dtype != t->dtype;
        ot->ndim = t->ndim;
        uint64_t elems = 1;
        for (uint32_t d = 0; d < t->ndim; d++) {
            ot->shape[d] = t->shape[d];
            elems *= t->shape[d];
        }
        if (t->ndim == 0 || elems == 0)
            return k3_err_set(e, K3_EFORMAT, "%s: tensor %s: empty", shard, t->name);
        ot->nbytes = elems * k3_dtype_size(ot->dtype);
        ((k3_pk_piece *)ot->pieces)->unit = (uint32_t)(x->layer + 2); /* the slot, until layout */
        p->tensors[i].slot = (uint32_t)(x->layer + 2);
    }
    /* every expected trunk tensor present */
    char missing[600] = "";
    uint32_t nmissing = 0;
    for (uint32_t i = 0; i < nex; i++)
        if (p->man.tensors[i].pieces[0].unit == UINT32_MAX) {
            if (nmissing < 3) {
                size_t l = strlen(missing);
                snprintf(missing + l, sizeof missing - l, "%s%s", nmissing ? ", " : "", ex[i].name);
            }
            nmissing++;
        }
    if (nmissing)
        return k3_err_set(e, K3_ENOENT, "%s: %u expected tensor(s) missing: %s%s", p->src, nmissing, missing,
                          nmissing > 3 ? ", ..." : "");
    p->xdtype = K3_DT_COUNT;
    for (uint64_t r = 0; r < p->nrecs; r++)
        if ((rc = check_record(p, r, e)))
            return rc;
    return 0;
}

int k3_conv_plan_build(k3_conv_plan *p, const char *src, const char *dst, int trunk_bf16, const char *hdr_dir,
                       k3_err *e)
{
    memset(p, 0, sizeof *p);
    snprintf(p->man.trunk_dtypes, sizeof p->man.trunk_dtypes, "%s", trunk_bf16 ? "bf16" : "source");
    int rc;
    if (!(p->src = strdup(src)) || !(p->dst = strdup(dst)))
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    /* a packed model, a file, a directory we may not read: said exactly */
    if ((rc = k3_io_dir_expect(src, K3_DIR_UPSTREAM, "k3-convert", e)) < 0)
        goto fail;
    char cpath[4096];
    if ((rc = k3_io_path_join(cpath, sizeof cpath, src, "config.json", e)))
        goto fail;
    if ((rc = k3_cfg_load(&p->cfg, cpath, e)))
        goto fail;
    if ((rc = k3_st_open_headers(&p->st, src, hdr_dir, 0, e)))
        goto fail;
    p->man.cfg = p->cfg;
    if (!(p->man.cfg_json = k3_cfg_to_json(&p->cfg)) || !(p->man.producer = strdup("k3-convert 1"))) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto fail;
    }
    uint32_t nmoe = k3_man_moe_layers(&p->cfg);
    if (nmoe && p->cfg.num_experts) {
        if ((rc = k3_man_expert_layout(&p->man.xl, p->cfg.moe_intermediate_size, p->cfg.routed_expert_hidden_size, e)))
            goto fail;
        p->man.has_experts = 1;
    }
    k3_man_expect *ex = NULL;
    uint32_t nex = 0;
    if ((rc = k3_man_expect_trunk(&p->cfg, &ex, &nex, e)))
        goto fail;
    rc = load_tensors(p, ex, nex, trunk_bf16, e);
    k3_man_expect_free(ex, nex);
    if (rc)
        goto fail;
    if (!p->man.has_experts)
        p->xfmt = K3_CONV_X_NONE;
    static const char *fmt_names[] = {"none", "mxfp4", "", "f8_e4m3"};
    snprintf(p->man.expert_format, sizeof p->man.expert_format, "%s",
             p->xfmt == K3_CONV_X_FLOAT ? (p->xdtype == K3_DT_BF16 ? "bf16" : p->xdtype == K3_DT_F16 ? "f16" : "f32")
                                        : fmt_names[p->xfmt]);
    if ((rc = make_groups(p, e)))
        goto fail;
    /* which group writes each layer's unit: the one holding its last tensor */
    uint32_t nslots = p->cfg.num_hidden_layers + 2;
    p->slot_group = calloc(nslots, sizeof *p->slot_group);
    if (!p->slot_group) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto fail;
    }
    for (uint64_t i = 0, g = 0; i < p->ntensors; i++) {
        while (g + 1 < p->ngroups && p->tensors[i].st->shard >= p->groups[g].shard_end)
            g++;
        if (p->tensors[i].role == K3_CONV_T_TRUNK)
            p->slot_group[p->tensors[i].slot] = (uint32_t)g;
    }
    /* trunk tensors per slot, in input order (CSR) */
    p->slot_first = calloc(nslots + 1, sizeof *p->slot_first);
    uint64_t ntrunk = 0;
    for (uint64_t i = 0; i < p->ntensors; i++)
        ntrunk += p->tensors[i].role == K3_CONV_T_TRUNK;
    p->slot_tensors = calloc(ntrunk ? ntrunk : 1, sizeof *p->slot_tensors);
    uint64_t *fill = calloc(nslots, sizeof *fill);
    if (!p->slot_first || !p->slot_tensors || !fill) {
        free(fill);
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto fail;
    }
    for (uint64_t i = 0; i < p->ntensors; i++)
        if (p->tensors[i].role == K3_CONV_T_TRUNK)
            p->slot_first[p->tensors[i].slot + 1]++;
    for (uint32_t k = 0; k < nslots; k++)
        p->slot_first[k + 1] += p->slot_first[k];
    for (uint64_t i = 0; i < p->ntensors; i++)
        if (p->tensors[i].role == K3_CONV_T_TRUNK) {
            uint32_t k = p->tensors[i].slot;
            p->slot_tensors[p->slot_first[k] + fill[k]++] = i;
        }
    free(fill);
    /* layout group by group over the (shard, offset)-ordered tensor list */
    uint64_t ti = 0;
    for (uint32_t g = 0; g < p->ngroups; g++) {
        uint64_t t0 = ti;
        while (ti < p->ntensors && p->tensors[ti].st->shard < p->groups[g].shard_end)
            ti++;
        if ((rc = layout_group(p, g, t0, ti, e)))
            goto fail;
        p->total_input += p->groups[g].input_bytes;
    }
    /* piece units were marked UINT32_MAX - uid during layout */
    for (uint32_t i = 0; i < p->man.ntensors; i++) {
        k3_pk_piece *pc = (k3_pk_piece *)p->man.tensors[i].pieces;
        pc->unit = UINT32_MAX - pc->unit;
    }
    /* files: per group trunk then experts; then experts.idx; tokenizer files
     * and embed.crc are appended by the run */
    uint32_t nfiles = 0;
    p->man.files = calloc(2 * p->ngroups + 4, sizeof *p->man.files);
    if (!p->man.files) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t g = 0; g < p->ngroups; g++) {
        k3_conv_ofile *fs[2] = {&p->groups[g].trunk, &p->groups[g].experts};
        for (int k = 0; k < 2; k++) {
            if (!fs[k]->size)
                continue;
            fs[k]->file_index = nfiles;
            k3_pk_file *f = &p->man.files[nfiles++];
            f->name = strdup(fs[k]->name);
            f->kind = k ? K3_PK_FILE_EXPERTS : K3_PK_FILE_TRUNK;
            f->size = fs[k]->size;
            if (!f->name) {
                p->man.nfiles = nfiles;
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
                goto fail;
            }
        }
        for (uint32_t u = p->groups[g].unit_first; u < p->groups[g].unit_end; u++)
            p->man.units[u].file = p->groups[g].trunk.file_index;
    }
    if (p->man.has_experts) {
        p->man.expert_index_file = nfiles;
        k3_pk_file *f = &p->man.files[nfiles++];
        f->name = strdup("experts.idx");
        f->kind = K3_PK_FILE_EXPERT_INDEX;
        f->size = k3_man_idx_size(&p->cfg);
        if (!f->name) {
            p->man.nfiles = nfiles;
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            goto fail;
        }
        p->records = calloc(p->nrecs ? p->nrecs : 1, sizeof *p->records);
        if (!p->records) {
            p->man.nfiles = nfiles;
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            goto fail;
        }
        for (uint64_t r = 0; r < p->nrecs; r++) {
            const k3_conv_group *G = &p->groups[p->recs[r].group];
            p->records[r].file = G->experts.file_index;
            p->records[r].offset = (uint64_t)p->recs[r].slot * p->man.xl.stride;
        }
    }
    p->man.nfiles = nfiles;
    if ((rc = fingerprint(p, e)))
        goto fail;
    return 0;
fail:
    k3_conv_plan_free(p);
    return rc;
}
