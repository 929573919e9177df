/*
 * probe.c - what this machine reads and computes, and the speed a memory plan
 * should give (probe.h).
 *
 * Reads: the model's own trunk files, sequentially in 2 MiB requests (up to
 * 1 GiB), and its expert files, one record at a time at random places (up to
 * 512 MiB), four requests in flight, with O_DIRECT so that the page cache
 * neither helps nor hides the device. Kernels: a bf16 and an MXFP4 product of
 * 8192 (bf16) and 16384 (MXFP4) rows by the model's hidden size, for T = 1
 * ... 256 vectors (the longest pass a budget takes), with the threads the
 * run will use, over copies of the matrix filling 192 MiB or more, so that
 * the weights come from memory, as streamed weights do (about 250 MB while
 * it runs).
 *
 * The prediction adds, per pass over the weights: the plan's streamed trunk
 * bytes at the trunk rate and the expert records it misses at the expert
 * rate (reads), and every weight byte the pass multiplies at the kernels'
 * seconds per byte for its row count plus the CRC of every byte it reads
 * (compute; the CRC's CPU time over the cores when the run's threads take
 * them all, the products then wait for it; timed over the same pool) and what
 * each layer computes besides its products (probe_rest.c). A decode pass is one id, the
 * cache hitting what the prompt's passes leave in it, weighted by the
 * prompt's routes (k3_probe_prompt_experts); without routes, in proportion to its share
 * of all records. A prompt is the
 * given ids in passes of the chunk: the trunk once per pass (the head, which
 * only the last pass asks for, once, for one row), and per pass the union of
 * the experts its ids route to, each multiplied for the rows routed to it.
 * That union comes from the model's own routers applied to the prompt's
 * embeddings (probe_route.c), through an LRU of the plan's slots (per MoE
 * layer) that starts empty: the first pass reads every record it needs.
 * Without routes, independent ones: E (1 - (1 - k/E)^C) per MoE layer. The
 * bound is the largest of reads, memory (the bytes multiplied at one row's
 * speed) and compute (what the products took beyond that).
 */
#include "probe.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "k3_crc.h"
#include "k3_engine.h"
#include "k3_io.h"
#include "k3_kern.h"

#define PROBE_CHUNK (2u << 20)
#define PROBE_TRUNK_MAX (1ull << 30)
#define PROBE_EXPERT_MAX (512ull << 20)
#define PROBE_ROWS 8192u           /* bf16: 8192 x hidden (117 MB at K3 width); MXFP4 twice the rows */
#define PROBE_POOL (192ull << 20)

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct pfile {
    int fd;
    uint64_t size;
} pfile;

/* The files of dir ending in ext, opened for reading (O_DIRECT if it can). */
static int open_files(const char *dir, const char *ext, pfile **out, uint32_t *n, int *direct, k3_err *e)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d)
        return k3_err_sys(e, K3_EIO, errno, "%s: cannot list", dir);
    int rc = 0;
    uint32_t cap = 0;
    for (struct dirent *de; rc == 0 && (de = readdir(d));) {
        const char *x = strrchr(de->d_name, '.');
        if (!x || strcmp(x, ext))
            continue;
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        int fd = open(path, O_RDONLY | O_DIRECT);
        if (fd < 0 && errno == EINVAL) {   /* a filesystem without O_DIRECT: buffered, cache dropped */
            fd = open(path, O_RDONLY);
            *direct = 0;
            if (fd >= 0)
                posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        }
        struct stat st;
        if (fd < 0 || fstat(fd, &st) < 0) {
            rc = k3_err_sys(e, K3_EIO, errno, "%s: cannot open", path);
            if (fd >= 0)
                close(fd);
            break;
        }
        if (*n == cap) {
            cap = cap ? 2 * cap : 8;
            pfile *t = realloc(*out, cap * sizeof *t);
            if (!t) {
                close(fd);
                rc = k3_err_set(e, K3_ENOMEM, "out of memory probing %s", dir);
                break;
            }
            *out = t;
        }
        (*out)[(*n)++] = (pfile){fd, (uint64_t)st.st_size};
    }
    closedir(d);
    return rc;
}

static void close_files(pfile *f, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        close(f[i].fd);
    free(f);
}

typedef struct preq {
    int fd;
    uint64_t off, len;
} preq;

