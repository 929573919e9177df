/*
 * pack_run.c - execute a repack plan (pack.h) crash-safely.
 *
 * DST is built as "DST.k3-pack-tmp": the journal ("DST.k3-pack-tmp/
 * .k3-pack-journal/") first records the plan's fingerprint, then one entry per
 * finished output file (written atomically after the file itself was
 * fsynced and renamed into place). manifest.json is written last, the journal
 * removed, the directory fsynced and renamed to DST, and DST's parent fsynced.
 * So at any kill point DST is either absent (the temporary can be resumed
 * with --resume, or removed with --force) or complete.
 *
 * Trunk bytes are copied piece by piece from the source (read once, O_DIRECT
 * where the filesystem allows; every source unit CRC-checked as it streams
 * past, before the new trunk file is published) into the new trunk file through the
 * k3-convert output writer (common/outfile.c: hashes and unit CRCs computed
 * while writing, zero blocks left as holes). Expert files that do not change
 * are hard-linked, else reflinked (FICLONE), else copied; reordered expert
 * records are read CRC-checked and written in their new order.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/fs.h>
#include <openssl/evp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_outfile.h"
#include "k3_crc.h"
#include "k3_io.h"
#include "pack.h"

static volatile sig_atomic_t stop_requested;

void k3_pack_interrupt(void) { stop_requested = 1; }

static int check_stop(k3_err *e)
{
    if (stop_requested)
        return k3_err_set(e, K3_EINTR, "interrupted: run again with --resume to continue");
    return 0;
}

/* Test hook: K3_PACK_CRASH="STAGE:N" kills the process with SIGKILL at that
 * point. STAGE: "trunk" after the N-th trunk piece is written (the trunk
 * temporary is half written), "file" after output file N is published but
 * before its journal entry, "journaled" after its journal entry, "manifest"
 * after manifest.json is in the temporary directory, "renaming" after the
 * journal is removed, before the rename (N ignored for both). */
static void crash_point(const char *stage, uint32_t n)
{
    const char *v = getenv("K3_PACK_CRASH");
    if (!v)
        return;
    size_t l = strlen(stage);
    if (strncmp(v, stage, l) || v[l] != ':')
        return;
    char *end;
    unsigned long want = strtoul(v + l + 1, &end, 10);
    if (*end == 0 && (want == n || !strcmp(stage, "manifest") || !strcmp(stage, "renaming")))
        raise(SIGKILL);
}

/* ------------------------------------------------------------ helpers */

/* Remove a flat directory we own (regular files, and the journal directory
 * one level down). */
