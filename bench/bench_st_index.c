/*
 * bench_st_index.c - how long k3_st_open takes to index a checkpoint the size
 * of real K3: 96 shards, 497,220 tensors with K3's names and K3's shapes, plus
 * model.safetensors.index.json.
 *
 * The shards are sparse files: each header is real, the data area has the
 * real size (so offsets and file sizes look like K3's) but is a hole, so the
 * whole thing costs ~80 MB of disk. Opening never reads tensor data, so the
 * figure is header reading + parsing + indexing + cross-checking the index.
 *
 * For comparison the same headers are parsed with cJSON (parse + free only,
 * no validation), to show what the bounded cursor parser buys.
 *
 *   bin/bench-bench_st_index [DIR] [RUNS]     (default /tmp/st/k3-index, 5)
 *
 * The directory is created, used and removed (K3_BENCH_KEEP=1 keeps it).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "k3_io.h"
#include "k3_schema.h"
#include "k3_st.h"

#define NSHARDS 96
#define NTENSORS 497220u
#define LAYERS 93
#define EXPERTS 896

typedef struct spec {
    char name[128];
    const char *dtype;
    uint32_t dsize;
    int nd;
    uint64_t shape[3];
} spec;

static spec *specs;
static uint32_t nspecs;

static void add(const char *dtype, int nd, uint64_t a, uint64_t b, uint64_t c, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static void add(const char *dtype, int nd, uint64_t a, uint64_t b, uint64_t c, const char *fmt, ...)
{
    spec *s = &specs[nspecs++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    s->dtype = dtype;
    s->dsize = !strcmp(dtype, "BF16") ? 2 : !strcmp(dtype, "F32") ? 4 : 1;
    s->nd = nd;
    s->shape[0] = a;
    s->shape[1] = b;
    s->shape[2] = c;
}

static int is_mla(int l)
{
    return (l + 1) % 4 == 0 || l == 92;
}

/* K3's tensor list (the tensor schema, include/k3_schema.h, for K3's
 * config), padded to exactly 497,220 with extra vectors. */
static void make_names(void)
{
    k3_cfg c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 7168; c.num_hidden_layers = LAYERS; c.vocab_size = 163840;
    c.kda_num_heads = 96; c.kda_head_dim = 128; c.short_conv_kernel_size = 4;
    c.num_attention_heads = 96; c.q_lora_rank = 1536; c.kv_lora_rank = 512;
    c.qk_nope_head_dim = 128; c.qk_rope_head_dim = 64; c.v_head_dim = 128; c.mla_use_output_gate = 1;
    c.num_experts = EXPERTS; c.num_experts_per_token = 16; c.num_shared_experts = 2;
    c.routed_expert_hidden_size = 3584; c.moe_intermediate_size = 3072; c.latent_moe_use_norm = 1;
    c.first_k_dense_replace = 1; c.intermediate_size = 33792;
    for (int l = 0; l < LAYERS; l++)
        c.is_mla[l] = is_mla(l);
    const uint64_t I = c.moe_intermediate_size, L = c.routed_expert_hidden_size;
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    specs = calloc(NTENSORS + 16, sizeof *specs);
    char name[256];
    for (uint32_t g = 0; g <= LAYERS + 1; g++) {   /* the embedding (g 0), layers 1.., the head */
        for (uint32_t i = 0; i < nrows; i++) {
            const k3_sch_row *r = &rows[i];
            if (g == 0 ? r->where != K3_SCH_IN_EMBED : !k3_schema_in_group(&c, r, g - 1))
                continue;
            uint64_t sh[3];
            k3_schema_shape(&c, r, sh);
            k3_schema_name(name, sizeof name, r->slot, g - 1, 1);
            add(r->est_bytes == 4 ? "F32" : "BF16", r->ndim, sh[0], sh[1], sh[2], "%s", name);
        }
        if (g == 0 || g > LAYERS || k3_cfg_layer_is_dense(&c, g - 1))
            continue;
        for (uint32_t x = 0; x < EXPERTS; x++)
            for (int w = 0; w < 3; w++) {
                const uint64_t rr = w == 1 ? L : I, cc = w == 1 ? I : L;
                k3_schema_expert_name(name, sizeof name, g - 1, x, w, K3_SCH_XP_PACKED);
                add("U8", 2, rr, cc / 2, 0, "%s", name);
                k3_schema_expert_name(name, sizeof name, g - 1, x, w, K3_SCH_XP_SCALE);
                add("U8", 2, rr, cc / 32, 0, "%s", name);
            }
    }
    for (uint32_t k = 0; nspecs < NTENSORS; k++)
        add("BF16", 1, c.hidden_size, 0, 0, K3_SCH_PREFIX "mtp.%u.extra_norm.weight", k);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "bench_st_index: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* Drop the checkpoint's pages from the page cache (clean pages of files we
 * own: no privileges needed), so the next open reads from the disk. */
