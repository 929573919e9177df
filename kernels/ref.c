/*
 * ref.c - the scalar definition of every number the runtime computes: the
 * bf16/f16/fp8/E2M1/E8M0 conversions, MXFP4 quantization, and the bf16, f16,
 * f32 and MXFP4 matrix products with their accumulation order. Plain C, built with
 * -ffp-contract=off and without fast-math; fmaf() is the only fused operation.
 * Every SIMD path (gemm_avx2.c, gemm_avx512.c) must give the same bits as the
 * functions here; tests/t_kernels.c checks that.
 *
 * Product contract (also in include/k3_kern.h): for each output Y[t][r], 32
 * f32 lanes start at +0; column c goes to lane c mod 32 through one fmaf, in
 * increasing c; then the lanes fold by halves (16, 8, 4, 2, 1). The MXFP4
 * weight is e2m1 * 2^(s-127) rounded once to f32, and a group with scale 255
 * is skipped. 32 lanes because that is two AVX-512 or four AVX2 registers:
 * enough independent chains to hide the FMA latency with one row in flight.
 */
#include "k3_kern.h"
#include "kern_impl.h"

#include <math.h>
#include <string.h>

/* ---- conversions ---------------------------------------------------------- */

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

float k3_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t k3_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)         /* NaN: keep sign and payload top, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* round to nearest, ties to even: add 0x7fff plus the lowest kept bit;
     * a carry into the exponent is the correct rounding (up to inf). */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float k3_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f)                             /* inf / NaN */
        return f32_from_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {                              /* zero / subnormal: man * 2^-24, exact */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/* E4M3 "fn": bias 7, no infinities, S.1111.111 is NaN, subnormals man*2^-9. */
float k3_f8e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu;
    uint32_t man = b & 0x7u;
    if (exp == 0xf && man == 0x7)
        return f32_from_bits(sign | 0x7fc00000u);
    if (exp == 0) {
        float v = (float)man * 0x1p-9f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

/* E5M2 is the top byte of an IEEE half. */
float k3_f8e5m2_to_f32(uint8_t b)
{
    return k3_f16_to_f32((uint16_t)((uint16_t)b << 8));
}

const float k3_kern_e2m1_table[16] = {
    0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

_Alignas(64) float k3_kern_mx_table[256][16];
_Alignas(32) uint32_t k3_kern_mx_table8x[256][8];

__attribute__((constructor)) static void mx_table_fill(void)
{
    for (int s = 0; s < 256; s++)
        for (int n = 0; n < 16; n++)
            k3_kern_mx_table[s][n] = k3_kern_e2m1_table[n] * k3_kern_e8m0((uint8_t)s);
    for (int s = 0; s < 256; s++)
        for (uint32_t m = 0; m < 8; m++)
            k3_kern_mx_table8x[s][m] = f32_bits(k3_kern_mx_table[s][m]) ^ (m << 28);
}

float k3_e2m1_value(uint8_t nibble)
{
    return k3_kern_e2m1_table[nibble & 0xfu];
}

float k3_e8m0_scale(uint8_t s)
{
    return k3_kern_e8m0(s);
}

void k3_bf16_to_f32_n(const uint16_t *src, float *dst, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        dst[i] = k3_bf16_to_f32(src[i]);
}

void k3_f16_to_f32_n(const uint16_t *src, float *dst, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        dst[i] = k3_f16_to_f32(src[i]);
}

void k3_f32_to_bf16_n(const float *src, uint16_t *dst, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        dst[i] = k3_f32_to_bf16(src[i]);
}

/* ---- exponential ---------------------------------------------------------- */

/*
 * e^x from IEEE basic operations only (no libm, no fused operations), so
 * that every architecture and C library computes the same bits: libm's exp
 * is within about 0.5 ulp but not correctly rounded, and x86-64 (FMA and
 * non-FMA variants) and aarch64 builds of it disagree in the last bit now
 * and then, which is enough to change logits. Method: k = nearest integer
 * to x / ln 2, r = x - k ln 2 in two steps (Cody-Waite: LN2_HI has 32 significant bits,
 * so k * LN2_HI is exact), e^r by its Taylor series in Horner form (|r| <= 0.347:
 * the first omitted term of k3_exp is below 2^-60 relative, of k3_expf
 * below 2^-27), then times 2^k as ldexp would (exact, or one correct
 * rounding into the subnormals). Error about 1 ulp of double; k3_expf rounds the
 * double result to float once.
 */
#define LN2_HI K3_KERN_LN2_HI
#define LN2_LO K3_KERN_LN2_LO
#define INV_LN2 K3_KERN_INV_LN2

/* The series' coefficients, highest power first (also the vector paths'). */
const double k3_kern_exp_c[14] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                  1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,
                                  1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,         0.5,
                                  1.0,                1.0};
const double k3_kern_expf_c[9] = {1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
                                  1.0 / 6.0,     0.5,          1.0,         1.0};
const double k3_kern_expm1_c[14] = {1.0 / 87178291200.0, 1.0 / 6227020800.0, 1.0 / 479001600.0,
                                    1.0 / 39916800.0,    1.0 / 3628800.0,    1.0 / 362880.0,
                                    1.0 / 40320.0,       1.0 / 5040.0,       1.0 / 720.0,
                                    1.0 / 120.0,         1.0 / 24.0,         1.0 / 6.0,
                                    0.5,                 1.0};

static double exp_reduce(double x, int *k)
{
    /* floor of y, |y| < 1100: truncation, one less for a negative fraction
     * (exact: both are integers well inside double's range) */
    const double y = x * INV_LN2 + 0.5;
    int64_t t = (int64_t)y;
    t -= (double)t > y;
    const double kd = (double)t;
    *k = (int)t;
    return (x - kd * LN2_HI) - kd * LN2_LO;
}

/* p * 2^k, as ldexp: one multiplication by the power of two when 2^k is a
 * normal double (the product is then correctly rounded, exactly ldexp's
 * result), ldexp itself beyond. No libm call on the common path. */
static double scale2(double p, int k)
{
    if (k < -1022 || k > 1023)
        return ldexp(p, k);
    const uint64_t b = (uint64_t)(k + 1023) << 52;
    double two;
    memcpy(&two, &b, sizeof two);
    return p * two;
}

double k3_exp(double x)
{
    if (x != x)
        return x + x;
    if (x > 709.8)
        return INFINITY;
    if (x < -745.2)
        return 0.0;
    int k;
    double r = exp_reduce(x, &k);
    const double *c = k3_kern_exp_c;
    double p = c[0];
    for (int i = 1; i < 14; i++)
        p = p * r + c[i];
    return scale2(p, k);
}

float k3_expf(float x)
{
    if (x != x)
        return x + x;
    if (x > 89.0f)
        return INFINITY;
    if (x < -104.0f)
        return 0.0f;
    int k;
    double r = exp_reduce((double)x, &k);
    const double *c = k3_kern_expf_c;
    double p = c[0];
    for (int i = 1; i < 9; i++)
        p = p * r + c[i];
    return (float)scale2(p, k);
}

/* e^x - 1, accurate near 0 too: the series without its constant term for
 * |x| < 0.34 (no cancellation), else k3_exp(x) - 1 (at least 0.28 there). */
static double expm1_d(double x)
{
    if (fabs(x) < 0.34) {
        const double *c = k3_kern_expm1_c;
        double p = c[0];
        for (int i = 1; i < 14; i++)
            p = p * x + c[i];
        return p * x;
    }
    return k3_exp(x) - 1.0;
}

/* tanh x = (e^2a - 1) / (e^2a + 1) with a = |x|, the sign put back; 1 past
 * |x| = 20 (tanh 20 rounds to 1 even in double). */
float k3_tanhf(float x)
{
    double a = fabs((double)x);
    if (a > 20.0)
        return x > 0 ? 1.0f : -1.0f;
    double em = expm1_d(2.0 * a);
    return (float)copysign(em / (em + 2.0), (double)x);
}

/* ---- MXFP4 quantization --------------------------------------------------- */

/* Nearest E2M1 magnitude code (0..7) of a >= 0, ties to the even code (the
 * one whose mantissa bit is 0), saturating at 6; NaN gives 7. */
static uint8_t e2m1_code(double a)
{
    if (a <= 0.25) return 0;
    if (a < 0.75) return 1;
    if (a <= 1.25) return 2;
    if (a < 1.75) return 3;
    if (a <= 2.5) return 4;
    if (a < 3.5) return 5;
    if (a <= 5.0) return 6;
    return 7;
}

/*
 * The rule (docs/MODEL.md §2.6), per group of 32 consecutive values:
 *   amax = the largest |x| (NaN ignored; inf counts as FLT_MAX);
 *   amax == 0 (or only NaN): scale byte 0 and all nibbles 0;
 *   else e = floor(log2(amax)) - 2, clamped to [-127, 127]; scale byte e+127;
 *   each x / 2^e (exact, in double) goes to the nearest E2M1 magnitude with
 *   ties to the even code, saturating at 6; the sign bit of x is kept, so -0
 *   and negatives that round to 0 give nibble 8 (-0); NaN gives magnitude 6.
 * A group that is already exactly E2M1 * 2^(s-127) with some |value| of 4 or
 * 6 and s <= 252 comes back with the same bytes.
 */
void k3_mx_quantize(const float *x, uint64_t n, uint8_t *packed, uint8_t *scales)
{
    for (uint64_t g = 0; g < n / 32; g++) {
        const float *v = x + g * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[i]);
            if (a > amax)
                amax = a;
        }
        uint8_t *p = packed + g * 16;
        if (amax == 0.0f) {
            scales[g] = 0;
            memset(p, 0, 16);
            continue;
        }
        if (isinf(amax))
            amax = 0x1.fffffep127f;
        int ex;
        (void)frexpf(amax, &ex);                 /* amax = m * 2^ex, m in [0.5, 1) */
        int e = ex - 1 - 2;
        if (e < -127)
            e = -127;
        if (e > 127)
            e = 127;
        scales[g] = (uint8_t)(e + 127);
        for (int i = 0; i < 32; i += 2) {
            uint8_t nib[2];
            for (int k = 0; k < 2; k++) {
                float f = v[i + k];
                double a = ldexp(fabs((double)f), -e);
                nib[k] = (uint8_t)(e2m1_code(isnan(f) ? 6.0 : a) | (signbit(f) ? 8u : 0u));
            }
            p[i / 2] = (uint8_t)(nib[0] | (nib[1] << 4));
        }
    }
}

