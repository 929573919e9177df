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
 * accumulation order (documented there and summarised here); every SIMD path
 * reproduces them bit for bit. Results never depend on the thread count:
 * threads split independent output rows.
 *
 * Accumulation order (the contract, identical for bf16, f16, f32 and MXFP4): each output
 * Y[t][r] keeps 32 f32 lanes L[0..31], all +0 at the start. For c = 0, 1, ...,
 * cols-1 in order, L[c mod 32] = fmaf(w(r,c), X[t][c], L[c mod 32]) (one
 * correctly rounded fused multiply-add). Then the lanes are folded by a fixed
 * tree: for h = 16, 8, 4, 2, 1: L[l] = L[l] + L[l+h] for l < h; Y = L[0].
 *   bf16:  w(r,c) is the bf16 value widened exactly to f32.
 *   f16:   w(r,c) is the IEEE half widened exactly to f32 (k3_f16_to_f32;
 *          F16C vcvtph2ps on x86 gives the same value).
 *   f32:   w(r,c) is the stored f32.
 *   MXFP4: w(r,c) = e2m1(nibble) * 2^(s-127), one f32 multiply (exact except
 *          where the true value leaves the f32 range, e.g. 4 * 2^127 -> inf);
 *          s = 0 gives the subnormal 2^-127. A group whose scale byte is 255 is
 *          skipped entirely: no fmaf at all for its 32 columns, so it
 *          contributes exactly nothing even when X holds inf or NaN there.
 * NaN payloads and the sign of a NaN result are not part of the contract.
 */
#ifndef K3_KERN_H
#define K3_KERN_H

#include <stddef.h>
#include <stdint.h>

/* ---- dispatch -------------------------------------------------------------- */

/* Pick the fastest path the CPU has (x86-64: avx512, avx2 or scalar; aarch64:
 * neon or scalar; all give the ref.c bits), once; K3_ISA=scalar|avx2|avx512|
 * neon forces one (an unavailable or
 * unknown forced path falls back to the best available and k3_kern_name says
 * so; avx512bf16 is not built, see kernels/dispatch.c). Idempotent,
 * thread-safe after the first call. */
void k3_kern_init(void);
/* Name of the path in use, e.g. "avx512", or "avx2 (K3_ISA=avx512 unavailable)";
 * calls k3_kern_init if needed. The string is static. */
const char *k3_kern_name(void);

/* The host's architecture (e.g. "x86_64") when this program runs under
 * user-mode emulation, such as an aarch64 build under qemu-aarch64: the
 * kernel's own architecture (/proc/sys/kernel/arch, which the emulator passes
 * through) differs from the one the program was built for. NULL when it runs
 * natively or the kernel does not say. Timings taken emulated say nothing
 * about the real CPU. The string is static. */
const char *k3_kern_emulated(void);

/* Whether this CPU (and this build) can run the named path: 1 or 0. */
int k3_kern_supported(const char *isa);
/* Switch to the named path now (tests, benchmarks). Returns 0, or K3_EARG for
 * an unknown name or a path this CPU cannot run (the path is then unchanged).
 * Not thread-safe: call it while no product is running. */
int k3_kern_use(const char *isa);

/* ---- scalar conversions (ref.c) ------------------------------------------- */

float k3_bf16_to_f32(uint16_t h);          /* exact (bf16 is the top half of an f32) */
uint16_t k3_f32_to_bf16(float f);          /* round to nearest even, overflow to inf,
                                              subnormals kept; NaN stays NaN (quiet) */
float k3_f16_to_f32(uint16_t h);           /* exact, subnormals and inf/NaN included */
float k3_f8e4m3_to_f32(uint8_t b);         /* E4M3 "fn": bias 7, no inf, S.1111.111 NaN */
float k3_f8e5m2_to_f32(uint8_t b);         /* E5M2: the top byte of an f16 */
float k3_e2m1_value(uint8_t nibble);        /* the 16 E2M1 values (high bits ignored) */
float k3_e8m0_scale(uint8_t s);             /* 2^(s-127) (s = 0: subnormal 2^-127); 0 for 255 */

/* e^x, the same bits on every architecture and C library (libm's exp is not:
 * see ref.c); about 1 ulp. The runtime's softmaxes, sigmoids and decays use
 * these, never libm's exp/expf/tanhf. NaN in, NaN out; overflow gives inf. */
double k3_exp(double x);
float k3_expf(float x);
/* y[i] = k3_exp(x[i]) for i < n, the same bits on every path, vectorised
 * where the CPU allows (y may be x). */
void k3_exp_n(double *y, const double *x, uint64_t n);
/* y[i] = k3_expf(x[i]) in the same way. */
void k3_expf_n(float *y, const float *x, uint64_t n);
/* tanh x in the same way (from e^2|x| - 1, exact near 0); -0 stays -0. */
float k3_tanhf(float x);
/* SiTU-GLU of n pairs, in place: g[i] = [b1 tanh(g[i]/b1) sigmoid(g[i])]
 * [b2 tanh(u[i]/b2)], sigmoid(x) = 1 / (1 + k3_expf(-x)), every float
 * operation in that order, with k3_tanhf and k3_expf: the same bits on every
 * path. One thread (callers split n). */
