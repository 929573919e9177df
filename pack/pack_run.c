/*
 * pack_run.c - execute a repack plan (pack.h) crash-safely.
 *
 * DST is built as "DST.k3-pack-tmp": the journal ("DST.k3-pack-tmp/
 * .k3-pack-journal/") first records the plan's fingerprint, then one entry per
 * finished output file (written atomically after the file itself was
 * fsynced and renamed into place). manifest.json is written last, the journal
 * removed, the directory fsynced and renamed to DST, and DST's parent fsynced.
 * So at any kill point DST is either absent (the temporary can be resumed
 * with --resume, or removed with --force) or complete. The journal is the
 * one k3-convert uses (k3_journal.h).
 *
 * The trunk is one file (about 111 GB at K3 size), so it is journaled per
 * unit: after the last piece of each output unit the temporary is fsynced
 * and "NAME.part.json" records the writer's state (hash frontier, SHA-256
 * state, unit CRCs: k3_conv_w_checkpoint) and the source units' running
 * CRCs; --resume continues from the last such entry (bytes past it are
 * zeroed and written again), so a kill loses at most one unit of work.
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
#include <unistd.h>

#include <cjson/cJSON.h>

#include "k3_outfile.h"
#include "k3_crc.h"
#include "k3_io.h"
#include "k3_journal.h"
#include "pack.h"

static volatile sig_atomic_t stop_requested;

void k3_pack_interrupt(void) { stop_requested = 1; }
int k3_pack_interrupted(void) { return stop_requested != 0; }

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
 * journal is removed, before the rename (N ignored for both).
 * "interrupt:N" raises SIGINT instead, as Ctrl-C would, after trunk piece N. */
static void crash_point(const char *stage, uint32_t n)
{
    const char *v = getenv("K3_PACK_CRASH");
    if (!v)
        return;
    if (!strncmp(v, "interrupt:", 10)) {   /* "interrupt:N": SIGINT, as Ctrl-C, after trunk piece N */
        char *e2;
        if (!strcmp(stage, "trunk") && strtoul(v + 10, &e2, 10) == n && !*e2)
            raise(SIGINT);
        return;
    }
    size_t l = strlen(stage);
    if (strncmp(v, stage, l) || v[l] != ':')
        return;
    char *end;
    unsigned long want = strtoul(v + l + 1, &end, 10);
    if (*end == 0 && (want == n || !strcmp(stage, "manifest") || !strcmp(stage, "renaming")))
        raise(SIGKILL);
}

/* ------------------------------------------------------------ helpers */

static const char *const pack_siblings[] = {K3_PACK_TMP_SUFFIX, K3_PACK_OLD_SUFFIX, NULL};
const k3_dest_tool k3_pack_dest_tool = {"k3-pack", K3_DEST_PACKED, pack_siblings};

/* Remove a directory of ours (the temporary, the old DST, a stand-in,
 * the journal) after checking that it holds only a packed model's files. */
static int remove_tree(const char *dir, k3_err *e)
{
    return k3_dest_clear(&k3_pack_dest_tool, dir, 1, 1, e);
}

static int exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

/* ------------------------------------------------------------ journal */

/* The temporary's journal (k3_journal.h): "plan", then "NAME.json" per
 * finished output file and "NAME.part.json" per finished trunk unit. */
static int pack_journal(k3_journal *j, const char *tmp, k3_err *e)
{
    return k3_journal_init(j, tmp, K3_PACK_JOURNAL, "plan", e);
}

