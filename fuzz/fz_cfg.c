/*
 * fz_cfg.c - config.json (k3_cfg_parse, k3_cfg_validate, k3_cfg_to_json).
 *
 * Input: the text of a config.json, nested or flat. An accepted config must
 * validate, have a layer count within K3_CFG_MAX_LAYERS, and survive the round
 * trip the header promises: parsing k3_cfg_to_json's output gives an equal
 * k3_cfg.
 */
#include "k3_fuzz.h"

#include <stdlib.h>
#include <string.h>

#include "k3_cfg.h"

#define CFG_FIELDS(X)                                                                          \
    X(hidden_size) X(num_hidden_layers) X(vocab_size) X(rms_norm_eps) X(kda_num_heads)         \
    X(kda_head_dim) X(short_conv_kernel_size) X(gate_lower_bound) X(num_attention_heads)       \
    X(q_lora_rank) X(kv_lora_rank) X(qk_nope_head_dim) X(qk_rope_head_dim) X(v_head_dim)       \
    X(mla_use_output_gate) X(num_experts) X(num_experts_per_token) X(num_shared_experts)      \
    X(routed_expert_hidden_size) X(moe_intermediate_size) X(routed_scaling_factor)            \
    X(moe_renormalize) X(latent_moe_use_norm) X(first_k_dense_replace) X(intermediate_size)   \
    X(attn_res_block_size) X(situ_beta) X(situ_linear_beta) X(group_size)

static void check_equal(const k3_cfg *a, const k3_cfg *b)
{
#define SAME(f)                                                                                \
    if (a->f != b->f)                                                                          \
        k3_fuzz_fail("config round trip changed " #f ": %.17g -> %.17g", (double)a->f,        \
                     (double)b->f);
    CFG_FIELDS(SAME)
#undef SAME
    for (uint32_t l = 0; l < a->num_hidden_layers; l++)
        if (!a->is_mla[l] != !b->is_mla[l])
            k3_fuzz_fail("config round trip changed the kind of layer %u", l);
}

K3_FUZZ_TARGET(cfg)
{
    k3_cfg *cfg = calloc(2, sizeof *cfg);
    if (!cfg)
        k3_fuzz_fail("out of memory in the harness");
    k3_err e = {0};
    int rc = k3_cfg_parse(&cfg[0], (const char *)data, size, "config.json", &e);
    k3_fuzz_check_result(rc, &e, "k3_cfg_parse");
    if (rc == 0) {
        if (cfg[0].num_hidden_layers == 0 || cfg[0].num_hidden_layers > K3_CFG_MAX_LAYERS)
            k3_fuzz_fail("accepted %u layers", cfg[0].num_hidden_layers);
        rc = k3_cfg_validate(&cfg[0], "config.json", &e);
        if (rc)
            k3_fuzz_fail("k3_cfg_parse accepted what k3_cfg_validate rejects: %s", e.msg);
        char *json = k3_cfg_to_json(&cfg[0]);
        if (!json)
            k3_fuzz_fail("k3_cfg_to_json failed on an accepted config");
        rc = k3_cfg_parse(&cfg[1], json, strlen(json), "normalised config", &e);
        if (rc)
            k3_fuzz_fail("the normalised config does not parse: %s", e.msg);
        check_equal(&cfg[0], &cfg[1]);
        free(json);
    }
    free(cfg);
    return 0;
}
