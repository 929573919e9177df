/*
 * pack_slice.c - k3-pack --ranks N --rank R: the slice of a packed model
 * that rank R of an N-rank job reads (docs/DIST.md), so that its disk holds
 * only that.
 *
 * The slice has every file of the model, at its size, and the same
 * manifest but for plan.slice. What rank R never reads is left as holes:
 * the pieces of the other ranks' rows of every streamed matrix (cut as the
 * rank's own run cuts them at --ram-piece, k3_ws_stream_foreign) and the
 * expert records of the other ranks (expert e is rank e mod N's). Blocks of
 * 4096 bytes are holes only when wholly foreign: a block shared with kept
 * bytes is written. Every unit and record read from SRC is checked against
 * its CRC before anything of it is written.
 *
 * plan.slice = {"ranks": N, "rank": R, "piece_bytes": P,
 *               "units": [{"unit": U, "kept": [[offset, nbytes, "crc32"], ...]}]}
 * lists, for every unit with holes, the byte ranges kept and their CRC32,
 * which k3-verify checks (the manifest's own CRC of such a unit covers
 * bytes that are not there).
 *
 * The slice is written in DST.k3-pack-tmp and renamed to DST when complete
 * (manifest.json last); on an error or an interrupt only that directory's
 * files, all of them ours, are removed.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cjson/cJSON.h>

#include "k3_io.h"
#include "k3_man.h"
#include "k3_pk.h"
#include "k3_stream.h"
#include "pack.h"

typedef struct span {
    uint32_t file;
    uint64_t a, b;
} span;

typedef struct spans {
    span *v;
    uint64_t n, cap;
    int oom;
} spans;

static void add_span(void *arg, uint32_t file, uint64_t a, uint64_t b)
{
    spans *s = arg;
    if (s->n == s->cap) {
        uint64_t cap = s->cap ? 2 * s->cap : 256;
        span *v = realloc(s->v, cap * sizeof *v);
        if (!v) {
            s->oom = 1;
            return;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = (span){file, a, b};
}

static int span_cmp(const void *x, const void *y)
{
    const span *a = x, *b = y;
    if (a->file != b->file)
        return a->file < b->file ? -1 : 1;
    return a->a < b->a ? -1 : a->a > b->a;
}

/* Write [a, b) of the unit image u (starting at file offset off) to fd,
 * leaving out the whole blocks of the foreign spans fs[0..nf) inside it.
 * kept: the ranges written, with their CRC32, appended to arr (a JSON
 * array) when the unit has holes. */
static int write_unit(int fd, const char *path, const uint8_t *u, uint64_t off, uint64_t n, const span *fs,
                      uint64_t nf, cJSON *kept, k3_err *e)
{
    uint64_t cur = off;
    for (uint64_t i = 0; i <= nf; i++) {
        uint64_t ha = i < nf ? (fs[i].a + 4095) / 4096 * 4096 : off + n;
        uint64_t hb = i < nf ? fs[i].b / 4096 * 4096 : off + n;
        if (i < nf && hb <= ha)
            continue;   /* no whole block to leave out */
        if (ha > cur) {
            int rc = k3_io_pwrite(fd, u + (cur - off), ha - cur, cur, path, e);
            if (rc < 0)
                return rc;
            if (kept) {
                char hex[9];
                snprintf(hex, sizeof hex, "%08x", (uint32_t)crc32(0, u + (cur - off), (uInt)(ha - cur)));
                cJSON *r = cJSON_CreateArray();
                cJSON_AddItemToArray(r, cJSON_CreateNumber((double)cur));
                cJSON_AddItemToArray(r, cJSON_CreateNumber((double)(ha - cur)));
                cJSON_AddItemToArray(r, cJSON_CreateString(hex));
                cJSON_AddItemToArray(kept, r);
            }
        }
        cur = hb > cur ? hb : cur;
    }
    return 0;
}

static int copy_file(const k3_pk *pk, uint32_t fi, int fd, const char *path, k3_err *e)
{
    const k3_pk_file *f = k3_pk_file_at(pk, fi);
    uint8_t *buf = malloc(1u << 20);
    if (!buf)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    int rc = 0;
    for (uint64_t off = 0; off < f->size && rc == 0; off += 1u << 20) {
        uint64_t k = f->size - off < (1u << 20) ? f->size - off : (1u << 20);
        rc = k3_pk_read(pk, fi, buf, k, off, NULL, 0, e);
        if (rc == 0)
            rc = k3_io_pwrite(fd, buf, k, off, path, e);
    }
    free(buf);
    return rc;
}

