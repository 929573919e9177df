/*
 * probe_rest.c - what a layer computes besides its matrix products (probe.h,
 * k3_probe_rest_run): attention (the KDA recurrence and short convolutions,
 * MLA's absorption, scores and weighted sums), activations, norms, routing
 * and the attention residuals.
 *
 * None of this depends on the weights' values, only on the model's shapes,
 * so it is timed on two one-layer models held in memory (k3_ws_mem), one KDA
 * + LatentMoE layer and one MLA + LatentMoE layer, with the model's head
 * counts and sizes, expert inner width, top-k and shared experts, run on the
 * run's threads. Three things are made small so that the probe takes seconds:
 * the hidden size (at most 1024), the routed experts' latent width (32: their
 * products are priced by the kernel probe, and the latent vectors are copied
 * per row, a small cost) and the expert count (top-k, so that every row goes
 * to every expert, as many (row, expert) pairs as the model's). The rest is
 * the layer's time less its products' (k3_model_times.products).
 *
 * A pass of C rows at positions p0 .. p0 + C - 1 takes C a + b S seconds,
 * S = sum of (p + 1), the positions each row attends to: MLA's scores grow
 * with the context, the KDA recurrence does not. Passes of R = min(C, 64)
 * rows are timed (past 64 rows a row costs about the same, and larger passes
 * would take the probe tens of seconds at K3 width), medians of 3: b from
 * two passes of the largest R, at positions [0, R) and [R, 2R); a per chunk
 * from the first pass of its own R (one row for decode).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "k3_model.h"
#include "k3_ws.h"
#include "probe.h"

#define REST_HIDDEN 1024u
#define REST_LATENT 32u
#define REST_VOCAB 64u
#define REST_REPS 3
#define REST_ROWS 64u   /* rows a pass times at most: a chunk past it is priced per row as 64 */

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The layer's time less its products' for one pass of C rows. */
static int pass_rest(k3_model *m, k3_sess *s, const uint32_t *ids, uint32_t C, double *out, k3_err *e)
{
    k3_model_times_reset(m);
    int rc = k3_model_forward(m, s, ids, C, K3_LOGITS_NONE, NULL, e);
    if (rc < 0)
        return rc;
    double layer;
    k3_model_times t;
    k3_model_layer_times(m, &layer);
    k3_model_times_get(m, &t);
    *out = layer - t.products > 0 ? layer - t.products : 0;
    return 0;
}

/* Medians over REST_REPS of the two passes [0, C) and [C, 2C). */
static int two_passes(k3_model *m, k3_sess *s, const uint32_t *ids, uint32_t C, double *r1, double *r2, k3_err *e)
{
    double a[REST_REPS], b[REST_REPS];
    for (int r = -1; r < REST_REPS; r++) {   /* one round first: scratch paged in, threads up */
        double x, y;
        k3_sess_reset(s);
        int rc = pass_rest(m, s, ids, C, &x, e);
        if (rc == 0)
            rc = pass_rest(m, s, ids + C, C, &y, e);
        if (rc < 0)
            return rc;
        if (r >= 0)
            a[r] = x, b[r] = y;
    }
    qsort(a, REST_REPS, sizeof *a, cmp_d);
    qsort(b, REST_REPS, sizeof *b, cmp_d);
    *r1 = a[REST_REPS / 2];
    *r2 = b[REST_REPS / 2];
    return 0;
}

void k3_probe_rest_cfg(const k3_cfg *c, int mla, k3_cfg *out)
{
    *out = *c;
    out->num_hidden_layers = 1;
    memset(out->is_mla, 0, sizeof out->is_mla);
    out->is_mla[0] = (uint8_t)mla;
    out->first_k_dense_replace = 0;
    out->hidden_size = c->hidden_size < REST_HIDDEN ? c->hidden_size : REST_HIDDEN;
    out->vocab_size = REST_VOCAB;
    out->routed_expert_hidden_size = REST_LATENT;
    out->num_experts = c->num_experts_per_token;
}

/* One kind of layer (mla 0 or 1) at every chunk of p->rest. */
static int time_kind(const k3_cfg *c, int mla, uint32_t cmax, k3_probe *p, k3_err *e)
{
    k3_cfg q;
    k3_probe_rest_cfg(c, mla, &q);
    k3_ws *ws = NULL;
    k3_model *m = NULL;
    k3_sess *s = NULL;
    uint32_t *ids = malloc(2 * (size_t)cmax * sizeof *ids);
    int rc = ids ? 0 : k3_err_set(e, K3_ENOMEM, "out of memory for the layer probe");
    if (rc == 0)
        rc = k3_ws_mem_create(&ws, &q, 0x7e57, e);
    k3_model_opts o = {cmax};
    if (rc == 0)
        rc = k3_model_open(&m, ws, &o, e);
    if (rc == 0)
        rc = k3_sess_create(&s, m, 2 * cmax, e);
    for (uint32_t i = 0; rc == 0 && i < 2 * cmax; i++)
        ids[i] = (7u * i + 3u) % REST_VOCAB;
    /* b from passes of the most rows timed: the second attends to R^2 more
     * positions than the first */
    double m1 = 0, m2 = 0;
    if (rc == 0)
        rc = two_passes(m, s, ids, cmax, &m1, &m2, e);
    const double b = m2 > m1 ? (m2 - m1) / ((double)cmax * cmax) : 0;
    for (uint32_t k = 0; rc == 0 && k < p->n_rest; k++) {
        const uint32_t R = p->rest[k].chunk < cmax ? p->rest[k].chunk : cmax;
        double r1 = m1, r2;
        if (R != cmax)
            rc = two_passes(m, s, ids, R, &r1, &r2, e);
        /* the first pass attends to R (R + 1) / 2 positions */
        const double a = (r1 - b * (double)R * (R + 1) / 2) / R;
        p->rest[k].a[mla] = a > 0 ? a : 0;
        p->rest[k].b[mla] = b;
    }
    k3_sess_free(s);
    k3_model_close(m);
    k3_ws_close(ws);
    free(ids);
    return rc;
}

int k3_probe_rest_run(const k3_cfg *c, const uint32_t *chunks, uint32_t n, k3_probe *p, k3_err *e)
{
    const double t0 = omp_get_wtime();
    uint32_t cmax = 1;
    p->n_rest = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t k = 0;
        while (k < p->n_rest && p->rest[k].chunk != chunks[i])
            k++;
        if (k < p->n_rest || !chunks[i] || p->n_rest == K3_PROBE_REST_MAX)
            continue;
        memset(&p->rest[k], 0, sizeof p->rest[k]);
        p->rest[k].chunk = chunks[i];
        p->n_rest++;
        cmax = chunks[i] > cmax ? chunks[i] : cmax;
    }
    cmax = cmax < REST_ROWS ? cmax : REST_ROWS;
    int rc = 0;
    for (int mla = 0; mla < 2 && rc == 0; mla++)
        rc = time_kind(c, mla, cmax, p, e);
    if (rc < 0)
        p->n_rest = 0;
    p->rest_seconds = omp_get_wtime() - t0;
    return rc;
}
