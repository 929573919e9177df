/*
 * crc32.c - zlib's CRC-32, computed faster (see k3_crc.h): path choice and
 * the folding constants of the carry-less multiplication paths. The paths
 * themselves are per architecture: crc32_x86.c (PCLMULQDQ) and
 * crc32_avx512.c (VPCLMULQDQ) on x86-64, crc32_arm.c (the ARMv8 CRC32
 * instructions) on aarch64; the Makefile builds only those of the target.
 *
 * Invariants: the path is chosen once (pthread once) unless k3_crc_use
 * changes it; a path is only chosen when the CPU and the OS say it can run
 * (x86-64: CPUID and XGETBV; aarch64: AT_HWCAP); the constants are derived
 * from the polynomial before any folding path is chosen; every path returns
 * zlib's value (tests/t_crc.c).
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

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif
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

/* ---- path choice ---------------------------------------------------------- */

enum { PATH_ZLIB, PATH_PCLMUL, PATH_VPCLMUL, PATH_ARMV8 };
static const char *const path_names[] = {"zlib", "pclmul", "vpclmul", "armv8"};

struct crc_caps {
    int pclmul;     /* PCLMULQDQ (and SSE2, always there on x86-64) */
    int vpclmul;    /* + VPCLMULQDQ, AVX-512 F/VL, OS saves zmm/opmask */
    int armv8;      /* aarch64 CRC32 instructions (AT_HWCAP) */
};

#if defined(__x86_64__)
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
#else
static struct crc_caps crc_caps_probe(void)
{
    struct crc_caps c = {0};
#if defined(__aarch64__) && defined(HWCAP_CRC32) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    c.armv8 = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#endif
    return c;
}
#endif

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
    if (!strcmp(name, "armv8"))
        return c.armv8 ? PATH_ARMV8 : -1;
    return -1;
}

static void init_once(void)
{
    crc_consts_derive(&k3_crc_k);
    struct crc_caps c = crc_caps_probe();
    int p = c.vpclmul ? PATH_VPCLMUL : c.pclmul ? PATH_PCLMUL : c.armv8 ? PATH_ARMV8 : PATH_ZLIB;
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
#if defined(__x86_64__)
    if (g_path == PATH_VPCLMUL && len >= K3_CRC_MIN_VPCLMUL)
        return k3_crc32_vpclmul(crc, p, len);
    if (g_path != PATH_ZLIB && len >= K3_CRC_MIN_PCLMUL)
        return k3_crc32_pclmul(crc, p, len);
#elif defined(__aarch64__)
    if (g_path == PATH_ARMV8 && len >= K3_CRC_MIN_ARMV8)
        return k3_crc32_armv8(crc, p, len);
#endif
    return (uint32_t)crc32_z(crc, p, len);
}
