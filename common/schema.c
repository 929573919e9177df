/*
 * schema.c - the tensor schema of include/k3_schema.h: the one table of the
 * language-model tensors (names per docs/MODEL.md §2.3, shapes per §1.4) and
 * the functions over it.
 *
 * Order of the table: the order the model uses the slots within a group
 * (attention residual and norm, the attention, the MLP residual and norm, the
 * MLP or MoE; the head). k3_stream_piece_slots is its streamable rows in this
 * order. ck: the upstream checkpoint's order (every-layer vectors, the
 * attention, the MLP or MoE; the head), which k3-synth writes.
 */
#include <stdio.h>
#include <string.h>

#include "k3_schema.h"

#define R(slot, where, cls, cond, stream, ck, est, name, nd, d0, d1, d2)                                  \
    {(slot), K3_SCH_IN_##where, K3_SCH_##cls, K3_SCH_##cond, (nd), {K3_SD_##d0, K3_SD_##d1, K3_SD_##d2}, \
     (stream), (ck), (est), (name)}
#define MAT(slot, where, cond, stream, ck, name, r, c) R(slot, where, MATRIX, cond, stream, ck, 2, name, 2, r, c, 1)
#define VEC(slot, where, cond, ck, est, name, n) R(slot, where, VECTOR, cond, 0, ck, est, name, 1, n, 1, 1)

