/*
 * bench_kernels.c - the products at the real K3 shapes, against the memory
 * bandwidth measured in the same run.
 *
 * For every shape, thread count (1, 2) and batch T (1, 2, 4, 8, 16, 32, 64)
 * it reports the median time of several calls, the weight bytes per second,
 * GFLOP/s (2 * rows * cols * T per call) and two ratios measured in the same
 * process: the weight rate over STREAM-style probes run first (a triad
 * a = b + s*c, counted as 3 arrays, the STREAM convention, and a read-only
 * sum, what a weight stream can at best reach), and GFLOP/s over the f32 FMA
 * peak of the vector width the kernels use (a register-only loop of 12
 * independent FMA chains per thread, the products' own ceiling since they
 * keep f32 activations). "cold" calls cycle through copies of the matrix
 * that together are several times the last-level cache, so every call reads
 * its weights from DRAM; "warm" calls repeat the whole matrix (what ggml's
 * test-backend-ops does; a matrix that fits the last-level cache stays
 * there); "hot" calls repeat one slice of rows small enough to stay in each
 * core's L2, which shows the compute ceiling.
 *
 * F32 and F16 weights (trunk tensors some exporters ship, kept as stored)
 * run at the router shape (896 x 7168, F32 in such checkpoints) and at a
 * KDA projection shape, next to bf16 at the same shapes.
 *
 *   bench-bench_kernels [--runs N] [--pool-mib N] [--only bf16|mx|f32|f16] [--shape RxC]
 *                       [--mode cold|warm|hot] [--threads 1|2] [--ts 1,2,4,...] [--version]
 *
 * --shape takes any RxC (ggml's 4096x14336 too): the built-in shapes of that
 * size, or else that shape for every kind --only allows (MXFP4: C a multiple
 * of 32). Defaults: cold and hot, 1 and 2 threads, all seven T.
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

/* ---- f32 FMA peak ---------------------------------------------------------- */

/* 12 independent chains of n FMAs per thread, registers only; returns flops.
 * 12 chains cover two pipes of up to 6 cycles' latency. */
