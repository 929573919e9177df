/*
 * vfy_upstream.c - k3-verify of an upstream checkpoint directory: every
 * shard's header (tensors inside the shard, sizes, overlaps: k3_st_header_*),
 * the index against the shards (both directions, extra shards), the config's
 * expected tensors (names, shapes, dtypes, complete expert sets), --sums
 * entries against the directory, and in full mode every listed file hashed.
 */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_man.h"
#include "k3_st.h"
#include "vfy.h"

#define MAX_LIST 8   /* names quoted per kind of problem before "... and N more" */

typedef struct shard {
    char *name;
    uint64_t size;
    int header_ok;
    int in_index;
    k3_st_header h;
} shard;

typedef struct tref {
    const char *name;
    uint32_t shard;
    const k3_st_tensor *t;
} tref;

static int tref_cmp(const void *a, const void *b)
{
    return strcmp(((const tref *)a)->name, ((const tref *)b)->name);
}

static const tref *tfind(const tref *v, uint64_t n, const char *name)
{
    uint64_t lo = 0, hi = n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(v[mid].name, name);
        if (c == 0)
            return &v[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(((const shard *)a)->name, ((const shard *)b)->name);
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* Collects missing names: quotes the first MAX_LIST, counts the rest. */
typedef struct miss {
    char text[1024];
    uint64_t n;
} miss;

static void miss_add(miss *m, const char *name)
{
    if (m->n < MAX_LIST) {
        size_t l = strlen(m->text);
        snprintf(m->text + l, sizeof m->text - l, "%s%s", m->n ? ", " : "", name);
    }
    m->n++;
}

static void check_index(k3_vfy *v, shard *sh, uint32_t ns, const tref *all, uint64_t nall, uint8_t *indexed,
                        int *index_present)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", v->dir);
    *index_present = access(path, F_OK) == 0;
    if (!*index_present)
        return;
    const char *iname = "model.safetensors.index.json";
    char *txt;
    uint64_t len;
    k3_err e = {0};
    if (k3_io_read_file(path, 1ull << 30, &txt, &len, &e)) {
        k3_vfy_problem(v, iname, "%s", e.msg);
        return;
    }
    cJSON *root = cJSON_ParseWithLength(txt, (size_t)len);
    free(txt);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        k3_vfy_problem(v, iname, "%s", root ? "no \"weight_map\" object" : "not valid JSON");
        cJSON_Delete(root);
        return;
    }
    miss absent = {0}, wrong = {0}, badshard = {0};
    uint64_t entries = 0;
    for (const cJSON *it = wm->child; it; it = it->next) {
        entries++;
        if (!cJSON_IsString(it) || !it->string) {
            miss_add(&badshard, it->string ? it->string : "?");
            continue;
        }
        uint32_t s;
        for (s = 0; s < ns; s++)
            if (!strcmp(sh[s].name, it->valuestring))
                break;
        if (s == ns) {
            char b[600];
            snprintf(b, sizeof b, "%.200s -> %.200s", it->string, it->valuestring);
            miss_add(&badshard, b);
            continue;
        }
        sh[s].in_index = 1;
        if (!sh[s].header_ok)
            continue;
        const tref *r = tfind(all, nall, it->string);
        if (r)
            indexed[r - all] = 1;
        if (!r)
            miss_add(&absent, it->string);
        else if (r->shard != s) {
            char b[600];
            snprintf(b, sizeof b, "%.200s (index: %.100s, found in %.100s)", it->string, it->valuestring,
                     sh[r->shard].name);
            miss_add(&wrong, b);
        }
    }
    if (badshard.n)
        k3_vfy_problem(v, iname, "%" PRIu64 " entries name a shard that is missing: %s%s", badshard.n, badshard.text,
                       badshard.n > MAX_LIST ? ", ..." : "");
    if (absent.n)
        k3_vfy_problem(v, iname, "%" PRIu64 " tensors are in the index but not in their shard: %s%s", absent.n,
                       absent.text, absent.n > MAX_LIST ? ", ..." : "");
    if (wrong.n)
        k3_vfy_problem(v, iname, "%" PRIu64 " tensors are in another shard than the index says: %s%s", wrong.n,
                       wrong.text, wrong.n > MAX_LIST ? ", ..." : "");
    /* every tensor of a good shard must be in the index */
    miss *extra = calloc(ns ? ns : 1, sizeof *extra);
    for (uint64_t i = 0; extra && i < nall; i++)
        if (!indexed[i] && !(i > 0 && !strcmp(all[i].name, all[i - 1].name)))
            miss_add(&extra[all[i].shard], all[i].name);
    for (uint32_t s = 0; extra && s < ns; s++)
        if (extra[s].n)
            k3_vfy_problem(v, sh[s].name, "%" PRIu64 " tensors are not in the index (a shard of another checkpoint?): "
                           "%s%s", extra[s].n, extra[s].text, extra[s].n > MAX_LIST ? ", ..." : "");
    free(extra);
    cJSON_Delete(root);
}

