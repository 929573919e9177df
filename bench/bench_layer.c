/*
 * bench_layer.c - time per layer of each kind at real K3 width: the dense
 * layer (KDA + dense MLP), KDA + LatentMoE, MLA + LatentMoE, and the head,
 * on a `k3-synth --preset k3-width` checkpoint: with --layers 3, layer 0 is
 * KDA+dense, layer 1 KDA+MoE, layer 2 MLA+MoE; the default 2 layers (22 GB
 * instead of 38) have no KDA+MoE layer, and --compose builds one from layer
 * 0's attention and layer 1's MoE (see ws_compose). A --sparse checkpoint
 * (all-zero weights) times the same as a random one: the AVX-512 and AVX2
 * MXFP4 kernels look the weights up in k3_kern_mx_table, whose scale-0 row
 * holds +0.0 for nibble 0 (never a denormal), and the bf16 kernel has no
 * data-dependent branch (runtime/STREAM.md "Figures"); only the scalar
 * reference path multiplies by the denormal 2^-127 and is about 25% slower
 * on zeros. Weights are made resident by a warm-up
 * pass (the same tokens route to the same experts), then each repetition
 * resets the session and runs the same chunk; compute time only.
 *
 * The limit it is measured against, taken in the same run: a STREAM-style
 * triad over 3 x 256 MiB (the layer is a stream of weight bytes at T = 1).
 *
 *   bin/bench-bench_layer CKPT [--tokens T[,T...]] [--reps N] [--threads N] [--compose]
 *
 * ms/token = layer time / T: with a chunk of T tokens every weight is read
 * once for all T, so at small T the per-token cost falls almost as 1/T.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kern.h"
#include "k3_model.h"
#include "k3_ws.h"

/* --compose: a 3-layer view of a 2-layer k3-width checkpoint (layer 0 KDA +
 * dense, layer 1 MLA + MoE) so that each kind is timed directly: virtual
 * layer 0 = real 0; virtual 1 = real 0's KDA attention and residual tensors
 * with real 1's MoE (KDA + MoE); virtual 2 = real 1 (MLA + MoE); head as is.
 * The real source keeps its groups resident, so both stay valid. */
typedef struct ws_compose {
    k3_ws base;
    k3_ws *real;
    k3_view mix[K3_W_COUNT];
} ws_compose;

static uint32_t real_group(uint32_t g, k3_wslot s)
{
    if (g == 0)
        return 0;
    if (g == 1)
        return (s >= K3_W_MOE_ROUTER && s <= K3_W_MOE_SH_DOWN) ? 1 : 0;
    return g - 1; /* 2 -> 1, head 3 -> 2 */
}

static int cmp_describe(k3_ws *ws, uint32_t g, k3_wslot s, k3_view *out, k3_err *e)
{
    return k3_ws_describe(((ws_compose *)ws)->real, real_group(g, s), s, out, e);
}

static int cmp_acquire(k3_ws *ws, uint32_t g, const k3_view **views, k3_err *e)
{
    ws_compose *w = (ws_compose *)ws;
    if (g != 1)
        return k3_ws_acquire(w->real, real_group(g, K3_W_INPUT_NORM), views, e);
    const k3_view *a, *b;
    int rc = k3_ws_acquire(w->real, 0, &a, e);
    if (rc == 0)
        rc = k3_ws_acquire(w->real, 1, &b, e);
    if (rc < 0)
        return rc;
    for (int s = 0; s < K3_W_COUNT; s++)
        w->mix[s] = real_group(1, (k3_wslot)s) ? b[s] : a[s];
    *views = w->mix;
    return 0;
}

static void cmp_release(k3_ws *ws, uint32_t g) { (void)ws; (void)g; }
static int cmp_embed(k3_ws *ws, const uint32_t *ids, uint32_t n, float *out, k3_err *e)
{
    return k3_ws_embed(((ws_compose *)ws)->real, ids, n, out, e);
}
static uint32_t cmp_batch(k3_ws *ws) { return k3_ws_expert_batch_max(((ws_compose *)ws)->real); }
static int cmp_experts(k3_ws *ws, uint32_t layer, const uint32_t *ids, uint32_t n, k3_expert_view *out, k3_err *e)
{
    (void)layer;
    return k3_ws_experts_acquire(((ws_compose *)ws)->real, 1, ids, n, out, e);
}
static void cmp_experts_release(k3_ws *ws, uint32_t layer) { (void)ws; (void)layer; }
static void cmp_close(k3_ws *ws)
{
    k3_ws_close(((ws_compose *)ws)->real);
    free(ws);
}
static const k3_ws_ops compose_ops = {"compose", cmp_describe, cmp_acquire, cmp_release, cmp_embed,
                                      cmp_batch, cmp_experts, cmp_experts_release, cmp_close,
                                      NULL, NULL, NULL, NULL, NULL, NULL};

