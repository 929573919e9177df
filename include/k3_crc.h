/*
 * k3_crc.h - CRC-32 of model data: zlib's crc32, computed faster.
 *
 * k3_crc32 returns bit for bit what zlib's crc32(crc, buf, len) returns (the
 * reflected polynomial 0x04C11DB7, initial and final inversion), for any
 * size_t length: callers need no uInt-sized loops. Chaining works as with
 * zlib: k3_crc32(k3_crc32(c, a, n), b, m) == k3_crc32(c, ab, n + m). To join
 * CRCs of pieces computed apart, keep using zlib's crc32_combine.
 *
 * The path is chosen once, from CPUID (common/crc32.c): "vpclmul" (AVX-512
 * VPCLMULQDQ, 4 x 512-bit streams), "pclmul" (PCLMULQDQ, 4 x 128-bit streams)
 * or "zlib" (zlib's own crc32). Buffers shorter than a few blocks go to zlib
 * on every path. K3_CRC=zlib|pclmul|vpclmul forces a path; an unknown or
 * unavailable one falls back to the best available and k3_crc_name says so.
 */
#ifndef K3_CRC_H
#define K3_CRC_H

#include <stddef.h>
#include <stdint.h>

/* zlib's crc32(crc, buf, len) for any len. buf may be NULL only with len 0;
 * then, like zlib, the result is 0 (the initial value), whatever crc is.
 * Thread-safe; picks the path on the first call (k3_crc_init). */
uint32_t k3_crc32(uint32_t crc, const void *buf, size_t len);

/* Choose the path (CPUID, K3_CRC) and derive the folding constants, once.
 * Idempotent and thread-safe; k3_crc32 calls it itself. */
void k3_crc_init(void);

/* Name of the path in use, e.g. "vpclmul", "zlib (K3_CRC)" or
 * "pclmul (K3_CRC=vpclmul unavailable)". The string is static. */
const char *k3_crc_name(void);

/* Whether this CPU and build can run the named path: 1 or 0. */
int k3_crc_supported(const char *path);

/* Switch to the named path now (tests, benchmarks). Returns 0, or K3_EARG for
 * an unknown name or a path this CPU cannot run (the path is then unchanged).
 * Not thread-safe: call it while no CRC is being computed. */
int k3_crc_use(const char *path);

#endif