static int entry_name(char *out, size_t cap, const char *file, const char *what)
{
    int n = snprintf(out, cap, "%s%s.json", file, what);
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

static int journal_write(const char *tmp, const k3_pack_plan *p, const k3_pack_out *out, k3_err *e)
{
    const k3_pk_file *f = &p->man.files[out->file];
    k3_journal j;
    char hex[65], name[400];
    int rc = pack_journal(&j, tmp, e);
    if (rc)
        return rc;
    if (entry_name(name, sizeof name, f->name, ""))
        return k3_err_set(e, K3_ELIMIT, "%s: name too long", f->name);
    cJSON *o = cJSON_CreateObject();
    k3_man_hex(f->sha256, hex);
    cJSON_AddStringToObject(o, "name", f->name);
    cJSON_AddNumberToObject(o, "size", (double)f->size);
    cJSON_AddStringToObject(o, "sha256", hex);
    if (out->how == K3_PACK_OUT_TRUNK) {
        cJSON *a = cJSON_AddArrayToObject(o, "crc32");
        for (uint32_t u = 0; u < p->man.nunits; u++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber(p->man.units[u].crc32));
    }
    /* sealed with its SHA-256, so that --resume never takes a value that
     * reads back differently from what was written */
    rc = k3_journal_put(&j, name, o, e);
    cJSON_Delete(o);
    return rc;
}

/* 1 if the journal holds a finished entry for out whose file still has its
 * size (sha256 and unit CRCs are taken from the entry), 0 if not. */
static int journal_take(const char *tmp, k3_pack_plan *p, const k3_pack_out *out)
{
    k3_pk_file *f = &p->man.files[out->file];
    char name[400], fpath[4400];
    k3_journal j;
    k3_err je = {0};
    if (pack_journal(&j, tmp, &je) || entry_name(name, sizeof name, f->name, ""))
        return 0;
    /* an entry that does not hash to its first line is not trusted: redo */
    cJSON *o = k3_journal_get(&j, name, NULL);
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

/* The copier's source-unit CRC state, for a trunk checkpoint: units with
 * any progress as [unit, pos, crc, flags]. */
static cJSON *copier_state(const copier *c)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t u = 0; a && u < c->p->src_man.nunits; u++) {
        const srcunit *x = &c->su[u];
        if (!x->pos && !x->done && !x->reread)
            continue;
        double v[4] = {u, (double)x->pos, x->crc, x->done | x->reread << 1};
        cJSON_AddItemToArray(a, cJSON_CreateDoubleArray(v, 4));
    }
    return a;
}

static int copier_load(copier *c, const cJSON *a)
{
    const uint32_t n = c->p->src_man.nunits;
    memset(c->su, 0, (n + 1) * sizeof *c->su);
    if (!cJSON_IsArray(a))
        return -1;
    const cJSON *it;
    cJSON_ArrayForEach(it, a)
    {
        double v[4];
        int k = 0;
        const cJSON *x;
        if (!cJSON_IsArray(it) || cJSON_GetArraySize(it) != 4)
            return -1;
        cJSON_ArrayForEach(x, it)
        {
            if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble != (double)(uint64_t)x->valuedouble)
                return -1;
            v[k++] = x->valuedouble;
        }
        uint32_t u = (uint32_t)v[0];
        if (v[0] >= n || v[1] > (double)k3_pk_unit_at(c->p->pk, u)->nbytes || v[2] > 4294967295.0 || v[3] > 3)
            return -1;
        c->su[u] = (srcunit){(uint64_t)v[1], (uint32_t)v[2], (uint8_t)((uint32_t)v[3] & 1), (uint8_t)((uint32_t)v[3] >> 1)};
    }
    return 0;
}

/* After copies [0, next) (a whole output unit): the writer's and the
 * copier's state go to the journal entry part, so that a kill loses at most
 * the unit being written. */
