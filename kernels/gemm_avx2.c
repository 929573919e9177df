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
 * MXFP4 decode, 8 weights at a time: vpsrlvd (after a vpshufb, or on a
 * broadcast dword when T > 4) brings each weight's nibble to the bottom of a
 * dword, vpermps looks up the magnitude (low 3 bits) in the group's row of
 * k3_kern_mx_table8x, and one xor with the nibble shifted left by 28
 * restores the pre-xored bits and sets the sign from bit 3 (so nibble 8
 * gives -0, exactly e2m1 * scale as in ref.c).
 * T > 1 (MXFP4: T > 4) runs b_rows: register tiles over one lane quarter
 * at a time, the weights decoded once per panel and chunk (see below).
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
                        uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 1, 1, DT); }
W_TILES(bf16_tile, DT_BF16)
W_TILES(f16_tile, DT_F16)
W_TILES(f32_tile, DT_F32)

typedef void (*w_tile_fn)(const void *, uint64_t, uint64_t, const float *, float *, uint64_t, uint32_t);

/* T = 1: row pairs, then the odd row (T > 1 runs b_rows). */
AI void w_rows(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y,
               uint64_t r0, uint64_t r1, w_tile_fn t2x1, w_tile_fn t1x1)
{
    uint64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        t2x1(W, rows, cols, X, Y, r, 0);
    for (; r < r1; r++)
        t1x1(W, rows, cols, X, Y, r, 0);
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

/* ---- T > 1: decode once per panel, register tiles per lane quarter -------- */

/*
 * Every output keeps 32 lanes, four ymm registers, so a tile holding all of
 * them fits only three outputs in the 16 registers. But the four quarters
 * (lanes 0..7, 8..15, 16..23, 24..31) never meet before the fold, so they are
 * computed one after the other: a register tile then holds one quarter of
 * R rows x TB vectors (R * TB = 12 accumulators, more than two FMA pipes of
 * 4-cycle latency need), loads R + TB operands per R * TB FMAs, and each lane
 * still takes its columns in increasing order.
 *
 * Loop order, per call: panels of BP rows (the weights come from memory
 * once); inside, slices of at most BTS vectors with the lanes of every output
 * of the slice parked in accb; inside, chunks of BCH groups (32 columns);
 * inside, blocks of at most BTB vectors (sizes balanced: 16 = 4 x 4, 7 = 4 + 3)
 * and for each block the panel's rows in tiles of R = 12 / TB (6 at TB = 1;
 * BP is a multiple of every R; leftover rows run 1-row tiles). The weights
 * of a chunk are stored as exact f32 in wbuf, quarter-major
 * ([row][quarter][group][8]), and every block reads them from there, so the
 * decode is paid once per slice: bf16 / f16 widening and f32 loads in the
 * first block of the chunk, among its FMAs; MXFP4 in a pass of its own
 * before the blocks (bmx_decode), which also flags scale-255 groups (their
 * chunks run tiles that leave those FMAs out, as in ref.c). A block's x
 * slice of a chunk (BTB * BCH * 128 bytes) and wbuf stay in L1. The weights
 * of the next chunk (the next panel's first after the last) are prefetched
 * during the decode. The bf16 / f16 / f32 column tail past the last full
 * group runs once per output with the blend of w_tile, then fold32. Stack:
 * accb 48 KiB, wbuf 24 KiB.
 *
 * Measured on 192 x 3584 MXFP4 and 48 x 7168 bf16 (L2-resident), 1 thread:
 * the quarter tiles with a separate decode pass took bf16 T = 16 from 52 to
 * 73 GFLOP/s; 4-vector blocks (3 x 4 tiles) rather than 6 (2 x 6) to 86;
 * the decode inside the first block to ~90 (MXFP4: 62 -> ~70). MXFP4
 * since (bench/README.md, 2026-12-07): its decoding tiles spilled two
 * accumulators (a store and reload in their FMA chains every group); a
 * separate pass with the shuffle-free mx_quarter8 and the prefetch took
 * 3072 x 3584 T = 16 on 1 thread from 0.56-0.61 to 0.64-0.66 of the FMA
 * peak in quiet runs (0.45-0.46 to 0.50-0.51 with the machine loaded).
 */
#define BP 12
#define BCH 16
#define BTS 32
#define BTB 4
#define WB_ROW (4 * BCH * 8)             /* floats of one row in wbuf */

/* The 8 MXFP4 weights of quarter q from the group's 4 bytes 4q..4q+3: with
 * the dword broadcast, nibble j (weight 8q + j, little-endian) is shifted
 * to the bottom of dword j, so no byte shuffle is needed (one op fewer
 * than mx_weights8, and the broadcast is a plain load). tab8 as there. */
AI __m256 mx_quarter8(const uint8_t *p, int q, __m256 tab8)
{
    const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    uint32_t d;
    memcpy(&d, p + 4 * q, sizeof d);
    __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)d), shift);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(tab8, idx),
                         _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* The quarter-q weights of one group of a dense type at src, widened. */
