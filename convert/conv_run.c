/*
 * conv_run.c - k3-convert's job: prepare DST, convert each shard group in one
 * sequential pass (a reader thread reads and hashes the input while the
 * calling thread converts, writes and hashes the output), publish each
 * group's files and journal entry, then experts.idx, manifest.json (last) and
 * remove the journal.
 *
 * Invariants: nothing in DST looks finished before it is (temporaries end in
 * .tmp; manifest.json is published last); a journal entry exists only for a
 * group whose files are fsynced and renamed; the bytes of every output file
 * depend only on the plan, never on timing, thread count or resumption.
 */
#include "conv_run.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <omp.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "k3_outfile.h"
#include "k3_crc.h"
#include "k3_dest.h"
#include "k3_io.h"
#include "k3_journal.h"
#include "k3_kern.h"
#include "k3_progress.h"

volatile sig_atomic_t k3_conv_stop_requested;

void k3_conv_interrupt(void)
{
    k3_conv_stop_requested = 1;
}

/* Test hook: K3_CONVERT_CRASH="STAGE:GROUP" kills the process with SIGKILL at
 * that point (STAGE: chunk = after the group's first chunk is converted,
 * published = after its files are renamed but before its journal entry,
 * journaled = after its journal entry, index = after experts.idx, before the
 * manifest; GROUP is ignored for index; "interrupt:G" raises SIGINT instead,
 * as Ctrl-C would, after group G's first chunk). */
static void crash_point(const char *stage, uint32_t g)
{
    const char *v = getenv("K3_CONVERT_CRASH");
    if (!v)
        return;
    if (!strcmp(stage, "chunk") && !strncmp(v, "interrupt:", 10)) {
        char *end;
        if (strtoul(v + 10, &end, 10) == g && !*end)
            raise(SIGINT);
        return;
    }
    size_t n = strlen(stage);
    if (strncmp(v, stage, n) || v[n] != ':')
        return;
    char *end;
    unsigned long want = strtoul(v + n + 1, &end, 10);
    if (*end == '\0' && (want == g || !strcmp(stage, "index")))
        raise(SIGKILL);
}

/* ---- converting ------------------------------------------------------------- */


/* Fold n output bytes of the embedding at byte off of the table (bytes come
 * in order) into the row CRCs. */
static int embed_feed(conv *cv, uint64_t off, const uint8_t *ptr, uint64_t n, k3_err *e)
{
    if (off != cv->erow_at)
        return k3_err_set(e, K3_EINTERNAL, "embedding bytes out of order (%" PRIu64 " after %" PRIu64 ")", off,
                          cv->erow_at);
    while (n) {
        uint64_t fill = cv->erow_at % cv->erow_rb, take = cv->erow_rb - fill < n ? cv->erow_rb - fill : n;
        if (cv->erow_at + take > (uint64_t)cv->p->cfg.vocab_size * cv->erow_rb)
            return k3_err_set(e, K3_EINTERNAL, "embedding longer than its shape");
        cv->erow_c = k3_crc32(cv->erow_c, ptr, (size_t)take);
        cv->erow_at += take;
        ptr += take;
        n -= take;
        if (cv->erow_at % cv->erow_rb == 0) {
            cv->erow[cv->erow_at / cv->erow_rb - 1] = cv->erow_c;
            cv->erow_c = 0;
        }
    }
    return 0;
}

static uint64_t section(const k3_pk_expert_layout *xl, int which, int part)
{
    static const int scale = K3_MAN_XP_SCALE;
    if (which == 0)
        return part == scale ? xl->w1_scales : xl->w1_packed;
    if (which == 1)
        return part == scale ? xl->w2_scales : xl->w2_packed;
    return part == scale ? xl->w3_scales : xl->w3_packed;
}

static float src_to_f32(const uint8_t *p, k3_dtype t)
{
    uint16_t h;
    float f;
    switch (t) {
    case K3_DT_BF16:
        memcpy(&h, p, 2);
        return k3_bf16_to_f32(h);
    case K3_DT_F16:
        memcpy(&h, p, 2);
        return k3_f16_to_f32(h);
    case K3_DT_F8_E4M3:
        return k3_f8e4m3_to_f32(*p);
    default:
        memcpy(&f, p, 4);
        return f;
    }
}

/* Quantize one float/F8 matrix of a record into its sections. sinv (F8 only)
 * is the block-scale tensor [ceil(rows/128)][ceil(cols/128)]. */
