/*
 * t_kernels.c - the numeric kernels: conversions, MXFP4 quantization, and
 * every instruction-set path of the products against the scalar contract in
 * kernels/ref.c, bit for bit, on odd shapes and hostile values; thread-count
 * independence; the ISA choice.
 */
#include "k3_err.h"
#include "k3_kern.h"
#include "k3_test.h"
#include "../kernels/kern_impl.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers -------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void) { return k3t_xorshift(&rng_state); }

static float rnd_float(void) /* roughly N(0,1)-ish, uniform in [-2, 2) */
{
    return (float)((double)(rnd() >> 11) * 0x1p-53 * 4.0 - 2.0);
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Every SIMD path of either architecture; each test runs those this build
 * holds and this CPU runs (k3_kern_supported). */
static const char *const isas[] = {"avx2", "avx512", "neon"};
#define N_ISAS (sizeof isas / sizeof *isas)

/* The best path this build and CPU have, as k3_kern_init picks it. */
static const char *best_isa(void)
{
    return k3_kern_supported("avx512") ? "avx512" : k3_kern_supported("avx2") ? "avx2"
         : k3_kern_supported("neon")   ? "neon"   : "scalar";
}

/* First index where two float arrays differ in bits, or -1. */
static long first_diff(const float *a, const float *b, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (bits(a[i]) != bits(b[i]))
            return (long)i;
    return -1;
}

/* ---- conversions ---------------------------------------------------------- */

K3_TEST(kern_bf16_rounds_to_nearest_even)
{
    CHECK_EQ_INT(k3_f32_to_bf16(1.0f), 0x3f80);
    CHECK_EQ_INT(k3_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);          /* tie, even stays */
    CHECK_EQ_INT(k3_f32_to_bf16(1.0f + 0x1p-7f + 0x1p-8f), 0x3f82); /* tie, odd goes up */
    CHECK_EQ_INT(k3_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    CHECK_EQ_INT(k3_f32_to_bf16(-0.0f), 0x8000);
    CHECK_EQ_INT(k3_f32_to_bf16(INFINITY), 0x7f80);
    CHECK_EQ_INT(k3_f32_to_bf16(0x1.fffffep127f), 0x7f80);          /* rounds up to inf */
    CHECK_EQ_INT(k3_f32_to_bf16(from_bits(0x00010000u)), 0x0001);   /* subnormal kept */
    CHECK_EQ_INT(k3_f32_to_bf16(from_bits(0x00018000u)), 0x0002);   /* subnormal tie to even */
    uint16_t nan = k3_f32_to_bf16(from_bits(0x7f800001u));          /* payload only in low bits */
    CHECK(isnan(k3_bf16_to_f32(nan)));
    CHECK_EQ_INT(k3_f32_to_bf16(from_bits(0xffc00000u)), 0xffc0);
    /* every bf16 survives the round trip exactly */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = k3_bf16_to_f32((uint16_t)h);
        if (!isnan(f) && k3_f32_to_bf16(f) != h)
            CHECK_EQ_INT(k3_f32_to_bf16(f), h);
    }
    /* random floats: the result is one of the two neighbours and the nearer */
    for (int i = 0; i < 100000; i++) {
        float f = from_bits((uint32_t)rnd() & 0xff7fffffu);         /* finite */
        uint16_t b = k3_f32_to_bf16(f);
        uint16_t down = (uint16_t)(bits(f) >> 16);
        double lo = k3_bf16_to_f32(down), hi = k3_bf16_to_f32((uint16_t)(down + 1));
        if (isinf(hi))                                               /* overflow rounds as if 2^128 existed */
            hi = copysign(0x1p128, hi);
        double d_lo = fabs((double)f - lo), d_hi = fabs((double)f - hi);
        uint16_t want = d_lo < d_hi ? down : d_hi < d_lo ? (uint16_t)(down + 1)
                                                         : ((down & 1) ? (uint16_t)(down + 1) : down);
        if (b != want) {
            CHECK_EQ_INT(b, want);
            break;
        }
    }
    uint16_t src[3] = {0x3f80, 0xc000, 0x0001};
    float dst[3];
    k3_bf16_to_f32_n(src, dst, 3);
    CHECK(dst[0] == 1.0f && dst[1] == -2.0f && dst[2] == 0x1p-133f);
    uint16_t back[3];
    k3_f32_to_bf16_n(dst, back, 3);
    CHECK(!memcmp(back, src, sizeof src));
}

K3_TEST(kern_f16_and_fp8_decode_every_code)
{
    for (uint32_t h = 0; h < 65536; h++) {
        int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
        double want = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
        float got = k3_f16_to_f32((uint16_t)h);
        if (isnan(want)) {
            if (!isnan(got))
                CHECK(isnan(got));
            continue;
        }
        want = s ? -want : want;
        if ((double)got != want || !!signbit(got) != (s != 0)) {
            k3t_fail(__FILE__, __LINE__, "f16 %#x: %g != %g", h, got, want);
            break;
        }
    }
    for (uint32_t b = 0; b < 256; b++) {
        int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        float got = k3_f8e4m3_to_f32((uint8_t)b);
        if (e == 15 && m == 7) {
            CHECK(isnan(got));
            continue;
        }
        double want = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
        want = s ? -want : want;
        if ((double)got != want || !!signbit(got) != (s != 0))
            k3t_fail(__FILE__, __LINE__, "e4m3 %#x: %g != %g", b, got, want);
        float g2 = k3_f8e5m2_to_f32((uint8_t)b);
        CHECK(bits(g2) == bits(k3_f16_to_f32((uint16_t)(b << 8))) || (isnan(g2) && isnan(k3_f16_to_f32((uint16_t)(b << 8)))));
    }
    CHECK(k3_f8e4m3_to_f32(0x7e) == 448.0f);
    CHECK(k3_f8e5m2_to_f32(0x7b) == 57344.0f);
    CHECK(isinf(k3_f8e5m2_to_f32(0x7c)));
}

K3_TEST(kern_e2m1_and_e8m0_values)
{
    static const float want[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int i = 0; i < 16; i++)
        CHECK_EQ_INT(bits(k3_e2m1_value((uint8_t)i)), bits(want[i]));
    CHECK(signbit(k3_e2m1_value(8)));
    CHECK(k3_e2m1_value(0x17) == 6.0f);                              /* high bits ignored */
    CHECK(k3_e8m0_scale(127) == 1.0f);
    CHECK(k3_e8m0_scale(128) == 2.0f);
    CHECK(k3_e8m0_scale(254) == 0x1p127f);
    CHECK(k3_e8m0_scale(1) == 0x1p-126f);
    CHECK(k3_e8m0_scale(0) == 0x1p-127f);                            /* subnormal, not 0 */
    CHECK(k3_e8m0_scale(255) == 0.0f);
}

/* ---- MXFP4 quantization --------------------------------------------------- */

K3_TEST(kern_mx_quantize_follows_the_rule)
{
    float x[32] = {0};
    uint8_t p[16], s[1];
    /* amax 6 -> e = floor(log2 6) - 2 = 0 -> scale 127; ties to even */
    float vals[] = {6.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 7.0f, -0.3f, -0.0f, -100.0f};
    uint8_t want[] = {7, 0, 2, 2, 4, 4, 6, 6, 7, 9, 8, 15};
    for (int i = 0; i < 12; i++)
        x[i] = vals[i];
    x[8] = 5.5f;                                                     /* 5.5 -> 6 (nearer) */
    want[8] = 7;
    x[11] = -6.0f;
    k3_mx_quantize(x, 32, p, s);
    CHECK_EQ_INT(s[0], 127);
    for (int i = 0; i < 12; i++) {
        uint8_t nib = (i & 1) ? (uint8_t)(p[i / 2] >> 4) : (uint8_t)(p[i / 2] & 15);
        if (nib != want[i])
            k3t_fail(__FILE__, __LINE__, "value %g: nibble %u, want %u", x[i], nib, want[i]);
    }
    /* all zero (even -0) -> scale 0, nibbles 0 */
    memset(x, 0, sizeof x);
    x[3] = -0.0f;
    k3_mx_quantize(x, 32, p, s);
    CHECK_EQ_INT(s[0], 0);
    for (int i = 0; i < 16; i++)
        CHECK_EQ_INT(p[i], 0);
    /* saturation: amax 7 -> e = 0, 7 saturates at 6; tiny scale clamps at byte 0 */
    x[0] = 7.0f;
    k3_mx_quantize(x, 32, p, s);
    CHECK_EQ_INT(s[0], 127);
    CHECK_EQ_INT(p[0] & 15, 7);
    x[0] = 0x1p-140f;
    k3_mx_quantize(x, 32, p, s);
    CHECK_EQ_INT(s[0], 0);
    CHECK_EQ_INT(p[0] & 15, 0);                                      /* 2^-140 / 2^-127 rounds to 0 */
    x[0] = 0x1p127f;
    k3_mx_quantize(x, 32, p, s);
    CHECK_EQ_INT(s[0], 252);
    CHECK_EQ_INT(p[0] & 15, 6);
}

K3_TEST(kern_mx_quantize_round_trip_properties)
{
    enum { N = 32 * 512 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    uint8_t *p = malloc(N / 2), *s = malloc(N / 32), *p2 = malloc(N / 2), *s2 = malloc(N / 32);
    for (int i = 0; i < N; i++)
        x[i] = ldexpf(rnd_float(), (int)(rnd() % 40) - 20) * ((i % 97) == 0 ? 1e6f : 1.0f);
    k3_mx_quantize(x, N, p, s);
    k3_mx_dequantize(p, s, N, y);
    for (int g = 0; g < N / 32; g++) {
        float amax = 0;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(x[g * 32 + i]));
        double step = ldexp(1.0, (int)s[g] - 127);                  /* the group's unit */
        for (int i = 0; i < 32; i++) {
            double xi = x[g * 32 + i], yi = y[g * 32 + i];
            /* nearest grid point: the error is at most half the local spacing
             * (0.25 unit below 2 units ... 1 unit between 4 and 6) */
            double a = fabs(xi) / step;
            double half = a < 2 ? 0.25 : a < 4 ? 0.5 : 1.0;
            if (a <= 6 && fabs(xi - yi) > half * step * (1 + 1e-12)) {
                k3t_fail(__FILE__, __LINE__, "group %d elem %d: %g -> %g (unit %g)", g, i, xi, yi, step);
                goto out;
            }
            if (yi != 0 && !!signbit(yi) != !!signbit(xi)) {
                k3t_fail(__FILE__, __LINE__, "sign flipped: %g -> %g", xi, yi);
                goto out;
            }
        }
        /* amax lands in [4, 8) units: the scale uses the top of the grid */
        if (!(amax / step >= 4 && amax / step < 8))
            k3t_fail(__FILE__, __LINE__, "group %d: amax %g is %g units", g, amax, amax / step);
    }
    /* quantizing the dequantized values changes nothing */
    k3_mx_quantize(y, N, p2, s2);
    CHECK(!memcmp(p, p2, N / 2));
    CHECK(!memcmp(s, s2, N / 32));
out:
    free(x), free(y), free(p), free(s), free(p2), free(s2);
}

K3_TEST(kern_mx_quantize_returns_representable_bytes_unchanged)
{
    enum { G = 2000 };
    uint8_t *p = malloc(G * 16), *s = malloc(G), *p2 = malloc(G * 16), *s2 = malloc(G);
    float *x = malloc(G * 32 * sizeof *x);
    for (int g = 0; g < G; g++) {
        /* canonical: scale 0..252 (incl. subnormal results) and some |value| 4 or 6 */
        s[g] = (uint8_t)(g < 4 ? g : g < 8 ? 252 - (g - 4) : (int)(rnd() % 253));
        for (int i = 0; i < 16; i++)
            p[g * 16 + i] = (uint8_t)rnd();
        int k = (int)(rnd() % 32);
        uint8_t top = (uint8_t)(6 + (rnd() & 1) + (rnd() & 8));
        p[g * 16 + k / 2] = (k & 1) ? (uint8_t)((p[g * 16 + k / 2] & 0x0f) | (top << 4))
                                    : (uint8_t)((p[g * 16 + k / 2] & 0xf0) | top);
    }
    k3_mx_dequantize(p, s, G * 32, x);
    k3_mx_quantize(x, G * 32, p2, s2);
    CHECK(!memcmp(s, s2, G));
    CHECK(!memcmp(p, p2, G * 16));
    free(p), free(s), free(p2), free(s2), free(x);
}

/* ---- products: every path against the scalar contract -------------------- */

/* Random bf16 with the hostile cases mixed in: subnormals, -0, zeros. */
static uint16_t rnd_bf16(void)
{
    switch (rnd() % 16) {
    case 0: return (uint16_t)(rnd() & 0x807f);                      /* subnormal or +-0 */
    case 1: return 0x8000;                                           /* -0 */
    default: return k3_f32_to_bf16(rnd_float());
    }
}

static void fill_x(float *x, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) {
        switch (rnd() % 32) {
        case 0: x[i] = -0.0f; break;
        case 1: x[i] = from_bits((uint32_t)rnd() & 0x807fffffu); break; /* subnormal */
        case 2: x[i] = rnd_float() * 1e30f; break;
        default: x[i] = rnd_float();
        }
    }
}

