/*
 * t_kernels_batch.c - the batched products (T > 1) of every instruction-set
 * path against kernels/ref.c, bit for bit: every T from 1 to 70 for bf16,
 * f16, f32 and MXFP4, row counts that leave partial row tiles and panels,
 * column counts that leave partial chunks and lane tails, MXFP4 matrices with
 * and without scale-255 groups (the two decode routes of gemm_avx2.c), row
 * ranges that start and end inside a panel, and outputs that must stay -0.
 */
#include "k3_kern.h"
#include "k3_test.h"
#include "../kernels/kern_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t bt_state = 0x2545f4914f6cdd1dull;

static uint64_t bt_rnd(void) { return k3t_xorshift(&bt_state); }

static float bt_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* uniform in [-2, 2), with -0, subnormals and huge values now and then */
static float bt_x(void)
{
    switch (bt_rnd() % 32) {
    case 0: return -0.0f;
    case 1: return bt_from_bits((uint32_t)bt_rnd() & 0x807fffffu);
    case 2: return (float)((int64_t)(bt_rnd() % 4000) - 2000) * 1e27f;
    default: return (float)((int64_t)(bt_rnd() % 4000) - 2000) / 1000.0f;
    }
}

static const char *const bt_isas[] = {"avx2", "avx512", "neon"};
enum { BT_BF16, BT_F16, BT_F32, BT_MX };
static const char *const bt_name[] = {"bf16", "f16", "f32", "mxfp4"};

/* W for rows x cols of type k; mx255: 0 no scale-255 group, 1 rare, 2 often */
static void *bt_weights(int k, uint64_t rows, uint64_t cols, int mx255)
{
    uint64_t n = rows * cols;
    if (k == BT_MX) {
        uint8_t *p = malloc(n / 2 + n / 32 + 1), *s = p + n / 2;
        for (uint64_t i = 0; i < n / 2; i++)
            p[i] = (uint8_t)bt_rnd();
        for (uint64_t i = 0; i < n / 32; i++) {
            uint64_t u = bt_rnd() % 1000;
            s[i] = (uint8_t)(u < 30 ? bt_rnd() % 255 : 118 + u % 12);
            if ((mx255 == 1 && u == 999) || (mx255 == 2 && u >= 930))
                s[i] = 255;
        }
        return p;
    }
    if (k == BT_F32) {
        float *w = malloc(n * 4 + 4);
        for (uint64_t i = 0; i < n; i++)
            w[i] = bt_x() * 0.25f;
        return w;
    }
    uint16_t *h = malloc(n * 2 + 2);
    for (uint64_t i = 0; i < n; i++) {
        uint16_t u = (uint16_t)bt_rnd();
        h[i] = k == BT_BF16 ? (uint16_t)((u & 0x807f) | (0x3b00 + (u >> 7 & 0xf) * 0x80))
                            : (uint16_t)((u & 0x83ff) | (0x2c00 + (u >> 10 & 0xf) * 0x400));
        if (u % 61 == 0)
            h[i] &= 0x8000 | (k == BT_BF16 ? 0x7f : 0x3ff);            /* subnormal or +-0 */
    }
    return h;
}

static void bt_run(const k3_kern_path *p, int k, const void *W, uint64_t rows, uint64_t cols,
                   const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    if (k == BT_MX)
        p->gemm_mx_rows(W, (const uint8_t *)W + rows * cols / 2, rows, cols, X, T, Y, r0, r1);
    else if (k == BT_F32)
        p->gemm_f32_rows(W, rows, cols, X, T, Y, r0, r1);
    else if (k == BT_F16)
        p->gemm_f16_rows(W, rows, cols, X, T, Y, r0, r1);
    else
        p->gemm_bf16_rows(W, rows, cols, X, T, Y, r0, r1);
}

/* One case: rows [r0, r1) of a path against scalar; rows outside the range
 * must keep their sentinel. Returns 1 on a difference (reported). */
