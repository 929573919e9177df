/*
 * bench_crc.c - CRC-32 speed: zlib's crc32 against k3_crc32 on each path
 * this CPU runs (pclmul, vpclmul), one thread, on 16 MiB buffers.
 *
 *   bin/bench-bench_crc [--runs N] [--pool-mib N]
 *
 * hot:  the same 16 MiB buffer again and again (it stays in the last-level
 *       cache): the compute ceiling of each path;
 * cold: each call takes the next 16 MiB buffer of a pool of --pool-mib
 *       (default 1024, about 4x the L3), so the bytes come from DRAM, as
 *       after a read that bypassed the caches (O_DIRECT).
 * Also hot lines for 4 KiB and 256 KiB buffers (short calls: entry cost).
 *
 * Each figure is the median over --runs calls (default 41) after one warm-up,
 * in GB/s (1e9 bytes) of wall time and of thread CPU time (the machine is
 * shared: CPU time is what the CRC takes from the model's compute). Every
 * path's result is checked against zlib's before timing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "k3_cli.h"
#include "k3_crc.h"
#include "k3_kern.h"
#include "k3_io.h"

#define BUF (16u << 20)

static double clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static volatile uint32_t sink;

/* path NULL: zlib's crc32 itself (in uInt calls, as callers used it) */
static uint32_t run_one(const char *path, const uint8_t *p, size_t n)
{
    if (path)
        return k3_crc32(0, p, n);
    return (uint32_t)crc32(0, p, (uInt)n);
}

/* Median wall and CPU seconds of runs calls, call i on buffer bufs[i % nbufs]. */
static void timeit(const char *path, uint8_t **bufs, unsigned nbufs, size_t n, unsigned runs,
                   double *wall, double *cpu)
{
    double *w = malloc(runs * sizeof *w), *c = malloc(runs * sizeof *c);
    unsigned next = 0;
    sink ^= run_one(path, bufs[next++ % nbufs], n); /* warm-up */
    for (unsigned r = 0; r < runs; r++) {
        const uint8_t *p = bufs[next++ % nbufs];
        double w0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
        sink ^= run_one(path, p, n);
        c[r] = clock_s(CLOCK_THREAD_CPUTIME_ID) - c0;
        w[r] = clock_s(CLOCK_MONOTONIC) - w0;
    }
    qsort(w, runs, sizeof *w, cmp_double);
    qsort(c, runs, sizeof *c, cmp_double);
    *wall = w[runs / 2];
    *cpu = c[runs / 2];
    free(w);
    free(c);
}

int main(int argc, char **argv)
{
    uint64_t runs = 41, pool_mib = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            if (k3_cli_parse_u64(argv[++i], 1, 100000, &runs)) {
                fprintf(stderr, "bench_crc: --runs needs 1..100000\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--pool-mib") && i + 1 < argc) {
            if (k3_cli_parse_u64(argv[++i], 32, 1u << 20, &pool_mib)) {
                fprintf(stderr, "bench_crc: --pool-mib needs 32..1048576\n");
                return 2;
            }
        } else {
            fprintf(stderr, "usage: bench-bench_crc [--runs N] [--pool-mib N]\n");
            return 2;
        }
    }
    unsigned nbufs = (unsigned)(pool_mib / 16);
    uint8_t **bufs = calloc(nbufs, sizeof *bufs);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (unsigned b = 0; bufs && b < nbufs; b++) {
        bufs[b] = k3_io_huge_alloc(BUF);
        if (!bufs[b]) {
            fprintf(stderr, "bench_crc: cannot allocate %llu MiB\n", (unsigned long long)pool_mib);
            return 1;
        }
        for (size_t i = 0; i < BUF; i += 8) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            memcpy(bufs[b] + i, &s, 8);
        }
    }
    const char *paths[] = {NULL, "pclmul", "vpclmul", "armv8"};
    enum { NPATHS = sizeof paths / sizeof *paths };
    if (k3_kern_emulated())
        printf("EMULATED: this build runs under user-mode emulation on a %s host: the figures are\n"
               "the emulator's speed, not the CPU's\n", k3_kern_emulated());
    printf("bench_crc: crc32 path chosen here: %s; %u x 16 MiB cold pool, median of %llu calls\n",
           k3_crc_name(), nbufs, (unsigned long long)runs);
    for (unsigned k = 1; k < NPATHS; k++)
        if (k3_crc_supported(paths[k])) {
            k3_crc_use(paths[k]);
            if (k3_crc32(0, bufs[0] + 1, BUF - 1) != (uint32_t)crc32(0, bufs[0] + 1, BUF - 1)) {
                fprintf(stderr, "bench_crc: %s disagrees with zlib\n", paths[k]);
                return 1;
            }
        }
    printf("%-8s %-6s %9s %10s %10s\n", "path", "case", "size", "GB/s wall", "GB/s cpu");
    struct { const char *name; size_t n; unsigned nbufs; } cases[] = {
        {"hot", 4096, 1}, {"hot", 256u << 10, 1}, {"hot", BUF, 1}, {"cold", BUF, nbufs}};
    for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (unsigned k = 0; k < NPATHS; k++) {
            if (paths[k] && (!k3_crc_supported(paths[k]) || k3_crc_use(paths[k])))
                continue;
            /* short calls: time a batch, so the clock is not the measurement */
            unsigned batch = cases[c].n < BUF ? (unsigned)(BUF / cases[c].n) : 1;
            double wall = 0, cpu = 0;
            if (batch == 1) {
                timeit(paths[k], bufs, cases[c].nbufs, cases[c].n, (unsigned)runs, &wall, &cpu);
            } else {
                double *w = malloc(runs * sizeof *w), *cp = malloc(runs * sizeof *cp);
                for (unsigned r = 0; r <= runs; r++) {
                    double w0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
                    for (unsigned i = 0; i < batch; i++)
                        sink ^= run_one(paths[k], bufs[0], cases[c].n);
                    if (r) { /* r == 0 is the warm-up */
                        cp[r - 1] = (clock_s(CLOCK_THREAD_CPUTIME_ID) - c0) / batch;
                        w[r - 1] = (clock_s(CLOCK_MONOTONIC) - w0) / batch;
                    }
                }
                qsort(w, runs, sizeof *w, cmp_double);
                qsort(cp, runs, sizeof *cp, cmp_double);
                wall = w[runs / 2], cpu = cp[runs / 2];
                free(w), free(cp);
            }
            char size[32];
            if (cases[c].n >= (1u << 20))
                snprintf(size, sizeof size, "%zu MiB", cases[c].n >> 20);
            else
                snprintf(size, sizeof size, "%zu KiB", cases[c].n >> 10);
            printf("%-8s %-6s %9s %10.2f %10.2f\n", paths[k] ? paths[k] : "zlib", cases[c].name, size,
                   (double)cases[c].n / wall * 1e-9, (double)cases[c].n / cpu * 1e-9);
            fflush(stdout);
        }
    for (unsigned b = 0; b < nbufs; b++)
        k3_io_huge_free(bufs[b], BUF);
    free(bufs);
    return 0;
}
