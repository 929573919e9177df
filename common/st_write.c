/*
 * st_write.c - the streaming safetensors shard writer (see k3_stw.h).
 *
 * Invariants: the header text is a pure function of the declared tensors and
 * metadata, so a dry run and a real run of the same declarations agree on
 * every size and offset. Data is laid out in declaration order with no gaps.
 * Until k3_stw_finish succeeds the only file on disk is "<path>.tmp", and
 * k3_stw_free removes it.
 *
 * Streaming: the file is cut into chunks at fixed file offsets (multiples of
 * the chunk size, itself a multiple of the piece size and of 4096). The main
 * thread fills a chunk piece by piece on OpenMP threads and hands it to a
 * writer thread through a ring of three buffers, so that generation and
 * writing overlap. Pieces that the callback reports as zero are not written
 * when sparse (the file was sized by ftruncate, so they read as zero).
 */
#include "k3_stw.h"

#include "k3_io.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>

#define STW_PIECE   4096u           /* fill / sparse (hole) granularity */
#define STW_CHUNK   (16u << 20)     /* default write request */
#define STW_NBUF    3

typedef struct stw_tensor {
    char *name;
    k3_dtype dtype;
    uint32_t ndim;
    uint64_t shape[K3_ST_MAX_DIMS];
    uint64_t begin, end;            /* relative to the data start */
} stw_tensor;

struct k3_stw {
    char *path;                     /* NULL for a dry run */
    char *tmp_path;
    stw_tensor *t;
    uint64_t count, cap;
    char *meta;                     /* ,"key":"value" pairs, JSON-escaped */
    uint64_t meta_len;
    uint64_t entries_len;           /* sum of entry lengths incl. separators */
    uint64_t data_bytes;
    char *header;                   /* after begin: N bytes of JSON */
    uint64_t header_len;
    int fd;
    int finished;
    uint64_t written;
};

/* Local names: this file must not depend on the reader's implementation. */
static const char *dtype_name(k3_dtype t)
{
    static const char *names[K3_DT_COUNT] = {"BF16", "F16", "F32", "U8", "I8", "I32", "F8_E4M3", "F8_E5M2"};
    return (unsigned)t < K3_DT_COUNT ? names[t] : NULL;
}

static uint32_t dtype_size(k3_dtype t)
{
    static const uint32_t sizes[K3_DT_COUNT] = {2, 2, 4, 1, 1, 4, 1, 1};
    return (unsigned)t < K3_DT_COUNT ? sizes[t] : 0;
}

/* JSON string escape of s into out (capacity cap); returns the escaped length
 * (without quotes) even when it does not fit, like snprintf. */
static uint64_t json_escape(const char *s, char *out, uint64_t cap)
{
    uint64_t n = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char tmp[8];
        const char *rep = NULL;
        uint64_t rl = 1;
        if (*p == '"')
            rep = "\\\"", rl = 2;
        else if (*p == '\\')
            rep = "\\\\", rl = 2;
        else if (*p < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", *p);
            rep = tmp, rl = 6;
        }
        for (uint64_t k = 0; k < rl; k++, n++)
            if (n < cap)
                out[n] = rep ? rep[k] : (char)*p;
    }
    return n;
}

/* One header entry "NAME":{...} written to out (NULL: measure only). */
static uint64_t entry_text(char *out, uint64_t cap, const char *name, k3_dtype dt, uint32_t ndim,
                           const uint64_t *shape, uint64_t begin, uint64_t end)
{
    char tail[512];
    int k = snprintf(tail, sizeof tail, "\":{\"dtype\":\"%s\",\"shape\":[", dtype_name(dt));
    for (uint32_t d = 0; d < ndim; d++)
        k += snprintf(tail + k, sizeof tail - (size_t)k, "%s%" PRIu64, d ? "," : "", shape[d]);
    k += snprintf(tail + k, sizeof tail - (size_t)k, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                  begin, end);
    uint64_t n = 1;
    if (out && cap)
        out[0] = '"';
    n += json_escape(name, out ? out + 1 : NULL, out && cap > 1 ? cap - 1 : 0);
    if (out && n + (uint64_t)k <= cap)
        memcpy(out + n, tail, (size_t)k);
    return n + (uint64_t)k;
}

