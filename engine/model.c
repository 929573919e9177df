/*
 * model.c - the forward pass driver (docs/MODEL.md §1.4): open/validate, scratch, the
 * attention-residual stack, norms, the head; layer parts live in kda.c,
 * mla.c and moe.c.
 *
 * Fixed reduction orders (the determinism contract):
 *  - RMSNorm: sum of squares in double, index ascending; y = w * (x * r)
 *    with r = (float)(1/sqrt(ss/n + eps)).
 *  - AttnRes: per source, dot(S, f) and sum of squares in double, index
 *    ascending; softmax over sources in source order (max first, sum of
 *    exp in double); output sum over sources in source order, in float.
 *  - Matrix products: k3_gemm_* (the kernel contract: per output element a
 *    fixed order independent of T and of the thread count); F32 matrices
 *    (accepted for small tensors) by a plain column-ascending float loop.
 * Work is split over tokens or rows only, never inside a reduction.
 *
 * Batches (k3_model_forward_batch): the tokens of several sessions are laid
 * end to end in passes of at most max_chunk rows; every reduction above is
 * per row (a row's norm, residual mix, routing, top-k sum and products see
 * only that row), so a row's bits do not depend on which rows share its
 * pass. A product whose output rows are not one block goes through
 * m->mmtmp in row blocks (mm_block): the kernel's per-output order is
 * independent of the row range too.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "follow.h"
#include "k3_kern.h"
#include "model_int.h"

/* ---------------------------------------------------------------- helpers */

uint64_t k3_model_par_min = 1u << 16;

void k3_model_set_parallel_threshold(uint64_t work) { k3_model_par_min = work; }

static uint64_t view_rows(const k3_view *v) { return v->ndim ? v->shape[0] : 1; }
static uint64_t view_cols(const k3_view *v)
{
    uint64_t n = k3_view_numel(v), r = view_rows(v);
    return r ? n / r : 0;
}

/* One kernel call: Y[t*rows + r] = row r of W (rows x cols at w) . X[t]. */
static void kern(k3_dtype dt, const void *w, uint64_t rows, uint64_t cols, const float *X, uint32_t T, float *Y)
{
    /* every trunk dtype through its kernel: one contract (include/k3_kern.h) */
    const int st = omp_in_parallel();
    if (dt == K3_DT_BF16)
        (st ? k3_gemm_bf16_st : k3_gemm_bf16)((const uint16_t *)w, rows, cols, X, T, Y);
    else if (dt == K3_DT_F16)
        (st ? k3_gemm_f16_st : k3_gemm_f16)((const uint16_t *)w, rows, cols, X, T, Y);
    else
        (st ? k3_gemm_f32_st : k3_gemm_f32)((const float *)w, rows, cols, X, T, Y);
}

/* n rows of a matrix held in memory at w into the output columns [col, col
 * + n) of every row t: Y + t * ldy, or rowp[t] when rowp is set (the head's
 * rows going to each sequence's own buffer). When the output rows are not
 * one [T][n] block the rows go through m->mmtmp in blocks of K3_MM_BLOCK:
 * the kernel's per-output order depends on neither the row range nor T, so
 * the same numbers, and nothing is allocated. */
static void mm_block(k3_model *m, k3_dtype dt, const void *w, uint64_t n, uint64_t cols, const float *X, uint32_t T,
                     float *Y, uint64_t ldy, float *const *rowp, uint64_t col)
{
    if (T == 1) {
        kern(dt, w, n, cols, X, 1, (rowp ? rowp[0] : Y) + col);
        return;
    }
    if (!rowp && ldy == n && col == 0) {
        kern(dt, w, n, cols, X, T, Y);
        return;
    }
    const uint64_t es = dt == K3_DT_F32 ? 4 : 2, step = K3_MM_BLOCK;
    for (uint64_t b = 0; b < n; b += step) {
        uint64_t nb = n - b < step ? n - b : step;
        kern(dt, (const uint8_t *)w + b * cols * es, nb, cols, X, T, m->mmtmp);
        for (uint32_t t = 0; t < T; t++)
            memcpy((rowp ? rowp[t] : Y + (uint64_t)t * ldy) + col + b, m->mmtmp + (uint64_t)t * nb,
                   nb * sizeof(float));
    }
}

/* Rows [row0, row0 + rows) of W into the output (see mm_block). A streamed
 * matrix comes piece by piece from the source, each piece's products written
 * to their place: the same kernel on the same rows, so the same numbers. A
 * failed read stops the product there: its error is returned (the source
 * keeps it too, k3_ws_status) and the output is left as is. */
static int mm_local(k3_model *m, const k3_view *W, uint64_t row0, uint64_t rows, const float *X, uint32_t T,
                    float *Y, float *const *rowp, k3_err *e)
{
    const uint64_t cols = view_cols(W), es = W->dtype == K3_DT_F32 ? 4 : 2;
    if (W->data || !W->src) {
        mm_block(m, W->dtype, (const uint8_t *)W->data + row0 * cols * es, rows, cols, X, T, Y, rows, rowp, 0);
        return 0;
    }
    for (uint64_t r = row0; r < row0 + rows;) {
        const void *p;
        uint64_t n = 0;
        int rc = k3_ws_rows_acquire(W->src, W->group, (k3_wslot)W->slot, r, &n, &p, e);
        if (rc < 0)
            return rc;
        if (n == 0) {
            k3_ws_rows_release(W->src, W->group, (k3_wslot)W->slot);
            return k3_err_set(e, K3_EINTERNAL, "no rows from row %llu of %s in group %u", (unsigned long long)r,
                              k3_wslot_name((k3_wslot)W->slot), W->group);
        }
        if (n > row0 + rows - r)
            n = row0 + rows - r;
        mm_block(m, W->dtype, p, n, cols, X, T, Y, rows, rowp, r - row0);
        k3_ws_rows_release(W->src, W->group, (k3_wslot)W->slot);
        r += n;
    }
    return 0;
}

