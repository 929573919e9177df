/*
 * bench_kernels.c - the products at the real K3 shapes, against the memory
 * bandwidth measured in the same run.
 *
 * For every shape, thread count (1, 2) and batch T (1, 4, 16, 64) it reports
 * the median time of several calls, the weight bytes per second, GFLOP/s
 * (2 * rows * cols * T per call) and the ratio of the weight rate to the
 * STREAM-style probes run first in the same process: a triad a = b + s*c
 * (counted as 3 arrays, the STREAM convention) and a read-only sum (what a
 * weight stream can at best reach). "cold" calls cycle through copies of the
 * matrix that together are several times the last-level cache, so every call
 * reads its weights from DRAM; "hot" calls repeat one slice of rows small
 * enough to stay in each core's L2, which shows the compute ceiling.
 *
 * F32 and F16 weights (trunk tensors some exporters ship, kept as stored)
 * run at the router shape (896 x 7168, F32 in such checkpoints) and at a
 * KDA projection shape, next to bf16 at the same shapes.
 *
 *   bench-bench_kernels [--runs N] [--pool-mib N] [--only bf16|mx|f32|f16] [--shape RxC] [--version]
 */
#include "k3_io.h"
#include "k3_kern.h"

#include <errno.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU seconds of the calling thread: the time the work took while it had a
 * core (on a shared, overloaded machine wall time mostly measures the
 * scheduler). Used for the 1-thread lines only, where the product runs on
 * this thread alone. The 2-thread lines have no CPU-time figure: the process
 * clock (CLOCK_PROCESS_CPUTIME_ID) adds a thread running on the other core
 * only at its next scheduler tick or switch, so for calls well under a tick
 * it counted about the calling thread alone (2-thread "cpu" times came out
 * at half the wall time, ratios above 1), and OpenMP workers spinning
 * between calls would count as work anyway. */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void fill_random(void *buf, uint64_t n, uint64_t seed)
{
    uint64_t x = seed | 1, *p = buf;
    for (uint64_t i = 0; i < n / 8; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[i] = x;
    }
}

/* ---- memory probes -------------------------------------------------------- */

struct stream_bw {
    double triad, read;         /* GB/s, medians, wall clock */
    double triad_cpu, read_cpu; /* GB/s, medians, thread CPU time (1 thread only) */
};

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

#if defined(__x86_64__)
/* Explicit AVX2 so that the probes are not limited by the compiler's choices
 * (-O2, no fast-math: a float sum would otherwise be one serial chain). */
__attribute__((target("avx2,fma")))
static double probe_triad(float *a, const float *b, const float *c, uint64_t n)
{
#pragma omp parallel for schedule(static)
    for (uint64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_fmadd_ps(_mm256_set1_ps(3.0f), _mm256_load_ps(c + i), _mm256_load_ps(b + i));
        _mm256_store_ps(a + i, v);
    }
    return 3.0 * (double)n * sizeof(float);
}

__attribute__((target("avx2,fma")))
static double probe_read(const float *b, uint64_t n)
{
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
        for (uint64_t i = 0; i < n; i += 32) {
            s0 = _mm256_add_ps(s0, _mm256_load_ps(b + i));
            s1 = _mm256_add_ps(s1, _mm256_load_ps(b + i + 8));
            s2 = _mm256_add_ps(s2, _mm256_load_ps(b + i + 16));
            s3 = _mm256_add_ps(s3, _mm256_load_ps(b + i + 24));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
        for (int k = 0; k < 8; k++)
            total += lanes[k];
    }
    if (total == 12345.0f)          /* keep the loop */
        fprintf(stderr, "%g\n", total);
    return (double)n * sizeof(float);
}
#elif defined(__aarch64__)
/* The same probes in NEON: 128-bit loads, eight independent sums. */
static double probe_triad(float *a, const float *b, const float *c, uint64_t n)
{
#pragma omp parallel for schedule(static)
    for (uint64_t i = 0; i < n; i += 8) {
        vst1q_f32(a + i, vfmaq_n_f32(vld1q_f32(b + i), vld1q_f32(c + i), 3.0f));
        vst1q_f32(a + i + 4, vfmaq_n_f32(vld1q_f32(b + i + 4), vld1q_f32(c + i + 4), 3.0f));
    }
    return 3.0 * (double)n * sizeof(float);
}

