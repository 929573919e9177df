/*
 * t_crc.c - k3_crc32 against zlib's crc32 on every path this build and CPU
 * run (vpclmul, pclmul on x86-64; armv8, the CRC32 instructions, on aarch64;
 * zlib everywhere): every length 0..600 at every start alignment
 * 0..63, random lengths up to several MiB, chained calls split anywhere,
 * initial CRCs, a length past 4 GiB, and the choice of path (K3_CRC).
 */
#include "k3_crc.h"
#include "k3_err.h"
#include "k3_test.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <zlib.h>

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t rnd(void) { return k3t_xorshift(&rng_state); }

static uint8_t *random_bytes(size_t n)
{
    uint8_t *b = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(rnd() >> 56);
    return b;
}

static const char *const paths[] = {"vpclmul", "pclmul", "armv8", "zlib"};
#define NPATHS (sizeof paths / sizeof paths[0])

/* zlib's answer, in uInt-sized calls as zlib's API asks */
static uint32_t zcrc(uint32_t crc, const uint8_t *p, size_t n)
{
    uLong c = crc;
    if (!n)
        return (uint32_t)crc32(c, p, 0);
    while (n) {
        uInt take = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, p, take);
        p += take;
        n -= take;
    }
    return (uint32_t)c;
}

/* Runs the statement once per path this CPU supports, with that path in use. */
#define FOR_EACH_PATH(i) \
    for (unsigned i = 0; i < NPATHS; i++) \
        if (k3_crc_supported(paths[i]) && k3_crc_use(paths[i]) == 0)

K3_TEST(crc_matches_zlib_for_every_length_to_600_at_every_alignment)
{
    uint8_t *buf = random_bytes(600 + 64);
    FOR_EACH_PATH(i)
    {
        long bad = 0;
        for (size_t n = 0; n <= 600; n++)
            for (size_t a = 0; a < 64; a++) {
                uint32_t init = (uint32_t)rnd();
                uint32_t want = zcrc(init, buf + a, n), got = k3_crc32(init, buf + a, n);
                if (want != got && bad++ < 3)
                    k3t_fail(__FILE__, __LINE__, "%s len %zu align %zu crc %08x: zlib %08x, k3 %08x",
                             paths[i], n, a, init, want, got);
            }
        CHECK_EQ_INT(bad, 0);
    }
    free(buf);
}

K3_TEST(crc_matches_zlib_on_random_lengths_up_to_6_mib)
{
    size_t cap = 6u << 20;
    uint8_t *buf = random_bytes(cap + 64);
    /* the edges of every block size, then random lengths and alignments */
    size_t lens[64] = {4095, 4096, 4097, 65535, 65536, 65537, 1u << 20, (1u << 20) + 255, cap};
    for (size_t k = 9; k < 64; k++)
        lens[k] = (size_t)(rnd() % cap) + 1;
    for (size_t k = 0; k < 64; k++) {
        size_t a = (size_t)(rnd() % 64);
        uint32_t init = k % 3 == 0 ? 0 : k % 3 == 1 ? 0xFFFFFFFFu : (uint32_t)rnd();
        uint32_t want = zcrc(init, buf + a, lens[k]);
        FOR_EACH_PATH(i)
        {
            uint32_t got = k3_crc32(init, buf + a, lens[k]);
            if (got != want)
                k3t_fail(__FILE__, __LINE__, "%s len %zu align %zu crc %08x: zlib %08x, k3 %08x",
                         paths[i], lens[k], a, init, want, got);
        }
    }
    free(buf);
}

K3_TEST(crc_chained_calls_split_anywhere_equal_one_call)
{
    size_t n = 1u << 20;
    uint8_t *buf = random_bytes(n);
    uint32_t want = zcrc(0, buf, n);
    FOR_EACH_PATH(i)
    {
        for (int round = 0; round < 40; round++) {
            /* pieces from 0 bytes to a few KiB, and now and then a big one */
            uint32_t c = 0;
            size_t at = 0;
            while (at < n) {
                size_t piece = rnd() % 8 == 0 ? (size_t)(rnd() % (n / 4)) : (size_t)(rnd() % 3000);
                if (piece > n - at)
                    piece = n - at;
                c = k3_crc32(c, buf + at, piece);
                at += piece;
            }
            if (c != want)
                k3t_fail(__FILE__, __LINE__, "%s round %d: chained %08x, zlib %08x", paths[i], round, c, want);
        }
        /* the value after each piece is zlib's too, not only the last one */
        uint32_t c = 0, z = 0;
        for (size_t at = 0, piece = 1; at < n; at += piece, piece = piece * 3 + 1) {
            if (piece > n - at)
                piece = n - at;
            c = k3_crc32(c, buf + at, piece);
            z = zcrc(z, buf + at, piece);
            CHECK_EQ_U64(c, z);
        }
    }
    free(buf);
}