static int trunk_checkpoint(copier *c, k3_conv_w *w, const k3_journal *j, const char *part, uint32_t next, k3_err *e)
{
    cJSON *ws = NULL;
    int rc = k3_conv_w_checkpoint(w, next, &ws, e);
    if (rc || !ws)
        return rc;
    cJSON *o = cJSON_CreateObject();
    cJSON *cs = copier_state(c);
    if (!o || !cs || !cJSON_AddNumberToObject(o, "read", (double)c->read)) {
        cJSON_Delete(o);
        cJSON_Delete(cs);
        cJSON_Delete(ws);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    cJSON_AddItemToObject(o, "writer", ws);
    cJSON_AddItemToObject(o, "source_units", cs);
    rc = k3_journal_put(j, part, o, e);
    cJSON_Delete(o);
    return rc;
}

static int write_trunk(k3_pack_plan *p, const char *tmp, const k3_pack_out *out, int dense, int resuming,
                       FILE *progress, k3_progress *meter, k3_pack_stats *s, k3_err *e)
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
    int rc = 0, opened = 0, checkpointed = 0;
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
    /* a unit checkpoint of an interrupted run continues the temporary */
    k3_journal j;
    char part[400];
    uint32_t first = 0;
    uint64_t kept = 0;
    if ((rc = pack_journal(&j, tmp, e)))
        goto out;
    if (entry_name(part, sizeof part, f->name, ".part")) {
        rc = k3_err_set(e, K3_ELIMIT, "%s: name too long", f->name);
        goto out;
    }
    cJSON *state = resuming ? k3_journal_get(&j, part, NULL) : NULL;
    const cJSON *rd = cJSON_GetObjectItemCaseSensitive(state, "read");
    if (state && cJSON_IsNumber(rd) && copier_load(&c, cJSON_GetObjectItemCaseSensitive(state, "source_units")) == 0)
        rc = k3_conv_w_resume(&w, tmp, &of, dense, cJSON_GetObjectItemCaseSensitive(state, "writer"), &first, e);
    else
        rc = k3_conv_w_open(&w, tmp, &of, dense, e);
    if (rc == 1) {
        c.read = (uint64_t)rd->valuedouble;
        kept = w.written;
        rc = 0;
    } else if (rc == 0) {
        first = 0;
        memset(c.su, 0, (p->src_man.nunits + 1) * sizeof *c.su);
    }
    cJSON_Delete(state);
    if (rc)
        goto out;
    opened = 1;
    s->trunk_bytes_kept += kept;
    if (kept && progress)
        fprintf(progress, "k3-pack: %s: %" PRIu64 " bytes (%u of %u pieces) kept from the interrupted run\n", f->name,
                kept, first, p->ncopies);
    uint64_t counted = w.written;   /* what the meter has been told of this file */
    k3_progress_add(meter, counted);
    for (uint32_t i = first; i < p->ncopies && !rc; i++) {
        const k3_pack_copy *cp = &p->copies[i];
        const k3_pk_piece *pc = &m->tensors[cp->tensor].pieces[cp->piece];
        rc = copy_rows(&c, &w, i, cp->tensor, pc->row_begin, pc->row_end, e);
        k3_progress_add(meter, w.written - counted);
        counted = w.written;
        crash_point("trunk", i);
        if (rc || i + 1 == p->ncopies)
            continue;
        const k3_pack_copy *nx = &p->copies[i + 1];
        uint32_t unit = pc->unit;
        if (m->tensors[nx->tensor].pieces[nx->piece].unit != unit) {
            rc = trunk_checkpoint(&c, &w, &j, part, i + 1, e);
            if (!rc) {
                checkpointed = 1;
                crash_point("unit", unit);
            }
        }
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
        s->bytes_written += w.written - kept;
        k3_progress_add(meter, f->size > counted ? f->size - counted : 0);   /* holes and padding */
    }
out:
    /* an interrupted trunk with a unit checkpoint keeps its temporary for
     * --resume (it is ours, inside our temporary directory); after any
     * other failure (a full disk, an I/O error) it goes, as every temporary
     * of a failed write does, and --resume starts the trunk again */
    if (opened)
        k3_conv_w_close(&w, rc != 0 && !(rc == K3_EINTR && (checkpointed || kept)));
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

static int write_experts(k3_pack_plan *p, const char *tmp, const k3_pack_out *out, k3_progress *meter,
                         k3_pack_stats *s, k3_err *e)
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
        if (!rc)
            k3_progress_add(meter, xl->stride);
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
            rc = remove_tree(path, e);
        }
    closedir(d);
    return rc;
}