/* Over several ranks: each rank computes the rows of [row0, row0 + rows)
 * inside its own range of the matrix (k3_dist_rows) with mm_local, in
 * rounds of at most K3_DIST_ROUND_ROWS rows per rank, and every rank's rows
 * go to their place on every rank (Y and rowp both NULL: computed and sent,
 * not kept). Each row is computed wholly on one rank by the kernel one
 * process uses, so the same numbers. */
static int mm_any(k3_model *m, const k3_view *W, uint64_t row0, uint64_t rows, const float *X, uint32_t T, float *Y,
                  float *const *rowp, k3_err *e)
{
    k3_dist *d = m->dist;
    if (!d)
        return mm_local(m, W, row0, rows, X, T, Y, rowp, e);
    const uint32_t N = d->size;
    float *mine = (float *)(m->dsend + sizeof(k3_dist_status));
    uint64_t a[K3_DIST_MAX_RANKS], len[K3_DIST_MAX_RANKS], n[K3_DIST_MAX_RANKS], most = 0;
    for (uint32_t q = 0; q < N; q++) {
        uint64_t lo, hi;
        k3_dist_rows(view_rows(W), q, N, &lo, &hi);
        a[q] = lo > row0 ? lo : row0;
        const uint64_t b = hi < row0 + rows ? hi : row0 + rows;
        len[q] = b > a[q] ? b - a[q] : 0;
        most = len[q] > most ? len[q] : most;
    }
    /* rounds end where a rank's streamed pieces end (they start at its
     * range), so no piece is asked for twice */
    const uint64_t pr = W->piece_rows, RR = !pr ? K3_DIST_ROUND_ROWS
                                         : pr >= K3_DIST_ROUND_ROWS ? pr : K3_DIST_ROUND_ROWS / pr * pr;
    for (uint64_t k = 0; k == 0 || k * RR < most; k++) {
        for (uint32_t q = 0; q < N; q++) {
            const uint64_t done = k * RR < len[q] ? k * RR : len[q];
            n[q] = (len[q] - done < RR ? len[q] - done : RR) * T * sizeof(float);
        }
        const uint64_t nr = n[d->rank] / sizeof(float) / T;
        int rc = nr ? mm_local(m, W, a[d->rank] + k * RR, nr, X, T, mine, NULL, e) : 0;
        d->st.trunk_gathers++;
        rc = k3_dist_gather(d, rc, e, m->dsend, n, m->drecv, m->dparts, e);
        if (rc < 0)
            return rc;
        if (!Y && !rowp)
            continue;
        for (uint32_t q = 0; q < N; q++) {
            const uint64_t nq = n[q] / sizeof(float) / T, col = a[q] + k * RR - row0;
            const float *src = m->dparts[q];
            for (uint32_t t = 0; t < T && nq; t++)
                memcpy((rowp ? rowp[t] : Y + (uint64_t)t * rows) + col, src + (uint64_t)t * nq, nq * sizeof(float));
        }
    }
    return 0;
}

int k3_model_mm_heads(k3_model *m, const k3_view *W, uint32_t H, uint64_t rows_per_head, uint64_t off, uint64_t rows,
                      const float *X, uint64_t x_stride, uint32_t T, float *Y, k3_err *e)
{
    k3_dist *d = m->dist;
    const uint64_t y_stride = (uint64_t)T * rows;
    if (!d) {
        const double t0 = omp_get_wtime();
        int rc = 0;
        for (uint32_t h = 0; h < H && rc == 0; h++)
            rc = mm_local(m, W, h * rows_per_head + off, rows, X + h * x_stride, T, Y + h * y_stride, NULL, e);
        m->times.products += omp_get_wtime() - t0;
        return rc < 0 ? rc : 0;
    }
    /* rank q: heads [H q / N, H (q + 1) / N), whose outputs lie end to end in Y */
    const uint32_t N = d->size, h0 = (uint32_t)((uint64_t)H * d->rank / N), h1 = (uint32_t)((uint64_t)H * (d->rank + 1) / N);
    float *mine = (float *)(m->dsend + sizeof(k3_dist_status));
    uint64_t n[K3_DIST_MAX_RANKS];
    for (uint32_t q = 0; q < N; q++)
        n[q] = ((uint64_t)H * (q + 1) / N - (uint64_t)H * q / N) * y_stride * sizeof(float);
    int rc = 0;
    for (uint32_t h = h0; h < h1 && rc == 0; h++)
        rc = mm_local(m, W, h * rows_per_head + off, rows, X + h * x_stride, T, mine + (h - h0) * y_stride, NULL, e);
    d->st.trunk_gathers++;
    rc = k3_dist_gather(d, rc, e, m->dsend, n, m->drecv, m->dparts, e);
    if (rc < 0)
        return rc;
    for (uint32_t q = 0; q < N; q++)
        memcpy(Y + (uint64_t)H * q / N * y_stride, m->dparts[q], n[q]);
    return 0;
}

int k3_model_mm(k3_model *m, const k3_view *W, const float *X, uint32_t T, float *Y, k3_err *e)
{
    const double t0 = omp_get_wtime();
    int rc = mm_any(m, W, 0, view_rows(W), X, T, Y, NULL, e);
    m->times.products += omp_get_wtime() - t0;
    return rc;
}

static void rmsnorm_row(const float *x, const float *w, uint32_t n, float eps, float *y)
{
    double ss = 0.0;
    for (uint32_t i = 0; i < n; i++)
        ss += (double)x[i] * (double)x[i];
    float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    if (w) {
        for (uint32_t i = 0; i < n; i++)
            y[i] = w[i] * (x[i] * r);
    } else {
        for (uint32_t i = 0; i < n; i++)
            y[i] = x[i] * r;
    }
}

void k3_model_rmsnorm(const float *x, const float *w, uint32_t n, uint32_t T, float eps, float *y)
{
    K3_PAR_FOR(!omp_in_parallel() && (uint64_t)T * n > K3_PAR_MIN,
    for (uint32_t t = 0; t < T; t++)
        rmsnorm_row(x + (uint64_t)t * n, w, n, eps, y + (uint64_t)t * n););
}

