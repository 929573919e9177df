/*
 * crc32_x86.c - the PCLMULQDQ path of k3_crc32 (x86-64 builds only): four
 * 128-bit streams folded by 512 bits, joined, reduced to 32 bits (Barrett)
 * and finished by zlib. The mathematics, the representation and the
 * constants are explained at the top of common/crc32.c, which derives the
 * constants and calls this path only when CPUID says it can run.
 */
#include "crc32_impl.h"

#include <immintrin.h>
#include <zlib.h>

/* ---- PCLMULQDQ path ------------------------------------------------------- */

/* x x^D for the fold pair k of distance D (see the top of the file) */
K3_CRC_TARGET_PCLMUL static inline __m128i fold(__m128i x, __m128i k)
{
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

K3_CRC_TARGET_PCLMUL static inline __m128i kload(const uint64_t k[2])
{
    return _mm_load_si128((const __m128i *)k);
}

/* the 128-bit carry-less product of two 64-bit words, as (lo, hi) */
K3_CRC_TARGET_PCLMUL static inline void clmul64(uint64_t a, uint64_t b, uint64_t *lo, uint64_t *hi)
{
    __m128i p = _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)a), _mm_cvtsi64_si128((long long)b), 0x00);
    *lo = (uint64_t)_mm_cvtsi128_si64(p);
    *hi = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(p, p));
}

/* R = X x^32 mod P, as a 32-bit reflected value (steps 1-3 at the top) */
K3_CRC_TARGET_PCLMUL static uint32_t reduce(__m128i x)
{
    const k3_crc_consts *k = &k3_crc_k;
    uint64_t h = (uint64_t)_mm_cvtsi128_si64(x);
    uint64_t l = (uint64_t)_mm_cvtsi128_si64(_mm_unpackhi_epi64(x, x));
    uint64_t ylo, yhi, t2lo, t2hi, wlo, whi;
    /* 1: Y, degree < 96, occupies register bits 32..127 */
    clmul64(h, k->x95, &ylo, &yhi);
    ylo ^= l << 32;
    yhi ^= l >> 32;
    /* 2: Yh sits in bits 32..63 of the low word, which is rep(Yh) */
    clmul64(ylo & 0xFFFFFFFF00000000ull, k->x63, &t2lo, &t2hi);
    uint64_t z = t2hi ^ yhi; /* rep(Z), degree < 64 */
    /* 3: rep(Zh) = low 32 bits of z moved up; the product is Zh mu x, whose
     * coefficients x^64..x^33 (bits 63..94) are q */
    clmul64((z & 0xFFFFFFFFull) << 32, k->mu, &wlo, &whi);
    uint32_t q = (uint32_t)((wlo >> 63) | (whi << 1));
    /* q P x: coefficients x^32..x^1 (bits 95..126) are q P mod x^32 */
    clmul64((uint64_t)q << 32, k->poly, &wlo, &whi);
    return (uint32_t)(z >> 32) ^ (uint32_t)(whi >> 31);
}

K3_CRC_TARGET_PCLMUL uint32_t k3_crc_fold_finish(__m128i x, const uint8_t *p, size_t n)
{
    const __m128i k128 = kload(k3_crc_k.f128);
    for (; n >= 16; p += 16, n -= 16)
        x = _mm_xor_si128(fold(x, k128), _mm_loadu_si128((const __m128i *)p));
    uint32_t r = reduce(x);
    return n ? (uint32_t)crc32_z(~r, p, n) : ~r;
}

K3_CRC_TARGET_PCLMUL uint32_t k3_crc32_pclmul(uint32_t crc, const uint8_t *p, size_t n)
{
    const __m128i k512 = kload(k3_crc_k.f512);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)~crc));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x0 = _mm_xor_si128(fold(x0, k512), _mm_loadu_si128((const __m128i *)p));
        x1 = _mm_xor_si128(fold(x1, k512), _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = _mm_xor_si128(fold(x2, k512), _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = _mm_xor_si128(fold(x3, k512), _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    __m128i x = _mm_xor_si128(_mm_xor_si128(fold(x0, kload(k3_crc_k.f384)), fold(x1, kload(k3_crc_k.f256))),
                              _mm_xor_si128(fold(x2, kload(k3_crc_k.f128)), x3));
    return k3_crc_fold_finish(x, p, n);
}
