/*
 * crc32_arm.c - the ARMv8 CRC32 instruction path of k3_crc32 (aarch64 builds
 * only; built with +crc by its file suffix, called only when AT_HWCAP says
 * the CPU has the instructions).
 *
 * CRC32B/H/W/X compute the bit-reflected CRC of the polynomial 0x04C11DB7,
 * zlib's, without the initial and final inversion (CRC32C* is the other
 * polynomial and is not used): so zlib's crc32(crc, p, n) is the inversion of
 * the instructions' CRC of p started from ~crc. tests/t_crc.c compares every
 * length and alignment with zlib itself. Bytes are taken as little-endian
 * 64-bit words (crc32.c selects this path on little-endian builds only).
 *
 * One dependent chain of CRC32X, 8 bytes per instruction: on cores where it
 * takes 2-3 cycles of latency that is 3-4 bytes per cycle, several GB/s, well
 * above what the I/O threads deliver per core.
 */
#include "crc32_impl.h"

#include <arm_acle.h>
#include <string.h>

uint32_t k3_crc32_armv8(uint32_t crc, const uint8_t *p, size_t n)
{
    uint32_t c = ~crc;
    /* bytes up to an 8-byte boundary, so that the word loads are aligned */
    while (n && ((uintptr_t)p & 7)) {
        c = __crc32b(c, *p++);
        n--;
    }
    for (; n >= 32; p += 32, n -= 32) {
        uint64_t w[4];
        memcpy(w, p, sizeof w);
        c = __crc32d(c, w[0]);
        c = __crc32d(c, w[1]);
        c = __crc32d(c, w[2]);
        c = __crc32d(c, w[3]);
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, sizeof w);
        c = __crc32d(c, w);
    }
    while (n--)
        c = __crc32b(c, *p++);
    return ~c;
}
