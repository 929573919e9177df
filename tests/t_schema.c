/*
 * t_schema.c - the tensor schema (common/schema.c) is the one list of K3's
 * tensors: each name is written once in the C sources outside tests/, every
 * slot has one row, the orders are what the model and the checkpoint use,
 * and the model, the in-memory source and the convert/verify expectations
 * agree with it on every config tried. Also: the memory planner's model
 * sizes are the model's own sizing, and that is what open allocates.
 *
 * The PyTorch trainer (train/) is an independent implementation of the
 * model in another language; tests/t_trained.c checks it against k3, and it
 * is not searched here.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_guard.h"
#include "k3_man.h"
#include "k3_plan.h"
#include "k3_model.h"
#include "k3_schema.h"
#include "k3_stream.h"
#include "k3_test.h"
#include "k3_ws.h"

/* Every row's name appears in exactly one C source outside tests/ (the
 * schema's), on as many lines as rows carry it. */
K3_TEST(schema_each_tensor_name_is_written_once_in_the_sources)
{
    uint32_t n;
    const k3_sch_row *rows = k3_schema_rows(&n);
    CHECK_EQ_U64(n, K3_SCH_COUNT);
    char list[768];
    snprintf(list, sizeof list,
             "cd '%s' && { if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git ls-files -z -- '*.c' '*.h'; "
             "else find . -path ./build -prune -o -path ./build-asan -prune -o -path ./build-arm64 -prune "
             "-o -path ./bin -prune -o \\( -name '*.c' -o -name '*.h' \\) -print0; fi; } | "
             "tr '\\0' '\\n' | sed 's|^\\./||' | grep -v '^tests/' | tr '\\n' '\\0'",
             k3t_root());
    char *out = NULL;
    CHECK_EQ_INT(k3t_runf(&out, NULL, "%s | tr -cd '\\0' | wc -c", list), 0);
    CHECK(out && strtoul(out, NULL, 10) > 100);   /* the search below covers the tree */
    free(out);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t same = 0;
        for (uint32_t j = 0; j < n; j++)
            same += !strcmp(rows[i].name, rows[j].name);
        out = NULL;
        k3t_runf(&out, NULL, "%s | xargs -0 grep -c -F -- '%s' | grep -v ':0$' ; true", list, rows[i].name);
        CHECK(out != NULL);
        char want1[128], want2[128];
        snprintf(want1, sizeof want1, "common/schema.c:%u\n", same);
        snprintf(want2, sizeof want2, "include/k3_schema.h:%u\n", same);
        if (strcmp(out, want1) && strcmp(out, want2))
            k3t_fail(__FILE__, __LINE__,
                     "tensor name %s is written outside the schema (or more than once): file:lines =\n%s"
                     "(name tensors through include/k3_schema.h)", rows[i].name, out);
        free(out);
    }
}

/* One row per slot; the checkpoint order is a permutation; the streamable
 * rows are matrices, and k3_stream_piece_slots is them in table order. */
K3_TEST(schema_rows_cover_every_slot_once_and_the_orders_are_permutations)
{
    uint32_t n;
    const k3_sch_row *rows = k3_schema_rows(&n);
    int seen[K3_SCH_COUNT] = {0}, ck[K3_SCH_COUNT] = {0};
    uint32_t nstream = 0;
    for (uint32_t i = 0; i < n; i++) {
        CHECK(rows[i].slot < K3_SCH_COUNT);
        CHECK(rows[i].ck < K3_SCH_COUNT);
        seen[rows[i].slot]++;
        ck[rows[i].ck]++;
        CHECK(k3_schema_row(rows[i].slot) == &rows[i]);
        if (rows[i].stream) {
            CHECK_EQ_INT(rows[i].cls, K3_SCH_MATRIX);
            nstream++;
        }
        CHECK_EQ_INT(rows[i].where == K3_SCH_IN_HEAD, rows[i].slot < K3_W_COUNT && k3_wslot_in_head((k3_wslot)rows[i].slot));
    }
    for (uint32_t s = 0; s < K3_SCH_COUNT; s++) {
        CHECK_EQ_INT(seen[s], 1);
        CHECK_EQ_INT(ck[s], 1);
    }
    CHECK(rows[0].where == K3_SCH_IN_EMBED);
    const k3_wslot *order;
    uint32_t no = k3_stream_piece_slots(&order);
    CHECK_EQ_U64(no, nstream);
    for (uint32_t i = 0, k = 0; i < n; i++)
        if (rows[i].stream) {
            CHECK_EQ_INT(order[k], rows[i].slot);
            k++;
        }
    /* kv_b is read per head inside a parallel loop: never in pieces */
    CHECK(!k3_schema_row(K3_W_MLA_KVB)->stream);
}