static int bt_case(const char *isa, int k, uint64_t rows, uint64_t cols, uint32_t T, int mx255,
                   uint64_t r0, uint64_t r1)
{
    void *W = bt_weights(k, rows, cols, mx255);
    float *X = malloc((uint64_t)T * cols * sizeof *X + 4);
    uint64_t ny = (uint64_t)T * rows;
    float *Y0 = malloc(ny * sizeof *Y0 + 4), *Y1 = malloc(ny * sizeof *Y1 + 4);
    for (uint64_t i = 0; i < (uint64_t)T * cols; i++)
        X[i] = bt_x();
    memset(Y0, 0xff, ny * sizeof *Y0);
    memset(Y1, 0xff, ny * sizeof *Y1);
    bt_run(&k3_kern_path_scalar, k, W, rows, cols, X, T, Y0, r0, r1);
    bt_run(k3_kern_path_find(isa), k, W, rows, cols, X, T, Y1, r0, r1);
    long d = -1;
    for (uint64_t i = 0; i < ny && d < 0; i++)
        if (memcmp(&Y0[i], &Y1[i], sizeof *Y0))
            d = (long)i;
    if (d >= 0)
        k3t_fail(__FILE__, __LINE__, "%s %s %llux%llu T=%u rows [%llu,%llu) 255:%d: Y[t=%ld][r=%ld] %a != scalar %a",
                 isa, bt_name[k], (unsigned long long)rows, (unsigned long long)cols, T,
                 (unsigned long long)r0, (unsigned long long)r1, mx255, d / (long)rows,
                 d % (long)rows, Y1[d], Y0[d]);
    free(W), free(X), free(Y0), free(Y1);
    return d >= 0;
}

/* Every T from 1 to 70, random odd shapes; every third case a row range. */
static void bt_every_t(int k)
{
    for (size_t a = 0; a < sizeof bt_isas / sizeof *bt_isas; a++) {
        if (!k3_kern_supported(bt_isas[a]))
            continue;
        for (uint32_t T = 1; T <= 70; T++) {
            uint64_t rows = 1 + bt_rnd() % 29;
            uint64_t cols = k == BT_MX ? 32 * (1 + bt_rnd() % 37) : 1 + bt_rnd() % 1100;
            uint64_t r0 = 0, r1 = rows;
            if (T % 3 == 0 && rows > 2) {
                r0 = bt_rnd() % (rows / 2);
                r1 = r0 + 1 + bt_rnd() % (rows - r0);
            }
            if (bt_case(bt_isas[a], k, rows, cols, T, (int)(T % 3), r0, r1))
                return;
        }
    }
}

K3_TEST(kern_batch_bf16_every_t_bit_identical_to_scalar)
{
    bt_every_t(BT_BF16);
}

K3_TEST(kern_batch_f16_every_t_bit_identical_to_scalar)
{
    bt_every_t(BT_F16);
}

K3_TEST(kern_batch_f32_every_t_bit_identical_to_scalar)
{
    bt_every_t(BT_F32);
}

K3_TEST(kern_batch_mx_every_t_bit_identical_to_scalar)
{
    bt_every_t(BT_MX);
}

/* The K3 widths (slices of rows), every tile edge at once: 12-row panels
 * with 1-row leftovers, 16-group chunks with a partial last one, T past the
 * 32-vector slice. */
K3_TEST(kern_batch_k3_widths_bit_identical_to_scalar)
{
    static const struct { int k; uint64_t rows, cols; uint32_t T; } c[] = {
        {BT_MX, 29, 3584, 16}, {BT_MX, 13, 3072, 33}, {BT_MX, 25, 7168, 64}, {BT_MX, 7, 3584, 5},
        {BT_BF16, 29, 7168, 16}, {BT_BF16, 14, 7168 + 5, 64}, {BT_BF16, 5, 12288 + 31, 9},
        {BT_F16, 17, 7168, 16}, {BT_F32, 19, 7168 + 17, 16}, {BT_F32, 3, 544, 70},
    };
    for (size_t a = 0; a < sizeof bt_isas / sizeof *bt_isas; a++) {
        if (!k3_kern_supported(bt_isas[a]))
            continue;
        for (size_t i = 0; i < sizeof c / sizeof *c; i++)
            for (int m = 0; m < (c[i].k == BT_MX ? 3 : 1); m++)
                if (bt_case(bt_isas[a], c[i].k, c[i].rows, c[i].cols, c[i].T, m, 0, c[i].rows))
                    return;
    }
}

