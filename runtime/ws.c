/*
 * ws.c - what every weight source shares: the slot names and which slots a
 * layer kind has, and k3_ws_open choosing the source for a directory.
 */
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>

#include "k3_io.h"
#include "k3_ws.h"

static const char *const slot_names[K3_W_COUNT] = {
    [K3_W_INPUT_NORM] = "input_layernorm.weight",
    [K3_W_POST_NORM] = "post_attention_layernorm.weight",
    [K3_W_SA_RES_NORM] = "self_attention_res_norm.weight",
    [K3_W_SA_RES_PROJ] = "self_attention_res_proj.weight",
    [K3_W_MLP_RES_NORM] = "mlp_res_norm.weight",
    [K3_W_MLP_RES_PROJ] = "mlp_res_proj.weight",
    [K3_W_KDA_Q] = "self_attn.q_proj.weight",
    [K3_W_KDA_K] = "self_attn.k_proj.weight",
    [K3_W_KDA_V] = "self_attn.v_proj.weight",
    [K3_W_KDA_G] = "self_attn.g_proj.weight",
    [K3_W_KDA_O] = "self_attn.o_proj.weight",
    [K3_W_KDA_FA] = "self_attn.f_a_proj.weight",
    [K3_W_KDA_FB] = "self_attn.f_b_proj.weight",
    [K3_W_KDA_B] = "self_attn.b_proj.weight",
    [K3_W_KDA_QCONV] = "self_attn.q_conv1d.weight",
    [K3_W_KDA_KCONV] = "self_attn.k_conv1d.weight",
    [K3_W_KDA_VCONV] = "self_attn.v_conv1d.weight",
    [K3_W_KDA_ALOG] = "self_attn.A_log",
    [K3_W_KDA_DTBIAS] = "self_attn.dt_bias",
    [K3_W_KDA_ONORM] = "self_attn.o_norm.weight",
    [K3_W_MLA_QA] = "self_attn.q_a_proj.weight",
    [K3_W_MLA_QA_NORM] = "self_attn.q_a_layernorm.weight",
    [K3_W_MLA_QB] = "self_attn.q_b_proj.weight",
    [K3_W_MLA_KVA] = "self_attn.kv_a_proj_with_mqa.weight",
    [K3_W_MLA_KVA_NORM] = "self_attn.kv_a_layernorm.weight",
    [K3_W_MLA_KVB] = "self_attn.kv_b_proj.weight",
    [K3_W_MLA_O] = "self_attn.o_proj.weight",
    [K3_W_MLA_G] = "self_attn.g_proj.weight",
    [K3_W_MLP_GATE] = "mlp.gate_proj.weight",
    [K3_W_MLP_UP] = "mlp.up_proj.weight",
    [K3_W_MLP_DOWN] = "mlp.down_proj.weight",
    [K3_W_MOE_ROUTER] = "block_sparse_moe.gate.weight",
    [K3_W_MOE_BIAS] = "block_sparse_moe.gate.e_score_correction_bias",
    [K3_W_MOE_LDOWN] = "block_sparse_moe.routed_expert_down_proj.weight",
    [K3_W_MOE_LUP] = "block_sparse_moe.routed_expert_up_proj.weight",
    [K3_W_MOE_NORM] = "block_sparse_moe.routed_expert_norm.weight",
    [K3_W_MOE_SH_GATE] = "block_sparse_moe.shared_experts.gate_proj.weight",
    [K3_W_MOE_SH_UP] = "block_sparse_moe.shared_experts.up_proj.weight",
    [K3_W_MOE_SH_DOWN] = "block_sparse_moe.shared_experts.down_proj.weight",
    [K3_W_FINAL_NORM] = "model.norm.weight",
    [K3_W_OUT_RES_NORM] = "model.output_attn_res_norm.weight",
    [K3_W_OUT_RES_PROJ] = "model.output_attn_res_proj.weight",
    [K3_W_LM_HEAD] = "lm_head.weight",
};

const char *k3_wslot_name(k3_wslot s)
{
    return (unsigned)s < K3_W_COUNT ? slot_names[s] : "?";
}

int k3_wslot_in_layer(k3_wslot s, int is_mla, int is_dense)
{
    if (s <= K3_W_MLP_RES_PROJ)
        return 1;
    if (s >= K3_W_KDA_Q && s <= K3_W_KDA_ONORM)
        return !is_mla;
    if (s >= K3_W_MLA_QA && s <= K3_W_MLA_G)
        return is_mla;
    if (s >= K3_W_MLP_GATE && s <= K3_W_MLP_DOWN)
        return is_dense;
    if (s >= K3_W_MOE_ROUTER && s <= K3_W_MOE_SH_DOWN)
        return !is_dense;
    return 0;
}

int k3_wslot_in_head(k3_wslot s)
{
    return s >= K3_W_FINAL_NORM && s <= K3_W_LM_HEAD;
}

int k3_ws_open(k3_ws **out, const char *dir, unsigned flags, k3_err *e)
{
    *out = NULL;
    int k = k3_io_dir_kind(dir, e);   /* permission, a file, missing: said exactly */
    if (k < 0)
        return k;
    if (k == K3_DIR_PACKED)
        return k3_ws_pk_open(out, dir, flags, e);
    if (k == K3_DIR_UPSTREAM)
        return k3_ws_st_open(out, dir, flags, e);
    return k3_io_dir_expect(dir, K3_DIR_PACKED, "k3-run", e);  /* unfinished, or not a model */
}

void k3_ws_close(k3_ws *ws)
{
    if (ws)
        ws->ops->close(ws);
}