AI __m256 bq_weights(const uint8_t *src, int q, const int DT)
{
    return w8(src + 8 * (uint64_t)q * dt_size(DT), DT);
}

/*
 * One quarter q of an R x TB tile over ng groups. wb: row 0 of the tile,
 * quarter q, group 0 of the chunk in wbuf; x[j]: vector j at column c0 + 8q;
 * acc: the parked lanes of (row 0, vector 0, quarter q), rows ars floats
 * apart, vectors 32 floats apart. MODE 0 reads the weights from wbuf; MODE 1
 * too, leaving out the groups flagged in skip[i * BCH + g]; MODE 2 is the
 * first block of a chunk of a dense type: it widens the weights from src
 * (row 0 at the chunk's first column, rows srs bytes apart) while it
 * multiplies, and stores them to wbuf for the other blocks, so that the
 * widening runs among the FMAs instead of in a pass of its own; it also
 * prefetches the next chunk's rows (row 0 at pf, pfn of them, png groups
 * each; pf NULL: none).
 */
AI void bq_tile(const float *wb, const float *const *x, float *acc, uint64_t ars, uint64_t ng,
                const uint8_t *skip, const uint8_t *src, uint64_t srs, const uint8_t *pf,
                uint64_t pfn, uint64_t png, int q, const int R, const int TB, const int MODE,
                const int DT)
{
    const uint64_t gb = 32 * dt_size(DT);                /* bytes per group */
    /* the next chunk's weights for these rows (the hardware prefetchers
     * follow 12 row streams of 1-2 KiB poorly): lines q, q + 4, ... of each
     * row in quarter q's pass, so that the four passes cover the chunk */
    if (MODE == 2 && pf)
        for (uint64_t i = 0; i < (uint64_t)R && i < pfn; i++)
            for (uint64_t l = (uint64_t)q; l * 64 < png * gb; l += 4)
                _mm_prefetch((const char *)pf + i * srs + l * 64, _MM_HINT_T0);
    __m256 a[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            a[i][j] = _mm256_load_ps(acc + (uint64_t)i * ars + 32 * (uint64_t)j);
    for (uint64_t g = 0; g < ng; g++) {
        if (MODE == 1) {
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                if (skip[(uint64_t)i * BCH + g])
                    continue;
                __m256 w = _mm256_load_ps(wb + (uint64_t)i * WB_ROW + g * 8);
#pragma GCC unroll 4
                for (int j = 0; j < TB; j++)
                    a[i][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[j] + g * 32), a[i][j]);
            }
        } else if (R <= TB) {            /* the R weights in registers, x streamed */
            __m256 w[6];
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                if (MODE == 2) {
                    w[i] = bq_weights(src + (uint64_t)i * srs + g * gb, q, DT);
                    _mm256_store_ps((float *)wb + (uint64_t)i * WB_ROW + g * 8, w[i]);
                } else {
                    w[i] = _mm256_load_ps(wb + (uint64_t)i * WB_ROW + g * 8);
                }
            }
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++) {
                __m256 xv = _mm256_loadu_ps(x[j] + g * 32);
#pragma GCC unroll 6
                for (int i = 0; i < R; i++)
                    a[i][j] = _mm256_fmadd_ps(w[i], xv, a[i][j]);
            }
        } else {                         /* the TB x in registers, weights streamed */
            __m256 xv[4];
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++)
                xv[j] = _mm256_loadu_ps(x[j] + g * 32);