static void evict(const char *dir)
{
    char path[4096];
    for (uint32_t s = 0; s <= NSHARDS; s++) {
        if (s < NSHARDS)
            snprintf(path, sizeof path, "%s/model-%05u-of-%05u.safetensors", dir, s + 1, NSHARDS);
        else
            snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        int fd = open(path, O_RDONLY);
        if (fd < 0)
            die(path);
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}


/* Writes the shards and the index; returns total header bytes. */
static uint64_t write_checkpoint(const char *dir, uint64_t *apparent)
{
    uint64_t hdr_total = 0;
    size_t cap = 8u << 20;
    char *hdr = malloc(cap);
    size_t icap = 64u << 20, ilen = 0;
    char *idx = malloc(icap);
    ilen += (size_t)snprintf(idx, icap, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    *apparent = 0;
    uint32_t per = (NTENSORS + NSHARDS - 1) / NSHARDS;
    for (uint32_t s = 0; s < NSHARDS; s++) {
        char fname[64], path[4096];
        snprintf(fname, sizeof fname, "model-%05u-of-%05u.safetensors", s + 1, NSHARDS);
        snprintf(path, sizeof path, "%s/%s", dir, fname);
        size_t len = (size_t)snprintf(hdr, cap, "{\"__metadata__\":{\"format\":\"pt\"}");
        uint64_t off = 0;
        for (uint32_t i = s * per; i < (s + 1) * per && i < nspecs; i++) {
            const spec *t = &specs[i];
            uint64_t nb = t->dsize;
            for (int d = 0; d < t->nd; d++)
                nb *= t->shape[d];
            len += (size_t)snprintf(hdr + len, cap - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name, t->dtype);
            for (int d = 0; d < t->nd; d++)
                len += (size_t)snprintf(hdr + len, cap - len, "%s%" PRIu64, d ? "," : "", t->shape[d]);
            len += (size_t)snprintf(hdr + len, cap - len, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + nb);
            off += nb;
            ilen += (size_t)snprintf(idx + ilen, icap - ilen, "%s\"%s\":\"%s\"", i ? "," : "", t->name, fname);
            if (len > cap - 4096 || ilen > icap - 4096) {
                fprintf(stderr, "bench_st_index: buffer too small\n");
                exit(1);
            }
        }
        hdr[len++] = '}';
        while (len % 8)
            hdr[len++] = ' ';
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            die(path);
        uint8_t n8[8];
        for (int i = 0; i < 8; i++)
            n8[i] = (uint8_t)((uint64_t)len >> (8 * i));
        if (pwrite(fd, n8, 8, 0) != 8 || pwrite(fd, hdr, len, 8) != (ssize_t)len)
            die(path);
        /* the data is a hole of the real size */
        if (ftruncate(fd, (off_t)(8 + len + off)) != 0)
            die(path);
        close(fd);
        hdr_total += len;
        *apparent += 8 + len + off;
    }
    ilen += (size_t)snprintf(idx + ilen, icap - ilen, "}}\n");
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "w");
    if (!f || fwrite(idx, 1, ilen, f) != ilen || fclose(f) != 0)
        die(path);
    free(hdr);
    free(idx);
    return hdr_total;
}

/* cJSON on the same headers: parse + free, nothing else. */
static double cjson_parse_all(const char *dir)
{
    double t0 = now_s();
    for (uint32_t s = 0; s < NSHARDS; s++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/model-%05u-of-%05u.safetensors", dir, s + 1, NSHARDS);
        int fd = open(path, O_RDONLY);
        uint8_t n8[8];
        if (fd < 0 || pread(fd, n8, 8, 0) != 8)
            die(path);
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--)
            n = n << 8 | n8[i];
        char *text = malloc(n);
        if (pread(fd, text, n, 8) != (ssize_t)n)
            die(path);
        close(fd);
        cJSON *j = cJSON_ParseWithLength(text, n);
        if (!j) {
            fprintf(stderr, "bench_st_index: cJSON failed on %s\n", path);
            exit(1);
        }
        cJSON_Delete(j);
        free(text);
    }
    return now_s() - t0;
}

