/*
 * gemm_avx2.c - the AVX2+FMA products, bit-identical to ref.c.
 *
 * The 32 contract lanes of one output are four ymm accumulators (lanes 0..7,
 * 8..15, 16..23, 24..31); fold32 adds them in the ref.c tree order. A column
 * tail (cols not a multiple of 32) goes through zero-padded copies and a blend
 * that leaves lanes past the end untouched, as ref.c does no fmaf for them.
 *
 * f16 and f32 weights run the bf16 tiles with another widening step (F16C
 * vcvtph2ps, or a plain load): same lanes, same order.
 *
 * MXFP4 decode, 8 weights at a time: vpsrlvd (after a vpshufb when T > 1)
 * brings each weight's nibble to the bottom of a dword, vpermps looks up the
 * magnitude (low 3 bits) in the group's row of k3_kern_mx_table8x, and one xor
 * with the nibble shifted left by 28 restores the pre-xored bits and sets the
 * sign from bit 3 (so nibble 8 gives -0, exactly e2m1 * scale as in ref.c).
 * At T > 4 each row-group is decoded once per call (per 32 vectors) into a
 * small f32 buffer and multiplied from there (mx_batched).
 */
#include "k3_kern.h"
#include "kern_impl.h"

#include <immintrin.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

AI float fold32(const __m256 *a)
{
    __m256 s = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])); /* 16, 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  /* 4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                  /* 2 */
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));                              /* 1 */
    return _mm_cvtss_f32(d);
}

AI __m256 bf16x8(const uint16_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* lane mask for lanes k*8 .. k*8+7 of a tail with n valid columns */
AI __m256 tail_mask(uint64_t n, int k)
{
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i lim = _mm256_set1_epi32((int)n - k * 8);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, idx));
}

/* ---- bf16, f16, f32 -------------------------------------------------------- */

/* The three weight types share one tile: DT (a constant in every caller)
 * picks how 8 weights are widened to f32; everything else, including the
 * lane of every column, is the same code. */
enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };

AI uint64_t dt_size(const int DT)
{
    return DT == DT_F32 ? 4 : 2;
}

AI __m256 w8(const void *p, const int DT)
{
    if (DT == DT_F32)
        return _mm256_loadu_ps((const float *)p);
    if (DT == DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));   /* exact (F16C) */
    return bf16x8((const uint16_t *)p);
}

AI void w_tile(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y,
               uint64_t r, uint32_t t0, const int R, const int TB, const int DT)
{
    const uint64_t es = dt_size(DT);
    __m256 acc[2][2][4];
    const char *w[2];
    const float *x[2];
#pragma GCC unroll 2
    for (int i = 0; i < R; i++) {
        w[i] = (const char *)W + (r + (uint64_t)i) * cols * es;
#pragma GCC unroll 2
        for (int j = 0; j < TB; j++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                acc[i][j][k] = _mm256_setzero_ps();
    }
#pragma GCC unroll 2
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;

    /* fetch the next block of R rows (contiguous) while this one runs, on the
     * first pass over these rows only: R * es / 2 lines of it per 32 columns */
    const char *pf = NULL;
    if (t0 == 0 && R >= 2 && r + 2 * (uint64_t)R <= rows)
        pf = (const char *)W + (r + (uint64_t)R) * cols * es;
    const uint64_t pl = (uint64_t)R * es / 2;
    uint64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
        if (pf)
#pragma GCC unroll 4
            for (uint64_t i = 0; i < pl; i++)
                _mm_prefetch(pf + (c / 32 * pl + i) * 64, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256 wv = w8(w[i] + (c + 8 * (uint64_t)k) * es, DT);
#pragma GCC unroll 2
                for (int j = 0; j < TB; j++)
                    acc[i][j][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[j] + c + 8 * k), acc[i][j][k]);
            }
        }
    }
    if (c < cols) {
        uint64_t n = cols - c;
        _Alignas(32) char wt[32 * 4];
        float xt[32];
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
            memset(wt, 0, sizeof wt);
            memcpy(wt, w[i] + c * es, n * es);
#pragma GCC unroll 2
            for (int j = 0; j < TB; j++) {
                memset(xt, 0, sizeof xt);
                memcpy(xt, x[j] + c, n * sizeof *xt);
                for (int k = 0; k < 4; k++) {
                    __m256 f = _mm256_fmadd_ps(w8(wt + 8 * (uint64_t)k * es, DT), _mm256_loadu_ps(xt + 8 * k), acc[i][j][k]);
                    acc[i][j][k] = _mm256_blendv_ps(acc[i][j][k], f, tail_mask(n, k));
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
        for (int j = 0; j < TB; j++)
            Y[(uint64_t)(t0 + (uint32_t)j) * rows + r + (uint64_t)i] = fold32(acc[i][j]);
}

/* One function per (type, tile shape), so that R, TB and DT are constants. */
#define W_TILES(N, DT)                                                                                       \
    static void N##_2x1(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, \
                        uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 2, 1, DT); }                      \
    static void N##_1x1(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, \
                        uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 1, 1, DT); }                      \
    static void N##_1x2(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, \
                        uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 1, 2, DT); }
