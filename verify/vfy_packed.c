/*
 * vfy_packed.c - k3-verify of a packed model directory: the manifest (its
 * own hash, schema, consistency), the directory listing against it (missing,
 * extra), every file's size, experts.idx, provenance against --sums, and
 * then either a sample of record CRCs (--quick) or every byte hashed with
 * every unit and record CRC checked (full); embedding rows against embed.crc
 * (a sample with --quick, every row in full).
 */
#include <dirent.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_crc.h"
#include "k3_io.h"
#include "k3_man.h"
#include "vfy.h"

/* A rank's slice (plan.slice, pack/pack_slice.c): the units with holes and
 * the ranges kept of each. */
typedef struct kept {
    uint32_t unit;
    uint64_t off, len;
    uint32_t crc;
} kept;

typedef struct pstate {
    k3_man m;
    uint32_t ranks, rank;       /* ranks 0: a whole model */
    kept *kept;
    uint32_t nkept;
    uint8_t *holed;             /* per unit: it has holes, its kept ranges stand for it */
    int *size_ok;               /* per file */
    k3_pk_record *recs;         /* NULL if experts.idx is unusable */
    uint32_t *row_crc;          /* embed.crc; NULL if unusable */
} pstate;

static void check_listing(k3_vfy *v, pstate *s)
{
    DIR *d = opendir(v->dir);
    if (!d) {
        k3_vfy_problem(v, NULL, "cannot list the directory");
        return;
    }
    uint8_t *seen = calloc(s->m.nfiles ? s->m.nfiles : 1, 1);
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..") || !strcmp(n, "manifest.json"))
            continue;
        uint32_t i;
        for (i = 0; i < s->m.nfiles; i++)
            if (!strcmp(s->m.files[i].name, n))
                break;
        if (i < s->m.nfiles) {
            if (seen)
                seen[i] = 1;
            continue;
        }
        size_t l = strlen(n);
        if (!strcmp(n, ".k3-convert-journal"))
            k3_vfy_problem(v, n, "unexpected extra file: the journal of an unfinished k3-convert");
        else if (l > 4 && !strcmp(n + l - 4, ".tmp"))
            k3_vfy_problem(v, n, "unexpected extra file: a temporary of an unfinished write");
        else
            k3_vfy_problem(v, n, "unexpected extra file (not in the manifest)");
    }
    closedir(d);
    for (uint32_t i = 0; i < s->m.nfiles; i++) {
        const k3_pk_file *f = &s->m.files[i];
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", v->dir, f->name);
        struct stat st;
        if ((seen && !seen[i]) || stat(path, &st) != 0) {
            k3_vfy_problem(v, f->name, "missing (%" PRIu64 " bytes expected)", f->size);
            continue;
        }
        if (!S_ISREG(st.st_mode)) {
            k3_vfy_problem(v, f->name, "not a regular file");
            continue;
        }
        uint64_t size = (uint64_t)st.st_size;
        if (size < f->size)
            k3_vfy_problem(v, f->name, "truncated at byte %" PRIu64 " of %" PRIu64, size, f->size);
        else if (size > f->size)
            k3_vfy_problem(v, f->name, "%" PRIu64 " bytes, the manifest says %" PRIu64 " (data past the end)", size,
                           f->size);
        else
            s->size_ok[i] = 1;
    }
    free(seen);
}

/* Read a small file the manifest names (whole, into *buf) and check its
 * size and SHA-256; problems are reported and give -1. what names the file's
 * role in the mismatch message; count: add it to the files and bytes hashed
 * once read. */