/* One header at the K3_ST_MAX_HEADER bound, parsed in memory: the bounded
 * parser against cJSON (best of 3, CPU time). */
static void big_header(void)
{
    size_t cap = K3_ST_MAX_HEADER, len = 0;
    char *h = malloc(cap + 4096);
    uint64_t off = 0;
    unsigned n = 0;
    len += (size_t)sprintf(h, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (;; n++) {
        char entry[400];
        int k = snprintf(entry, sizeof entry,
                         ",\"language_model.model.layers.%u.block_sparse_moe.experts.%u.w1.weight_packed\":"
                         "{\"dtype\":\"U8\",\"shape\":[3072,1792],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                         n / 5376, n % 5376, off, off + (uint64_t)3072 * 1792);
        if (len + (size_t)k + 1 > cap)
            break;
        memcpy(h + len, entry, (size_t)k);
        len += (size_t)k;
        off += (uint64_t)3072 * 1792;
    }
    h[len++] = '}';
    double best = 1e9, best_cjson = 1e9;
    for (int r = 0; r < 3; r++) {
        k3_st_header hd;
        k3_err e = {0};
        double a = cpu_s();
        if (k3_st_header_parse(&hd, "big", (const uint8_t *)h, len, 8 + len + off, &e)) {
            fprintf(stderr, "bench_st_index: %s\n", e.msg);
            exit(1);
        }
        double b = cpu_s();
        k3_st_header_free(&hd);
        if (b - a < best)
            best = b - a;
        a = cpu_s();
        cJSON *j = cJSON_ParseWithLength(h, len);
        if (!j) {
            fprintf(stderr, "bench_st_index: cJSON failed on the big header\n");
            exit(1);
        }
        cJSON_Delete(j);
        b = cpu_s();
        if (b - a < best_cjson)
            best_cjson = b - a;
    }
    printf("one %.1f MB header (%u tensors): k3_st_header_parse %.3f s CPU (%.0f MB/s, full validation), "
           "cJSON parse+free %.3f s CPU (%.0f MB/s)\n", len / 1e6, n, best, len / 1e6 / best, best_cjson,
           len / 1e6 / best_cjson);
    free(h);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "/tmp/st/k3-index";
    long runs = 5;
    if (argc > 2) {
        char *end;
        errno = 0;
        runs = strtol(argv[2], &end, 10);
        if (errno || *end || runs < 1 || runs > 100) {
            fprintf(stderr, "bench_st_index: RUNS must be 1..100\n");
            return 2;
        }
    }
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    if (system(cmd) != 0)
        die(dir);
    make_names();
    double t0 = now_s();
    uint64_t apparent;
    uint64_t hdr_bytes = write_checkpoint(dir, &apparent);
    printf("checkpoint: %s: %u shards, %u tensors, %.1f MB of headers, %.3f TB apparent (sparse), written in %.2f s\n",
           dir, NSHARDS, nspecs, hdr_bytes / 1e6, apparent / 1e12, now_s() - t0);

    double *t = malloc((size_t)runs * sizeof *t), *cpu = malloc((size_t)runs * sizeof *cpu);
    k3_err e = {0};
    /* one warm-up run: the page cache then holds the headers for every run */
    for (long r = -1; r < runs; r++) {
        k3_st *st;
        k3_err_clear(&e);
        double a = now_s(), ca = cpu_s();
        int rc = k3_st_open(&st, dir, 0, &e);
        double b = now_s(), cb = cpu_s();
        if (rc) {
            fprintf(stderr, "bench_st_index: k3_st_open: %s\n", e.msg);
            return 1;
        }
        if (k3_st_tensor_count(st) != NTENSORS || !k3_st_find(st, "language_model.model.layers.92.block_sparse_moe."
                                                                  "experts.895.w3.weight_scale")) {
            fprintf(stderr, "bench_st_index: wrong index\n");
            return 1;
        }
        k3_st_close(st);
        if (r >= 0) {
            t[r] = b - a;
            cpu[r] = cb - ca;
        }
    }
    qsort(t, (size_t)runs, sizeof *t, cmp_double);
    qsort(cpu, (size_t)runs, sizeof *cpu, cmp_double);
    printf("k3_st_open (index + 96 headers, warm page cache, %d threads): wall median %.3f s (min %.3f, max %.3f), "
           "CPU median %.3f s (min %.3f, max %.3f) over %ld runs\n",
           omp_get_max_threads(), t[runs / 2], t[0], t[runs - 1], cpu[runs / 2], cpu[0], cpu[runs - 1], runs);

    /* cold: headers and index evicted from the page cache before each run */
    for (long r = 0; r < runs; r++) {
        k3_st *st;
        evict(dir);
        double a = now_s(), ca = cpu_s();
        int rc = k3_st_open(&st, dir, 0, &e);
        double b = now_s(), cb = cpu_s();
        if (rc) {
            fprintf(stderr, "bench_st_index: k3_st_open: %s\n", e.msg);
            return 1;
        }
        k3_st_close(st);
        t[r] = b - a;
        cpu[r] = cb - ca;
    }
    qsort(t, (size_t)runs, sizeof *t, cmp_double);
    qsort(cpu, (size_t)runs, sizeof *cpu, cmp_double);
    printf("k3_st_open (page cache evicted with POSIX_FADV_DONTNEED): wall median %.3f s (min %.3f, max %.3f), "
           "CPU median %.3f s over %ld runs\n", t[runs / 2], t[0], t[runs - 1], cpu[runs / 2], runs);

    /* lookups, and what an open checkpoint holds in memory */
    k3_st *st;
    /* one thread, so that everything lands in the main malloc arena, the one
     * mallinfo2 reports */
    int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    struct mallinfo2 m0 = mallinfo2();
    k3_st_open(&st, dir, 0, &e);
    struct mallinfo2 m1 = mallinfo2();
    omp_set_num_threads(threads);
    printf("heap held by the open k3_st: %.1f MB (%.0f bytes per tensor)\n",
           (double)(m1.uordblks + m1.hblkhd - m0.uordblks - m0.hblkhd) / 1e6,
           (double)(m1.uordblks + m1.hblkhd - m0.uordblks - m0.hblkhd) / NTENSORS);
    double a = now_s();
    uint64_t found = 0;
    for (uint32_t i = 0; i < nspecs; i++)
        found += k3_st_find(st, specs[(i * 2654435761u) % nspecs].name) != NULL;
    double b = now_s();
    printf("k3_st_find: %u lookups in %.3f s (%.0f ns each), %" PRIu64 " found\n", nspecs, b - a,
           (b - a) / nspecs * 1e9, found);
    k3_st_close(st);

    double c[3], cc[3];
    for (int r = 0; r < 3; r++) {
        double c0 = cpu_s();
        c[r] = cjson_parse_all(dir);
        cc[r] = cpu_s() - c0;
    }
    qsort(c, 3, sizeof *c, cmp_double);
    qsort(cc, 3, sizeof *cc, cmp_double);
    printf("for comparison, cJSON parse+free of the same 96 headers (no validation, no index): wall median %.3f s, "
           "CPU median %.3f s\n", c[1], cc[1]);

    big_header();

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("peak RSS %.0f MB\n", ru.ru_maxrss / 1024.0);
    if (!getenv("K3_BENCH_KEEP")) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "bench_st_index: could not remove %s\n", dir);
    }
    free(t);
    free(cpu);
    free(specs);
    return 0;
}