uint64_t k3_view_numel(const k3_view *v)
{
    uint64_t n = 1;
    for (uint32_t i = 0; i < v->ndim; i++)
        n *= v->shape[i];
    return n;
}

/* ------------------------------------------------------------ validation */

static int is_vector_slot(k3_wslot s)
{
    const k3_sch_row *r = k3_schema_row((uint32_t)s);
    return r && r->cls != K3_SCH_MATRIX;
}

/* Every slot of group g the schema expects for the config, checked against
 * what the source describes: a matrix shape for shape, a vector (and conv
 * taps) by count, A_log at least H values. */
static int check_group(k3_model *m, uint32_t g, uint64_t *smalls_need, k3_err *e)
{
    const int is_head = g == K3_WS_HEAD(&m->cfg);
    uint64_t need = 0;
    for (int si = 0; si < K3_W_COUNT; si++) {
        k3_wslot s = (k3_wslot)si;
        const k3_sch_row *r = k3_schema_row((uint32_t)si);
        if (!k3_schema_in_group(&m->cfg, r, g))
            continue;
        uint64_t shape[3];
        const uint64_t count = k3_schema_shape(&m->cfg, r, shape);
        const uint64_t rows = r->cls == K3_SCH_MATRIX ? shape[0] : count;
        const uint64_t cols = r->cls == K3_SCH_MATRIX ? shape[1] : 0;
        k3_view v;
        memset(&v, 0, sizeof v);
        int rc = k3_ws_describe(m->ws, g, s, &v, e);
        if (rc < 0)
            return rc;
        if (v.piece_rows > m->dist_round_rows)
            m->dist_round_rows = v.piece_rows;
        const char *where = is_head ? "model output" : "layer";
        uint64_t n = k3_view_numel(&v);
        if (cols) {
            if (v.dtype != K3_DT_BF16 && v.dtype != K3_DT_F16 && v.dtype != K3_DT_F32)
                return k3_err_set(e, K3_EFORMAT, "%s %u: tensor %s has dtype %s, expected BF16, F16 or F32",
                                  where, is_head ? 0 : g, k3_wslot_name(s), k3_dtype_name(v.dtype));
            if (v.ndim != 2 || v.shape[0] != rows || v.shape[1] != cols)
                return k3_err_set(e, K3_EFORMAT,
                                  "%s %u: tensor %s has shape %llu elements in %u dims (first %llu), expected [%llu, %llu]",
                                  where, is_head ? 0 : g, k3_wslot_name(s), (unsigned long long)n, v.ndim,
                                  (unsigned long long)(v.ndim ? v.shape[0] : 0), (unsigned long long)rows,
                                  (unsigned long long)cols);
        } else {
            if (v.dtype != K3_DT_BF16 && v.dtype != K3_DT_F16 && v.dtype != K3_DT_F32)
                return k3_err_set(e, K3_EFORMAT, "%s %u: tensor %s has dtype %s, expected BF16, F16 or F32",
                                  where, is_head ? 0 : g, k3_wslot_name(s), k3_dtype_name(v.dtype));
            const int alog = r->cls == K3_SCH_ALOG;
            int ok = alog ? n >= rows : n == rows;
            if (!ok)
                return k3_err_set(e, K3_EFORMAT, "%s %u: tensor %s has %llu elements, expected %s%llu",
                                  where, is_head ? 0 : g, k3_wslot_name(s), (unsigned long long)n,
                                  alog ? "at least " : "", (unsigned long long)rows);
            need += n;
        }
    }
    if (need > *smalls_need)
        *smalls_need = need;
    return 0;
}

/* Widen the group's vectors to f32 and fold the AttnRes queries. */
static void load_smalls(k3_model *m, const k3_view *v)
{
    float *p = m->smalls;
    for (int si = 0; si < K3_W_COUNT; si++) {
        m->vf[si] = NULL;
        if (!is_vector_slot((k3_wslot)si) || !v[si].data)
            continue;
        uint64_t n = k3_view_numel(&v[si]);
        if (v[si].dtype == K3_DT_F32)
            memcpy(p, v[si].data, n * sizeof(float));
        else if (v[si].dtype == K3_DT_F16)
            k3_f16_to_f32_n((const uint16_t *)v[si].data, p, n);
        else
            k3_bf16_to_f32_n((const uint16_t *)v[si].data, p, n);
        m->vf[si] = p;
        p += n;
    }
    uint32_t E = m->d.E;
    if (m->vf[K3_W_SA_RES_NORM] && m->vf[K3_W_SA_RES_PROJ])
        for (uint32_t i = 0; i < E; i++)
            m->f_sa[i] = m->vf[K3_W_SA_RES_NORM][i] * m->vf[K3_W_SA_RES_PROJ][i];
    if (m->vf[K3_W_MLP_RES_NORM] && m->vf[K3_W_MLP_RES_PROJ])
        for (uint32_t i = 0; i < E; i++)
            m->f_mlp[i] = m->vf[K3_W_MLP_RES_NORM][i] * m->vf[K3_W_MLP_RES_PROJ][i];
    if (m->vf[K3_W_OUT_RES_NORM] && m->vf[K3_W_OUT_RES_PROJ])
        for (uint32_t i = 0; i < E; i++)
            m->f_out[i] = m->vf[K3_W_OUT_RES_NORM][i] * m->vf[K3_W_OUT_RES_PROJ][i];
}

/* ------------------------------------------------------------------ open */

static float *falloc(uint64_t n, int *bad)
{
    if (n == 0)
        n = 1;
    if (n > (UINT64_MAX / sizeof(float)) / 2) {
        *bad = 1;
        return NULL;
    }
    float *p = calloc(n, sizeof(float));
    if (!p)
        *bad = 1;
    return p;
}

static uint32_t *ualloc(uint64_t n, int *bad)
{
    uint32_t *p = calloc(n ? n : 1, sizeof(uint32_t));
    if (!p)
        *bad = 1;
    return p;
}