/* Bytes of a tensor, or UINT64_MAX on overflow or a bad dtype. */
static uint64_t tensor_bytes(k3_dtype dt, uint32_t ndim, const uint64_t *shape)
{
    uint64_t n = dtype_size(dt);
    if (!n || ndim > K3_ST_MAX_DIMS)
        return UINT64_MAX;
    for (uint32_t d = 0; d < ndim; d++) {
        if (shape[d] && n > UINT64_MAX / 4 / shape[d])
            return UINT64_MAX;
        n *= shape[d];
    }
    return n;
}

/* Header: '{' "__metadata__":{"format":"pt"META} [',' entry]* '}' padded. */
static const char META_OPEN[] = "{\"__metadata__\":{\"format\":\"pt\"";

static uint64_t header_len_for(uint64_t meta_len, uint64_t entries_len)
{
    uint64_t raw = (sizeof META_OPEN - 1) + meta_len + 1 /* } */ + entries_len + 1 /* } */;
    return (raw + 8 + 7) / 8 * 8 - 8;
}

int k3_stw_create(k3_stw **out, const char *path, k3_err *e)
{
    *out = NULL;
    k3_stw *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory for a shard writer");
    w->fd = -1;
    if (path) {
        size_t n = strlen(path);
        w->path = strdup(path);
        w->tmp_path = malloc(n + 5);
        if (!w->path || !w->tmp_path) {
            k3_stw_free(w);
            return k3_err_set(e, K3_ENOMEM, "out of memory for a shard writer");
        }
        snprintf(w->tmp_path, n + 5, "%s.tmp", path);
    }
    *out = w;
    return 0;
}

void k3_stw_free(k3_stw *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    if (w->tmp_path && w->header && !w->finished)
        unlink(w->tmp_path);
    for (uint64_t i = 0; i < w->count; i++)
        free(w->t[i].name);
    free(w->t);
    free(w->meta);
    free(w->header);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

int k3_stw_metadata(k3_stw *w, const char *key, const char *value, k3_err *e)
{
    if (w->header)
        return k3_err_set(e, K3_EARG, "metadata added after the header was written");
    uint64_t kl = json_escape(key, NULL, 0), vl = json_escape(value, NULL, 0);
    uint64_t add = 1 + 2 + kl + 1 + 2 + vl;   /* ,"k":"v" */
    char *m = realloc(w->meta, w->meta_len + add + 1);
    if (!m)
        return k3_err_set(e, K3_ENOMEM, "out of memory for shard metadata");
    w->meta = m;
    char *p = m + w->meta_len;
    *p++ = ',';
    *p++ = '"';
    p += json_escape(key, p, kl);
    *p++ = '"';
    *p++ = ':';
    *p++ = '"';
    p += json_escape(value, p, vl);
    *p++ = '"';
    *p = '\0';
    w->meta_len += add;
    return 0;
}

uint64_t k3_stw_size_with(const k3_stw *w, const char *name, k3_dtype dtype, uint32_t ndim,
                          const uint64_t *shape)
{
    uint64_t nb = tensor_bytes(dtype, ndim, shape);
    if (nb == UINT64_MAX || nb > UINT64_MAX / 2 - w->data_bytes)
        return UINT64_MAX;
    uint64_t el = 1 + entry_text(NULL, 0, name, dtype, ndim, shape, w->data_bytes, w->data_bytes + nb);
    return 8 + header_len_for(w->meta_len, w->entries_len + el) + w->data_bytes + nb;
}

uint64_t k3_stw_size(const k3_stw *w)
{
    return 8 + header_len_for(w->meta_len, w->entries_len) + w->data_bytes;
}

int k3_stw_add(k3_stw *w, const char *name, k3_dtype dtype, uint32_t ndim, const uint64_t *shape,
               k3_err *e)
{
    if (w->header)
        return k3_err_set(e, K3_EARG, "%s: tensor added after the header was written", name);
    if (!dtype_name(dtype) || ndim > K3_ST_MAX_DIMS)
        return k3_err_set(e, K3_EARG, "%s: bad dtype or rank", name);
    uint64_t nb = tensor_bytes(dtype, ndim, shape);
    if (nb == UINT64_MAX || nb > UINT64_MAX / 2 - w->data_bytes)
        return k3_err_set(e, K3_ELIMIT, "%s: tensor size overflows", name);
    if (w->count == w->cap) {
        uint64_t nc = w->cap ? w->cap * 2 : 64;
        stw_tensor *t = realloc(w->t, (size_t)nc * sizeof *t);
        if (!t)
            return k3_err_set(e, K3_ENOMEM, "out of memory for %" PRIu64 " tensors", nc);
        w->t = t;
        w->cap = nc;
    }
    stw_tensor *t = &w->t[w->count];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name)
        return k3_err_set(e, K3_ENOMEM, "out of memory for a tensor name");
    t->dtype = dtype;
    t->ndim = ndim;
    memcpy(t->shape, shape, ndim * sizeof *shape);
    t->begin = w->data_bytes;
    t->end = w->data_bytes + nb;
    w->entries_len += 1 + entry_text(NULL, 0, name, dtype, ndim, shape, t->begin, t->end);
    w->data_bytes = t->end;
    w->count++;
    return 0;
}

