/*
 * t_model.c - the forward pass on in-memory random models (no files): the
 * determinism gates that need no reference. Gate 3: decoding token by token
 * gives bit-identical logits to recomputing the prefix; Gate 4: every chunk
 * size gives bit-identical logits; and the same for every thread count. Also
 * the kernel property they rest on: a product's row for one vector does not
 * depend on how many vectors are in the call.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "k3_gen.h"
#include "k3_kern.h"
#include "k3_model.h"
#include "k3_test.h"
#include "k3_ws.h"

static void tiny_cfg(k3_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->hidden_size = 64; c->num_hidden_layers = 6; c->vocab_size = 97; c->rms_norm_eps = 1e-5;
    c->kda_num_heads = 2; c->kda_head_dim = 16; c->short_conv_kernel_size = 4; c->gate_lower_bound = -5.0;
    c->num_attention_heads = 2; c->q_lora_rank = 32; c->kv_lora_rank = 32; c->qk_nope_head_dim = 16;
    c->qk_rope_head_dim = 8; c->v_head_dim = 16; c->mla_use_output_gate = 1;
    c->num_experts = 8; c->num_experts_per_token = 3; c->num_shared_experts = 1;
    c->routed_expert_hidden_size = 32; c->moe_intermediate_size = 64; c->routed_scaling_factor = 1.0;
    c->moe_renormalize = 1; c->latent_moe_use_norm = 1; c->first_k_dense_replace = 1;
    c->intermediate_size = 96; c->attn_res_block_size = 2; c->situ_beta = 4.0; c->situ_linear_beta = 25.0;
    c->group_size = 32;
    c->is_mla[2] = 1; c->is_mla[4] = 1; c->is_mla[5] = 1;
}

#define MODEL_LOGITS_HASH 0x2086ede4c1289ce1ull

static uint32_t ids32[32] = {5, 17, 3, 88, 42, 42, 9, 0, 96, 61, 23, 7, 7, 7, 50, 11,
                             2, 33, 70, 1, 90, 15, 44, 28, 63, 81, 19, 4, 36, 55, 12, 8};

/* All 32 positions' logits with the given chunk size. */
static float *run_all(k3_ws *ws, uint32_t chunk, uint32_t n)
{
    k3_err e = {0};
    k3_model *m;
    k3_sess *s;
    k3_model_opts o = {chunk};
    CHECK_EQ_INT(k3_model_open(&m, ws, &o, &e), 0);
    CHECK_EQ_INT(k3_sess_create(&s, m, 64, &e), 0);
    float *lg = malloc((size_t)n * 97 * sizeof(float));
    CHECK(lg != NULL);
    int rc = k3_model_forward(m, s, ids32, n, K3_LOGITS_ALL, lg, &e);
    if (rc)
        fprintf(stderr, "%s\n", e.msg);
    CHECK_EQ_INT(rc, 0);
    CHECK_EQ_INT(k3_sess_pos(s), n);
    k3_sess_free(s);
    k3_model_close(m);
    return lg;
}

static k3_ws *tiny_ws(void)
{
    k3_cfg c;
    tiny_cfg(&c);
    k3_ws *ws;
    k3_err e = {0};
    CHECK_EQ_INT(k3_ws_mem_create(&ws, &c, 1234, &e), 0);
    return ws;
}

K3_TEST(model_logits_are_finite_and_depend_on_the_input)
{
    k3_ws *ws = tiny_ws();
    float *lg = run_all(ws, 64, 32);
    float spread = 0;
    for (uint32_t i = 0; i < 32 * 97; i++) {
        CHECK(isfinite(lg[i]));
        spread = fmaxf(spread, fabsf(lg[i] - lg[i % 97]));
    }
    CHECK(spread > 1e-3f);
    free(lg);
    k3_ws_close(ws);
}