void k3_mx_dequantize(const uint8_t *packed, const uint8_t *scales, uint64_t n, float *x)
{
    for (uint64_t c = 0; c < n; c++) {
        uint8_t byte = packed[c / 2];
        uint8_t nib = (c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0xfu);
        x[c] = k3_kern_e2m1_table[nib] * k3_kern_e8m0(scales[c / 32]);
    }
}

/* ---- products ------------------------------------------------------------- */

#define LANES 32

/* The fixed fold of the 32 lanes: halves added lane by lane. */
static float lanes_fold(float *L)
{
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++)
            L[l] = L[l] + L[l + h];
    return L[0];
}

static void ref_gemm_bf16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                               const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    for (uint64_t r = r0; r < r1; r++) {
        const uint16_t *w = W + r * cols;
        for (uint32_t t = 0; t < T; t++) {
            const float *x = X + (uint64_t)t * cols;
            float L[LANES] = {0};
            for (uint64_t c = 0; c < cols; c++)
                L[c % LANES] = fmaf(k3_bf16_to_f32(w[c]), x[c], L[c % LANES]);
            Y[(uint64_t)t * rows + r] = lanes_fold(L);
        }
    }
}

/* F32 and F16 weights: the bf16 contract with w(r,c) the stored value widened
 * exactly to f32 (an f32 weight is used as is). */