uint64_t k3_stw_count(const k3_stw *w) { return w->count; }
uint64_t k3_stw_header_len(const k3_stw *w) { return header_len_for(w->meta_len, w->entries_len); }
uint64_t k3_stw_tensor_bytes(const k3_stw *w, uint64_t i) { return w->t[i].end - w->t[i].begin; }
uint64_t k3_stw_bytes_written(const k3_stw *w) { return w->written; }

uint64_t k3_stw_tensor_offset(const k3_stw *w, uint64_t i)
{
    return 8 + k3_stw_header_len(w) + w->t[i].begin;
}

static int build_header(k3_stw *w, k3_err *e)
{
    uint64_t n = k3_stw_header_len(w);
    char *h = malloc((size_t)n + 1);
    if (!h)
        return k3_err_set(e, K3_ENOMEM, "out of memory for a %" PRIu64 "-byte header", n);
    char *p = h;
    memcpy(p, META_OPEN, sizeof META_OPEN - 1);
    p += sizeof META_OPEN - 1;
    if (w->meta_len)
        memcpy(p, w->meta, (size_t)w->meta_len);
    p += w->meta_len;
    *p++ = '}';
    for (uint64_t i = 0; i < w->count; i++) {
        stw_tensor *t = &w->t[i];
        *p++ = ',';
        p += entry_text(p, (uint64_t)(h + n - p), t->name, t->dtype, t->ndim, t->shape, t->begin, t->end);
    }
    *p++ = '}';
    while (p < h + n)
        *p++ = ' ';
    *p = '\0';
    w->header = h;
    w->header_len = n;
    return 0;
}