static void model_dims(k3_dims *d, const k3_cfg *c)
{
    d->E = c->hidden_size; d->V = c->vocab_size; d->NL = c->num_hidden_layers;
    d->H = c->kda_num_heads; d->D = c->kda_head_dim; d->P = d->H * d->D;
    d->CW = c->short_conv_kernel_size; d->MH = c->num_attention_heads;
    d->NOPE = c->qk_nope_head_dim; d->ROPE = c->qk_rope_head_dim; d->VD = c->v_head_dim;
    d->QK = d->NOPE + d->ROPE; d->QL = c->q_lora_rank; d->KVL = c->kv_lora_rank;
    d->NE = c->num_experts; d->TOPK = c->num_experts_per_token; d->LAT = c->routed_expert_hidden_size;
    d->I = c->moe_intermediate_size; d->NSH = c->num_shared_experts; d->IDN = c->intermediate_size;
    d->B = c->attn_res_block_size ? c->attn_res_block_size : 1;
    d->NB = (d->NL + d->B - 1) / d->B;
    d->eps = (float)c->rms_norm_eps; d->lb = (float)c->gate_lower_bound;
    d->b1 = (float)c->situ_beta; d->b2 = (float)c->situ_linear_beta;
    d->rsf = (float)c->routed_scaling_factor;
    d->mla_gate = c->mla_use_output_gate; d->renorm = c->moe_renormalize; d->moe_norm = c->latent_moe_use_norm;
}

/* Bytes of falloc(n) / ualloc(n). */
static uint64_t fbytes(uint64_t n) { return (n ? n : 1) * sizeof(float); }
static uint64_t ubytes(uint64_t n) { return (n ? n : 1) * sizeof(uint32_t); }

/* The sizes of open and create below, buffer for buffer (keep the two in
 * step: tests/t_schema.c compares them with what is allocated). */
void k3_model_mem_need(const k3_cfg *c, uint32_t max_chunk, uint32_t max_ctx, uint32_t nthreads,
                       k3_model_mem *out)
{
    k3_dims dd, *d = &dd;
    memset(d, 0, sizeof *d);
    model_dims(d, c);
    for (uint32_t L = 0; L < d->NL; L++)
        *(k3_cfg_layer_is_mla(c, L) ? &d->n_mla : &d->n_kda) += 1;
    /* the largest group's vectors (check_group's smalls) */
    uint64_t smalls = 0;
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    for (uint32_t g = 0; g <= d->NL; g++) {
        uint64_t need = 0, sh[3];
        for (uint32_t i = 0; i < nrows; i++)
            if (rows[i].cls != K3_SCH_MATRIX && k3_schema_in_group(c, &rows[i], g))
                need += k3_schema_shape(c, &rows[i], sh);
        if (need > smalls)
            smalls = need;
    }
    const uint64_t T = max_chunk ? max_chunk : 64, E = d->E, P = d->P, MH = d->MH;
    uint64_t b = sizeof(struct k3_model) + d->NL * (sizeof(uint32_t) + sizeof(double));
    b += fbytes(smalls) + 3 * fbytes(E) + 6 * fbytes(T * E) + fbytes((uint64_t)d->NB * T * E);
    if (d->n_kda)
        b += 9 * fbytes(T * P) + fbytes(T * d->H) + fbytes(T * d->D);
    if (d->n_mla)
        b += fbytes(T * d->QL) + fbytes(T * MH * d->QK) + fbytes(T * (d->KVL + d->ROPE)) +
             2 * fbytes(T * MH * d->KVL) + 3 * fbytes(T * MH * d->VD);
    uint64_t inner = d->IDN;
    if ((uint64_t)d->I * d->NSH > inner)
        inner = (uint64_t)d->I * d->NSH;
    b += 2 * fbytes(T * inner);
    if (d->NL > c->first_k_dense_replace) {
        const uint64_t TK = T * d->TOPK;
        b += fbytes(T * d->NE) + fbytes(TK) + ubytes(TK) + 2 * fbytes(T * d->LAT) + 2 * fbytes(T * d->I) +
             fbytes(T * d->LAT) + fbytes(TK * d->LAT) + fbytes(T * d->LAT) + fbytes(T * E) + 2 * ubytes(d->NE) +
             2 * ubytes(TK);
    }
    /* the pass: product row blocks, segments, row maps, head rows */
    b += fbytes(T * K3_MM_BLOCK) + T * sizeof(k3_seg) + T * sizeof(float *) + 3 * ubytes(T);
    out->model = b;
    out->kv = fbytes((uint64_t)d->n_mla * max_ctx * (d->KVL + d->ROPE));
    out->state = sizeof(struct k3_sess) + fbytes((uint64_t)d->n_kda * d->H * d->D * d->D) +
                 fbytes((uint64_t)d->n_kda * 3 * (d->CW - 1) * d->P);
    out->scores = fbytes((uint64_t)(nthreads ? nthreads : 1) * k3_mla_head_group(d->MH) * max_ctx);
}