K3_TEST(crc_null_and_empty_buffers_behave_like_zlib)
{
    uint8_t b[1] = {0x5a};
    FOR_EACH_PATH(i)
    {
        CHECK_EQ_U64(k3_crc32(0x12345678u, NULL, 0), crc32(0x12345678u, Z_NULL, 0));
        CHECK_EQ_U64(k3_crc32(0x12345678u, b, 0), crc32(0x12345678u, b, 0));
        CHECK_EQ_U64(k3_crc32(0, b, 1), crc32(0, b, 1));
    }
    /* the well-known check value of CRC-32 */
    CHECK_EQ_U64(k3_crc32(0, "123456789", 9), 0xCBF43926u);
}

/* One call over more than 4 GiB (zlib's uInt would wrap). The middle is
 * untouched anonymous memory, so it costs no RAM; bytes at both ends and
 * straddling 4 GiB are set so the length and the position both matter.
 * The folding paths only: the zlib path is crc32_z itself. */
K3_TEST_TIMEOUT(crc_one_call_past_4_gib, 300)
{
    size_t n = (4ull << 30) + 4099;
    uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    CHECK(p != MAP_FAILED);
    if (p == MAP_FAILED)
        return;
    madvise(p, n, MADV_HUGEPAGE); /* read faults then map the huge zero page: 2048x fewer */
    for (size_t k = 0; k < 100; k++) {
        p[k] = (uint8_t)(k * 37 + 1);
        p[(4ull << 30) - 50 + k] = (uint8_t)(k * 11 + 3);
        p[n - 1 - k] = (uint8_t)(k * 5 + 7);
    }
    uint32_t want = zcrc(0xdeadbeefu, p + 1, n - 1);
    FOR_EACH_PATH(i)
    {
        if (!strcmp(paths[i], "zlib"))
            continue; /* that is crc32_z in one call: 1.5 s to learn nothing */
        uint32_t got = k3_crc32(0xdeadbeefu, p + 1, n - 1);
        if (got != want)
            k3t_fail(__FILE__, __LINE__, "%s: zlib %08x, k3 %08x", paths[i], want, got);
    }
    munmap(p, n);
}

K3_TEST(crc_path_forced_to_zlib_by_environment)
{
    setenv("K3_CRC", "zlib", 1);
    CHECK_STR_EQ(k3_crc_name(), "zlib (K3_CRC)");
    uint8_t *buf = random_bytes(100000);
    CHECK_EQ_U64(k3_crc32(7, buf, 100000), zcrc(7, buf, 100000));
    CHECK_STR_EQ(k3_crc_name(), "zlib (K3_CRC)");
    CHECK_EQ_INT(k3_crc_use("nonsense"), K3_EARG);
    CHECK_STR_EQ(k3_crc_name(), "zlib (K3_CRC)");
    CHECK(k3_crc_supported("zlib"));
    free(buf);
}

K3_TEST(crc_unknown_forced_path_falls_back_and_says_so)
{
    setenv("K3_CRC", "crc32c", 1);
    CHECK_STR_CONTAINS(k3_crc_name(), "(K3_CRC=crc32c unavailable)");
    const char *best = k3_crc_supported("vpclmul") ? "vpclmul " : k3_crc_supported("pclmul") ? "pclmul "
                     : k3_crc_supported("armv8")   ? "armv8 "   : "zlib ";
    CHECK(!strncmp(k3_crc_name(), best, strlen(best)));
}

/* The build's own architecture path is there: a CPU with it never falls back
 * to zlib unnoticed (x86-64: PCLMULQDQ on every CPU since 2010; aarch64: the
 * CRC32 instructions, optional in ARMv8.0 and part of every v8.1 core, and
 * emulated by qemu-aarch64), and its values are zlib's on the check string. */
K3_TEST(crc_architecture_path_present_and_gives_the_check_value)
{
    const char *mine = NULL;
#if defined(__x86_64__)
    mine = "pclmul";
#elif defined(__aarch64__)
    mine = "armv8";
#endif
    if (!mine)
        k3t_skip("no CRC instruction path for this architecture");
    CHECK(k3_crc_supported(mine));
    CHECK_EQ_INT(k3_crc_use(mine), 0);
    /* "123456789" is the standard check string: 0xcbf43926 for CRC-32 */
    static const char chk[] = "123456789123456789123456789123456789123456789123456789123456789123456789";
    CHECK_EQ_U64(k3_crc32(0, chk, 9), 0xcbf43926u);
    CHECK_EQ_U64(k3_crc32(0, chk, sizeof chk - 1), zcrc(0, (const uint8_t *)chk, sizeof chk - 1));
}