static int quantize_matrix(conv *cv, open_rec *o, int which, const uint8_t *w, k3_dtype wt, const uint8_t *sinv,
                           k3_dtype st, k3_err *e)
{
    const k3_pk_expert_layout *xl = &cv->p->man.xl;
    uint64_t rows = which == 1 ? xl->rows_w2 : xl->rows_w13;
    uint64_t cols = which == 1 ? xl->cols_w2 : xl->cols_w13;
    uint8_t *packed = o->buf + section(xl, which, K3_MAN_XP_PACKED);
    uint8_t *scales = o->buf + section(xl, which, K3_MAN_XP_SCALE);
    uint32_t esz = k3_dtype_size(wt), ssz = sinv ? k3_dtype_size(st) : 0;
    uint64_t bcols = (cols + 127) / 128;
    int oom = 0;
#pragma omp parallel if (rows * cols >= (1u << 20))
    {
        float *row = malloc(cols * sizeof *row);
        if (!row) {
#pragma omp atomic write
            oom = 1;
        }
#pragma omp for schedule(static)
        for (uint64_t r = 0; r < rows; r++) {
            if (!row)
                continue;
            const uint8_t *src = w + r * cols * esz;
            for (uint64_t c = 0; c < cols; c++) {
                float v = src_to_f32(src + c * esz, wt);
                if (sinv)
                    v *= src_to_f32(sinv + ((r / 128) * bcols + c / 128) * ssz, st);
                row[c] = v;
            }
            k3_mx_quantize(row, cols, packed + r * cols / 2, scales + r * cols / 32);
        }
        free(row);
    }
    if (oom)
        return k3_err_set(e, K3_ENOMEM, "out of memory quantizing an expert");
    return 0;
}

static open_rec *rec_slot(conv *cv, uint64_t rec, const k3_st_tensor *t, k3_err *e)
{
    open_rec *free_slot = NULL;
    for (uint32_t i = 0; i < K3_CONV_MAX_OPEN_RECORDS; i++) {
        if (cv->recs[i].rec == (int64_t)rec)
            return &cv->recs[i];
        if (cv->recs[i].rec < 0 && !free_slot)
            free_slot = &cv->recs[i];
    }
    if (!free_slot) {
        k3_err_set(e, K3_ELIMIT, "%s: tensor %s: more than %u experts interleaved in one shard (not supported)",
                   k3_st_shard_name(cv->p->st, t->shard), t->name, K3_CONV_MAX_OPEN_RECORDS);
        return NULL;
    }
    uint64_t stride = cv->p->man.xl.stride;
    if (!free_slot->buf && !(free_slot->buf = k3_io_alloc_aligned(stride, K3_PK_ALIGN))) {
        k3_err_set(e, K3_ENOMEM, "out of memory for an expert record (%" PRIu64 " bytes)", stride);
        return NULL;
    }
    free_slot->rec = (int64_t)rec;
    free_slot->have = 0;
    free_slot->nonzero = 0;
    memset(free_slot->complete, 0, sizeof free_slot->complete);
    return free_slot;
}

/* The record's first byte that may not be zero: clear the buffer (all
 * parts so far were zeros, and the padding between sections is zero). */
static void rec_touch(conv *cv, open_rec *o)
{
    if (!o->nonzero)
        memset(o->buf, 0, (size_t)cv->p->man.xl.stride);
    o->nonzero = 1;
}

/* n bytes of tensor ct at toff; zero: they are known zeros (a hole) */
static int handle_expert(conv *cv, const k3_conv_tensor *ct, uint64_t toff, const uint8_t *ptr, uint64_t n, int zero,
                         k3_err *e)
{
    k3_conv_plan *p = cv->p;
    const k3_st_tensor *t = ct->st;
    open_rec *o = rec_slot(cv, ct->rec, t, e);
    if (!o)
        return e->code;
    int w = ct->which, q = ct->part;
    int done = toff + n == t->nbytes;
    if (p->xfmt == K3_CONV_X_MXFP4) {
        if (!zero) {
            rec_touch(cv, o);
            memcpy(o->buf + section(&p->man.xl, w, q) + toff, ptr, (size_t)n);
        }
    } else {
        rec_touch(cv, o); /* quantized: zeros need not quantize to zero bytes */
        if (toff == 0 && !(o->stage[w][q] = malloc((size_t)t->nbytes)))
            return k3_err_set(e, K3_ENOMEM, "out of memory staging %s", t->name);
        memcpy(o->stage[w][q] + toff, ptr, (size_t)n);
    }
    if (!done)
        return 0;
    o->complete[w][q] = 1;
    o->have++;
    int rc = 0;
    const k3_conv_rec *R = &p->recs[ct->rec];
    if (p->xfmt == K3_CONV_X_FLOAT) {
        rc = quantize_matrix(cv, o, w, o->stage[w][q], t->dtype, NULL, K3_DT_F32, e);
        free(o->stage[w][q]);
        o->stage[w][q] = NULL;
    } else if (p->xfmt == K3_CONV_X_F8 && o->complete[w][K3_MAN_XP_WEIGHT] && o->complete[w][K3_MAN_XP_SCALE_INV]) {
        const k3_st_tensor *wt = p->tensors[R->parts[w][K3_MAN_XP_WEIGHT]].st;
        const k3_st_tensor *st = p->tensors[R->parts[w][K3_MAN_XP_SCALE_INV]].st;
        rc = quantize_matrix(cv, o, w, o->stage[w][K3_MAN_XP_WEIGHT], wt->dtype, o->stage[w][K3_MAN_XP_SCALE_INV],
                             st->dtype, e);
        free(o->stage[w][K3_MAN_XP_WEIGHT]);
        free(o->stage[w][K3_MAN_XP_SCALE_INV]);
        o->stage[w][K3_MAN_XP_WEIGHT] = o->stage[w][K3_MAN_XP_SCALE_INV] = NULL;
    }
    if (rc)
        return rc;
    if (o->have == R->nparts_need) {
        rc = o->nonzero ? k3_conv_w_write(&cv->xw, R->slot, 0, o->buf, p->man.xl.stride, e)
                        : k3_conv_w_write_zeros(&cv->xw, R->slot, 0, p->man.xl.stride, e);
        o->rec = -1;
    }
    return rc;
}