typedef struct rjob {
    const preq *q;
    uint32_t n, tid;
    uint8_t *buf;
    uint64_t bytes;
    int err;
} rjob;

static void *read_main(void *arg)
{
    rjob *j = arg;
    for (uint32_t i = j->tid; i < j->n && !j->err; i += 4) {
        ssize_t r = pread(j->q[i].fd, j->buf, j->q[i].len, (off_t)j->q[i].off);
        if (r < 0)
            j->err = errno;
        else
            j->bytes += (uint64_t)r;
    }
    return NULL;
}

/* Read every request, four in flight (a thread each); bytes/s, or -1 with e set. */
static double read_all(const preq *q, uint32_t n, uint64_t buf_bytes, k3_err *e)
{
    rjob j[4];
    pthread_t th[4];
    int started = 0, err = 0;
    memset(j, 0, sizeof j);
    /* huge pages, as the runtime's read arenas: a DMA into 4 KiB pages costs
       the kernel a page walk per page */
    for (int i = 0; i < 4; i++)
        if (!(j[i].buf = k3_io_huge_alloc(buf_bytes))) {
            for (int k = 0; k < i; k++)
                k3_io_huge_free(j[k].buf, buf_bytes);
            k3_err_set(e, K3_ENOMEM, "out of memory for the read probe");
            return -1;
        }
    const double t0 = k3_now_s();
    for (int i = 0; i < 4; i++) {
        j[i].q = q, j[i].n = n, j[i].tid = (uint32_t)i;
        if (pthread_create(&th[i], NULL, read_main, &j[i]) != 0)
            break;
        started++;
    }
    uint64_t total = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        total += j[i].bytes;
        err = err ? err : j[i].err;
    }
    const double dt = k3_now_s() - t0;
    for (int i = 0; i < 4; i++)
        k3_io_huge_free(j[i].buf, buf_bytes);
    if (started < 4) {
        k3_err_set(e, K3_ENOMEM, "cannot start the read probe's threads");
        return -1;
    }
    if (err) {
        k3_err_sys(e, K3_EIO, err, "the read probe failed");
        return -1;
    }
    return dt > 0 ? (double)total / dt : 0;
}

