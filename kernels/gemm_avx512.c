/*
 * gemm_avx512.c - the AVX-512 (F/BW/VL/DQ) products, bit-identical to ref.c.
 *
 * The 32 contract lanes of one output are two zmm accumulators: acc[0] holds
 * lanes 0..15, acc[1] lanes 16..31, so column c always lands in lane c mod 32
 * and every step is the same fmaf as in ref.c (vfmadd rounds once). The fold
 * (fold32) adds the halves exactly in the ref.c tree order.
 *
 * bf16 (and f16, f32: the same tiles with vcvtph2ps or a plain load as the
 * widening step): tiles of R rows x TB activation vectors (4x1 at T = 1, 4x3 else)
 * whose accumulators stay in registers for the whole row; the weights are
 * widened once per tile and used TB times, and for T > TB the same rows are
 * re-read from L1/L2, never from memory (once X outgrows L2 the vectors go
 * in slices that fit, see w_rows). The next block of rows is prefetched
 * while a block runs, spread over all passes over it.
 *
 * MXFP4: the group's row of k3_kern_mx_table (e2m1 * 2^(s-127) for all 16
 * nibbles, exactly the ref.c weights) is the vpermps table, so no multiply
 * is needed. At T = 1 (decode-bound) the activations are permuted once per
 * call so that one vpsrlvd per 16 weights suffices (see mx_t1_tile), and
 * 8-row blocks without a scale-255 group skip the per-group test
 * (mx_t1_8_clean; K3_MX_T1=checked forces mx_t1_tile). For
 * T > 1 the decode uses vpmultishiftqb (AVX512-VBMI) or vpshufb + vpsrlvd to
 * put the nibbles in element order, and the work runs in panels of 8 rows and
 * chunks of columns with the lanes parked in a stack buffer between chunks
 * (see mx_batched): a chunk without scale 255 is decoded once into a small
 * buffer of f32 weights (16 KiB, L1) and multiplied by register tiles of
 * 4 rows x 3 vectors (mxb_*; K3_MX_BATCH=checked forces the per-block
 * decode of mxc_*). Groups with scale 255 are skipped, as in ref.c.
 *
 * None of this changes the per-output order: every lane takes its columns in
 * increasing order, and fold32 is the ref.c tree.
 */
#include "k3_kern.h"
#include "kern_impl.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

/* ---- shared pieces -------------------------------------------------------- */

AI float fold32(__m512 lo, __m512 hi)
{
    __m512 v = _mm512_add_ps(lo, hi);                                    /* h = 16 */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); /* 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));    /* 4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                       /* 2 */
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));                   /* 1 */
    return _mm_cvtss_f32(d);
}

AI __m512 bf16x16(const uint16_t *p)
{
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI __m512 bf16x16_mask(const uint16_t *p, __mmask16 m)
{
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* ---- bf16, f16, f32 -------------------------------------------------------- */

/* The three weight types share one tile: DT (a constant in every caller)
 * picks how 16 weights are widened to f32 (shift, vcvtph2ps, or a plain
 * load); the lanes and their order are the same code. */
enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };

AI uint64_t dt_size(const int DT)
{
    return DT == DT_F32 ? 4 : 2;
}

AI __m512 w16(const char *p, const int DT)
{
    if (DT == DT_F32)
        return _mm512_loadu_ps((const float *)p);
    if (DT == DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return bf16x16((const uint16_t *)p);
}

AI __m512 w16_mask(const char *p, __mmask16 m, const int DT)
{
    if (DT == DT_F32)
        return _mm512_maskz_loadu_ps(m, (const float *)p);
    if (DT == DT_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    return bf16x16_mask((const uint16_t *)p, m);
}

#ifndef W_PF_HINT
#define W_PF_HINT _MM_HINT_T0
#endif

AI void w_tile(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y,
               uint64_t r, uint32_t t0, uint32_t npass, uint32_t pass, const int R, const int TB,
               const int DT)
{
    const uint64_t es = dt_size(DT);
    __m512 acc[4][4][2];
    const char *w[4];
    const float *x[4];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        w[i] = (const char *)W + (r + (uint64_t)i) * cols * es;
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;

    /* the next block of R rows (contiguous) is fetched while this one runs:
     * R * es / 2 lines of it per 32 columns, this pass taking the steps
     * pass, pass + npass, ... (see w_rows) */
    const char *pf = NULL;
    if (R >= 2 && r + 2 * (uint64_t)R <= rows)
        pf = (const char *)W + (r + (uint64_t)R) * cols * es;
    const uint64_t pl = (uint64_t)R * es / 2;
    uint64_t c = 0, pc = pf && pass < npass ? (uint64_t)pass * 32 : ~(uint64_t)0;
    for (; c + 32 <= cols; c += 32) {
        if (c == pc) {
#pragma GCC unroll 8
            for (uint64_t i = 0; i < pl; i++)
                _mm_prefetch(pf + (c / 32 * pl + i) * 64, W_PF_HINT);
            pc += (uint64_t)npass * 32;
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            __m512 w0 = w16(w[i] + c * es, DT), w1 = w16(w[i] + (c + 16) * es, DT);
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++) {
                acc[i][j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + c), acc[i][j][0]);
                acc[i][j][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + c + 16), acc[i][j][1]);
            }
        }
    }
    if (c < cols) {
        /* masked lanes keep their accumulator untouched (no fma), as in ref.c */
        uint64_t n = cols - c;
        __mmask16 m0 = (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u);
        __mmask16 m1 = (__mmask16)(n > 16 ? (1u << (n - 16)) - 1u : 0u);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            __m512 w0 = w16_mask(w[i] + c * es, m0, DT), w1 = w16_mask(w[i] + (c + 16) * es, m1, DT);
#pragma GCC unroll 4
            for (int j = 0; j < TB; j++) {
                __m512 x0 = _mm512_maskz_loadu_ps(m0, x[j] + c);
                __m512 x1 = _mm512_maskz_loadu_ps(m1, x[j] + c + 16);
                acc[i][j][0] = _mm512_mask3_fmadd_ps(w0, x0, acc[i][j][0], m0);
                acc[i][j][1] = _mm512_mask3_fmadd_ps(w1, x1, acc[i][j][1], m1);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TB; j++)
            Y[(uint64_t)(t0 + (uint32_t)j) * rows + r + (uint64_t)i] = fold32(acc[i][j][0], acc[i][j][1]);
}

typedef void (*w_tile_fn)(const void *, uint64_t, uint64_t, const float *, float *, uint64_t, uint32_t,
                          uint32_t, uint32_t);

/* One function per (type, tile shape) so that R, TB and DT are constants
 * inside; the tables are indexed by TB. */
#define W_TILE(N, DT, R, TB)                                                                              \
    static void N##_##R##x##TB(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y,   \
                               uint64_t r, uint32_t t0, uint32_t np, uint32_t k) { w_tile(W, rows, cols, X, Y, r, t0, np, k, R, TB, DT); }