static double probe_read(const float *b, uint64_t n)
{
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        float32x4_t s[8];
        for (int k = 0; k < 8; k++)
            s[k] = vdupq_n_f32(0.0f);
#pragma omp for schedule(static)
        for (uint64_t i = 0; i < n; i += 32)
            for (int k = 0; k < 8; k++)
                s[k] = vaddq_f32(s[k], vld1q_f32(b + i + 4 * (uint64_t)k));
        for (int k = 1; k < 8; k++)
            s[0] = vaddq_f32(s[0], s[k]);
        total += vaddvq_f32(s[0]);
    }
    if (total == 12345.0f)          /* keep the loop */
        fprintf(stderr, "%g\n", total);
    return (double)n * sizeof(float);
}
#else
static double probe_triad(float *a, const float *b, const float *c, uint64_t n)
{
#pragma omp parallel for schedule(static)
    for (uint64_t i = 0; i < n; i++)
        a[i] = b[i] + 3.0f * c[i];
    return 3.0 * (double)n * sizeof(float);
}

static double probe_read(const float *b, uint64_t n)
{
    float total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
    for (uint64_t i = 0; i < n; i++)
        total += b[i];
    if (total == 12345.0f)          /* keep the loop */
        fprintf(stderr, "%g\n", total);
    return (double)n * sizeof(float);
}
#endif

static struct stream_bw stream_measure(int threads, uint64_t mib)
{
    uint64_t n = mib * (1ull << 20) / sizeof(float);
    float *a = k3_io_huge_alloc(n * 4), *b = k3_io_huge_alloc(n * 4), *c = k3_io_huge_alloc(n * 4);
    struct stream_bw bw = {0};
    if (!a || !b || !c) {
        fprintf(stderr, "bench: cannot allocate the stream arrays\n");
        exit(6);
    }
    for (uint64_t i = 0; i < n; i++)
        b[i] = 1.0f, c[i] = 2.0f;
    omp_set_num_threads(threads);
    double tr[5], rd[5], trc[5], rdc[5];
    probe_triad(a, b, c, n);
    for (int k = 0; k < 5; k++) {
        double t0 = now(), c0 = cpu_now();
        double bytes = probe_triad(a, b, c, n);
        tr[k] = bytes / (now() - t0) / 1e9;
        trc[k] = bytes / (cpu_now() - c0) / 1e9;
        t0 = now(), c0 = cpu_now();
        bytes = probe_read(b, n);
        rd[k] = bytes / (now() - t0) / 1e9;
        rdc[k] = bytes / (cpu_now() - c0) / 1e9;
    }
    bw.triad = median(tr, 5);
    bw.read = median(rd, 5);
    bw.triad_cpu = median(trc, 5);
    bw.read_cpu = median(rdc, 5);
    k3_io_huge_free(a, n * 4), k3_io_huge_free(b, n * 4), k3_io_huge_free(c, n * 4);
    return bw;
}

/* ---- products ------------------------------------------------------------- */

enum { W_BF16 = 0, W_MX, W_F32, W_F16 };
static const char *const kind_name[] = {"bf16", "mxfp4", "f32", "f16"};
static const char *const kind_opt[] = {"bf16", "mx", "f32", "f16"};

struct shape {
    int mx;                 /* W_* */
    uint64_t rows, cols;
};

static const struct shape shapes[] = {
    {W_BF16, 12288, 7168}, {W_BF16, 7168, 12288}, {W_BF16, 33792, 7168}, {W_BF16, 896, 7168},
    {W_MX, 3072, 3584}, {W_MX, 3584, 3072},
    {W_F32, 12288, 7168}, {W_F32, 896, 7168}, {W_F16, 12288, 7168}, {W_F16, 896, 7168},
};
#define NSHAPES (sizeof shapes / sizeof *shapes)