static void check_expected(k3_vfy *v, const k3_cfg *cfg, shard *sh, const tref *all, uint64_t nall, int all_ok)
{
    k3_man_expect *ex;
    uint32_t nex;
    k3_err e = {0};
    if (k3_man_expect_trunk(cfg, &ex, &nex, &e)) {
        k3_vfy_problem(v, NULL, "%s", e.msg);
        return;
    }
    miss missing = {0};
    for (uint32_t i = 0; i < nex; i++) {
        const tref *r = tfind(all, nall, ex[i].name);
        if (!r) {
            miss_add(&missing, ex[i].name);
            continue;
        }
        const k3_st_tensor *t = r->t;
        if (t->dtype != K3_DT_BF16 && t->dtype != K3_DT_F16 && t->dtype != K3_DT_F32)
            k3_vfy_problem(v, sh[r->shard].name, "tensor %s: dtype %s, expected BF16, F16 or F32", t->name,
                           k3_dtype_name(t->dtype));
        else if (!k3_man_expect_match(&ex[i], t))
            k3_vfy_problem(v, sh[r->shard].name, "tensor %s: shape does not match the config (expected %s[%" PRIu64
                           ", %" PRIu64 "%s])", t->name, ex[i].kind == K3_MAN_T_MATRIX ? "" : "elements ",
                           ex[i].shape[0], ex[i].shape[1], ex[i].ndim > 2 ? ", ..." : "");
    }
    k3_man_expect_free(ex, nex);
    /* routed experts: MXFP4 (weight_packed + weight_scale) or float/F8 (weight [+ weight_scale_inv]) */
    const uint64_t I = cfg->moe_intermediate_size, L = cfg->routed_expert_hidden_size;
    for (uint32_t layer = cfg->first_k_dense_replace; layer < cfg->num_hidden_layers; layer++)
        for (uint32_t x = 0; x < cfg->num_experts; x++)
            for (int w = 0; w < 3; w++) {
                uint64_t rows = w == 1 ? L : I, cols = w == 1 ? I : L;
                char base[256], n1[300], n2[300];
                k3_schema_expert_name(base, sizeof base, layer, x, w, NULL);
                snprintf(n1, sizeof n1, "%s." K3_SCH_XP_PACKED, base);
                const tref *p = tfind(all, nall, n1);
                if (p) {
                    snprintf(n2, sizeof n2, "%s." K3_SCH_XP_SCALE, base);
                    const tref *s = tfind(all, nall, n2);
                    if (!s)
                        miss_add(&missing, n2);
                    if (p->t->dtype != K3_DT_U8 || p->t->ndim != 2 || p->t->shape[0] != rows ||
                        p->t->shape[1] != cols / 2)
                        k3_vfy_problem(v, sh[p->shard].name, "tensor %s: expected U8 [%" PRIu64 ", %" PRIu64 "]", n1,
                                       rows, cols / 2);
                    if (s && (s->t->dtype != K3_DT_U8 || s->t->ndim != 2 || s->t->shape[0] != rows ||
                              s->t->shape[1] != cols / 32))
                        k3_vfy_problem(v, sh[s->shard].name, "tensor %s: expected U8 [%" PRIu64 ", %" PRIu64 "]", n2,
                                       rows, cols / 32);
                    continue;
                }
                snprintf(n2, sizeof n2, "%s." K3_SCH_XP_WEIGHT, base);
                const tref *f = tfind(all, nall, n2);
                if (!f) {
                    miss_add(&missing, n1);
                    continue;
                }
                if (f->t->ndim != 2 || f->t->shape[0] != rows || f->t->shape[1] != cols)
                    k3_vfy_problem(v, sh[f->shard].name, "tensor %s: expected [%" PRIu64 ", %" PRIu64 "]", n2, rows,
                                   cols);
                if (f->t->dtype == K3_DT_F8_E4M3) {
                    snprintf(n1, sizeof n1, "%s." K3_SCH_XP_SCALE_INV, base);
                    if (!tfind(all, nall, n1))
                        miss_add(&missing, n1);
                }
            }
    if (missing.n)
        k3_vfy_problem(v, NULL, "%" PRIu64 " tensors the config expects are missing%s: %s%s", missing.n,
                       all_ok ? "" : " (some may be in the unreadable shards above)", missing.text,
                       missing.n > MAX_LIST ? ", ..." : "");
}

