/*
 * vfy_common.c - k3-verify's problem list, --sums files, and the parallel
 * full-file hashing pass (SHA-256 of every file, CRC32 of every region in it,
 * one sequential read per file).
 */
#include "vfy.h"

#include <inttypes.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_crc.h"
#include "k3_io.h"
#include "k3_json.h"
#include "k3_man.h"
#include "k3_progress.h"

#define HASH_CHUNK (8u << 20)

void k3_vfy_problem(k3_vfy *v, const char *file, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* a library message that starts with the very path reported: once is enough */
    char where[4400];
    snprintf(where, sizeof where, "%s%s%s: ", v->dir, file ? "/" : "", file ? file : "");
    size_t wl = strlen(where);
    if (!strncmp(msg, where, wl))
        memmove(msg, msg + wl, strlen(msg + wl) + 1);
    pthread_mutex_lock(&v->mu);
    v->problems++;
    if (v->jproblems) {
        where[wl - 2] = '\0';
        char *w = k3_json_utf8_dup(where), *mm = k3_json_utf8_dup(msg);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "path", w ? w : "");
        cJSON_AddStringToObject(o, "problem", mm ? mm : "");
        cJSON_AddItemToArray((cJSON *)v->jproblems, o);
        free(w);
        free(mm);
    } else if (file)
        fprintf(v->out, "%s/%s: %s\n", v->dir, file, msg);
    else
        fprintf(v->out, "%s: %s\n", v->dir, msg);
    fflush(v->out);
    pthread_mutex_unlock(&v->mu);
}

int k3_vfy_sums_load(k3_vfy *v, const char *path, k3_err *e)
{
    char *txt;
    uint64_t len;
    int rc = k3_io_read_file(path, 64u << 20, &txt, &len, e);
    if (rc)
        return rc;
    uint32_t cap = 0, line = 0;
    char *save = NULL;
    for (char *l = strtok_r(txt, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        line++;
        size_t n = strlen(l);
        if (n && l[n - 1] == '\r')
            l[--n] = '\0';
        if (n == 0)
            continue;
        if (n < 67 || (l[64] != ' ') || (l[65] != ' ' && l[65] != '*')) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %u is not \"SHA256  NAME\"", path, line);
            break;
        }
        char hex[65];
        for (int i = 0; i < 64; i++)
            hex[i] = (char)(l[i] >= 'A' && l[i] <= 'F' ? l[i] - 'A' + 'a' : l[i]);
        hex[64] = '\0';
        if (cap == v->nsums) {
            cap = cap ? cap * 2 : 64;
            k3_vfy_sum *ns = realloc(v->sums, cap * sizeof *ns);
            if (!ns) {
                rc = k3_err_set(e, K3_ENOMEM, "out of memory");
                break;
            }
            v->sums = ns;
        }
        k3_vfy_sum *s = &v->sums[v->nsums];
        memset(s, 0, sizeof *s);
        if (k3_man_unhex(hex, s->sha256)) {
            rc = k3_err_set(e, K3_EFORMAT, "%s: line %u: bad SHA-256", path, line);
            break;
        }
        const char *name = l + 66;
        const char *slash = strrchr(name, '/');
        if (!(s->name = strdup(slash ? slash + 1 : name))) {
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
            break;
        }
        v->nsums++;
    }
    free(txt);
    if (rc == 0 && v->nsums == 0)
        rc = k3_err_set(e, K3_EFORMAT, "%s: no entries", path);
    if (rc == 0 && !v->sums)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    return rc;
}

void k3_vfy_sums_free(k3_vfy *v)
{
    for (uint32_t i = 0; i < v->nsums; i++)
        free(v->sums[i].name);
    free(v->sums);
    v->sums = NULL;
    v->nsums = 0;
}

k3_vfy_sum *k3_vfy_sums_find(k3_vfy *v, const char *name)
{
    for (uint32_t i = 0; i < v->nsums; i++)
        if (!strcmp(v->sums[i].name, name))
            return &v->sums[i];
    return NULL;
}