/* Compare a path with scalar on W (rows x cols) for T vectors; returns 0 if equal. */
static int bf16_case(const char *isa, uint64_t rows, uint64_t cols, uint32_t T)
{
    uint16_t *W = malloc(rows * cols * sizeof *W + 2);
    float *X = malloc((uint64_t)T * cols * sizeof *X + 4);
    float *Y0 = malloc((uint64_t)T * rows * sizeof *Y0 + 4), *Y1 = malloc((uint64_t)T * rows * sizeof *Y1 + 4);
    for (uint64_t i = 0; i < rows * cols; i++)
        W[i] = rnd_bf16();
    fill_x(X, (uint64_t)T * cols);
    k3_kern_path_scalar.gemm_bf16_rows(W, rows, cols, X, T, Y0, 0, rows);
    memset(Y1, 0xff, (uint64_t)T * rows * sizeof *Y1);
    k3_kern_path_find(isa)->gemm_bf16_rows(W, rows, cols, X, T, Y1, 0, rows);
    long d = first_diff(Y0, Y1, (uint64_t)T * rows);
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "%s bf16 %llux%llu T=%u: Y[%ld] %a != scalar %a", isa,
                 (unsigned long long)rows, (unsigned long long)cols, T, d, Y1[d], Y0[d]);
    free(W), free(X), free(Y0), free(Y1);
    return d >= 0;
}