static int remove_tree(const char *dir, int depth, k3_err *e)
{
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? 0 : k3_err_sys(e, K3_EIO, errno, "%s: cannot open", dir);
    struct dirent *de;
    char path[4400];
    int rc = 0;
    while (!rc && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (lstat(path, &st) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot stat", path);
        else if (S_ISDIR(st.st_mode) && depth > 0)
            rc = remove_tree(path, depth - 1, e);
        else if (S_ISDIR(st.st_mode))
            rc = k3_err_set(e, K3_EIO, "%s: unexpected directory: not removing", path);
        else if (unlink(path) != 0)
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", path);
    }
    closedir(d);
    if (!rc && rmdir(dir) != 0)
        rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot remove", dir);
    return rc;
}

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* ------------------------------------------------------------ journal */

static int journal_path(char *out, size_t cap, const char *tmp, const char *name)
{
    int n = snprintf(out, cap, "%s/" K3_PACK_JOURNAL "%s%s%s", tmp, name ? "/" : "", name ? name : "",
                     name ? ".json" : "");
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

static int journal_write(const char *tmp, const k3_pack_plan *p, const k3_pack_out *out, k3_err *e)
{
    const k3_pk_file *f = &p->man.files[out->file];
    cJSON *o = cJSON_CreateObject();
    char hex[65], path[4400];
    k3_man_hex(f->sha256, hex);
    cJSON_AddStringToObject(o, "name", f->name);
    cJSON_AddNumberToObject(o, "size", (double)f->size);
    cJSON_AddStringToObject(o, "sha256", hex);
    if (out->how == K3_PACK_OUT_TRUNK) {
        cJSON *a = cJSON_AddArrayToObject(o, "crc32");
        for (uint32_t u = 0; u < p->man.nunits; u++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber(p->man.units[u].crc32));
    }
    char *js = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    /* sealed with its SHA-256, so that --resume never takes a value that
     * reads back differently from what was written */
    size_t tl = 0;
    char *txt = js ? k3_man_seal(js, strlen(js), &tl) : NULL;
    free(js);
    if (!txt)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    int rc = journal_path(path, sizeof path, tmp, f->name) ? k3_err_set(e, K3_ELIMIT, "%s: path too long", tmp)
                                                            : k3_io_write_file_atomic(path, txt, tl, e);
    free(txt);
    return rc;
}

/* 1 if the journal holds a finished entry for out whose file still has its
 * size (sha256 and unit CRCs are taken from the entry), 0 if not. */
static int journal_take(const char *tmp, k3_pack_plan *p, const k3_pack_out *out)
{
    k3_pk_file *f = &p->man.files[out->file];
    char path[4400], fpath[4400];
    char *txt = NULL;
    uint64_t len;
    k3_err je = {0};
    if (journal_path(path, sizeof path, tmp, f->name) || k3_io_read_file(path, 1u << 30, &txt, &len, &je))
        return 0;
    /* an entry that does not hash to its first line is not trusted: redo */
    size_t bl = 0;
    const char *body = k3_man_unseal(txt, len, &bl);
    if (!body) {
        free(txt);
        return 0;
    }
    cJSON *o = cJSON_ParseWithLength(body, bl);
    free(txt);
    int ok = 0;
    struct stat st;
    snprintf(fpath, sizeof fpath, "%s/%s", tmp, f->name);
    const cJSON *sz = cJSON_GetObjectItemCaseSensitive(o, "size");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(o, "sha256");
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(o, "name");
    uint8_t sha[32];
    if (o && cJSON_IsNumber(sz) && (uint64_t)sz->valuedouble == f->size && cJSON_IsString(sh) &&
        cJSON_IsString(nm) && !strcmp(nm->valuestring, f->name) && !k3_man_unhex(sh->valuestring, sha) &&
        stat(fpath, &st) == 0 && (uint64_t)st.st_size == f->size) {
        ok = 1;
        if (out->how == K3_PACK_OUT_TRUNK) {
            const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "crc32");
            if (!cJSON_IsArray(a) || (uint32_t)cJSON_GetArraySize(a) != p->man.nunits)
                ok = 0;
            uint32_t u = 0;
            const cJSON *it;
            cJSON_ArrayForEach(it, a)
            {
                if (!ok || !cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble > 4294967295.0) {
                    ok = 0;
                    break;
                }
                p->man.units[u++].crc32 = (uint32_t)it->valuedouble;
            }
        } else if (memcmp(sha, f->sha256, 32) && out->how != K3_PACK_OUT_EXPERTS) {
            ok = 0;   /* linked/index files have hashes known from the plan */
        }
        if (ok)
            memcpy(f->sha256, sha, 32);
    }
    cJSON_Delete(o);
    return ok;
}

/* ------------------------------------------------------------ trunk */

/* Source trunk units are CRC-checked as their bytes stream past: each unit
 * keeps a running CRC of its prefix [0, pos); a read at pos extends it, a
 * read past pos first feeds the gap (padding between tensors), and a unit
 * read out of order is checked by a separate full pass at the end. Every
 * unit touched is checked before the new trunk file is published, so a
 * corrupt source never yields a DST. */
typedef struct srcunit {
    uint64_t pos;
    uint32_t crc;
    uint8_t done, reread;
} srcunit;

typedef struct copier {
    k3_pack_plan *p;
    uint8_t *buf;               /* K3_PACK_COPY_CHUNK, aligned */
    uint8_t *bounce;            /* for unaligned O_DIRECT reads */
    uint64_t bounce_cap;
    uint8_t *gap, *gap_bounce;  /* GAP_CHUNK (+ 3 pages): reads that must not touch buf */
    srcunit *su;                /* per source unit */
    uint64_t read;
} copier;

#define GAP_CHUNK (1u << 20)

static int crc_mismatch(copier *c, uint32_t su, uint32_t got, k3_err *e)
{
    const k3_pk_unit *u = k3_pk_unit_at(c->p->pk, su);
    return k3_err_set(e, K3_ECORRUPT,
                      "%s: trunk unit %u (%s, offset %" PRIu64 ", layer %d) has CRC32 %08x, the manifest says %08x: "
                      "the source is corrupt (run k3-verify)",
                      c->p->src, su, k3_pk_file_at(c->p->pk, u->file)->name, u->offset, u->layer, got, u->crc32);
}

/* Read [from, to) of source unit su (relative to the unit) into the running CRC. */
static int crc_feed_file(copier *c, uint32_t su, uint64_t from, uint64_t to, k3_err *e)
{
    const k3_pk_unit *u = k3_pk_unit_at(c->p->pk, su);
    srcunit *s = &c->su[su];
    uint32_t crc = s->crc;
    while (from < to) {
        uint64_t n = to - from > GAP_CHUNK ? GAP_CHUNK : to - from;
        int rc = k3_pk_read(c->p->pk, u->file, c->gap, n, u->offset + from, c->gap_bounce, GAP_CHUNK + 3 * 4096, e);
        if (rc)
            return rc;
        crc = k3_crc32(crc, c->gap, (size_t)n);
        from += n;
        c->read += n;
    }
    s->crc = crc;
    return 0;
}

/* The bytes [rel, rel + n) of source unit su were just read into data. */
static int crc_track(copier *c, uint32_t su, uint64_t rel, const uint8_t *data, uint64_t n, k3_err *e)
{
    srcunit *s = &c->su[su];
    if (s->done || s->reread)
        return 0;
    if (rel < s->pos) {
        s->reread = 1;   /* out of order: a full pass at the end */
        return 0;
    }
    int rc;
    if (rel > s->pos) {
        if ((rc = crc_feed_file(c, su, s->pos, rel, e)))
            return rc;
        s->pos = rel;
    }
    s->crc = k3_crc32(s->crc, data, (size_t)n);
    s->pos += n;
    const k3_pk_unit *u = k3_pk_unit_at(c->p->pk, su);
    if (s->pos == u->nbytes) {
        s->done = 1;
        if (s->crc != u->crc32)
            return crc_mismatch(c, su, s->crc, e);
    }
    return 0;
}

/* Finish every unit not yet checked (tail after the last tensor, or read out
 * of order). */
static int crc_finish(copier *c, k3_err *e)
{
    const uint32_t n = k3_pk_unit_count(c->p->pk);
    for (uint32_t su = 0; su < n; su++) {
        srcunit *s = &c->su[su];
        if (s->done || (s->pos == 0 && !s->reread))
            continue;   /* checked, or not used */
        if (s->reread) {
            s->pos = 0;
            s->crc = 0;   /* the CRC of nothing */
        }
        const k3_pk_unit *u = k3_pk_unit_at(c->p->pk, su);
        int rc = crc_feed_file(c, su, s->pos, u->nbytes, e);
        if (rc)
            return rc;
        s->done = 1;
        if (s->crc != u->crc32)
            return crc_mismatch(c, su, s->crc, e);
    }
    return 0;
}

/* Copy rows [a, b) of tensor t from the source into extent ext. */
static int copy_rows(copier *c, k3_conv_w *w, uint32_t ext, uint32_t t, uint64_t a, uint64_t b, k3_err *e)
{
    const k3_pk_tensor *st = &c->p->src_man.tensors[t];
    const uint64_t rb = st->nbytes / st->shape[0];
    uint64_t done = 0;
    for (uint32_t j = 0; j < st->npieces; j++) {
        const k3_pk_piece *sp = &st->pieces[j];
        uint64_t r0 = a > sp->row_begin ? a : sp->row_begin, r1 = b < sp->row_end ? b : sp->row_end;
        if (r0 >= r1)
            continue;
        const k3_pk_unit *u = k3_pk_unit_at(c->p->pk, sp->unit);
        uint64_t off = sp->offset + (r0 - sp->row_begin) * rb, n = (r1 - r0) * rb;
        int rc;
        while (n) {
            if ((rc = check_stop(e)))
                return rc;
            uint64_t take = n > K3_PACK_COPY_CHUNK ? K3_PACK_COPY_CHUNK : n;
            if ((rc = k3_pk_read(c->p->pk, u->file, c->buf, take, off, c->bounce, c->bounce_cap, e)) ||
                (rc = crc_track(c, sp->unit, off - u->offset, c->buf, take, e)) ||
                (rc = k3_conv_w_write(w, ext, done, c->buf, take, e)))
                return rc;
            c->read += take;
            done += take;
            off += take;
            n -= take;
        }
    }
    return 0;
}

static int write_trunk(k3_pack_plan *p, const char *tmp, const k3_pack_out *out, int dense, k3_pack_stats *s,
                       k3_err *e)
{
    k3_man *m = &p->man;
    k3_pk_file *f = &m->files[out->file];
    k3_conv_ofile of;
    memset(&of, 0, sizeof of);
    snprintf(of.name, sizeof of.name, "%s", f->name);
    of.file_index = out->file;
    of.size = f->size;
    of.ext = calloc(p->ncopies + 1, sizeof *of.ext);
    of.regions = calloc(m->nunits + 1, sizeof *of.regions);
    of.region_crc = calloc(m->nunits + 1, sizeof *of.region_crc);
    copier c = {p, k3_io_alloc_aligned(K3_PACK_COPY_CHUNK, 4096), NULL, K3_PACK_COPY_CHUNK + 3 * 4096,
                k3_io_alloc_aligned(GAP_CHUNK, 4096), k3_io_alloc_aligned(GAP_CHUNK + 3 * 4096, 4096),
                calloc(p->src_man.nunits + 1, sizeof(srcunit)), 0};
    c.bounce = k3_io_alloc_aligned(c.bounce_cap, 4096);
    for (uint32_t u = 0; c.su && u < p->src_man.nunits; u++)
        c.su[u].crc = 0;   /* the CRC of nothing */
    k3_conv_w w;
    int rc = 0, opened = 0;
    if (!of.ext || !of.regions || !of.region_crc || !c.buf || !c.bounce || !c.gap || !c.gap_bounce || !c.su) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < p->ncopies; i++) {
        const k3_pk_piece *pc = &m->tensors[p->copies[i].tensor].pieces[p->copies[i].piece];
        of.ext[i] = (k3_conv_ext){pc->offset, pc->nbytes};
    }
    of.next = p->ncopies;
    for (uint32_t u = 0; u < m->nunits; u++)
        of.regions[u] = (k3_conv_ext){m->units[u].offset, m->units[u].nbytes};
    of.nregions = m->nunits;
    if ((rc = k3_conv_w_open(&w, tmp, &of, dense, e)))
        goto out;
    opened = 1;
    for (uint32_t i = 0; i < p->ncopies && !rc; i++) {
        const k3_pack_copy *cp = &p->copies[i];
        const k3_pk_piece *pc = &m->tensors[cp->tensor].pieces[cp->piece];
        rc = copy_rows(&c, &w, i, cp->tensor, pc->row_begin, pc->row_end, e);
        crash_point("trunk", i);
    }
    if (!rc)
        rc = crc_finish(&c, e);
    if (!rc)
        rc = k3_conv_w_finish(&w, f->sha256, e);
    if (!rc)
        rc = k3_conv_w_publish(&w, e);
    if (!rc) {
        for (uint32_t u = 0; u < m->nunits; u++)
            m->units[u].crc32 = of.region_crc[u];
        s->bytes_written += w.written;
    }
out:
    if (opened)
        k3_conv_w_close(&w, rc != 0);
    free(of.ext);
    free(of.regions);
    free(of.region_crc);
    k3_io_free_aligned(c.buf);
    k3_io_free_aligned(c.bounce);
    k3_io_free_aligned(c.gap);
    k3_io_free_aligned(c.gap_bounce);
    free(c.su);
    return rc;
}

