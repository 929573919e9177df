/*
 * outfile.c - one output file of k3-convert or k3-pack: written at planned offsets into
 * "<name>.tmp", hashed (SHA-256 of the whole file, CRC32 of each region) in
 * offset order while it is written, zero blocks left as holes.
 *
 * Invariants: the temporary is created empty and extended to its final size
 * first, so every byte never written reads as zero; bytes are fed to the
 * hashes exactly once and in file order: data written at the hash frontier is
 * hashed from memory, data written ahead of it is read back from the file
 * when the frontier reaches it (never in the usual stream order), gaps
 * between extents are zeros by construction.
 */
#include "k3_outfile.h"

/* The SHA256_* calls are deprecated in OpenSSL 3 but kept: their context is a
 * plain struct, the one way to carry a hash across a process (a checkpoint);
 * EVP contexts cannot be saved. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h> /* crc32_combine64 */

#include "k3_crc.h"
#include "k3_io.h"

#define READBACK (4u << 20)
#define SYNC_EVERY (64ull << 20)

static const uint8_t zeros[65536] __attribute__((aligned(4096)));

/* zlib's crc32(crc, <n zero bytes>, n), in O(log n): with crc32's pre- and
 * post-inversion, appending n zeros multiplies (crc ^ ~0) by x^(8n) and
 * inverts again, which is crc32_combine(crc ^ ~0, ~0, n). Tested against
 * crc32 over real zero buffers. */
uint32_t k3_conv_crc32_zeros(uint32_t crc, uint64_t n)
{
    if (n == 0)
        return crc;
    return (uint32_t)crc32_combine64((uLong)(crc ^ 0xffffffffu), 0xffffffffUL, (z_off64_t)n);
}

/* Bytes [frontier, frontier+n) of the file go to the hashes; buf NULL: they
 * are zeros (SHA-256 still sees every byte; the CRCs skip ahead exactly). */
static void feed(k3_conv_w *w, const uint8_t *buf, uint64_t n)
{
    if (buf) {
        SHA256_Update(&w->sha, buf, (size_t)n);
    } else {
        for (uint64_t left = n; left;) {
            uint64_t take = left > sizeof zeros ? sizeof zeros : left;
            SHA256_Update(&w->sha, zeros, (size_t)take);
            left -= take;
        }
    }
    const k3_conv_ofile *of = w->of;
    uint64_t pos = w->frontier;
    while (n) {
        uint64_t take = n;
        if (w->creg < of->nregions) {
            const k3_conv_ext *r = &of->regions[w->creg];
            if (pos < r->off) {
                take = r->off - pos < n ? r->off - pos : n;
            } else {
                uint64_t end = r->off + r->len;
                take = end - pos < n ? end - pos : n;
                w->crc = buf ? k3_crc32(w->crc, buf, (size_t)take) : k3_conv_crc32_zeros(w->crc, take);
                if (pos + take == end) {
                    of->region_crc[w->creg] = (uint32_t)w->crc;
                    w->creg++;
                    w->crc = 0;
                }
            }
        }
        if (buf)
            buf += take;
        pos += take;
        n -= take;
        if (w->creg >= of->nregions) {
            /* nothing left to CRC: hash only */
            pos += n;
            n = 0;
        }
    }
    w->frontier = pos;
}

static void feed_zeros(k3_conv_w *w, uint64_t n)
{
    feed(w, NULL, n);
}