static void mx_fill(uint8_t *p, uint8_t *s, uint64_t rows, uint64_t cols)
{
    for (uint64_t i = 0; i < rows * cols / 2; i++)
        p[i] = (uint8_t)rnd();
    for (uint64_t i = 0; i < rows * cols / 32; i++) {
        switch (rnd() % 16) {
        case 0: s[i] = 0; break;
        case 1: s[i] = 255; break;
        case 2: s[i] = (uint8_t)(rnd() % 256); break;
        default: s[i] = (uint8_t)(120 + rnd() % 10);
        }
    }
}

static int mx_case(const char *isa, uint64_t rows, uint64_t cols, uint32_t T)
{
    uint8_t *p = malloc(rows * cols / 2 + 1), *s = malloc(rows * cols / 32 + 1);
    float *X = malloc((uint64_t)T * cols * sizeof *X + 4);
    float *Y0 = malloc((uint64_t)T * rows * sizeof *Y0 + 4), *Y1 = malloc((uint64_t)T * rows * sizeof *Y1 + 4);
    mx_fill(p, s, rows, cols);
    fill_x(X, (uint64_t)T * cols);
    k3_kern_path_scalar.gemm_mx_rows(p, s, rows, cols, X, T, Y0, 0, rows);
    memset(Y1, 0xff, (uint64_t)T * rows * sizeof *Y1);
    k3_kern_path_find(isa)->gemm_mx_rows(p, s, rows, cols, X, T, Y1, 0, rows);
    long d = first_diff(Y0, Y1, (uint64_t)T * rows);
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "%s mx %llux%llu T=%u: Y[%ld] %a != scalar %a", isa,
                 (unsigned long long)rows, (unsigned long long)cols, T, d, Y1[d], Y0[d]);
    free(p), free(s), free(X), free(Y0), free(Y1);
    return d >= 0;
}

static void every_path_matches_scalar(int mx)
{
    static const uint32_t Ts[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 64};
    int ran = 0;
    for (size_t k = 0; k < sizeof isas / sizeof *isas; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        ran++;
        for (int rep = 0; rep < 60; rep++) {
            uint64_t rows = 1 + rnd() % 13;
            uint64_t cols = mx ? 32 * (1 + rnd() % 9) : 1 + rnd() % 200;
            if (rep < 3)
                cols = mx ? 32 : (uint64_t)rep + 1;
            if (rep == 3)
                cols = mx ? 32 * 112 : 7168 + 5;
            if (rep == 4)
                cols = mx ? 32 * 260 : 12288 + 31;          /* past the T=1 stack buffer */
            uint32_t T = rep < 8 || rep % 3 == 0 ? 1 : Ts[rnd() % (sizeof Ts / sizeof *Ts)];
            if (rep == 5 || rep == 6) {                  /* several column chunks, T past 64 */
                rows = 8 + rep * 3;
                cols = mx ? 32 * (33 + (uint64_t)rep) : 700 + (uint64_t)rep;
                T = rep == 5 ? 70 : 13;
            }
            if ((mx ? mx_case : bf16_case)(isas[k], rows, cols, T))
                return;
        }
    }
    CHECK(ran > 0 || (!k3_kern_supported("avx2") && !k3_kern_supported("neon")));
}

K3_TEST(kern_bf16_every_path_bit_identical_to_scalar)
{
    every_path_matches_scalar(0);
}

K3_TEST(kern_mx_every_path_bit_identical_to_scalar)
{
    every_path_matches_scalar(1);
}

K3_TEST(kern_mx_avx512_shuffle_decode_bit_identical_to_scalar)
{
    if (!k3_kern_supported("avx512"))
        return;
    setenv("K3_MX_DECODE", "shuf", 1);
    for (int rep = 0; rep < 40; rep++)
        if (mx_case("avx512", 1 + rnd() % 11, 32 * (1 + rnd() % 7), (uint32_t)(1 + rnd() % 9)))
            return;
}

/* T = 1 on avx512 runs 8-row blocks without a scale-255 group through a loop
 * of its own (mx_t1_8_clean): scales here avoid 255 except where planted, so
 * that loop, its fallback for blocks with a 255, and the 4- and 1-row tails
 * all meet hostile scales (0 = subnormal weights, 254 = infinite ones) and
 * hostile activations. */