W_TILES(bf16_tile, DT_BF16)
W_TILES(f16_tile, DT_F16)
W_TILES(f32_tile, DT_F32)

typedef void (*w_tile_fn)(const void *, uint64_t, uint64_t, const float *, float *, uint64_t, uint32_t);

AI void w_rows(const void *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y,
               uint64_t r0, uint64_t r1, w_tile_fn t2x1, w_tile_fn t1x1, w_tile_fn t1x2)
{
    uint64_t r = r0;
    if (T == 1) {
        for (; r + 2 <= r1; r += 2)
            t2x1(W, rows, cols, X, Y, r, 0);
        for (; r < r1; r++)
            t1x1(W, rows, cols, X, Y, r, 0);
        return;
    }
    for (; r < r1; r++) {
        uint32_t t = 0;
        for (; t + 2 <= T; t += 2)
            t1x2(W, rows, cols, X, Y, r, t);
        if (t < T)
            t1x1(W, rows, cols, X, Y, r, t);
    }
}

static void avx2_gemm_bf16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                                const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, bf16_tile_2x1, bf16_tile_1x1, bf16_tile_1x2);
}

static void avx2_gemm_f16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                               const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, f16_tile_2x1, f16_tile_1x1, f16_tile_1x2);
}

static void avx2_gemm_f32_rows(const float *W, uint64_t rows, uint64_t cols,
                               const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, f32_tile_2x1, f32_tile_1x1, f32_tile_1x2);
}

/* ---- MXFP4 ---------------------------------------------------------------- */

/* tab8 is a k3_kern_mx_table8x row: the xor with idx << 28 undoes its
 * pre-xored bits 28..30 and supplies the sign from the nibble's bit 3. */
AI __m256 mx_weights8(__m256i bytes, __m256i ctrl, __m256 tab8)
{
    const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    __m256i idx = _mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, ctrl), shift);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(tab8, idx),
                         _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

AI void mx_tile(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                const float *X, float *Y, uint64_t r, uint32_t t0, const int R, const int TB)
{
    /* chunk k (weights 8k..8k+7): dword j takes byte 4k + j/2 (lane-relative:
     * the 16 bytes are in both 128-bit lanes), other bytes zeroed */
    const __m256i Z = _mm256_set1_epi32((int)0x80808000u);
    const __m256i ctrl[4] = {
        _mm256_or_si256(Z, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
        _mm256_or_si256(Z, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)),
        _mm256_or_si256(Z, _mm256_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11)),
        _mm256_or_si256(Z, _mm256_setr_epi32(12, 12, 13, 13, 14, 14, 15, 15)),
    };
    uint64_t groups = cols / 32;
    __m256 acc[2][2][4];
    const float *x[2];
#pragma GCC unroll 2
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
        for (int j = 0; j < TB; j++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                acc[i][j][k] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;
    for (uint64_t g = 0; g < groups; g++) {
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
            uint8_t s = scales[(r + (uint64_t)i) * groups + g];
            if (s == 255)
                continue;
            __m256 tab8 = _mm256_load_ps((const float *)k3_kern_mx_table8x[s]);
            const uint8_t *p = packed + (r + (uint64_t)i) * (cols / 2) + g * 16;
            __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256 wv = mx_weights8(bytes, ctrl[k], tab8);
#pragma GCC unroll 2
                for (int j = 0; j < TB; j++)
                    acc[i][j][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[j] + g * 32 + 8 * k), acc[i][j][k]);
            }
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
        for (int j = 0; j < TB; j++)
            Y[(uint64_t)(t0 + (uint32_t)j) * rows + r + (uint64_t)i] = fold32(acc[i][j]);
}