/* ------------------------------------------------------------ experts */

static int write_experts(k3_pack_plan *p, const char *tmp, const k3_pack_out *out, k3_pack_stats *s, k3_err *e)
{
    k3_man *m = &p->man;
    k3_pk_file *f = &m->files[out->file];
    const k3_pk_expert_layout *xl = k3_pk_experts(p->pk);
    const uint32_t NE = p->cfg.num_experts, layer = p->cfg.first_k_dense_replace + out->moe_layer;
    k3_conv_ofile of;
    memset(&of, 0, sizeof of);
    snprintf(of.name, sizeof of.name, "%s", f->name);
    of.file_index = out->file;
    of.size = f->size;
    of.ext = calloc(NE, sizeof *of.ext);
    of.regions = calloc(NE, sizeof *of.regions);
    of.region_crc = calloc(NE, sizeof *of.region_crc);
    uint8_t *buf = k3_io_alloc_aligned(xl->stride, 4096);
    k3_conv_w w;
    int rc = 0, opened = 0;
    if (!of.ext || !of.regions || !of.region_crc || !buf) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < NE; i++)
        of.ext[i] = of.regions[i] = (k3_conv_ext){(uint64_t)i * xl->stride, xl->stride};
    of.next = of.nregions = NE;
    if ((rc = k3_conv_w_open(&w, tmp, &of, 0, e)))
        goto out;
    opened = 1;
    for (uint32_t i = 0; i < NE && !rc; i++) {
        uint32_t x = p->order[(uint64_t)out->moe_layer * NE + i];
        if (!(rc = check_stop(e)) && !(rc = k3_pk_read_record(p->pk, layer, x, buf, 1, e)))
            rc = k3_conv_w_write(&w, i, 0, buf, xl->stride, e);
    }
    if (!rc)
        rc = k3_conv_w_finish(&w, f->sha256, e);
    if (!rc)
        rc = k3_conv_w_publish(&w, e);
    if (!rc)
        s->bytes_written += w.written;