int k3_model_open(k3_model **out, k3_ws *ws, const k3_model_opts *opts, k3_err *e)
{
    *out = NULL;
    k3_kern_init();
    k3_model *m = calloc(1, sizeof *m);
    if (!m)
        return k3_err_set(e, K3_ENOMEM, "out of memory opening the model");
    m->ws = ws;
    m->cfg = *k3_ws_cfg(ws);
    const k3_cfg *c = &m->cfg;
    k3_dims *d = &m->d;
    model_dims(d, c);
    if (d->CW < 1 || d->E == 0 || d->V == 0 || d->NL == 0 || d->TOPK == 0 || d->TOPK > d->NE ||
        d->NL > K3_CFG_MAX_LAYERS || d->D > 4096 || d->D == 0) {
        int rc = k3_err_set(e, K3_EFORMAT,
                            "config: unusable dimensions (layers %u, width %u, KDA head dim %u, top-k %u of %u)",
                            d->NL, d->E, d->D, d->TOPK, d->NE);
        free(m);
        return rc;
    }
    m->max_chunk = opts && opts->max_chunk ? opts->max_chunk : 64;
    m->nthreads = omp_get_max_threads();
    m->layer_slot = calloc(d->NL, sizeof(uint32_t));
    m->layer_s = calloc(d->NL, sizeof(double));
    if (!m->layer_slot || !m->layer_s) {
        free(m->layer_slot);
        free(m->layer_s);
        free(m);
        return k3_err_set(e, K3_ENOMEM, "out of memory opening the model");
    }
    for (uint32_t L = 0; L < d->NL; L++)
        m->layer_slot[L] = k3_cfg_layer_is_mla(c, L) ? d->n_mla++ : d->n_kda++;

    uint64_t smalls = 0;
    int rc = 0;
    for (uint32_t L = 0; L < d->NL && rc == 0; L++)
        rc = check_group(m, L, &smalls, e);
    if (rc == 0)
        rc = check_group(m, K3_WS_HEAD(c), &smalls, e);
    if (rc < 0) {
        k3_model_close(m);
        return rc;
    }
    uint64_t T = m->max_chunk, E = d->E, P = d->P;
    int bad = 0;
    m->smalls_cap = smalls;
    m->smalls = falloc(smalls, &bad);
    m->f_sa = falloc(E, &bad); m->f_mlp = falloc(E, &bad); m->f_out = falloc(E, &bad);
    m->h = falloc(T * E, &bad); m->prefix = falloc(T * E, &bad); m->stack = falloc((uint64_t)d->NB * T * E, &bad);
    m->xn = falloc(T * E, &bad); m->attn = falloc(T * E, &bad); m->mlp = falloc(T * E, &bad);
    m->head_x = falloc(T * E, &bad);
    if (d->n_kda) {
        m->kq = falloc(T * P, &bad); m->kk = falloc(T * P, &bad); m->kv = falloc(T * P, &bad);
        m->kg = falloc(T * P, &bad); m->kb = falloc(T * d->H, &bad); m->kfa = falloc(T * d->D, &bad);
        m->kz = falloc(T * P, &bad); m->kcq = falloc(T * P, &bad); m->kck = falloc(T * P, &bad);
        m->kcv = falloc(T * P, &bad); m->ko = falloc(T * P, &bad);
    }
    if (d->n_mla) {
        uint64_t MH = d->MH;
        m->mqa = falloc(T * d->QL, &bad); m->mq = falloc(T * MH * d->QK, &bad);
        m->mc = falloc(T * (d->KVL + d->ROPE), &bad); m->mqlat = falloc(T * MH * d->KVL, &bad);
        m->molat = falloc(MH * T * d->KVL, &bad); m->mov = falloc(MH * T * d->VD, &bad);
        m->mo = falloc(T * MH * d->VD, &bad); m->mg = falloc(T * MH * d->VD, &bad);
    }
    uint64_t inner = d->IDN;
    if ((uint64_t)d->I * d->NSH > inner)
        inner = (uint64_t)d->I * d->NSH;
    m->dg = falloc(T * inner, &bad); m->du = falloc(T * inner, &bad);
    int has_moe = d->NL > c->first_k_dense_replace;
    if (has_moe) {
        uint64_t TK = T * d->TOPK;
        m->rs = falloc(T * d->NE, &bad); m->rw = falloc(TK, &bad); m->rsel = ualloc(TK, &bad);
        m->mz = falloc(T * d->LAT, &bad); m->mx = falloc(T * d->LAT, &bad);
        m->m1 = falloc(T * d->I, &bad); m->m3 = falloc(T * d->I, &bad); m->my = falloc(T * d->LAT, &bad);
        m->mout = falloc(TK * d->LAT, &bad); m->macc = falloc(T * d->LAT, &bad); m->mup = falloc(T * E, &bad);
        m->eids = ualloc(d->NE, &bad); m->ecount = ualloc(d->NE, &bad);
        m->etok = ualloc(TK, &bad); m->eslot = ualloc(TK, &bad);
    }
    m->mmtmp = falloc(T * K3_MM_BLOCK, &bad);
    m->dist = k3_dist_get();
    if (m->dist && m->dist->size > 1) {
        /* a product round: at most K3_DIST_ROUND_ROWS rows per rank; the
         * expert outputs: T x top-k latents */
        const uint64_t N = m->dist->size, S = sizeof(k3_dist_status);
        const uint64_t rr = m->dist_round_rows > K3_DIST_ROUND_ROWS ? m->dist_round_rows : K3_DIST_ROUND_ROWS;
        uint64_t share = T * rr * sizeof(float), all = N * share;
        const uint64_t xo = has_moe ? T * d->TOPK * d->LAT * sizeof(float) : 0;
        share = share > xo ? share : xo;
        all = all > xo ? all : xo;
        /* the MLA values by heads (k3_model_mm_heads) */
        const uint64_t hv = d->n_mla ? T * d->VD * sizeof(float) : 0;
        share = share > (d->MH + N - 1) / N * hv ? share : (d->MH + N - 1) / N * hv;
        all = all > d->MH * hv ? all : d->MH * hv;
        m->dsend = malloc(S + share + 8);   /* + rounding to 8 (k3_dist_gather) */
        m->drecv = malloc(N * (S + 8) + all);
        m->dparts = calloc(N, sizeof *m->dparts);
        if (!m->dsend || !m->drecv || !m->dparts)
            bad = 1;
    } else {
        m->dist = NULL;
    }
    m->segs = calloc(T, sizeof(k3_seg));
    m->head_dst = calloc(T, sizeof(float *));
    if (!m->segs || !m->head_dst)
        bad = 1;
    m->rowseg = ualloc(T, &bad); m->ids = ualloc(T, &bad); m->head_row = ualloc(T, &bad);
    if (bad) {
        k3_model_close(m);
        return k3_err_set(e, K3_ENOMEM, "out of memory sizing the scratch for chunks of %llu tokens",
                          (unsigned long long)T);
    }
    *out = m;
    return 0;
}