#define W_TILES(N, DT)                                                                                    \
    W_TILE(N, DT, 4, 1) W_TILE(N, DT, 4, 2) W_TILE(N, DT, 4, 3)                                           \
    W_TILE(N, DT, 2, 1) W_TILE(N, DT, 2, 2) W_TILE(N, DT, 2, 3) W_TILE(N, DT, 2, 4)                       \
    W_TILE(N, DT, 1, 1) W_TILE(N, DT, 1, 2) W_TILE(N, DT, 1, 3) W_TILE(N, DT, 1, 4)                       \
    static const w_tile_fn N##_four[4] = {0, N##_4x1, N##_4x2, N##_4x3};                                  \
    static const w_tile_fn N##_two[5] = {0, N##_2x1, N##_2x2, N##_2x3, N##_2x4};                          \
    static const w_tile_fn N##_one[5] = {0, N##_1x1, N##_1x2, N##_1x3, N##_1x4};
W_TILES(bf16_tile, DT_BF16)
W_TILES(f16_tile, DT_F16)
W_TILES(f32_tile, DT_F32)

/* X bytes a slice of vectors may take, and weight bytes of the rows that
 * run all slices before the next rows start (see w_rows) */
#ifndef W_X_BYTES
#define W_X_BYTES (448u << 10)
#endif
#ifndef W_ROW_BYTES
#define W_ROW_BYTES (256u << 10)
#endif

AI void w_rows_slice(const void *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T,
                     float *Y, uint64_t r0, uint64_t r1, const w_tile_fn *four,
                     const w_tile_fn *two, const w_tile_fn *one)
{
    uint64_t r = r0;
    if (T == 1) {
        for (; r + 4 <= r1; r += 4)
            four[1](W, rows, cols, X, Y, r, 0, 1, 0);
        for (; r < r1; r++)
            one[1](W, rows, cols, X, Y, r, 0, 1, 0);
        return;
    }
    /* 4 rows x 3 vectors: 24 accumulators; each x load feeds 4 FMAs, which
     * keeps the L2 traffic for x (T*cols*4 bytes, past L1) affordable. The
     * next block's lines are shared out over all passes over these rows
     * (pass k fetches 32-column steps k, k + npass, ...), so that they are
     * asked for at the pace the block runs, not in a burst in its first
     * pass. With fewer than two whole passes (T < 6, or 8 for the row
     * tails) the first pass fetches them all: its partner is too short to
     * take half. */
    uint32_t n4 = T >= 6 ? (T + 2) / 3 : 1, n2 = T >= 8 ? (T + 3) / 4 : 1;
    for (; r + 4 <= r1; r += 4)
        for (uint32_t t = 0; t < T; t += 3)
            four[T - t >= 3 ? 3 : T - t](W, rows, cols, X, Y, r, t, n4, t / 3);
    for (; r + 2 <= r1; r += 2)
        for (uint32_t t = 0; t < T; t += 4)
            two[T - t >= 4 ? 4 : T - t](W, rows, cols, X, Y, r, t, n2, t / 4);
    for (; r < r1; r++)
        for (uint32_t t = 0; t < T; t += 4)
            one[T - t >= 4 ? 4 : T - t](W, rows, cols, X, Y, r, t, n2, t / 4);
}

AI void w_rows(const void *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y,
               uint64_t r0, uint64_t r1, const w_tile_fn *four, const w_tile_fn *two,
               const w_tile_fn *one, const uint64_t es)
{
    /* Every pass over a 4-row block reads its vectors' X from wherever X
     * lives, 16 bytes per FMA; once X (T * cols * 4 bytes: 1.8 MiB at T = 64
     * and 7168 columns, 0.9 MiB at T = 16 and 14336) no longer fits in L2
     * beside the rows in flight, that is L3. So past 1.5 slices the vectors
     * go in slices of ts (X of one slice at most W_X_BYTES, 4 to 16
     * vectors; the last slice up to 1.5 ts), and the rows in groups of about
     * W_ROW_BYTES that run every slice before the next group starts: each
     * slice's X stays in L2, and the group's weights are read from memory
     * once, then from L2. Every output is still computed by the same tile
     * code: same bits. */
    uint64_t cb = cols ? cols : 1, ts = W_X_BYTES / (cb * 4), rg = W_ROW_BYTES / (cb * es) / 4 * 4;
    ts = ts < 4 ? 4 : ts > 16 ? 16 : ts;
    rg = rg < 4 ? 4 : rg;
    if (T <= ts + ts / 2) {
        w_rows_slice(W, rows, cols, X, T, Y, r0, r1, four, two, one);
        return;
    }
    for (uint64_t rs = r0; rs < r1; rs += rg) {
        uint64_t re = r1 - rs < rg ? r1 : rs + rg;
        for (uint32_t t = 0; t < T; t += (uint32_t)ts) {
            uint32_t n = T - t < ts + ts / 2 ? T - t : (uint32_t)ts;
            w_rows_slice(W, rows, cols, X + (uint64_t)t * cols, n, Y + (uint64_t)t * rows, rs, re,
                         four, two, one);
            if (n != ts)
                break;
        }
    }
}

static void avx512_gemm_bf16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                                  const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, bf16_tile_four, bf16_tile_two, bf16_tile_one, 2);
}

static void avx512_gemm_f16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                                 const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, f16_tile_four, f16_tile_two, f16_tile_one, 2);
}

static void avx512_gemm_f32_rows(const float *W, uint64_t rows, uint64_t cols,
                                 const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    w_rows(W, rows, cols, X, T, Y, r0, r1, f32_tile_four, f32_tile_two, f32_tile_one, 4);
}

/* ---- MXFP4 ---------------------------------------------------------------- */

/* Weights 0..15 and 16..31 of one group (16 packed bytes at p), already scaled
 * (tab = E2M1 table times the group scale). */
__attribute__((target("avx512vbmi")))
static inline __attribute__((always_inline)) void mx_decode_vbmi(const uint8_t *p, __m512 tab,
                                                                 __m512 *w0, __m512 *w1)
{
    /* output qword q (elements 2q, 2q+1 of the 16 in a source qword) takes
     * bits 8q.. into its byte 0 and bits 8q+4.. into its byte 4 */
    const __m512i ctrl = _mm512_set_epi64(0x3c00000038LL, 0x3400000030LL, 0x2c00000028LL,
                                          0x2400000020LL, 0x1c00000018LL, 0x1400000010LL,
                                          0x0c00000008LL, 0x0400000000LL);
    uint64_t lo, hi;
    memcpy(&lo, p, 8);
    memcpy(&hi, p + 8, 8);
    __m512i i0 = _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64((long long)lo));
    __m512i i1 = _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64((long long)hi));
    *w0 = _mm512_permutexvar_ps(i0, tab);
    *w1 = _mm512_permutexvar_ps(i1, tab);
}