void k3_situ(float *g, const float *u, uint64_t n, float b1, float b2);
/* Attention's dots and weighted sums (engine/mla.c), the same bits on every
 * path; products are rounded before they are added (no FMA).
 * k3_dot8x4: out[j] = a . b[j] for j < 4, each over eight partial sums s_l
 * (element c, ascending, into s_(c mod 8) while c < n - n mod 8, the rest
 * into s_0, s_1, ...), combined ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)).
 * k3_axpy4: y[c] = (((y[c] + w0 x0[c]) + w1 x1[c]) + w2 x2[c]) + w3 x3[c]:
 * four weighted sums into y in that order. */
void k3_dot8x4(const float *a, const float *const b[4], uint32_t n, float out[4]);
void k3_axpy4(float *y, const float w[4], const float *const x[4], uint32_t n);
/* One token of KDA's delta rule (engine/kda.c) on a head's D x D float
 * state S (row i = key channel i), in double, the same bits on every path:
 *   S[i][j] = (float)(S[i][j] decay[i]),   u[j] = sum_i S[i][j] k[i]
 *   dl[j]   = beta (v[j] - u[j])
 *   S[i][j] = (float)(S[i][j] + k[i] dl[j]),   o[j] = sum_i S[i][j] q[i]
 * each S[i][j] widened from the float just stored; the sums over i
 * ascending from 0.0; products rounded before they are added (no FMA). */
void k3_kda_step(float *S, uint32_t D, const double *decay, const double *k, const double *q, const float *v,
                 double beta, double *o);

void k3_bf16_to_f32_n(const uint16_t *src, float *dst, uint64_t n);
void k3_f32_to_bf16_n(const float *src, uint16_t *dst, uint64_t n);
void k3_f16_to_f32_n(const uint16_t *src, float *dst, uint64_t n);

/* Quantize n floats (n a multiple of 32) to MXFP4 by the docs/MODEL.md §2.6 rule:
 * packed gets n/2 bytes, scales n/32 bytes. Per group of 32: amax = max |x|
 * (NaN ignored, inf as FLT_MAX); amax 0 gives scale byte 0 and zero nibbles;
 * else e = floor(log2 amax) - 2 clamped to [-127, 127], scale byte e + 127,
 * and each x / 2^e goes to the nearest E2M1 magnitude (ties to the even code,
 * saturating at 6) with the sign bit of x kept (so -0 gives nibble 8; NaN
 * gives magnitude 6). Data already of the form E2M1 * 2^(s-127) with some
 * |value| of 4 or 6 (s <= 252) comes back as the same bytes. */
void k3_mx_quantize(const float *x, uint64_t n, uint8_t *packed, uint8_t *scales);
/* Expand MXFP4 to floats (tests and reference only; the runtime never does). */
void k3_mx_dequantize(const uint8_t *packed, const uint8_t *scales, uint64_t n, float *x);

/* ---- products ------------------------------------------------------------- */

/* Y = X . W^T for a bf16 W: Y[t*rows + r] = sum_c W[r][c] * X[t*cols + c],
 * summed in the order given at the top of this file; any rows, any cols, any
 * T (the weights are read from memory once per call whatever T is).
 * Threaded over rows with OpenMP; inside a parallel region (or for small
 * products) it runs on the calling thread only. Never allocates; uses at most
 * 72 KiB of stack (activation permutation, parked lanes). */
void k3_gemm_bf16(const uint16_t *W, uint64_t rows, uint64_t cols,
                  const float *X, uint32_t T, float *Y);

/* The same for an MXFP4 W, straight from the nibbles and scales: no
 * dequantized copy of the matrix ever exists. At T = 1 the weights go from
 * nibbles to registers. For T > 1 the SIMD paths decode one tile at a time
 * (at most 8 rows x 512 columns, 16 KiB, in L1 on the stack) once per call
 * and reuse it for all T vectors; K3_MX_BATCH=checked forces a register-only
 * loop that decodes again for every 6 vectors (same bits, slower). cols must
 * be a multiple of 32 (not checked: the caller's shapes come from a
 * validated manifest). */
void k3_gemm_mx(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                const float *X, uint32_t T, float *Y);

/* The same for F32 and F16 (IEEE half) weights: a trunk tensor is used in
 * the dtype it was stored in, never rounded. Same contract as bf16, same
 * threading, any rows, cols, T. */
void k3_gemm_f32(const float *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y);
void k3_gemm_f16(const uint16_t *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y);

/* Single-threaded forms, for callers that parallelise at a higher level
 * (e.g. across experts); same results bit for bit. */
void k3_gemm_bf16_st(const uint16_t *W, uint64_t rows, uint64_t cols,
                     const float *X, uint32_t T, float *Y);
void k3_gemm_mx_st(const uint8_t *packed, const uint8_t *scales, uint64_t rows, uint64_t cols,
                   const float *X, uint32_t T, float *Y);
void k3_gemm_f32_st(const float *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y);
void k3_gemm_f16_st(const uint16_t *W, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y);

#endif