static int mx_t1_case(uint64_t rows, uint64_t cols, int plant255)
{
    uint64_t groups = cols / 32;
    uint8_t *p = malloc(rows * cols / 2), *s = malloc(rows * groups);
    float *X = malloc(cols * sizeof *X), *Y0 = malloc(rows * sizeof *Y0), *Y1 = malloc(rows * sizeof *Y1);
    for (uint64_t i = 0; i < rows * cols / 2; i++)
        p[i] = (uint8_t)rnd();
    for (uint64_t i = 0; i < rows * groups; i++) {
        switch (rnd() % 16) {
        case 0: s[i] = 0; break;
        case 1: s[i] = 254; break;
        case 2: s[i] = (uint8_t)(rnd() % 255); break;
        default: s[i] = (uint8_t)(118 + rnd() % 14);
        }
    }
    fill_x(X, cols);
    if (plant255) {             /* and inf there: a decoded zero weight would give NaN */
        uint64_t g = rnd() % groups;
        s[(rnd() % rows) * groups + g] = 255;
        X[g * 32 + rnd() % 32] = INFINITY;
    }
    k3_kern_path_scalar.gemm_mx_rows(p, s, rows, cols, X, 1, Y0, 0, rows);
    memset(Y1, 0xff, rows * sizeof *Y1);
    k3_kern_path_find("avx512")->gemm_mx_rows(p, s, rows, cols, X, 1, Y1, 0, rows);
    long d = first_diff(Y0, Y1, rows);
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "avx512 mx T=1 %llux%llu%s: Y[%ld] %a != scalar %a",
                 (unsigned long long)rows, (unsigned long long)cols, plant255 ? " (one 255)" : "",
                 d, Y1[d], Y0[d]);
    free(p), free(s), free(X), free(Y0), free(Y1);
    return d >= 0;
}

static void mx_t1_blocks_match_scalar(void)
{
    static const uint64_t gs[] = {1, 2, 15, 16, 17, 96, 112, 255, 256, 257};
    for (size_t k = 0; k < sizeof gs / sizeof *gs; k++)
        for (int rep = 0; rep < 4; rep++) {
            uint64_t rows = rep == 0 ? 8 : rep == 1 ? 16 : 8 + rnd() % 21;
            if (mx_t1_case(rows, 32 * gs[k], rep == 3))
                return;
        }
}

K3_TEST(kern_mx_avx512_t1_blocks_bit_identical_to_scalar)
{
    if (k3_kern_supported("avx512"))
        mx_t1_blocks_match_scalar();
}

K3_TEST(kern_mx_avx512_t1_checked_loop_forced_bit_identical_to_scalar)
{
    if (!k3_kern_supported("avx512"))
        return;
    setenv("K3_MX_T1", "checked", 1);
    mx_t1_blocks_match_scalar();
}

/* T > 1 on avx512 runs panels of 8 rows whose column chunk holds no scale
 * 255 through a decode-once loop of its own (mxb_* in gemm_avx512.c): scales
 * here avoid 255 except where planted, so that loop (its decoding first
 * block of 1 or 2 vectors, the later blocks of 1, 2 and 3), the fallback for
 * chunks with a 255 and the row tails all meet hostile scales (0, 254) and
 * activations, across several chunks and vector slices. */
static int mx_batched_case(uint64_t rows, uint64_t cols, uint32_t T, int plant255)
{
    uint64_t groups = cols / 32;
    uint8_t *p = malloc(rows * cols / 2), *s = malloc(rows * groups);
    float *X = malloc((uint64_t)T * cols * sizeof *X);
    float *Y0 = malloc((uint64_t)T * rows * sizeof *Y0), *Y1 = malloc((uint64_t)T * rows * sizeof *Y1);
    for (uint64_t i = 0; i < rows * cols / 2; i++)
        p[i] = (uint8_t)rnd();
    for (uint64_t i = 0; i < rows * groups; i++) {
        switch (rnd() % 16) {
        case 0: s[i] = 0; break;
        case 1: s[i] = 254; break;
        case 2: s[i] = (uint8_t)(rnd() % 255); break;
        default: s[i] = (uint8_t)(118 + rnd() % 14);
        }
    }
    fill_x(X, (uint64_t)T * cols);
    if (plant255) {             /* and inf there: a decoded zero weight would give NaN */
        uint64_t g = rnd() % groups;
        s[(rnd() % rows) * groups + g] = 255;
        for (uint32_t t = 0; t < T; t++)
            X[(uint64_t)t * cols + g * 32 + rnd() % 32] = INFINITY;
    }
    k3_kern_path_scalar.gemm_mx_rows(p, s, rows, cols, X, T, Y0, 0, rows);
    memset(Y1, 0xff, (uint64_t)T * rows * sizeof *Y1);
    k3_kern_path_find("avx512")->gemm_mx_rows(p, s, rows, cols, X, T, Y1, 0, rows);
    long d = first_diff(Y0, Y1, (uint64_t)T * rows);
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "avx512 mx T=%u %llux%llu%s: Y[%ld] %a != scalar %a", T,
                 (unsigned long long)rows, (unsigned long long)cols, plant255 ? " (one 255)" : "",
                 d, Y1[d], Y0[d]);
    free(p), free(s), free(X), free(Y0), free(Y1);
    return d >= 0;
}

static void mx_batched_blocks_match_scalar(void)
{
    static const uint64_t gs[] = {1, 15, 16, 17, 33, 112};
    static const uint32_t Ts[] = {2, 3, 4, 5, 6, 7, 16, 33, 64, 70};
    for (size_t k = 0; k < sizeof gs / sizeof *gs; k++)
        for (int rep = 0; rep < 5; rep++) {
            uint64_t rows = rep == 0 ? 8 : rep == 1 ? 16 : 8 + rnd() % 21;
            uint32_t T = Ts[(k * 5 + (size_t)rep) % (sizeof Ts / sizeof *Ts)];
            if (mx_batched_case(rows, 32 * gs[k], T, rep == 4))
                return;
        }
}

K3_TEST(kern_mx_avx512_batched_panels_bit_identical_to_scalar)
{
    if (k3_kern_supported("avx512"))
        mx_batched_blocks_match_scalar();
}