void k3_model_close(k3_model *m)
{
    if (!m)
        return;
    float *fs[] = {m->smalls, m->f_sa, m->f_mlp, m->f_out, m->h, m->prefix, m->stack, m->xn, m->attn,
                   m->mlp, m->head_x, m->kq, m->kk, m->kv, m->kg, m->kb, m->kfa, m->kz, m->kcq, m->kck,
                   m->kcv, m->ko, m->mqa, m->mq, m->mc, m->mqlat, m->molat, m->mov, m->mo, m->mg,
                   m->dg, m->du, m->rs, m->rw, m->mz, m->mx, m->m1, m->m3, m->my, m->mout, m->macc, m->mup,
                   m->mmtmp};
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        free(fs[i]);
    free(m->rsel); free(m->eids); free(m->ecount); free(m->etok); free(m->eslot);
    free(m->segs); free(m->head_dst); free(m->rowseg); free(m->ids); free(m->head_row);
    free(m->dsend); free(m->drecv); free(m->dparts);
    free(m->layer_slot);
    free(m->layer_s);
    free(m);
}

const k3_cfg *k3_model_cfg(const k3_model *m) { return &m->cfg; }
uint32_t k3_model_max_chunk(const k3_model *m) { return m->max_chunk; }

void k3_model_times_get(const k3_model *m, k3_model_times *t) { *t = m->times; }

void k3_model_layer_times(const k3_model *m, double *out)
{
    memcpy(out, m->layer_s, m->d.NL * sizeof(double));
}

void k3_model_times_reset(k3_model *m)
{
    memset(&m->times, 0, sizeof m->times);
    memset(m->layer_s, 0, m->d.NL * sizeof(double));
}

/* --------------------------------------------------------------- session */

int k3_sess_create(k3_sess **out, const k3_model *m, uint32_t max_ctx, k3_err *e)
{
    *out = NULL;
    const k3_dims *d = &m->d;
    if (max_ctx == 0)
        return k3_err_set(e, K3_EARG, "context length must be at least 1");
    k3_sess *s = calloc(1, sizeof *s);
    if (!s)
        return k3_err_set(e, K3_ENOMEM, "out of memory creating a session");
    s->m = m;
    s->max_ctx = max_ctx;
    int bad = 0;
    s->kda_state = falloc((uint64_t)d->n_kda * d->H * d->D * d->D, &bad);
    s->conv_hist = falloc((uint64_t)d->n_kda * 3 * (d->CW - 1) * d->P, &bad);
    s->mla_cache = falloc((uint64_t)d->n_mla * max_ctx * (d->KVL + d->ROPE), &bad);
    s->scores = falloc((uint64_t)m->nthreads * k3_mla_head_group(d->MH) * max_ctx, &bad);
    if (bad) {
        k3_sess_free(s);
        return k3_err_set(e, K3_ENOMEM, "out of memory for a session of %u tokens", max_ctx);
    }
    *out = s;
    return 0;
}

void k3_sess_free(k3_sess *s)
{
    if (!s)
        return;
    free(s->kda_state);
    free(s->conv_hist);
    free(s->mla_cache);
    free(s->scores);
    free(s);
}

void k3_sess_reset(k3_sess *s)
{
    const k3_dims *d = &s->m->d;
    memset(s->kda_state, 0, (uint64_t)d->n_kda * d->H * d->D * d->D * sizeof(float));
    memset(s->conv_hist, 0, (uint64_t)d->n_kda * 3 * (d->CW - 1) * d->P * sizeof(float));
    /* the MLA cache needs no clearing: positions >= pos are never read */
    s->pos = 0;
}

uint32_t k3_sess_pos(const k3_sess *s) { return s->pos; }
uint32_t k3_sess_max_ctx(const k3_sess *s) { return s->max_ctx; }

/* --------------------------------------------------------------- forward */

/* out[t] = AttnRes over (stack[0..ns) row r, last row r) with query f, for
 * T rows r = rows[t] (rows NULL: r = t). */
static void attn_res(const k3_model *m, uint32_t ns, const uint32_t *rows, const float *last, const float *f,
                     uint32_t T, float *out)
{
    const uint32_t E = m->d.E;
    const float eps = m->d.eps;
    const uint64_t stride = (uint64_t)m->max_chunk * E;
    K3_PAR_FOR((uint64_t)T * E * (ns + 1) > K3_PAR_MIN,
    for (uint32_t t = 0; t < T; t++) {
        float sc[K3_CFG_MAX_LAYERS + 1];
        const float *src[K3_CFG_MAX_LAYERS + 1];
        const uint64_t r = rows ? rows[t] : t;
        uint32_t n = ns + 1;
        for (uint32_t i = 0; i < ns; i++)
            src[i] = m->stack + i * stride + r * E;
        src[ns] = last + r * E;
        float mx = -INFINITY;
        for (uint32_t i = 0; i < n; i++) {
            double dot = 0.0, ss = 0.0;
            for (uint32_t c = 0; c < E; c++) {
                dot += (double)src[i][c] * (double)f[c];
                ss += (double)src[i][c] * (double)src[i][c];
            }
            sc[i] = (float)(dot / sqrt(ss / (double)E + (double)eps));
            if (sc[i] > mx)
                mx = sc[i];
        }
        double sum = 0.0;
        for (uint32_t i = 0; i < n; i++) {
            sc[i] = k3_expf(sc[i] - mx);
            sum += sc[i];
        }
        for (uint32_t i = 0; i < n; i++)
            sc[i] = (float)(sc[i] / sum);
        float *o = out + (uint64_t)t * E;
        for (uint32_t c = 0; c < E; c++) {
            float acc = 0.0f;
            for (uint32_t i = 0; i < n; i++)
                acc += sc[i] * src[i][c];
            o[c] = acc;
        }
    });
}

static void vadd(float *a, const float *b, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        a[i] += b[i];
}