AI void mx_decode_shuf(const uint8_t *p, __m512 tab, __m512 *w0, __m512 *w1)
{
    /* dword j gets byte j/2 (first 16 weights) or 8 + j/2 (last 16) in its low
     * byte, then odd dwords shift right by 4 to bring the high nibble down */
    const __m512i ctrl0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i ctrl1 = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i high_zero = _mm512_set1_epi32((int)0x80808000u);
    __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    __m512i i0 = _mm512_srlv_epi32(_mm512_shuffle_epi8(b, _mm512_or_si512(ctrl0, high_zero)), shift);
    __m512i i1 = _mm512_srlv_epi32(_mm512_shuffle_epi8(b, _mm512_or_si512(ctrl1, high_zero)), shift);
    *w0 = _mm512_permutexvar_ps(i0, tab);
    *w1 = _mm512_permutexvar_ps(i1, tab);
}

#define MX_TILE_BODY(DECODE)                                                              \
    uint64_t groups = cols / 32;                                                          \
    __m512 acc[4][1][2];                                                                  \
    const float *x[1];                                                                    \
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)                                   \
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++)                              \
            acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();                            \
    _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++)                                  \
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;                                   \
    const char *pf = NULL;                                                                \
    if (t0 == 0 && R >= 2 && r + 2 * (uint64_t)R <= rows)                                 \
        pf = (const char *)(packed + (r + (uint64_t)R) * (cols / 2));                     \
    for (uint64_t g = 0; g < groups; g++) {                                               \
        /* next R rows: R*16 bytes per group; their scales at the start */                \
        if (pf) {                                                                         \
            if ((g * (uint64_t)R * 16) % 64 == 0)                                         \
                _mm_prefetch(pf + g * (uint64_t)R * 16, _MM_HINT_T0);                     \
            if (g * 64 < (uint64_t)R * groups)                                            \
                _mm_prefetch((const char *)(scales + (r + (uint64_t)R) * groups) + g * 64, \
                             _MM_HINT_T0);                                                \
        }                                                                                 \
        _Pragma("GCC unroll 4") for (int i = 0; i < R; i++) {                             \
            uint8_t s = scales[(r + (uint64_t)i) * groups + g];                           \
            if (s == 255)                                                                 \
                continue;                                                                 \
            __m512 tab = _mm512_load_ps(k3_kern_mx_table[s]);                             \
            __m512 w0, w1;                                                                \
            DECODE(packed + (r + (uint64_t)i) * (cols / 2) + g * 16, tab, &w0, &w1);      \
            _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {                        \
                acc[i][j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + g * 32), acc[i][j][0]); \
                acc[i][j][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + g * 32 + 16), acc[i][j][1]); \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    _Pragma("GCC unroll 4") for (int i = 0; i < R; i++)                                   \
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++)                              \
            Y[(uint64_t)(t0 + (uint32_t)j) * rows + r + (uint64_t)i] =                    \
                fold32(acc[i][j][0], acc[i][j][1]);

__attribute__((target("avx512vbmi")))
static inline __attribute__((always_inline)) void mx_tile_vbmi(
    const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
    const float *X, float *Y, uint64_t r, uint32_t t0, const int R, const int TB)
{
    MX_TILE_BODY(mx_decode_vbmi)
}

AI void mx_tile_shuf(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                     const float *X, float *Y, uint64_t r, uint32_t t0, const int R, const int TB)
{
    MX_TILE_BODY(mx_decode_shuf)
}

/*
 * T > 1: panels of MX_PANEL rows, column chunks of MX_CHUNK groups. For each
 * chunk, every block of up to 6 activation vectors runs over all rows of the
 * panel: that block's slice of X (6 x 2 KiB) stays in L1 for all of them and
 * the panel's slice of weights (8 x 256 B) stays in L1 for all blocks. The 32
 * lanes of every (row, vector) live in accb between chunks; each lane still
 * takes its columns in increasing order, so the result is the ref.c one.
 * Vectors go in slices of MX_TSLICE inside each panel, so the weights come
 * from memory once per call whatever T is. This per-block decode (mxc_*)
 * serves chunks with a scale-255 group and row tails; the others take the
 * decode-once loop below (mxb_*). Stack: accb 32 KiB + wbuf 16 KiB.
 */
#ifndef MX_PANEL
#define MX_PANEL 8
#endif
#ifndef MX_CHUNK
#define MX_CHUNK 16
#endif
#ifndef MX_TSLICE
#define MX_TSLICE 32
#endif
#ifndef MX_PF_HINT
#define MX_PF_HINT _MM_HINT_T0
#endif

#define MX_CHUNK_BODY(DECODE)                                                             \
    uint64_t groups = cols / 32;                                                          \
    __m512 acc[2][6][2];                                                                  \
    const float *x[6];                                                                    \
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)                                   \
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {                            \
            acc[i][j][0] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32); \
            acc[i][j][1] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16); \
        }                                                                                 \
    _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++)                                  \
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;                                   \
    for (uint64_t g = g0; g < g1; g++) {                                                  \
        _Pragma("GCC unroll 2") for (int i = 0; i < R; i++) {                             \
            uint8_t s = scales[(r + (uint64_t)i) * groups + g];                           \
            if (s == 255)                                                                 \
                continue;                                                                 \
            __m512 tab = _mm512_load_ps(k3_kern_mx_table[s]);                             \
            __m512 w0, w1;                                                                \
            DECODE(packed + (r + (uint64_t)i) * (cols / 2) + g * 16, tab, &w0, &w1);      \
            _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {                        \
                acc[i][j][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + g * 32), acc[i][j][0]); \
                acc[i][j][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + g * 32 + 16), acc[i][j][1]); \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    _Pragma("GCC unroll 2") for (int i = 0; i < R; i++)                                   \
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {                            \
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32, acc[i][j][0]); \
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16, acc[i][j][1]); \
        }

typedef void (*mx_chunk_fn)(const uint8_t *, const uint8_t *, uint64_t, const float *, float *,
                            uint64_t, uint64_t, uint32_t, uint64_t, uint64_t);
