/*
 * bench_layer.c - time per layer of each kind at real K3 width: the dense
 * layer (KDA + dense MLP), KDA + LatentMoE, MLA + LatentMoE, and the head,
 * on a `k3-synth --preset k3-width` checkpoint: with --layers 3, layer 0 is
 * KDA+dense, layer 1 KDA+MoE, layer 2 MLA+MoE; with the default 2 layers,
 * layer 1 is MLA+MoE and KDA+MoE is the sum of the printed KDA-attention and
 * MoE parts. Do not use --sparse checkpoints for the MoE figure: all-zero
 * expert bytes mean E8M0 scale 0 = 2^-127, a float32 denormal, which sends
 * the MXFP4 kernel down the CPU's slow denormal path. Weights are made resident by a warm-up
 * pass (the same tokens route to the same experts), then each repetition
 * resets the session and runs the same chunk; compute time only.
 *
 * The limit it is measured against, taken in the same run: a STREAM-style
 * triad over 3 x 256 MiB (the layer is a stream of weight bytes at T = 1).
 *
 *   bin/bench-bench_layer CKPT [--tokens T] [--reps N] [--threads N]
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kern.h"
#include "k3_model.h"
#include "k3_ws.h"

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double triad_gbs(void)
{
    const size_t n = (256u << 20) / sizeof(float);
    float *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
    if (!a || !b || !c)
        return 0;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 0;
        b[i] = 1;
        c[i] = 2;
    }
    double best = 0;
    for (int r = 0; r < 4; r++) {
        double t0 = omp_get_wtime();
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + 3.0f * c[i];
        double t = omp_get_wtime() - t0;
        double gbs = 3.0 * n * 4 / t / 1e9;
        if (r && gbs > best)
            best = gbs;
    }
    free(a);
    free(b);
    free(c);
    return best;
}

static uint64_t group_bytes(k3_ws *ws, uint32_t g)
{
    uint64_t sum = 0;
    for (int s = 0; s < K3_W_COUNT; s++) {
        k3_view v;
        if (k3_ws_describe(ws, g, (k3_wslot)s, &v, NULL) == 0)
            sum += k3_view_numel(&v) * k3_dtype_size(v.dtype);
    }
    return sum;
}

int main(int argc, char **argv)
{
    const char *dir = NULL;
    unsigned long T = 1, reps = 5, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            T = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = strtoul(argv[++i], NULL, 10);
        else if (!dir)
            dir = argv[i];
        else {
            fprintf(stderr, "usage: bench-bench_layer CKPT [--tokens T] [--reps N] [--threads N]\n");
            return 2;
        }
    }
    if (!dir || T < 1 || T > 4096 || reps < 1 || reps > 100) {
        fprintf(stderr, "usage: bench-bench_layer CKPT [--tokens T (1-4096)] [--reps N (1-100)] [--threads N]\n");
        return 2;
    }
    if (threads)
        omp_set_num_threads((int)threads);
    k3_err e = {0};
    k3_ws *ws;
    k3_model *m;
    k3_sess *s;
    if (k3_ws_open(&ws, dir, 0, &e) < 0 || k3_model_open(&m, ws, &(k3_model_opts){(uint32_t)T}, &e) < 0 ||
        k3_sess_create(&s, m, (uint32_t)T, &e) < 0) {
        fprintf(stderr, "bench_layer: error: %s\n", e.msg);
        return 1;
    }
    const k3_cfg *c = k3_model_cfg(m);
    const uint32_t NL = c->num_hidden_layers, V = c->vocab_size;
    uint32_t *ids = malloc(T * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof(float));
    double *lt = malloc(NL * sizeof(double)), *samples = malloc(reps * (NL + 1) * sizeof(double));
    double *parts = malloc(reps * 4 * sizeof(double));   /* attn KDA, attn MLA, dense MLP, MoE */
    for (uint32_t i = 0; i < T; i++)
        ids[i] = (1000u + 7919u * i) % V;
    double gbs = triad_gbs();
    printf("k3 bench_layer: %s, kernels %s, %d threads, chunk of %lu token(s), %lu reps\n", dir, k3_kern_name(),
           omp_get_max_threads(), T, reps);
    printf("memory triad (same run): %.1f GB/s\n", gbs);
    double t0 = omp_get_wtime();
    if (k3_model_forward(m, s, ids, (uint32_t)T, K3_LOGITS_LAST, logits, &e) < 0) {
        fprintf(stderr, "bench_layer: error: %s\n", e.msg);
        return 1;
    }
    printf("warm-up (reads the weights): %.2f s\n", omp_get_wtime() - t0);
    for (unsigned long r = 0; r < reps; r++) {
        k3_sess_reset(s);
        k3_model_times_reset(m);
        if (k3_model_forward(m, s, ids, (uint32_t)T, K3_LOGITS_LAST, logits, &e) < 0) {
            fprintf(stderr, "bench_layer: error: %s\n", e.msg);
            return 1;
        }
        k3_model_layer_times(m, lt);
        k3_model_times tm;
        k3_model_times_get(m, &tm);
        for (uint32_t L = 0; L < NL; L++)
            samples[L * reps + r] = lt[L];
        samples[NL * reps + r] = tm.head;
        parts[0 * reps + r] = tm.attn_kda;
        parts[1 * reps + r] = tm.attn_mla;
        parts[2 * reps + r] = tm.mlp_dense;
        parts[3 * reps + r] = tm.moe;
    }
    int finite = 1;
    for (uint32_t i = 0; i < V; i++)
        finite &= isfinite(logits[i]) != 0;
    /* one expert: 3 matrices of I x L nibbles (1/2 byte) + one scale byte per 32 */
    const uint64_t expert_bytes = (uint64_t)c->moe_intermediate_size * c->routed_expert_hidden_size * 3 / 32 * 17;
    printf("%-6s %-14s %10s %10s %10s %12s %10s %8s\n", "layer", "kind", "median_ms", "min_ms", "max_ms",
           "weights_MB", "GB/s", "/triad");
    for (uint32_t L = 0; L <= NL; L++) {
        double *x = samples + (size_t)L * reps;
        qsort(x, reps, sizeof *x, cmp_d);
        double med = x[reps / 2];
        char kind[32];
        uint64_t bytes;
        if (L == NL) {
            snprintf(kind, sizeof kind, "head");
            bytes = group_bytes(ws, NL);
        } else {
            int moe = !k3_cfg_layer_is_dense(c, L);
            snprintf(kind, sizeof kind, "%s+%s", k3_cfg_layer_is_mla(c, L) ? "MLA" : "KDA", moe ? "MoE" : "dense");
            bytes = group_bytes(ws, L);
            if (moe) {
                uint64_t used = (uint64_t)T * c->num_experts_per_token;
                if (used > c->num_experts)
                    used = c->num_experts;
                bytes += used * expert_bytes;   /* at most: distinct experts may be fewer */
            }
        }
        double rate = bytes / med / 1e9;
        char label[16];
        snprintf(label, sizeof label, L == NL ? "-" : "%u", L);
        printf("%-6s %-14s %10.2f %10.2f %10.2f %12.1f %10.1f %8.2f\n", label, kind, med * 1e3,
               x[0] * 1e3, x[reps - 1] * 1e3, bytes / 1e6, rate, gbs > 0 ? rate / gbs : 0);
    }
    static const char *const pn[4] = {"KDA attention (all KDA layers)", "MLA attention (all MLA layers)",
                                      "dense MLP (all dense layers)", "LatentMoE (all MoE layers)"};
    printf("parts, median ms over the reps (sums over layers of that kind):\n");
    for (int k = 0; k < 4; k++) {
        double *x = parts + (size_t)k * reps;
        qsort(x, reps, sizeof *x, cmp_d);
        printf("  %-32s %10.2f\n", pn[k], x[reps / 2] * 1e3);
    }
    printf("logits finite: %s\n", finite ? "yes" : "NO");
    free(ids);
    free(logits);
    free(lt);
    free(samples);
    free(parts);
    k3_sess_free(s);
    k3_model_close(m);
    k3_ws_close(ws);
    return finite ? 0 : 1;
}
