/*
 * gemm_neon.c - the aarch64 Advanced SIMD (NEON) products, bit-identical to
 * ref.c (aarch64 builds only).
 *
 * The 32 contract lanes of one output are eight float32x4_t accumulators
 * (lanes 4k..4k+3 in acc[k]); every column step is one vfmaq_f32, a fused
 * multiply-add rounded once, exactly fmaf; fold32 adds the lanes in the
 * ref.c tree order. A column tail (cols not a multiple of 32) goes through
 * zero-padded copies and a select that leaves lanes past the end untouched,
 * as ref.c does no fmaf for them (an fma with 0 * 0 would turn a -0 lane +0).
 *
 * bf16 weights widen exactly with one shift (vshll: bf16 is the top half of
 * an f32), f16 weights with vcvt (exact), f32 weights are used as loaded: one
 * tile (w_tile) serves all three.
 *
 * MXFP4 decode, 32 weights (one group) at a time: the 16 bytes split into low
 * and high nibbles, which zip back into element order (element 2i is the low
 * nibble of byte i). Every E2M1 value, signed, is exactly a bf16 whose two
 * bytes depend on the nibble alone, so two 16-entry byte lookups (vqtbl1q_u8)
 * give the high and the low byte of 16 weights at once; zipped they are bf16,
 * widened like the bf16 weights, then one f32 multiply by the group's scale
 * 2^(s-127): exactly the one rounding of ref.c's e2m1 * scale (nibble 8 is
 * -0, and -0 * scale is -0). A scale-255 group is skipped: no fma at all.
 *
 * T = 1 runs two rows at a time (16 accumulators) straight from the nibbles.
 * T > 1 decodes each row once per call and per 32 vectors, a chunk of at most
 * 16 groups at a time, into a 2 KiB buffer on the stack, and multiplies every
 * vector from there; the lanes of each vector are parked in a 4 KiB array
 * between chunks, so each lane still takes its columns in increasing order.
 * Never allocates.
 */
#include "k3_kern.h"
#include "kern_impl.h"

#include <arm_neon.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

AI float fold32(const float32x4_t *a)
{
    float32x4_t s0 = vaddq_f32(a[0], a[4]), s1 = vaddq_f32(a[1], a[5]); /* 16 */
    float32x4_t s2 = vaddq_f32(a[2], a[6]), s3 = vaddq_f32(a[3], a[7]);
    float32x4_t t0 = vaddq_f32(s0, s2), t1 = vaddq_f32(s1, s3);         /* 8 */
    float32x4_t u = vaddq_f32(t0, t1);                                  /* 4 */
    float32x2_t v = vadd_f32(vget_low_f32(u), vget_high_f32(u));        /* 2 */
    return vget_lane_f32(v, 0) + vget_lane_f32(v, 1);                   /* 1 */
}

AI void acc_zero(float32x4_t *a)
{
    for (int k = 0; k < 8; k++)
        a[k] = vdupq_n_f32(0.0f);
}

/* the 8 f32 weights of 8 bf16 values */
AI void bf16x8(const uint16_t *p, float32x4_t *lo, float32x4_t *hi)
{
    uint16x8_t h = vld1q_u16(p);
    *lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
    *hi = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
}

/* lanes 4k..4k+3 of a tail with n valid columns: all ones where valid */
AI uint32x4_t tail_mask(uint64_t n, int k)
{
    static const uint32_t idx[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)(n > (uint64_t)(4 * k) ? n - 4 * (uint64_t)k : 0)));
}

/* ---- bf16, f16, f32 ------------------------------------------------------- */

/* Weight types of the one tile below: each widens exactly to f32 (f16 by
 * vcvt, which, like F16C on x86, quiets a signalling NaN: NaN payloads are
 * not part of the contract). */
enum { WT_BF16, WT_F16, WT_F32 };

/* the 8 f32 weights at element i of a row of type WT */
AI void w8(const void *row, uint64_t i, const int WT, float32x4_t *lo, float32x4_t *hi)
{
    if (WT == WT_F32) {
        const float *p = (const float *)row + i;
        *lo = vld1q_f32(p);
        *hi = vld1q_f32(p + 4);
    } else if (WT == WT_F16) {
        float16x8_t h = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *)row + i));
        *lo = vcvt_f32_f16(vget_low_f16(h));
        *hi = vcvt_high_f32_f16(h);
    } else {
        bf16x8((const uint16_t *)row + i, lo, hi);
    }
}

