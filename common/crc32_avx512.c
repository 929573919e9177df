/*
 * crc32_avx512.c - the VPCLMULQDQ path of k3_crc32: the folding of crc32.c
 * (see the derivation there) on four 512-bit registers, i.e. 16 independent
 * 128-bit lanes, 256 bytes per step.
 *
 * Built with the AVX-512 flags (file suffix); VPCLMULQDQ comes from the
 * target attribute. crc32.c only calls this when CPUID says it can run, and
 * only with n >= K3_CRC_MIN_VPCLMUL. Lane j of register i holds the blocks
 * 16 m + 4 i + j; each lane folds by 16 blocks (2048 bits), then the
 * registers join by 1536/1024/512 bits and the four lanes of the last one by
 * 384/256/128 bits; crc32.c finishes the whole blocks left and the bytes.
 */
#include "crc32_impl.h"

#include <immintrin.h>

#define TARGET_VPCLMUL __attribute__((target("avx512f,avx512vl,pclmul,vpclmulqdq")))

/* a 512-bit register with the fold pair k in each 128-bit lane */
TARGET_VPCLMUL static inline __m512i kload512(const uint64_t k[2])
{
    return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)k));
}

/* z x^D lane by lane, plus the next data d (three-way XOR) */
TARGET_VPCLMUL static inline __m512i fold512(__m512i z, __m512i k, __m512i d)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z, k, 0x00),
                                     _mm512_clmulepi64_epi128(z, k, 0x11), d, 0x96);
}

TARGET_VPCLMUL static inline __m128i fold128(__m128i x, const uint64_t k[2], __m128i d)
{
    __m128i kk = _mm_load_si128((const __m128i *)k);
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(x, kk, 0x00),
                                  _mm_clmulepi64_si128(x, kk, 0x11), d, 0x96);
}

TARGET_VPCLMUL uint32_t k3_crc32_vpclmul(uint32_t crc, const uint8_t *p, size_t n)
{
    const k3_crc_consts *k = &k3_crc_k;
    const __m512i k2048 = kload512(k->f2048);
    __m512i z0 = _mm512_loadu_si512(p);
    __m512i z1 = _mm512_loadu_si512(p + 64);
    __m512i z2 = _mm512_loadu_si512(p + 128);
    __m512i z3 = _mm512_loadu_si512(p + 192);
    z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        z0 = fold512(z0, k2048, _mm512_loadu_si512(p));
        z1 = fold512(z1, k2048, _mm512_loadu_si512(p + 64));
        z2 = fold512(z2, k2048, _mm512_loadu_si512(p + 128));
        z3 = fold512(z3, k2048, _mm512_loadu_si512(p + 192));
    }
    const __m512i k512 = kload512(k->f512);
    __m512i z = fold512(z0, kload512(k->f1536), fold512(z1, kload512(k->f1024), fold512(z2, k512, z3)));
    for (; n >= 64; p += 64, n -= 64)
        z = fold512(z, k512, _mm512_loadu_si512(p));
    __m128i x = fold128(_mm512_extracti32x4_epi32(z, 0), k->f384,
                        fold128(_mm512_extracti32x4_epi32(z, 1), k->f256,
                                fold128(_mm512_extracti32x4_epi32(z, 2), k->f128,
                                        _mm512_extracti32x4_epi32(z, 3))));
    return k3_crc_fold_finish(x, p, n);
}