#pragma GCC unroll 6
            for (int i = 0; i < R; i++) {
                __m256 w;
                if (MODE == 2) {
                    w = bq_weights(src + (uint64_t)i * srs + g * gb, q, DT);
                    _mm256_store_ps((float *)wb + (uint64_t)i * WB_ROW + g * 8, w);
                } else {
                    w = _mm256_load_ps(wb + (uint64_t)i * WB_ROW + g * 8);
                }
#pragma GCC unroll 4
                for (int j = 0; j < TB; j++)
                    a[i][j] = _mm256_fmadd_ps(w, xv[j], a[i][j]);
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            _mm256_store_ps(acc + (uint64_t)i * ars + 32 * (uint64_t)j, a[i][j]);
}

/* The four quarters of an R x TB tile over one chunk (see bq_tile). */
struct b_args {
    const float *X;
    uint64_t cols, c0, ars, ng, srs;
    const uint8_t *src;                  /* MODE 2: row 0 of the tile at the chunk */
    const uint8_t *pf;                   /* MODE 2: row 0 of the tile at the next chunk, or NULL */
    uint64_t pfn, png;                   /* its rows from that row on, its groups */
};

AI void b_tile(const float *wb, const struct b_args *ba, uint32_t t, float *acc,
               const uint8_t *skip, const int R, const int TB, const int MODE, const int DT)
{
#pragma GCC unroll 1
    for (int q = 0; q < 4; q++) {
        const float *x[4];
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            x[j] = ba->X + (uint64_t)(t + (uint32_t)j) * ba->cols + ba->c0 + 8 * (uint64_t)q;
        bq_tile(wb + (uint64_t)q * BCH * 8, x, acc + 8 * (uint64_t)q, ba->ars, ba->ng, skip,
                ba->src, ba->srs, ba->pf, ba->pfn, ba->png, q, R, TB, MODE, DT);
    }
}

typedef void (*b_tile_fn)(const float *, const struct b_args *, uint32_t, float *, const uint8_t *);
#define B_TILE(N, R, TB, MODE, DT)                                                                 \
    static void N##_##R##x##TB(const float *wb, const struct b_args *ba, uint32_t t, float *acc,  \
                               const uint8_t *skip)                                                \
    { b_tile(wb, ba, t, acc, skip, R, TB, MODE, DT); }