static void mx_tile_2x1(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, uint32_t t0) { mx_tile(packed, scales, rows, cols, X, Y, r, t0, 2, 1); }
static void mx_tile_1x1(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, uint32_t t0) { mx_tile(packed, scales, rows, cols, X, Y, r, t0, 1, 1); }
static void mx_tile_1x2(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *X, float *Y, uint64_t r, uint32_t t0) { mx_tile(packed, scales, rows, cols, X, Y, r, t0, 1, 2); }

/*
 * T > 1: decode once, multiply many. For a panel of MXB_PANEL rows and a
 * chunk of MXB_CHUNK groups, every row-group is decoded once (mx_weights8)
 * into wbuf, exact f32 weights in element order; then each block of up to 3
 * vectors runs a 1-row x TB tile (4 TB accumulators, the row's 4 weight
 * vectors in registers, x as FMA operands) over every row of the panel, so
 * the block's slice of X stays in L1 for the panel. A group with scale 255
 * is marked in skip[] and its FMAs are left out, as in ref.c. The lanes live
 * in accb between chunks; each lane takes its columns in increasing order.
 * Stack: accb 16 KiB + wbuf 8 KiB.
 */
#define MXB_PANEL 4
#define MXB_CHUNK 16
#define MXB_TSLICE 32

AI void mxb_tile(const float *wb, const uint8_t *skip, const float *X, uint64_t cols,
                 uint64_t c0, uint32_t t, float *accb, uint64_t ng, const int TB)
{
    __m256 acc[3][4];
    const float *x[3];
#pragma GCC unroll 3
    for (int j = 0; j < TB; j++) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            acc[j][k] = _mm256_load_ps(accb + (uint64_t)j * 32 + 8 * (uint64_t)k);
        x[j] = X + (uint64_t)(t + (uint32_t)j) * cols + c0;
    }
    for (uint64_t g = 0; g < ng; g++) {
        if (skip[g])
            continue;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256 w = _mm256_load_ps(wb + g * 32 + 8 * (uint64_t)k);
#pragma GCC unroll 3
            for (int j = 0; j < TB; j++)
                acc[j][k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + g * 32 + 8 * (uint64_t)k), acc[j][k]);
        }
    }
#pragma GCC unroll 3
    for (int j = 0; j < TB; j++)
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            _mm256_store_ps(accb + (uint64_t)j * 32 + 8 * (uint64_t)k, acc[j][k]);
}

typedef void (*mxb_tile_fn)(const float *, const uint8_t *, const float *, uint64_t, uint64_t,
                            uint32_t, float *, uint64_t);
static void mxb_tile_1(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t ng) { mxb_tile(wb, skip, X, cols, c0, t, accb, ng, 1); }
static void mxb_tile_2(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t ng) { mxb_tile(wb, skip, X, cols, c0, t, accb, ng, 2); }
static void mxb_tile_3(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t ng) { mxb_tile(wb, skip, X, cols, c0, t, accb, ng, 3); }

/* Decodes groups [g0, g1) of rows [r, r + np) into wbuf; skip[i][g] = scale 255.
 * The same groups of the next panel (rows r + MXB_PANEL.., if below r_end)
 * are fetched meanwhile, and its scales with the first chunk: short rows
 * defeat the hardware prefetchers. */
static void mxb_decode(const uint8_t *packed, const uint8_t *scales, uint64_t cols, uint64_t r,
                       uint64_t np, uint64_t r_end, uint64_t g0, uint64_t g1, float *wbuf,
                       uint8_t *skip)
{
    const __m256i Z = _mm256_set1_epi32((int)0x80808000u);
    const __m256i ctrl[4] = {
        _mm256_or_si256(Z, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
        _mm256_or_si256(Z, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)),
        _mm256_or_si256(Z, _mm256_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11)),
        _mm256_or_si256(Z, _mm256_setr_epi32(12, 12, 13, 13, 14, 14, 15, 15)),
    };
    uint64_t groups = cols / 32;
    uint64_t rn = r + 2 * MXB_PANEL <= r_end ? r + MXB_PANEL : r;
    for (uint64_t b = 0; g0 == 0 && b < MXB_PANEL * groups; b += 64)
        _mm_prefetch((const char *)(scales + rn * groups) + b, _MM_HINT_T0);
    for (uint64_t i = 0; i < np; i++) {
        const uint8_t *sc = scales + (r + i) * groups, *p = packed + (r + i) * (cols / 2);
        const char *pn = (const char *)(packed + (rn + i) * (cols / 2));
        for (uint64_t g = g0; g < g1; g++) {
            if ((g & 3) == 0)
                _mm_prefetch(pn + g * 16, _MM_HINT_T0);
            float *o = wbuf + (i * MXB_CHUNK + (g - g0)) * 32;
            skip[i * MXB_CHUNK + (g - g0)] = sc[g] == 255;
            __m256 tab8 = _mm256_load_ps((const float *)k3_kern_mx_table8x[sc[g]]);
            __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + g * 16)));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                _mm256_store_ps(o + 8 * k, mx_weights8(bytes, ctrl[k], tab8));
        }
    }
}