static int run(k3_pack_plan *p, const k3_dest *dest, const k3_pack_opts *o, k3_pack_stats *s, k3_err *e)
{
    memset(s, 0, sizeof *s);
    double t0 = k3_now_s();
    const char *dst = p->dst;
    char tmp[4200], old[4200], path[4500];
    if (snprintf(tmp, sizeof tmp, "%s" K3_PACK_TMP_SUFFIX, dst) >= (int)sizeof tmp ||
        snprintf(old, sizeof old, "%s" K3_PACK_OLD_SUFFIX, dst) >= (int)sizeof old)
        return k3_err_set(e, K3_ELIMIT, "%s: path too long", dst);
    int rc;
    if (dest->state != K3_DEST_ABSENT && !o->force)
        return k3_err_set(e, K3_EEXIST, "%s exists (use --force to replace it)", dst);
    k3_journal jn;
    if ((rc = pack_journal(&jn, tmp, e)))
        return rc;
    if ((rc = remove_stale_probes(dst, e)))
        return rc;
    int resuming = 0;
    if (exists(tmp)) {
        if ((rc = k3_dest_check_dir(&k3_pack_dest_tool, tmp, 1, e)))
            return rc;
        char hex[65];
        k3_man_hex(p->fingerprint, hex);
        k3_err pe = {0};
        int cmp = k3_journal_plan_cmp(&jn, hex, &pe);   /* 0 same, 1 other, 2 absent, <0 unreadable */
        if (cmp < 0 && o->resume) {
            *e = pe;
            return cmp;
        }
        char mp[4400];
        snprintf(mp, sizeof mp, "%s/manifest.json", tmp);
        if (o->resume && cmp == 0) {
            resuming = 1;
        } else if (o->resume && cmp == 2 && exists(mp)) {
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
            if ((rc = k3_journal_remove(&jn, e)))
                return rc;
            goto publish;
        } else if (o->resume && cmp == 1) {
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
        if (!resuming && (rc = remove_tree(tmp, e)))
            return rc;
    }
    if (!resuming) {
        if (mkdir(tmp, 0755) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", tmp);
        char hex[65];
        k3_man_hex(p->fingerprint, hex);
        if ((rc = k3_journal_begin(&jn, hex, e)) || (rc = k3_io_fsync_dir(tmp, e)))
            return rc;
    }

    for (uint32_t i = 0; i < p->nouts; i++) {
        const k3_pack_out *out = &p->outs[i];
        k3_pk_file *f = &p->man.files[out->file];
        if (resuming && journal_take(tmp, p, out)) {
            s->files_resumed++;
            k3_progress_add(o->meter, f->size);
            continue;
        }
        if ((rc = check_stop(e)))
            return rc;
        switch (out->how) {
        case K3_PACK_OUT_TRUNK:
            rc = write_trunk(p, tmp, out, o->dense, resuming, o->progress, o->meter, s, e);
            break;
        case K3_PACK_OUT_EXPERTS:
            rc = write_experts(p, tmp, out, o->meter, s, e);
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
        if (out->how != K3_PACK_OUT_TRUNK && out->how != K3_PACK_OUT_EXPERTS)
            k3_progress_add(o->meter, f->size);
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
    if ((rc = k3_journal_remove(&jn, e)))
        return rc;
    crash_point("renaming", 0);

publish:
    if (exists(dst)) {   /* --force: the old DST leaves only once the new one is complete */
        /* DST was checked to be a packed model (or empty) when it was
         * opened, under the lock; the old copy must still be one */
        if ((rc = k3_dest_check_dir(&k3_pack_dest_tool, dst, 0, e)) || (rc = remove_tree(old, e)))
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
    if ((rc = remove_tree(old, e)))
        return rc;
    s->seconds = k3_now_s() - t0;
    return 0;
}

int k3_pack_run(k3_pack_plan *p, const k3_dest *dest, const k3_pack_opts *o, k3_pack_stats *s, k3_err *e)
{
    if (!dest || dest->lock_fd < 0 || !p->dst || strcmp(dest->path, p->dst))
        return k3_err_set(e, K3_EINTERNAL, "k3_pack_run: the destination is not open and locked");
    return run(p, dest, o, s, e);
}
