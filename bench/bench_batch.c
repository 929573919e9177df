/*
 * bench_batch.c - batched decode through the engine: aggregate tokens/s and
 * bytes read per step for B sequences stepped together, against the I/O
 * bound of those bytes.
 *
 *   bin/bench-bench_batch PACKED_DIR [--ram BUDGET] [--batches 1,2,4,8,16]
 *                         [--gen N] [--threads N] [--gbps G [--xgbps X]]
 *
 * For each B: a fresh engine planned for B sequences of 4 + N tokens, B
 * different 4-token prompts in one step, then N decode steps of B tokens
 * (greedy). Timed: the decode steps after the first (the first decode step
 * still finds the prompt's last groups in the ring). Per B it prints the
 * decode seconds per step, aggregate tokens/s (B / s per step), trunk and
 * expert bytes read per step, experts requested per step (the union of what
 * the B rows route to, summed over the MoE layers), the cache hits, and the
 * I/O bound per step = trunk bytes / G GB/s + expert bytes / X GB/s (the
 * device's O_DIRECT read rates for trunk units and expert records, e.g.
 * trunk_gbps and experts_gbps of bench-bench_stream --json; X defaults to G;
 * without --gbps no bound).
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_engine.h"

#define NPROMPT 4
#define MAXB 64

static double now_s(void)
{
    return omp_get_wtime();
}

static uint32_t argmax(const float *x, uint32_t n)
{
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

static int run(const char *dir, const char *ram, uint32_t B, uint32_t gen, double gbps, double xgbps)
{
    k3_err e = {0};
    k3_engine_opts o;
    k3_engine_opts_init(&o);
    o.ram = ram;
    k3_engine *en = NULL;
    k3_engine_size sz = {NPROMPT + gen, B, 0};
    int rc = k3_engine_open(&en, dir, &o, &e);
    if (rc == 0)
        rc = k3_engine_plan(en, &sz, NULL, &e);
    if (rc == 0)
        rc = k3_engine_load(en, &e);
    if (rc < 0) {
        fprintf(stderr, "bench_batch: %s\n", e.msg);
        k3_engine_close(en);
        return rc;
    }
    const uint32_t V = k3_engine_cfg(en)->vocab_size;
    k3_seq *s[MAXB];
    k3_step_seq st[MAXB];
    uint32_t ids[MAXB][NPROMPT], next[MAXB];
    float *lg = malloc((size_t)B * V * sizeof(float));
    if (!lg) {
        k3_engine_close(en);
        return -1;
    }
    for (uint32_t i = 0; i < B && rc == 0; i++) {
        rc = k3_seq_create(&s[i], en, NPROMPT + gen, &e);
        for (uint32_t t = 0; t < NPROMPT; t++)
            ids[i][t] = (1 + 7 * i + 13 * t) % V;
        st[i] = (k3_step_seq){s[i], ids[i], NPROMPT, K3_LOGITS_LAST, lg + (size_t)i * V};
    }
    if (rc == 0)
        rc = k3_engine_step(en, st, B, &e);
    k3_stream_stats a, b;
    double t0 = 0, t1 = 0;
    for (uint32_t k = 0; k < gen && rc == 0; k++) {
        for (uint32_t i = 0; i < B; i++) {
            next[i] = argmax(lg + (size_t)i * V, V);
            st[i] = (k3_step_seq){s[i], &next[i], 1, K3_LOGITS_LAST, lg + (size_t)i * V};
        }
        if (k == 1) {
            k3_engine_stream_stats(en, &a);
            t0 = now_s();
        }
        rc = k3_engine_step(en, st, B, &e);
    }
    t1 = now_s();
    k3_engine_stream_stats(en, &b);
    if (rc < 0) {
        fprintf(stderr, "bench_batch: B=%u: %s\n", B, e.msg);
    } else {
        const double n = gen - 1, sps = (t1 - t0) / n;
        const double tb = (b.trunk_bytes - a.trunk_bytes) / n, xb = (b.expert_bytes - a.expert_bytes) / n;
        const double req = (b.expert_requests - a.expert_requests) / n, hit = (b.expert_hits - a.expert_hits) / n;
        const double wait = (b.trunk_wait_s - a.trunk_wait_s + b.expert_wait_s - a.expert_wait_s) / n;
        printf("B=%-3u decode %.3f s/step  %.3f tok/s  trunk %.3f GB/step  experts %.3f GB/step  "
               "requested %.1f experts/step (%.1f hits)  I/O wait %.3f s/step",
               B, sps, B / sps, tb / 1e9, xb / 1e9, req, hit, wait);
        if (gbps > 0) {
            const double bound = tb / 1e9 / gbps + xb / 1e9 / xgbps;
            printf("  I/O bound %.3f s/step  ratio %.2f", bound, sps / bound);
        }
        printf("\n");
        fflush(stdout);
    }
    free(lg);
    k3_engine_close(en);
    return rc;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *ram = "floor", *batches = "1,2,4,8,16";
    uint32_t gen = 4, threads = 0;
    double gbps = 0, xgbps = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ram") && i + 1 < argc)
            ram = argv[++i];
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc)
            batches = argv[++i];
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc)
            gen = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--gbps") && i + 1 < argc)
            gbps = strtod(argv[++i], NULL);
        else if (!strcmp(argv[i], "--xgbps") && i + 1 < argc)
            xgbps = strtod(argv[++i], NULL);
        else if (argv[i][0] != '-' && !dir)
            dir = argv[i];
        else
            dir = NULL, argc = 0;
    }
    if (!dir || gen < 2) {
        fprintf(stderr, "usage: bench-bench_batch PACKED_DIR [--ram BUDGET] [--batches 1,2,4,8,16] [--gen N >= 2] "
                        "[--threads N] [--gbps G [--xgbps X]]\n");
        return 2;
    }
    if (threads)
        omp_set_num_threads((int)threads);
    if (xgbps <= 0)
        xgbps = gbps;
    printf("bench_batch: %s --ram %s, %d threads, %u-token prompts, %u decode steps (%u timed); "
           "I/O at %.3f GB/s trunk, %.3f GB/s experts\n",
           dir, ram, omp_get_max_threads(), NPROMPT, gen, gen - 1, gbps, xgbps);
    int bad = 0;
    for (const char *p = batches; *p;) {
        char *end;
        unsigned long B = strtoul(p, &end, 10);
        if (end == p || B == 0 || B > MAXB) {
            fprintf(stderr, "bench_batch: bad --batches %s (1 to %d)\n", batches, MAXB);
            return 2;
        }
        bad |= run(dir, ram, (uint32_t)B, gen, gbps, xgbps) < 0;
        p = *end == ',' ? end + 1 : end;
    }
    return bad ? 1 : 0;
}