K3_TEST(kern_mx_avx512_batched_shuffle_decode_bit_identical_to_scalar)
{
    if (!k3_kern_supported("avx512"))
        return;
    setenv("K3_MX_DECODE", "shuf", 1);
    mx_batched_blocks_match_scalar();
}

K3_TEST(kern_mx_avx512_batched_checked_loop_forced_bit_identical_to_scalar)
{
    if (!k3_kern_supported("avx512"))
        return;
    setenv("K3_MX_BATCH", "checked", 1);
    mx_batched_blocks_match_scalar();
}

/* The scalar contract itself against an independent double-precision dot
 * product from dequantized / widened weights: close, and a decoder with the
 * nibbles swapped is not. */
K3_TEST(kern_mx_product_uses_low_nibble_for_even_element)
{
    enum { R = 8, C = 256, T = 3 };
    uint8_t p[R * C / 2], s[R * C / 32];
    float X[T * C], Y[T * R], deq[R * C];
    for (int i = 0; i < R * C / 2; i++)
        p[i] = (uint8_t)rnd();
    for (int i = 0; i < R * C / 32; i++)
        s[i] = (uint8_t)(124 + rnd() % 6);
    for (int i = 0; i < T * C; i++)
        X[i] = rnd_float();
    k3_mx_dequantize(p, s, R * C, deq);
    for (size_t k = 0; k < 1 + N_ISAS; k++) {
        const char *isa = k == 0 ? "scalar" : isas[k - 1];
        if (!k3_kern_supported(isa))
            continue;
        CHECK_EQ_INT(k3_kern_use(isa), 0);
        k3_gemm_mx_st(p, s, R, C, X, T, Y);
        double worst_ok = 0, best_swapped = INFINITY;
        for (int t = 0; t < T; t++)
            for (int r = 0; r < R; r++) {
                double d = 0, dsw = 0, mag = 0;
                for (int c = 0; c < C; c++) {
                    uint8_t b = p[(r * C + c) / 2];
                    uint8_t swapped = (c & 1) ? (uint8_t)(b & 15) : (uint8_t)(b >> 4);
                    double wsw = (double)k3_e2m1_value(swapped) * k3_e8m0_scale(s[(r * C + c) / 32]);
                    d += (double)deq[r * C + c] * X[t * C + c];
                    dsw += wsw * X[t * C + c];
                    mag += fabs((double)deq[r * C + c] * X[t * C + c]);
                }
                double y = Y[t * R + r];
                worst_ok = fmax(worst_ok, fabs(y - d) / mag);
                best_swapped = fmin(best_swapped, fabs(y - dsw) / mag);
            }
        if (!(worst_ok < 1e-6))
            k3t_fail(__FILE__, __LINE__, "%s: relative error %g against double", isa, worst_ok);
        if (!(best_swapped > 1e-3))
            k3t_fail(__FILE__, __LINE__, "%s: swapped-nibble decode is as close (%g)", isa, best_swapped);
    }
}

K3_TEST(kern_bf16_product_close_to_double)
{
    enum { R = 9, C = 1000, T = 5 };
    static uint16_t W[R * C];
    static float X[T * C], Y[T * R];
    for (int i = 0; i < R * C; i++)
        W[i] = k3_f32_to_bf16(rnd_float());
    for (int i = 0; i < T * C; i++)
        X[i] = rnd_float();
    k3_gemm_bf16(W, R, C, X, T, Y);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            double d = 0, mag = 0;
            for (int c = 0; c < C; c++) {
                d += (double)k3_bf16_to_f32(W[r * C + c]) * X[t * C + c];
                mag += fabs((double)k3_bf16_to_f32(W[r * C + c]) * X[t * C + c]);
            }
            if (fabs(Y[t * R + r] - d) > 1e-6 * mag)
                k3t_fail(__FILE__, __LINE__, "row %d t %d: %g vs %g", r, t, Y[t * R + r], d);
        }
}

/* Scale 255 contributes nothing even when X is inf or NaN there; a scale-0
 * group contributes its subnormal products; -0 weights keep their sign. */
K3_TEST(kern_mx_scale_255_skips_group_even_against_inf)
{
    enum { C = 96, R = 9, TMAX = 16 };
    uint8_t p[R * C / 2], s[R * 3];
    float X[TMAX * C], Y[1 + N_ISAS][TMAX * R];
    for (int i = 0; i < R * C / 2; i++)
        p[i] = 0x22;                                                 /* 1.0, 1.0 */
    for (int r = 0; r < R; r++)
        s[3 * r] = 127, s[3 * r + 1] = 255, s[3 * r + 2] = 0;
    for (int i = 0; i < TMAX * C; i++)
        X[i] = i % C == 40 ? INFINITY : i % C == 41 ? NAN : 1.0f;
    /* one row and T = 1, then 9 rows (a panel of 8 and a tail) at T > 1:
     * every product path and block shape meets the skipped group */
    static const uint32_t Ts[] = {1, 2, 3, 5, 16};
    for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
        uint32_t T = Ts[ti];
        uint64_t rows = T == 1 ? 1 : R;
        for (size_t k = 0; k < 1 + N_ISAS; k++) {
            const char *isa = k == 0 ? "scalar" : isas[k - 1];
            if (!k3_kern_supported(isa))
                continue;
            k3_kern_path_find(isa)->gemm_mx_rows(p, s, rows, C, X, T, Y[k], 0, rows);
            for (uint64_t o = 0; o < rows * T; o++)
                CHECK(Y[k][o] == 32.0f + 32 * 0x1p-127f);
        }
    }
    /* all -0 weights against +x: every lane stays +0 (+0 + -0); against -0
     * activations with an all -0 start the result is still +0 */
    memset(p, 0x88, sizeof p);
    s[1] = 127;
    for (size_t k = 0; k < 1 + N_ISAS; k++) {
        const char *isa = k == 0 ? "scalar" : isas[k - 1];
        if (!k3_kern_supported(isa))
            continue;
        for (int i = 0; i < C; i++)
            X[i] = 1.0f;
        k3_kern_path_find(isa)->gemm_mx_rows(p, s, 1, C, X, 1, Y[k], 0, 1);
        CHECK_EQ_INT(bits(Y[k][0]), 0);
    }
}

/* A lane can become -0 (a tiny negative product rounds to -0 in fmaf); the
 * next -0 weight must then keep it -0, which a +0 decode of nibble 8 would
 * not. This pins the sign of zero through every path. */
