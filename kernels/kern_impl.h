/*
 * kern_impl.h - the table of functions each instruction-set path provides, and
 * what the paths share. Internal to kernels/ (and tests/, which compare every
 * path against the scalar one directly).
 *
 * A path computes output rows [r0, r1) of Y for all T vectors; rows outside
 * that range are not touched, so callers may split rows across threads in any
 * way without changing a single bit (the per-row order is fixed by ref.c).
 */
#ifndef K3_KERN_IMPL_H
#define K3_KERN_IMPL_H

#include <stdint.h>
#include <string.h>

typedef void (*k3_kern_bf16_rows_fn)(const uint16_t *W, uint64_t rows, uint64_t cols,
                                     const float *X, uint32_t T, float *Y,
                                     uint64_t r0, uint64_t r1);
typedef void (*k3_kern_mx_rows_fn)(const uint8_t *packed, const uint8_t *scales,
                                   uint64_t rows, uint64_t cols, const float *X, uint32_t T,
                                   float *Y, uint64_t r0, uint64_t r1);

typedef void (*k3_kern_f32_rows_fn)(const float *W, uint64_t rows, uint64_t cols,
                                    const float *X, uint32_t T, float *Y,
                                    uint64_t r0, uint64_t r1);

typedef void (*k3_kern_situ_fn)(float *g, const float *u, uint64_t n, float b1, float b2);
typedef void (*k3_kern_exp_n_fn)(double *y, const double *x, uint64_t n);
typedef void (*k3_kern_expf_n_fn)(float *y, const float *x, uint64_t n);
typedef void (*k3_kern_dot8x4_fn)(const float *a, const float *const b[4], uint32_t n, float out[4]);
typedef void (*k3_kern_axpy4_fn)(float *y, const float w[4], const float *const x[4], uint32_t n);
typedef void (*k3_kern_kda_step_fn)(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                                    const float *v, double beta, double *o);

/* One entry per weight type. gemm_f16_rows takes IEEE half weights (same
 * signature as bf16). A path may leave gemm_f32_rows / gemm_f16_rows NULL:
 * dispatch then runs the scalar one for that type (same bits, slower), so a
 * new ISA can land its bf16/MXFP4 products first. */
typedef struct k3_kern_path {
    const char *name;
    k3_kern_bf16_rows_fn gemm_bf16_rows;
    k3_kern_mx_rows_fn gemm_mx_rows;
    k3_kern_f32_rows_fn gemm_f32_rows;
    k3_kern_bf16_rows_fn gemm_f16_rows;
    k3_kern_situ_fn situ;   /* k3_situ; NULL: the scalar one */
    k3_kern_exp_n_fn exp_n;     /* k3_exp_n; NULL: the scalar one */
    k3_kern_expf_n_fn expf_n;   /* k3_expf_n; NULL: the scalar one */
    k3_kern_dot8x4_fn dot8x4;   /* k3_dot8x4; NULL: the scalar one */
    k3_kern_axpy4_fn axpy4;     /* k3_axpy4; NULL: the scalar one */
    k3_kern_kda_step_fn kda_step;   /* k3_kda_step; NULL: the scalar one */
} k3_kern_path;

extern const k3_kern_path k3_kern_path_scalar;
extern const k3_kern_path k3_kern_path_avx2;    /* x86-64 builds only */
extern const k3_kern_path k3_kern_path_avx512;  /* x86-64 builds only */
extern const k3_kern_path k3_kern_path_neon;    /* aarch64 builds only */