/* n bytes of tensor ct at toff (ptr holds them even when zero: they are
 * known zeros, a hole) */
static int handle_trunk(conv *cv, const k3_conv_tensor *ct, uint64_t toff, const uint8_t *ptr, uint64_t n, int zero,
                        k3_err *e)
{
    const k3_st_tensor *t = ct->st;
    const int emb = cv->embed_t >= 0 && ct == &cv->p->tensors[cv->embed_t];
    if (t->dtype == ct->out_dtype) {
        int rc = emb ? embed_feed(cv, toff, ptr, n, e) : 0;
        if (rc)
            return rc;
        return zero ? k3_conv_w_write_zeros(&cv->tw, ct->ext, toff, n, e)
                    : k3_conv_w_write(&cv->tw, ct->ext, toff, ptr, n, e);
    }
    if (toff == 0) {
        cv->carry_len = 0;
        cv->out_done = 0;
    }
    uint32_t esz = k3_dtype_size(t->dtype);
    uint64_t m = 0;
    uint16_t h;
    if (cv->carry_len) {
        uint64_t take = esz - cv->carry_len < n ? esz - cv->carry_len : n;
        memcpy(cv->carry + cv->carry_len, ptr, (size_t)take);
        cv->carry_len += (uint32_t)take;
        ptr += take;
        n -= take;
        if (cv->carry_len < esz)
            return 0;
        h = k3_f32_to_bf16(src_to_f32(cv->carry, t->dtype));
        memcpy(cv->scratch, &h, 2);
        m = 2;
        cv->carry_len = 0;
    }
    uint64_t whole = n / esz;
    for (uint64_t i = 0; i < whole; i++) {
        h = k3_f32_to_bf16(src_to_f32(ptr + i * esz, t->dtype));
        memcpy(cv->scratch + m, &h, 2);
        m += 2;
    }
    memcpy(cv->carry, ptr + whole * esz, (size_t)(n - whole * esz));
    cv->carry_len = (uint32_t)(n - whole * esz);
    int rc = m && emb ? embed_feed(cv, cv->out_done, cv->scratch, m, e) : 0;
    if (rc == 0 && m)
        rc = k3_conv_w_write(&cv->tw, ct->ext, cv->out_done, cv->scratch, m, e);
    cv->out_done += m;
    return rc;
}

static int process_chunk(conv *cv, const chunk *c, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    while (cv->ti < p->ntensors && p->tensors[cv->ti].st->shard < c->shard)
        cv->ti++;
    while (cv->ti < p->ntensors && p->tensors[cv->ti].st->shard == c->shard) {
        const k3_conv_tensor *ct = &p->tensors[cv->ti];
        const k3_st_tensor *t = ct->st;
        uint64_t tend = t->offset + t->nbytes;
        if (t->nbytes == 0 || tend <= c->off) {
            cv->ti++;
            continue;
        }
        if (t->offset >= c->off + c->len)
            break;
        uint64_t lo = t->offset > c->off ? t->offset : c->off;
        uint64_t hi = tend < c->off + c->len ? tend : c->off + c->len;
        int rc = 0;
        if (ct->role == K3_CONV_T_TRUNK && p->slot_group[ct->slot] == cv->g)
            rc = handle_trunk(cv, ct, lo - t->offset, c->buf + (lo - c->off), hi - lo,
                              k3_conv_chunk_zero(c, lo - c->off, hi - c->off), e);
        else if (ct->role == K3_CONV_T_EXPERT && p->recs[ct->rec].group == cv->g)
            rc = handle_expert(cv, ct, lo - t->offset, c->buf + (lo - c->off), hi - lo,
                               k3_conv_chunk_zero(c, lo - c->off, hi - c->off), e);
        if (rc)
            return rc;
        if (hi < tend)
            break;
        cv->ti++;
    }
    return 0;
}