/* Before a MoE layer's attention: its MoE input as it would be if the
 * attention added nothing (the output AttnRes over the stack and the partial
 * block - empty when the layer starts a block), normed, routed as a guess of
 * the experts the layer will want (k3_moe_guess). m->attn and m->mlp are
 * free until the attention and the MLP write them. */
static void guess_experts(k3_model *m, uint32_t L, const k3_view *v, uint32_t T, uint32_t ns, int prefix_none)
{
    const uint64_t TE = (uint64_t)T * m->d.E;
    const float *last = m->prefix;
    if (prefix_none) {
        memset(m->attn, 0, TE * sizeof(float));
        last = m->attn;
    }
    attn_res(m, ns, NULL, last, m->f_mlp, T, m->mlp);
    k3_model_rmsnorm(m->mlp, m->vf[K3_W_POST_NORM], m->d.E, T, m->d.eps, m->mlp);
    k3_moe_guess(m, L, v, m->mlp, T);
}

/* Over several ranks, group g done: every rank's status agreed, and the
 * CRCs of units whose pieces several ranks read checked (k3_ws.h). */
static int group_done(k3_model *m, uint32_t g, int code, k3_err *e)
{
    return k3_ws_has_dist_check(m->ws) ? k3_ws_dist_check(m->ws, g, code, e) : k3_model_agree(m, code, e);
}

/* One pass over the weights for the rows m->segs lays out (m->rows of them,
 * ids in m->ids); then the head for the m->nhead rows m->head_row, row i's
 * logits to m->head_dst[i]. */
static int forward_pass(k3_model *m, k3_err *e)
{
    const k3_dims *d = &m->d;
    const uint32_t T = m->rows;
    const uint64_t TE = (uint64_t)T * d->E, stride = (uint64_t)m->max_chunk * d->E;
    double t0 = omp_get_wtime();
    int rc = k3_model_agree(m, k3_ws_embed(m->ws, m->ids, T, m->h, e), e);
    if (rc < 0)
        return rc;
    double t1 = omp_get_wtime();
    m->times.embed += t1 - t0;
    uint32_t ns = 0;
    for (uint32_t L = 0; L < d->NL; L++) {
        const k3_view *v;
        rc = k3_ws_acquire(m->ws, L, &v, e);
        if (m->dist) {
            int held = rc == 0;
            rc = k3_model_agree(m, rc, e);
            if (rc < 0 && held)
                k3_ws_release(m->ws, L);
        }
        if (rc < 0)
            return rc;
        double tl0 = omp_get_wtime();
        load_smalls(m, v);
        memcpy(m->prefix, m->h, TE * sizeof(float));
        if (ns)
            attn_res(m, ns, NULL, m->prefix, m->f_sa, T, m->h);
        int prefix_none = 0;
        if (L % d->B == 0) {
            memcpy(m->stack + ns * stride, m->prefix, TE * sizeof(float));
            ns++;
            prefix_none = 1;
        }
        int dense = k3_cfg_layer_is_dense(&m->cfg, L);
        if (!dense && !m->dist && k3_ws_has_experts_guess(m->ws))   /* ranks: a product is a collective */
            guess_experts(m, L, v, T, ns, prefix_none);
        k3_model_rmsnorm(m->h, m->vf[K3_W_INPUT_NORM], d->E, T, d->eps, m->xn);
        t0 = omp_get_wtime();
        int mla = k3_cfg_layer_is_mla(&m->cfg, L);
        rc = mla ? k3_mla_forward(m, L, v, T, e) : k3_kda_forward(m, L, v, T, e);
        if (rc < 0) {
            k3_ws_release(m->ws, L);
            return rc;
        }
        t1 = omp_get_wtime();
        if (mla)
            m->times.attn_mla += t1 - t0;
        else
            m->times.attn_kda += t1 - t0;
        if (prefix_none)
            memcpy(m->prefix, m->attn, TE * sizeof(float));
        else
            vadd(m->prefix, m->attn, TE);
        attn_res(m, ns, NULL, m->prefix, m->f_mlp, T, m->h);
        k3_model_rmsnorm(m->h, m->vf[K3_W_POST_NORM], d->E, T, d->eps, m->xn);
        t0 = omp_get_wtime();
        rc = dense ? k3_mlp_dense_forward(m, v, T, e) : k3_moe_forward(m, L, v, T, e);
        t1 = omp_get_wtime();
        if (dense)
            m->times.mlp_dense += t1 - t0;
        else
            m->times.moe += t1 - t0;
        k3_ws_release(m->ws, L);
        if (rc == 0)
            rc = k3_ws_status(m->ws, e);   /* a streamed piece that failed to read */
        if (m->dist)
            rc = group_done(m, L, rc, e);
        if (rc < 0)
            return rc;
        memcpy(m->h, m->prefix, TE * sizeof(float));
        vadd(m->h, m->mlp, TE);
        m->layer_s[L] += omp_get_wtime() - tl0;
    }
    for (uint32_t g = 0; g < m->nseg; g++)
        m->segs[g].s->pos += m->segs[g].n;
    const uint32_t R = m->nhead;
    if (R == 0)
        return 0;
    t0 = omp_get_wtime();
    uint32_t g = K3_WS_HEAD(&m->cfg);
    const k3_view *v;
    rc = k3_ws_acquire(m->ws, g, &v, e);
    if (m->dist) {
        int held = rc == 0;
        rc = k3_model_agree(m, rc, e);
        if (rc < 0 && held)
            k3_ws_release(m->ws, g);
    }
    if (rc < 0)
        return rc;
    load_smalls(m, v);
    /* Only the rows asked for: the head is the largest matrix of the model. */
    attn_res(m, ns, m->head_row, m->h, m->f_out, R, m->head_x);
    k3_model_rmsnorm(m->head_x, m->vf[K3_W_FINAL_NORM], d->E, R, d->eps, m->head_x);
    int one_block = 1;   /* every row's logits right after the previous row's */
    for (uint32_t i = 1; i < R && one_block; i++)
        one_block = m->head_dst[i] == m->head_dst[0] + (uint64_t)i * d->V;
    if (!m->head_dst[0])   /* a follower rank computes its share for rank 0 */
        rc = mm_any(m, &v[K3_W_LM_HEAD], 0, d->V, m->head_x, R, NULL, NULL, e);
    else
        rc = mm_any(m, &v[K3_W_LM_HEAD], 0, d->V, m->head_x, R, one_block ? m->head_dst[0] : NULL,
                    one_block ? NULL : m->head_dst, e);
    k3_ws_release(m->ws, g);
    if (rc == 0)
        rc = k3_ws_status(m->ws, e);
    if (m->dist)
        rc = group_done(m, g, rc, e);
    if (rc < 0)
        return rc;
    m->times.head += omp_get_wtime() - t0;
    return 0;
}