#define MX_CHUNK_FN(KIND, ATTR, R, TB)                                                    \
    ATTR static void mxc_##KIND##_##R##x##TB(const uint8_t *packed, const uint8_t *scales, \
                                             uint64_t cols, const float *X, float *accb,  \
                                             uint64_t acc_t, uint64_t r, uint32_t t0,      \
                                             uint64_t g0, uint64_t g1)                     \
    {                                                                                     \
        const int R_ = R, TB_ = TB;                                                       \
        mxc_body_##KIND(packed, scales, cols, X, accb, acc_t, r, t0, g0, g1, R_, TB_);    \
    }

__attribute__((target("avx512vbmi")))
static inline __attribute__((always_inline)) void mxc_body_vbmi(
    const uint8_t *packed, const uint8_t *scales, uint64_t cols, const float *X, float *accb,
    uint64_t acc_t, uint64_t r, uint32_t t0, uint64_t g0, uint64_t g1, const int R, const int TB)
{
    MX_CHUNK_BODY(mx_decode_vbmi)
}

AI void mxc_body_shuf(const uint8_t *packed, const uint8_t *scales, uint64_t cols, const float *X,
                      float *accb, uint64_t acc_t, uint64_t r, uint32_t t0, uint64_t g0,
                      uint64_t g1, const int R, const int TB)
{
    MX_CHUNK_BODY(mx_decode_shuf)
}

#define MX_CHUNK_SET(KIND, ATTR)                                                          \
    MX_CHUNK_FN(KIND, ATTR, 2, 1) MX_CHUNK_FN(KIND, ATTR, 2, 2) MX_CHUNK_FN(KIND, ATTR, 2, 3) \
    MX_CHUNK_FN(KIND, ATTR, 2, 4) MX_CHUNK_FN(KIND, ATTR, 2, 5) MX_CHUNK_FN(KIND, ATTR, 2, 6) \
    MX_CHUNK_FN(KIND, ATTR, 1, 1) MX_CHUNK_FN(KIND, ATTR, 1, 2) MX_CHUNK_FN(KIND, ATTR, 1, 3) \
    MX_CHUNK_FN(KIND, ATTR, 1, 4) MX_CHUNK_FN(KIND, ATTR, 1, 5) MX_CHUNK_FN(KIND, ATTR, 1, 6)
MX_CHUNK_SET(vbmi, __attribute__((target("avx512vbmi"))))
MX_CHUNK_SET(shuf, )

struct mx_chunks {
    mx_chunk_fn two[7], one[7];
};
static const struct mx_chunks mxc_vbmi = {
    {0, mxc_vbmi_2x1, mxc_vbmi_2x2, mxc_vbmi_2x3, mxc_vbmi_2x4, mxc_vbmi_2x5, mxc_vbmi_2x6},
    {0, mxc_vbmi_1x1, mxc_vbmi_1x2, mxc_vbmi_1x3, mxc_vbmi_1x4, mxc_vbmi_1x5, mxc_vbmi_1x6}};
static const struct mx_chunks mxc_shuf = {
    {0, mxc_shuf_2x1, mxc_shuf_2x2, mxc_shuf_2x3, mxc_shuf_2x4, mxc_shuf_2x5, mxc_shuf_2x6},
    {0, mxc_shuf_1x1, mxc_shuf_1x2, mxc_shuf_1x3, mxc_shuf_1x4, mxc_shuf_1x5, mxc_shuf_1x6}};

/*
 * T > 1, panels without a scale-255 group (the usual case): decode once,
 * multiply many. The MX_PANEL rows' weights of one chunk (MX_CHUNK groups)
 * are decoded once into wbuf, exact f32 table values in element order, laid
 * out [tile of 4 rows][group][row][32] so that a tile reads one stream; then
 * every block of 2 or 3 vectors runs a register tile of 4 rows x TB vectors
 * (mxb_tile: 8 TB accumulators, one x load per 4 FMAs, one weight load per
 * TB FMAs) over the chunk. The decode (4 vector operations per row-group)
 * is thus paid once per chunk instead of once per 6 vectors. The lanes,
 * their columns and the order in which they take them are those of the
 * mxc_* loop above: same bits. A chunk in which some row has a 255 scale
 * runs the mxc_* loop instead (it skips those groups).
 */
#define MXB_ROWS 4
#ifndef MXB_FIRST
#define MXB_FIRST 2
#endif

AI void mxb_tile(const float *wb, const float *X, uint64_t cols, uint64_t c0, uint32_t t,
                 float *accb, uint64_t acc_t, uint64_t ng, const char *pf, uint64_t npf,
                 const int TB)
{
    __m512 acc[MXB_ROWS][3][2];
    const float *x[3];
#pragma GCC unroll 4
    for (int i = 0; i < MXB_ROWS; i++)
#pragma GCC unroll 3
        for (int j = 0; j < TB; j++) {
            acc[i][j][0] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32);
            acc[i][j][1] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16);
        }
#pragma GCC unroll 3
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t + (uint32_t)j) * cols + c0;
    for (uint64_t g = 0; g < ng; g++) {
        if (g < npf)
            _mm_prefetch(pf + g * 64, MX_PF_HINT);
        __m512 xv[3][2];
#pragma GCC unroll 3
        for (int j = 0; j < TB; j++) {
            xv[j][0] = _mm512_loadu_ps(x[j] + g * 32);
            xv[j][1] = _mm512_loadu_ps(x[j] + g * 32 + 16);
        }
#pragma GCC unroll 4
        for (int i = 0; i < MXB_ROWS; i++) {
            const float *w = wb + (g * MXB_ROWS + (uint64_t)i) * 32;
            __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16);
            /* one load per weight vector, not one per FMA (GCC would fold
             * the load into each FMA and make the tile load-bound) */
            __asm__("" : "+v"(w0), "+v"(w1));
#pragma GCC unroll 3
            for (int j = 0; j < TB; j++) {
                acc[i][j][0] = _mm512_fmadd_ps(w0, xv[j][0], acc[i][j][0]);
                acc[i][j][1] = _mm512_fmadd_ps(w1, xv[j][1], acc[i][j][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MXB_ROWS; i++)
#pragma GCC unroll 3
        for (int j = 0; j < TB; j++) {
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32, acc[i][j][0]);
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16, acc[i][j][1]);
        }
}

typedef void (*mxb_tile_fn)(const float *, const float *, uint64_t, uint64_t, uint32_t, float *,
                            uint64_t, uint64_t, const char *, uint64_t);