int k3_vfy_upstream(k3_vfy *v, k3_err *e)
{
    DIR *d = opendir(v->dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open", v->dir);
    shard *sh = NULL;
    uint32_t ns = 0, cap = 0;
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d))) {
        if (!ends_with(de->d_name, ".safetensors"))
            continue;
        if (ns == cap) {
            cap = cap ? cap * 2 : 64;
            shard *n = realloc(sh, cap * sizeof *n);
            if (!n) {
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
                break;
            }
            sh = n;
        }
        memset(&sh[ns], 0, sizeof sh[ns]);
        if (!(sh[ns].name = strdup(de->d_name))) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            break;
        }
        ns++;
    }
    closedir(d);
    if (rc)
        goto out;
    if (ns)
        qsort(sh, ns, sizeof *sh, name_cmp);
    if (ns == 0)
        k3_vfy_problem(v, NULL, "no *.safetensors shard");

    /* config */
    k3_cfg cfg;
    char path[4400];
    snprintf(path, sizeof path, "%s/config.json", v->dir);
    k3_err ce = {0};
    int cfg_ok = k3_cfg_load(&cfg, path, &ce) == 0;
    if (!cfg_ok)
        k3_vfy_problem(v, "config.json", "%s", ce.msg);

    /* headers */
    uint64_t nall = 0;
    int all_ok = 1;
    for (uint32_t s = 0; s < ns; s++) {
        snprintf(path, sizeof path, "%s/%s", v->dir, sh[s].name);
        k3_err he = {0};
        int fd = k3_io_open_read(path, 0, NULL, &he);
        if (fd >= 0) {
            if (k3_io_file_size(fd, &sh[s].size, path, &he) == 0 && k3_st_header_read(&sh[s].h, fd, path, &he) == 0)
                sh[s].header_ok = 1;
            close(fd);
        }
        if (!sh[s].header_ok) {
            const char *msg = he.msg;
            size_t pl = strlen(path);
            if (!strncmp(msg, path, pl) && msg[pl] == ':')
                msg += pl + 2;
            k3_vfy_problem(v, sh[s].name, "%s", msg);
            all_ok = 0;
        } else {
            nall += sh[s].h.count;
        }
    }
    tref *all = calloc(nall ? nall : 1, sizeof *all);
    if (!all) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto out;
    }
    uint64_t k = 0;
    for (uint32_t s = 0; s < ns; s++)
        for (uint64_t i = 0; sh[s].header_ok && i < sh[s].h.count; i++)
            all[k++] = (tref){sh[s].h.tensors[i].name, s, &sh[s].h.tensors[i]};
    qsort(all, nall, sizeof *all, tref_cmp);
    /* duplicates: one line per shard holding a second copy */
    miss *dup = calloc(ns ? ns : 1, sizeof *dup);
    uint32_t *dup_of = calloc(ns ? ns : 1, sizeof *dup_of);
    for (uint64_t i = 1; dup && dup_of && i < nall; i++)
        if (!strcmp(all[i].name, all[i - 1].name)) {
            uint32_t a = all[i - 1].shard, b = all[i].shard, hi = a > b ? a : b;
            if (!dup[hi].n)
                dup_of[hi] = a > b ? b : a;
            miss_add(&dup[hi], all[i].name);
        }
    for (uint32_t s = 0; dup && dup_of && s < ns; s++)
        if (dup[s].n)
            k3_vfy_problem(v, sh[s].name, "%" PRIu64 " tensors are also in %s: %s%s", dup[s].n, sh[dup_of[s]].name,
                           dup[s].text, dup[s].n > MAX_LIST ? ", ..." : "");
    free(dup);
    free(dup_of);

    int index_present = 0;
    uint8_t *indexed = calloc(nall ? nall : 1, 1);
    if (!indexed) {
        free(all);
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto out;
    }
    check_index(v, sh, ns, all, nall, indexed, &index_present);
    free(indexed);
    for (uint32_t s = 0; index_present && s < ns; s++)
        if (!sh[s].in_index)
            k3_vfy_problem(v, sh[s].name, "unexpected extra file: a shard the index does not name");
    if (cfg_ok)
        check_expected(v, &cfg, sh, all, nall, all_ok);
    free(all);

    /* --sums: every listed file present, every shard listed */
    for (uint32_t s = 0; v->sums && s < ns; s++) {
        k3_vfy_sum *sum = k3_vfy_sums_find(v, sh[s].name);
        if (!sum)
            k3_vfy_problem(v, sh[s].name, "unexpected extra file: not in the sums file");
        else
            sum->seen = 1;
    }
    for (uint32_t i = 0; v->sums && i < v->nsums; i++) {
        if (v->sums[i].seen)
            continue;
        snprintf(path, sizeof path, "%s/%s", v->dir, v->sums[i].name);
        if (access(path, F_OK) != 0)
            k3_vfy_problem(v, v->sums[i].name, "missing (named by the sums file)");
    }

    if (v->full) {
        k3_vfy_job *jobs = calloc(ns + v->nsums + 1, sizeof *jobs);
        if (!jobs) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            goto out;
        }
        uint32_t nj = 0;
        for (uint32_t s = 0; s < ns; s++) {
            if (!sh[s].header_ok)
                continue; /* already reported; its size is not trustworthy */
            k3_vfy_job *j = &jobs[nj++];
            snprintf(j->name, sizeof j->name, "%s", sh[s].name);
            snprintf(j->path, sizeof j->path, "%s/%s", v->dir, sh[s].name);
            j->size = sh[s].size;
            k3_vfy_sum *sum = v->sums ? k3_vfy_sums_find(v, sh[s].name) : NULL;
            if (sum) {
                j->has_want = 1;
                memcpy(j->want, sum->sha256, 32);
                j->want_from = "the sums file";
            }
        }
        /* other files named by the sums file (config, index, tokenizer) */
        for (uint32_t i = 0; v->sums && i < v->nsums; i++) {
            if (ends_with(v->sums[i].name, ".safetensors"))
                continue;
            struct stat st;
            snprintf(path, sizeof path, "%s/%s", v->dir, v->sums[i].name);
            if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
                continue;
            k3_vfy_job *j = &jobs[nj++];
            snprintf(j->name, sizeof j->name, "%s", v->sums[i].name);
            snprintf(j->path, sizeof j->path, "%s", path);
            j->size = (uint64_t)st.st_size;
            j->has_want = 1;
            memcpy(j->want, v->sums[i].sha256, 32);
            j->want_from = "the sums file";
        }
        k3_vfy_hash_jobs(v, jobs, nj);
        free(jobs);
    }
out:
    for (uint32_t s = 0; s < ns; s++) {
        free(sh[s].name);
        if (sh[s].header_ok)
            k3_st_header_free(&sh[s].h);
    }
    free(sh);
    return rc;
}