static int compose_open(k3_ws **out, k3_ws *real, k3_err *e)
{
    const k3_cfg *c = k3_ws_cfg(real);
    if (c->num_hidden_layers != 2 || c->first_k_dense_replace != 1 || k3_cfg_layer_is_mla(c, 0) ||
        !k3_cfg_layer_is_mla(c, 1))
        return k3_err_set(e, K3_EARG, "--compose needs a 2-layer checkpoint: KDA+dense, then MLA+MoE");
    ws_compose *w = calloc(1, sizeof *w);
    if (!w)
        return k3_err_set(e, K3_ENOMEM, "out of memory");
    w->base.ops = &compose_ops;
    w->base.cfg = *c;
    w->base.cfg.num_hidden_layers = 3;
    memset(w->base.cfg.is_mla, 0, sizeof w->base.cfg.is_mla);
    w->base.cfg.is_mla[2] = 1;
    w->real = real;
    *out = &w->base;
    return 0;
}

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

/* One chunk size: warm-up (reads what these tokens need), then reps. */
static int run_chunk(k3_ws *ws, k3_model *m, k3_sess *s, unsigned long T, unsigned long reps, double gbs)
{
    k3_err e = {0};
    const k3_cfg *c = k3_model_cfg(m);
    const uint32_t NL = c->num_hidden_layers, V = c->vocab_size;
    uint32_t *ids = malloc(T * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof(float));
    double *lt = malloc(NL * sizeof(double)), *samples = malloc(reps * (NL + 1) * sizeof(double));
    double *parts = malloc(reps * 4 * sizeof(double));   /* attn KDA, attn MLA, dense MLP, MoE */
    if (!ids || !logits || !lt || !samples || !parts)
        return 1;
    for (uint32_t i = 0; i < T; i++)
        ids[i] = (1000u + 7919u * i) % V;
    printf("\n== chunk of %lu token(s), %lu reps\n", T, reps);
    double t0 = omp_get_wtime();
    k3_sess_reset(s);
    if (k3_model_forward(m, s, ids, (uint32_t)T, K3_LOGITS_LAST, logits, &e) < 0) {
        fprintf(stderr, "bench_layer: error: %s\n", e.msg);
        return 1;
    }
    printf("warm-up (reads the weights these tokens need): %.2f s\n", omp_get_wtime() - t0);
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
    printf("%-6s %-14s %10s %10s %10s %10s %12s %8s %8s\n", "layer", "kind", "median_ms", "min_ms", "max_ms",
           "ms/token", "weights_MB", "GB/s", "/triad");
    for (uint32_t L = 0; L <= NL; L++) {
        double *x = samples + (size_t)L * reps;
        qsort(x, reps, sizeof *x, cmp_d);
        double med = x[reps / 2];
        char kind[32];
        uint64_t bytes;
        if (L == NL) {
            snprintf(kind, sizeof kind, "head(1 row)");
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
        printf("%-6s %-14s %10.2f %10.2f %10.2f %10.2f %12.1f %8.1f %8.2f\n", label, kind, med * 1e3, x[0] * 1e3,
               x[reps - 1] * 1e3, L == NL ? med * 1e3 : med * 1e3 / T, bytes / 1e6, rate, gbs > 0 ? rate / gbs : 0);
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
    return finite ? 0 : 1;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *tokens = "1";
    unsigned long reps = 5, threads = 0;
    int compose = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--compose"))
            compose = 1;
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            tokens = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = strtoul(argv[++i], NULL, 10);
        else if (!dir)
            dir = argv[i];
        else
            dir = NULL, i = argc;
    }
    unsigned long tlist[16], nt = 0, tmax = 0;
    for (const char *p = tokens; *p && nt < 16;) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v < 1 || v > 4096)
            break;
        tlist[nt++] = v;
        tmax = v > tmax ? v : tmax;
        p = *end == ',' ? end + 1 : end;
    }
    if (!dir || nt == 0 || reps < 1 || reps > 100) {
        fprintf(stderr, "usage: bench-bench_layer CKPT [--tokens T[,T...] (1-4096)] [--reps N (1-100)] "
                        "[--threads N] [--compose]\n");
        return 2;
    }
    if (threads)
        omp_set_num_threads((int)threads);
    k3_err e = {0};
    k3_ws *ws;
    k3_model *m;
    k3_sess *s;
    if (k3_ws_open(&ws, dir, 0, &e) < 0 || (compose && compose_open(&ws, ws, &e) < 0) ||
        k3_model_open(&m, ws, &(k3_model_opts){(uint32_t)tmax}, &e) < 0 ||
        k3_sess_create(&s, m, (uint32_t)tmax, &e) < 0) {
        fprintf(stderr, "bench_layer: error: %s\n", e.msg);
        return 1;
    }
    double gbs = triad_gbs();
    if (k3_kern_emulated())
        printf("EMULATED: this build runs under user-mode emulation on a %s host: the timings are\n"
               "the emulator's, not the CPU's\n", k3_kern_emulated());
    printf("k3 bench_layer: %s, kernels %s, %d threads\n", dir, k3_kern_name(), omp_get_max_threads());
    printf("memory triad (same run): %.1f GB/s\n", gbs);
    int rc = 0;
    for (unsigned long i = 0; i < nt && rc == 0; i++)
        rc = run_chunk(ws, m, s, tlist[i], reps, gbs);
    printf("memory triad (end of run): %.1f GB/s\n", triad_gbs());
    k3_sess_free(s);
    k3_model_close(m);
    k3_ws_close(ws);
    return rc;
}