static void mxb_tile_1(const float *wb, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t acc_t, uint64_t ng, const char *pf, uint64_t npf) { mxb_tile(wb, X, cols, c0, t, accb, acc_t, ng, pf, npf, 1); }
static void mxb_tile_2(const float *wb, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t acc_t, uint64_t ng, const char *pf, uint64_t npf) { mxb_tile(wb, X, cols, c0, t, accb, acc_t, ng, pf, npf, 2); }
static void mxb_tile_3(const float *wb, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t acc_t, uint64_t ng, const char *pf, uint64_t npf) { mxb_tile(wb, X, cols, c0, t, accb, acc_t, ng, pf, npf, 3); }

/* The first block of vectors (TB 1 or 2) of a 4-row tile decodes as it
 * goes: each row-group is decoded once from its nibbles, stored to wb for
 * the later blocks, and multiplied at once, so the decode's shuffles share
 * the ports with FMAs instead of running alone. */
#define MXB_DTILE_BODY(DECODE)                                                            \
    uint64_t groups = cols / 32;                                                          \
    __m512 acc[MXB_ROWS][2][2];                                                           \
    const float *x[2];                                                                    \
    _Pragma("GCC unroll 4") for (int i = 0; i < MXB_ROWS; i++)                            \
        _Pragma("GCC unroll 2") for (int j = 0; j < TB; j++) {                            \
            acc[i][j][0] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32); \
            acc[i][j][1] = _mm512_load_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16); \
        }                                                                                 \
    _Pragma("GCC unroll 2") for (int j = 0; j < TB; j++)                                  \
        x[j] = X + (uint64_t)(t + (uint32_t)j) * cols + g0 * 32;                          \
    const uint8_t *sc = scales + r * groups + g0, *p = packed + r * (cols / 2) + g0 * 16; \
    for (uint64_t g = 0; g < ng; g++) {                                                   \
        if (g < npf)                                                                      \
            _mm_prefetch(pf + g * 64, MX_PF_HINT);                                        \
        __m512 xv[2][2];                                                                  \
        _Pragma("GCC unroll 2") for (int j = 0; j < TB; j++) {                            \
            xv[j][0] = _mm512_loadu_ps(x[j] + g * 32);                                    \
            xv[j][1] = _mm512_loadu_ps(x[j] + g * 32 + 16);                               \
        }                                                                                 \
        _Pragma("GCC unroll 4") for (int i = 0; i < MXB_ROWS; i++) {                      \
            __m512 w0, w1;                                                                \
            DECODE(p + (uint64_t)i * (cols / 2) + g * 16,                                 \
                   _mm512_load_ps(k3_kern_mx_table[sc[(uint64_t)i * groups + g]]), &w0, &w1); \
            float *o = wb + (g * MXB_ROWS + (uint64_t)i) * 32;                            \
            _mm512_store_ps(o, w0);                                                       \
            _mm512_store_ps(o + 16, w1);                                                  \
            _Pragma("GCC unroll 2") for (int j = 0; j < TB; j++) {                        \
                acc[i][j][0] = _mm512_fmadd_ps(w0, xv[j][0], acc[i][j][0]);               \
                acc[i][j][1] = _mm512_fmadd_ps(w1, xv[j][1], acc[i][j][1]);               \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    _Pragma("GCC unroll 4") for (int i = 0; i < MXB_ROWS; i++)                            \
        _Pragma("GCC unroll 2") for (int j = 0; j < TB; j++) {                            \
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32, acc[i][j][0]); \
            _mm512_store_ps(accb + ((uint64_t)i * acc_t + (uint64_t)j) * 32 + 16, acc[i][j][1]); \
        }

typedef void (*mxb_dtile_fn)(const uint8_t *, const uint8_t *, uint64_t, uint64_t, uint64_t,
                             uint64_t, float *, const float *, uint32_t, float *, uint64_t,
                             const char *, uint64_t);
#define MXB_DTILE_FN(KIND, ATTR, TB_)                                                     \
    ATTR static void mxb_dtile_##KIND##_##TB_(const uint8_t *packed, const uint8_t *scales, \
                                              uint64_t cols, uint64_t r, uint64_t g0,      \
                                              uint64_t ng, float *wb, const float *X,      \
                                              uint32_t t, float *accb, uint64_t acc_t,     \
                                              const char *pf, uint64_t npf)                \
    {                                                                                     \
        const int TB = TB_;                                                               \
        MXB_DTILE_BODY(mx_decode_##KIND)                                                  \
    }
MXB_DTILE_FN(vbmi, __attribute__((target("avx512vbmi"))), 1)
MXB_DTILE_FN(vbmi, __attribute__((target("avx512vbmi"))), 2)
MXB_DTILE_FN(shuf, , 1)
MXB_DTILE_FN(shuf, , 2)

/* 1 if one of the MX_PANEL rows from r has scale 255 in groups [g0, g1). */
static int mxb_has255(const uint8_t *scales, uint64_t groups, uint64_t r, uint64_t g0, uint64_t g1)
{
    __mmask64 bad = 0;
    for (uint64_t i = 0; i < MX_PANEL; i++)
        for (uint64_t g = g0; g < g1; g += 64) {
            uint64_t n = g1 - g < 64 ? g1 - g : 64;
            __mmask64 m = n == 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);
            __m512i v = _mm512_maskz_loadu_epi8(m, scales + (r + i) * groups + g);
            bad |= _mm512_mask_cmpeq_epi8_mask(m, v, _mm512_set1_epi8(-1));
        }
    return bad != 0;
}

/* K3_MX_BATCH=checked forces the mxc_* loop for every chunk (tests cover both). */
static int mxb_allowed(void)
{
    static int pick; /* 0 unknown, 1 allowed, 2 forced off */
    int p = __atomic_load_n(&pick, __ATOMIC_ACQUIRE);
    if (!p) {
        const char *force = getenv("K3_MX_BATCH");
        p = force && !strcmp(force, "checked") ? 2 : 1;
        __atomic_store_n(&pick, p, __ATOMIC_RELEASE);
    }
    return p == 1;
}

static void mx_batched(const struct mx_chunks *k, const mxb_dtile_fn *dtile,
                       const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                       uint64_t cols, const float *X, uint32_t T, float *Y, uint64_t r0,
                       uint64_t r1)
{
    static const mxb_tile_fn tiles[4] = {0, mxb_tile_1, mxb_tile_2, mxb_tile_3};
    _Alignas(64) float accb[MX_PANEL * MX_TSLICE * 32];
    _Alignas(64) float wbuf[MX_PANEL * MX_CHUNK * 32];
    uint64_t groups = cols / 32;
    int fast = mxb_allowed();
    /* panels outside, vector slices inside: a panel's weights (MX_PANEL
     * rows) come from memory once per call whatever T is */
    for (uint64_t rp = r0; rp < r1; rp += MX_PANEL) {
        uint64_t np = r1 - rp < MX_PANEL ? r1 - rp : MX_PANEL;
        for (uint32_t ts = 0; ts < T; ts += MX_TSLICE) {
            uint32_t nt = T - ts < MX_TSLICE ? T - ts : MX_TSLICE;
            memset(accb, 0, np * nt * 32 * sizeof(float));
            for (uint64_t g0 = 0; g0 < groups; g0 += MX_CHUNK) {
                uint64_t g1 = groups - g0 < MX_CHUNK ? groups : g0 + MX_CHUNK;
                /* the rows are short, so the hardware prefetchers do not run
                 * far enough ahead: the next panel (packed bytes and scales,
                 * contiguous) is fetched while this one runs, its scales at
                 * the start, its bytes (MX_PANEL * 16 per group) spread over
                 * all tile calls of the chunk in the first slice, a few lines
                 * each, so that they never wait for a free fill buffer in a
                 * burst; without a next panel, this one's own bytes again */
                const char *pf = (const char *)(packed + rp * (cols / 2));
                if (rp + 2 * MX_PANEL <= r1) {
                    pf = (const char *)(packed + (rp + MX_PANEL) * (cols / 2));
                    const char *ns = (const char *)(scales + (rp + MX_PANEL) * groups);
                    for (uint64_t b = 0; ts == 0 && g0 == 0 && b < MX_PANEL * groups; b += 64)
                        _mm_prefetch(ns + b, MX_PF_HINT);
                }
                pf += g0 * MX_PANEL * 16;
                if (fast && np == MX_PANEL && !mxb_has255(scales, groups, rp, g0, g1)) {
                    /* first block decodes (1 or 2 vectors), then blocks of 3,
                     * the last ones 2 + 2 rather than 3 + 1 */
                    uint32_t tbs[MX_TSLICE], nb = 0;
                    for (uint32_t t = 0; t < nt; t += tbs[nb++]) {
                        uint32_t left = nt - t;
                        tbs[nb] = t == 0 ? (nt >= MXB_FIRST ? MXB_FIRST : 1)
                                         : left == 4 || left == 2 ? 2 : left >= 3 ? 3 : 1;
                    }
                    uint64_t lines = ts == 0 ? (g1 - g0) * MX_PANEL * 16 / 64 : 0;
                    uint64_t share = (lines + 2 * nb - 1) / (2 * nb), done = 0;
                    for (uint32_t b = 0, t = 0; b < nb; t += tbs[b++])
                        for (uint64_t q = 0; q < MX_PANEL / MXB_ROWS; q++) {
                            uint64_t npf = lines - done < share ? lines - done : share;
                            if (b == 0)
                                dtile[tbs[b]](packed, scales, cols, rp + q * MXB_ROWS, g0, g1 - g0,
                                              wbuf + q * MX_CHUNK * MXB_ROWS * 32, X, ts,
                                              accb + q * MXB_ROWS * nt * 32, nt, pf + done * 64, npf);
                            else
                                tiles[tbs[b]](wbuf + q * MX_CHUNK * MXB_ROWS * 32, X, cols, g0 * 32,
                                              ts + t, accb + (q * MXB_ROWS * nt + t) * 32, nt,
                                              g1 - g0, pf + done * 64, npf);
                            done += npf;
                        }
                    continue;
                }
                for (uint32_t t = 0; t < nt; t += 6) {
                    uint32_t tb = nt - t < 6 ? nt - t : 6;
                    uint64_t i = 0;
                    for (; i + 2 <= np; i += 2)
                        k->two[tb](packed, scales, cols, X, accb + (i * nt + t) * 32, nt, rp + i,
                                   ts + t, g0, g1);
                    if (i < np)
                        k->one[tb](packed, scales, cols, X, accb + (i * nt + t) * 32, nt, rp + i,
                                   ts + t, g0, g1);
                }
            }
            for (uint64_t i = 0; i < np; i++)
                for (uint32_t t = 0; t < nt; t++) {
                    const float *a = accb + (i * nt + t) * 32;
                    Y[(uint64_t)(ts + t) * rows + rp + i] = fold32(_mm512_load_ps(a), _mm512_load_ps(a + 16));
                }
        }
    }
}

typedef void (*mx_tile_fn)(const uint8_t *, const uint8_t *, uint64_t, uint64_t, const float *,
                           float *, uint64_t, uint32_t);

#define MX_TILE_FN(KIND, ATTR, R, TB)                                                     \
    ATTR static void mx_##KIND##_##R##x##TB(const uint8_t *packed, const uint8_t *scales, \
                                            uint64_t rows, uint64_t cols, const float *X,  \
                                            float *Y, uint64_t r, uint32_t t0)             \
    {                                                                                     \
        mx_tile_##KIND(packed, scales, rows, cols, X, Y, r, t0, R, TB);                   \
    }