/* ---- one group -------------------------------------------------------------- */

static int convert_group(conv *cv, uint32_t g, reader *rd, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    k3_conv_group *G = &p->groups[g];
    int rc = 0;
    cv->has_t = cv->has_x = 0;
    if (g == cv->embed_group) {
        cv->erow_at = 0;
        cv->erow_c = 0;   /* the CRC of nothing */
    }
    if (G->trunk.size) {
        if ((rc = k3_conv_w_open(&cv->tw, p->dst, &G->trunk, cv->o->dense, e)))
            goto fail;
        cv->has_t = 1;
    }
    if (G->experts.size) {
        if ((rc = k3_conv_w_open(&cv->xw, p->dst, &G->experts, cv->o->dense, e)))
            goto fail;
        cv->has_x = 1;
    }
    rd->shard_first = G->shard_first;
    rd->shard_end = G->shard_end;
    rd->head = rd->count = 0;
    rd->finished = rd->failed = rd->stop = 0;
    rd->holes = 0;
    k3_err_clear(&rd->err);
    pthread_t th;
    if (pthread_create(&th, NULL, k3_conv_reader_main, rd) != 0) {
        rc = k3_err_set(e, K3_EINTERNAL, "cannot start the reader thread");
        goto fail;
    }
    cv->ti = 0;
    cv->g = g;
    /* trunk tensors of this group's units that lie in earlier shards (a
     * layer straddling a shard boundary): read them directly first, in input
     * order, in pieces of at most one chunk */
    for (uint64_t i = 0; rc == 0 && i < p->ntensors && p->tensors[i].st->shard < G->shard_first; i++) {
        const k3_conv_tensor *ct = &p->tensors[i];
        if (ct->role != K3_CONV_T_TRUNK || p->slot_group[ct->slot] != g)
            continue;
        for (uint64_t off = 0; rc == 0 && off < ct->st->nbytes; off += rd->chunk) {
            uint64_t n = ct->st->nbytes - off < rd->chunk ? ct->st->nbytes - off : rd->chunk;
            uint8_t *tmp = malloc((size_t)n);
            if (!tmp)
                rc = k3_err_set(e, K3_ENOMEM, "out of memory reading %s", ct->st->name);
            if (rc == 0)
                rc = k3_st_read_range(p->st, ct->st, off, n, tmp, e);
            if (rc == 0)
                rc = handle_trunk(cv, ct, off, tmp, n, 0, e);
            free(tmp);
        }
    }
    /* parts of this group's records that lie in earlier shards (an expert
     * straddling a shard boundary): read them directly first */
    for (uint64_t r = 0; rc == 0 && r < p->nrecs; r++) {
        if (p->recs[r].group != g)
            continue;
        for (int w = 0; rc == 0 && w < 3; w++)
            for (int q = 0; rc == 0 && q < K3_MAN_XP_COUNT; q++) {
                int32_t ti = p->recs[r].parts[w][q];
                if (ti < 0 || p->tensors[ti].st->shard >= G->shard_first)
                    continue;
                const k3_st_tensor *t = p->tensors[ti].st;
                uint8_t *buf = malloc(t->nbytes ? (size_t)t->nbytes : 1);
                if (!buf)
                    rc = k3_err_set(e, K3_ENOMEM, "out of memory reading %s", t->name);
                if (rc == 0)
                    rc = k3_st_read(p->st, t, buf, e);
                if (rc == 0)
                    rc = handle_expert(cv, &p->tensors[ti], 0, buf, t->nbytes, 0, e);
                free(buf);
            }
    }
    for (;;) {
        pthread_mutex_lock(&rd->mu);
        while (rd->count == 0 && !rd->finished)
            pthread_cond_wait(&rd->cv, &rd->mu);
        int have = rd->count > 0;
        pthread_mutex_unlock(&rd->mu);
        if (!have)
            break;
        chunk *c = &rd->slots[rd->head];
        if (k3_conv_stop_requested)
            rc = k3_err_set(e, K3_EINTR, "interrupted");
        if (rc == 0)
            rc = process_chunk(cv, c, e);
        if (rc == 0) {
            k3_progress_add(cv->prog, c->len);
            cv->s->bytes_read += c->len;
            crash_point("chunk", g);
        }
        pthread_mutex_lock(&rd->mu);
        rd->head = (rd->head + 1) % K3_CONV_NCHUNKS;
        rd->count--;
        if (rc)
            rd->stop = 1;
        pthread_cond_broadcast(&rd->cv);
        pthread_mutex_unlock(&rd->mu);
        if (rc)
            break;
    }
    pthread_join(th, NULL);
    cv->s->src_hole_bytes += rd->holes;
    if (rc == 0 && rd->failed) {
        *e = rd->err;
        rc = rd->failed;
    }
    for (uint32_t i = 0; rc == 0 && i < K3_CONV_MAX_OPEN_RECORDS; i++)
        if (cv->recs[i].rec >= 0)
            rc = k3_err_set(e, K3_EINTERNAL, "record %" PRId64 " never completed", cv->recs[i].rec);
    if (rc)
        goto fail;
    k3_conv_w *ws[2] = {cv->has_t ? &cv->tw : NULL, cv->has_x ? &cv->xw : NULL};
    for (int k = 0; k < 2; k++) {
        if (!ws[k])
            continue;
        if ((rc = k3_conv_w_finish(ws[k], p->man.files[ws[k]->of->file_index].sha256, e)))
            goto fail;
        cv->s->bytes_written += ws[k]->of->size;
        cv->s->holes_bytes += ws[k]->holes;
    }
    for (int k = 0; k < 2; k++)
        if (ws[k] && (rc = k3_conv_w_publish(ws[k], e)))
            goto fail;
    for (int k = 0; k < 2; k++)
        if (ws[k])
            k3_conv_w_close(ws[k], 0);
    cv->has_t = cv->has_x = 0;
    crash_point("published", g);
    rc = k3_conv_journal_write_group(cv, g, e);
    if (rc == 0)
        crash_point("journaled", g);
    return rc;
fail:
    for (uint32_t i = 0; i < K3_CONV_MAX_OPEN_RECORDS; i++) {
        cv->recs[i].rec = -1;
        for (int w = 0; w < 3; w++)
            for (int q = 0; q < K3_MAN_XP_COUNT; q++) {
                free(cv->recs[i].stage[w][q]);
                cv->recs[i].stage[w][q] = NULL;
            }
    }
    if (cv->has_t)
        k3_conv_w_close(&cv->tw, 1);
    if (cv->has_x)
        k3_conv_w_close(&cv->xw, 1);
    cv->has_t = cv->has_x = 0;
    return rc;
}