/* Products that underflow to -0 in every lane fold to -0; a path that adds a
 * +0 anywhere (padding, a skipped group, a tail lane) gives +0 instead. */
K3_TEST(kern_batch_negative_zero_outputs_survive)
{
    enum { R = 14, C = 32 * 17 + 9, T = 13 };
    uint16_t *W = malloc(R * C * sizeof *W);
    float *X = malloc(T * C * sizeof *X), *Y0 = malloc(T * R * sizeof *Y0), *Y1 = malloc(T * R * sizeof *Y1);
    for (int i = 0; i < R * C; i++)
        W[i] = 0x0d80;                                   /* bf16 ~1e-30 */
    for (int i = 0; i < T * C; i++)
        X[i] = -1e-30f;
    k3_kern_path_scalar.gemm_bf16_rows(W, R, C, X, T, Y0, 0, R);
    CHECK(Y0[0] == 0.0f && memcmp(&Y0[0], &(float){-0.0f}, 4) == 0);
    for (size_t a = 0; a < sizeof bt_isas / sizeof *bt_isas; a++) {
        if (!k3_kern_supported(bt_isas[a]))
            continue;
        memset(Y1, 0x55, T * R * sizeof *Y1);
        k3_kern_path_find(bt_isas[a])->gemm_bf16_rows(W, R, C, X, T, Y1, 0, R);
        CHECK(memcmp(Y0, Y1, T * R * sizeof *Y0) == 0);
    }
    /* MXFP4: the same with the smallest scale, some groups at 255 */
    uint8_t *P = malloc(R * 256 / 2 + R * 256 / 32), *S = P + R * 256 / 2;
    memset(P, 0x11, R * 256 / 2);                        /* every weight 0.5 * 2^-127 */
    for (int i = 0; i < R * 256 / 32; i++)
        S[i] = i % 8 % 3 == 2 ? 255 : 0;                 /* groups 2 and 5 of every row */
    for (int i = 0; i < T * 256; i++)
        X[i] = i % 7 == 0 && S[(i % 256) / 32] == 255 ? -INFINITY : -1e-30f;
    k3_kern_path_scalar.gemm_mx_rows(P, S, R, 256, X, T, Y0, 0, R);
    CHECK(memcmp(&Y0[1], &(float){-0.0f}, 4) == 0);
    for (size_t a = 0; a < sizeof bt_isas / sizeof *bt_isas; a++) {
        if (!k3_kern_supported(bt_isas[a]))
            continue;
        memset(Y1, 0x55, T * R * sizeof *Y1);
        k3_kern_path_find(bt_isas[a])->gemm_mx_rows(P, S, R, 256, X, T, Y1, 0, R);
        CHECK(memcmp(Y0, Y1, T * R * sizeof *Y0) == 0);
    }
    free(W), free(X), free(Y0), free(Y1), free(P);
}

/* Wide rows with many vectors: on avx512 the vectors then go in slices whose
 * X fits L2 and the rows in groups that run every slice (w_rows in
 * kernels/gemm_avx512.c); these shapes leave several groups, a short last
 * group, a long last slice, and row ranges that start inside a group. */
K3_TEST(kern_batch_vector_slices_and_row_groups_bit_identical_to_scalar)
{
    static const struct { int k; uint64_t rows, cols; uint32_t T; uint64_t r0, r1; } c[] = {
        {BT_BF16, 37, 14336 + 3, 16, 0, 37}, {BT_BF16, 37, 14336 + 3, 16, 5, 33},
        {BT_F32, 27, 4099, 40, 0, 27}, {BT_F16, 33, 9000, 20, 3, 30},
        {BT_BF16, 41, 7168, 64, 2, 41},
    };
    for (size_t a = 0; a < sizeof bt_isas / sizeof *bt_isas; a++) {
        if (!k3_kern_supported(bt_isas[a]))
            continue;
        for (size_t i = 0; i < sizeof c / sizeof *c; i++)
            if (bt_case(bt_isas[a], c[i].k, c[i].rows, c[i].cols, c[i].T, 0, c[i].r0, c[i].r1))
                return;
    }
}