static int all_zero(const uint8_t *p, uint64_t n)
{
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        if (v)
            return 0;
    }
    for (; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* Whole aligned blocks from aligned memory go through the O_DIRECT fd (no
 * page-cache copy: expert records), everything else through the buffered one. */
static int put(k3_conv_w *w, const uint8_t *buf, uint64_t n, uint64_t off, k3_err *e)
{
    const uint64_t A = K3_IO_DIRECT_ALIGN;
    if (w->dfd >= 0 && (uintptr_t)buf % A == 0 && off % A == 0 && n % A == 0)
        return k3_io_pwrite(w->dfd, buf, n, off, w->tmp, e);
    return k3_io_pwrite(w->fd, buf, n, off, w->tmp, e);
}

/* Write buf at off, leaving 4096-aligned all-zero blocks unwritten (holes). */
static int sparse_write(k3_conv_w *w, const uint8_t *buf, uint64_t n, uint64_t off, k3_err *e)
{
    if (w->dense)
        return put(w, buf, n, off, e);
    uint64_t run_start = 0, run_len = 0;
    uint64_t i = 0;
    while (i < n) {
        uint64_t blk_end = (off + i) / 4096 * 4096 + 4096 - off;
        uint64_t len = (blk_end < n ? blk_end : n) - i;
        if (all_zero(buf + i, len)) {
            if (run_len) {
                int rc = put(w, buf + run_start, run_len, off + run_start, e);
                if (rc)
                    return rc;
                run_len = 0;
            }
            w->holes += len;
        } else {
            if (!run_len)
                run_start = i;
            run_len += len;
        }
        i += len;
    }
    if (run_len)
        return put(w, buf + run_start, run_len, off + run_start, e);
    return 0;
}

int k3_conv_w_open(k3_conv_w *w, const char *dir, k3_conv_ofile *of, int dense, k3_err *e)
{
    memset(w, 0, sizeof *w);
    w->fd = w->dfd = -1;
    w->of = of;
    w->dense = dense;
    int rc = k3_io_path_join(w->path, sizeof w->path, dir, of->name, e);
    if (rc)
        return rc;
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp", w->path);
    w->done = calloc(of->next ? of->next : 1, sizeof *w->done);
    if (!w->done || SHA256_Init(&w->sha) != 1)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", w->tmp);
    w->crc = 0;   /* the CRC of nothing */
    /* the temporary is ours: a stale one from an interrupted run is replaced */
    w->fd = open(w->tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot create", w->tmp);
    if (ftruncate(w->fd, (off_t)of->size) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot extend to %" PRIu64 " bytes", w->tmp, of->size);
    w->dfd = open(w->tmp, O_WRONLY | O_CLOEXEC | O_DIRECT); /* -1 where unsupported: buffered only */
    if (w->dfd >= 0 && !k3_io_direct_fits(w->dfd, 0)) {   /* wants more than 4096-byte alignment */
        close(w->dfd);
        w->dfd = -1;
    }
    return 0;
}

/* Move the frontier over everything already written, reading back extents
 * that were written ahead of it. */
static int advance(k3_conv_w *w, k3_err *e)
{
    const k3_conv_ofile *of = w->of;
    while (w->cur < of->next) {
        const k3_conv_ext *x = &of->ext[w->cur];
        if (w->done[w->cur] == 0)
            return 0;
        if (w->frontier < x->off)
            feed_zeros(w, x->off - w->frontier);
        uint64_t have = w->frontier - x->off;
        while (have < w->done[w->cur]) {
            if (!w->rb && !(w->rb = malloc(READBACK)))
                return k3_err_set(e, K3_ENOMEM, "%s: out of memory", w->tmp);
            uint64_t take = w->done[w->cur] - have;
            take = take > READBACK ? READBACK : take;
            int rc = k3_io_pread(w->fd, w->rb, take, x->off + have, w->tmp, e);
            if (rc)
                return rc;
            feed(w, w->rb, take);
            have += take;
            w->readback += take;
        }
        if (w->done[w->cur] < x->len)
            return 0;
        w->cur++;
    }
    return 0;
}

/* k3_conv_w_write, or with buf NULL k3_conv_w_write_zeros */
static int write_at(k3_conv_w *w, uint32_t ext, uint64_t off_in_ext, const uint8_t *buf, uint64_t n, k3_err *e)
{
    const k3_conv_ofile *of = w->of;
    if (ext >= of->next || off_in_ext != w->done[ext] || n > of->ext[ext].len - off_in_ext)
        return k3_err_set(e, K3_EINTERNAL, "%s: out-of-order write to extent %u at %" PRIu64, w->tmp, ext,
                          off_in_ext);
    const k3_conv_ext *x = &of->ext[ext];
    int rc = 0;
    if (buf) {
        rc = sparse_write(w, buf, n, x->off + off_in_ext, e);
    } else if (w->dense) {
        for (uint64_t d = 0; rc == 0 && d < n; d += sizeof zeros)
            rc = put(w, zeros, n - d < sizeof zeros ? n - d : sizeof zeros, x->off + off_in_ext + d, e);
    } else {
        w->holes += n; /* never written since the temporary was created empty: zeros */
    }
    if (rc)
        return rc;
    w->written += n;
    if (ext == w->cur) {
        if (w->frontier < x->off)
            feed_zeros(w, x->off - w->frontier);
        if (w->frontier == x->off + off_in_ext)
            feed(w, buf, n);
    }
    w->done[ext] += n;
    if (w->written - w->synced >= SYNC_EVERY) {
        /* start write-back early so the final fsync has little left to do */
        sync_file_range(w->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
        w->synced = w->written;
    }
    return advance(w, e);
}

int k3_conv_w_write(k3_conv_w *w, uint32_t ext, uint64_t off_in_ext, const void *buf, uint64_t n, k3_err *e)
{
    if (!buf && n)
        return k3_err_set(e, K3_EINTERNAL, "%s: write of %" PRIu64 " bytes from NULL", w->tmp, n);
    static const uint8_t none;
    return write_at(w, ext, off_in_ext, buf ? buf : &none, n, e);
}

int k3_conv_w_write_zeros(k3_conv_w *w, uint32_t ext, uint64_t off_in_ext, uint64_t n, k3_err *e)
{
    return write_at(w, ext, off_in_ext, NULL, n, e);
}

int k3_conv_w_finish(k3_conv_w *w, uint8_t sha[32], k3_err *e)
{
    int rc = advance(w, e);
    if (rc)
        return rc;
    if (w->cur != w->of->next)
        return k3_err_set(e, K3_EINTERNAL, "%s: extent %u of %u never completed", w->tmp, w->cur, w->of->next);
    if (w->frontier < w->of->size)
        feed_zeros(w, w->of->size - w->frontier);
    if (w->creg != w->of->nregions)
        return k3_err_set(e, K3_EINTERNAL, "%s: region %u of %u not closed", w->tmp, w->creg, w->of->nregions);
    unsigned int len = 0;
    (void)len;
    if (SHA256_Final(sha, &w->sha) != 1)
        return k3_err_set(e, K3_EINTERNAL, "%s: SHA-256 failed", w->tmp);
    return 0;
}

int k3_conv_w_publish(k3_conv_w *w, k3_err *e)
{
    if (w->dfd >= 0) {
        if (fsync(w->dfd) != 0)
            return k3_err_sys(e, K3_EIO, errno, "%s: fsync", w->tmp);
        close(w->dfd);
        w->dfd = -1;
    }
    int fd = w->fd;
    w->fd = -1;
    int rc = k3_io_publish(fd, w->tmp, w->path, e);
    if (rc)
        unlink(w->tmp);
    return rc;
}

void k3_conv_w_close(k3_conv_w *w, int remove_tmp)
{
    if (!w)
        return;
    if (w->dfd >= 0) {
        close(w->dfd);
        w->dfd = -1;
    }
    if (w->fd >= 0) {
        close(w->fd);
        w->fd = -1;
        if (remove_tmp)
            unlink(w->tmp);
    }
    free(w->done);
    w->done = NULL;
    free(w->rb);
    w->rb = NULL;
}

/* ---- checkpoints ------------------------------------------------------------ */

static void hex_bytes(const void *p, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

static int unhex_bytes(const char *s, void *p, size_t n)
{
    uint8_t *b = p;
    if (strlen(s) != 2 * n)
        return -1;
    for (size_t i = 0; i < 2 * n; i++) {
        int v = s[i] >= '0' && s[i] <= '9' ? s[i] - '0' : s[i] >= 'a' && s[i] <= 'f' ? s[i] - 'a' + 10 : -1;
        if (v < 0)
            return -1;
        if (i % 2 == 0)
            b[i / 2] = (uint8_t)(v << 4);
        else
            b[i / 2] |= (uint8_t)v;
    }
    return 0;
}

int k3_conv_w_checkpoint(k3_conv_w *w, uint32_t next, cJSON **out, k3_err *e)
{
    *out = NULL;
    const k3_conv_ofile *of = w->of;
    if (next == 0 || next > of->next || w->cur != next || w->done[next - 1] != of->ext[next - 1].len ||
        w->frontier != of->ext[next - 1].off + of->ext[next - 1].len)
        return 0;
    if ((w->dfd >= 0 && fsync(w->dfd) != 0) || fsync(w->fd) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: fsync", w->tmp);
    w->synced = w->written;
    char shx[2 * sizeof(SHA256_CTX) + 1], h[9];
    hex_bytes(&w->sha, sizeof w->sha, shx);
    cJSON *o = cJSON_CreateObject();
    cJSON *rc = cJSON_CreateArray();
    for (uint32_t i = 0; rc && i < w->creg; i++) {
        snprintf(h, sizeof h, "%08x", of->region_crc[i]);
        cJSON_AddItemToArray(rc, cJSON_CreateString(h));
    }
    snprintf(h, sizeof h, "%08x", w->crc);
    if (!o || !rc || !cJSON_AddNumberToObject(o, "next", next) || !cJSON_AddNumberToObject(o, "size", (double)of->size) ||
        !cJSON_AddNumberToObject(o, "frontier", (double)w->frontier) ||
        !cJSON_AddNumberToObject(o, "creg", w->creg) || !cJSON_AddStringToObject(o, "crc", h) ||
        !cJSON_AddNumberToObject(o, "written", (double)w->written) ||
        !cJSON_AddNumberToObject(o, "holes", (double)w->holes) || !cJSON_AddStringToObject(o, "sha_state", shx)) {
        cJSON_Delete(o);
        cJSON_Delete(rc);
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", w->tmp);
    }
    cJSON_AddItemToObject(o, "region_crcs", rc);
    *out = o;
    return 0;
}

static int get_u64(const cJSON *o, const char *k, uint64_t *v)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 9007199254740992.0 ||
        x->valuedouble != (double)(uint64_t)x->valuedouble)
        return -1;
    *v = (uint64_t)x->valuedouble;
    return 0;
}

static int get_crc(const cJSON *x, uint32_t *v)
{
    char *end;
    if (!cJSON_IsString(x) || strlen(x->valuestring) != 8)
        return -1;
    *v = (uint32_t)strtoul(x->valuestring, &end, 16);
    return *end ? -1 : 0;
}

int k3_conv_w_resume(k3_conv_w *w, const char *dir, k3_conv_ofile *of, int dense, const cJSON *state,
                     uint32_t *next, k3_err *e)
{
    uint64_t nx, size, frontier, creg, written, holes;
    uint32_t crc;
    const cJSON *shx = cJSON_GetObjectItemCaseSensitive(state, "sha_state");
    const cJSON *rcs = cJSON_GetObjectItemCaseSensitive(state, "region_crcs");
    SHA256_CTX sha;
    int fits = state && !get_u64(state, "next", &nx) && !get_u64(state, "size", &size) &&
               !get_u64(state, "frontier", &frontier) && !get_u64(state, "creg", &creg) &&
               !get_u64(state, "written", &written) && !get_u64(state, "holes", &holes) &&
               !get_crc(cJSON_GetObjectItemCaseSensitive(state, "crc"), &crc) && cJSON_IsString(shx) &&
               !unhex_bytes(shx->valuestring, &sha, sizeof sha) && cJSON_IsArray(rcs) && size == of->size &&
               nx >= 1 && nx <= of->next && frontier == of->ext[nx - 1].off + of->ext[nx - 1].len &&
               creg <= of->nregions && (uint64_t)cJSON_GetArraySize(rcs) == creg;
    char tmp[4200];
    struct stat st;
    k3_err ignore = {0};
    fits = fits && k3_io_path_join(tmp, sizeof tmp, dir, of->name, &ignore) == 0 &&
           snprintf(tmp + strlen(tmp), sizeof tmp - strlen(tmp), ".tmp") > 0 && stat(tmp, &st) == 0 &&
           S_ISREG(st.st_mode) && (uint64_t)st.st_size == of->size;
    if (!fits)
        return k3_conv_w_open(w, dir, of, dense, e);
    memset(w, 0, sizeof *w);
    w->fd = w->dfd = -1;
    w->of = of;
    w->dense = dense;
    int rc = k3_io_path_join(w->path, sizeof w->path, dir, of->name, e);
    if (rc)
        return rc;
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp", w->path);
    w->done = calloc(of->next ? of->next : 1, sizeof *w->done);
    if (!w->done)
        return k3_err_set(e, K3_ENOMEM, "%s: out of memory", w->tmp);
    uint32_t i = 0;
    for (const cJSON *it = rcs->child; it; it = it->next, i++)
        if (get_crc(it, &of->region_crc[i]))
            return k3_conv_w_open(w, dir, of, dense, e);
    w->fd = open(w->tmp, O_RDWR | O_CLOEXEC);
    if (w->fd < 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot open", w->tmp);
    /* the kept bytes end at the frontier; whatever the killed run wrote
     * after it is zeroed (those extents are written again, and their holes
     * must read as zeros) */
    if (ftruncate(w->fd, (off_t)frontier) != 0 || ftruncate(w->fd, (off_t)of->size) != 0)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot cut back to %" PRIu64 " bytes", w->tmp, frontier);
    w->dfd = open(w->tmp, O_WRONLY | O_CLOEXEC | O_DIRECT);
    w->sha = sha;
    w->crc = crc;
    w->creg = (uint32_t)creg;
    w->frontier = frontier;
    w->cur = (uint32_t)nx;
    for (uint32_t k = 0; k < nx; k++)
        w->done[k] = of->ext[k].len;
    w->written = w->synced = written;
    w->holes = holes;
    *next = (uint32_t)nx;
    return 1;
}