static void mx_batched(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                       uint64_t cols, const float *X, uint32_t T, float *Y, uint64_t r0,
                       uint64_t r1)
{
    static const mxb_tile_fn tiles[4] = {0, mxb_tile_1, mxb_tile_2, mxb_tile_3};
    _Alignas(32) float accb[MXB_PANEL * MXB_TSLICE * 32];
    _Alignas(32) float wbuf[MXB_PANEL * MXB_CHUNK * 32];
    uint8_t skip[MXB_PANEL * MXB_CHUNK];
    uint64_t groups = cols / 32;
    /* panels outside, vector slices inside: weights come from memory once */
    for (uint64_t rp = r0; rp < r1; rp += MXB_PANEL) {
        uint64_t np = r1 - rp < MXB_PANEL ? r1 - rp : MXB_PANEL;
        for (uint32_t ts = 0; ts < T; ts += MXB_TSLICE) {
            uint32_t nt = T - ts < MXB_TSLICE ? T - ts : MXB_TSLICE;
            memset(accb, 0, np * nt * 32 * sizeof(float));
            for (uint64_t g0 = 0; g0 < groups; g0 += MXB_CHUNK) {
                uint64_t g1 = groups - g0 < MXB_CHUNK ? groups : g0 + MXB_CHUNK;
                mxb_decode(packed, scales, cols, rp, np, r1, g0, g1, wbuf, skip);
                for (uint32_t t = 0; t < nt;) {
                    /* blocks of 3, the last ones 2 + 2 rather than 3 + 1 */
                    uint32_t left = nt - t, tb = left == 4 || left == 2 ? 2 : left >= 3 ? 3 : 1;
                    for (uint64_t i = 0; i < np; i++)
                        tiles[tb](wbuf + i * MXB_CHUNK * 32, skip + i * MXB_CHUNK, X, cols,
                                  g0 * 32, ts + t, accb + (i * nt + t) * 32, g1 - g0);
                    t += tb;
                }
            }
            for (uint64_t i = 0; i < np; i++)
                for (uint32_t t = 0; t < nt; t++) {
                    const float *a = accb + (i * nt + t) * 32;
                    __m256 v[4] = {_mm256_load_ps(a), _mm256_load_ps(a + 8), _mm256_load_ps(a + 16),
                                   _mm256_load_ps(a + 24)};
                    Y[(uint64_t)(ts + t) * rows + rp + i] = fold32(v);
                }
        }
    }
}

/*
 * T = 1 (decode-bound): as in gemm_avx512.c, the activation vector is
 * permuted once per call so that weights come out of the cheapest decode in
 * x's order: the group's 16 bytes broadcast to both 128-bit lanes, one
 * vpsrlvd selecting nibble 2k+L (L = lane) of dword m, i.e. element
 * 2*(4m + k) + L, for vector k = 0..3 and dword j = 4L + m. Accumulators are
 * put back into contract lane order through a 32-float array before the fold.
 */
#define MX_T1_MAX_COLS 8192

static uint8_t mx_t1_elem(int k, int j) /* element of vector k, dword j */
{
    return (uint8_t)(2 * (4 * (j % 4) + k) + j / 4);
}

AI void mx_t1_tile(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *xp, float *Y, uint64_t r, uint64_t r_end, const int R)
{
    const __m256i sh[4] = {
        _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12),
        _mm256_setr_epi32(16, 16, 16, 16, 20, 20, 20, 20), _mm256_setr_epi32(24, 24, 24, 24, 28, 28, 28, 28),
    };
    uint64_t groups = cols / 32;
    __m256 acc[2][4];
    const uint8_t *p[2], *sc[2];