out:
    if (opened)
        k3_conv_w_close(&w, rc != 0);
    free(of.ext);
    free(of.regions);
    free(of.region_crc);
    k3_io_free_aligned(buf);
    return rc;
}

/* Put the source file at to: hard link, else reflink, else a copy. A copy
 * hashes the bytes it read and compares them with want (the source
 * manifest's SHA-256) before it is published: the copy must be the file the
 * new manifest describes. */
static int place_file(const char *from, const char *to, uint64_t size, const uint8_t want[32], int copy_only,
                      k3_pack_stats *s, k3_err *e)
{
    if (unlink(to) != 0 && errno != ENOENT)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot replace", to);
    if (!copy_only && link(from, to) == 0) {
        s->files_linked++;
        s->bytes_linked += size;
        return 0;
    }
    char tmp[4400];
    int sfd = k3_io_open_read(from, 0, NULL, e);
    if (sfd < 0)
        return sfd;
    int rc = k3_io_tmp_create(to, 1, tmp, sizeof tmp, e);
    if (rc < 0) {
        close(sfd);
        return rc;
    }
    int dfd = rc;
    rc = 0;
    if (!copy_only && ioctl(dfd, FICLONE, sfd) == 0) {
        s->files_reflinked++;
        s->bytes_linked += size;
    } else {
        uint8_t *buf = malloc(K3_PACK_COPY_CHUNK);
        EVP_MD_CTX *md = EVP_MD_CTX_new();
        if (!buf || !md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1)
            rc = k3_err_set(e, K3_ENOMEM, "out of memory");
        for (uint64_t at = 0; !rc && at < size;) {
            uint64_t n = size - at > K3_PACK_COPY_CHUNK ? K3_PACK_COPY_CHUNK : size - at;
            if (!(rc = check_stop(e)) && !(rc = k3_io_pread(sfd, buf, n, at, from, e))) {
                EVP_DigestUpdate(md, buf, (size_t)n);
                rc = k3_io_pwrite(dfd, buf, n, at, tmp, e);
            }
            at += n;
        }
        uint8_t got[32];
        unsigned int hl = 0;
        if (!rc && (EVP_DigestFinal_ex(md, got, &hl) != 1 || memcmp(got, want, 32))) {
            char w[65], g[65];
            k3_man_hex(want, w);
            k3_man_hex(got, g);
            rc = k3_err_set(e, K3_ECORRUPT, "%s: the bytes copied hash to %s, the source manifest says %s", from, g,
                            w);
        }
        EVP_MD_CTX_free(md);
        free(buf);
        if (!rc) {
            s->files_copied++;
            s->bytes_copied += size;
            s->bytes_written += size;
        }
    }
    close(sfd);
    if (rc) {
        close(dfd);
        unlink(tmp);
        return rc;
    }
    return k3_io_publish(dfd, tmp, to, e);
}