int k3_model_forward_batch(k3_model *m, const k3_model_seq *q, uint32_t n, k3_err *e)
{
    const k3_dims *d = &m->d;
    const int follower = m->dist && m->dist->rank != 0;   /* its logits are rank 0's */
    for (uint32_t i = 0; i < n; i++) {
        const k3_sess *s = q[i].s;
        if (q[i].logits != K3_LOGITS_NONE && !q[i].out && !follower)
            return k3_err_set(e, K3_EARG, "logits requested without a buffer");
        if (q[i].n == 0 && q[i].logits == K3_LOGITS_LAST)
            return k3_err_set(e, K3_EARG, "no tokens to run");
        for (uint32_t t = 0; t < q[i].n; t++)
            if (q[i].ids[t] >= d->V)
                return k3_err_set(e, K3_EARG, "token id %u at position %u is out of range (vocabulary %u)",
                                  q[i].ids[t], s->pos + t, d->V);
        if ((uint64_t)s->pos + q[i].n > s->max_ctx)
            return k3_err_set(e, K3_ELIMIT, "context full: %u + %u tokens exceed the session's %u", s->pos,
                              q[i].n, s->max_ctx);
        for (uint32_t j = 0; j < i; j++)
            if (q[j].s == s)
                return k3_err_set(e, K3_EARG, "a session is twice in one batch (entries %u and %u)", j, i);
    }
    /* the followers run the same batch (engine/follow.c) */
    if (m->dist && !follower)
        K3_TRY(k3_order_forward(m, q, n, e));
    /* Passes of at most max_chunk rows: the entries' tokens in order, an
     * entry that does not fit whole going on in the next pass. */
    const uint32_t C = m->max_chunk;
    uint32_t i = 0, off = 0;
    while (i < n) {
        m->nseg = m->rows = m->nhead = 0;
        while (i < n && m->rows < C) {
            const k3_model_seq *x = &q[i];
            uint32_t k = x->n - off < C - m->rows ? x->n - off : C - m->rows;
            if (k) {
                k3_seg *sg = &m->segs[m->nseg];
                sg->s = x->s;
                sg->row = m->rows;
                sg->n = k;
                for (uint32_t t = 0; t < k; t++) {
                    m->ids[m->rows + t] = x->ids[off + t];
                    m->rowseg[m->rows + t] = m->nseg;
                }
                if (x->logits == K3_LOGITS_LAST && off + k == x->n) {
                    m->head_row[m->nhead] = m->rows + k - 1;
                    m->head_dst[m->nhead++] = x->out;
                } else if (x->logits == K3_LOGITS_ALL) {
                    for (uint32_t t = 0; t < k; t++) {
                        m->head_row[m->nhead] = m->rows + t;
                        m->head_dst[m->nhead++] = x->out ? x->out + (uint64_t)(off + t) * d->V : NULL;
                    }
                }
                m->nseg++;
                m->rows += k;
                off += k;
            }
            if (off == x->n) {
                i++;
                off = 0;
            }
        }
        if (m->rows == 0)
            break;
        int rc = forward_pass(m, e);
        if (rc < 0)
            return rc;
    }
    return 0;
}

/* ------------------------------------------------------ over several ranks */

void k3_model_dist_id_set(k3_model *m, uint32_t id) { m->dist_id = id; }
void k3_sess_dist_id_set(k3_sess *s, uint32_t id) { s->dist_id = id; }

int k3_model_agree(k3_model *m, int code, k3_err *e)
{
    return m->dist ? k3_dist_agree(m->dist, code, e, 0, NULL, e) : code;
}

int k3_model_dist_experts(k3_model *m, uint32_t T, int code, k3_err *e)
{
    k3_dist *d = m->dist;
    const uint32_t N = d->size, K = m->d.TOPK, LAT = m->d.LAT;
    const uint64_t TK = (uint64_t)T * K, row = LAT * sizeof(float);
    uint64_t n[K3_DIST_MAX_RANKS] = {0};
    float *mine = (float *)(m->dsend + sizeof(k3_dist_status));
    for (uint64_t i = 0; i < TK; i++) {
        const uint32_t q = k3_dist_expert_rank(m->rsel[i], N);
        if (q == d->rank && code == 0)
            memcpy(mine + n[q] / sizeof(float), m->mout + i * LAT, row);
        n[q] += row;
    }
    d->st.expert_gathers++;
    int rc = k3_dist_gather(d, code, e, m->dsend, n, m->drecv, m->dparts, e);
    if (rc < 0)
        return rc;
    const float *src[K3_DIST_MAX_RANKS];
    for (uint32_t q = 0; q < N; q++)
        src[q] = m->dparts[q];
    for (uint64_t i = 0; i < TK; i++) {
        const uint32_t q = k3_dist_expert_rank(m->rsel[i], N);
        if (q != d->rank)
            memcpy(m->mout + i * LAT, src[q], row);
        src[q] += LAT;
    }
    return 0;
}

int k3_model_forward(k3_model *m, k3_sess *s, const uint32_t *ids, uint32_t n, int logits_mode, float *logits,
                     k3_err *e)
{
    k3_model_seq q = {s, ids, n, logits_mode, logits};
    return k3_model_forward_batch(m, &q, 1, e);
}