/* ---- DST preparation and the final files ------------------------------------- */

/* k3-convert's destination: a packed model, written in place */
const k3_dest_tool k3_conv_dest_tool = {"k3-convert", K3_DEST_PACKED, NULL};

static int remove_journal(const char *dst, k3_err *e)
{
    k3_journal j;
    int rc = k3_conv_journal(&j, dst, e);
    return rc ? rc : k3_journal_remove(&j, e);
}

/* Make DST ready. Returns 1 if DST already holds the finished conversion
 * (resume after the manifest was published), 0 to go on. */
static int prepare_dst(k3_conv_plan *p, const k3_conv_opts *o, k3_dest_state state, k3_err *e)
{
    const char *dst = p->dst;
    char hex[65];
    k3_man_hex(p->fingerprint, hex);
    if (state == K3_DEST_ABSENT) {
        if (mkdir(dst, 0755) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: cannot create directory", dst);
    } else if (state == K3_DEST_OURS) {
        /* a packed model or an interrupted conversion (k3_dest_open checked
         * that it holds nothing else) */
        char mp[4200];
        k3_journal j;
        int rc = k3_conv_journal(&j, dst, e);
        if (rc == 0)
            rc = k3_io_path_join(mp, sizeof mp, dst, "manifest.json", e);
        if (rc)
            return rc;
        int has_journal = k3_journal_exists(&j), has_manifest = access(mp, F_OK) == 0;
        if (o->resume && has_journal) {
            int cmp = k3_journal_plan_cmp(&j, hex, e);
            if (cmp < 0)
                return cmp;
            if (cmp == 2) {
                /* killed before the plan was written: nothing finished yet */
                goto fresh;
            }
            if (cmp == 1)
                return k3_err_set(e, K3_EEXIST, "%s: the journal is of a conversion from other input or "
                                  "options; use --force to start again", dst);
            if (has_manifest) {
                /* finished, interrupted only while removing the journal */
                rc = remove_journal(dst, e);
                return rc ? rc : 1;
            }
            return 0;
        }
        if (o->resume && has_manifest)
            return 1;
    fresh:
        if (!o->force && !o->resume)
            return k3_err_set(e, K3_EEXIST, "%s: exists and is not empty (--force to replace, --resume to "
                              "continue an interrupted conversion)", dst);
        /* only what k3_dest_clear recognises as a packed model's goes,
         * manifest.json first so the directory never looks complete */
        if ((rc = k3_dest_clear(&k3_conv_dest_tool, dst, 0, 0, e)))
            return rc;
    }
    k3_journal j;
    int rc = k3_conv_journal(&j, dst, e);
    if (rc == 0)
        rc = k3_journal_begin(&j, hex, e);
    return rc ? rc : k3_io_fsync_dir(dst, e);
}

/* Provenance of the small upstream files; tokenizer files are copied. */
static int small_files(k3_conv_plan *p, k3_err *e)
{
    static const char *names[] = {"config.json", "model.safetensors.index.json", "tiktoken.model",
                                  "tokenizer_config.json"};
    p->man.src_files = calloc(4, sizeof *p->man.src_files);
    if (!p->man.src_files)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (int i = 0; i < 4; i++) {
        char path[4200];
        int rc = k3_io_path_join(path, sizeof path, p->src, names[i], e);
        if (rc)
            return rc;
        if (access(path, F_OK) != 0)
            continue;
        char *buf;
        uint64_t len;
        if ((rc = k3_io_read_file(path, 1ull << 30, &buf, &len, e)))
            return rc;
        k3_man_src *s = &p->man.src_files[p->man.nsrc_files++];
        unsigned int hl;
        EVP_Digest(buf, (size_t)len, s->sha256, &hl, EVP_sha256(), NULL);
        s->size = len;
        s->name = strdup(names[i]);
        if (!s->name) {
            free(buf);
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        }
        if (i >= 2) {
            char out[4200];
            if ((rc = k3_io_path_join(out, sizeof out, p->dst, names[i], e)) ||
                (rc = k3_io_write_file_atomic(out, buf, len, e))) {
                free(buf);
                return rc;
            }
            k3_pk_file *f = &p->man.files[p->man.nfiles++];
            f->name = strdup(names[i]);
            f->kind = K3_PK_FILE_TOKENIZER;
            f->size = len;
            memcpy(f->sha256, s->sha256, 32);
            if (!f->name) {
                free(buf);
                return k3_err_set(e, K3_ENOMEM, "out of memory");
            }
        }
        free(buf);
    }
    return 0;
}

/* embed.crc: the embedding's row CRCs (taken as it was written, or from the
 * journal's embed-crc.bin for a kept group), little-endian, to DST. */
static int write_embed_crcs(conv *cv, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    const uint64_t V = p->cfg.vocab_size;
    if (cv->embed_t < 0 || !cv->erow)
        return k3_err_set(e, K3_EINTERNAL, "no embedding table in the plan");
    uint8_t *out = malloc(4 * V + 1);
    if (!out)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < V; i++)
        for (int j = 0; j < 4; j++)
            out[4 * i + j] = (uint8_t)(cv->erow[i] >> (8 * j));
    k3_pk_file *f = &p->man.files[p->man.nfiles];
    p->man.embed_crc_file = p->man.nfiles;
    f->kind = K3_PK_FILE_EMBED_CRC;
    f->size = 4 * V;
    unsigned int hl;
    EVP_Digest(out, (size_t)f->size, f->sha256, &hl, EVP_sha256(), NULL);
    char path[4200];
    int rc = 0;
    if (!(f->name = strdup(K3_MAN_EMBED_CRC_NAME)))
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    else
        p->man.nfiles++;
    if (rc == 0)
        rc = k3_io_path_join(path, sizeof path, p->dst, f->name, e);
    if (rc == 0)
        rc = k3_io_write_file_atomic(path, out, f->size, e);
    free(out);
    return rc;
}