#if defined(__x86_64__)
__attribute__((target("avx2,fma")))
static double fma_loop_avx2(uint64_t n, float *sink)
{
    __m256 a[12], m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        a[i] = _mm256_set1_ps((float)i);
    for (uint64_t k = 0; k < n; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm256_fmadd_ps(a[i], m, c);
    for (int i = 1; i < 12; i++)
        a[0] = _mm256_add_ps(a[0], a[i]);
    *sink = _mm256_cvtss_f32(a[0]);
    return 12.0 * 16.0 * (double)n;
}

__attribute__((target("avx512f")))
static double fma_loop_avx512(uint64_t n, float *sink)
{
    __m512 a[12], m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_ps((float)i);
    for (uint64_t k = 0; k < n; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_fmadd_ps(a[i], m, c);
    for (int i = 1; i < 12; i++)
        a[0] = _mm512_add_ps(a[0], a[i]);
    *sink = _mm512_reduce_add_ps(a[0]);
    return 12.0 * 32.0 * (double)n;
}
#elif defined(__aarch64__)
static double fma_loop_neon(uint64_t n, float *sink)
{
    float32x4_t a[12], m = vdupq_n_f32(0.999999f), c = vdupq_n_f32(1e-7f);
    for (int i = 0; i < 12; i++)
        a[i] = vdupq_n_f32((float)i);
    for (uint64_t k = 0; k < n; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = vfmaq_f32(c, a[i], m);
    for (int i = 1; i < 12; i++)
        a[0] = vaddq_f32(a[0], a[i]);
    *sink = vaddvq_f32(a[0]);
    return 12.0 * 8.0 * (double)n;
}
#endif

/* GFLOP/s of the FMA loop of the width the kernels use (name in *what), on
 * `threads` threads at once, median of 5; 0 if no vector path is built. */
static double fma_peak(int threads, const char **what)
{
    const char *k = k3_kern_name();
    double (*loop)(uint64_t, float *) = NULL;
#if defined(__x86_64__)
    int zmm = !strncmp(k, "avx512", 6);
    loop = zmm ? fma_loop_avx512 : fma_loop_avx2;
    *what = zmm ? "avx512 zmm" : "avx2 ymm";
    if (!zmm && !k3_kern_supported("avx2"))
        loop = NULL;
#elif defined(__aarch64__)
    loop = fma_loop_neon;
    *what = "neon q";
#endif
    if (!loop) {
        *what = "none";
        return 0;
    }
    omp_set_num_threads(threads);
    double g[5];
    float sink = 0;
    for (int r = -1; r < 5; r++) {
        double flops = 0, t0 = now();
#pragma omp parallel reduction(+ : flops)
        {
            float s1;
            flops += loop(r < 0 ? 1000000 : 20000000, &s1);
#pragma omp critical
            sink += s1;
        }
        if (r >= 0)
            g[r] = flops / (now() - t0) / 1e9;
    }
    if (sink == 12345.0f)
        fprintf(stderr, "%g\n", sink);
    return median(g, 5);
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
#define MAX_TS 16

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

/* Random finite weights of the shape's type in each of `copies` copies. */
static void fill_weights(const struct shape *s, uint8_t *pool, uint64_t copies, uint64_t stride)
{
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
}

static int usage(void)
{
    fprintf(stderr, "usage: bench_kernels [--runs N] [--pool-mib N] [--only bf16|mx|f32|f16] [--shape RxC]\n"
                    "                     [--mode cold|warm|hot] [--threads 1|2] [--ts 1,2,4,...] [--version]\n");
    return 2;
}

/* "RxC" with both in 1..2^20 */
static int parse_shape(const char *a, uint64_t *r, uint64_t *c)
{
    char buf[48];
    const char *x = strchr(a, 'x');
    if (!x || (size_t)(x - a) >= sizeof buf)
        return -1;
    memcpy(buf, a, (size_t)(x - a));
    buf[x - a] = '\0';
    return parse_u64(buf, 1, 1u << 20, r) || parse_u64(x + 1, 1, 1u << 20, c) ? -1 : 0;
}

/* "1,2,4" into Ts (each 1..1024, at most MAX_TS) */
static int parse_ts(const char *a, uint32_t *Ts, size_t *n)
{
    char buf[128];
    if (strlen(a) >= sizeof buf)
        return -1;
    strcpy(buf, a);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        uint64_t v;
        if (*n == MAX_TS || parse_u64(tok, 1, 1024, &v))
            return -1;
        Ts[(*n)++] = (uint32_t)v;
    }
    return *n ? 0 : -1;
}

int main(int argc, char **argv)
{
    uint64_t runs = 7, pool_mib = 1024, sr = 0, sc = 0;
    const char *only = NULL;
    int modes = 1 | 4, th_lo = 1, th_hi = 2;               /* mode bits: 1 cold, 2 warm, 4 hot */
    uint32_t Ts[MAX_TS] = {1, 2, 4, 8, 16, 32, 64};
    size_t nts = 7;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--version")) {
            printf("bench_kernels (kernels: %s)\n", k3_kern_name());
            return 0;
        }
        if (!v)
            return usage();
        i++;
        if (!strcmp(a, "--runs")) {
            if (parse_u64(v, 3, 1000, &runs)) {
                fprintf(stderr, "bench_kernels: error: --runs wants 3..1000\n");
                return 2;
            }
        } else if (!strcmp(a, "--pool-mib")) {
            if (parse_u64(v, 64, 65536, &pool_mib)) {
                fprintf(stderr, "bench_kernels: error: --pool-mib wants 64..65536\n");
                return 2;
            }
        } else if (!strcmp(a, "--only")) {
            only = v;
        } else if (!strcmp(a, "--shape")) {
            if (parse_shape(v, &sr, &sc)) {
                fprintf(stderr, "bench_kernels: error: --shape wants RxC, e.g. 4096x14336\n");
                return 2;
            }
        } else if (!strcmp(a, "--mode")) {
            modes = !strcmp(v, "cold") ? 1 : !strcmp(v, "warm") ? 2 : !strcmp(v, "hot") ? 4 : 0;
            if (!modes) {
                fprintf(stderr, "bench_kernels: error: --mode wants cold, warm or hot\n");
                return 2;
            }
        } else if (!strcmp(a, "--threads")) {
            uint64_t t;
            if (parse_u64(v, 1, 2, &t)) {
                fprintf(stderr, "bench_kernels: error: --threads wants 1 or 2\n");
                return 2;
            }
            th_lo = th_hi = (int)t;
        } else if (!strcmp(a, "--ts")) {
            if (parse_ts(v, Ts, &nts)) {
                fprintf(stderr, "bench_kernels: error: --ts wants a list like 1,16,64 (1..1024, at most %d)\n", MAX_TS);
                return 2;
            }
        } else {
            return usage();
        }
    }
    /* the shapes to run: built-ins (of --shape's size, if given), else the
     * given shape for every kind --only allows */
    struct shape run[NSHAPES + 4];
    size_t nrun = 0;
    for (size_t i = 0; i < NSHAPES; i++)
        if ((!only || !strcmp(only, kind_opt[shapes[i].mx])) && (!sr || (shapes[i].rows == sr && shapes[i].cols == sc)))
            run[nrun++] = shapes[i];
    if (sr && !nrun)
        for (int k = 0; k < 4; k++)
            if ((!only || !strcmp(only, kind_opt[k])) && (k != W_MX || sc % 32 == 0))
                run[nrun++] = (struct shape){k, sr, sc};
    if (!nrun) {
        fprintf(stderr, "bench_kernels: error: nothing to run (--only names bf16, mx, f32 or f16; MXFP4 wants C %% 32 == 0)\n");
        return 2;
    }
    uint32_t maxT = 1;
    for (size_t i = 0; i < nts; i++)
        maxT = Ts[i] > maxT ? Ts[i] : maxT;

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
    double peak[3] = {0};
    for (int th = th_lo; th <= th_hi; th++) {
        const char *what;
        peak[th] = fma_peak(th, &what);
        printf("fma peak, %d thread%s: %.1f GFLOP/s (%s, f32, registers only)\n", th, th > 1 ? "s" : "", peak[th], what);
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
           "the wall triad / read probes, ratio of GFLOP/s to the fma peak of as many threads;\n"
           "cpu (1 thread only): the same from the thread's CPU time against the cpu-time probes\n\n");
    printf("%-5s %-10s %-4s %2s %3s %9s %17s %7s %7s %5s %5s %5s | %8s %7s %7s %5s %5s\n", "kind",
           "shape", "mode", "th", "T", "ms", "(min-max)", "GB/s", "GFLOP/s", "/trd", "/read", "/fma",
           "cpu ms", "GB/s", "GFLOP/s", "/trd", "/read");

    /* medians kept for the summary: [shape][mode][threads-1][T index] */
    static double med_wall[NSHAPES + 4][3][2][MAX_TS];
    double *times = malloc(runs * sizeof *times), *cpus = malloc(runs * sizeof *cpus);
    for (size_t si = 0; si < nrun; si++) {
        const struct shape *s = &run[si];
        uint64_t bytes = weight_bytes(s, s->rows);
        uint64_t stride = (bytes + 4095) / 4096 * 4096;
        uint64_t copies = modes & 1 ? pool_mib * (1ull << 20) / stride : 1;
        if (copies < 2)
            copies = 2;
        uint8_t *pool = k3_io_huge_alloc(copies * stride);
        float *X = k3_io_alloc_aligned((uint64_t)maxT * s->cols * sizeof(float), 64);
        float *Y = k3_io_alloc_aligned((uint64_t)maxT * s->rows * sizeof(float), 64);
        if (!pool || !X || !Y) {
            fprintf(stderr, "bench_kernels: error: cannot allocate %llu copies of %llu bytes\n",
                    (unsigned long long)copies, (unsigned long long)stride);
            return 6;
        }
        fill_weights(s, pool, copies, stride);
        for (uint64_t i = 0; i < (uint64_t)maxT * s->cols; i++)
            X[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
        char name[48];
        snprintf(name, sizeof name, "%llux%llu", (unsigned long long)s->rows, (unsigned long long)s->cols);
        for (int mode = 0; mode < 3; mode++) {
            if (!(modes & (1 << mode)))
                continue;
            int hot = mode == 2;
            for (int th = th_lo; th <= th_hi; th++) {
                omp_set_num_threads(th);
                /* hot: about 1 MiB of weights per thread, repeated */
                uint64_t rows = s->rows;
                if (hot) {
                    uint64_t per_row = weight_bytes(s, 1);
                    rows = (1ull << 20) / per_row * (uint64_t)th;
                    rows = rows / 32 * 32;
                    if (rows > s->rows || rows == 0)
                        rows = s->rows;
                    /* a contiguous slice with its scales right after it */
                    if (s->mx == W_MX)
                        memmove(pool + rows * s->cols / 2, pool + s->rows * s->cols / 2, rows * s->cols / 32);
                }
                for (size_t ti = 0; ti < nts; ti++) {
                    uint32_t T = Ts[ti];
                    uint64_t next = 0, ncopy = mode == 0 ? copies : 1;
                    call(s, pool + (next++ % ncopy) * stride, rows, X, T, Y);
                    for (uint64_t k = 0; k < runs; k++) {
                        const uint8_t *w = pool + (next++ % ncopy) * stride;
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
                    med_wall[si][mode][th - 1][ti] = med;
                    int mem = mode == 0;            /* the stream ratios mean something */
                    printf("%-5s %-10s %-4s %2d %3u %9.3f %17s %7.1f %7.1f %5.2f %5.2f %5.2f | ",
                           kind_name[s->mx], name, mode == 0 ? "cold" : mode == 1 ? "warm" : "hot", th, T,
                           med * 1e3, mm, wb / med / 1e9, flop / med / 1e9,
                           mem ? wb / med / 1e9 / bw[th].triad : 0.0, mem ? wb / med / 1e9 / bw[th].read : 0.0,
                           peak[th] > 0 ? flop / med / 1e9 / peak[th] : 0.0);
                    if (th == 1)
                        printf("%8.3f %7.1f %7.1f %5.2f %5.2f\n", cmed * 1e3, wb / cmed / 1e9,
                               flop / cmed / 1e9, mem ? wb / cmed / 1e9 / bw[th].triad_cpu : 0.0,
                               mem ? wb / cmed / 1e9 / bw[th].read_cpu : 0.0);
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
    printf("\nsummary (wall): T=1 weight GB/s over the triad probe (cold), and GFLOP/s over\n"
           "the fma peak of as many threads for every T\n");
    static const char *const mname[] = {"cold", "warm", "hot"};
    for (size_t si = 0; si < nrun; si++) {
        const struct shape *s = &run[si];
        for (int mode = 0; mode < 3; mode++) {
            if (!(modes & (1 << mode)))
                continue;
            for (int th = th_lo; th <= th_hi; th++) {
                printf("%-5s %5llux%-5llu %-4s %d thread%s:", kind_name[s->mx], (unsigned long long)s->rows,
                       (unsigned long long)s->cols, mname[mode], th, th > 1 ? "s" : " ");
                if (mode == 0 && Ts[0] == 1)
                    printf(" T=1 %.2f of triad;", (double)weight_bytes(s, s->rows) / med_wall[si][0][th - 1][0] / 1e9 / bw[th].triad);
                uint64_t rows = s->rows;
                if (mode == 2) {
                    rows = (1ull << 20) / weight_bytes(s, 1) * (uint64_t)th / 32 * 32;
                    if (rows > s->rows || rows == 0)
                        rows = s->rows;
                }
                for (size_t ti = 0; ti < nts; ti++)
                    printf(" T=%u %.2f", Ts[ti], peak[th] > 0 ? 2.0 * (double)rows * (double)s->cols * Ts[ti] /
                                                                  med_wall[si][mode][th - 1][ti] / 1e9 / peak[th] : 0.0);
                printf("\n");
            }
        }
    }
    free(times);
    free(cpus);
    return 0;
}
