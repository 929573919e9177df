/*
 * bench_convert.c - k3-convert and k3-verify throughput on a real-width
 * checkpoint, against the limits measured in the same run:
 *   disk read   O_DIRECT sequential read of the input shards (2 MiB-aligned
 *               huge-page buffer, 16 MiB requests), first 4 GiB
 *   disk write  O_DIRECT sequential write of 2 GiB + fsync in DST's filesystem
 *   SHA-256     EVP_Digest of a 256 MiB buffer, one core
 * Conversion must read, hash, write and hash every byte, so its bound is the
 * slowest of the three (SHA-256 runs on two threads: input and output).
 * Full verification reads and hashes every output byte (threads = CPUs).
 *
 *   bin/bench-bench_convert SRC WORK [RUNS]      (RUNS default 3)
 *   bin/bench-bench_convert --manifest SRC       (manifest/record table at SRC's scale)
 *
 * SRC: e.g. k3-synth /tmp/x --preset k3-width --layers 2. WORK is created and
 * removed. Each run converts SRC to WORK/out (removed between runs); page
 * cache effects: the converter and verifier read with O_DIRECT, and the input
 * is dropped from the cache (POSIX_FADV_DONTNEED) before each run.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <omp.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../convert/conv.h"
#include "../verify/vfy.h"
#include "k3_io.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* user + system CPU seconds of this process so far */
static double cpu_now(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void drop_cache_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            fdatasync(fd);
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
    }
    if (d)
        closedir(d);
}

/* O_DIRECT read of up to `limit` bytes of the *.safetensors in dir. */
static double probe_read(const char *dir, uint64_t limit)
{
    const uint64_t req = 16u << 20;
    uint8_t *buf = k3_io_huge_alloc(req);
    uint64_t done = 0;
    double t0 = now();
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)) && done < limit) {
        if (!strstr(de->d_name, ".safetensors"))
            continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        int fd = open(p, O_RDONLY | O_DIRECT);
        if (fd < 0)
            continue;
        ssize_t r;
        off_t off = 0;
        while (done < limit && (r = pread(fd, buf, req, off)) > 0) {
            off += r;
            done += (uint64_t)r;
        }
        close(fd);
    }
    if (d)
        closedir(d);
    double t = now() - t0;
    k3_io_huge_free(buf, req);
    return (double)done / t / 1e9;
}

static double probe_write(const char *dir, uint64_t total)
{
    const uint64_t req = 64u << 20;
    uint8_t *buf = k3_io_huge_alloc(req);
    for (uint64_t i = 0; i < req; i++)
        buf[i] = (uint8_t)(i * 131 + 7);
    char p[4400];
    snprintf(p, sizeof p, "%s/write-probe.bin", dir);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd < 0)
        fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    double t0 = now();
    uint64_t done = 0;
    while (fd >= 0 && done < total) {
        ssize_t r = pwrite(fd, buf, req, (off_t)done);
        if (r <= 0)
            break;
        done += (uint64_t)r;
    }
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
    double t = now() - t0;
    unlink(p);
    k3_io_huge_free(buf, req);
    return (double)done / t / 1e9;
}

static double thread_cpu(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* SHA-256 speed per CPU-second of one core (independent of machine load). */
static double probe_sha(void)
{
    const uint64_t n = 256u << 20;
    uint8_t *buf = k3_io_huge_alloc(n);
    uint8_t md[32];
    unsigned int l;
    EVP_Digest(buf, 1 << 20, md, &l, EVP_sha256(), NULL);
    double t0 = thread_cpu();
    EVP_Digest(buf, (size_t)n, md, &l, EVP_sha256(), NULL);
    double t = thread_cpu() - t0;
    k3_io_huge_free(buf, n);
    return (double)n / t / 1e9;
}

static void median3(double *v, int n, double *med, double *lo, double *hi)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    *med = v[n / 2];
    *lo = v[0];
    *hi = v[n - 1];
}

/* --manifest SRC: build the plan of SRC (headers only), serialise its
 * manifest and experts.idx, then time what a reader does at open: parse +
 * validate the manifest, decode + validate the record table. */
