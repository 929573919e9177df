/*
 * k3_kern.h - the numeric kernels: bf16/f16/fp8 <-> f32, MXFP4 quantization,
 * and the matrix products the model is made of.
 *
 * Layouts (row-major, no padding unless stated):
 *   bf16 matrix W: rows x cols uint16_t, W[r*cols + c]
 *   MXFP4 matrix:  packed rows x cols/2 bytes, element c of row r is the low
 *                  nibble of packed[r*cols/2 + c/2] when c is even, the high
 *                  nibble when odd; scales rows x cols/32 E8M0 bytes, scale
 *                  s of group g multiplies 2^(s-127); 255 contributes zero.
 *   activations:   X is T x cols f32 (X[t*cols + c]); Y is T x rows f32.
 *
 * The scalar definitions in kernels/ref.c are the contract, including the
 * accumulation order (documented there); every SIMD path reproduces them bit
 * for bit unless ref.c documents a bounded difference. Results never depend on
 * the thread count: threads split independent output rows.
 */
#ifndef K3_KERN_H
#define K3_KERN_H

#include <stddef.h>
#include <stdint.h>

/* ---- dispatch -------------------------------------------------------------- */

/* Pick the fastest path the CPU has, once; K3_ISA=scalar|avx2|avx512|avx512bf16
 * forces one (an unavailable forced path falls back to the best available and
 * k3_kern_name says so). Idempotent, thread-safe after the first call. */
void k3_kern_init(void);
/* Name of the path in use, e.g. "avx512"; calls k3_kern_init if needed. */
const char *k3_kern_name(void);

/* ---- scalar conversions (ref.c) ------------------------------------------- */

float k3_bf16_to_f32(uint16_t h);
uint16_t k3_f32_to_bf16(float f);          /* round to nearest even; NaN stays NaN */
float k3_f16_to_f32(uint16_t h);
float k3_f8e4m3_to_f32(uint8_t b);
float k3_f8e5m2_to_f32(uint8_t b);
float k3_e2m1_value(uint8_t nibble);        /* the 16 E2M1 values */
float k3_e8m0_scale(uint8_t s);             /* 2^(s-127); 0 for 255 */

void k3_bf16_to_f32_n(const uint16_t *src, float *dst, uint64_t n);
void k3_f32_to_bf16_n(const float *src, uint16_t *dst, uint64_t n);

/* Quantize n floats (n a multiple of 32) to MXFP4 by the SPEC §2 rule:
 * packed gets n/2 bytes, scales n/32 bytes. */
void k3_mx_quantize(const float *x, uint64_t n, uint8_t *packed, uint8_t *scales);
/* Expand MXFP4 to floats (tests and reference only; the runtime never does). */
void k3_mx_dequantize(const uint8_t *packed, const uint8_t *scales, uint64_t n, float *x);

/* ---- products ------------------------------------------------------------- */

/* Y = X . W^T for a bf16 W: Y[t*rows + r] = sum_c W[r][c] * X[t*cols + c].
 * Threaded over rows with OpenMP (nested calls run single-threaded). */
void k3_gemm_bf16(const uint16_t *W, uint64_t rows, uint64_t cols,
                  const float *X, uint32_t T, float *Y);

/* The same for an MXFP4 W (cols a multiple of 32), straight from the nibbles
 * and scales: no dequantized buffer. */
void k3_gemm_mx(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                const float *X, uint32_t T, float *Y);

/* Single-threaded forms, for callers that parallelise at a higher level
 * (e.g. across experts); same results bit for bit. */
void k3_gemm_bf16_st(const uint16_t *W, uint64_t rows, uint64_t cols,
                     const float *X, uint32_t T, float *Y);
void k3_gemm_mx_st(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *X, uint32_t T, float *Y);

#endif