K3_TEST(kern_negative_zero_lanes_survive_every_path)
{
    enum { C = 64 };
    uint8_t p[C / 2], s[2] = {0, 0};
    uint16_t W[C];
    float X[C], Y0, Y1;
    memset(p, 0x99, 16);                                             /* group 0: -0.5 */
    memset(p + 16, 0x88, 16);                                        /* group 1: -0 */
    for (int i = 0; i < C; i++)
        X[i] = 0x1p-100f;                                            /* products underflow */
    for (int i = 0; i < C; i++)
        W[i] = i < 32 ? k3_f32_to_bf16(-0x1p-100f) : 0x8000;
    k3_kern_path_scalar.gemm_mx_rows(p, s, 1, C, X, 1, &Y0, 0, 1);
    CHECK(Y0 == 0.0f && signbit(Y0));                                /* -0 reached the output */
    for (size_t k = 0; k < N_ISAS; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        k3_kern_path_find(isas[k])->gemm_mx_rows(p, s, 1, C, X, 1, &Y1, 0, 1);
        CHECK_EQ_INT(bits(Y1), bits(Y0));
    }
    k3_kern_path_scalar.gemm_bf16_rows(W, 1, C - 3, X, 1, &Y0, 0, 1);
    CHECK(Y0 == 0.0f && signbit(Y0));
    for (size_t k = 0; k < N_ISAS; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        k3_kern_path_find(isas[k])->gemm_bf16_rows(W, 1, C - 3, X, 1, &Y1, 0, 1);
        CHECK_EQ_INT(bits(Y1), bits(Y0));
    }
}

/* ---- threads and dispatch ------------------------------------------------- */

K3_TEST(kern_results_identical_for_every_thread_count)
{
    enum { R = 301, C = 544, T = 5 };
    uint16_t *W = malloc(R * C * sizeof *W);
    uint8_t *p = malloc(R * C / 2), *s = malloc(R * C / 32);
    float *X = malloc(T * C * sizeof *X), *Y0 = malloc(T * R * 4), *Y1 = malloc(T * R * 4);
    float *M0 = malloc(T * R * 4), *M1 = malloc(T * R * 4);
    for (int i = 0; i < R * C; i++)
        W[i] = rnd_bf16();
    mx_fill(p, s, R, C);
    fill_x(X, T * C);
    k3_gemm_bf16_st(W, R, C, X, T, Y0);
    k3_gemm_mx_st(p, s, R, C, X, T, M0);
    for (int n = 1; n <= 5; n++) {
        omp_set_num_threads(n);
        memset(Y1, 0xff, T * R * 4);                                 /* NaN: a skipped row shows */
        memset(M1, 0xff, T * R * 4);
        k3_gemm_bf16(W, R, C, X, T, Y1);
        k3_gemm_mx(p, s, R, C, X, T, M1);
        CHECK_EQ_INT(first_diff(Y0, Y1, T * R), -1);
        CHECK_EQ_INT(first_diff(M0, M1, T * R), -1);
    }
    /* called from inside a parallel region: runs on the caller, same bits */
    omp_set_num_threads(2);
    int bad = 0;
#pragma omp parallel reduction(+ : bad)
    {
        float *Yt = malloc(T * R * 4);
        memset(Yt, 0xff, T * R * 4);
        k3_gemm_bf16(W, R, C, X, T, Yt);
        bad += first_diff(Y0, Yt, T * R) != -1;
        memset(Yt, 0xff, T * R * 4);
        k3_gemm_mx(p, s, R, C, X, T, Yt);
        bad += first_diff(M0, Yt, T * R) != -1;
        free(Yt);
    }
    CHECK_EQ_INT(bad, 0);
    free(W), free(p), free(s), free(X), free(Y0), free(Y1), free(M0), free(M1);
}

K3_TEST(kern_isa_forced_by_environment)
{
    setenv("K3_ISA", "scalar", 1);
    CHECK_STR_EQ(k3_kern_name(), "scalar (K3_ISA)");
    CHECK_EQ_INT(k3_kern_use("nonsense"), K3_EARG);
    CHECK_STR_EQ(k3_kern_name(), "scalar (K3_ISA)");
    CHECK_EQ_INT(k3_kern_use("scalar"), 0);
    CHECK_STR_EQ(k3_kern_name(), "scalar");
}

K3_TEST(kern_isa_avx512bf16_is_not_built_and_says_so)
{
    setenv("K3_ISA", "avx512bf16", 1);
    if (k3_kern_supported("avx512"))
        CHECK_STR_EQ(k3_kern_name(), "avx512 (K3_ISA=avx512bf16 not built)");
    else
        CHECK_STR_CONTAINS(k3_kern_name(), "(K3_ISA=avx512bf16 unavailable)");
    CHECK(!k3_kern_supported("avx512bf16"));
}

K3_TEST(kern_isa_unknown_forced_name_falls_back_and_says_so)
{
    setenv("K3_ISA", "sve", 1);
    CHECK_STR_CONTAINS(k3_kern_name(), "(K3_ISA=sve unavailable)");
    /* the fallback is the best path this CPU has */
    char best[32];
    snprintf(best, sizeof best, "%s ", best_isa());
    CHECK(!strncmp(k3_kern_name(), best, strlen(best)));
}

