/*
 * t_probe.c - the prompt side of k3-run --plan --probe: the experts a
 * prompt's passes need (the routed union, the cold first pass, an LRU that
 * the pass's own misses can empty), the bound each prediction names, and on
 * a model where the routing estimate is exact (k3-synth --sparse-live: every
 * layer routes a multiple of the embedding) the experts the probe predicts
 * are the records the run asks for.
 */
#include "k3_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../runtime/probe.h"

/* 3 layers, the first dense: 2 MoE layers of 8 experts, top 2. Every
 * product costs 1 ns per byte whatever its rows; records of 1000 bytes. */
static void fake(k3_cfg *c, k3_probe *p)
{
    memset(c, 0, sizeof *c);
    c->num_hidden_layers = 3;
    c->first_k_dense_replace = 1;
    c->num_experts = 8;
    c->num_experts_per_token = 2;
    c->hidden_size = 64;
    c->vocab_size = 16;
    memset(p, 0, sizeof *p);
    p->rec_bytes = 1000;
    p->trunk_bps = p->expert_bps = 1e6;
    for (int i = 0; i < K3_PROBE_NT; i++)
        p->bf16_s[i] = p->mx_s[i] = 1e-9;
}

/* 4 ids routed to experts 1 and 2 in the one sampled layer of the two */
static uint32_t fake_sel[8] = {1, 2, 2, 1, 1, 2, 2, 1};
static const k3_probe_routes fake_routes = {
    .n_ids = 4, .top_k = 2, .num_experts = 8, .n_moe = 2, .n_layers = 1, .sel = fake_sel};

/* A plan of 4 groups, the head pinned (nothing skipped when a pass asks no
 * logits), one expert slot a layer (every request misses), 1 MB of trunk of
 * which `streamed` bytes go through the ring. */
static void fake_plan(k3_stream_plan *pl, uint64_t streamed)
{
    memset(pl, 0, sizeof *pl);
    pl->ngroups = 4;
    pl->expert_slots = 2;
    pl->trunk_total = 1000000;
    pl->trunk_streamed = streamed;
    pl->pinned[3] = 1;
}

