/*
 * dispatch.c - chooses the instruction-set path once (CPUID or the kernel's
 * hardware capabilities, or K3_ISA), and runs the products over threads.
 *
 * Invariants: the path pointer is set exactly once by k3_kern_init (pthread
 * once) unless k3_kern_use changes it explicitly; a path is only ever chosen
 * when the CPU and the OS say its registers are usable (x86-64: CPUID and
 * XGETBV; aarch64: AT_HWCAP says Advanced SIMD). Each build holds the paths of
 * its own architecture only (the Makefile picks the files). Every path is
 * bit-identical to ref.c. An "avx512bf16" path (vdpbf16ps on activations
 * rounded to bf16) was built and measured: it was slower than the exact
 * avx512 path at every T on this machine and changed the numbers, so it was
 * dropped; K3_ISA=avx512bf16 runs avx512 and the name says so. Threads split
 * output rows into contiguous ranges; since every row is computed by the same
 * code whatever range it falls in, results do not depend on the thread count.
 * Inside an OpenMP parallel region the threaded forms run on the calling
 * thread only (no nested teams).
 */
#include "k3_err.h"
#include "k3_kern.h"
#include "kern_impl.h"

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- CPU features --------------------------------------------------------- */

struct cpu_caps {
    int avx2;       /* AVX2 + FMA + F16C + OS saves ymm */
    int avx512;     /* F + BW + VL + DQ + OS saves zmm/opmask */
    int neon;       /* aarch64 Advanced SIMD (with its fused multiply-add) */
};