int k3_stw_begin(k3_stw *w, int overwrite_tmp, k3_err *e)
{
    if (!w->path)
        return k3_err_set(e, K3_EARG, "begin on a dry-run shard writer");
    if (w->header)
        return k3_err_set(e, K3_EARG, "%s: begin called twice", w->path);
    int rc = build_header(w, e);
    if (rc)
        return rc;
    int flags = O_RDWR | O_CREAT | O_CLOEXEC | (overwrite_tmp ? O_TRUNC : O_EXCL);
    w->fd = open(w->tmp_path, flags, 0644);
    if (w->fd < 0) {
        int err = errno;
        free(w->header);
        w->header = NULL;   /* not ours: k3_stw_free must not remove it */
        return k3_err_sys(e, err == EEXIST ? K3_EEXIST : K3_EIO, err, "%s: cannot create", w->tmp_path);
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)(w->header_len >> (8 * i));
    uint64_t size = k3_stw_size(w);
    if (ftruncate(w->fd, (off_t)size) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot size to %" PRIu64 " bytes", w->tmp_path, size);
    rc = k3_io_pwrite(w->fd, len8, 8, 0, w->tmp_path, e);
    if (rc == 0)
        rc = k3_io_pwrite(w->fd, w->header, w->header_len, 8, w->tmp_path, e);
    return rc;
}

int k3_stw_write(k3_stw *w, uint64_t i, uint64_t off, const void *buf, uint64_t n, k3_err *e)
{
    if (!w->header || w->fd < 0 || i >= w->count)
        return k3_err_set(e, K3_EARG, "shard writer: write before begin or to a bad tensor");
    stw_tensor *t = &w->t[i];
    if (off > t->end - t->begin || n > t->end - t->begin - off)
        return k3_err_set(e, K3_EARG, "%s: write of %" PRIu64 " bytes at %" PRIu64 " past the tensor's end",
                          t->name, n, off);
    w->written += n;
    return k3_io_pwrite(w->fd, buf, n, k3_stw_tensor_offset(w, i) + off, w->tmp_path, e);
}

/* ---- streaming ------------------------------------------------------------ */

typedef struct stw_buf {
    unsigned char *mem;
    uint64_t file_off, len;
    uint8_t *nonzero;       /* per piece */
    int state;              /* 0 free, 1 full, 2 stop */
} stw_buf;

typedef struct stw_pipe {
    k3_stw *w;
    int fd_direct;          /* -1: buffered writes only */
    int sparse;
    k3_progress *progress;
    stw_buf buf[STW_NBUF];
    uint64_t chunk;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int failed;
    k3_err err;
} stw_pipe;

/* Write [off, off+n) of b; aligned whole blocks go through O_DIRECT when we
 * have it, a ragged tail (only at end of file) through the buffered fd. */
static int write_run(stw_pipe *p, const unsigned char *mem, uint64_t off, uint64_t n, k3_err *e)
{
    k3_stw *w = p->w;
    uint64_t direct_n = p->fd_direct >= 0 ? n / K3_IO_DIRECT_ALIGN * K3_IO_DIRECT_ALIGN : 0;
    int rc = 0;
    if (direct_n)
        rc = k3_io_pwrite(p->fd_direct, mem, direct_n, off, w->tmp_path, e);
    if (rc == 0 && n > direct_n)
        rc = k3_io_pwrite(w->fd, mem + direct_n, n - direct_n, off + direct_n, w->tmp_path, e);
    return rc;
}

static void *writer_main(void *arg)
{
    stw_pipe *p = arg;
    for (unsigned k = 0;; k = (k + 1) % STW_NBUF) {
        stw_buf *b = &p->buf[k];
        pthread_mutex_lock(&p->mu);
        while (b->state == 0)
            pthread_cond_wait(&p->cv, &p->mu);
        int stop = b->state == 2;
        pthread_mutex_unlock(&p->mu);
        if (stop)
            return NULL;
        k3_err e = {0};
        int rc = 0;
        uint64_t npieces = (b->len + STW_PIECE - 1) / STW_PIECE;
        for (uint64_t s = 0; s < npieces && rc == 0;) {
            if (p->sparse && !b->nonzero[s]) {
                s++;
                continue;
            }
            uint64_t t = s + 1;
            while (t < npieces && (!p->sparse || b->nonzero[t]))
                t++;
            uint64_t lo = s * STW_PIECE, hi = t * STW_PIECE < b->len ? t * STW_PIECE : b->len;
            rc = write_run(p, b->mem + lo, b->file_off + lo, hi - lo, &e);
            if (rc == 0)
                p->w->written += hi - lo;
            s = t;
        }
        k3_progress_add(p->progress, b->len);
        pthread_mutex_lock(&p->mu);
        if (rc && !p->failed) {
            p->failed = 1;
            p->err = e;
        }
        b->state = 0;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
}

/* First tensor whose data ends after data offset d. */
static uint64_t tensor_at(const k3_stw *w, uint64_t d)
{
    uint64_t lo = 0, hi = w->count;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (w->t[mid].end <= d)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Fill one piece [off, off+n) of the file. Returns 1 if it holds any
 * non-zero byte, 0 if all zero (then, when sparse, its bytes are garbage and
 * it is not written), <0 on error. Zero ranges reported by the callback are
 * cleared only when needed: ranges before the first data in the piece are
 * contiguous, so they are cleared in one go when data turns up. */
static int fill_piece(k3_stw *w, k3_stw_fill_fn fill, void *ctx, int sparse, unsigned char *dst,
                      uint64_t off, uint64_t n, k3_err *e)
{
    uint64_t hdr_end = 8 + w->header_len;
    int nonzero = !sparse;
    uint64_t pos = off, end = off + n;
    if (pos < hdr_end) {
        uint64_t m = (end < hdr_end ? end : hdr_end) - pos;
        for (uint64_t k = 0; k < m; k++) {
            uint64_t fo = pos + k;
            dst[k] = fo < 8 ? (unsigned char)(w->header_len >> (8 * fo)) : (unsigned char)w->header[fo - 8];
        }
        pos += m;
        nonzero = 1;
    }
    uint64_t zero_from = pos;   /* start of the leading zero ranges */
    for (uint64_t i = pos < end ? tensor_at(w, pos - hdr_end) : w->count; pos < end && i < w->count; i++) {
        stw_tensor *t = &w->t[i];
        uint64_t tb = hdr_end + t->begin, te = hdr_end + t->end;
        uint64_t hi = te < end ? te : end;
        if (hi <= pos)
            continue;
        int rc = fill(ctx, i, pos - tb, hi - pos, dst + (pos - off), e);
        if (rc < 0)
            return rc;
        if (rc == K3_STW_ZERO) {
            if (nonzero)
                memset(dst + (pos - off), 0, (size_t)(hi - pos));
        } else if (!nonzero) {
            memset(dst + (zero_from - off), 0, (size_t)(pos - zero_from));
            nonzero = 1;
        }
        pos = hi;
    }
    return nonzero;
}

/* Whether every tensor overlapping file bytes [off, off+n) is all zero (and
 * the range holds no header byte). */
static int chunk_is_zero(const k3_stw *w, const k3_stw_stream_opts *o, void *ctx, uint64_t off, uint64_t n)
{
    uint64_t hdr_end = 8 + w->header_len;
    if (off < hdr_end)
        return 0;
    for (uint64_t i = tensor_at(w, off - hdr_end); i < w->count && hdr_end + w->t[i].begin < off + n; i++)
        if (!o->tensor_is_zero(ctx, i))
            return 0;
    return 1;
}

int k3_stw_stream(k3_stw *w, k3_stw_fill_fn fill, void *ctx, const k3_stw_stream_opts *o, k3_err *e)
{
    if (!w->header || w->fd < 0)
        return k3_err_set(e, K3_EARG, "shard writer: stream before begin");
    uint64_t size = k3_stw_size(w);
    uint64_t chunk = o && o->chunk_bytes ? o->chunk_bytes : STW_CHUNK;
    chunk = (chunk + STW_PIECE - 1) / STW_PIECE * STW_PIECE;
    uint64_t size_rounded = (size + STW_PIECE - 1) / STW_PIECE * STW_PIECE;
    if (chunk > size_rounded)
        chunk = size_rounded;
    stw_pipe p;
    memset(&p, 0, sizeof p);
    p.w = w;
    p.fd_direct = -1;
    p.sparse = o && o->sparse;
    p.progress = o ? o->progress : NULL;
    p.chunk = chunk;
    if (o && o->direct)
        p.fd_direct = open(w->tmp_path, O_WRONLY | O_CLOEXEC | O_DIRECT);
    if (p.fd_direct >= 0 && !k3_io_direct_fits(p.fd_direct, 0)) {   /* coarser alignment: buffered */
        close(p.fd_direct);
        p.fd_direct = -1;
    }
    int rc = 0;
    for (int k = 0; k < STW_NBUF && rc == 0; k++) {
        p.buf[k].mem = k3_io_huge_alloc(chunk);
        p.buf[k].nonzero = calloc((size_t)(chunk / STW_PIECE), 1);
        if (!p.buf[k].mem || !p.buf[k].nonzero)
            rc = k3_err_set(e, K3_ENOMEM, "out of memory for %" PRIu64 "-byte write buffers", chunk);
    }
    pthread_t th;
    int started = 0;
    if (rc == 0) {
        pthread_mutex_init(&p.mu, NULL);
        pthread_cond_init(&p.cv, NULL);
        if (pthread_create(&th, NULL, writer_main, &p) != 0)
            rc = k3_err_set(e, K3_EINTERNAL, "cannot start the writer thread");
        else
            started = 1;
    }
    int threads = o && o->threads > 0 ? o->threads : 0;
    unsigned k = 0;
    for (uint64_t off = 0; rc == 0 && off < size; off += chunk, k = (k + 1) % STW_NBUF) {
        stw_buf *b = &p.buf[k];
        pthread_mutex_lock(&p.mu);
        while (b->state != 0 && !p.failed)
            pthread_cond_wait(&p.cv, &p.mu);
        int failed = p.failed;
        pthread_mutex_unlock(&p.mu);
        if (failed)
            break;
        if (o && o->cancel && *o->cancel) {
            rc = k3_err_set(e, K3_EINTR, "%s: interrupted", w->path);
            break;
        }
        b->file_off = off;
        b->len = size - off < chunk ? size - off : chunk;
        int64_t npieces = (int64_t)((b->len + STW_PIECE - 1) / STW_PIECE);
        if (p.sparse && o->tensor_is_zero && chunk_is_zero(w, o, ctx, off, b->len)) {
            memset(b->nonzero, 0, (size_t)npieces);
            pthread_mutex_lock(&p.mu);
            b->state = 1;
            pthread_cond_broadcast(&p.cv);
            pthread_mutex_unlock(&p.mu);
            continue;
        }
        int frc = 0;
        k3_err ferr = {0};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads ? threads : omp_get_max_threads()) if (npieces > 1)
        for (int64_t s = 0; s < npieces; s++) {
            uint64_t lo = (uint64_t)s * STW_PIECE;
            uint64_t n = b->len - lo < STW_PIECE ? b->len - lo : STW_PIECE;
            k3_err pe = {0};
            int r = fill_piece(w, fill, ctx, p.sparse, b->mem + lo, off + lo, n, &pe);
            if (r < 0) {
#pragma omp critical(k3_stw_fill_err)
                if (!frc) {
                    frc = r;
                    ferr = pe;
                }
                r = 0;
            }
            b->nonzero[s] = (uint8_t)r;
        }
        if (frc) {
            rc = frc;
            if (e)
                *e = ferr;
            break;
        }
        pthread_mutex_lock(&p.mu);
        b->state = 1;
        pthread_cond_broadcast(&p.cv);
        pthread_mutex_unlock(&p.mu);
    }
    if (started) {
        /* wait for the ring to drain, then stop the writer */
        stw_buf *b = &p.buf[k];
        pthread_mutex_lock(&p.mu);
        while (b->state != 0)
            pthread_cond_wait(&p.cv, &p.mu);
        b->state = 2;
        pthread_cond_broadcast(&p.cv);
        pthread_mutex_unlock(&p.mu);
        pthread_join(th, NULL);
        if (rc == 0 && p.failed) {
            rc = p.err.code ? p.err.code : K3_EIO;
            if (e)
                *e = p.err;
        }
        pthread_mutex_destroy(&p.mu);
        pthread_cond_destroy(&p.cv);
    }
    for (int j = 0; j < STW_NBUF; j++) {
        k3_io_huge_free(p.buf[j].mem, chunk);
        free(p.buf[j].nonzero);
    }
    if (p.fd_direct >= 0)
        close(p.fd_direct);
    return rc;
}

int k3_stw_finish(k3_stw *w, k3_err *e)
{
    if (!w->header || w->fd < 0)
        return k3_err_set(e, K3_EARG, "shard writer: finish before begin");
    int fd = w->fd;
    w->fd = -1;
    int rc = k3_io_publish(fd, w->tmp_path, w->path, e);
    if (rc == 0)
        w->finished = 1;
    return rc;
}