void k3_kern_situ_scalar(float *g, const float *u, uint64_t n, float b1, float b2);   /* ref.c */
void k3_kern_situ_avx512(float *g, const float *u, uint64_t n, float b1, float b2);   /* act_avx512.c */
void k3_kern_situ_avx2(float *g, const float *u, uint64_t n, float b1, float b2);     /* act_avx2.c */
void k3_kern_exp_n_scalar(double *y, const double *x, uint64_t n);   /* ref.c */
void k3_kern_exp_n_avx512(double *y, const double *x, uint64_t n);   /* act_avx512.c */
void k3_kern_exp_n_avx2(double *y, const double *x, uint64_t n);     /* act_avx2.c */
void k3_kern_expf_n_scalar(float *y, const float *x, uint64_t n);    /* ref.c */
void k3_kern_expf_n_avx512(float *y, const float *x, uint64_t n);    /* act_avx512.c */
void k3_kern_expf_n_avx2(float *y, const float *x, uint64_t n);      /* act_avx2.c */
void k3_kern_exp_n_neon(double *y, const double *x, uint64_t n);     /* attn_neon.c */
void k3_kern_expf_n_neon(float *y, const float *x, uint64_t n);      /* attn_neon.c */
void k3_kern_dot8x4_neon(const float *a, const float *const b[4], uint32_t n, float out[4]);     /* attn_neon.c */
void k3_kern_axpy4_neon(float *y, const float w[4], const float *const x[4], uint32_t n);        /* attn_neon.c */
void k3_kern_kda_step_neon(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                           const float *v, double beta, double *o);     /* attn_neon.c */
void k3_kern_dot8x4_scalar(const float *a, const float *const b[4], uint32_t n, float out[4]);   /* ref.c */
void k3_kern_axpy4_scalar(float *y, const float w[4], const float *const x[4], uint32_t n);      /* ref.c */
void k3_kern_dot8x4_avx2(const float *a, const float *const b[4], uint32_t n, float out[4]);     /* attn_avx2.c */
void k3_kern_axpy4_avx2(float *y, const float w[4], const float *const x[4], uint32_t n);        /* attn_avx2.c */
/* k3_kda_step for the state's columns [j0, j1) only (ref.c): the scalar
 * path, and the vector paths' code for columns left over. */
void k3_kern_kda_cols(float *S, uint32_t D, uint32_t j0, uint32_t j1, const double *decay, const double *k,
                      const double *q, const float *v, double beta, double *o);
void k3_kern_kda_step_scalar(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                             const float *v, double beta, double *o);   /* ref.c */
void k3_kern_kda_step_avx2(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                           const float *v, double beta, double *o);     /* kda_avx2.c */
void k3_kern_kda_step_avx512(float *S, uint32_t D, const double *decay, const double *k, const double *q,
                             const float *v, double beta, double *o);   /* kda_avx512.c */
/* k3_dot8x4's last steps from the partial sums p of elements [0, c): the
 * elements [c, n) into sums 0, 1, ..., then the combine (ref.c). */
void k3_kern_dot8x4_finish(const float *a, const float *const b[4], uint32_t c, uint32_t n, float p[4][8],
                           float out[4]);

/* The path in use (k3_kern_init has run). */
const k3_kern_path *k3_kern_path_current(void);
/* A path by name if this CPU runs it, else NULL. */
const k3_kern_path *k3_kern_path_find(const char *isa);

/* k3_exp's constants (ref.c): ln 2 in two parts (k * LN2_HI is exact for
 * every k the range gives), 1 / ln 2, and the Taylor coefficients, highest
 * power first, of k3_exp (14), k3_expf (9) and tanh's e^x - 1 near 0 (14). */
#define K3_KERN_LN2_HI 0x1.62e42fee00000p-1
#define K3_KERN_LN2_LO 0x1.a39ef35793c76p-33
#define K3_KERN_INV_LN2 0x1.71547652b82fep0
extern const double k3_kern_exp_c[14];
extern const double k3_kern_expf_c[9];
extern const double k3_kern_expm1_c[14];

/* The 16 E2M1 values in nibble order (bit 3 = sign, so entry 8 is -0). */
extern const float k3_kern_e2m1_table[16];

/* k3_kern_mx_table[s][n] = e2m1(n) * 2^(s-127), the exact ref.c weight, for
 * every scale byte (row 255 is all zero; such groups are skipped anyway).
 * Filled before main by a constructor in ref.c (plain C, no ISA flags), so
 * the paths look weights up with one load instead of a multiply. 16 KiB. */
extern float k3_kern_mx_table[256][16];
/* For 8-entry lookups (AVX2 vpermps): entry m (0..7) of k3_kern_mx_table[s]
 * with bits 28..30 xored with m, so that xoring the looked-up value with
 * (nibble << 28) restores those bits and sets the sign from bit 3 in one op. */
extern uint32_t k3_kern_mx_table8x[256][8];

/* 2^(s-127) built from its bits (s = 0 is the subnormal 2^-127); 0 for 255.
 * Same values as k3_e8m0_scale, inline for the per-group step of the paths. */
static inline float k3_kern_e8m0(uint8_t s)
{
    uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0u : (uint32_t)s << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