#if defined(__x86_64__)
static unsigned long long xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static struct cpu_caps cpu_caps_probe(void)
{
    struct cpu_caps c = {0};
    unsigned int a, b, cx, d;
    if (!__get_cpuid(1, &a, &b, &cx, &d))
        return c;
    int osxsave = (cx >> 27) & 1, fma = (cx >> 12) & 1, f16c = (cx >> 29) & 1;
    if (!osxsave)
        return c;
    unsigned long long xcr0 = xgetbv0();
    int ymm_ok = (xcr0 & 0x6) == 0x6;
    int zmm_ok = (xcr0 & 0xe6) == 0xe6;
    if (__get_cpuid_max(0, NULL) < 7)
        return c;
    __cpuid_count(7, 0, a, b, cx, d);
    int avx2 = (b >> 5) & 1;
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    c.avx2 = ymm_ok && avx2 && fma && f16c;
    c.avx512 = c.avx2 && zmm_ok && f && dq && bw && vl;
    return c;
}
#elif defined(__aarch64__)
static struct cpu_caps cpu_caps_probe(void)
{
    struct cpu_caps c = {0};
#ifdef HWCAP_ASIMD
    c.neon = (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#endif
    return c;
}
#else
static struct cpu_caps cpu_caps_probe(void)
{
    struct cpu_caps c = {0};
    return c;
}
#endif

/* ---- emulation ------------------------------------------------------------ */

#if defined(__x86_64__)
#define BUILD_ARCH "x86_64"
#elif defined(__aarch64__)
#define BUILD_ARCH "aarch64"
#else
#define BUILD_ARCH NULL
#endif

static char g_host[64];
static pthread_once_t g_emu_once = PTHREAD_ONCE_INIT;

static void emu_once(void)
{
    FILE *f = fopen("/proc/sys/kernel/arch", "r");
    if (!f)
        return;
    char buf[64] = "";
    if (fgets(buf, sizeof buf, f)) {
        buf[strcspn(buf, "\n")] = '\0';
        if (BUILD_ARCH && buf[0] && strcmp(buf, BUILD_ARCH) != 0)
            snprintf(g_host, sizeof g_host, "%s", buf);
    }
    fclose(f);
}

const char *k3_kern_emulated(void)
{
    pthread_once(&g_emu_once, emu_once);
    return g_host[0] ? g_host : NULL;
}

/* ---- path choice ---------------------------------------------------------- */

static const k3_kern_path *g_path;
static char g_name[96];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

const k3_kern_path *k3_kern_path_find(const char *isa)
{
    struct cpu_caps c = cpu_caps_probe();
    if (!isa)
        return NULL;
    if (!strcmp(isa, "scalar"))
        return &k3_kern_path_scalar;
#if defined(__x86_64__)
    if (!strcmp(isa, "avx2"))
        return c.avx2 ? &k3_kern_path_avx2 : NULL;
    if (!strcmp(isa, "avx512"))
        return c.avx512 ? &k3_kern_path_avx512 : NULL;
#elif defined(__aarch64__)
    if (!strcmp(isa, "neon"))
        return c.neon ? &k3_kern_path_neon : NULL;
#endif
    (void)c;
    return NULL;
}

static const k3_kern_path *best_path(void)
{
    struct cpu_caps c = cpu_caps_probe();
#if defined(__x86_64__)
    if (c.avx512)
        return &k3_kern_path_avx512;
    if (c.avx2)
        return &k3_kern_path_avx2;
#elif defined(__aarch64__)
    if (c.neon)
        return &k3_kern_path_neon;
#endif
    (void)c;
    return &k3_kern_path_scalar;
}

static void init_once(void)
{
    const char *want = getenv("K3_ISA");
    const k3_kern_path *p = best_path();
    snprintf(g_name, sizeof g_name, "%s", p->name);
    if (want && *want) {
        const k3_kern_path *forced = k3_kern_path_find(want);
        if (forced) {
            p = forced;
            snprintf(g_name, sizeof g_name, "%s (K3_ISA)", p->name);
#if defined(__x86_64__)
        } else if (!strcmp(want, "avx512bf16") && p == &k3_kern_path_avx512) {
            snprintf(g_name, sizeof g_name, "%s (K3_ISA=avx512bf16 not built)", p->name);
#endif
        } else {
            snprintf(g_name, sizeof g_name, "%s (K3_ISA=%.40s unavailable)", p->name, want);
        }
    }
    g_path = p;
}

void k3_kern_init(void)
{
    pthread_once(&g_once, init_once);
}

const char *k3_kern_name(void)
{
    k3_kern_init();
    return g_name;
}

const k3_kern_path *k3_kern_path_current(void)
{
    k3_kern_init();
    return g_path;
}

int k3_kern_supported(const char *isa)
{
    return k3_kern_path_find(isa) != NULL;
}

int k3_kern_use(const char *isa)
{
    k3_kern_init();
    const k3_kern_path *p = k3_kern_path_find(isa);
    if (!p)
        return K3_EARG;
    g_path = p;
    snprintf(g_name, sizeof g_name, "%s", p->name);
    return 0;
}

/* ---- threaded products ---------------------------------------------------- */

/* Below this many multiply-adds a product is not worth waking a team. */
#define MIN_PARALLEL_MACS (1u << 18)

/* Rows [r0, r1) of thread i of n: contiguous, multiples of 16 rows so that the
 * paths keep their row blocks whole (this does not change any result). */
static void split_rows(uint64_t rows, int i, int n, uint64_t *r0, uint64_t *r1)
{
    uint64_t blocks = (rows + 15) / 16;
    uint64_t b0 = blocks * (uint64_t)i / (uint64_t)n, b1 = blocks * (uint64_t)(i + 1) / (uint64_t)n;
    *r0 = b0 * 16 < rows ? b0 * 16 : rows;
    *r1 = b1 * 16 < rows ? b1 * 16 : rows;
}

static int go_parallel(uint64_t rows, uint64_t cols, uint32_t T)
{
    if (omp_in_parallel() || omp_get_max_threads() < 2 || rows < 32)
        return 0;
    return (double)rows * (double)cols * (double)T >= (double)MIN_PARALLEL_MACS;
}

void k3_gemm_bf16(const uint16_t *W, uint64_t rows, uint64_t cols,
                  const float *X, uint32_t T, float *Y)
{
    const k3_kern_path *p = k3_kern_path_current();
    if (!go_parallel(rows, cols, T)) {
        p->gemm_bf16_rows(W, rows, cols, X, T, Y, 0, rows);
        return;
    }
#pragma omp parallel
    {
        uint64_t r0, r1;
        split_rows(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        if (r0 < r1)
            p->gemm_bf16_rows(W, rows, cols, X, T, Y, r0, r1);
    }
}

void k3_gemm_mx(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                const float *X, uint32_t T, float *Y)
{
    const k3_kern_path *p = k3_kern_path_current();
    if (!go_parallel(rows, cols, T)) {
        p->gemm_mx_rows(packed, scales, rows, cols, X, T, Y, 0, rows);
        return;
    }
#pragma omp parallel
    {
        uint64_t r0, r1;
        split_rows(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        if (r0 < r1)
            p->gemm_mx_rows(packed, scales, rows, cols, X, T, Y, r0, r1);
    }
}

void k3_gemm_bf16_st(const uint16_t *W, uint64_t rows, uint64_t cols,
                     const float *X, uint32_t T, float *Y)
{
    k3_kern_path_current()->gemm_bf16_rows(W, rows, cols, X, T, Y, 0, rows);
}

void k3_gemm_mx_st(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *X, uint32_t T, float *Y)
{
    k3_kern_path_current()->gemm_mx_rows(packed, scales, rows, cols, X, T, Y, 0, rows);
}

/* F32 and F16 weights: the same contract as bf16 (include/k3_kern.h). A path
 * without its own F32/F16 products uses the scalar ones. */
static k3_kern_f32_rows_fn f32_rows(const k3_kern_path *p)
{
    return p->gemm_f32_rows ? p->gemm_f32_rows : k3_kern_path_scalar.gemm_f32_rows;
}

static k3_kern_bf16_rows_fn f16_rows(const k3_kern_path *p)
{
    return p->gemm_f16_rows ? p->gemm_f16_rows : k3_kern_path_scalar.gemm_f16_rows;
}

void k3_gemm_f32(const float *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y)
{
    k3_kern_f32_rows_fn f = f32_rows(k3_kern_path_current());
    if (!go_parallel(rows, cols, T)) {
        f(W, rows, cols, X, T, Y, 0, rows);
        return;
    }
#pragma omp parallel
    {
        uint64_t r0, r1;
        split_rows(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        if (r0 < r1)
            f(W, rows, cols, X, T, Y, r0, r1);
    }
}

void k3_gemm_f16(const uint16_t *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y)
{
    k3_kern_bf16_rows_fn f = f16_rows(k3_kern_path_current());
    if (!go_parallel(rows, cols, T)) {
        f(W, rows, cols, X, T, Y, 0, rows);
        return;
    }
#pragma omp parallel
    {
        uint64_t r0, r1;
        split_rows(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        if (r0 < r1)
            f(W, rows, cols, X, T, Y, r0, r1);
    }
}

void k3_gemm_f32_st(const float *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y)
{
    f32_rows(k3_kern_path_current())(W, rows, cols, X, T, Y, 0, rows);
}

void k3_gemm_f16_st(const uint16_t *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y)
{
    f16_rows(k3_kern_path_current())(W, rows, cols, X, T, Y, 0, rows);
}
