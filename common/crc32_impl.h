/*
 * crc32_impl.h - what crc32.c shares with the per-architecture paths: the
 * folding constants (derived once from the polynomial by crc32.c), the
 * 128-bit tail of the x86 folding paths, and each path's entry point. Not a
 * public header.
 *
 * Representation (see crc32.c for the derivation): a 128-bit register holding
 * 16 message bytes loaded little-endian stands for the polynomial whose x^127
 * coefficient is bit 0 of the first byte (zlib's CRC is bit-reflected). A
 * 64-bit constant "rep(K)" holds the coefficient of x^d of K in bit 63 - d.
 */
#ifndef K3_CRC32_IMPL_H
#define K3_CRC32_IMPL_H

#include <stddef.h>
#include <stdint.h>

/* fold pair for a distance of D bits: { rep(x^(D+63) mod P), rep(x^(D-1) mod P) }:
 * multiplies the low and the high 64-bit half of a 128-bit lane by x^D. */
typedef struct k3_crc_consts {
    _Alignas(64) uint64_t f128[2];
    _Alignas(16) uint64_t f256[2];
    _Alignas(16) uint64_t f384[2];
    _Alignas(16) uint64_t f512[2];
    _Alignas(16) uint64_t f1024[2];
    _Alignas(16) uint64_t f1536[2];
    _Alignas(16) uint64_t f2048[2];
    uint64_t x95;   /* rep(x^95 mod P): 128 -> 96 bits */
    uint64_t x63;   /* rep(x^63 mod P): 96 -> 64 bits */
    uint64_t mu;    /* rep(floor(x^64 / P)), 33 bits: Barrett quotient */
    uint64_t poly;  /* rep(P), 33 bits */
} k3_crc_consts;

/* Filled by k3_crc_init before any folding path can be chosen. */
extern k3_crc_consts k3_crc_k;

#if defined(__x86_64__)
#include <emmintrin.h>

#define K3_CRC_TARGET_PCLMUL __attribute__((target("sse2,pclmul")))

/* Fold x (the state over every byte before p, the initial CRC already mixed
 * in) over the n / 16 whole blocks at p, reduce it to 32 bits, and finish the
 * n % 16 last bytes with zlib. Returns the CRC as zlib returns it. */
K3_CRC_TARGET_PCLMUL uint32_t k3_crc_fold_finish(__m128i x, const uint8_t *p, size_t n);

/* The PCLMULQDQ path (crc32_x86.c); n >= K3_CRC_MIN_PCLMUL. */
uint32_t k3_crc32_pclmul(uint32_t crc, const uint8_t *p, size_t n);

/* The AVX-512 VPCLMULQDQ path (crc32_avx512.c); n >= K3_CRC_MIN_VPCLMUL. */
uint32_t k3_crc32_vpclmul(uint32_t crc, const uint8_t *p, size_t n);
#endif

/* The ARMv8 CRC32 instruction path (crc32_arm.c, aarch64 builds only);
 * n >= K3_CRC_MIN_ARMV8. */
uint32_t k3_crc32_armv8(uint32_t crc, const uint8_t *p, size_t n);

#define K3_CRC_MIN_PCLMUL  64u    /* 4 x 16 bytes: one load per stream */
#define K3_CRC_MIN_VPCLMUL 256u   /* 4 x 64 bytes */
#define K3_CRC_MIN_ARMV8   16u    /* below that zlib's table is as quick */
#endif