int k3_conv_finish(conv *cv, k3_err *e)
{
    k3_conv_plan *p = cv->p;
    int rc = small_files(p, e);
    if (rc)
        return rc;
    uint32_t ns = k3_st_shard_count(p->st);
    p->man.src_shards = calloc(ns ? ns : 1, sizeof *p->man.src_shards);
    if (!p->man.src_shards)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint32_t s = 0; s < ns; s++) {
        k3_man_src *m = &p->man.src_shards[p->man.nsrc_shards++];
        if (!(m->name = strdup(k3_st_shard_name(p->st, s))))
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        m->size = k3_st_shard_size(p->st, s);
        memcpy(m->sha256, cv->shard_sha[s], 32);
    }
    for (uint32_t g = 0; g < p->ngroups; g++) {
        const k3_conv_group *G = &p->groups[g];
        for (uint32_t u = G->unit_first; u < G->unit_end; u++)
            p->man.units[u].crc32 = G->trunk.region_crc[u - G->unit_first];
    }
    if ((rc = write_embed_crcs(cv, e)))
        return rc;
    if (p->man.has_experts) {
        for (uint64_t r = 0; r < p->nrecs; r++)
            p->records[r].crc32 = p->groups[p->recs[r].group].experts.region_crc[p->recs[r].slot];
        k3_pk_file *f = &p->man.files[p->man.expert_index_file];
        uint8_t *buf = malloc((size_t)f->size);
        if (!buf)
            return k3_err_set(e, K3_ENOMEM, "out of memory");
        k3_man_idx_encode(buf, &p->cfg, p->man.xl.stride, p->records);
        unsigned int hl;
        EVP_Digest(buf, (size_t)f->size, f->sha256, &hl, EVP_sha256(), NULL);
        char path[4200];
        rc = k3_io_path_join(path, sizeof path, p->dst, f->name, e);
        if (rc == 0)
            rc = k3_io_write_file_atomic(path, buf, f->size, e);
        free(buf);
        if (rc)
            return rc;
    }
    crash_point("index", 0);
    p->man.plan_json = strdup("{\"tool\":\"k3-convert\",\"grouping\":\"shard-groups\",\"units\":\"layer-per-group\"}");
    char *txt = k3_man_to_json(&p->man);
    if (!txt || !p->man.plan_json) {
        free(txt);
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    }
    /* the manifest must pass our own reader before it is published */
    k3_man check;
    char mpath[4200];
    rc = k3_io_path_join(mpath, sizeof mpath, p->dst, "manifest.json", e);
    if (rc == 0 && (rc = k3_man_parse(&check, txt, strlen(txt), mpath, e)))
        rc = k3_err_set(e, K3_EINTERNAL, "the manifest k3-convert produced is invalid: %s", e->msg);
    k3_man_free(&check);
    if (rc == 0)
        rc = k3_io_write_file_atomic(mpath, txt, strlen(txt), e);
    free(txt);
    if (rc)
        return rc;
    return remove_journal(p->dst, e);
}