static int read_named(k3_vfy *v, const pstate *s, uint32_t fi, const char *what, int count, char path[4400],
                      char **buf, uint64_t *len)
{
    const k3_pk_file *f = &s->m.files[fi];
    if (!s->size_ok[fi])
        return -1;
    snprintf(path, 4400, "%s/%s", v->dir, f->name);
    k3_err e = {0};
    if (k3_io_read_file(path, 1ull << 32, buf, len, &e)) {
        k3_vfy_problem(v, f->name, "%s", e.msg);
        return -1;
    }
    uint8_t sha[32];
    unsigned int hl = 0;
    EVP_Digest(*buf, (size_t)*len, sha, &hl, EVP_sha256(), NULL);
    if (count) {
        v->files++;
        v->bytes_hashed += *len;
    }
    if (*len != f->size || memcmp(sha, f->sha256, 32)) {
        k3_vfy_problem(v, f->name, "SHA-256 mismatch: %s is not the one the manifest names", what);
        free(*buf);
        return -1;
    }
    return 0;
}

static void check_index(k3_vfy *v, pstate *s)
{
    if (!s->m.has_experts)
        return;
    const k3_pk_file *f = &s->m.files[s->m.expert_index_file];
    char path[4400], *buf;
    uint64_t len;
    if (read_named(v, s, s->m.expert_index_file, "the record table", 0, path, &buf, &len))
        return;
    k3_err e = {0};
    uint64_t n = (uint64_t)k3_man_moe_layers(&s->m.cfg) * s->m.cfg.num_experts;
    s->recs = calloc(n ? n : 1, sizeof *s->recs);
    if (!s->recs || k3_man_idx_decode(&s->m, (const uint8_t *)buf, len, s->recs, path, &e)) {
        k3_vfy_problem(v, f->name, "%s", s->recs ? e.msg : "out of memory");
        free(s->recs);
        s->recs = NULL;
    }
    free(buf);
}

/* embed.crc: its SHA-256 (it is not hashed again in full mode), then the
 * table is kept for check_embed_rows */
static void check_embed_crc(k3_vfy *v, pstate *s)
{
    const k3_pk_file *f = &s->m.files[s->m.embed_crc_file];
    char path[4400], *buf;
    uint64_t len;
    if (read_named(v, s, s->m.embed_crc_file, "the embedding's row CRC table", 1, path, &buf, &len))
        return;
    s->row_crc = malloc(len / 4 * sizeof *s->row_crc + 1);
    if (!s->row_crc)
        k3_vfy_problem(v, f->name, "not checked: out of memory");
    for (uint64_t i = 0; s->row_crc && i < len / 4; i++) {
        const uint8_t *b = (const uint8_t *)buf + 4 * i;
        s->row_crc[i] = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    }
    free(buf);
}

/* Each embedding row (every one in full mode, v->sample of them evenly
 * spread with --quick) against its CRC32 in embed.crc. */
static void check_embed_rows(k3_vfy *v, pstate *s)
{
    const k3_man *m = &s->m;
    const k3_pk_tensor *t = NULL;
    for (uint32_t i = 0; i < m->ntensors; i++)
        if (!strcmp(m->tensors[i].name, K3_SCH_EMBED_NAME))
            t = &m->tensors[i];
    if (!s->row_crc)
        return;
    if (!t || t->ndim != 2 || t->shape[0] != m->cfg.vocab_size) {
        k3_vfy_problem(v, "manifest.json", "no embedding table [vocab_size, hidden_size]");
        return;
    }
    const uint64_t V = t->shape[0], rb = t->shape[1] * (t->dtype == K3_DT_F32 ? 4 : 2);
    const uint64_t want = v->full ? V : (v->sample < V ? v->sample : V);
    uint8_t *buf = malloc(rb ? rb : 1);
    if (!buf)
        return;
    for (uint64_t k = 0; k < want; k++) {
        uint64_t r = want > 1 ? k * (V - 1) / (want - 1) : 0;
        const k3_pk_piece *pc = NULL;
        for (uint32_t j = 0; j < t->npieces; j++)
            if (r >= t->pieces[j].row_begin && r < t->pieces[j].row_end)
                pc = &t->pieces[j];
        if (!pc)
            continue; /* the manifest's validation covers every row */
        uint32_t fi = m->units[pc->unit].file;
        if (!s->size_ok[fi])
            continue;
        const k3_pk_file *f = &m->files[fi];
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", v->dir, f->name);
        uint64_t off = pc->offset + (r - pc->row_begin) * rb;
        k3_err e = {0};
        int fd = k3_io_open_read(path, 0, NULL, &e);
        if (fd < 0 || k3_io_pread(fd, buf, rb, off, path, &e)) {
            k3_vfy_problem(v, f->name, "%s", e.msg);
            if (fd >= 0)
                close(fd);
            break;
        }
        close(fd);
        uint32_t c = k3_crc32(0, buf, (size_t)rb);
        if (c != s->row_crc[r])
            k3_vfy_problem(v, f->name, "embedding row %" PRIu64 " at offset %" PRIu64
                           ": CRC32 mismatch (embed.crc says %08x, computed %08x)", r, off, s->row_crc[r], c);
        v->crcs_checked++;
    }
    free(buf);
}