K3_TEST(probe_prompt_experts_are_the_routed_union_read_cold_then_cached)
{
    k3_cfg c;
    k3_probe p;
    fake(&c, &p);
    /* one layer of the two sampled; 4 ids, all routed to experts 1 and 2 */
    uint32_t sel[8] = {1, 2, 2, 1, 1, 2, 2, 1};
    k3_probe_routes r = {.n_ids = 4, .top_k = 2, .num_experts = 8, .n_moe = 2, .n_layers = 1, .sel = sel};
    k3_probe_xcost x;
    /* passes of 2: 2 records per pass and layer, scaled to both layers */
    k3_probe_prompt_experts(&p, &c, &r, 4, 2, 8, &x);
    CHECK_EQ_INT(x.passes, 2);
    CHECK(fabs(x.records - 8) < 1e-9);
    CHECK(fabs(x.misses - 4) < 1e-9);   /* the first pass reads both, the second finds them */
    CHECK(fabs(x.compute_s - 8 * 1000e-9) < 1e-12);
    /* one slot per layer: each request evicts the other record */
    k3_probe_prompt_experts(&p, &c, &r, 4, 2, 2, &x);
    CHECK(fabs(x.misses - 8) < 1e-9);
    /* one pass of 4: 2 records per layer, all read (the cache starts empty) */
    k3_probe_prompt_experts(&p, &c, &r, 4, 4, 1000, &x);
    CHECK_EQ_INT(x.passes, 1);
    CHECK(fabs(x.records - 4) < 1e-9);
    CHECK(fabs(x.misses - 4) < 1e-9);

    /* passes that ask for experts 0-3 twice through 2 slots a layer: the
       second pass's misses of 0 and 1 evict 2 and 3 before they are asked
       for, so nothing hits (what the state before the pass would not say) */
    uint32_t s2[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    r.sel = s2;
    k3_probe_prompt_experts(&p, &c, &r, 4, 2, 4, &x);
    CHECK(fabs(x.records - 16) < 1e-9);
    CHECK(fabs(x.misses - 16) < 1e-9);
    k3_probe_prompt_experts(&p, &c, &r, 4, 2, 8, &x);   /* 4 slots a layer: the second pass hits all */
    CHECK(fabs(x.misses - 8) < 1e-9);

    /* no routes: independent, 8 (1 - (3/4)^2) = 3.5 per layer and pass; the
       first pass misses all, the second hits the cache's share (8 of 16) */
    k3_probe_prompt_experts(&p, &c, NULL, 4, 2, 8, &x);
    CHECK(fabs(x.records - 14) < 1e-9);
    CHECK(fabs(x.misses - 10.5) < 1e-9);
}

K3_TEST(probe_predict_adds_reads_and_products_and_names_the_largest)
{
    k3_cfg c;
    k3_probe p;
    fake(&c, &p);
    const k3_probe_routes r = fake_routes;
    k3_stream_plan pl;
    fake_plan(&pl, 0);
    k3_probe_pred q;
    /* one pass of 4: 4 records read at 1 MB/s = 4 ms; products 1 ms trunk + 4 us experts */
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &q);
    CHECK_EQ_INT(q.passes, 1);
    CHECK(fabs(q.experts_per_pass - 4) < 1e-9);
    CHECK(fabs(q.prompt_io - 4e-3 / 4) < 1e-12);
    CHECK(fabs(q.prompt_compute - (1e-3 + 4e-6) / 4) < 1e-12);
    CHECK_EQ_INT(q.prompt_bound, K3_PROBE_DISK);
    CHECK(fabs(q.prompt_s - q.prompt_io - q.prompt_compute) < 1e-15);
    /* products at 64 rows cost 64x the bytes of 1: compute, not memory */
    for (int i = 0; i < K3_PROBE_NT; i++)
        p.bf16_s[i] = p.mx_s[i] = 1e-9 * (1 << i);
    pl.trunk_total = 100000000;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &q);
    CHECK_EQ_INT(q.prompt_bound, K3_PROBE_COMPUTE);
    CHECK_EQ_INT(q.decode_bound, K3_PROBE_MEMORY);   /* one row: the weights' streaming is all of it */
    CHECK_STR_EQ(k3_probe_bound_name(q.prompt_bound), "compute");
}

/* Every byte read is CRC'd on the cores the products run on: its CPU time,
 * times the share the products wait for, is charged to compute (prompt and
 * decode), the trunk's part not with --no-trunk-crc; the bound still weighs
 * the products alone against the reads. */
K3_TEST(probe_predict_charges_the_crc_of_every_byte_read)
{
    k3_cfg c;
    k3_probe p;
    fake(&c, &p);
    const k3_probe_routes r = fake_routes;
    k3_stream_plan pl;
    fake_plan(&pl, 500000);
    k3_probe_pred a, b, d;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &a);
    p.crc_s = 1e-9;
    p.crc_share = 0.5;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &b);
    /* prompt: one pass reads the streamed trunk and 4 records of 1000 bytes */
    CHECK(fabs(b.prompt_compute - a.prompt_compute - (500000 + 4000) * 0.5e-9 / 4) < 1e-15);
    CHECK(fabs(b.prompt_io - a.prompt_io) < 1e-15);
    /* decode: the trunk and the k records of each of the 2 MoE layers (one
     * slot a layer holds expert 2, half the prompt's routes: half miss) */
    CHECK(fabs(b.decode_compute - a.decode_compute - (500000 + 2 * 2 * 1000 * 0.5) * 0.5e-9) < 1e-15);
    CHECK_EQ_INT(b.decode_bound, a.decode_bound);
    p.no_trunk_crc = 1;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &d);
    CHECK(fabs(d.decode_compute - a.decode_compute - 2 * 2 * 1000 * 0.5 * 0.5e-9) < 1e-15);
    CHECK(fabs(d.prompt_compute - a.prompt_compute - 4000 * 0.5e-9 / 4) < 1e-15);
}