static int manifest_only(const char *src)
{
    k3_conv_plan p;
    k3_err e = {0};
    double t0 = now();
    if (k3_conv_plan_build(&p, src, "/nonexistent", 0, NULL, &e)) {
        fprintf(stderr, "plan: %s\n", e.msg);
        return 1;
    }
    double t_plan = now() - t0;
    p.man.plan_json = strdup("{}");
    p.man.src_shards = calloc(k3_st_shard_count(p.st), sizeof *p.man.src_shards);
    for (uint32_t i = 0; i < k3_st_shard_count(p.st); i++) {
        p.man.src_shards[i].name = strdup(k3_st_shard_name(p.st, i));
        p.man.src_shards[i].size = k3_st_shard_size(p.st, i);
    }
    p.man.nsrc_shards = k3_st_shard_count(p.st);
    char *txt = k3_man_to_json(&p.man);
    uint64_t idx_len = p.man.has_experts ? k3_man_idx_size(&p.cfg) : 0;
    uint8_t *idx = malloc(idx_len ? idx_len : 1);
    if (p.man.has_experts)
        k3_man_idx_encode(idx, &p.cfg, p.man.xl.stride, p.records);
    double best_parse = 1e9, best_idx = 1e9;
    for (int r = 0; r < 5; r++) {
        k3_man m;
        t0 = now();
        if (k3_man_parse(&m, txt, strlen(txt), "manifest.json", &e)) {
            fprintf(stderr, "parse: %s\n", e.msg);
            return 1;
        }
        double t = now() - t0;
        best_parse = t < best_parse ? t : best_parse;
        if (m.has_experts) {
            uint64_t n = (uint64_t)k3_man_moe_layers(&m.cfg) * m.cfg.num_experts;
            k3_pk_record *rec = calloc(n, sizeof *rec);
            t0 = now();
            if (k3_man_idx_decode(&m, idx, idx_len, rec, "experts.idx", &e)) {
                fprintf(stderr, "idx: %s\n", e.msg);
                return 1;
            }
            t = now() - t0;
            best_idx = t < best_idx ? t : best_idx;
            free(rec);
        }
        k3_man_free(&m);
    }
    printf("plan of %s: %.2f s (%" PRIu64 " tensors, %u shards, %u groups)\n", src, t_plan, p.ntensors,
           k3_st_shard_count(p.st), p.ngroups);
    printf("manifest: %zu bytes, %u files, %u units, %u trunk tensors; parse+validate best of 5: %.1f ms\n",
           strlen(txt), p.man.nfiles, p.man.nunits, p.man.ntensors, best_parse * 1e3);
    printf("experts.idx: %" PRIu64 " bytes, %" PRIu64 " records; decode+validate best of 5: %.1f ms\n", idx_len,
           p.nrecs, best_idx * 1e3);
    free(idx);
    free(txt);
    k3_conv_plan_free(&p);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--manifest"))
        return manifest_only(argv[2]);
    if (argc < 3) {
        fprintf(stderr, "usage: %s SRC WORK [RUNS]\n", argv[0]);
        return 2;
    }
    const char *src = argv[1], *work = argv[2];
    int runs = argc > 3 ? atoi(argv[3]) : 3;
    if (runs < 1 || runs > 20)
        runs = 3;
    mkdir(work, 0755);
    char out[4400];
    snprintf(out, sizeof out, "%s/out", work);

    drop_cache_dir(src);
    double rd = probe_read(src, 4ull << 30);
    double wr = probe_write(work, 2ull << 30);
    double sha = probe_sha();
    printf("limits: disk read %.2f GB/s (O_DIRECT, 16 MiB), disk write %.2f GB/s (O_DIRECT + fsync), "
           "SHA-256 %.2f GB/s per CPU-second (%.2f ns/byte)\n", rd, wr, sha, 1.0 / sha);

    double conv[20], ver[20], quick[20], conv_cpu[20], ver_cpu[20];
    uint64_t in_bytes = 0, out_bytes = 0, rss = 0;
    for (int r = 0; r < runs; r++) {
        char cmd[8900];
        snprintf(cmd, sizeof cmd, "rm -rf %s", out);
        if (system(cmd) != 0)
            return 1;
        drop_cache_dir(src);
        k3_conv_opts o = {.quiet = 1};
        k3_conv_stats s;
        k3_err e = {0};
        double t0 = now(), c0 = cpu_now();
        if (k3_conv_run(src, out, &o, &s, &e)) {
            fprintf(stderr, "convert failed: %s\n", e.msg);
            return 1;
        }
        conv[r] = now() - t0;
        conv_cpu[r] = cpu_now() - c0;
        in_bytes = s.bytes_read;
        out_bytes = s.bytes_written;
        rss = s.peak_rss_kb > rss ? s.peak_rss_kb : rss;
        drop_cache_dir(out);
        k3_vfy v = {.dir = out, .full = 1, .threads = omp_get_num_procs(), .out = stderr, .sample = 32};
        pthread_mutex_init(&v.mu, NULL);
        t0 = now();
        c0 = cpu_now();
        k3_vfy_packed(&v, &e);
        ver[r] = now() - t0;
        ver_cpu[r] = cpu_now() - c0;
        if (v.problems) {
            fprintf(stderr, "verify found %" PRIu64 " problems\n", v.problems);
            return 1;
        }
        v.full = 0;
        t0 = now();
        k3_vfy_packed(&v, &e);
        quick[r] = now() - t0;
        printf("run %d: convert %.2f s (%.2f GB/s in; %.1f CPU s = %.2f ns/byte), verify full %.2f s (%.2f GB/s; "
               "%.1f CPU s), quick %.3f s\n", r + 1, conv[r], (double)in_bytes / conv[r] / 1e9, conv_cpu[r],
               conv_cpu[r] * 1e9 / (double)in_bytes, ver[r], (double)out_bytes / ver[r] / 1e9, ver_cpu[r], quick[r]);
        fflush(stdout);
    }
    double cm, cl, ch, vm, vl, vh, qm, ql, qh;
    median3(conv, runs, &cm, &cl, &ch);
    median3(ver, runs, &vm, &vl, &vh);
    median3(quick, runs, &qm, &ql, &qh);
    double bound = rd < wr ? rd : wr;
    bound = bound < sha ? bound : sha;
    printf("input %.2f GB, output %.2f GB, peak RSS %.0f MB\n", (double)in_bytes / 1e9, (double)out_bytes / 1e9,
           (double)rss / 1024);
    printf("convert: median %.2f GB/s (min-max %.2f-%.2f) = %.0f%% of min(read, write, sha) = %.2f GB/s\n",
           (double)in_bytes / cm / 1e9, (double)in_bytes / ch / 1e9, (double)in_bytes / cl / 1e9,
           100.0 * (double)in_bytes / cm / 1e9 / bound, bound);
    double vbound = rd < sha * omp_get_num_procs() ? rd : sha * omp_get_num_procs();
    printf("verify full: median %.2f GB/s (min-max %.2f-%.2f) = %.0f%% of min(read, sha x %d cores) = %.2f GB/s\n",
           (double)out_bytes / vm / 1e9, (double)out_bytes / vh / 1e9, (double)out_bytes / vl / 1e9,
           100.0 * (double)out_bytes / vm / 1e9 / vbound, omp_get_num_procs(), vbound);
    printf("verify quick: median %.3f s (min-max %.3f-%.3f)\n", qm, ql, qh);
    double cc[20];
    memcpy(cc, conv_cpu, sizeof cc);
    double ccm, ccl, cch;
    median3(cc, runs, &ccm, &ccl, &cch);
    printf("convert CPU: median %.2f ns/byte (min-max %.2f-%.2f); two SHA-256 passes alone cost %.2f ns/byte: "
           "%.0f%% of the CPU goes to hashing\n", ccm * 1e9 / (double)in_bytes, ccl * 1e9 / (double)in_bytes,
           cch * 1e9 / (double)in_bytes, 2.0 / sha, 100.0 * (2.0 / sha) / (ccm * 1e9 / (double)in_bytes));
    char cmd[8900];
    snprintf(cmd, sizeof cmd, "rm -rf %s", out);
    return system(cmd) == 0 ? 0 : 1;
}