static void hash_one(k3_vfy *v, k3_vfy_job *j, uint8_t *buf)
{
    k3_err e = {0};
    int direct = 0;
    int fd = k3_io_open_read(j->path, 1, &direct, &e);
    if (fd < 0) {
        k3_vfy_problem(v, j->name, "cannot open: %s", e.msg);
        return;
    }
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        k3_vfy_problem(v, j->name, "cannot create a SHA-256 context");
        EVP_MD_CTX_free(md);
        close(fd);
        return;
    }
    uint32_t r = 0;
    uint32_t crc = 0;   /* the CRC of nothing */
    uint64_t off = 0, crcs = 0;
    int ok = 1;
    while (off < j->size) {
        uint64_t n = j->size - off < HASH_CHUNK ? j->size - off : HASH_CHUNK;
        int rc;
        if (direct) {
            /* aligned body straight into buf, the tail (< 4096) through the bounce */
            uint64_t al = n / K3_IO_DIRECT_ALIGN * K3_IO_DIRECT_ALIGN;
            rc = al ? k3_io_pread_direct(fd, buf, al, off, NULL, 0, j->path, &e) : 0;
            if (rc == 0 && n > al)
                rc = k3_io_pread_direct(fd, buf + al, n - al, off + al, buf + HASH_CHUNK, 2 * K3_IO_DIRECT_ALIGN,
                                        j->path, &e);
        } else {
            rc = k3_io_pread(fd, buf, n, off, j->path, &e);
        }
        if (rc) {
            k3_vfy_problem(v, j->name, "read failed: %s", e.msg);
            ok = 0;
            break;
        }
        EVP_DigestUpdate(md, buf, (size_t)n);
        k3_progress_add(v->progress, n);
        /* CRCs of the regions overlapping [off, off+n) */
        uint64_t pos = off;
        while (pos < off + n && r < j->nregions) {
            const k3_vfy_region *g = &j->regions[r];
            uint64_t gend = g->off + g->len;
            if (pos < g->off) {
                pos = g->off < off + n ? g->off : off + n;
                continue;
            }
            uint64_t take = (gend < off + n ? gend : off + n) - pos;
            crc = k3_crc32(crc, buf + (pos - off), (size_t)take);
            pos += take;
            if (pos == gend) {
                crcs++;
                if (crc != g->crc)
                    k3_vfy_problem(v, j->name, "%s at offset %" PRIu64 ": CRC32 mismatch (expected %08x, computed %08x)",
                                   g->what, g->off, g->crc, crc);
                crc = 0;
                r++;
            }
        }
        off += n;
    }
    uint8_t got[32];
    unsigned int hl = 0;
    EVP_DigestFinal_ex(md, got, &hl);
    EVP_MD_CTX_free(md);
    close(fd);
    if (ok && j->has_want && memcmp(got, j->want, 32)) {
        char w[65], g[65];
        k3_man_hex(j->want, w);
        k3_man_hex(got, g);
        k3_vfy_problem(v, j->name, "SHA-256 mismatch: %s says %s, the file hashes to %s (corrupted, or a file of "
                       "another checkpoint)", j->want_from, w, g);
    }
    pthread_mutex_lock(&v->mu);
    v->files++;
    v->bytes_hashed += off;
    v->crcs_checked += crcs;
    pthread_mutex_unlock(&v->mu);
}

static int job_cmp(const void *a, const void *b)
{
    const k3_vfy_job *x = a, *y = b;
    return x->size < y->size ? 1 : x->size > y->size ? -1 : strcmp(x->name, y->name);
}

void k3_vfy_hash_jobs(k3_vfy *v, k3_vfy_job *jobs, uint32_t n)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += jobs[i].size;
    k3_progress_set_total(v->progress, total);
    /* biggest first, so the last file to finish is a small one */
    qsort(jobs, n, sizeof *jobs, job_cmp);
    int nt = v->threads > 0 ? v->threads : 1;
#pragma omp parallel num_threads(nt)
    {
        uint8_t *buf = k3_io_alloc_aligned(HASH_CHUNK + 2 * K3_IO_DIRECT_ALIGN, K3_IO_HUGE_ALIGN);
#pragma omp for schedule(dynamic, 1)
        for (uint32_t i = 0; i < n; i++) {
            if (buf)
                hash_one(v, &jobs[i], buf);
            else
                k3_vfy_problem(v, jobs[i].name, "not checked: out of memory");
        }
        k3_io_free_aligned(buf);
    }
}