K3_TEST(model_chunk_size_changes_no_logit_bit)
{
    k3_ws *ws = tiny_ws();
    float *a = run_all(ws, 64, 32), *b = run_all(ws, 7, 32), *c = run_all(ws, 1, 32);
    CHECK(memcmp(a, b, 32 * 97 * sizeof(float)) == 0);
    CHECK(memcmp(a, c, 32 * 97 * sizeof(float)) == 0);
    free(a); free(b); free(c);
    k3_ws_close(ws);
}

/* The logits' bits are pinned: the tiny model's 32 positions hash to one
 * value on every architecture, kernel path and build. The determinism gates
 * above hold for any fixed order of the sums; this one also catches a
 * change of order that every path would share (an attention dot summed in
 * another tree, say), which moves the numbers a saved state or a reference
 * was made with. A change that moves a bit on purpose changes the constant. */
K3_TEST(model_logits_bits_are_pinned)
{
    k3_ws *ws = tiny_ws();
    float *a = run_all(ws, 64, 32);
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < 32 * 97; i++) {
        uint32_t u;
        memcpy(&u, &a[i], sizeof u);
        for (int b = 0; b < 4; b++) {
            h ^= (u >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    }
    if (h != MODEL_LOGITS_HASH)
        k3t_fail(__FILE__, __LINE__, "the tiny model's logits changed: hash 0x%016llx", (unsigned long long)h);
    free(a);
    k3_ws_close(ws);
}

K3_TEST(model_thread_count_changes_no_logit_bit)
{
    k3_ws *ws = tiny_ws();
    /* every loop threaded (threshold 0: outer loops parallel, inner ones
     * nested), then the default threshold (small loops serial, so a
     * parallel inner reduction would show) */
    static const uint64_t thresholds[2] = {0, 1u << 16};
    for (int k = 0; k < 2; k++) {
        k3_model_set_parallel_threshold(thresholds[k]);
        omp_set_num_threads(1);
        float *a = run_all(ws, 7, 32);
        omp_set_num_threads(2);
        float *b = run_all(ws, 7, 32);
        omp_set_num_threads(3);
        float *c = run_all(ws, 7, 32);
        CHECK(memcmp(a, b, 32 * 97 * sizeof(float)) == 0);
        CHECK(memcmp(a, c, 32 * 97 * sizeof(float)) == 0);
        free(a); free(b); free(c);
    }
    k3_ws_close(ws);
}

K3_TEST(model_incremental_decode_matches_recomputing_the_prefix)
{
    k3_ws *ws = tiny_ws();
    float *all = run_all(ws, 64, 32);
    k3_err e = {0};
    k3_model *m;
    k3_sess *s, *s2;
    k3_model_opts o = {16};
    CHECK_EQ_INT(k3_model_open(&m, ws, &o, &e), 0);
    CHECK_EQ_INT(k3_sess_create(&s, m, 32, &e), 0);
    CHECK_EQ_INT(k3_sess_create(&s2, m, 32, &e), 0);
    float lg[97];
    /* prompt of 5, then one token at a time */
    CHECK_EQ_INT(k3_model_forward(m, s, ids32, 5, K3_LOGITS_LAST, lg, &e), 0);
    CHECK(memcmp(lg, all + 4 * 97, sizeof lg) == 0);
    for (uint32_t i = 5; i < 32; i++) {
        CHECK_EQ_INT(k3_model_forward(m, s, ids32 + i, 1, K3_LOGITS_LAST, lg, &e), 0);
        CHECK(memcmp(lg, all + (size_t)i * 97, sizeof lg) == 0);
        /* and a fresh session recomputing the whole prefix */
        if (i % 9 == 0) {
            float lg2[97];
            k3_sess_reset(s2);
            CHECK_EQ_INT(k3_model_forward(m, s2, ids32, i + 1, K3_LOGITS_LAST, lg2, &e), 0);
            CHECK(memcmp(lg, lg2, sizeof lg) == 0);
        }
    }
    /* full context is refused, not overrun */
    CHECK_EQ_INT(k3_model_forward(m, s, ids32, 1, K3_LOGITS_LAST, lg, &e), K3_ELIMIT);
    k3_sess_free(s);
    k3_sess_free(s2);
    k3_model_close(m);
    free(all);
    k3_ws_close(ws);
}

K3_TEST(model_rejects_out_of_range_token_ids)
{
    k3_ws *ws = tiny_ws();
    k3_err e = {0};
    k3_model *m;
    k3_sess *s;
    CHECK_EQ_INT(k3_model_open(&m, ws, NULL, &e), 0);
    CHECK_EQ_INT(k3_sess_create(&s, m, 8, &e), 0);
    uint32_t bad[2] = {3, 97};
    float lg[97];
    CHECK_EQ_INT(k3_model_forward(m, s, bad, 2, K3_LOGITS_LAST, lg, &e), K3_EARG);
    CHECK_STR_CONTAINS(e.msg, "out of range");
    k3_sess_free(s);
    k3_model_close(m);
    k3_ws_close(ws);
}

K3_TEST(kernel_row_results_do_not_depend_on_the_batch)
{
    enum { R = 70, C = 96, T = 9 };
    uint16_t *w = malloc(R * C * 2);
    float *wf = malloc(R * C * 4), *x = malloc(T * C * 4), *y = malloc(T * R * 4), *y1 = malloc(R * 4);
    uint8_t *p = malloc(R * C / 2), *sc = malloc(R * C / 32);
    uint64_t st = 99;
    for (int i = 0; i < R * C; i++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        wf[i] = (float)((double)(st >> 11) * 0x1.0p-53 - 0.5);
        w[i] = k3_f32_to_bf16(wf[i]);
    }
    for (int i = 0; i < T * C; i++)
        x[i] = sinf((float)i * 0.37f);
    k3_mx_quantize(wf, R * C, p, sc);
    k3_gemm_bf16(w, R, C, x, T, y);
    for (int t = 0; t < T; t++) {
        k3_gemm_bf16(w, R, C, x + t * C, 1, y1);
        CHECK(memcmp(y1, y + t * R, R * 4) == 0);
        k3_gemm_bf16_st(w, R, C, x + t * C, 1, y1);
        CHECK(memcmp(y1, y + t * R, R * 4) == 0);
    }
    k3_gemm_mx(p, sc, R, C, x, T, y);
    for (int t = 0; t < T; t++) {
        k3_gemm_mx(p, sc, R, C, x + t * C, 1, y1);
        CHECK(memcmp(y1, y + t * R, R * 4) == 0);
        k3_gemm_mx_st(p, sc, R, C, x + t * C, 1, y1);
        CHECK(memcmp(y1, y + t * R, R * 4) == 0);
    }
    free(w); free(wf); free(x); free(y); free(y1); free(p); free(sc);
}

K3_TEST(gen_stops_at_an_end_of_sequence_id_and_reports_it)
{
    k3_ws *ws = tiny_ws();
    k3_err e = {0};
    k3_model *m;
    k3_sess *s;
    k3_sampler *smp;
    CHECK_EQ_INT(k3_model_open(&m, ws, NULL, &e), 0);
    CHECK_EQ_INT(k3_sess_create(&s, m, 32, &e), 0);
    CHECK_EQ_INT(k3_sampler_create(&smp, 97, 0.0f, 0, 1.0f, 0, &e), 0);
    float lg[97], first[97];
    uint32_t out[8], n = 0;
    k3_gen_stats st;
    k3_gen_opts o = {8, NULL, 0, lg, first, NULL, NULL, NULL, NULL, NULL};
    CHECK_EQ_INT(k3_gen_run(m, s, smp, ids32, 4, &o, out, &n, &st, &e), 0);
    CHECK_EQ_INT(n, 8);
    CHECK_EQ_INT(st.stopped_by_eos, 0);
    /* now with the third greedy token as end-of-sequence */
    uint32_t eos = out[2], out2[8];
    k3_sess_reset(s);
    o.eos = &eos;
    o.n_eos = 1;
    CHECK_EQ_INT(k3_gen_run(m, s, smp, ids32, 4, &o, out2, &n, &st, &e), 0);
    CHECK(n <= 3);
    CHECK_EQ_INT(out2[n - 1], eos);
    CHECK_EQ_INT(st.stopped_by_eos, 1);
    k3_sampler_free(smp);
    k3_sess_free(s);
    k3_model_close(m);
    k3_ws_close(ws);
}

K3_TEST(sampler_greedy_ties_go_to_the_lowest_id_and_seeds_repeat)
{
    k3_err e = {0};
    k3_sampler *g, *a, *b;
    float x[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f};
    CHECK_EQ_INT(k3_sampler_create(&g, 6, 0.0f, 0, 1.0f, 0, &e), 0);
    CHECK_EQ_INT(k3_sampler_next(g, x), 1);
    CHECK_EQ_INT(k3_sampler_create(&a, 6, 1.0f, 0, 1.0f, 77, &e), 0);
    CHECK_EQ_INT(k3_sampler_create(&b, 6, 1.0f, 0, 1.0f, 77, &e), 0);
    int hist[6] = {0};
    for (int i = 0; i < 2000; i++) {
        uint32_t u = k3_sampler_next(a, x), v = k3_sampler_next(b, x);
        CHECK_EQ_INT(u, v);
        hist[u]++;
    }
    /* p = softmax(x): ids 1 and 3 (0.34 each) dominate, id 2 is rare (0.02) */
    CHECK(hist[1] > 550 && hist[1] < 800);
    CHECK(hist[3] > 550 && hist[3] < 800);
    CHECK(hist[2] < 100);
    k3_sampler_free(g);
    k3_sampler_free(a);
    k3_sampler_free(b);
    CHECK(k3_sampler_create(&a, 6, 1.0f, 0, 0.0f, 1, &e) == K3_EARG);
}

/* Draw j depends only on (seed, j): k3_sampler_at in any order gives the ids
 * of successive k3_sampler_next calls, and the ids are the documented ones
 * (x_j = mix64(mix64(77) + (j+1) * golden): u = 0.9151, 0.4427, 0.8752 over
 * the cumulative softmax 0.302 0.604 0.877 0.944 0.985 1 of ids 1 3 4 0 5 2). */
K3_TEST(sampler_draws_are_counter_based)
{
    k3_err e = {0};
    k3_sampler *a, *b;
    float x[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f};
    CHECK_EQ_INT(k3_sampler_create(&a, 6, 1.0f, 0, 1.0f, 77, &e), 0);
    CHECK_EQ_INT(k3_sampler_create(&b, 6, 1.0f, 0, 1.0f, 77, &e), 0);
    CHECK_EQ_INT(k3_sampler_at(b, x, 2), 4);
    CHECK_EQ_INT(k3_sampler_at(b, x, 0), 0);
    CHECK_EQ_INT(k3_sampler_at(b, x, 1), 3);
    CHECK_EQ_INT(k3_sampler_count(b), 0);
    CHECK_EQ_INT(k3_sampler_next(a, x), 0);
    CHECK_EQ_INT(k3_sampler_next(a, x), 3);
    CHECK_EQ_INT(k3_sampler_next(a, x), 4);
    CHECK_EQ_INT(k3_sampler_count(a), 3);
    for (uint64_t j = 0; j < 300; j++) {
        uint32_t want = k3_sampler_next(a, x);
        CHECK_EQ_INT(k3_sampler_at(b, x, j + 3), want);
    }
    k3_sampler_set_count(b, 1);
    CHECK_EQ_INT(k3_sampler_next(b, x), 3);
    k3_sampler_free(a);
    k3_sampler_free(b);
}
