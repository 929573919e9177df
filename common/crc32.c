/*
 * crc32.c - zlib's CRC-32 by carry-less multiplication (see k3_crc.h): path
 * choice, the folding constants, and the PCLMULQDQ path.
 *
 * Invariants: the path is chosen once (pthread once) unless k3_crc_use
 * changes it; a folding path is only chosen when CPUID and the OS (XGETBV)
 * say it can run; the constants are derived from the polynomial before any
 * folding path is chosen; every path returns zlib's value (tests/t_crc.c).
 *
 * The mathematics. P = x^32 + x^26 + x^23 + x^22 + x^16 + x^12 + x^11 + x^10
 * + x^8 + x^7 + x^5 + x^4 + x^2 + x + 1 (0x104C11DB7). For a message M of
 * bits m, zlib returns ~R where R = (M(x) x^32 + S x^(8 len)) mod P and S is
 * ~crc; as in any CRC, adding S into the first 32 message bits gives the same
 * R with S = 0, so the folding paths XOR ~crc into the first 4 bytes, need
 * len >= 4, and compute R = M x^32 mod P. zlib's CRC is bit-reflected: bit 0
 * of byte 0 is the highest coefficient of M.
 *
 * Representation. 16 bytes loaded little-endian into a 128-bit register r
 * stand for the polynomial sum r_k x^(127-k); a 64-bit word q for sum q_k
 * x^(63-k) ("rep"). So the low 64-bit half of a register is the upper half H
 * of its polynomial, X = H x^64 + L. PCLMULQDQ multiplies integers without
 * carries: bit k of a*b is the XOR of a_i b_j over i + j = k, the coefficient
 * of x^(126-k) of A B, i.e. bit k stands for x^(127-k) of A B x. Every
 * reflected product carries one extra factor x, which the constants absorb.
 *
 * Folding. With X the state over the bytes read so far and N the next 16
 * bytes, the new state is X x^128 + N. Any polynomial congruent mod P will do
 * as long as it fits in 128 bits: X x^D = H x^(D+64) + L x^D, and with
 * k1 = x^(D+63) mod P, k2 = x^(D-1) mod P (degree < 32),
 *   clmul(H, rep k1) = H k1 x == H x^(D+64),  clmul(L, rep k2) == L x^D,
 * each of degree < 64 + 32 = 96. Four registers that each hold every fourth
 * block fold by D = 512 independently (four multiply chains in flight), then
 * join as X0 x^384 + X1 x^256 + X2 x^128 + X3.
 *
 * Reduction of the last register X (degree < 128) to R = X x^32 mod P:
 *   1. X x^32 = H x^96 + L x^32 == clmul(H, rep(x^95 mod P)) + L x^32 = Y,
 *      degree < 96 (L x^32 is the high half shifted left 32 in the register);
 *   2. Y = Yh x^64 + Yl, Yh of degree < 32: Yh x^64 == clmul(Yh, rep(x^63 mod
 *      P)), degree < 64, so Z = that + Yl has degree < 64;
 *   3. Barrett: Z = Zh x^32 + Zl; with mu = floor(x^64 / P) the quotient is
 *      exactly q = floor(Zh mu / x^32) (deg Z < 2 deg P), and
 *      R = Z - q P = Zl + (q P mod x^32).
 * Step 3 takes the bits out of the 128-bit products with shifts that undo the
 * extra factor x. The bytes after the last whole block (0..15) are finished
 * by zlib from R. The constants are derived at start-up by crc_consts_derive
 * from P itself (x^n mod P by shifting, mu by long division), not typed in.
 */
#include "k3_crc.h"
#include "crc32_impl.h"
#include "k3_err.h"

#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define CRC_POLY 0x104C11DB7ull /* normal form, bit d = coefficient of x^d */

k3_crc_consts k3_crc_k;

/* ---- constants from the polynomial ---------------------------------------- */

/* x^n mod P, normal form (degree < 32) */
static uint32_t xpow_mod(unsigned n)
{
    uint64_t r = 1;
    while (n--) {
        r <<= 1;
        if (r >> 32)
            r ^= CRC_POLY;
    }
    return (uint32_t)r;
}

static uint64_t bitrev64(uint64_t v)
{
    uint64_t r = 0;
    for (int i = 0; i < 64; i++, v >>= 1)
        r = (r << 1) | (v & 1);
    return r;
}

/* rep(K) for K in normal form of degree < 64: coefficient of x^d to bit 63-d */
static uint64_t rep(uint64_t normal)
{
    return bitrev64(normal);
}

static void fold_pair(uint64_t k[2], unsigned d)
{
    k[0] = rep(xpow_mod(d + 63));
    k[1] = rep(xpow_mod(d - 1));
}

