/*
 * bench_spec_copy.c - what the --spec rollback checkpoint costs at K3 size.
 *
 *   bin/bench-bench_spec_copy [--runs N]
 *
 * k3_seq_copy (engine/sess_state.c) is three memcpy's: every KDA layer's
 * state (heads x dim x dim floats), every KDA layer's conv history (3 x
 * (kernel - 1) x heads*dim floats) and every MLA layer's latents (kv_lora +
 * rope floats) for the positions so far. At K3's shape (69 KDA layers of 96
 * heads of 128, conv 4, 24 MLA layers of 512 + 64) that is 434,110,464 +
 * 30,523,392 + 55,296 x position bytes. This times the same memcpy's on
 * buffers of those sizes (faulted in first, one warm-up; median and min-max
 * of --runs, default 7) at positions 0, 1024 and 4096, with a read-only sum
 * over the same bytes as the memory-speed reference of the same run.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3_cli.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    uint64_t runs = 7;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc && !k3_cli_parse_u64(argv[i + 1], 1, 1000, &runs)) {
            i++;
        } else {
            fprintf(stderr, "usage: bench-bench_spec_copy [--runs N]\n");
            return 2;
        }
    }
    const uint64_t kda = 69ull * 96 * 128 * 128 * 4, conv = 69ull * 3 * 3 * 96 * 128 * 4;
    const uint64_t lat_per_pos = 24ull * (512 + 64) * 4;
    const uint32_t poss[] = {0, 1024, 4096};
    const uint64_t max = kda + conv + lat_per_pos * 4096;
    char *src = malloc(max), *dst = malloc(max);
    if (!src || !dst) {
        fprintf(stderr, "bench_spec_copy: out of memory (2 x %llu bytes)\n", (unsigned long long)max);
        return 6;
    }
    memset(src, 1, max);
    memset(dst, 2, max);
    double *t = malloc(runs * sizeof *t);
    if (!t)
        return 6;
    printf("bench_spec_copy: K3 sequence state = %llu (KDA) + %llu (conv) + %llu x position (MLA) bytes\n",
           (unsigned long long)kda, (unsigned long long)conv, (unsigned long long)lat_per_pos);
    for (int pi = 0; pi < 3; pi++) {
        const uint64_t lat = lat_per_pos * poss[pi], n = kda + conv + lat;
        for (uint64_t r = 0; r <= runs; r++) {
            double t0 = now_s();
            memcpy(dst, src, kda);
            memcpy(dst + kda, src + kda, conv);
            memcpy(dst + kda + conv, src + kda + conv, lat);
            if (r)
                t[r - 1] = now_s() - t0;
            src[r % n] ^= dst[(r * 7) % n];   /* keep the copies live */
        }
        qsort(t, runs, sizeof *t, cmp_d);
        double med = t[runs / 2];
        /* read-only reference over the same bytes */
        double rs[16];
        uint64_t nr = runs < 16 ? runs : 16, sum = 0;
        for (uint64_t r = 0; r < nr; r++) {
            double t0 = now_s();
            const uint64_t *p = (const uint64_t *)src;
            for (uint64_t i = 0; i < n / 8; i++)
                sum += p[i];
            rs[r] = now_s() - t0;
        }
        qsort(rs, nr, sizeof *rs, cmp_d);
        printf("position %4u: %.3f GB copied in %.4f s (min %.4f max %.4f): %.2f GB/s; read-only sum of the "
               "same bytes %.2f GB/s (checksum %llu)\n",
               poss[pi], n / 1e9, med, t[0], t[runs - 1], n / med / 1e9, n / rs[nr / 2] / 1e9,
               (unsigned long long)(sum & 0xff));
    }
    free(t);
    free(src);
    free(dst);
    return 0;
}