int k3_conv_cv_init(conv *cv, k3_conv_plan *plan, const k3_conv_opts *o, k3_conv_stats *s, k3_err *e)
{
    memset(cv, 0, sizeof *cv);
    cv->p = plan;
    cv->o = o;
    cv->s = s;
    for (uint32_t i = 0; i < K3_CONV_MAX_OPEN_RECORDS; i++)
        cv->recs[i].rec = -1;
    uint32_t ns = k3_st_shard_count(plan->st);
    cv->shard_sha = calloc(ns ? ns : 1, 32);
    cv->scratch = malloc(K3_CONV_CHUNK + 64);
    cv->embed_t = -1;
    for (uint64_t i = 0; i < plan->ntensors; i++) {
        const k3_conv_tensor *ct = &plan->tensors[i];
        if (ct->role == K3_CONV_T_TRUNK && !strcmp(plan->man.tensors[ct->out_tensor].name, K3_SCH_EMBED_NAME)) {
            cv->embed_t = (int64_t)i;
            cv->embed_group = plan->slot_group[ct->slot];
            cv->erow_rb = plan->man.tensors[ct->out_tensor].shape[1] * k3_dtype_size(ct->out_dtype);
        }
    }
    cv->erow = calloc(plan->cfg.vocab_size ? plan->cfg.vocab_size : 1, sizeof *cv->erow);
    if (!cv->shard_sha || !cv->scratch || !cv->erow)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    return 0;
}

void k3_conv_cv_free(conv *cv)
{
    for (uint32_t i = 0; i < K3_CONV_MAX_OPEN_RECORDS; i++)
        k3_io_free_aligned(cv->recs[i].buf);
    free(cv->scratch);
    free(cv->erow);
    free(cv->shard_sha);
    cv->scratch = NULL;
    cv->erow = NULL;
    cv->shard_sha = NULL;
}

int k3_conv_group_inputs_here(const k3_conv_plan *p, uint32_t g, uint32_t *shard, const char **tensor)
{
    const k3_conv_group *G = &p->groups[g];
    for (uint32_t sh = G->shard_first; sh < G->shard_end; sh++)
        if (!k3_st_shard_present(p->st, sh)) {
            *shard = sh;
            *tensor = NULL;
            return 0;
        }
    /* what convert_group reads directly from earlier shards */
    for (uint64_t i = 0; i < p->ntensors && p->tensors[i].st->shard < G->shard_first; i++) {
        const k3_conv_tensor *ct = &p->tensors[i];
        int mine = (ct->role == K3_CONV_T_TRUNK && p->slot_group[ct->slot] == g) ||
                   (ct->role == K3_CONV_T_EXPERT && p->recs[ct->rec].group == g);
        if (mine && !k3_st_shard_present(p->st, ct->st->shard)) {
            *shard = ct->st->shard;
            *tensor = ct->st->name;
            return 0;
        }
    }
    return 1;
}