AI void w_tile(const void *W, uint64_t rows, uint64_t cols, const float *X, float *Y,
               uint64_t r, uint32_t t0, const int R, const int TB, const int WT)
{
    const size_t es = WT == WT_F32 ? 4 : 2;
    float32x4_t acc[2][2][8];
    const char *w[2];
    const float *x[2];
#pragma GCC unroll 2
    for (int i = 0; i < R; i++) {
        w[i] = (const char *)W + (r + (uint64_t)i) * cols * es;
#pragma GCC unroll 2
        for (int j = 0; j < TB; j++)
            acc_zero(acc[i][j]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < TB; j++)
        x[j] = X + (uint64_t)(t0 + (uint32_t)j) * cols;
    uint64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
            __builtin_prefetch(w[i] + (c + 128) * es);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                float32x4_t wl, wh;
                w8(w[i], c + 8 * (uint64_t)k, WT, &wl, &wh);
#pragma GCC unroll 2
                for (int j = 0; j < TB; j++) {
                    acc[i][j][2 * k] = vfmaq_f32(acc[i][j][2 * k], wl, vld1q_f32(x[j] + c + 8 * k));
                    acc[i][j][2 * k + 1] = vfmaq_f32(acc[i][j][2 * k + 1], wh, vld1q_f32(x[j] + c + 8 * k + 4));
                }
            }
        }
    }
    if (c < cols) {
        uint64_t n = cols - c;
        _Alignas(16) float wt[32];  /* room for 32 weights of any type */
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
                    float32x4_t wl, wh;
                    w8(wt, 8 * (uint64_t)k, WT, &wl, &wh);
                    float32x4_t fl = vfmaq_f32(acc[i][j][2 * k], wl, vld1q_f32(xt + 8 * k));
                    float32x4_t fh = vfmaq_f32(acc[i][j][2 * k + 1], wh, vld1q_f32(xt + 8 * k + 4));
                    acc[i][j][2 * k] = vbslq_f32(tail_mask(n, 2 * k), fl, acc[i][j][2 * k]);
                    acc[i][j][2 * k + 1] = vbslq_f32(tail_mask(n, 2 * k + 1), fh, acc[i][j][2 * k + 1]);
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

/* T = 1: two rows at a time; T > 1: one row, two vectors at a time */
#define W_ROWS(NAME, TYPE, WT)                                                                         \
    static void NAME##_2x1(const TYPE *W, uint64_t rows, uint64_t cols, const float *X, float *Y,       \
                           uint64_t r, uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 2, 1, WT); }  \
    static void NAME##_1x1(const TYPE *W, uint64_t rows, uint64_t cols, const float *X, float *Y,       \
                           uint64_t r, uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 1, 1, WT); }  \
    static void NAME##_1x2(const TYPE *W, uint64_t rows, uint64_t cols, const float *X, float *Y,       \
                           uint64_t r, uint32_t t0) { w_tile(W, rows, cols, X, Y, r, t0, 1, 2, WT); }  \
    static void neon_gemm_##NAME##_rows(const TYPE *W, uint64_t rows, uint64_t cols, const float *X,    \
                                        uint32_t T, float *Y, uint64_t r0, uint64_t r1)                \
    {                                                                                                   \
        uint64_t r = r0;                                                                                \
        if (T == 1) {                                                                                   \
            for (; r + 2 <= r1; r += 2)                                                                 \
                NAME##_2x1(W, rows, cols, X, Y, r, 0);                                                  \
            for (; r < r1; r++)                                                                         \
                NAME##_1x1(W, rows, cols, X, Y, r, 0);                                                  \
            return;                                                                                     \
        }                                                                                               \
        for (; r < r1; r++) {                                                                           \
            uint32_t t = 0;                                                                             \
            for (; t + 2 <= T; t += 2)                                                                  \
                NAME##_1x2(W, rows, cols, X, Y, r, t);                                                  \
            if (t < T)                                                                                  \
                NAME##_1x1(W, rows, cols, X, Y, r, t);                                                  \
        }                                                                                               \
    }

W_ROWS(bf16, uint16_t, WT_BF16)
W_ROWS(f16, uint16_t, WT_F16)
W_ROWS(f32, float, WT_F32)