static void ref_gemm_f32_rows(const float *W, uint64_t rows, uint64_t cols,
                              const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    for (uint64_t r = r0; r < r1; r++) {
        const float *w = W + r * cols;
        for (uint32_t t = 0; t < T; t++) {
            const float *x = X + (uint64_t)t * cols;
            float L[LANES] = {0};
            for (uint64_t c = 0; c < cols; c++)
                L[c % LANES] = fmaf(w[c], x[c], L[c % LANES]);
            Y[(uint64_t)t * rows + r] = lanes_fold(L);
        }
    }
}

static void ref_gemm_f16_rows(const uint16_t *W, uint64_t rows, uint64_t cols,
                              const float *X, uint32_t T, float *Y, uint64_t r0, uint64_t r1)
{
    for (uint64_t r = r0; r < r1; r++) {
        const uint16_t *w = W + r * cols;
        for (uint32_t t = 0; t < T; t++) {
            const float *x = X + (uint64_t)t * cols;
            float L[LANES] = {0};
            for (uint64_t c = 0; c < cols; c++)
                L[c % LANES] = fmaf(k3_f16_to_f32(w[c]), x[c], L[c % LANES]);
            Y[(uint64_t)t * rows + r] = lanes_fold(L);
        }
    }
}

static void ref_gemm_mx_rows(const uint8_t *packed, const uint8_t *scales, uint64_t rows,
                             uint64_t cols, const float *X, uint32_t T, float *Y,
                             uint64_t r0, uint64_t r1)
{
    uint64_t groups = cols / 32;
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *p = packed + r * (cols / 2);
        const uint8_t *s = scales + r * groups;
        for (uint32_t t = 0; t < T; t++) {
            const float *x = X + (uint64_t)t * cols;
            float L[LANES] = {0};
            for (uint64_t g = 0; g < groups; g++) {
                if (s[g] == 255)
                    continue;
                float scale = k3_kern_e8m0(s[g]);
                for (int k = 0; k < 32; k++) {
                    uint8_t byte = p[g * 16 + k / 2];
                    uint8_t nib = (k & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0xfu);
                    float w = k3_kern_e2m1_table[nib] * scale;
                    L[k] = fmaf(w, x[g * 32 + k], L[k]);
                }
            }
            Y[(uint64_t)t * rows + r] = lanes_fold(L);
        }
    }
}