/* Every file of the slice into tmp; plan.slice's unit list into units. */
static int write_files(const k3_pk *pk, const char *tmp, uint32_t ranks, uint32_t rank, const spans *fs,
                       cJSON *units, k3_err *e)
{
    const k3_cfg *c = k3_pk_cfg(pk);
    const k3_pk_expert_layout *xl = k3_pk_experts(pk);
    int rc = 0;
    for (uint32_t fi = 0; fi < k3_pk_file_count(pk) && rc == 0; fi++) {
        const k3_pk_file *f = k3_pk_file_at(pk, fi);
        char path[8192];
        if ((rc = k3_io_path_join(path, sizeof path, tmp, f->name, e)) < 0)
            break;
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", path);
        if (ftruncate(fd, (off_t)f->size) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot size to %" PRIu64 " bytes", path, f->size);
        if (rc == 0 && f->kind == K3_PK_FILE_TRUNK) {
            for (uint32_t ui = 0; ui < k3_pk_unit_count(pk) && rc == 0; ui++) {
                const k3_pk_unit *u = k3_pk_unit_at(pk, ui);
                if (u->file != fi)
                    continue;
                if (k3_pack_interrupted()) {
                    rc = k3_err_set(e, K3_EINTR, "interrupted");
                    break;
                }
                uint8_t *img = k3_io_alloc_aligned(u->nbytes ? u->nbytes : 4096, 4096);
                if (!img) {
                    rc = k3_err_set(e, K3_ENOMEM, "out of memory for a unit of %" PRIu64 " bytes", u->nbytes);
                    break;
                }
                rc = k3_pk_read_unit(pk, ui, img, 1, e);   /* the source checked first */
                uint64_t i0 = 0, nf = 0;
                while (i0 < fs->n && (fs->v[i0].file < fi || (fs->v[i0].file == fi && fs->v[i0].b <= u->offset)))
                    i0++;
                while (i0 + nf < fs->n && fs->v[i0 + nf].file == fi && fs->v[i0 + nf].a < u->offset + u->nbytes)
                    nf++;
                cJSON *kept = nf ? cJSON_CreateArray() : NULL;
                if (rc == 0)
                    rc = write_unit(fd, path, img, u->offset, u->nbytes, fs->v + i0, nf, kept, e);
                if (kept) {
                    cJSON *o = cJSON_CreateObject();
                    cJSON_AddNumberToObject(o, "unit", ui);
                    cJSON_AddItemToObject(o, "kept", kept);
                    cJSON_AddItemToArray(units, o);
                }
                k3_io_free_aligned(img);
            }
        } else if (rc == 0 && f->kind == K3_PK_FILE_EXPERTS) {
            uint8_t *rec = k3_io_alloc_aligned(xl->stride, 4096);
            if (!rec)
                rc = k3_err_set(e, K3_ENOMEM, "out of memory for an expert record");
            for (uint32_t L = c->first_k_dense_replace; L < c->num_hidden_layers && rc == 0; L++)
                for (uint32_t x = rank; x < c->num_experts && rc == 0; x += ranks) {
                    const k3_pk_record *r = k3_pk_record_find(pk, L, x);
                    if (!r || r->file != fi)
                        continue;
                    rc = k3_pk_read_record(pk, L, x, rec, 1, e);   /* checks its CRC */
                    if (rc == 0)
                        rc = k3_io_pwrite(fd, rec, xl->stride, r->offset, path, e);
                }
            k3_io_free_aligned(rec);
        } else if (rc == 0) {
            rc = copy_file(pk, fi, fd, path, e);
        }
        if (rc == 0 && fsync(fd) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: fsync", path);
        if (close(fd) != 0 && rc == 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: close", path);
    }
    return rc;
}

/* The manifest of SRC with plan.slice added, sealed again. */
static int write_manifest(const char *src, const char *tmp, uint32_t ranks, uint32_t rank, uint64_t piece,
                          cJSON *units, k3_err *e)
{
    char mp[8192];
    char *txt = NULL;
    uint64_t len;
    k3_man m;
    memset(&m, 0, sizeof m);
    int rc = k3_io_path_join(mp, sizeof mp, src, "manifest.json", e);
    if (rc == 0)
        rc = k3_io_read_file(mp, K3_MAN_MAX_BYTES, &txt, &len, e);
    if (rc == 0)
        rc = k3_man_parse(&m, txt, len, mp, e);
    free(txt);
    if (rc < 0)
        return rc;
    cJSON *plan = cJSON_Parse(m.plan_json ? m.plan_json : "{}");
    cJSON *slice = cJSON_CreateObject();
    cJSON_AddNumberToObject(slice, "ranks", ranks);
    cJSON_AddNumberToObject(slice, "rank", rank);
    cJSON_AddNumberToObject(slice, "piece_bytes", (double)piece);
    cJSON_AddItemReferenceToObject(slice, "units", units);
    if (plan) {
        cJSON_DeleteItemFromObject(plan, "slice");
        cJSON_AddItemToObject(plan, "slice", slice);
    }
    char *pj = plan ? cJSON_PrintUnformatted(plan) : NULL;
    cJSON_Delete(plan);
    if (!plan)
        cJSON_Delete(slice);
    char *out = NULL;
    if (pj) {
        free(m.plan_json);
        m.plan_json = pj;
        out = k3_man_to_json(&m);
    }
    k3_man_free(&m);
    if (!out)
        return k3_err_set(e, K3_ENOMEM, "out of memory writing the manifest");
    rc = k3_io_path_join(mp, sizeof mp, tmp, "manifest.json", e);
    if (rc == 0)
        rc = k3_io_write_file_atomic(mp, out, strlen(out), e);
    free(out);
    return rc;
}

/* Remove the files of tmp (all ours) and tmp itself. */
static void remove_tmp(const k3_pk *pk, const char *tmp)
{
    char p[8192];
    for (uint32_t fi = 0; pk && fi < k3_pk_file_count(pk); fi++)
        if (k3_io_path_join(p, sizeof p, tmp, k3_pk_file_at(pk, fi)->name, NULL) == 0)
            unlink(p);
    if (k3_io_path_join(p, sizeof p, tmp, "manifest.json", NULL) == 0)
        unlink(p);
    rmdir(tmp);
}

int k3_pack_slice(const char *src, const char *dst, uint32_t ranks, uint32_t rank, uint64_t piece, k3_err *e)
{
    struct stat st;
    if (lstat(dst, &st) == 0)
        return k3_err_set(e, K3_EEXIST, "%s exists: a slice is written only where nothing is", dst);
    char tmp[8192];
    if (snprintf(tmp, sizeof tmp, "%s%s", dst, K3_PACK_TMP_SUFFIX) >= (int)sizeof tmp)
        return k3_err_set(e, K3_EARG, "%s: path too long", dst);
    if (lstat(tmp, &st) == 0)
        return k3_err_set(e, K3_EEXIST, "%s exists (an earlier slice that did not finish?): remove it first", tmp);
    spans fs = {0};
    int rc = k3_ws_stream_foreign(src, ranks, rank, piece, add_span, &fs, e);
    if (rc == 0 && fs.oom)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    if (rc < 0) {
        free(fs.v);
        return rc;
    }
    qsort(fs.v, fs.n, sizeof *fs.v, span_cmp);
    k3_pk *pk = NULL;
    if ((rc = k3_pk_open(&pk, src, 0, e)) < 0) {
        free(fs.v);
        return rc;
    }
    if (mkdir(tmp, 0755) != 0) {
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot create", tmp);
        k3_pk_close(pk);
        free(fs.v);
        return rc;
    }
    cJSON *units = cJSON_CreateArray();
    rc = units ? write_files(pk, tmp, ranks, rank, &fs, units, e) : k3_err_set(e, K3_ENOMEM, "out of memory");
    if (rc == 0 && k3_pack_interrupted())
        rc = k3_err_set(e, K3_EINTR, "interrupted");
    if (rc == 0)
        rc = write_manifest(src, tmp, ranks, rank, piece, units, e);
    cJSON_Delete(units);
    if (rc == 0)
        rc = k3_io_fsync_dir(tmp, e);
    if (rc == 0 && rename(tmp, dst) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot rename to %s", tmp, dst);
    if (rc == 0) {
        char parent[8192];
        snprintf(parent, sizeof parent, "%s", dst);
        char *sl = strrchr(parent, '/');
        if (sl)
            *sl = 0;
        rc = k3_io_fsync_dir(sl ? (parent[0] ? parent : "/") : ".", e);
    } else {
        remove_tmp(pk, tmp);
    }
    k3_pk_close(pk);
    free(fs.v);
    return rc;
}