#define VBMI __attribute__((target("avx512vbmi")))
MX_TILE_FN(vbmi, VBMI, 4, 1)
MX_TILE_FN(vbmi, VBMI, 1, 1)
MX_TILE_FN(shuf, , 4, 1)
MX_TILE_FN(shuf, , 1, 1)

/* T = 1 with cols past the stack buffer of the permuted path, and the
 * batched chunks, each in the VBMI and the shuffle decode */
struct mx_tiles {
    mx_tile_fn t4x1, t1x1;
    const struct mx_chunks *chunks;
    mxb_dtile_fn dtile[3];
};

static const struct mx_tiles mx_vbmi = {mx_vbmi_4x1, mx_vbmi_1x1, &mxc_vbmi, {0, mxb_dtile_vbmi_1, mxb_dtile_vbmi_2}};
static const struct mx_tiles mx_shuf = {mx_shuf_4x1, mx_shuf_1x1, &mxc_shuf, {0, mxb_dtile_shuf_1, mxb_dtile_shuf_2}};

/* K3_MX_DECODE=shuf forces the non-VBMI decode (tests cover both). */
static const struct mx_tiles *mx_tiles_pick(void)
{
    static const struct mx_tiles *pick;
    const struct mx_tiles *p = __atomic_load_n(&pick, __ATOMIC_ACQUIRE);
    if (!p) {
        const char *force = getenv("K3_MX_DECODE");
        int vbmi = __builtin_cpu_supports("avx512vbmi");
        p = vbmi && !(force && !strcmp(force, "shuf")) ? &mx_vbmi : &mx_shuf;
        __atomic_store_n(&pick, p, __ATOMIC_RELEASE);
    }
    return p;
}