static int write_index(k3_pack_plan *p, const char *tmp, const k3_pack_out *out, k3_pack_stats *s, k3_err *e)
{
    const k3_pk_file *f = &p->man.files[out->file];
    uint8_t *buf = calloc(f->size, 1);
    char path[4400];
    if (!buf)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    k3_man_idx_encode(buf, &p->cfg, p->man.xl.stride, p->records);
    int rc = k3_io_path_join(path, sizeof path, tmp, f->name, e);
    if (!rc)
        rc = k3_io_write_file_atomic(path, buf, f->size, e);
    free(buf);
    if (!rc)
        s->bytes_written += f->size;
    return rc;
}

/* ------------------------------------------------------------ run */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The plan's fingerprint in the journal: 0 if it matches, 1 if it differs
 * or is unreadable, -1 if absent. */
static int journal_plan_cmp(const char *tmp, const k3_pack_plan *p)
{
    char path[4400], hex[65];
    char *txt = NULL;
    uint64_t len;
    k3_err je = {0};
    snprintf(path, sizeof path, "%s/" K3_PACK_JOURNAL "/plan", tmp);
    if (!exists(path))
        return -1;
    if (k3_io_read_file(path, 4096, &txt, &len, &je))
        return 1;
    k3_man_hex(p->fingerprint, hex);
    int same = len >= 64 && !memcmp(txt, hex, 64);
    free(txt);
    return same ? 0 : 1;
}