/* tile shapes: [TB] = {R rows, 1 row}; R * TB = 12 but at TB = 1 */
#define B_TILES(N, MODE, DT)                                                                       \
    B_TILE(N, 6, 1, MODE, DT) B_TILE(N, 6, 2, MODE, DT) B_TILE(N, 4, 3, MODE, DT)                 \
    B_TILE(N, 3, 4, MODE, DT) B_TILE(N, 1, 1, MODE, DT) B_TILE(N, 1, 2, MODE, DT)                 \
    B_TILE(N, 1, 3, MODE, DT) B_TILE(N, 1, 4, MODE, DT)                                            \
    static const b_tile_fn N[BTB + 1][2] = {{0, 0},                                                \
        {N##_6x1, N##_1x1}, {N##_6x2, N##_1x2}, {N##_4x3, N##_1x3}, {N##_3x4, N##_1x4}};
B_TILES(bt_buf, 0, 0)
B_TILES(bt_skip, 1, 0)
B_TILES(bt_dec_bf16, 2, DT_BF16)
B_TILES(bt_dec_f16, 2, DT_F16)
B_TILES(bt_dec_f32, 2, DT_F32)
static const int b_rtile[BTB + 1] = {0, 6, 6, 4, 3};

/* Decodes groups [g0, g1) of MXFP4 rows [r, r + np) into wbuf; returns 1 if
 * one of them has scale 255 (flagged in skip[i * BCH + g - g0]). Row i's
 * bytes and scales of the chunk to come (rows [pr, pr + pn), groups [pg0,
 * pg1)) are prefetched as row i is decoded: 4 short lines per row are too
 * few for the hardware prefetchers to follow. */
static int bmx_decode(const uint8_t *packed, const uint8_t *scales, uint64_t cols, uint64_t r,
                      uint64_t np, uint64_t g0, uint64_t g1, float *wbuf, uint8_t *skip,
                      uint64_t pr, uint64_t pn, uint64_t pg0, uint64_t pg1)
{
    uint64_t groups = cols / 32;
    int any = 0;
    for (uint64_t i = 0; i < np || i < pn; i++) {
        if (i < pn) {
            const char *pp = (const char *)(packed + (pr + i) * (cols / 2));
            for (uint64_t b = pg0 * 16 & ~(uint64_t)63; b < pg1 * 16; b += 64)
                _mm_prefetch(pp + b, _MM_HINT_T0);
            _mm_prefetch((const char *)(scales + (pr + i) * groups + pg0), _MM_HINT_T0);
        }
        if (i >= np)
            continue;
        const uint8_t *sc = scales + (r + i) * groups, *p = packed + (r + i) * (cols / 2);
        if (memchr(sc + g0, 255, g1 - g0)) {    /* rare: clear every row's flags once, then flag */
            if (!any)
                memset(skip, 0, BP * BCH);
            any = 1;
            for (uint64_t g = g0; g < g1; g++)
                skip[i * BCH + (g - g0)] = sc[g] == 255;
        }
        for (uint64_t g = g0; g < g1; g++) {
            float *o = wbuf + i * WB_ROW + (g - g0) * 8;
            __m256 tab8 = _mm256_load_ps((const float *)k3_kern_mx_table8x[sc[g]]);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
                _mm256_store_ps(o + (uint64_t)q * BCH * 8, mx_quarter8(p + g * 16, q, tab8));
        }
    }
    return any;
}

/* The tail columns [c, cols) of one output and its fold (w_tile's blend). */
AI float b_tail_fold(const float *acc, const char *wt, const float *x, uint64_t c, uint64_t cols,
                     const int DT)
{
    __m256 a[4];
    for (int k = 0; k < 4; k++)
        a[k] = _mm256_load_ps(acc + 8 * k);
    if (c < cols) {
        uint64_t n = cols - c;
        float xt[32] = {0};
        memcpy(xt, x + c, n * sizeof *xt);
        for (int k = 0; k < 4; k++) {
            __m256 f = _mm256_fmadd_ps(w8(wt + 8 * (uint64_t)k * dt_size(DT), DT), _mm256_loadu_ps(xt + 8 * k), a[k]);
            a[k] = _mm256_blendv_ps(a[k], f, tail_mask(n, k));
        }
    }
    return fold32(a);
}

/* DT < 0: MXFP4 (W is packed, S the scales); else a DT_* dense type. */
AI void b_rows(const void *W, const uint8_t *S, uint64_t rows, uint64_t cols, const float *X,
               uint32_t T, float *Y, uint64_t r0, uint64_t r1, const int DT)
{
    const int dt = DT < 0 ? 0 : DT;
    const b_tile_fn(*dec)[2] = DT == DT_F16 ? bt_dec_f16 : DT == DT_F32 ? bt_dec_f32 : bt_dec_bf16;
    _Alignas(32) float accb[BP * BTS * 32];
    _Alignas(32) float wbuf[BP * WB_ROW];
    uint8_t skip[BP * BCH];
    uint64_t full = cols / 32;
    const uint8_t *src0 = W;
    uint64_t srs = DT < 0 ? cols / 2 : cols * dt_size(dt), gb = DT < 0 ? 16 : 32 * dt_size(dt);
    for (uint64_t rp = r0; rp < r1; rp += BP) {
        uint64_t np = r1 - rp < BP ? r1 - rp : BP;
        for (uint32_t ts = 0; ts < T; ts += BTS) {
            uint32_t nt = T - ts < BTS ? T - ts : BTS;
            uint32_t nb = (nt + BTB - 1) / BTB;
            memset(accb, 0, np * nt * 32 * sizeof(float));
            for (uint64_t g0 = 0; g0 < full; g0 += BCH) {
                uint64_t g1 = full - g0 < BCH ? full : g0 + BCH;
                /* the chunk to prefetch: the next one of this panel, else the
                 * first of the next panel (pn = 0: none) */
                uint64_t pr = g1 < full ? rp : rp + BP, pg = g1 < full ? g1 : 0;
                uint64_t pn = pr < r1 ? (r1 - pr < BP ? r1 - pr : BP) : 0;
                int sk = 0;
                if (DT < 0)
                    sk = bmx_decode(W, S, cols, rp, np, g0, g1, wbuf, skip, pr, pn, pg,
                                    full - pg < BCH ? full : pg + BCH);
                struct b_args ba = {X, cols, g0 * 32, (uint64_t)nt * 32, g1 - g0, srs, NULL, NULL, 0,
                                    full - pg < BCH ? full - pg : BCH};
                for (uint32_t b = 0, t = 0; b < nb; b++) {
                    uint32_t tb = (nt - t) / (nb - b) + ((nt - t) % (nb - b) != 0);
                    uint64_t R = (uint64_t)b_rtile[tb], i = 0;
                    const b_tile_fn *tf = sk ? bt_skip[tb] : b == 0 && DT >= 0 ? dec[tb] : bt_buf[tb];
                    while (i < np) {             /* R-row tiles, then single rows */
                        int one = i + R > np;
                        ba.src = src0 + (rp + i) * srs + g0 * gb;
                        ba.pfn = pn > i ? pn - i : 0;
                        ba.pf = ba.pfn ? src0 + (pr + i) * srs + pg * gb : NULL;
                        tf[one](wbuf + i * WB_ROW, &ba, ts + t, accb + (i * nt + t) * 32, skip + i * BCH);
                        i += one ? 1 : R;
                    }
                    t += tb;
                }
            }
            for (uint64_t i = 0; i < np; i++) {
                _Alignas(32) char wt[32 * 4] = {0};
                if (DT >= 0 && full * 32 < cols)
                    memcpy(wt, src0 + (rp + i) * srs + full * gb, (cols - full * 32) * dt_size(dt));
                for (uint32_t t = 0; t < nt; t++)
                    Y[(uint64_t)(ts + t) * rows + rp + i] =
                        b_tail_fold(accb + (i * nt + t) * 32, wt, X + (uint64_t)(ts + t) * cols,
                                    DT < 0 ? cols : full * 32, cols, dt);
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
        b_rows(packed, scales, rows, cols, X, T, Y, r0, r1, -1);
        return;
    }
    /* T <= 4: the decode is paid once per row-group and pair of vectors
     * here, for all four quarters at once; measured against b_rows on
     * 192 x 3584, 1 thread: 1.9x faster at T = 2, 5 % at T = 4, 5 % slower
     * at T = 3 */
    for (; r < r1; r++) {
        uint32_t t = 0;
        for (; t + 2 <= T; t += 2)
            mx_tile_1x2(packed, scales, rows, cols, X, Y, r, t);
        if (t < T)
            mx_tile_1x1(packed, scales, rows, cols, X, Y, r, t);
    }
}

static void avx2_gemm_bf16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                                const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    if (T > 1) {
        b_rows(W, NULL, rows, cols, X, T, Y, r0, r1, DT_BF16);
        return;
    }
    w_rows(W, rows, cols, X, Y, r0, r1, bf16_tile_2x1, bf16_tile_1x1);
}

static void avx2_gemm_f16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                               const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    if (T > 1) {
        b_rows(W, NULL, rows, cols, X, T, Y, r0, r1, DT_F16);
        return;
    }
    w_rows(W, rows, cols, X, Y, r0, r1, f16_tile_2x1, f16_tile_1x1);
}

static void avx2_gemm_f32_rows(const float *W, uint64_t rows, uint64_t cols,
                               const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    if (T > 1) {
        b_rows(W, NULL, rows, cols, X, T, Y, r0, r1, DT_F32);
        return;
    }
    w_rows(W, rows, cols, X, Y, r0, r1, f32_tile_2x1, f32_tile_1x1);
}

const k3_kern_path k3_kern_path_avx2 = {
    .name = "avx2",
    .gemm_bf16_rows = avx2_gemm_bf16_rows,
    .gemm_mx_rows = avx2_gemm_mx_rows,
    .gemm_f32_rows = avx2_gemm_f32_rows,
    .gemm_f16_rows = avx2_gemm_f16_rows,
    .situ = k3_kern_situ_avx2,
    .exp_n = k3_kern_exp_n_avx2,
    .expf_n = k3_kern_expf_n_avx2,
    .dot8x4 = k3_kern_dot8x4_avx2,
    .axpy4 = k3_kern_axpy4_avx2,
    .kda_step = k3_kern_kda_step_avx2,
};