/* ---- MXFP4 ---------------------------------------------------------------- */

/* High and low byte of the bf16 form of each signed E2M1 value, by nibble:
 * 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (nibble 8 is -0). */
static const uint8_t e2m1_bf16_hi[16] = {0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40,
                                         0x80, 0xbf, 0xbf, 0xbf, 0xc0, 0xc0, 0xc0, 0xc0};
static const uint8_t e2m1_bf16_lo[16] = {0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0,
                                         0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0};

struct mx_luts {
    uint8x16_t hi, lo;
};

AI struct mx_luts mx_luts_load(void)
{
    struct mx_luts t = {vld1q_u8(e2m1_bf16_hi), vld1q_u8(e2m1_bf16_lo)};
    return t;
}

/* The 32 exact weights of one group (16 packed bytes at p, scale byte s,
 * s != 255) into w[0..7], in element order. */
AI void mx_decode32(const uint8_t *p, uint8_t s, struct mx_luts t, float32x4_t *w)
{
    uint8x16_t b = vld1q_u8(p);
    uint8x16_t lo = vandq_u8(b, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(b, 4);
    uint8x16_t n[2] = {vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)};         /* elements 0..15, 16..31 */
    float scale = k3_kern_e8m0(s);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        uint8x16_t bh = vqtbl1q_u8(t.hi, n[h]), bl = vqtbl1q_u8(t.lo, n[h]);
        uint16x8_t v0 = vreinterpretq_u16_u8(vzip1q_u8(bl, bh));         /* bf16 of 8 elements */
        uint16x8_t v1 = vreinterpretq_u16_u8(vzip2q_u8(bl, bh));
        w[4 * h + 0] = vmulq_n_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v0), 16)), scale);
        w[4 * h + 1] = vmulq_n_f32(vreinterpretq_f32_u32(vshll_high_n_u16(v0, 16)), scale);
        w[4 * h + 2] = vmulq_n_f32(vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v1), 16)), scale);
        w[4 * h + 3] = vmulq_n_f32(vreinterpretq_f32_u32(vshll_high_n_u16(v1, 16)), scale);
    }
}

AI void mx_t1_tile(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *x, float *Y, uint64_t r, const int R)
{
    const struct mx_luts t = mx_luts_load();
    uint64_t groups = cols / 32;
    float32x4_t acc[2][8];
    const uint8_t *p[2], *sc[2];
#pragma GCC unroll 2
    for (int i = 0; i < R; i++) {
        acc_zero(acc[i]);
        p[i] = packed + (r + (uint64_t)i) * (cols / 2);
        sc[i] = scales + (r + (uint64_t)i) * groups;
    }
    for (uint64_t g = 0; g < groups; g++) {
#pragma GCC unroll 2
        for (int i = 0; i < R; i++) {
            uint8_t s = sc[i][g];
            if (s == 255)
                continue;
            __builtin_prefetch(p[i] + g * 16 + 256);
            float32x4_t w[8];
            mx_decode32(p[i] + g * 16, s, t, w);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                acc[i][k] = vfmaq_f32(acc[i][k], w[k], vld1q_f32(x + g * 32 + 4 * k));
        }
    }
#pragma GCC unroll 2
    for (int i = 0; i < R; i++)
        Y[r + (uint64_t)i] = fold32(acc[i]);
}

static void mx_t1_2(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *x, float *Y, uint64_t r) { mx_t1_tile(packed, scales, rows, cols, x, Y, r, 2); }
static void mx_t1_1(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols, const float *x, float *Y, uint64_t r) { mx_t1_tile(packed, scales, rows, cols, x, Y, r, 1); }

#define MXB_CHUNK 16    /* groups decoded at a time: 512 weights, 2 KiB */
#define MXB_TSLICE 32   /* vectors whose lanes are parked at a time: 4 KiB */