static void check_provenance(k3_vfy *v, pstate *s)
{
    const k3_man *m = &s->m;
    if (m->nsrc_shards == 0)
        k3_vfy_problem(v, "manifest.json", "provenance: no upstream shard recorded");
    for (uint32_t i = 0; i < m->nsrc_shards; i++) {
        for (uint32_t j = 0; j < i; j++)
            if (!strcmp(m->src_shards[i].name, m->src_shards[j].name))
                k3_vfy_problem(v, "manifest.json", "provenance: shard %s recorded twice", m->src_shards[i].name);
        if (!v->sums)
            continue;
        k3_vfy_sum *sum = k3_vfy_sums_find(v, m->src_shards[i].name);
        if (!sum) {
            k3_vfy_problem(v, "manifest.json", "provenance: shard %s is not in the sums file", m->src_shards[i].name);
            continue;
        }
        sum->seen = 1;
        if (memcmp(sum->sha256, m->src_shards[i].sha256, 32))
            k3_vfy_problem(v, "manifest.json", "provenance: shard %s: converted from bytes whose SHA-256 differs "
                           "from the sums file (another checkpoint, or a corrupted download)", m->src_shards[i].name);
    }
    /* the small source files (config, index, tokenizer) were hashed as read:
     * with --sums, each one the sums file lists must match it. One it does not
     * list is not a problem (as for an upstream directory, where only shards
     * must be listed): publishers' lists often cover the large files only. */
    for (uint32_t i = 0; v->sums && i < m->nsrc_files; i++) {
        k3_vfy_sum *sum = k3_vfy_sums_find(v, m->src_files[i].name);
        if (!sum)
            continue;
        sum->seen = 1;
        if (memcmp(sum->sha256, m->src_files[i].sha256, 32))
            k3_vfy_problem(v, "manifest.json", "provenance: source file %s: read as bytes whose SHA-256 differs "
                           "from the sums file (a corrupted download or read)", m->src_files[i].name);
    }
    /* tokenizer files are copied byte for byte: they must be what the source had */
    for (uint32_t i = 0; i < m->nfiles; i++) {
        if (m->files[i].kind != K3_PK_FILE_TOKENIZER)
            continue;
        uint32_t j;
        for (j = 0; j < m->nsrc_files; j++)
            if (!strcmp(m->src_files[j].name, m->files[i].name))
                break;
        if (j == m->nsrc_files)
            k3_vfy_problem(v, "manifest.json", "provenance: tokenizer file %s has no source entry", m->files[i].name);
        else if (m->src_files[j].size != m->files[i].size || memcmp(m->src_files[j].sha256, m->files[i].sha256, 32))
            k3_vfy_problem(v, "manifest.json", "provenance: tokenizer file %s differs from the source's",
                           m->files[i].name);
    }
    for (uint32_t i = 0; v->sums && i < v->nsums; i++) {
        if (v->sums[i].seen)
            continue;
        int known = 0;
        for (uint32_t j = 0; j < m->nsrc_files; j++)
            known |= !strcmp(m->src_files[j].name, v->sums[i].name);
        if (!known && strstr(v->sums[i].name, ".safetensors"))
            k3_vfy_problem(v, "manifest.json", "provenance: shard %s of the sums file was not converted",
                           v->sums[i].name);
    }
}