/* Degenerate shapes do nothing harmful; unaligned buffers give the same bits. */
K3_TEST(kern_products_accept_empty_shapes_and_unaligned_buffers)
{
    float y[4] = {1, 1, 1, 1};
    uint16_t w1[4] = {0};
    uint8_t p1[16] = {0}, s1[1] = {127};
    k3_gemm_bf16(w1, 2, 0, y, 2, y);                                 /* cols 0: Y = +0 */
    CHECK_EQ_INT(bits(y[0]), 0);
    CHECK_EQ_INT(bits(y[3]), 0);
    y[0] = 5;
    k3_gemm_bf16(w1, 0, 4, y, 1, y);                                 /* rows 0: nothing */
    k3_gemm_mx(p1, s1, 1, 32, y, 0, y);                              /* T 0: nothing */
    CHECK(y[0] == 5);
    enum { R = 7, C = 261, T = 3 };
    uint16_t *W = malloc((R * C + 1) * 2);
    uint8_t *P = malloc(R * 256 / 2 + 1), *S = malloc(R * 256 / 32 + 1);
    float *X = malloc((T * C + 1) * 4), *Y0 = malloc(T * R * 4), *Y1 = malloc((T * R + 1) * 4);
    for (int i = 0; i < R * C + 1; i++)
        W[i] = rnd_bf16();
    mx_fill(P, S, R, 256);
    P[R * 128] = 0x77, S[R * 8] = 127;
    fill_x(X, T * C + 1);
    for (size_t k = 0; k < sizeof isas / sizeof *isas; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        for (uint32_t t = 1; t <= T; t += 2) {
            k3_kern_path_scalar.gemm_bf16_rows(W + 1, R, C, X + 1, t, Y0, 0, R);
            k3_kern_path_find(isas[k])->gemm_bf16_rows(W + 1, R, C, X + 1, t, Y1 + 1, 0, R);
            CHECK_EQ_INT(first_diff(Y0, Y1 + 1, t * R), -1);
            k3_kern_path_scalar.gemm_mx_rows(P + 1, S + 1, R, 256, X + 1, t, Y0, 0, R);
            k3_kern_path_find(isas[k])->gemm_mx_rows(P + 1, S + 1, R, 256, X + 1, t, Y1 + 1, 0, R);
            CHECK_EQ_INT(first_diff(Y0, Y1 + 1, t * R), -1);
        }
    }
    free(W), free(P), free(S), free(X), free(Y0), free(Y1);
}

/* Every tool's --version names the kernel path, and K3_ISA forcing reaches it. */
K3_TEST(every_tool_version_names_the_kernel_and_crc_paths)
{
    static const char *tools[] = {"k3-convert", "k3-verify", "k3-pack", "k3-synth", "k3-run"};
    for (size_t i = 0; i < sizeof tools / sizeof *tools; i++) {
        char *out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "%s --version", tools[i]), 0);
        CHECK_STR_CONTAINS(out, tools[i]);
        CHECK_STR_CONTAINS(out, "kernels: ");
        CHECK_STR_CONTAINS(out, "crc32: ");
        free(out);
        out = NULL;
        CHECK_EQ_INT(k3t_runf(&out, NULL, "K3_ISA=scalar %s --version", tools[i]), 0);
        CHECK_STR_CONTAINS(out, "kernels: scalar");
        free(out);
    }
}

/* ---- F32 and F16 weights ------------------------------------------------- */

/* Random IEEE half with the hostile cases mixed in: subnormals, -0, the
 * largest finite values, infinities. */
static uint16_t rnd_f16(void)
{
    switch (rnd() % 32) {
    case 0: return (uint16_t)(rnd() & 0x83ff);                      /* subnormal or +-0 */
    case 1: return 0x8000;                                           /* -0 */
    case 2: return (uint16_t)(0x7bff | (rnd() & 0x8000));            /* +-65504 */
    case 3: return (uint16_t)(0x7c00 | (rnd() & 0x8000));            /* +-inf */
    default: return (uint16_t)((rnd() & 0x8000) | (0x3000 + rnd() % 0x1800)); /* ~2^-3 .. 2^3 */
    }
}

static float rnd_f32w(void)
{
    switch (rnd() % 32) {
    case 0: return from_bits((uint32_t)rnd() & 0x807fffffu);        /* subnormal or +-0 */
    case 1: return -0.0f;
    case 2: return rnd_float() * 1e30f;
    default: return rnd_float() * 0.1f;
    }
}

/* One path against scalar for a T x cols times rows x cols product of type
 * f16 (f16 = 1) or f32; returns 1 on a difference. */
static int wf_case(const char *isa, int f16, uint64_t rows, uint64_t cols, uint32_t T)
{
    uint64_t n = rows * cols;
    void *W = malloc(n * (f16 ? 2 : 4) + 4);
    float *X = malloc((uint64_t)T * cols * sizeof *X + 4);
    float *Y0 = malloc((uint64_t)T * rows * sizeof *Y0 + 4), *Y1 = malloc((uint64_t)T * rows * sizeof *Y1 + 4);
    for (uint64_t i = 0; i < n; i++) {
        if (f16)
            ((uint16_t *)W)[i] = rnd_f16();
        else
            ((float *)W)[i] = rnd_f32w();
    }
    fill_x(X, (uint64_t)T * cols);
    const k3_kern_path *p = k3_kern_path_find(isa);
    memset(Y1, 0xff, (uint64_t)T * rows * sizeof *Y1);
    if (f16) {
        k3_kern_path_scalar.gemm_f16_rows(W, rows, cols, X, T, Y0, 0, rows);
        p->gemm_f16_rows(W, rows, cols, X, T, Y1, 0, rows);
    } else {
        k3_kern_path_scalar.gemm_f32_rows(W, rows, cols, X, T, Y0, 0, rows);
        p->gemm_f32_rows(W, rows, cols, X, T, Y1, 0, rows);
    }
    long d = first_diff(Y0, Y1, (uint64_t)T * rows);
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "%s %s %llux%llu T=%u: Y[%ld] %a != scalar %a", isa, f16 ? "f16" : "f32",
                 (unsigned long long)rows, (unsigned long long)cols, T, d, Y1[d], Y0[d]);
    free(W), free(X), free(Y0), free(Y1);
    return d >= 0;
}

/* Every T from 1 to 70 (every tile remainder of every path), odd row counts
 * (row-block tails), odd column counts (lane tails), a few long rows. */
static void wf_every_path(int f16)
{
    int ran = 0;
    for (size_t k = 0; k < sizeof isas / sizeof *isas; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        ran++;
        CHECK(k3_kern_path_find(isas[k])->gemm_f32_rows && k3_kern_path_find(isas[k])->gemm_f16_rows);
        for (uint32_t T = 1; T <= 70; T++) {
            uint64_t rows = 1 + rnd() % 11, cols = 1 + rnd() % 150;
            if (T <= 3)
                cols = T;                                            /* fewer columns than a vector */
            if (wf_case(isas[k], f16, rows, cols, T))
                return;
        }
        static const uint64_t shapes[][3] = {{5, 7168 + 5, 1}, {9, 2048 + 31, 1}, {3, 1000, 17}, {13, 33, 1},
                                             {16, 64, 5}, {1, 12288 + 1, 2}};
        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
            if (wf_case(isas[k], f16, shapes[i][0], shapes[i][1], (uint32_t)shapes[i][2]))
                return;
    }
    CHECK(ran > 0 || !k3_kern_supported("avx2"));
}