/* 0 if the manifest at mp is the one this plan produces (hashes of written
 * files taken from it), K3_EEXIST if not. */
static int same_plan_manifest(k3_pack_plan *p, const char *mp, k3_err *e)
{
    char *txt = NULL, *mine = NULL;
    uint64_t len;
    k3_man old;
    int rc = k3_io_read_file(mp, K3_MAN_MAX_BYTES, &txt, &len, e);
    if (rc)
        return rc;
    if ((rc = k3_man_parse(&old, txt, len, mp, e))) {
        free(txt);
        return rc;
    }
    int same = old.nfiles == p->man.nfiles && old.nunits == p->man.nunits;
    for (uint32_t i = 0; same && i < p->man.nfiles; i++)
        memcpy(p->man.files[i].sha256, old.files[i].sha256, 32);
    for (uint32_t u = 0; same && u < p->man.nunits; u++)
        p->man.units[u].crc32 = old.units[u].crc32;
    k3_man_free(&old);
    if (same && (mine = k3_man_to_json(&p->man)))
        same = strlen(mine) == len && !memcmp(mine, txt, len);
    free(mine);
    free(txt);
    return same ? 0
                : k3_err_set(e, K3_EEXIST,
                             "%s is a complete repack with a different plan (other source or options): use --force "
                             "to start again",
                             mp);
}

/* Hold an exclusive lock on the temporary directory for the whole run, so
 * that two k3-pack processes never work on the same DST at once. */
static int lock_dir(const char *dir, int *fd, k3_err *e)
{
    if (*fd >= 0)
        return 0;
    *fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*fd < 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open", dir);
    if (flock(*fd, LOCK_EX | LOCK_NB) != 0)
        return k3_err_set(e, K3_EEXIST, "%s: another k3-pack is writing it", dir);
    return 0;
}

/* Remove the stand-ins ("DST.k3-pack-probe.XXXXXX") a kill during planning
 * left next to DST. */
static int remove_stale_probes(const char *dst, k3_err *e)
{
    char parent[4200];
    snprintf(parent, sizeof parent, "%s", dst);
    char *slash = strrchr(parent, '/');
    const char *base = dst;
    if (slash) {
        base = dst + (slash - parent) + 1;
        if (slash == parent)
            parent[1] = 0;
        else
            *slash = 0;
    } else {
        snprintf(parent, sizeof parent, ".");
    }
    char prefix[4200];
    snprintf(prefix, sizeof prefix, "%s" K3_PACK_PROBE_SUFFIX, base);
    const size_t lp = strlen(prefix);
    DIR *d = opendir(parent);
    if (!d)
        return 0;
    struct dirent *de;
    int rc = 0;
    char path[8500];
    while (!rc && (de = readdir(d)))
        if (!strncmp(de->d_name, prefix, lp) && strlen(de->d_name) == lp + 6) {
            snprintf(path, sizeof path, "%s/%s", parent, de->d_name);
            rc = remove_tree(path, 0, e);
        }
    closedir(d);
    return rc;
}