static const k3_sch_row rows[] = {
    MAT(K3_SCH_EMBED, EMBED, ALWAYS, 0, 0, K3_SCH_EMBED_REL, V, E),
    /* every layer: the attention's residual query and norm */
    VEC(K3_W_SA_RES_NORM, EVERY, ALWAYS, 3, 2, "self_attention_res_norm.weight", E),
    VEC(K3_W_SA_RES_PROJ, EVERY, ALWAYS, 4, 2, "self_attention_res_proj.weight", E),
    VEC(K3_W_INPUT_NORM, EVERY, ALWAYS, 1, 2, "input_layernorm.weight", E),
    /* KDA */
    MAT(K3_W_KDA_Q, KDA, ALWAYS, 1, 7, "self_attn.q_proj.weight", P, E),
    MAT(K3_W_KDA_K, KDA, ALWAYS, 1, 8, "self_attn.k_proj.weight", P, E),
    MAT(K3_W_KDA_V, KDA, ALWAYS, 1, 9, "self_attn.v_proj.weight", P, E),
    MAT(K3_W_KDA_G, KDA, ALWAYS, 1, 18, "self_attn.g_proj.weight", P, E),
    MAT(K3_W_KDA_B, KDA, ALWAYS, 1, 15, "self_attn.b_proj.weight", H, E),
    MAT(K3_W_KDA_FA, KDA, ALWAYS, 1, 13, "self_attn.f_a_proj.weight", D, E),
    MAT(K3_W_KDA_FB, KDA, ALWAYS, 1, 14, "self_attn.f_b_proj.weight", P, D),
    R(K3_W_KDA_QCONV, KDA, CONV, ALWAYS, 0, 10, 2, "self_attn.q_conv1d.weight", 3, P, 1, CW),
    R(K3_W_KDA_KCONV, KDA, CONV, ALWAYS, 0, 11, 2, "self_attn.k_conv1d.weight", 3, P, 1, CW),
    R(K3_W_KDA_VCONV, KDA, CONV, ALWAYS, 0, 12, 2, "self_attn.v_conv1d.weight", 3, P, 1, CW),
    R(K3_W_KDA_ALOG, KDA, ALOG, ALWAYS, 0, 16, 4, "self_attn.A_log", 1, H, 1, 1),
    VEC(K3_W_KDA_DTBIAS, KDA, ALWAYS, 17, 4, "self_attn.dt_bias", P),
    VEC(K3_W_KDA_ONORM, KDA, ALWAYS, 19, 2, "self_attn.o_norm.weight", D),
    MAT(K3_W_KDA_O, KDA, ALWAYS, 1, 20, "self_attn.o_proj.weight", E, P),
    /* MLA */
    MAT(K3_W_MLA_QA, MLA, ALWAYS, 1, 21, "self_attn.q_a_proj.weight", QL, E),
    VEC(K3_W_MLA_QA_NORM, MLA, ALWAYS, 22, 2, "self_attn.q_a_layernorm.weight", QL),
    MAT(K3_W_MLA_QB, MLA, ALWAYS, 1, 23, "self_attn.q_b_proj.weight", QB, QL),
    MAT(K3_W_MLA_KVA, MLA, ALWAYS, 1, 24, "self_attn.kv_a_proj_with_mqa.weight", KVA, E),
    VEC(K3_W_MLA_KVA_NORM, MLA, ALWAYS, 25, 2, "self_attn.kv_a_layernorm.weight", KVL),
    /* kv_b is read per head inside a parallel loop: never streamed in pieces */
    MAT(K3_W_MLA_KVB, MLA, ALWAYS, 0, 26, "self_attn.kv_b_proj.weight", KVB, KVL),
    MAT(K3_W_MLA_G, MLA, IF_MLA_GATE, 1, 27, "self_attn.g_proj.weight", HV, E),
    MAT(K3_W_MLA_O, MLA, ALWAYS, 1, 28, "self_attn.o_proj.weight", E, HV),
    /* every layer: the MLP's residual query and norm */
    VEC(K3_W_MLP_RES_NORM, EVERY, ALWAYS, 5, 2, "mlp_res_norm.weight", E),
    VEC(K3_W_MLP_RES_PROJ, EVERY, ALWAYS, 6, 2, "mlp_res_proj.weight", E),
    VEC(K3_W_POST_NORM, EVERY, ALWAYS, 2, 2, "post_attention_layernorm.weight", E),
    /* dense MLP */
    MAT(K3_W_MLP_GATE, DENSE, ALWAYS, 1, 29, "mlp.gate_proj.weight", IDN, E),
    MAT(K3_W_MLP_UP, DENSE, ALWAYS, 1, 30, "mlp.up_proj.weight", IDN, E),
    MAT(K3_W_MLP_DOWN, DENSE, ALWAYS, 1, 31, "mlp.down_proj.weight", E, IDN),
    /* LatentMoE */
    MAT(K3_W_MOE_ROUTER, MOE, ALWAYS, 1, 32, "block_sparse_moe.gate.weight", NE, E),
    VEC(K3_W_MOE_BIAS, MOE, ALWAYS, 33, 4, "block_sparse_moe.gate.e_score_correction_bias", NE),
    MAT(K3_W_MOE_LDOWN, MOE, ALWAYS, 1, 34, "block_sparse_moe.routed_expert_down_proj.weight", LAT, E),
    MAT(K3_W_MOE_SH_GATE, MOE, IF_SHARED, 1, 37, "block_sparse_moe.shared_experts.gate_proj.weight", SH, E),
    MAT(K3_W_MOE_SH_UP, MOE, IF_SHARED, 1, 38, "block_sparse_moe.shared_experts.up_proj.weight", SH, E),
    MAT(K3_W_MOE_SH_DOWN, MOE, IF_SHARED, 1, 39, "block_sparse_moe.shared_experts.down_proj.weight", E, SH),
    VEC(K3_W_MOE_NORM, MOE, IF_MOE_NORM, 36, 2, "block_sparse_moe.routed_expert_norm.weight", LAT),
    MAT(K3_W_MOE_LUP, MOE, ALWAYS, 1, 35, "block_sparse_moe.routed_expert_up_proj.weight", E, LAT),
    /* the head */
    VEC(K3_W_OUT_RES_NORM, HEAD, ALWAYS, 41, 2, "model.output_attn_res_norm.weight", E),
    VEC(K3_W_OUT_RES_PROJ, HEAD, ALWAYS, 42, 2, "model.output_attn_res_proj.weight", E),
    VEC(K3_W_FINAL_NORM, HEAD, ALWAYS, 40, 2, "model.norm.weight", E),
    MAT(K3_W_LM_HEAD, HEAD, ALWAYS, 1, 43, K3_SCH_HEAD_NAME, V, E),
};

#define NROWS (sizeof rows / sizeof rows[0])
_Static_assert(NROWS == K3_SCH_COUNT, "one schema row per slot");

const k3_sch_row *k3_schema_rows(uint32_t *n)
{
    *n = (uint32_t)NROWS;
    return rows;
}

const k3_sch_row *k3_schema_row(uint32_t slot)
{
    for (uint32_t i = 0; i < NROWS; i++)
        if (rows[i].slot == slot)
            return &rows[i];
    return NULL;
}