K3_TEST(kern_f32_every_path_bit_identical_to_scalar)
{
    wf_every_path(0);
}

K3_TEST(kern_f16_every_path_bit_identical_to_scalar)
{
    wf_every_path(1);
}

/* The scalar F32 and F16 products are the bf16 contract with another
 * widening: the same weights given as bf16, as f32 (widened) and as f16
 * (values chosen exactly representable in all three) give the same bits on
 * every path, including the threaded entry points. */
K3_TEST(kern_f32_f16_follow_the_bf16_contract)
{
    enum { R = 37, C = 301, T = 6 };
    uint16_t *Wb = malloc(R * C * 2), *Wh = malloc(R * C * 2);
    float *Wf = malloc(R * C * 4), *X = malloc(T * C * 4);
    float *Y[4];
    for (int i = 0; i < 4; i++)
        Y[i] = malloc(T * R * 4);
    for (int i = 0; i < R * C; i++) {
        /* 8 significant bits and a small exponent: exact in bf16 and in f16 */
        float v = (float)((int)(rnd() % 256) - 128) * ldexpf(1.0f, (int)(rnd() % 8) - 10);
        Wf[i] = v;
        Wb[i] = k3_f32_to_bf16(v);
        Wh[i] = (uint16_t)0;
    }
    for (int i = 0; i < R * C; i++) {
        /* f16 bits of Wf[i], found by search over the exact conversion */
        uint32_t u = bits(Wf[i]);
        uint16_t s = (uint16_t)((u >> 16) & 0x8000u);
        if ((u & 0x7fffffffu) == 0) {
            Wh[i] = s;
            continue;
        }
        int ex = (int)((u >> 23) & 0xff) - 127;
        Wh[i] = (uint16_t)(s | (uint16_t)((ex + 15) << 10) | (uint16_t)((u >> 13) & 0x3ff));
        CHECK(bits(k3_f16_to_f32(Wh[i])) == u);
    }
    fill_x(X, T * C);
    static const char *const all[] = {"scalar", "avx2", "avx512", "neon"};
    for (size_t k = 0; k < sizeof all / sizeof *all; k++) {
        if (!k3_kern_supported(all[k]))
            continue;
        CHECK_EQ_INT(k3_kern_use(all[k]), 0);
        k3_gemm_bf16(Wb, R, C, X, T, Y[0]);
        k3_gemm_f32(Wf, R, C, X, T, Y[1]);
        k3_gemm_f16(Wh, R, C, X, T, Y[2]);
        k3_gemm_f32_st(Wf, R, C, X, T, Y[3]);
        CHECK_EQ_INT(first_diff(Y[0], Y[1], T * R), -1);
        CHECK_EQ_INT(first_diff(Y[0], Y[2], T * R), -1);
        CHECK_EQ_INT(first_diff(Y[0], Y[3], T * R), -1);
        k3_gemm_f16_st(Wh, R, C, X, T, Y[3]);
        CHECK_EQ_INT(first_diff(Y[0], Y[3], T * R), -1);
    }
    free(Wb), free(Wh), free(Wf), free(X);
    for (int i = 0; i < 4; i++)
        free(Y[i]);
}

K3_TEST(kern_f32_f16_identical_for_every_thread_count)
{
    enum { R = 301, C = 544, T = 5 };
    uint16_t *Wh = malloc(R * C * 2);
    float *Wf = malloc(R * C * 4), *X = malloc(T * C * 4);
    float *A0 = malloc(T * R * 4), *A1 = malloc(T * R * 4), *B0 = malloc(T * R * 4), *B1 = malloc(T * R * 4);
    for (int i = 0; i < R * C; i++) {
        Wh[i] = rnd_f16();
        Wf[i] = rnd_f32w();
    }
    fill_x(X, T * C);
    k3_gemm_f32_st(Wf, R, C, X, T, A0);
    k3_gemm_f16_st(Wh, R, C, X, T, B0);
    for (int n = 1; n <= 5; n++) {
        omp_set_num_threads(n);
        memset(A1, 0xff, T * R * 4);
        memset(B1, 0xff, T * R * 4);
        k3_gemm_f32(Wf, R, C, X, T, A1);
        k3_gemm_f16(Wh, R, C, X, T, B1);
        CHECK_EQ_INT(first_diff(A0, A1, T * R), -1);
        CHECK_EQ_INT(first_diff(B0, B1, T * R), -1);
    }
    free(Wh), free(Wf), free(X), free(A0), free(A1), free(B0), free(B1);
}

/* Every one of the 65536 halves, widened by F16C on the SIMD paths and by
 * k3_f16_to_f32 in ref.c, as a 1-column matrix times x = 1: Y is the
 * widened weight (-0 comes out +0: the lanes start at +0). */
K3_TEST(kern_f16_widening_matches_f16c_on_every_half)
{
    enum { N = 65536 };
    uint16_t *W = malloc(N * 2);
    float X[1] = {1.0f}, *Y0 = malloc(N * 4), *Y1 = malloc(N * 4);
    for (uint32_t h = 0; h < N; h++)
        W[h] = (uint16_t)h;
    k3_kern_path_scalar.gemm_f16_rows(W, N, 1, X, 1, Y0, 0, N);
    for (uint32_t h = 0; h < N; h++) {
        float w = k3_f16_to_f32((uint16_t)h);
        if (isnan(w) ? !isnan(Y0[h]) : bits(Y0[h]) != bits(w + 0.0f))
            k3t_fail(__FILE__, __LINE__, "half %04x: scalar %a, widened %a", h, Y0[h], w);
    }
    for (size_t k = 0; k < sizeof isas / sizeof *isas; k++) {
        if (!k3_kern_supported(isas[k]))
            continue;
        k3_kern_path_find(isas[k])->gemm_f16_rows(W, N, 1, X, 1, Y1, 0, N);
        for (uint32_t h = 0; h < N; h++)
            if (isnan(Y0[h]) ? !isnan(Y1[h]) : bits(Y0[h]) != bits(Y1[h]))
                k3t_fail(__FILE__, __LINE__, "%s half %04x: %a != scalar %a", isas[k], h, Y1[h], Y0[h]);
    }
    free(W), free(Y0), free(Y1);
}