static void small_cfg(k3_cfg *c, int variant)
{
    memset(c, 0, sizeof *c);
    c->hidden_size = 64; c->num_hidden_layers = 6; c->vocab_size = 97; c->rms_norm_eps = 1e-5;
    c->kda_num_heads = 2; c->kda_head_dim = 16; c->short_conv_kernel_size = 4; c->gate_lower_bound = -5.0;
    c->num_attention_heads = 2; c->q_lora_rank = 32; c->kv_lora_rank = 32; c->qk_nope_head_dim = 16;
    c->qk_rope_head_dim = 8; c->v_head_dim = 16; c->mla_use_output_gate = variant != 1;
    c->num_experts = 8; c->num_experts_per_token = 3; c->num_shared_experts = variant == 2 ? 0 : 1;
    c->routed_expert_hidden_size = 32; c->moe_intermediate_size = 64; c->routed_scaling_factor = 1.0;
    c->moe_renormalize = 1; c->latent_moe_use_norm = variant != 1; c->first_k_dense_replace = variant == 2 ? 2 : 1;
    c->intermediate_size = 96; c->attn_res_block_size = 2; c->situ_beta = 4.0; c->situ_linear_beta = 25.0;
    c->group_size = 32;
    c->is_mla[2] = 1; c->is_mla[4] = 1; c->is_mla[5] = variant != 2;
}

/* The in-memory source makes exactly the schema's tensors, the model accepts
 * them, and convert/verify expect the same set with the same shapes. */
K3_TEST(schema_sources_model_and_expectations_agree_on_every_config)
{
    for (int variant = 0; variant < 3; variant++) {
        k3_cfg c;
        small_cfg(&c, variant);
        k3_err e = {0};
        k3_ws *ws = NULL;
        CHECK_EQ_INT(k3_ws_mem_create(&ws, &c, 7, &e), 0);
        k3_model *m = NULL;
        CHECK_EQ_INT(k3_model_open(&m, ws, NULL, &e), 0);
        k3_man_expect *x = NULL;
        uint32_t nx = 0;
        CHECK_EQ_INT(k3_man_expect_trunk(&c, &x, &nx, &e), 0);
        uint32_t want = 1;   /* the embedding */
        for (uint32_t g = 0; g <= c.num_hidden_layers; g++)
            for (int s = 0; s < K3_W_COUNT; s++) {
                const k3_sch_row *r = k3_schema_row((uint32_t)s);
                k3_view v;
                k3_err de = {0};
                int has = k3_ws_describe(ws, g, (k3_wslot)s, &v, &de) == 0;
                CHECK_EQ_INT(has, k3_schema_in_group(&c, r, g));
                if (!has)
                    continue;
                want++;
                char name[256];
                k3_schema_name(name, sizeof name, (uint32_t)s, g, 1);
                const k3_man_expect *ex = k3_man_expect_find(x, nx, name);
                CHECK(ex != NULL);
                uint64_t sh[3];
                CHECK_EQ_U64(k3_view_numel(&v), k3_schema_shape(&c, r, sh));
                CHECK_EQ_INT(ex->kind == K3_MAN_T_MATRIX, r->cls == K3_SCH_MATRIX || r->cls == K3_SCH_CONV);
            }
        CHECK_EQ_U64(nx, want);
        k3_man_expect_free(x, nx);
        k3_model_close(m);
        k3_ws_close(ws);
    }
}

/* The planner's model sizes are the model's own (k3_model_mem_need), and
 * those are what k3_model_open and k3_sess_create allocate, byte for byte. */
K3_TEST(schema_planner_model_sizes_are_what_open_and_create_allocate)
{
    const uint32_t nt = (uint32_t)omp_get_max_threads();
    for (int variant = 0; variant < 3; variant++) {
        k3_cfg c;
        small_cfg(&c, variant);
        k3_err e = {0};
        k3_ws *ws = NULL;
        CHECK_EQ_INT(k3_ws_mem_create(&ws, &c, 7, &e), 0);
        k3_model *m = NULL;
        CHECK_EQ_INT(k3_model_open(&m, ws, NULL, &e), 0);   /* first use of the kernels and threads */
        k3_model_close(m);
        static const uint32_t chunks[] = {1, 7, 64}, ctxs[] = {5, 300};
        for (int ci = 0; ci < 3; ci++)
            for (int xi = 0; xi < 2; xi++) {
                k3_model_opts mo = {chunks[ci]};
                k3t_alloc_arm();
                int rc = k3_model_open(&m, ws, &mo, &e);
                k3t_alloc_disarm();
                const uint64_t got_model = k3t_alloc_bytes();
                CHECK_EQ_INT(rc, 0);
                k3_sess *s = NULL;
                k3t_alloc_arm();
                rc = k3_sess_create(&s, m, ctxs[xi], &e);
                k3t_alloc_disarm();
                const uint64_t got_sess = k3t_alloc_bytes();
                CHECK_EQ_INT(rc, 0);
                k3_model_mem need;
                k3_model_mem_need(&c, chunks[ci], ctxs[xi], nt, &need);
                CHECK_EQ_U64(got_model, need.model);
                CHECK_EQ_U64(got_sess, need.kv + need.state + need.scores);
                /* the planner: the same */
                uint64_t scratch, kv, state;
                k3_stream_model_mem(&c, chunks[ci], ctxs[xi], nt, &scratch, &kv, &state);
                CHECK_EQ_U64(scratch, need.model + need.scores);
                CHECK_EQ_U64(kv, need.kv);
                CHECK_EQ_U64(state, need.state);
                k3_sess_free(s);
                k3_model_close(m);
            }
        k3_ws_close(ws);
    }
}