/* TB vectors from t over the ng groups of a decoded chunk; lanes in accb. */
AI void mxb_tile(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0,
                 uint32_t t, float *accb, uint64_t ng, const int TB)
{
    float32x4_t acc[2][8];
    const float *x[2];
#pragma GCC unroll 2
    for (int j = 0; j < TB; j++) {
        for (int k = 0; k < 8; k++)
            acc[j][k] = vld1q_f32(accb + (uint64_t)j * 32 + 4 * (uint64_t)k);
        x[j] = X + (uint64_t)(t + (uint32_t)j) * cols + c0;
    }
    for (uint64_t g = 0; g < ng; g++) {
        if (skip[g])
            continue;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            float32x4_t w = vld1q_f32(wb + g * 32 + 4 * (uint64_t)k);
#pragma GCC unroll 2
            for (int j = 0; j < TB; j++)
                acc[j][k] = vfmaq_f32(acc[j][k], w, vld1q_f32(x[j] + g * 32 + 4 * (uint64_t)k));
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < TB; j++)
        for (int k = 0; k < 8; k++)
            vst1q_f32(accb + (uint64_t)j * 32 + 4 * (uint64_t)k, acc[j][k]);
}

static void mxb_tile_1(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t ng) { mxb_tile(wb, skip, X, cols, c0, t, accb, ng, 1); }
static void mxb_tile_2(const float *wb, const uint8_t *skip, const float *X, uint64_t cols, uint64_t c0, uint32_t t, float *accb, uint64_t ng) { mxb_tile(wb, skip, X, cols, c0, t, accb, ng, 2); }

static void mx_batched(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                       const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    const struct mx_luts lut = mx_luts_load();
    _Alignas(16) float accb[MXB_TSLICE * 32];
    _Alignas(16) float wbuf[MXB_CHUNK * 32];
    uint8_t skip[MXB_CHUNK];
    uint64_t groups = cols / 32;
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *p = packed + r * (cols / 2), *sc = scales + r * groups;
        for (uint32_t ts = 0; ts < T; ts += MXB_TSLICE) {
            uint32_t nt = T - ts < MXB_TSLICE ? T - ts : MXB_TSLICE;
            memset(accb, 0, (size_t)nt * 32 * sizeof(float));
            for (uint64_t g0 = 0; g0 < groups; g0 += MXB_CHUNK) {
                uint64_t ng = groups - g0 < MXB_CHUNK ? groups - g0 : MXB_CHUNK;
                for (uint64_t g = 0; g < ng; g++) {
                    skip[g] = sc[g0 + g] == 255;
                    if (skip[g])
                        continue;
                    float32x4_t w[8];
                    mx_decode32(p + (g0 + g) * 16, sc[g0 + g], lut, w);
                    for (int k = 0; k < 8; k++)
                        vst1q_f32(wbuf + g * 32 + 4 * (uint64_t)k, w[k]);
                }
                uint32_t t = 0;
                for (; t + 2 <= nt; t += 2)
                    mxb_tile_2(wbuf, skip, X, cols, g0 * 32, ts + t, accb + (uint64_t)t * 32, ng);
                if (t < nt)
                    mxb_tile_1(wbuf, skip, X, cols, g0 * 32, ts + t, accb + (uint64_t)t * 32, ng);
            }
            for (uint32_t t = 0; t < nt; t++) {
                float32x4_t v[8];
                for (int k = 0; k < 8; k++)
                    v[k] = vld1q_f32(accb + (uint64_t)t * 32 + 4 * (uint64_t)k);
                Y[(uint64_t)(ts + t) * rows + r] = fold32(v);
            }
        }
    }
}

static void neon_gemm_mx_rows(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                              uint64_t cols, const float *X, uint32_t T, float *Y,
                              uint64_t r0, uint64_t r1)
{
    uint64_t r = r0;
    if (T == 1) {
        for (; r + 2 <= r1; r += 2)
            mx_t1_2(packed, scales, rows, cols, X, Y, r);
        for (; r < r1; r++)
            mx_t1_1(packed, scales, rows, cols, X, Y, r);
        return;
    }
    mx_batched(packed, scales, rows, cols, X, T, Y, r0, r1);
}

const k3_kern_path k3_kern_path_neon = {
    .name = "neon",
    .gemm_bf16_rows = neon_gemm_bf16_rows,
    .gemm_mx_rows = neon_gemm_mx_rows,
    .gemm_f32_rows = neon_gemm_f32_rows,
    .gemm_f16_rows = neon_gemm_f16_rows,
    .exp_n = k3_kern_exp_n_neon,
    .expf_n = k3_kern_expf_n_neon,
    .dot8x4 = k3_kern_dot8x4_neon,
    .axpy4 = k3_kern_axpy4_neon,
    .kda_step = k3_kern_kda_step_neon,
};