static int run(k3_pack_plan *p, const k3_pack_opts *o, k3_pack_stats *s, int *lockfd, k3_err *e)
{
    memset(s, 0, sizeof *s);
    double t0 = now_s();
    const char *dst = p->dst;
    char tmp[4200], old[4200], jdir[4400], path[4500];
    if (snprintf(tmp, sizeof tmp, "%s" K3_PACK_TMP_SUFFIX, dst) >= (int)sizeof tmp ||
        snprintf(old, sizeof old, "%s" K3_PACK_OLD_SUFFIX, dst) >= (int)sizeof old)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dst);
    {
        /* DST must be neither the source nor inside it (a packed model holds
         * no other file) */
        char parent[4200];
        snprintf(parent, sizeof parent, "%s", dst);
        char *slash = strrchr(parent, '/');
        if (slash && slash != parent)
            *slash = 0;
        else
            snprintf(parent, sizeof parent, "%s", slash ? "/" : ".");
        char *rdst = realpath(dst, NULL), *rpar = realpath(parent, NULL);
        size_t ls = strlen(p->src);
        int bad = (rdst && !strcmp(rdst, p->src)) ||
                  (rpar && (!strcmp(rpar, p->src) || (!strncmp(rpar, p->src, ls) && rpar[ls] == '/')));
        free(rdst);
        free(rpar);
        if (bad)
            return k3_err_set(e, K3_EARG, "%s: DST is the source or inside it (%s)", dst, p->src);
    }
    int rc;
    if (exists(dst) && !o->force)
        return k3_err_set(e, K3_EEXIST, "%s exists (use --force to replace it)", dst);
    journal_path(jdir, sizeof jdir, tmp, NULL);
    if ((rc = remove_stale_probes(dst, e)))
        return rc;
    int resuming = 0;
    if (exists(tmp)) {
        if ((rc = lock_dir(tmp, lockfd, e)))
            return rc;
        int cmp = journal_plan_cmp(tmp, p);
        char mp[4400];
        snprintf(mp, sizeof mp, "%s/manifest.json", tmp);
        if (o->resume && cmp == 0) {
            resuming = 1;
        } else if (o->resume && cmp < 0 && exists(mp)) {
            /* killed after the journal was removed: complete, only the rename
             * is left - if it is this plan's model: the planned manifest with
             * the written hashes taken from it must be the same text */
            k3_pk *chk = NULL;
            if ((rc = k3_pk_open(&chk, tmp, 0, e)))
                return rc;
            k3_pk_close(chk);
            if ((rc = same_plan_manifest(p, mp, e)))
                return rc;
            /* killed inside the journal's removal ("plan" went first) */
            if ((rc = remove_tree(jdir, 0, e)) || (rc = k3_io_fsync_dir(tmp, e)))
                return rc;
            goto publish;
        } else if (o->resume && cmp > 0) {
            return k3_err_set(e, K3_EEXIST,
                              "%s was left by a repack with a different plan (other source or options): use "
                              "--force to start again",
                              tmp);
        } else if (!o->force && !o->resume) {
            return k3_err_set(e, K3_EEXIST,
                              "%s exists: an interrupted k3-pack (continue with --resume, or start again with "
                              "--force)",
                              tmp);
        }
        if (!resuming && (rc = remove_tree(tmp, 1, e)))
            return rc;
    }
    if (!resuming) {
        if (mkdir(tmp, 0755) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", tmp);
        if (*lockfd >= 0)
            close(*lockfd);   /* the lock of the removed temporary */
        *lockfd = -1;
        if ((rc = lock_dir(tmp, lockfd, e)))
            return rc;
        if (mkdir(jdir, 0755) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", jdir);
        char hex[65];
        k3_man_hex(p->fingerprint, hex);
        snprintf(path, sizeof path, "%s/plan", jdir);
        if ((rc = k3_io_write_file_atomic(path, hex, 64, e)) || (rc = k3_io_fsync_dir(tmp, e)))
            return rc;
    }

    for (uint32_t i = 0; i < p->nouts; i++) {
        const k3_pack_out *out = &p->outs[i];
        k3_pk_file *f = &p->man.files[out->file];
        if (resuming && journal_take(tmp, p, out)) {
            s->files_resumed++;
            continue;
        }
        if ((rc = check_stop(e)))
            return rc;
        switch (out->how) {
        case K3_PACK_OUT_TRUNK:
            rc = write_trunk(p, tmp, out, o->dense, s, e);
            break;
        case K3_PACK_OUT_EXPERTS:
            rc = write_experts(p, tmp, out, s, e);
            break;
        case K3_PACK_OUT_INDEX:
            rc = write_index(p, tmp, out, s, e);
            break;
        default: {
            char from[4400];
            if (!(rc = k3_io_path_join(from, sizeof from, p->src, p->src_man.files[out->src_file].name, e)) &&
                !(rc = k3_io_path_join(path, sizeof path, tmp, f->name, e))) {
                struct stat st;
                rc = place_file(from, path, f->size, f->sha256, o->copy_only, s, e);
                if (!rc && (stat(path, &st) != 0 || (uint64_t)st.st_size != f->size))
                    rc = k3_err_set(e, K3_EIO, "%s: size %lld after linking, the source manifest says %" PRIu64,
                                    path, (long long)st.st_size, f->size);
            }
        }
        }
        if (rc)
            return rc;
        crash_point("file", i);
        if ((rc = k3_io_fsync_dir(tmp, e)) || (rc = journal_write(tmp, p, out, e)))
            return rc;
        crash_point("journaled", i);
        if (o->progress)
            fprintf(o->progress, "k3-pack: %s done (%u/%u)\n", f->name, i + 1, p->nouts);
    }

    /* manifest last: it must pass our own reader first */
    {
        char *txt = k3_man_to_json(&p->man);
        if (!txt)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        k3_man check;
        snprintf(path, sizeof path, "%s/manifest.json", tmp);
        if ((rc = k3_man_parse(&check, txt, strlen(txt), path, e))) {
            free(txt);
            return k3_err_set(e, K3_EINTERNAL, "the manifest k3-pack produced is invalid: %s", e->msg);
        }
        k3_man_free(&check);
        rc = k3_io_write_file_atomic(path, txt, strlen(txt), e);
        s->bytes_written += strlen(txt);
        free(txt);
        if (rc)
            return rc;
    }
    crash_point("manifest", 0);
    if ((rc = remove_tree(jdir, 0, e)) || (rc = k3_io_fsync_dir(tmp, e)))
        return rc;
    crash_point("renaming", 0);

publish:
    if (exists(dst)) {   /* --force: the old DST leaves only once the new one is complete */
        if (exists(old) && (rc = remove_tree(old, 1, e)))
            return rc;
        if (rename(dst, old) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot move aside to %s", dst, old);
    }
    if (rename(tmp, dst) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot rename to %s", tmp, dst);
    if ((rc = k3_io_fsync_dir(dst, e)))
        return rc;
    {
        /* the parent's entry for DST */
        char parent[4200];
        snprintf(parent, sizeof parent, "%s", dst);
        char *slash = strrchr(parent, '/');
        if (slash == parent)
            parent[1] = 0;
        else if (slash)
            *slash = 0;
        else
            snprintf(parent, sizeof parent, ".");
        if ((rc = k3_io_fsync_dir(parent, e)))
            return rc;
    }
    if (exists(old) && (rc = remove_tree(old, 1, e)))
        return rc;
    s->seconds = now_s() - t0;
    return 0;
}

int k3_pack_run(k3_pack_plan *p, const k3_pack_opts *o, k3_pack_stats *s, k3_err *e)
{
    int lockfd = -1;
    int rc = run(p, o, s, &lockfd, e);
    if (lockfd >= 0)
        close(lockfd);
    return rc;
}