uint64_t k3_schema_dim(const k3_cfg *c, k3_sch_dim d)
{
    const uint64_t MH = c->num_attention_heads;
    switch (d) {
    case K3_SD_1: return 1;
    case K3_SD_E: return c->hidden_size;
    case K3_SD_V: return c->vocab_size;
    case K3_SD_H: return c->kda_num_heads;
    case K3_SD_D: return c->kda_head_dim;
    case K3_SD_P: return (uint64_t)c->kda_num_heads * c->kda_head_dim;
    case K3_SD_CW: return c->short_conv_kernel_size;
    case K3_SD_QL: return c->q_lora_rank;
    case K3_SD_QB: return MH * ((uint64_t)c->qk_nope_head_dim + c->qk_rope_head_dim);
    case K3_SD_KVA: return (uint64_t)c->kv_lora_rank + c->qk_rope_head_dim;
    case K3_SD_KVL: return c->kv_lora_rank;
    case K3_SD_KVB: return MH * ((uint64_t)c->qk_nope_head_dim + c->v_head_dim);
    case K3_SD_HV: return MH * c->v_head_dim;
    case K3_SD_IDN: return c->intermediate_size;
    case K3_SD_NE: return c->num_experts;
    case K3_SD_LAT: return c->routed_expert_hidden_size;
    case K3_SD_SH: return (uint64_t)c->moe_intermediate_size * c->num_shared_experts;
    case K3_SD_COUNT: break;
    }
    return 0;
}

uint64_t k3_schema_shape(const k3_cfg *c, const k3_sch_row *r, uint64_t shape[3])
{
    uint64_t n = 1;
    for (uint32_t k = 0; k < 3; k++) {
        shape[k] = k < r->ndim ? k3_schema_dim(c, (k3_sch_dim)r->dim[k]) : 0;
        if (k < r->ndim)
            n *= shape[k];
    }
    return n;
}

int k3_schema_cond(const k3_cfg *c, const k3_sch_row *r)
{
    switch (r->cond) {
    case K3_SCH_IF_MLA_GATE: return c->mla_use_output_gate != 0;
    case K3_SCH_IF_MOE_NORM: return c->latent_moe_use_norm != 0;
    case K3_SCH_IF_SHARED: return c->num_shared_experts > 0;
    default: return 1;
    }
}

static int where_in_layer(uint8_t where, int is_mla, int is_dense)
{
    switch (where) {
    case K3_SCH_IN_EVERY: return 1;
    case K3_SCH_IN_KDA: return !is_mla;
    case K3_SCH_IN_MLA: return is_mla;
    case K3_SCH_IN_DENSE: return is_dense;
    case K3_SCH_IN_MOE: return !is_dense;
    default: return 0;
    }
}

int k3_schema_in_group(const k3_cfg *c, const k3_sch_row *r, uint32_t g)
{
    int in = g == c->num_hidden_layers ? r->where == K3_SCH_IN_HEAD
             : g < c->num_hidden_layers
                 ? where_in_layer(r->where, k3_cfg_layer_is_mla(c, g), k3_cfg_layer_is_dense(c, g))
                 : 0;
    return in && k3_schema_cond(c, r);
}

int k3_schema_name(char *buf, size_t cap, uint32_t slot, uint32_t g, int prefixed)
{
    const k3_sch_row *r = k3_schema_row(slot);
    const char *lm = prefixed ? "language_model." : "";
    if (!r)
        return snprintf(buf, cap, "?");
    if (r->where == K3_SCH_IN_HEAD || r->where == K3_SCH_IN_EMBED)
        return snprintf(buf, cap, "%s%s", lm, r->name);
    return snprintf(buf, cap, "%smodel.layers.%u.%s", lm, g, r->name);
}

int k3_schema_expert_name(char *buf, size_t cap, uint32_t layer, uint32_t expert, int which, const char *part)
{
    return snprintf(buf, cap, K3_SCH_PREFIX "layers.%u" K3_SCH_EXPERTS "%u.w%d%s%s", layer, expert, which + 1,
                    part ? "." : "", part ? part : "");
}

const char *k3_wslot_name(k3_wslot s)
{
    const k3_sch_row *r = (unsigned)s < K3_W_COUNT ? k3_schema_row((uint32_t)s) : NULL;
    return r ? r->name : "?";
}

int k3_wslot_in_layer(k3_wslot s, int is_mla, int is_dense)
{
    const k3_sch_row *r = (unsigned)s < K3_W_COUNT ? k3_schema_row((uint32_t)s) : NULL;
    return r && where_in_layer(r->where, is_mla, is_dense);
}

int k3_wslot_in_head(k3_wslot s)
{
    const k3_sch_row *r = (unsigned)s < K3_W_COUNT ? k3_schema_row((uint32_t)s) : NULL;
    return r && r->where == K3_SCH_IN_HEAD;
}