static void crc_consts_derive(k3_crc_consts *k)
{
    fold_pair(k->f128, 128);
    fold_pair(k->f256, 256);
    fold_pair(k->f384, 384);
    fold_pair(k->f512, 512);
    fold_pair(k->f1024, 1024);
    fold_pair(k->f1536, 1536);
    fold_pair(k->f2048, 2048);
    k->x95 = rep(xpow_mod(95));
    k->x63 = rep(xpow_mod(63));
    /* mu = floor(x^64 / P): the x^32 quotient term leaves x^64 - x^32 P =
     * (P - x^32) x^32, then one long-division step per lower quotient bit */
    uint64_t q = 1ull << 32, r = (CRC_POLY ^ (1ull << 32)) << 32;
    for (int i = 31; i >= 0; i--)
        if ((r >> (i + 32)) & 1) {
            q |= 1ull << i;
            r ^= CRC_POLY << i;
        }
    k->mu = rep(q);
    k->poly = rep(CRC_POLY);
}

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

K3_CRC_TARGET_PCLMUL static uint32_t crc32_pclmul(uint32_t crc, const uint8_t *p, size_t n)
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

/* ---- path choice ---------------------------------------------------------- */

enum { PATH_ZLIB, PATH_PCLMUL, PATH_VPCLMUL };
static const char *const path_names[] = {"zlib", "pclmul", "vpclmul"};

struct crc_caps {
    int pclmul;     /* PCLMULQDQ (and SSE2, always there on x86-64) */
    int vpclmul;    /* + VPCLMULQDQ, AVX-512 F/VL, OS saves zmm/opmask */
};

static unsigned long long xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static struct crc_caps crc_caps_probe(void)
{
    struct crc_caps c = {0};
    unsigned int a, b, cx, d;
    if (!__get_cpuid(1, &a, &b, &cx, &d))
        return c;
    c.pclmul = (cx >> 1) & 1;
    int osxsave = (cx >> 27) & 1;
    if (!c.pclmul || !osxsave || __get_cpuid_max(0, NULL) < 7)
        return c;
    int zmm_ok = (xgetbv0() & 0xe6) == 0xe6;
    __cpuid_count(7, 0, a, b, cx, d);
    int f = (b >> 16) & 1, vl = (b >> 31) & 1, vpclmul = (cx >> 10) & 1;
    c.vpclmul = zmm_ok && f && vl && vpclmul;
    return c;
}

static int g_path = PATH_ZLIB;
static char g_name[96];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int path_find(const char *name)
{
    struct crc_caps c = crc_caps_probe();
    if (!name)
        return -1;
    if (!strcmp(name, "zlib"))
        return PATH_ZLIB;
    if (!strcmp(name, "pclmul"))
        return c.pclmul ? PATH_PCLMUL : -1;
    if (!strcmp(name, "vpclmul"))
        return c.vpclmul ? PATH_VPCLMUL : -1;
    return -1;
}

static void init_once(void)
{
    crc_consts_derive(&k3_crc_k);
    struct crc_caps c = crc_caps_probe();
    int p = c.vpclmul ? PATH_VPCLMUL : c.pclmul ? PATH_PCLMUL : PATH_ZLIB;
    snprintf(g_name, sizeof g_name, "%s", path_names[p]);
    const char *want = getenv("K3_CRC");
    if (want && *want) {
        int forced = path_find(want);
        if (forced >= 0) {
            p = forced;
            snprintf(g_name, sizeof g_name, "%s (K3_CRC)", path_names[p]);
        } else {
            snprintf(g_name, sizeof g_name, "%s (K3_CRC=%.40s unavailable)", path_names[p], want);
        }
    }
    g_path = p;
}

void k3_crc_init(void)
{
    pthread_once(&g_once, init_once);
}

const char *k3_crc_name(void)
{
    k3_crc_init();
    return g_name;
}

int k3_crc_supported(const char *path)
{
    return path_find(path) >= 0;
}

int k3_crc_use(const char *path)
{
    k3_crc_init();
    int p = path_find(path);
    if (p < 0)
        return K3_EARG;
    g_path = p;
    snprintf(g_name, sizeof g_name, "%s", path_names[p]);
    return 0;
}

uint32_t k3_crc32(uint32_t crc, const void *buf, size_t len)
{
    k3_crc_init();
    const uint8_t *p = buf;
    if (g_path == PATH_VPCLMUL && len >= K3_CRC_MIN_VPCLMUL)
        return k3_crc32_vpclmul(crc, p, len);
    if (g_path != PATH_ZLIB && len >= K3_CRC_MIN_PCLMUL)
        return crc32_pclmul(crc, p, len);
    return (uint32_t)crc32_z(crc, p, len);
}
