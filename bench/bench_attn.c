/*
 * bench_attn.c - what a layer's attention costs as the context grows: one
 * decode row, and one chunk of rows, at a context of N positions, for an
 * MLA layer and a KDA layer with the head counts and sizes of the model's
 * config. MLA's scores and weighted sums walk the whole latent cache for
 * every row, so its decode cost grows with N; the KDA recurrence does not.
 *
 * The layers are one-layer models held in memory (k3_ws_mem), the probe's
 * own (k3_probe_rest_cfg, runtime/probe_rest.c): the model's heads, head
 * sizes, latent rank and expert inner width, a hidden size of at most 1024
 * and top-k experts of latent width 32, so that a context of thousands of
 * positions is prefilled in seconds. What is printed is the layer's time
 * less its matrix products (k3_model_times.products): the attention's own
 * work, activations, norms and routing. Each context is prefilled once (chunks of
 * 64, not timed) into a base session; every repetition copies it and times
 * one pass from there.
 *
 *   bin/bench-bench_attn CONFIG_JSON [--ctx N[,N...]] [--rows R] [--reps N] [--threads N]
 *
 * Prints, per kind and context: decode ms (one row), ms per row of a chunk
 * of R rows (default 64), and, between consecutive contexts, the cost of one
 * more position attended (us per position per row).
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kern.h"
#include "k3_model.h"
#include "k3_ws.h"
#include "../runtime/probe.h"

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One pass of n rows from a copy of base: the layer's time less its products. */
static int timed_pass(k3_model *m, k3_sess *base, k3_sess *s, const uint32_t *ids, uint32_t n, double *out,
                      k3_err *e)
{
    if (k3_sess_copy(s, base, e) < 0)
        return -1;
    k3_model_times_reset(m);
    if (k3_model_forward(m, s, ids, n, K3_LOGITS_NONE, NULL, e) < 0)
        return -1;
    double layer;
    k3_model_times t;
    k3_model_layer_times(m, &layer);
    k3_model_times_get(m, &t);
    *out = layer - t.products;
    return 0;
}

static double median_pass(k3_model *m, k3_sess *base, k3_sess *s, const uint32_t *ids, uint32_t n,
                          unsigned long reps, k3_err *e)
{
    double x[100];
    for (unsigned long r = 0; r <= reps; r++)   /* one round first: pages and threads up */
        if (timed_pass(m, base, s, ids, n, &x[r ? r - 1 : 0], e) < 0)
            return -1;
    qsort(x, reps, sizeof *x, cmp_d);
    return x[reps / 2];
}

static int run_kind(const k3_cfg *c, int mla, const unsigned long *ctx, unsigned nctx, uint32_t rows,
                    unsigned long reps)
{
    k3_cfg q;
    k3_probe_rest_cfg(c, mla, &q);
    const uint32_t V = q.vocab_size;
    const uint32_t cmax = (uint32_t)ctx[nctx - 1] + rows;
    k3_err e = {0};
    k3_ws *ws = NULL;
    k3_model *m = NULL;
    k3_sess *base = NULL, *s = NULL;
    uint32_t *ids = malloc((size_t)cmax * sizeof *ids);
    int rc = ids ? 0 : -1;
    if (rc == 0)
        rc = k3_ws_mem_create(&ws, &q, 0x7e57, &e);
    if (rc == 0)
        rc = k3_model_open(&m, ws, &(k3_model_opts){rows > 64 ? rows : 64}, &e);
    if (rc == 0)
        rc = k3_sess_create(&base, m, cmax, &e);
    if (rc == 0)
        rc = k3_sess_create(&s, m, cmax, &e);
    for (uint32_t i = 0; ids && i < cmax; i++)
        ids[i] = (7u * i + 3u) % V;
    double prev_dec = 0;
    unsigned long prev_ctx = 0;
    for (unsigned i = 0; rc == 0 && i < nctx; i++) {
        const double t0 = omp_get_wtime();
        while (rc == 0 && k3_sess_pos(base) < ctx[i]) {
            uint32_t n = (uint32_t)(ctx[i] - k3_sess_pos(base));
            n = n < 64 ? n : 64;
            rc = k3_model_forward(m, base, ids + k3_sess_pos(base), n, K3_LOGITS_NONE, NULL, &e);
        }
        const double fill = omp_get_wtime() - t0;
        double dec = rc == 0 ? median_pass(m, base, s, ids + ctx[i], 1, reps, &e) : -1;
        double chunk = dec >= 0 ? median_pass(m, base, s, ids + ctx[i], rows, reps, &e) : -1;
        if (dec < 0 || chunk < 0) {
            rc = -1;
            break;
        }
        printf("%-4s ctx %6lu | decode %9.3f ms | chunk of %u: %9.3f ms/row", mla ? "MLA" : "KDA", ctx[i],
               dec * 1e3, rows, chunk * 1e3 / rows);
        if (i > 0)
            printf(" | %7.3f us per position", (dec - prev_dec) / (double)(ctx[i] - prev_ctx) * 1e6);
        printf(" | prefill %.1f s\n", fill);
        prev_dec = dec;
        prev_ctx = ctx[i];
    }
    if (rc < 0)
        fprintf(stderr, "bench_attn: error: %s\n", e.msg[0] ? e.msg : "out of memory");
    k3_sess_free(s);
    k3_sess_free(base);
    k3_model_close(m);
    k3_ws_close(ws);
    free(ids);
    return rc < 0 ? 1 : 0;
}

int main(int argc, char **argv)
{
    const char *cfgpath = NULL, *ctxs = "0,256,1024";
    unsigned long reps = 5, threads = 0, rows = 64;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ctx") && i + 1 < argc)
            ctxs = argv[++i];
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = strtoul(argv[++i], NULL, 10);
        else if (!cfgpath)
            cfgpath = argv[i];
        else
            cfgpath = NULL, i = argc;
    }
    unsigned long ctx[16];
    unsigned nctx = 0;
    for (const char *p = ctxs; *p && nctx < 16;) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (end == p || v > 65536 || (nctx && v <= ctx[nctx - 1]))
            break;
        ctx[nctx++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    if (!cfgpath || nctx == 0 || reps < 1 || reps > 99 || rows < 1 || rows > 1024) {
        fprintf(stderr, "usage: bench-bench_attn CONFIG_JSON [--ctx N[,N...] (ascending, <= 65536)] "
                        "[--rows R (1-1024)] [--reps N (1-99)] [--threads N]\n");
        return 2;
    }
    if (threads)
        omp_set_num_threads((int)threads);
    k3_cfg c;
    k3_err e = {0};
    if (k3_cfg_load(&c, cfgpath, &e) < 0) {
        fprintf(stderr, "bench_attn: %s\n", e.msg);
        return 1;
    }
    if (k3_kern_emulated())
        printf("EMULATED: this build runs under user-mode emulation on a %s host: the timings are\n"
               "the emulator's, not the CPU's\n", k3_kern_emulated());
    printf("k3 bench_attn: %s, kernels %s, %d threads; %u heads, kv rank %u + rope %u; median of %lu\n", cfgpath,
           k3_kern_name(), omp_get_max_threads(), c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, reps);
    int rc = 0;
    for (int mla = 1; mla >= 0 && rc == 0; mla--)
        rc = run_kind(&c, mla, ctx, nctx, (uint32_t)rows, reps);
    return rc;
}