/* SiTU-GLU of n pairs: g[i] = [b1 tanh(g/b1) sigmoid(g)] [b2 tanh(u/b2)], the
 * order of every float operation as written (the vector paths' reference,
 * and their code for blocks with a non-finite lane and for tails). */
void k3_kern_situ_scalar(float *g, const float *u, uint64_t n, float b1, float b2)
{
    for (uint64_t i = 0; i < n; i++) {
        const float x = g[i];
        const float gate = (b1 * k3_tanhf(x / b1)) * (1.0f / (1.0f + k3_expf(-x)));
        g[i] = gate * (b2 * k3_tanhf(u[i] / b2));
    }
}

void k3_situ(float *g, const float *u, uint64_t n, float b1, float b2)
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->situ ? p->situ : k3_kern_situ_scalar)(g, u, n, b1, b2);
}

void k3_kern_exp_n_scalar(double *y, const double *x, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        y[i] = k3_exp(x[i]);
}

void k3_exp_n(double *y, const double *x, uint64_t n)
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->exp_n ? p->exp_n : k3_kern_exp_n_scalar)(y, x, n);
}

void k3_kern_expf_n_scalar(float *y, const float *x, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        y[i] = k3_expf(x[i]);
}

void k3_expf_n(float *y, const float *x, uint64_t n)
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->expf_n ? p->expf_n : k3_kern_expf_n_scalar)(y, x, n);
}