static int region_cmp(const void *a, const void *b)
{
    const k3_vfy_region *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* --quick: the CRC of v->sample trunk units of the files too large to hash
 * (first, last and evenly between, in manifest order). */
static void sample_units(k3_vfy *v, pstate *s)
{
    const k3_man *m = &s->m;
    uint32_t n = 0;
    for (uint32_t u = 0; u < m->nunits; u++)
        n += m->files[m->units[u].file].size > v->quick_max;
    uint64_t want = v->sample < n ? v->sample : n;
    for (uint64_t k = 0; k < want; k++) {
        uint64_t target = want > 1 ? k * (n - 1) / (want - 1) : 0, seen = 0;
        uint32_t u;
        for (u = 0; u < m->nunits; u++)
            if (m->files[m->units[u].file].size > v->quick_max && seen++ == target)
                break;
        const k3_pk_unit *un = &m->units[u];
        const k3_pk_file *f = &m->files[un->file];
        if (!s->size_ok[un->file])
            continue;
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", v->dir, f->name);
        uint8_t *buf = malloc(un->nbytes ? un->nbytes : 1);
        k3_err e = {0};
        int fd = buf ? k3_io_open_read(path, 0, NULL, &e) : -1;
        if (!buf) {
            k3_vfy_problem(v, f->name, "unit %u not checked: out of memory", u);
            continue;
        }
        if (fd < 0 || k3_io_pread(fd, buf, un->nbytes, un->offset, path, &e)) {
            k3_vfy_problem(v, f->name, "%s", e.msg);
            if (fd >= 0)
                close(fd);
            free(buf);
            continue;
        }
        close(fd);
        uint32_t c = k3_crc32(0, buf, (size_t)un->nbytes);
        free(buf);
        if (c != un->crc32)
            k3_vfy_problem(v, f->name, "unit %u (layer %d) at offset %" PRIu64 ": CRC32 mismatch (expected %08x, "
                           "computed %08x)", u, un->layer, un->offset, un->crc32, c);
        v->crcs_checked++;
    }
}

static void sample_records(k3_vfy *v, pstate *s)
{
    if (!s->recs)
        return;
    const k3_man *m = &s->m;
    uint64_t n = (uint64_t)k3_man_moe_layers(&m->cfg) * m->cfg.num_experts;
    uint64_t want = v->sample < n ? v->sample : n;
    uint8_t *buf = k3_io_alloc_aligned(m->xl.stride, K3_PK_ALIGN);
    if (!buf)
        return;
    for (uint64_t k = 0; k < want; k++) {
        uint64_t i = want > 1 ? k * (n - 1) / (want - 1) : 0;  /* first, last and evenly between */
        const k3_pk_record *r = &s->recs[i];
        const k3_pk_file *f = &m->files[r->file];
        if (!s->size_ok[r->file] || f->size <= v->quick_max)
            continue;   /* a small file was hashed whole, its records with it */
        char path[4400];
        snprintf(path, sizeof path, "%s/%s", v->dir, f->name);
        k3_err e = {0};
        int fd = k3_io_open_read(path, 0, NULL, &e);
        if (fd < 0 || k3_io_pread(fd, buf, m->xl.stride, r->offset, path, &e)) {
            k3_vfy_problem(v, f->name, "%s", e.msg);
            if (fd >= 0)
                close(fd);
            continue;
        }
        close(fd);
        uint32_t c = k3_crc32(0, buf, (size_t)m->xl.stride);
        uint32_t layer = (uint32_t)(i / m->cfg.num_experts) + m->cfg.first_k_dense_replace;
        if (c != r->crc32)
            k3_vfy_problem(v, f->name, "record layer %u expert %u at offset %" PRIu64
                           ": CRC32 mismatch (expected %08x, computed %08x)",
                           layer, (uint32_t)(i % m->cfg.num_experts), r->offset, r->crc32, c);
        v->crcs_checked++;
    }
    k3_io_free_aligned(buf);
}

/* Hash every file of at most max_size bytes (all of them in full mode),
 * checking the CRC of every unit and record inside. */
static void full_hash(k3_vfy *v, pstate *s, uint64_t max_size)
{
    const k3_man *m = &s->m;
    k3_vfy_job *jobs = calloc(m->nfiles ? m->nfiles : 1, sizeof *jobs);
    uint32_t *nreg = calloc(m->nfiles ? m->nfiles : 1, sizeof *nreg);
    if (!jobs || !nreg) {
        k3_vfy_problem(v, NULL, "not checked: out of memory");
        free(jobs);
        free(nreg);
        return;
    }
    uint64_t nrec = s->recs ? (uint64_t)k3_man_moe_layers(&m->cfg) * m->cfg.num_experts : 0;
    for (uint32_t u = 0; u < m->nunits; u++)
        nreg[m->units[u].file]++;
    for (uint32_t k = 0; k < s->nkept; k++)
        nreg[m->units[s->kept[k].unit].file]++;
    for (uint64_t r = 0; r < nrec; r++)
        nreg[s->recs[r].file]++;
    uint32_t nj = 0;
    int oom = 0;
    uint32_t *job_of = calloc(m->nfiles ? m->nfiles : 1, sizeof *job_of);
    for (uint32_t i = 0; job_of && i < m->nfiles; i++) {
        if (!s->size_ok[i] || i == (s->m.has_experts ? s->m.expert_index_file : UINT32_MAX) ||
            i == s->m.embed_crc_file || (m->files[i].size > max_size && m->files[i].kind != K3_PK_FILE_TOKENIZER))
            continue; /* experts.idx and embed.crc were hashed already */
        k3_vfy_job *j = &jobs[nj];
        job_of[i] = nj + 1;
        snprintf(j->name, sizeof j->name, "%s", m->files[i].name);
        snprintf(j->path, sizeof j->path, "%s/%s", v->dir, m->files[i].name);
        j->size = m->files[i].size;
        /* a slice's data files have holes: their units and records say it all */
        const int data = m->files[i].kind == K3_PK_FILE_TRUNK || m->files[i].kind == K3_PK_FILE_EXPERTS;
        j->has_want = !(s->ranks && data);
        memcpy(j->want, m->files[i].sha256, 32);
        j->want_from = "the manifest";
        if (nreg[i] && !(j->regions = calloc(nreg[i], sizeof *j->regions)))
            oom = 1;
        nj++;
    }
    for (uint32_t k = 0; !oom && job_of && k < s->nkept; k++) {
        const kept *kp = &s->kept[k];
        uint32_t ji = job_of[m->units[kp->unit].file];
        if (!ji)
            continue;
        k3_vfy_region *g = &jobs[ji - 1].regions[jobs[ji - 1].nregions++];
        g->off = kp->off;
        g->len = kp->len;
        g->crc = kp->crc;
        snprintf(g->what, sizeof g->what, "unit %u (layer %d), bytes kept by the slice", kp->unit,
                 m->units[kp->unit].layer);
    }
    for (uint32_t u = 0; !oom && job_of && u < m->nunits; u++) {
        uint32_t ji = job_of[m->units[u].file];
        if (!ji || (s->holed && s->holed[u]))
            continue;
        k3_vfy_job *j = &jobs[ji - 1];
        k3_vfy_region *g = &j->regions[j->nregions++];
        g->off = m->units[u].offset;
        g->len = m->units[u].nbytes;
        g->crc = m->units[u].crc32;
        snprintf(g->what, sizeof g->what, "unit %u (layer %d)", u, m->units[u].layer);
    }
    for (uint64_t r = 0; !oom && job_of && r < nrec; r++) {
        uint32_t ji = job_of[s->recs[r].file];
        if (!ji || (s->ranks && (r % m->cfg.num_experts) % s->ranks != s->rank))
            continue;   /* another rank's expert: a hole in a slice */
        k3_vfy_job *j = &jobs[ji - 1];
        k3_vfy_region *g = &j->regions[j->nregions++];
        g->off = s->recs[r].offset;
        g->len = m->xl.stride;
        g->crc = s->recs[r].crc32;
        snprintf(g->what, sizeof g->what, "record layer %u expert %u",
                 (uint32_t)(r / m->cfg.num_experts) + m->cfg.first_k_dense_replace,
                 (uint32_t)(r % m->cfg.num_experts));
    }
    if (oom || !job_of) {
        k3_vfy_problem(v, NULL, "not checked: out of memory");
    } else {
        for (uint32_t i = 0; i < nj; i++)
            if (jobs[i].nregions)
                qsort(jobs[i].regions, jobs[i].nregions, sizeof *jobs[i].regions, region_cmp);
        k3_vfy_hash_jobs(v, jobs, nj);
    }
    for (uint32_t i = 0; i < nj; i++)
        free(jobs[i].regions);
    free(jobs);
    free(nreg);
    free(job_of);
}

/* plan.slice of a rank's slice: its ranks and the kept ranges of its units
 * with holes (0 and nothing for a whole model; -1 after a problem). */
static int read_slice(k3_vfy *v, pstate *s)
{
    cJSON *plan = cJSON_Parse(s->m.plan_json ? s->m.plan_json : "{}");
    const cJSON *sl = cJSON_GetObjectItemCaseSensitive(plan, "slice");
    int rc = 0;
    if (!sl)
        goto done;
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(sl, "ranks"), *r = cJSON_GetObjectItemCaseSensitive(sl, "rank");
    const cJSON *units = cJSON_GetObjectItemCaseSensitive(sl, "units");
    if (!cJSON_IsNumber(n) || !cJSON_IsNumber(r) || n->valuedouble < 2 || n->valuedouble > 256 ||
        r->valuedouble < 0 || r->valuedouble >= n->valuedouble || !cJSON_IsArray(units)) {
        k3_vfy_problem(v, "manifest.json", "plan.slice: ranks, rank or units are not what k3-pack --ranks writes");
        rc = -1;
        goto done;
    }
    s->ranks = v->slice_ranks = (uint32_t)n->valuedouble;
    s->rank = v->slice_rank = (uint32_t)r->valuedouble;
    if (!(s->holed = calloc(s->m.nunits ? s->m.nunits : 1, 1))) {
        rc = -1;
        goto done;
    }
    const cJSON *u;
    cJSON_ArrayForEach(u, units) {
        const cJSON *ui = cJSON_GetObjectItemCaseSensitive(u, "unit"), *ks = cJSON_GetObjectItemCaseSensitive(u, "kept");
        if (!cJSON_IsNumber(ui) || ui->valuedouble < 0 || ui->valuedouble >= s->m.nunits || !cJSON_IsArray(ks)) {
            k3_vfy_problem(v, "manifest.json", "plan.slice: a unit entry is not what k3-pack --ranks writes");
            rc = -1;
            goto done;
        }
        const uint32_t un = (uint32_t)ui->valuedouble;
        const k3_pk_unit *pu = &s->m.units[un];
        s->holed[un] = 1;
        const cJSON *k;
        cJSON_ArrayForEach(k, ks) {
            const cJSON *o = cJSON_GetArrayItem(k, 0), *l = cJSON_GetArrayItem(k, 1), *c = cJSON_GetArrayItem(k, 2);
            unsigned crc;
            if (!cJSON_IsNumber(o) || !cJSON_IsNumber(l) || !cJSON_IsString(c) || o->valuedouble < pu->offset ||
                l->valuedouble < 1 || o->valuedouble + l->valuedouble > pu->offset + pu->nbytes ||
                strlen(c->valuestring) != 8 || sscanf(c->valuestring, "%8x", &crc) != 1) {
                k3_vfy_problem(v, "manifest.json", "plan.slice: a kept range of unit %u is not inside it", un);
                rc = -1;
                goto done;
            }
            kept *nk = realloc(s->kept, (s->nkept + 1) * sizeof *nk);
            if (!nk) {
                rc = -1;
                goto done;
            }
            s->kept = nk;
            s->kept[s->nkept++] = (kept){un, (uint64_t)o->valuedouble, (uint64_t)l->valuedouble, crc};
        }
    }
done:
    cJSON_Delete(plan);
    return rc;
}

int k3_vfy_packed(k3_vfy *v, k3_err *e)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/manifest.json", v->dir);
    if (access(path, F_OK) != 0) {
        k3_vfy_problem(v, NULL, "incomplete packed model: no manifest.json");
        return 0;
    }
    pstate s = {0};
    char *txt;
    uint64_t len;
    k3_err pe = {0};
    int rc = k3_io_read_file(path, K3_MAN_MAX_BYTES, &txt, &len, &pe);
    if (rc == 0) {
        rc = k3_man_parse(&s.m, txt, len, path, &pe);
        free(txt);
    }
    if (rc) {
        /* without a trustworthy manifest nothing else can be judged */
        const char *msg = pe.msg;
        size_t pl = strlen(path);
        if (!strncmp(msg, path, pl) && msg[pl] == ':')
            msg += pl + 2;
        k3_vfy_problem(v, "manifest.json", "%s", msg);
        return 0;
    }
    v->have_model = 1;
    for (uint32_t i = 0; i < s.m.ntensors; i++) {
        k3_dtype d = s.m.tensors[i].dtype;
        v->trunk_n[d == K3_DT_F32 ? 2 : d == K3_DT_F16 ? 1 : 0]++;
    }
    v->trunk_rounded = s.m.trunk_rounded;
    v->left_outside_n = s.m.left_outside_n;
    v->left_outside_bytes = s.m.left_outside_bytes;
    v->left_unused_n = s.m.left_unused_n;
    v->left_unused_bytes = s.m.left_unused_bytes;
    s.size_ok = calloc(s.m.nfiles ? s.m.nfiles : 1, sizeof *s.size_ok);
    if (!s.size_ok) {
        k3_man_free(&s.m);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    if (read_slice(v, &s) < 0) {
        free(s.size_ok);
        k3_man_free(&s.m);
        return 0;
    }
    check_listing(v, &s);
    check_index(v, &s);
    check_embed_crc(v, &s);
    check_provenance(v, &s);
    if (v->full || s.ranks) {   /* a slice is checked whole: its ranges are listed, not sampled */
        full_hash(v, &s, UINT64_MAX);
    } else {
        /* --quick: every small file hashed whole (tokenizer, small trunk and
         * expert files, with their CRCs), a sample of the units and records of
         * the large ones */
        full_hash(v, &s, v->quick_max);
        sample_units(v, &s);
        sample_records(v, &s);
    }
    check_embed_rows(v, &s);
    free(s.kept);
    free(s.holed);
    free(s.recs);
    free(s.row_crc);
    free(s.size_ok);
    k3_man_free(&s.m);
    return 0;
}

void k3_vfy_packed_notes(const k3_vfy *v, FILE *f, const char *pre)
{
    if (!v->have_model)
        return;
    if (v->slice_ranks)
        fprintf(f, "%sslice: rank %u of %u ranks (k3-pack --ranks): its bytes checked, the other ranks' pieces "
                "and experts are holes\n", pre, v->slice_rank, v->slice_ranks);
    uint32_t n = v->trunk_n[0] + v->trunk_n[1] + v->trunk_n[2];
    if (v->trunk_rounded)
        fprintf(f, "%strunk: %u tensors, %u BF16, %u F16, %u F32; LOSSY: %u rounded to BF16 on request "
                "(k3-convert --trunk-dtype bf16)\n", pre, n, v->trunk_n[0], v->trunk_n[1], v->trunk_n[2],
                v->trunk_rounded);
    else
        fprintf(f, "%strunk: %u tensors, %u BF16, %u F16, %u F32, all as stored upstream (lossless)\n", pre, n,
                v->trunk_n[0], v->trunk_n[1], v->trunk_n[2]);
    fprintf(f, "%sleft out: %" PRIu64 " tensors outside language_model. (%" PRIu64 " bytes), %" PRIu64
            " unused by the config (%" PRIu64 " bytes)\n", pre, v->left_outside_n, v->left_outside_bytes,
            v->left_unused_n, v->left_unused_bytes);
}