static uint64_t weight_bytes(const struct shape *s, uint64_t rows)
{
    if (s->mx == W_MX)
        return rows * s->cols / 2 + rows * s->cols / 32;
    return rows * s->cols * (s->mx == W_F32 ? 4 : 2);
}

static void call(const struct shape *s, const uint8_t *w, uint64_t rows, const float *X,
                 uint32_t T, float *Y)
{
    if (s->mx == W_MX)
        k3_gemm_mx(w, w + rows * s->cols / 2, rows, s->cols, X, T, Y);
    else if (s->mx == W_F32)
        k3_gemm_f32((const float *)w, rows, s->cols, X, T, Y);
    else if (s->mx == W_F16)
        k3_gemm_f16((const uint16_t *)w, rows, s->cols, X, T, Y);
    else
        k3_gemm_bf16((const uint16_t *)w, rows, s->cols, X, T, Y);
}

int main(int argc, char **argv)
{
    uint64_t runs = 7, pool_mib = 1024;
    const char *only = NULL, *only_shape = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--version")) {
            printf("bench_kernels (kernels: %s)\n", k3_kern_name());
            return 0;
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            if (parse_u64(argv[++i], 3, 1000, &runs)) {
                fprintf(stderr, "bench_kernels: error: --runs wants 3..1000\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--pool-mib") && i + 1 < argc) {
            if (parse_u64(argv[++i], 64, 65536, &pool_mib)) {
                fprintf(stderr, "bench_kernels: error: --pool-mib wants 64..65536\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            only = argv[++i];
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            only_shape = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_kernels [--runs N] [--pool-mib N] [--only bf16|mx|f32|f16] [--shape RxC] [--version]\n");
            return 2;
        }
    }
    k3_kern_init();
    if (k3_kern_emulated())
        printf("EMULATED: this build runs under user-mode emulation on a %s host: every figure below\n"
               "is the emulator's speed, not the CPU's (see bench/README.md for what to expect)\n",
               k3_kern_emulated());
    printf("kernels: %s; %llu timed calls per line (median, min-max); cold pool %llu MiB\n",
           k3_kern_name(), (unsigned long long)runs, (unsigned long long)pool_mib);
    /* passive workers sleep between calls: waking and joining them cost
     * ~80 us per 2-thread call here, a third of a 3072x3584 MXFP4 product */
    const char *wait = getenv("OMP_WAIT_POLICY");
    printf("OMP_WAIT_POLICY=%s\n", wait && *wait ? wait : "(unset: workers spin a while between calls)");

    struct stream_bw bw[3];
    for (int th = 1; th <= 2; th++) {
        bw[th] = stream_measure(th, 256);
        if (th == 1)
            printf("stream probe, 1 thread: triad %.1f GB/s, read %.1f GB/s (wall); "
                   "triad %.1f, read %.1f GB/s (cpu time); 3 x 256 MiB\n",
                   bw[th].triad, bw[th].read, bw[th].triad_cpu, bw[th].read_cpu);
        else
            printf("stream probe, %d threads: triad %.1f GB/s, read %.1f GB/s (wall); 3 x 256 MiB\n",
                   th, bw[th].triad, bw[th].read);
    }
    printf("\nwall: median wall-clock ms (min-max), GB/s of weights, GFLOP/s, ratio of GB/s to\n"
           "the wall triad / read probes; cpu (1 thread only): the same from the thread's\n"
           "CPU time against the cpu-time probes (what the kernel does while it has the core)\n\n");
    printf("%-5s %-10s %-4s %2s %3s %9s %17s %7s %7s %5s %5s | %8s %7s %7s %5s %5s\n", "kind",
           "shape", "mode", "th", "T", "ms", "(min-max)", "GB/s", "GFLOP/s", "/trd", "/read",
           "cpu ms", "GB/s", "GFLOP/s", "/trd", "/read");

    static const uint32_t Ts[] = {1, 4, 16, 64};
    /* cold medians kept for the summary: [shape][threads-1][T index] */
    double cold_wall[NSHAPES][2][4] = {{{0}}}, cold_cpu[NSHAPES][2][4] = {{{0}}};
    double *times = malloc(runs * sizeof *times), *cpus = malloc(runs * sizeof *cpus);
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const struct shape *s = &shapes[si];
        if (only && strcmp(only, kind_opt[s->mx]))
            continue;
        char sname[48];
        snprintf(sname, sizeof sname, "%llux%llu", (unsigned long long)s->rows, (unsigned long long)s->cols);
        if (only_shape && strcmp(only_shape, sname))
            continue;
        uint64_t bytes = weight_bytes(s, s->rows);
        uint64_t stride = (bytes + 4095) / 4096 * 4096;
        uint64_t copies = pool_mib * (1ull << 20) / stride;
        if (copies < 2)
            copies = 2;
        uint8_t *pool = k3_io_huge_alloc(copies * stride);
        float *X = k3_io_alloc_aligned(64 * s->cols * sizeof(float), 64);
        float *Y = k3_io_alloc_aligned(64 * s->rows * sizeof(float), 64);
        if (!pool || !X || !Y) {
            fprintf(stderr, "bench_kernels: error: cannot allocate %llu copies of %llu bytes\n",
                    (unsigned long long)copies, (unsigned long long)stride);
            return 6;
        }
        for (uint64_t k = 0; k < copies; k++) {
            uint8_t *w = pool + k * stride;
            fill_random(w, stride, 0x1234567 + k);
            if (s->mx == W_MX) {
                uint8_t *sc = w + s->rows * s->cols / 2;
                for (uint64_t i = 0; i < s->rows * s->cols / 32; i++)
                    sc[i] = (uint8_t)(118 + sc[i] % 12);
            } else if (s->mx == W_F32) {
                float *f = (float *)w;
                for (uint64_t i = 0; i < s->rows * s->cols; i++) {   /* finite, |x| < 2 */
                    uint32_t u;
                    memcpy(&u, &f[i], 4);
                    f[i] = (float)(u >> 8) * 0x1p-23f - 1.0f;
                }
            } else if (s->mx == W_F16) {
                uint16_t *h = (uint16_t *)w;
                for (uint64_t i = 0; i < s->rows * s->cols; i++)     /* finite, |x| < 4 */
                    h[i] = (uint16_t)((h[i] & 0x83ff) | (0x3000 + ((h[i] >> 10) & 0x3) * 0x400));
            } else {
                uint16_t *h = (uint16_t *)w;
                for (uint64_t i = 0; i < s->rows * s->cols; i++)     /* finite, |x| < 4 */
                    h[i] = (uint16_t)((h[i] & 0x807f) | (0x3c00 + ((h[i] >> 7) & 0x3) * 0x80));
            }
        }
        for (uint64_t i = 0; i < 64 * s->cols; i++)
            X[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
        char name[32];
        snprintf(name, sizeof name, "%llux%llu", (unsigned long long)s->rows,
                 (unsigned long long)s->cols);
        for (int hot = 0; hot <= 1; hot++) {
            for (int th = 1; th <= 2; th++) {
                omp_set_num_threads(th);
                /* hot: about 1 MiB of weights per thread, repeated */
                uint64_t rows = s->rows;
                if (hot) {
                    uint64_t per_row = weight_bytes(s, 1);
                    rows = (1ull << 20) / per_row * (uint64_t)th;
                    rows = rows / 32 * 32;
                    if (rows > s->rows)
                        rows = s->rows;
                }
                for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
                    uint32_t T = Ts[ti];
                    /* hot mode wants a contiguous slice with scales after it */
                    uint8_t *hot_w = pool;
                    if (hot && s->mx == W_MX)
                        memmove(pool + rows * s->cols / 2, pool + s->rows * s->cols / 2,
                                rows * s->cols / 32);
                    uint64_t next = 0;
                    call(s, hot ? hot_w : pool + (next++ % copies) * stride, rows, X, T, Y);
                    for (uint64_t k = 0; k < runs; k++) {
                        const uint8_t *w = hot ? hot_w : pool + (next++ % copies) * stride;
                        double t0 = now(), c0 = cpu_now();
                        call(s, w, rows, X, T, Y);
                        times[k] = now() - t0;
                        cpus[k] = cpu_now() - c0;
                    }
                    double med = median(times, (int)runs), cmed = median(cpus, (int)runs);
                    double wb = (double)weight_bytes(s, rows);
                    double flop = 2.0 * (double)rows * (double)s->cols * T;
                    char mm[40];
                    snprintf(mm, sizeof mm, "(%.3f-%.3f)", times[0] * 1e3, times[runs - 1] * 1e3);
                    if (!hot) {
                        cold_wall[si][th - 1][ti] = med;
                        cold_cpu[si][th - 1][ti] = cmed;
                    }
                    printf("%-5s %-10s %-4s %2d %3u %9.3f %17s %7.1f %7.1f %5.2f %5.2f | ",
                           kind_name[s->mx], name, hot ? "hot" : "cold", th, T, med * 1e3,
                           mm, wb / med / 1e9, flop / med / 1e9, hot ? 0.0 : wb / med / 1e9 / bw[th].triad,
                           hot ? 0.0 : wb / med / 1e9 / bw[th].read);
                    if (th == 1)
                        printf("%8.3f %7.1f %7.1f %5.2f %5.2f\n", cmed * 1e3, wb / cmed / 1e9,
                               flop / cmed / 1e9, hot ? 0.0 : wb / cmed / 1e9 / bw[th].triad_cpu,
                               hot ? 0.0 : wb / cmed / 1e9 / bw[th].read_cpu);
                    else
                        printf("%8s %7s %7s %5s %5s\n", "-", "-", "-", "-", "-");
                    fflush(stdout);
                }
            }
        }
        k3_io_huge_free(pool, copies * stride);
        k3_io_free_aligned(X);
        k3_io_free_aligned(Y);
    }
    printf("\nsummary (cold): T=1 weight GB/s over the triad probe, and the time of T=16\n"
           "and T=64 over the time of T=1 (wall | cpu, 1 thread only)\n");
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const struct shape *s = &shapes[si];
        if (only && strcmp(only, kind_opt[s->mx]))
            continue;
        char sname[48];
        snprintf(sname, sizeof sname, "%llux%llu", (unsigned long long)s->rows, (unsigned long long)s->cols);
        if (only_shape && strcmp(only_shape, sname))
            continue;
        for (int th = 1; th <= 2; th++) {
            double wb = (double)weight_bytes(s, s->rows);
            double w1 = cold_wall[si][th - 1][0], c1 = cold_cpu[si][th - 1][0];
            printf("%-5s %5llux%-5llu %d thread%s: ", kind_name[s->mx],
                   (unsigned long long)s->rows, (unsigned long long)s->cols, th, th > 1 ? "s" : " ");
            if (th == 1)
                printf("T=1 %.2f | %.2f of triad;  T=16 %.1fx | %.1fx;  T=64 %.1fx | %.1fx\n",
                       wb / w1 / 1e9 / bw[th].triad, wb / c1 / 1e9 / bw[th].triad_cpu,
                       cold_wall[si][th - 1][2] / w1, cold_cpu[si][th - 1][2] / c1,
                       cold_wall[si][th - 1][3] / w1, cold_cpu[si][th - 1][3] / c1);
            else
                printf("T=1 %.2f of triad;  T=16 %.1fx;  T=64 %.1fx\n", wb / w1 / 1e9 / bw[th].triad,
                       cold_wall[si][th - 1][2] / w1, cold_wall[si][th - 1][3] / w1);
        }
    }
    free(times);
    free(cpus);
    return 0;
}