/* Decode hits the records the prompt's passes leave in the cache, weighted
 * by how often the prompt routed to each, times one less the share of its
 * routes whose expert it used once (the chance a decode route is new);
 * without routes, the cache's share of all records. */
K3_TEST(probe_decode_hits_what_the_prompt_leaves_weighted_by_its_routes)
{
    k3_cfg c;
    k3_probe p;
    fake(&c, &p);
    k3_stream_plan pl;
    fake_plan(&pl, 0);
    pl.expert_slots = 8;   /* 4 a layer */
    uint32_t sel[8] = {1, 2, 2, 1, 1, 2, 2, 1};
    k3_probe_routes r = {.n_ids = 4, .top_k = 2, .num_experts = 8, .n_moe = 2, .n_layers = 1, .sel = sel};
    k3_probe_pred q;
    /* every id routes to experts 1 and 2, both held: decode reads nothing */
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &q);
    CHECK(fabs(q.decode_hit - 1) < 1e-12);
    CHECK(fabs(q.decode_io) < 1e-15);
    /* every route a new expert: nothing says decode will come back to one */
    uint32_t fresh[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    r.sel = fresh;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &q);
    CHECK(fabs(q.decode_hit) < 1e-12);
    CHECK(fabs(q.decode_io - 2 * 2 * 1000 / 1e6) < 1e-15);
    /* experts 1 (3 routes), 2 (2), 3, 4, 5 (1 each), asked in that order
     * through 4 slots: 5 evicts 1. Held: 2 + 1 + 1 + 1 = 5 of 8 routes;
     * 3 of 8 routes are to experts used once */
    uint32_t mixed[8] = {1, 2, 1, 3, 1, 2, 4, 5};
    r.sel = mixed;
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &q);
    CHECK(fabs(q.decode_hit - (1 - 3.0 / 8) * 5.0 / 8) < 1e-12);
    CHECK(fabs(q.decode_io - 2 * 2 * (1 - q.decode_hit) * 1000 / 1e6) < 1e-15);
    /* no routes: the cache's share of all records, 8 of 16 */
    k3_probe_predict(&p, &c, &pl, 4, 4, NULL, &q);
    CHECK(fabs(q.decode_hit - 0.5) < 1e-12);
}

/* What the layers compute besides products, per pass of C rows at
 * positions p0 ..: C a + b S per layer of its kind, S the positions the rows
 * attend to; a chunk the probe did not time costs nothing. */
K3_TEST(probe_predict_adds_the_rest_of_each_layer_by_kind_and_context)
{
    k3_cfg c;
    k3_probe p;
    fake(&c, &p);
    c.is_mla[1] = 1;   /* layers 0 and 2 KDA, 1 MLA */
    const k3_probe_routes r = fake_routes;
    k3_stream_plan pl;
    fake_plan(&pl, 0);
    k3_probe_pred a, b, d;
    k3_probe_predict(&p, &c, &pl, 2, 4, &r, &a);
    p.rest[0] = (k3_probe_rest){.chunk = 2, .a = {1e-3, 2e-3}, .b = {0, 1e-5}};
    p.rest[1] = (k3_probe_rest){.chunk = 1, .a = {3e-3, 4e-3}, .b = {0, 1e-5}};
    p.n_rest = 2;
    k3_probe_predict(&p, &c, &pl, 2, 4, &r, &b);
    /* passes at positions 0-1 (S = 3) and 2-3 (S = 7): KDA 2 layers x 2
     * passes x 2 rows x 1 ms, MLA 2 x 2 x 2 ms + 1e-5 x 10 */
    const double rest = 8e-3 + 8e-3 + 1e-4;
    CHECK(fabs(b.prompt_rest - rest / 4) < 1e-15);
    CHECK(fabs(b.prompt_compute - a.prompt_compute - rest / 4) < 1e-15);
    CHECK(fabs(b.prompt_io - a.prompt_io) < 1e-15);
    /* decode: one row after the 4 ids (S = 5), at the one-row rates */
    CHECK(fabs(b.decode_compute - a.decode_compute - (2 * 3e-3 + 4e-3 + 5e-5)) < 1e-15);
    k3_probe_predict(&p, &c, &pl, 4, 4, &r, &d);   /* passes of 4: not timed */
    CHECK(d.prompt_rest == 0);
}