int k3_conv_run(const char *src, const char *dst, const k3_conv_opts *o, k3_conv_stats *s, k3_err *e)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    memset(s, 0, sizeof *s);
    k3_kern_init();
    if (o->threads > 0)
        omp_set_num_threads(o->threads);
    /* DST checked against SRC, owned and locked before anything is read or made */
    k3_dest dest;
    int rc = k3_dest_open(&dest, &k3_conv_dest_tool, src, dst, e);
    if (rc)
        return rc;
    k3_conv_plan plan;
    /* a part may hold only some shards: the others are stood in for by their
     * headers (k3_st.h), from --headers DIR or SRC itself */
    const char *hdr = o->part ? (o->headers ? o->headers : src) : NULL;
    if ((rc = k3_conv_plan_build(&plan, src, dest.path, o->trunk_bf16, hdr, e))) {
        k3_dest_close(&dest);
        return rc;
    }
    conv cv;
    reader rd = {.p = &plan};
    pthread_mutex_init(&rd.mu, NULL);
    pthread_cond_init(&rd.cv, NULL);
    uint32_t ns = k3_st_shard_count(plan.st);
    uint8_t *sel = calloc(plan.ngroups ? plan.ngroups : 1, 1);
    rc = k3_conv_cv_init(&cv, &plan, o, s, e);
    rd.shard_sha = cv.shard_sha;
    if (rc == 0 && !sel)
        rc = k3_err_set(e, K3_ENOMEM, "out of memory");
    for (uint32_t g = 0; rc == 0 && !o->part && g < plan.ngroups; g++)
        sel[g] = 1;
    if (rc == 0 && o->part)
        rc = k3_conv_part_select(&plan, o->part, sel, o->progress, e);
    if (rc)
        goto out;
    rc = prepare_dst(&plan, o, dest.state, e);
    if (rc == 1) {
        rc = 0;
        goto out;
    }
    if (rc)
        goto out;
    uint64_t todo = 0;
    for (uint32_t g = 0; g < plan.ngroups; g++) {
        const char *why = "";
        if (!sel[g]) {
            plan.groups[g].done = 1; /* another part's */
            continue;
        }
        s->groups++;
        int done = o->resume ? k3_conv_journal_load_group(&cv, g, &why, e) : 0;
        if (done < 0) {
            rc = done;
            goto out;
        }
        plan.groups[g].done = done;
        if (done)
            s->groups_skipped++;
        else
            todo += plan.groups[g].input_bytes;
        if (o->resume && !done && o->progress && strcmp(why, "no journal entry"))
            fprintf(o->progress, "k3-convert: group %u will be redone: %s\n", g, why);
    }
    uint64_t biggest = 0;
    for (uint32_t i = 0; i < ns; i++)
        if (k3_st_shard_present(plan.st, i))
            biggest = k3_st_shard_size(plan.st, i) > biggest ? k3_st_shard_size(plan.st, i) : biggest;
    rd.chunk = (biggest + K3_IO_DIRECT_ALIGN - 1) / K3_IO_DIRECT_ALIGN * K3_IO_DIRECT_ALIGN;
    rd.chunk = rd.chunk < K3_CONV_CHUNK ? (rd.chunk ? rd.chunk : K3_IO_DIRECT_ALIGN) : K3_CONV_CHUNK;
    const char *ck = getenv("K3_CONVERT_CHUNK"); /* test knob: smaller read chunks */
    if (ck) {
        char *end;
        unsigned long long v = strtoull(ck, &end, 10);
        if (!*end && v >= K3_IO_DIRECT_ALIGN && v <= K3_CONV_CHUNK && v % K3_IO_DIRECT_ALIGN == 0)
            rd.chunk = v;
    }
    rd.arena = k3_io_huge_alloc((uint64_t)K3_CONV_NCHUNKS * rd.chunk);
    rd.bounce = k3_io_alloc_aligned(K3_IO_DIRECT_ALIGN, K3_IO_DIRECT_ALIGN);
    if (!rd.arena || !rd.bounce) {
        rc = k3_err_set(e, K3_ENOMEM, "out of memory for the read buffers");
        goto out;
    }
    cv.prog = k3_progress_create("k3-convert", todo, o->progress,
                                 o->quiet || !o->progress ? K3_PROGRESS_QUIET
                                 : o->force_progress      ? K3_PROGRESS_FORCE
                                                          : K3_PROGRESS_AUTO);
    for (uint32_t g = 0; g < plan.ngroups && rc == 0; g++)
        if (!plan.groups[g].done)
            rc = convert_group(&cv, g, &rd, e);
    if (rc == 0)
        k3_progress_finish(cv.prog);
    k3_progress_free(cv.prog);
    if (rc == 0)
        rc = o->part ? k3_conv_part_finish(&cv, sel, e) : k3_conv_finish(&cv, e);
out:
    k3_conv_cv_free(&cv);
    free(sel);
    if (rd.arena)
        k3_io_huge_free(rd.arena, (uint64_t)K3_CONV_NCHUNKS * rd.chunk);
    k3_io_free_aligned(rd.bounce);
    pthread_mutex_destroy(&rd.mu);
    pthread_cond_destroy(&rd.cv);
    k3_conv_plan_free(&plan);
    k3_dest_close(&dest);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    s->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        s->peak_rss_kb = (uint64_t)ru.ru_maxrss;
    return rc;
}