#pragma GCC unroll 2
    for (int i = 0; i < R; i++) {
        for (int k = 0; k < 4; k++)
            acc[i][k] = _mm256_setzero_ps();
        p[i] = packed + (r + (uint64_t)i) * (cols / 2);
        sc[i] = scales + (r + (uint64_t)i) * groups;
    }
    /* short rows: fetch the next block of R rows (R*16 bytes per group) and
     * its scales while this block is decoded */
    const char *pf_p = NULL, *pf_s = NULL;
    if (R == 2 && r + 2 * (uint64_t)R <= r_end) {
        pf_p = (const char *)(packed + (r + (uint64_t)R) * (cols / 2));
        pf_s = (const char *)(scales + (r + (uint64_t)R) * groups);
    }
    for (uint64_t g = 0; g < groups; g++) {
        if (pf_p) {
            if ((g & 1) == 0)
                _mm_prefetch(pf_p + g * 32, _MM_HINT_T0);
            if (g * 64 < (uint64_t)R * groups)
                _mm_prefetch(pf_s + g * 64, _MM_HINT_T0);
        }
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
            uint8_t s = sc[i][g];
            if (s == 255)
                continue;
            __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p[i] + g * 16)));
            __m256 tab8 = _mm256_load_ps((const float *)k3_kern_mx_table8x[s]);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256i idx = _mm256_srlv_epi32(v, sh[k]);
                __m256 w = _mm256_xor_ps(_mm256_permutevar8x32_ps(tab8, idx),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
                acc[i][k] = _mm256_fmadd_ps(w, _mm256_load_ps(xp + g * 32 + 8 * k), acc[i][k]);
            }
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; i++) {
        float lanes[32], perm[32];
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(perm + 8 * k, acc[i][k]);
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 8; j++)
                lanes[mx_t1_elem(k, j)] = perm[8 * k + j];
        __m256 nat[4];
        for (int k = 0; k < 4; k++)
            nat[k] = _mm256_loadu_ps(lanes + 8 * k);
        Y[r + (uint64_t)i] = fold32(nat);
    }
}

static void mx_t1_2(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *xp, float *Y, uint64_t r, uint64_t r_end) { mx_t1_tile(packed, scales, rows, cols, xp, Y, r, r_end, 2); }
static void mx_t1_1(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *xp, float *Y, uint64_t r, uint64_t r_end) { mx_t1_tile(packed, scales, rows, cols, xp, Y, r, r_end, 1); }

static void mx_t1_permute_x(const float *x, uint64_t cols, float *xp)
{
    for (uint64_t c = 0; c < cols; c += 32)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 8; j++)
                xp[c + 8 * (uint64_t)k + (uint64_t)j] = x[c + mx_t1_elem(k, j)];
}

static void avx2_gemm_mx_rows(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                              uint64_t cols, const float *X, uint32_t T, float *Y,
                              uint64_t r0, uint64_t r1)
{
    uint64_t r = r0;
    if (T == 1 && cols <= MX_T1_MAX_COLS) {
        _Alignas(32) float xp[MX_T1_MAX_COLS];
        mx_t1_permute_x(X, cols, xp);
        for (; r + 2 <= r1; r += 2)
            mx_t1_2(packed, scales, rows, cols, xp, Y, r, r1);
        for (; r < r1; r++)
            mx_t1_1(packed, scales, rows, cols, xp, Y, r, r1);
        return;
    }
    if (T == 1) {
        for (; r + 2 <= r1; r += 2)
            mx_tile_2x1(packed, scales, rows, cols, X, Y, r, 0);
        for (; r < r1; r++)
            mx_tile_1x1(packed, scales, rows, cols, X, Y, r, 0);
        return;
    }
    if (T > 4) {
        mx_batched(packed, scales, rows, cols, X, T, Y, r0, r1);
        return;
    }
    /* T <= 4: the decode is paid only twice per row-group here and the
     * whole-row tiles need no parked lanes; measured 3-9 % faster than
     * mx_batched at T = 4 (and 40 % slower at T = 16) */
    for (; r < r1; r++) {
        uint32_t t = 0;
        for (; t + 2 <= T; t += 2)
            mx_tile_1x2(packed, scales, rows, cols, X, Y, r, t);
        if (t < T)
            mx_tile_1x1(packed, scales, rows, cols, X, Y, r, t);
    }
}

const k3_kern_path k3_kern_path_avx2 = {
    .name = "avx2",
    .gemm_bf16_rows = avx2_gemm_bf16_rows,
    .gemm_mx_rows = avx2_gemm_mx_rows,
    .gemm_f32_rows = avx2_gemm_f32_rows,
    .gemm_f16_rows = avx2_gemm_f16_rows,
};