void k3_kern_dot8x4_finish(const float *a, const float *const b[4], uint32_t c, uint32_t n, float p[4][8],
                           float out[4])
{
    for (uint32_t l = 0; c < n; c++, l++)
        for (int j = 0; j < 4; j++)
            p[j][l] += a[c] * b[j][c];
    for (int j = 0; j < 4; j++)
        out[j] = ((p[j][0] + p[j][4]) + (p[j][1] + p[j][5])) + ((p[j][2] + p[j][6]) + (p[j][3] + p[j][7]));
}

void k3_kern_dot8x4_scalar(const float *a, const float *const b[4], uint32_t n, float out[4])
{
    float p[4][8];
    memset(p, 0, sizeof p);
    uint32_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++)
                p[j][l] += a[c + l] * b[j][c + l];
    k3_kern_dot8x4_finish(a, b, c, n, p, out);
}

void k3_kern_axpy4_scalar(float *y, const float w[4], const float *const x[4], uint32_t n)
{
    for (uint32_t c = 0; c < n; c++)
        y[c] = (((y[c] + w[0] * x[0][c]) + w[1] * x[1][c]) + w[2] * x[2][c]) + w[3] * x[3][c];
}

void k3_dot8x4(const float *a, const float *const b[4], uint32_t n, float out[4])
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->dot8x4 ? p->dot8x4 : k3_kern_dot8x4_scalar)(a, b, n, out);
}

void k3_axpy4(float *y, const float w[4], const float *const x[4], uint32_t n)
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->axpy4 ? p->axpy4 : k3_kern_axpy4_scalar)(y, w, x, n);
}

void k3_kern_kda_cols(float *S, uint32_t D, uint32_t j0, uint32_t j1, const double *decay, const double *k,
                      const double *q, const float *v, double beta, double *o)
{
    for (uint32_t j = j0; j < j1; j++) {
        double u = 0.0;
        for (uint32_t i = 0; i < D; i++) {
            float *s = S + (uint64_t)i * D + j;
            *s = (float)((double)*s * decay[i]);
            u += (double)*s * k[i];
        }
        const double dl = beta * ((double)v[j] - u);
        double acc = 0.0;
        for (uint32_t i = 0; i < D; i++) {
            float *s = S + (uint64_t)i * D + j;
            *s = (float)((double)*s + k[i] * dl);
            acc += (double)*s * q[i];
        }
        o[j] = acc;
    }
}

void k3_kern_kda_step_scalar(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                             const float *v, double beta, double *o)
{
    k3_kern_kda_cols(S, D, 0, D, decay, k, q, v, beta, o);
}

void k3_kda_step(float *S, uint32_t D, const double *decay, const double *k, const double *q, const float *v,
                 double beta, double *o)
{
    const k3_kern_path *p = k3_kern_path_current();
    (p->kda_step ? p->kda_step : k3_kern_kda_step_scalar)(S, D, decay, k, q, v, beta, o);
}

const k3_kern_path k3_kern_path_scalar = {
    .name = "scalar",
    .gemm_bf16_rows = ref_gemm_bf16_rows,
    .gemm_mx_rows = ref_gemm_mx_rows,
    .gemm_f32_rows = ref_gemm_f32_rows,
    .gemm_f16_rows = ref_gemm_f16_rows,
    .situ = k3_kern_situ_scalar,
    .exp_n = k3_kern_exp_n_scalar,
    .expf_n = k3_kern_expf_n_scalar,
    .dot8x4 = k3_kern_dot8x4_scalar,
    .axpy4 = k3_kern_axpy4_scalar,
    .kda_step = k3_kern_kda_step_scalar,
};