static int probe_reads(const char *dir, const k3_cfg *c, k3_probe *p, k3_err *e)
{
    pfile *tf = NULL, *xf = NULL;
    uint32_t nt = 0, nx = 0;
    p->direct = 1;
    int rc = open_files(dir, ".k3t", &tf, &nt, &p->direct, e);
    if (rc == 0)
        rc = open_files(dir, ".k3e", &xf, &nx, &p->direct, e);
    preq *q = NULL;
    uint64_t tbytes = 0, xbytes = 0;
    for (uint32_t i = 0; i < nt; i++)
        tbytes += tf[i].size;
    for (uint32_t i = 0; i < nx; i++)
        xbytes += xf[i].size;
    if (rc == 0 && (!nt || !tbytes))
        rc = k3_err_set(e, K3_ENOENT, "%s: no trunk files (.k3t) to probe: --probe needs a packed model", dir);
    const uint32_t n_moe = c->num_hidden_layers > c->first_k_dense_replace
                               ? c->num_hidden_layers - c->first_k_dense_replace : 0;
    const uint64_t recs = (uint64_t)n_moe * c->num_experts;
    p->rec_bytes = recs && xbytes ? xbytes / recs : 0;
    /* the trunk: sequential 2 MiB requests, up to 1 GiB */
    uint32_t n = 0;
    if (rc == 0) {
        const uint32_t max = (uint32_t)(PROBE_TRUNK_MAX / PROBE_CHUNK);
        q = malloc((uint64_t)max * sizeof *q);
        if (!q)
            rc = k3_err_set(e, K3_ENOMEM, "out of memory for the read probe");
        for (uint32_t f = 0; rc == 0 && f < nt && n < max; f++)
            for (uint64_t off = 0; off + PROBE_CHUNK <= tf[f].size && n < max; off += PROBE_CHUNK)
                q[n++] = (preq){tf[f].fd, off, PROBE_CHUNK};
        if (rc == 0 && n == 0)   /* trunk files smaller than a request: read them whole */
            for (uint32_t f = 0; f < nt && n < max; f++)
                q[n++] = (preq){tf[f].fd, 0, (tf[f].size + 4095) & ~4095ull};
    }
    if (rc == 0) {
        uint64_t big = 0;
        for (uint32_t i = 0; i < n; i++)
            big = q[i].len > big ? q[i].len : big;
        double r = read_all(q, n, big, e);
        rc = r < 0 ? K3_EIO : 0;
        p->trunk_bps = r;
        for (uint32_t i = 0; i < n; i++)
            p->trunk_read += q[i].len;
    }
    /* the experts: whole records at random places, up to 512 MiB */
    if (rc == 0 && nx && p->rec_bytes >= 4096) {
        const uint64_t len = (p->rec_bytes + 4095) & ~4095ull;
        uint64_t cnt = PROBE_EXPERT_MAX / len;
        cnt = cnt < 8 ? 8 : cnt > 4096 ? 4096 : cnt;
        preq *x = realloc(q, cnt * sizeof *x);
        if (!x)
            rc = k3_err_set(e, K3_ENOMEM, "out of memory for the read probe");
        else {
            q = x;
            uint64_t s = 0x6b3;
            n = 0;
            for (uint64_t i = 0; i < cnt; i++) {
                const pfile *f = &xf[mix(&s) % nx];
                if (f->size < len)
                    continue;
                uint64_t off = (mix(&s) % (f->size - len + 1)) & ~4095ull;
                q[n++] = (preq){f->fd, off, len};
            }
            double r = n ? read_all(q, n, len, e) : 0;
            rc = r < 0 ? K3_EIO : 0;
            p->expert_bps = r;
            p->expert_read = (uint64_t)n * len;
        }
    }
    if (p->expert_bps <= 0)
        p->expert_bps = p->trunk_bps;   /* no experts to read: the trunk's rate stands in */
    free(q);
    close_files(tf, nt);
    close_files(xf, nx);
    return rc;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Seconds per weight byte of a product of T rows: median of 5 calls (3 from
 * 128 rows on, each of which takes a tenth of a second or more), each on the
 * next copy of the matrix. */
static double time_product(int mx, const uint8_t *pool, uint64_t bytes, uint32_t copies, uint64_t rows,
                           uint64_t cols, const float *X, uint32_t T, float *Y)
{
    double t[5];
    const int n = T >= 128 ? 3 : 5;
    for (int r = -1; r < n; r++) {   /* one call first: threads up, pages in */
        const uint8_t *w = pool + (uint64_t)((r + 1) % copies) * bytes;
        double t0 = k3_now_s();
        if (mx)
            k3_gemm_mx(w, w + rows * cols / 2, rows, cols, X, T, Y);
        else
            k3_gemm_bf16((const uint16_t *)w, rows, cols, X, T, Y);
        if (r >= 0)
            t[r] = k3_now_s() - t0;
    }
    qsort(t, (size_t)n, sizeof *t, cmp_d);
    return t[n / 2] / (double)bytes;
}

static volatile uint32_t crc_sink;   /* keeps the timed CRC */

static int probe_kernels(const k3_cfg *c, k3_probe *p, k3_err *e)
{
    const uint64_t rows = PROBE_ROWS, mrows = 2 * PROBE_ROWS, cols = c->hidden_size >= 32 ? c->hidden_size / 32 * 32 : 32;
    const uint64_t bb = rows * cols * 2, mb = mrows * cols / 2 + mrows * cols / 32;
    const uint32_t cb = (uint32_t)(PROBE_POOL / bb + 1), cm = (uint32_t)(PROBE_POOL / mb + 1);
    uint8_t *pool = malloc(PROBE_POOL + bb + mb);
    float *X = malloc(256 * cols * sizeof *X), *Y = malloc(256 * mrows * sizeof *Y);
    if (!pool || !X || !Y) {
        free(pool), free(X), free(Y);
        return k3_err_set(e, K3_ENOMEM, "out of memory for the kernel probe");
    }
    uint64_t s = 0x51;
    for (uint64_t i = 0; i < 256 * cols; i++)
        X[i] = (float)((int64_t)(mix(&s) >> 40) - (1 << 23)) / (float)(1 << 23);
    /* bf16 weights in [-1, 1): sign, exponent 120..126, random mantissa */
    for (uint64_t i = 0; i + 1 < (uint64_t)cb * bb; i += 2) {
        uint64_t r = mix(&s);
        uint16_t v = (uint16_t)((r & 0x807f) | (uint16_t)((120 + r % 7) << 7));
        memcpy(pool + i, &v, 2);
    }
    for (int i = 0; i < K3_PROBE_NT; i++)
        p->bf16_s[i] = time_product(0, pool, bb, cb, rows, cols, X, 1u << i, Y);
    /* the CRC every byte read gets, over the pool (most of it not in any
     * cache, as bytes a read has just put in memory): median of 3 */
    double ct[3];
    for (int r = 0; r < 3; r++) {
        double t0 = k3_now_s();
        crc_sink = k3_crc32(0, pool, (size_t)cb * bb);
        ct[r] = k3_now_s() - t0;
    }
    qsort(ct, 3, sizeof *ct, cmp_d);
    p->crc_s = ct[1] / (double)((uint64_t)cb * bb);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    p->crc_share = cores > 0 && omp_get_max_threads() >= cores ? 1.0 / (double)cores : 0;
    /* MXFP4: random nibbles, scale bytes 120..126 (no denormal, no 255) */
    for (uint32_t k = 0; k < cm; k++) {
        uint8_t *w = pool + (uint64_t)k * mb;
        for (uint64_t i = 0; i < mrows * cols / 2; i++)
            w[i] = (uint8_t)mix(&s);
        for (uint64_t i = 0; i < mrows * cols / 32; i++)
            w[mrows * cols / 2 + i] = (uint8_t)(120 + mix(&s) % 7);
    }
    for (int i = 0; i < K3_PROBE_NT; i++)
        p->mx_s[i] = time_product(1, pool, mb, cm, mrows, cols, X, 1u << i, Y);
    free(pool);
    free(X);
    free(Y);
    return 0;
}

int k3_probe_run(const char *dir, const k3_cfg *c, k3_probe *p, k3_err *e)
{
    memset(p, 0, sizeof *p);
    const double t0 = k3_now_s();
    int rc = probe_reads(dir, c, p, e);
    if (rc == 0)
        rc = probe_kernels(c, p, e);
    p->seconds = k3_now_s() - t0;
    return rc;
}

/* Seconds per byte at T rows, between the measured powers of two. */
static double per_byte(const double *s, double T)
{
    if (T <= 1)
        return s[0];
    double l = log2(T);
    if (l >= K3_PROBE_NT - 1)
        return s[K3_PROBE_NT - 1] * T / (double)(1u << (K3_PROBE_NT - 1));   /* beyond: the time grows with T */
    int i = (int)l;
    double f = l - i;
    return s[i] * pow(s[i + 1] / s[i], f);
}

const char *k3_probe_bound_name(k3_probe_bound b)
{
    return b == K3_PROBE_DISK ? "disk" : b == K3_PROBE_MEMORY ? "memory" : "compute";
}

static k3_probe_bound bound_of(double io, double mem, double compute)
{
    const double arith = compute - mem;   /* what the products took beyond streaming their weights */
    if (io >= mem && io >= arith)
        return K3_PROBE_DISK;
    return mem >= arith ? K3_PROBE_MEMORY : K3_PROBE_COMPUTE;
}

/* One sampled layer's passes through an LRU of cap records that starts
 * empty, requests in the model's order (each pass's experts ascending), so
 * an expert the last pass left behind is a hit only if this pass's earlier
 * misses have not evicted it yet. stamp[x]: when x was last used (0: not
 * held). */
static void layer_passes(const k3_probe *p, const uint32_t *sel, uint32_t n, uint32_t K, uint32_t NE, uint32_t chunk,
                         uint32_t cap, uint32_t *rows, uint64_t *stamp, k3_probe_xcost *o)
{
    uint64_t clock = 0;
    uint32_t held = 0;
    memset(stamp, 0, NE * sizeof *stamp);
    for (uint32_t b = 0; b < n; b += chunk) {
        const uint32_t C = n - b < chunk ? n - b : chunk;
        memset(rows, 0, NE * sizeof *rows);
        for (uint64_t i = (uint64_t)b * K; i < (uint64_t)(b + C) * K; i++)
            rows[sel[i]]++;
        for (uint32_t x = 0; x < NE; x++) {
            if (!rows[x])
                continue;
            o->records += 1;
            o->compute_s += (double)p->rec_bytes * per_byte(p->mx_s, rows[x]);
            o->mem_s += (double)p->rec_bytes * p->mx_s[0];
            if (!stamp[x]) {
                o->misses += 1;
                if (!cap)
                    continue;
                if (held == cap) {   /* evict the least recently used */
                    uint32_t v = UINT32_MAX;
                    for (uint32_t y = 0; y < NE; y++)
                        if (stamp[y] && (v == UINT32_MAX || stamp[y] < stamp[v]))
                            v = y;
                    stamp[v] = 0;
                    held--;
                }
                held++;
            }
            stamp[x] = ++clock;
        }
    }
}

void k3_probe_prompt_experts(const k3_probe *p, const k3_cfg *c, const k3_probe_routes *r, uint32_t n,
                             uint32_t chunk, uint32_t slots, k3_probe_xcost *out)
{
    memset(out, 0, sizeof *out);
    out->decode_hit = -1;
    const uint32_t n_moe = c->num_hidden_layers > c->first_k_dense_replace
                               ? c->num_hidden_layers - c->first_k_dense_replace : 0;
    const uint32_t NE = c->num_experts, K = c->num_experts_per_token;
    chunk = chunk ? chunk : 1;
    out->passes = n ? (n + chunk - 1) / chunk : 0;
    if (!n_moe || !NE || !K || !n)
        return;
    const double all = (double)n_moe * NE;
    uint32_t *rows = NULL;
    uint64_t *stamp = NULL;
    if (r && r->n_layers && r->n_ids == n && r->num_experts == NE && r->top_k == K &&
        (rows = malloc(NE * sizeof *rows)) && (stamp = malloc(NE * sizeof *stamp))) {
        const uint32_t cap = slots / n_moe < NE ? slots / n_moe : NE;
        const double N = (double)n * K;
        out->decode_hit = 0;
        for (uint32_t l = 0; l < r->n_layers; l++) {
            const uint32_t *sel = r->sel + (uint64_t)l * n * K;
            layer_passes(p, sel, n, K, NE, chunk, cap, rows, stamp, out);
            /* decode's hits: what the passes leave (stamp), weighted by the
               prompt's routes to it (rows: now the counts of all of them) */
            memset(rows, 0, NE * sizeof *rows);
            for (uint64_t i = 0; i < (uint64_t)n * K; i++)
                rows[sel[i]]++;
            double once = 0, held = 0;
            for (uint32_t x = 0; x < NE; x++) {
                once += rows[x] == 1;
                held += stamp[x] ? rows[x] : 0;
            }
            out->decode_hit += (1 - once / N) * held / N;
        }
        out->decode_hit /= r->n_layers;
        const double scale = (double)n_moe / r->n_layers;
        out->records *= scale, out->misses *= scale, out->compute_s *= scale, out->mem_s *= scale;
    } else {
        const double hit = fmin(1.0, slots / all);
        for (uint32_t b = 0; b < n; b += chunk) {
            const double C = n - b < chunk ? n - b : chunk;
            const double u = NE * (1 - pow(1 - (double)K / NE, C));
            out->records += n_moe * u;
            out->misses += n_moe * u * (b ? 1 - hit : 1);   /* the first pass finds the cache empty */
            out->compute_s += n_moe * u * (double)p->rec_bytes * per_byte(p->mx_s, C * K / u);
            out->mem_s += n_moe * u * (double)p->rec_bytes * p->mx_s[0];
        }
    }
    free(rows);
    free(stamp);
}

/* The rest (k3_probe_rest) of every layer of c in one pass of C rows at
 * positions p0 ..: 0 when the probe has none for this chunk. */
static double rest_pass(const k3_probe *p, const k3_cfg *c, uint32_t chunk, uint32_t C, uint32_t p0)
{
    const k3_probe_rest *r = NULL;
    for (uint32_t k = 0; k < p->n_rest && !r; k++)
        if (p->rest[k].chunk == chunk)
            r = &p->rest[k];
    if (!r)
        return 0;
    const double S = (double)C * p0 + (double)C * (C + 1) / 2;
    double t = 0;
    for (uint32_t L = 0; L < c->num_hidden_layers; L++) {
        const int mla = k3_cfg_layer_is_mla(c, L) != 0;
        t += C * r->a[mla] + S * r->b[mla];
    }
    return t;
}

void k3_probe_predict(const k3_probe *p, const k3_cfg *c, const k3_stream_plan *plan, uint32_t chunk,
                      uint32_t n_ids, const k3_probe_routes *r, k3_probe_pred *out)
{
    memset(out, 0, sizeof *out);
    const double n_moe = c->num_hidden_layers > c->first_k_dense_replace
                             ? c->num_hidden_layers - c->first_k_dense_replace : 0;
    const double E = c->num_experts, k = c->num_experts_per_token, rec = (double)p->rec_bytes;
    const double all = n_moe * E;
    chunk = chunk ? chunk : 1;
    const uint32_t n = n_ids ? n_ids : chunk;
    k3_probe_xcost x;
    k3_probe_prompt_experts(p, c, r, n, chunk, plan->expert_slots, &x);
    /* decode: one id, the cache hitting as the prompt's routes leave it, or
     * without routes (or prompt) in proportion to its share of all records */
    double hit = n_ids ? x.decode_hit : -1;
    if (hit < 0)
        hit = all > 0 ? fmin(1.0, plan->expert_slots / all) : 1;
    out->decode_hit = hit;
    const double trunk_read = (double)plan->trunk_streamed / p->trunk_bps;
    /* every byte read is CRC'd on the cores the products run on */
    const double crc = p->crc_s * p->crc_share, trunk_crc = p->no_trunk_crc ? 0 : crc;
    out->decode_io = trunk_read + (p->expert_bps > 0 ? n_moe * k * (1 - hit) * rec / p->expert_bps : 0);
    const double dmem = (double)plan->trunk_total * per_byte(p->bf16_s, 1) + n_moe * k * rec * per_byte(p->mx_s, 1);
    out->decode_rest = rest_pass(p, c, 1, 1, n_ids);
    out->decode_compute = dmem + (double)plan->trunk_streamed * trunk_crc + n_moe * k * (1 - hit) * rec * crc +
                          out->decode_rest;
    out->decode_s = out->decode_io + out->decode_compute;
    out->decode_bound = bound_of(out->decode_io, dmem, out->decode_compute);
    /* prompt: passes of `chunk` ids; the trunk read and multiplied once per
       pass, the head (its rows only) in the last pass alone, which alone asks
       for logits */
    uint64_t gb[K3_CFG_MAX_LAYERS + 1], row, stride;
    k3_stream_cfg_groups(c, gb, &row, &stride);
    const uint32_t hg = c->num_hidden_layers;
    const double head = fmin((double)gb[hg], (double)plan->trunk_total);
    const double head_streamed = hg < plan->ngroups && !plan->pinned[hg] ? fmin(head, (double)plan->trunk_streamed) : 0;
    double io = 0, comp = 0, mem = 0, rest = 0;
    for (uint32_t b = 0; b < n; b += chunk) {
        const uint32_t C = n - b < chunk ? n - b : chunk;
        const int last = b + C >= n;
        io += ((double)plan->trunk_streamed - (last ? 0 : head_streamed)) / p->trunk_bps;
        comp += ((double)plan->trunk_total - head) * per_byte(p->bf16_s, C) + (last ? head * p->bf16_s[0] : 0) +
                ((double)plan->trunk_streamed - (last ? 0 : head_streamed)) * trunk_crc;
        mem += ((double)plan->trunk_total - head) * p->bf16_s[0] + (last ? head * p->bf16_s[0] : 0);
        rest += rest_pass(p, c, chunk, C, b);
    }
    comp += rest;
    io += p->expert_bps > 0 ? x.misses * rec / p->expert_bps : 0;
    comp += x.compute_s + x.misses * rec * crc;
    mem += x.mem_s;
    out->passes = x.passes;
    out->experts_per_pass = x.passes ? x.records / x.passes : 0;
    out->expert_misses = x.misses;
    out->prompt_io = io / n;
    out->prompt_compute = comp / n;
    out->prompt_mem = mem / n;
    out->prompt_rest = rest / n;
    out->prompt_s = out->prompt_io + out->prompt_compute;
    out->prompt_bound = bound_of(out->prompt_io, out->prompt_mem, out->prompt_compute);
}

static void print_row(FILE *f, const char *pre, const char *name, const k3_probe *p, const k3_cfg *c,
                      const k3_stream_plan *pl, uint32_t chunk, uint32_t n_ids, const k3_probe_routes *r)
{
    k3_probe_pred q;
    k3_probe_predict(p, c, pl, chunk, n_ids, r, &q);
    fprintf(f, "%s  %-20s %9.2f GiB %5u %6.0f %10.3f %-8s %10.3f %-8s %5.1f%%\n", pre, name,
            pl->budget / 1073741824.0, chunk, q.experts_per_pass, q.prompt_s, k3_probe_bound_name(q.prompt_bound),
            q.decode_s, k3_probe_bound_name(q.decode_bound), 100 * q.decode_hit);
}

int k3_probe_print(const char *dir, const k3_engine_opts *eo, const k3_engine_size *sz, const k3_stream_plan *given,
                   const char *given_ram, uint32_t given_chunk, const uint32_t *ids, uint32_t n_ids, FILE *f,
                   const char *pre, k3_err *e)
{
    /* the plans first: each measures the process's memory, which the probe's
       buffers would inflate */
    static const char *const ram[] = {"floor", "4G", "16G", "64G", "256G", "resident"};
    enum { NB = sizeof ram / sizeof *ram };
    k3_stream_plan plans[NB];
    uint32_t chunks[NB];
    int ok[NB] = {0};
    k3_engine_opts o = *eo;
    o.trace_path = NULL;
    k3_cfg c;
    int have_cfg = 0;
    for (uint32_t i = 0; i < NB; i++) {
        k3_engine *b = NULL;
        const k3_stream_plan *pl = NULL;
        k3_err be = {0};
        o.ram = ram[i];
        if (k3_engine_open(&b, dir, &o, &be) == 0 && k3_engine_plan(b, sz, &pl, &be) == 0 && pl) {
            k3_engine_info inf;
            k3_engine_get_info(b, &inf);
            plans[i] = *pl;
            chunks[i] = inf.max_chunk;
            ok[i] = 1;
            if (!have_cfg) {
                c = *k3_engine_cfg(b);
                have_cfg = 1;
            }
        }
        k3_engine_close(b);   /* a budget this machine or model cannot take is left out */
    }
    if (!have_cfg)
        return k3_err_set(e, K3_EBUDGET, "%s: no budget this machine can hold to predict", dir);
    k3_probe p;
    int rc = k3_probe_run(dir, &c, &p, e);
    if (rc < 0)
        return rc;
    p.no_trunk_crc = !eo->trunk_crc;
    uint32_t cl[NB + 2], ncl = 0;
    cl[ncl++] = 1;   /* decode */
    if (given)
        cl[ncl++] = given_chunk;
    for (uint32_t i = 0; i < NB; i++)
        if (ok[i])
            cl[ncl++] = chunks[i];
    if ((rc = k3_probe_rest_run(&c, cl, ncl, &p, e)) < 0)
        return rc;
    k3_probe_routes r;
    if (ids && n_ids && (rc = k3_probe_routes_read(dir, ids, n_ids, &r, e)) < 0)
        return rc;
    if (!ids || !n_ids)
        memset(&r, 0, sizeof r);
    const double G = 1e9;
    const uint64_t len = (p.rec_bytes + 4095) & ~4095ull;
    fprintf(f, "%sprobe (%.1f s): reads %.2f GB/s trunk (%llu MiB in 2 MiB requests), %.2f GB/s experts (%llu "
               "records of %.3f MiB at random places)%s\n",
            pre, p.seconds, p.trunk_bps / G, (unsigned long long)(p.trunk_read >> 20), p.expert_bps / G,
            (unsigned long long)(len ? p.expert_read / len : 0), p.rec_bytes / 1048576.0,
            p.direct ? ", O_DIRECT" : ", buffered (no O_DIRECT here)");
    fprintf(f, "%sprobe: products of 8192 (bf16) and 16384 (MXFP4) rows, %d threads: bf16 %.1f GB/s of weights at T = 1, %.1f / %.1f GFLOP/s at "
               "T = 64 / 256; MXFP4 %.1f GB/s at T = 1, %.1f / %.1f GFLOP/s at T = 64 / 256\n",
            pre, omp_get_max_threads(), 1 / p.bf16_s[0] / G, 64.0 / p.bf16_s[6] / G, 256.0 / p.bf16_s[8] / G,
            1 / p.mx_s[0] / G, 2.0 * 64 * 32 / 17 / p.mx_s[6] / G, 2.0 * 256 * 32 / 17 / p.mx_s[8] / G);
    fprintf(f, "%sprobe: CRC of bytes read %.1f GB/s on one core; %s\n", pre, 1 / p.crc_s / G,
            p.crc_share > 0 ? "the run's threads take every core, so the products wait for it"
                            : "a core the run's threads leave free does it");
    for (uint32_t k = 0; k < p.n_rest; k++) {
        const k3_probe_rest *q = &p.rest[k];
        if (k == 0)
            fprintf(f, "%sprobe: besides the products, a layer computes (attention, activations, norms, routing; "
                       "timed on one-layer models in memory, %.1f s), per row:\n",
                    pre, p.rest_seconds);
        fprintf(f, "%s  in passes of %4u%s: KDA %.3f ms, MLA %.3f ms + %.3f us per position attended\n", pre,
                q->chunk, q->chunk > 64 ? " (timed in passes of 64)" : "", q->a[0] * 1e3, q->a[1] * 1e3, q->b[1] * 1e6);
    }
    if (r.n_layers) {
        uint32_t *seen = calloc(c.num_experts, sizeof *seen);
        double u = 0;   /* distinct experts over the whole prompt, per sampled layer */
        for (uint32_t l = 0; seen && l < r.n_layers; l++) {
            for (uint64_t i = 0; i < (uint64_t)n_ids * r.top_k; i++)
                u += !seen[r.sel[(uint64_t)l * n_ids * r.top_k + i]]++;
            memset(seen, 0, c.num_experts * sizeof *seen);
        }
        free(seen);
        const double ind = c.num_experts * (1 - pow(1 - (double)r.top_k / c.num_experts, n_ids));
        fprintf(f, "%sprobe: routes of the %u prompt ids by the routers of %u of %u MoE layers (on their normalised "
                   "embeddings, %.2f s): %.0f distinct experts per layer (independent routes: %.0f)\n",
                pre, n_ids, r.n_layers, r.n_moe, r.seconds, u / r.n_layers, ind);
    }
    fprintf(f, "%spredicted s/token for these %u prompt ids and decode (reads + compute, not overlapped; the largest "
               "of reads, memory, compute names the bound), in the chunk each budget takes; experts: distinct records "
               "per pass (%s); hits: decode's expert cache hits (%s):\n",
            pre, n_ids, r.n_layers ? "routed" : "independent routes",
            r.n_layers ? "what the prompt's passes leave, weighted by its routes" : "the cache's share of all records");
    fprintf(f, "%s  %-20s %13s %5s %6s %10s %-8s %10s %-8s %6s\n", pre, "budget", "", "chunk", "experts", "prompt",
            "bound", "decode", "bound", "hits");
    /* the budget asked: a preset is its row; a size goes in its place */
    int shown = !given;
    for (uint32_t i = 0; given && given_ram && i < NB; i++)
        if (!strcmp(given_ram, ram[i]) && (i == 0 || i == NB - 1)) {
            plans[i] = *given;
            chunks[i] = given_chunk;
            ok[i] = 2;
            shown = 1;
        }
    const uint64_t resident = ok[NB - 1] ? plans[NB - 1].budget : UINT64_MAX;
    for (uint32_t i = 0; i < NB; i++) {
        if (!ok[i] || (i > 0 && i < NB - 1 && (plans[i].budget >= resident || plans[i].budget <= plans[0].budget)))
            continue;
        if (!shown && given->budget <= plans[i].budget) {
            print_row(f, pre, "this budget", &p, &c, given, given_chunk, n_ids, &r);
            shown = 1;
        }
        char name[40];
        snprintf(name, sizeof name, "%s%s", ram[i], ok[i] == 2 ? " (this budget)" : "");
        print_row(f, pre, name, &p, &c, &plans[i], chunks[i], n_ids, &r);
    }
    if (!shown)
        print_row(f, pre, "this budget", &p, &c, given, given_chunk, n_ids, &r);
    k3_probe_routes_free(&r);
    return 0;
}