/*
 * T = 1: the weight decode is the bottleneck (memory would deliver more), so
 * the activation vector is first permuted once per call (on the stack) into
 * the order in which the cheapest decode yields weights: a 16-byte group
 * broadcast to the four 128-bit lanes, one vpsrlvd per 16 weights selecting
 * byte 4*(j%4) + j/4 and its low or high nibble for dword j, one vpermps from
 * the per-scale table in memory. acc[0] holds the even elements, acc[1] the
 * odd ones, each in that byte order; the two are put back into contract lane
 * order (vpermt2ps) before the fold. Per group: 2 shifts, 2 lookups, 2 FMAs.
 */
#define MX_T1_MAX_COLS 8192

AI void mx_t1_tile(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *xp, float *Y, uint64_t r, uint64_t r_end, const int R)
{
    /* Rows are only cols/2 bytes long, so R interleaved short streams defeat
     * the hardware prefetchers: fetch the next block of R rows (R/4 lines of
     * packed bytes per group, its scales in the first groups) while this one
     * is decoded. 8 rows per block: one x load serves 8 rows. */
    const char *pf_p = NULL, *pf_s = NULL;
    uint64_t pf_s_bytes = 0;
    if (R >= 4 && r + 2 * (uint64_t)R <= r_end) {
        pf_p = (const char *)(packed + (r + (uint64_t)R) * (cols / 2));
        pf_s = (const char *)(scales + (r + (uint64_t)R) * (cols / 32));
        pf_s_bytes = (uint64_t)R * (cols / 32);
    }
    const __m512i sh_e = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    const __m512i sh_o = _mm512_set_epi32(28, 28, 28, 28, 20, 20, 20, 20, 12, 12, 12, 12, 4, 4, 4, 4);
    const __m512i un_lo = _mm512_set_epi32(29, 13, 25, 9, 21, 5, 17, 1, 28, 12, 24, 8, 20, 4, 16, 0);
    const __m512i un_hi = _mm512_set_epi32(31, 15, 27, 11, 23, 7, 19, 3, 30, 14, 26, 10, 22, 6, 18, 2);
    uint64_t groups = cols / 32;
    __m512 acc[8][2];
    const uint8_t *p[8], *sc[8];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        p[i] = packed + (r + (uint64_t)i) * (cols / 2);
        sc[i] = scales + (r + (uint64_t)i) * groups;
    }
    for (uint64_t g = 0; g < groups; g++) {
        if (pf_p) {
            for (int q = 0; q < R / 4; q++)
                _mm_prefetch(pf_p + (g * (uint64_t)(R / 4) + (uint64_t)q) * 64, _MM_HINT_T0);
            if (g * 64 < pf_s_bytes)
                _mm_prefetch(pf_s + g * 64, _MM_HINT_T0);
        }
        __m512 xe = _mm512_load_ps(xp + g * 32), xo = _mm512_load_ps(xp + g * 32 + 16);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            uint8_t s = sc[i][g];
            if (s == 255)
                continue;
            __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p[i] + g * 16)));
            __m512 tab = _mm512_load_ps(k3_kern_mx_table[s]);
            __m512 we = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_e), tab);
            __m512 wo = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_o), tab);
            acc[i][0] = _mm512_fmadd_ps(we, xe, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(wo, xo, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        __m512 lo = _mm512_permutex2var_ps(acc[i][0], un_lo, acc[i][1]);
        __m512 hi = _mm512_permutex2var_ps(acc[i][0], un_hi, acc[i][1]);
        Y[r + (uint64_t)i] = fold32(lo, hi);
    }
}

static void mx_t1_4(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *xp, float *Y, uint64_t r, uint64_t r_end) { mx_t1_tile(packed, scales, rows, cols, xp, Y, r, r_end, 4); }
static void mx_t1_8(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *xp, float *Y, uint64_t r, uint64_t r_end) { mx_t1_tile(packed, scales, rows, cols, xp, Y, r, r_end, 8); }
static void mx_t1_1(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *xp, float *Y, uint64_t r, uint64_t r_end) { mx_t1_tile(packed, scales, rows, cols, xp, Y, r, r_end, 1); }

/*
 * T = 1, a block of 8 rows none of whose groups has scale 255 (the usual
 * case): the same decode and order as mx_t1_tile, without its per-group test
 * and with fewer live pointers. mx_t1_offsets first turns the block's scales
 * into byte offsets of their k3_kern_mx_table rows (off[i * MX_T1_MAX_GROUPS
 * + g] = 64 * s), so a row-group costs one offset load, the 16-byte load, two
 * shifts, two lookups and two FMAs, with rows addressed as base + k * stride.
 * The lanes and their order are exactly those of mx_t1_tile.
 */
#define MX_T1_MAX_GROUPS (MX_T1_MAX_COLS / 32)
#ifndef MX_T1_PF_BLOCKS
#define MX_T1_PF_BLOCKS 1 /* prefetch distance in 8-row blocks */
#endif
#ifndef MX_T1_PF_HINT
#define MX_T1_PF_HINT _MM_HINT_T0
#endif
#ifndef MX_T1_PF2_BLOCKS
#define MX_T1_PF2_BLOCKS 3 /* and farther ahead into L2 */
#endif
#ifndef MX_T1_PF2_HINT
#define MX_T1_PF2_HINT _MM_HINT_T1
#endif

/* Fills off for rows sc[0..8) (groups scales each); 1 if any scale is 255.
 * 16-bit offsets (at most 255 * 64), 32 per step: this runs once per block
 * and cost about 6 % of the block's time with 32-bit ones, 16 per step. */
static int mx_t1_offsets(const uint8_t *sc, uint64_t groups, uint16_t *off)
{
    __mmask32 bad = 0;
    for (uint64_t g = 0; g < groups; g += 32) {
        __mmask32 m = groups - g >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (groups - g)) - 1);
#pragma GCC unroll 8
        for (uint64_t i = 0; i < 8; i++) {
            __m256i s = _mm256_maskz_loadu_epi8(m, sc + i * groups + g);
            bad |= _mm256_mask_cmpeq_epi8_mask(m, s, _mm256_set1_epi8(-1));
            _mm512_store_si512(off + i * MX_T1_MAX_GROUPS + g,
                               _mm512_slli_epi16(_mm512_cvtepu8_epi16(s), 6));
        }
    }
    return bad != 0;
}

/* noinline: inlined into avx512_gemm_mx_rows, GCC hoists the eight row
 * addresses and spills them again. */
