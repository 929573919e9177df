/*
 * k3_cfg.h - the model configuration (docs/MODEL.md §1.1) and its layer map (§1.2).
 *
 * k3_cfg_parse reads an upstream config.json in either shape and reports
 * every missing required field in one message. Where fields are looked for:
 * - nested: if the root has "text_config" (an object), fields are read from
 *   text_config and text_config.linear_attn_config (or, if text_config has
 *   none, the root's linear_attn_config), and not from the root itself;
 * - flat: from the root and, if present, root.linear_attn_config.
 * Spellings accepted (flat spelling first; each is searched in both places
 * unless marked):
 *   kda_num_heads | linear_attn_config.num_heads (only there)
 *   kda_head_dim  | linear_attn_config.head_dim  (only there)
 *   num_experts | n_routed_experts      num_experts_per_token | num_experts_per_tok
 *   num_shared_experts | n_shared_experts      moe_renormalize | norm_topk_prob
 *   situ_beta | activation_situ_beta    situ_linear_beta | activation_situ_linear_beta
 *   full_attn_layers and/or kda_layers (one-based; if both, complementary)
 *   quantization_config.group_size (text_config's, else the root's; optional,
 *   must be 32)
 * A field given under two spellings or in two places must have one value.
 * A JSON null counts as absent. Unknown fields are ignored. Defaults exist
 * only for mla_use_output_gate, moe_renormalize, latent_moe_use_norm (true)
 * and group_size (32).
 *
 * Bounds (k3_cfg_validate): every width and count in [1, 2^24] (qk_nope/
 * qk_rope_head_dim, num_shared_experts, first_k_dense_replace and
 * intermediate_size may be 0; intermediate_size only with no dense layer),
 * num_hidden_layers <= K3_CFG_MAX_LAYERS, top-k <= num_experts,
 * routed_expert_hidden_size and moe_intermediate_size multiples of 32 (the
 * MXFP4 group runs along the inputs of W1/W3 and of W2), first_k_dense_replace
 * <= layers, 0 < rms_norm_eps < 1, gate_lower_bound < 0, positive
 * routed_scaling_factor and SiTU caps.
 *
 * The normalised form written by k3_cfg_to_json is flat and is what a packed
 * model's manifest carries: every field in its flat spelling, doubles in the
 * shortest form that reads back exactly, full_attn_layers one-based, and
 * "quantization_config": {"group_size": 32}.
 */
#ifndef K3_CFG_H
#define K3_CFG_H

#include <stdint.h>

#include "k3_err.h"

#define K3_CFG_MAX_LAYERS 1024

typedef struct k3_cfg {
    uint32_t hidden_size;             /* E */
    uint32_t num_hidden_layers;
    uint32_t vocab_size;              /* V */
    double rms_norm_eps;
    uint32_t kda_num_heads;           /* H */
    uint32_t kda_head_dim;            /* D */
    uint32_t short_conv_kernel_size;
    double gate_lower_bound;
    uint32_t num_attention_heads;     /* MLA heads */
    uint32_t q_lora_rank;
    uint32_t kv_lora_rank;
    uint32_t qk_nope_head_dim;
    uint32_t qk_rope_head_dim;
    uint32_t v_head_dim;
    int mla_use_output_gate;          /* default 1 */
    uint32_t num_experts;
    uint32_t num_experts_per_token;   /* top-k */
    uint32_t num_shared_experts;
    uint32_t routed_expert_hidden_size; /* L */
    uint32_t moe_intermediate_size;   /* I */
    double routed_scaling_factor;
    int moe_renormalize;              /* default 1 */
    int latent_moe_use_norm;          /* default 1 */
    uint32_t first_k_dense_replace;
    uint32_t intermediate_size;       /* dense MLP inner width */
    uint32_t attn_res_block_size;     /* B */
    double situ_beta;                 /* b1 */
    double situ_linear_beta;          /* b2 */
    uint32_t group_size;              /* MXFP4 group, always 32 */
    /* Layer map, derived: is_mla[L] for zero-based L. */
    uint8_t is_mla[K3_CFG_MAX_LAYERS];
} k3_cfg;

/* Parse config.json text (len bytes, need not be NUL-terminated; at most
 * 16 MiB; valid UTF-8; JSON nested at most 1000 levels). path is used in
 * messages ("PATH: text_config.num_experts must be an integer, ..."). Returns
 * 0, K3_EFORMAT or K3_ELIMIT. On error *cfg is unspecified. */
int k3_cfg_parse(k3_cfg *cfg, const char *json, uint64_t len, const char *path, k3_err *e);

/* Read and parse DIR/config.json, or the file at path. */
int k3_cfg_load(k3_cfg *cfg, const char *path, k3_err *e);

/* Structural validation (indices in range, top-k <= experts, MXFP4 widths
 * divisible by 32, ...). k3_cfg_parse already calls it. */
int k3_cfg_validate(const k3_cfg *cfg, const char *path, k3_err *e);

/* The normalised flat config as a JSON text (heap, caller frees; NULL if out
 * of memory), with full_attn_layers as one-based indices. Parsing it gives an
 * equal k3_cfg. */
char *k3_cfg_to_json(const k3_cfg *cfg);

/* Layer kinds. */
static inline int k3_cfg_layer_is_mla(const k3_cfg *c, uint32_t layer) { return c->is_mla[layer]; }
static inline int k3_cfg_layer_is_dense(const k3_cfg *c, uint32_t layer) { return layer < c->first_k_dense_replace; }

#endif