/* The rest is timed on models in memory, once per distinct chunk. */
K3_TEST(probe_rest_times_each_distinct_chunk_and_both_kinds)
{
    k3_cfg c;
    memset(&c, 0, sizeof c);
    c.hidden_size = 64; c.num_hidden_layers = 2; c.vocab_size = 97; c.rms_norm_eps = 1e-5;
    c.kda_num_heads = 2; c.kda_head_dim = 16; c.short_conv_kernel_size = 4; c.gate_lower_bound = -5.0;
    c.num_attention_heads = 2; c.q_lora_rank = 32; c.kv_lora_rank = 32; c.qk_nope_head_dim = 16;
    c.qk_rope_head_dim = 8; c.v_head_dim = 16; c.mla_use_output_gate = 1;
    c.num_experts = 8; c.num_experts_per_token = 3; c.num_shared_experts = 1;
    c.routed_expert_hidden_size = 32; c.moe_intermediate_size = 64; c.routed_scaling_factor = 1.0;
    c.moe_renormalize = 1; c.latent_moe_use_norm = 1; c.first_k_dense_replace = 1;
    c.intermediate_size = 96; c.attn_res_block_size = 2; c.situ_beta = 4.0; c.situ_linear_beta = 25.0;
    c.group_size = 32;
    c.is_mla[1] = 1;
    k3_probe p;
    memset(&p, 0, sizeof p);
    const uint32_t chunks[] = {1, 8, 0, 8, 1};
    k3_err e = {0};
    CHECK_EQ_INT(k3_probe_rest_run(&c, chunks, 5, &p, &e), 0);
    CHECK_EQ_INT(p.n_rest, 2);
    CHECK_EQ_INT(p.rest[0].chunk, 1);
    CHECK_EQ_INT(p.rest[1].chunk, 8);
    for (uint32_t k = 0; k < 2; k++)
        for (int m = 0; m < 2; m++) {
            CHECK(p.rest[k].a[m] > 0 && p.rest[k].a[m] < 1);
            CHECK(p.rest[k].b[m] >= 0 && p.rest[k].b[m] < 1);
        }
}

/* On a --sparse-live model the estimate is exact: the experts per pass the
 * probe prints are the records the run asks for (one pass, cold cache). */
K3_TEST(probe_routes_match_the_run_on_a_sparse_live_model)
{
    char up[4096], pk[4096], *out = NULL, *err = NULL;
    snprintf(up, sizeof up, "%s/up", k3t_tmpdir());
    snprintf(pk, sizeof pk, "%s/pk", k3t_tmpdir());
    CHECK_EQ_INT(k3t_runf(NULL, NULL, "k3-synth %s --preset tiny --sparse-live --layers 5 --quiet && k3-convert --quiet %s %s",
                          up, up, pk), 0);
    const char *ids = "5,6,7,8,9,10,11,12,13,14,40,41,42,43";
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids %s --gen 1 --ram floor --json", pk, ids), 0);
    const char *q = out ? strstr(out, "\"prompt\":{") : NULL;
    q = q ? strstr(q, "\"expert_requests\":") : NULL;
    CHECK(q != NULL);
    long asked = q ? strtol(q + strlen("\"expert_requests\":"), NULL, 10) : -1;
    free(out);
    free(err);
    CHECK_EQ_INT(k3t_runf(&out, &err, "k3-run %s --ids %s --ram floor --plan --probe", pk, ids), 0);
    CHECK_STR_CONTAINS(err, "probe: routes of the 14 prompt ids by the routers of 4 of 4 MoE layers");
    char want[128];
    snprintf(want, sizeof want, "    64 %6ld ", asked);
    CHECK_STR_CONTAINS(err, want);   /* floor row: chunk 64, one pass, experts */
    free(out);
    free(err);
}