__attribute__((noinline)) static void mx_t1_8_clean(const uint8_t *packed, const uint8_t *scales,
                                                    uint64_t cols, const uint16_t *off,
                                                    const float *xp, float *Y, uint64_t r,
                                                    uint64_t r_end)
{
    const __m512i sh_e = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    const __m512i sh_o = _mm512_set_epi32(28, 28, 28, 28, 20, 20, 20, 20, 12, 12, 12, 12, 4, 4, 4, 4);
    const __m512i un_lo = _mm512_set_epi32(29, 13, 25, 9, 21, 5, 17, 1, 28, 12, 24, 8, 20, 4, 16, 0);
    const __m512i un_hi = _mm512_set_epi32(31, 15, 27, 11, 23, 7, 19, 3, 30, 14, 26, 10, 22, 6, 18, 2);
    const char *tb = (const char *)k3_kern_mx_table;
    uint64_t groups = cols / 32, rs = cols / 2, rs3 = 3 * rs;
    /* the next block, fetched while this one runs (see mx_t1_tile): its
     * scales now, its packed bytes two lines per group; without a next
     * block the lines fetched are this block's own (no branch in the loop) */
    const char *pf_p = (const char *)(packed + r * rs), *pf_2 = pf_p;
    if (r + 8 * (MX_T1_PF_BLOCKS + 1) <= r_end) {
        pf_p += 8 * MX_T1_PF_BLOCKS * rs;
        const char *pf_s = (const char *)(scales + (r + 8 * MX_T1_PF_BLOCKS) * groups);
        for (uint64_t b = 0; b < 8 * groups; b += 64)
            _mm_prefetch(pf_s + b, MX_T1_PF_HINT);
    }
    /* a second stream MX_T1_PF2_BLOCKS ahead into L2 keeps more lines in
     * flight than the fill buffers of L1 allow: +4-6 % cold (bench/README.md) */
    if (r + 8 * (MX_T1_PF2_BLOCKS + 1) <= r_end)
        pf_2 += 8 * MX_T1_PF2_BLOCKS * rs;
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const uint8_t *b0 = packed + r * rs, *b4 = b0 + 4 * rs;
    for (uint64_t g = 0; g < groups; g++) {
        _mm_prefetch(pf_p + g * 128, MX_T1_PF_HINT);
        _mm_prefetch(pf_p + g * 128 + 64, MX_T1_PF_HINT);
        _mm_prefetch(pf_2 + g * 128, MX_T1_PF2_HINT);
        _mm_prefetch(pf_2 + g * 128 + 64, MX_T1_PF2_HINT);
        __m512 xe = _mm512_load_ps(xp + g * 32), xo = _mm512_load_ps(xp + g * 32 + 16);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const uint8_t *q = (i < 4 ? b0 : b4) + ((i & 3) == 3 ? rs3 : (uint64_t)(i & 3) * rs);
            __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
            __m512 tab = _mm512_load_ps((const float *)(tb + off[i * MX_T1_MAX_GROUPS + g]));
            __m512 we = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_e), tab);
            __m512 wo = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_o), tab);
            acc[i][0] = _mm512_fmadd_ps(we, xe, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(wo, xo, acc[i][1]);
        }
        b0 += 16;
        b4 += 16;
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        __m512 lo = _mm512_permutex2var_ps(acc[i][0], un_lo, acc[i][1]);
        __m512 hi = _mm512_permutex2var_ps(acc[i][0], un_hi, acc[i][1]);
        Y[r + (uint64_t)i] = fold32(lo, hi);
    }
}

/* K3_MX_T1=checked forces mx_t1_tile for every block (tests cover both). */
static int mx_t1_clean_allowed(void)
{
    static int pick; /* 0 unknown, 1 allowed, 2 forced off */
    int p = __atomic_load_n(&pick, __ATOMIC_ACQUIRE);
    if (!p) {
        const char *force = getenv("K3_MX_T1");
        p = force && !strcmp(force, "checked") ? 2 : 1;
        __atomic_store_n(&pick, p, __ATOMIC_RELEASE);
    }
    return p == 1;
}

/* xp = x with each group of 32 reordered: 16 even elements then 16 odd ones,
 * element 2*(4*(j%4) + j/4) (+1) at position j. */
static void mx_t1_permute_x(const float *x, uint64_t cols, float *xp)
{
    const __m512i pe = _mm512_set_epi32(30, 22, 14, 6, 28, 20, 12, 4, 26, 18, 10, 2, 24, 16, 8, 0);
    const __m512i po = _mm512_add_epi32(pe, _mm512_set1_epi32(1));
    for (uint64_t c = 0; c < cols; c += 32) {
        __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
        _mm512_store_ps(xp + c, _mm512_permutex2var_ps(a, pe, b));
        _mm512_store_ps(xp + c + 16, _mm512_permutex2var_ps(a, po, b));
    }
}

static void avx512_gemm_mx_rows(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                                uint64_t cols, const float *X, uint32_t T, float *Y,
                                uint64_t r0, uint64_t r1)
{
    const struct mx_tiles *k = mx_tiles_pick();
    uint64_t r = r0;
    if (T == 1 && cols <= MX_T1_MAX_COLS) {
        _Alignas(64) float xp[MX_T1_MAX_COLS];
        _Alignas(64) uint16_t off[8 * MX_T1_MAX_GROUPS];
        int clean = mx_t1_clean_allowed();
        mx_t1_permute_x(X, cols, xp);
        for (; r + 8 <= r1; r += 8) {
            if (clean && !mx_t1_offsets(scales + r * (cols / 32), cols / 32, off))
                mx_t1_8_clean(packed, scales, cols, off, xp, Y, r, r1);
            else
                mx_t1_8(packed, scales, rows, cols, xp, Y, r, r1);
        }
        for (; r + 4 <= r1; r += 4)
            mx_t1_4(packed, scales, rows, cols, xp, Y, r, r1);
        for (; r < r1; r++)
            mx_t1_1(packed, scales, rows, cols, xp, Y, r, r1);
        return;
    }
    if (T == 1) {
        for (; r + 4 <= r1; r += 4)
            k->t4x1(packed, scales, rows, cols, X, Y, r, 0);
        for (; r < r1; r++)
            k->t1x1(packed, scales, rows, cols, X, Y, r, 0);
        return;
    }
    mx_batched(k->chunks, k->dtile, packed, scales, rows, cols, X, T, Y, r0, r1);
}

const k3_kern_path k3_kern_path_avx512 = {
    .name = "avx512",
    .gemm_bf16_rows = avx512_gemm_bf16_rows,
    .gemm_f32_rows = avx512_gemm_f32_rows,
    .gemm_f16_rows = avx512_gemm_f16_rows,
    .gemm_mx_rows = avx512_gemm_mx_rows,
    .situ = k3_kern_situ_avx512,
    .exp_n = k3_kern_exp_n_avx512,
    .expf_n = k3_kern_expf_n_avx512,
    .dot8x4 = k3_kern_dot8x4_avx2,
    .axpy4 = k3_kern_axpy4_avx2,
    .kda_step = k3_kern_kda_step_avx512,
};
