/*
 * synth_model.c - presets, the tensor list of an upstream checkpoint (names,
 * shapes and dtypes per docs/MODEL.md §2) and config.json in the flat or nested form.
 *
 * Invariant: the tensor list is a pure function of the options; its order is
 * the file order (embedding, layers 0..n-1, final norm, output AttnRes, head).
 */
#include "synth.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

static void mla_every_fourth_and_last(k3_synth_model *m)
{
    memset(m->is_mla, 0, sizeof m->is_mla);
    for (uint32_t l = 0; l < m->layers; l++)
        m->is_mla[l] = (l + 1) % 4 == 0 || l + 1 == m->layers;
}

static void k3_dims(k3_synth_model *m)
{
    m->hidden = 7168;
    m->kda_heads = 96;
    m->kda_head_dim = 128;
    m->conv = 4;
    m->gate_lower_bound = -5.0;
    m->mla_heads = 96;
    m->q_lora = 1536;
    m->kv_lora = 512;
    m->nope = 128;
    m->rope = 64;
    m->v_dim = 128;
    m->experts = 896;
    m->top_k = 16;
    m->shared = 2;
    m->latent = 3584;
    m->moe_inter = 3072;
    m->first_dense = 1;
    m->dense_inter = 33792;
    m->attn_res_block = 12;
    m->situ_beta = 4.0;
    m->situ_linear_beta = 25.0;
    m->rms_eps = 1e-5;
    m->routed_scaling = 1.0;
    m->n_specials = 256;
    m->max_ranks = 4096;
}

int k3_synth_preset(k3_synth_opts *o, const char *name, uint32_t layers, uint32_t vocab, k3_err *e)
{
    k3_synth_model *m = &o->m;
    memset(m, 0, sizeof *m);
    if (!strcmp(name, "tiny")) {
        m->hidden = 64;
        m->layers = 13;
        m->kda_heads = 4;
        m->kda_head_dim = 16;
        m->conv = 4;
        m->gate_lower_bound = -5.0;
        m->mla_heads = 4;
        m->q_lora = 32;
        m->kv_lora = 32;
        m->nope = 16;
        m->rope = 8;
        m->v_dim = 16;
        m->experts = 16;
        m->top_k = 2;
        m->shared = 2;
        m->latent = 64;
        m->moe_inter = 32;
        m->first_dense = 1;
        m->dense_inter = 96;
        m->attn_res_block = 4;
        m->situ_beta = 4.0;
        m->situ_linear_beta = 25.0;
        m->rms_eps = 1e-5;
        m->routed_scaling = 1.0;
        m->n_specials = 8;
        m->max_ranks = 1024 - 8;
        m->vocab = 0;               /* ranks + specials, known after BPE */
        o->nested = 0;
        o->vec_dtype = K3_SYNTH_VEC_MIXED;
        o->trunk_dtype = K3_SYNTH_TRUNK_MIXED;
        o->shard_size = 512u << 10;
    } else if (!strcmp(name, "k3-width")) {
        k3_dims(m);
        m->layers = 2;
        m->vocab = 163840;
        o->nested = 1;
        o->vec_dtype = K3_SYNTH_VEC_REAL;
        o->shard_size = 5ull << 30;
    } else if (!strcmp(name, "k3")) {
        k3_dims(m);
        m->layers = 93;
        m->vocab = 163840;
        o->nested = 1;
        o->vec_dtype = K3_SYNTH_VEC_REAL;
        o->shard_size = 15600ull << 20;   /* ~96 shards, like upstream */
    } else {
        return k3_err_set(e, K3_EARG, "unknown preset '%s' (tiny, k3-width, k3)", name);
    }
    snprintf(m->preset, sizeof m->preset, "%s", name);
    if (layers) {
        if (layers > K3_SYNTH_MAX_LAYERS)
            return k3_err_set(e, K3_EARG, "--layers %u is more than %u", layers, K3_SYNTH_MAX_LAYERS);
        m->layers = layers;
    }
    if (vocab) {
        if (vocab < 256 + m->n_specials)
            return k3_err_set(e, K3_EARG, "--vocab %u is less than 256 byte tokens + %u specials", vocab,
                              m->n_specials);
        m->vocab = vocab;
        if (m->max_ranks > vocab - m->n_specials)
            m->max_ranks = vocab - m->n_specials;
    }
    if (m->first_dense > m->layers)
        m->first_dense = m->layers;
    mla_every_fourth_and_last(m);
    return 0;
}

/* ---- tensor list ---------------------------------------------------------- */

static const char *kind_suffix[SK_COUNT] = {
    [SK_EMBED] = "language_model.model.embed_tokens.weight",
    [SK_NORM] = "language_model.model.norm.weight",
    [SK_OUT_RES_NORM] = "language_model.model.output_attn_res_norm.weight",
    [SK_OUT_RES_PROJ] = "language_model.model.output_attn_res_proj.weight",
    [SK_LM_HEAD] = "language_model.lm_head.weight",
    [SK_IN_NORM] = "input_layernorm.weight",
    [SK_POST_NORM] = "post_attention_layernorm.weight",
    [SK_SA_RES_NORM] = "self_attention_res_norm.weight",
    [SK_SA_RES_PROJ] = "self_attention_res_proj.weight",
    [SK_MLP_RES_NORM] = "mlp_res_norm.weight",
    [SK_MLP_RES_PROJ] = "mlp_res_proj.weight",
    [SK_KDA_Q] = "self_attn.q_proj.weight",
    [SK_KDA_K] = "self_attn.k_proj.weight",
    [SK_KDA_V] = "self_attn.v_proj.weight",
    [SK_KDA_QCONV] = "self_attn.q_conv1d.weight",
    [SK_KDA_KCONV] = "self_attn.k_conv1d.weight",
    [SK_KDA_VCONV] = "self_attn.v_conv1d.weight",
    [SK_KDA_FA] = "self_attn.f_a_proj.weight",
    [SK_KDA_FB] = "self_attn.f_b_proj.weight",
    [SK_KDA_B] = "self_attn.b_proj.weight",
    [SK_KDA_ALOG] = "self_attn.A_log",
    [SK_KDA_DTBIAS] = "self_attn.dt_bias",
    [SK_KDA_G] = "self_attn.g_proj.weight",
    [SK_KDA_ONORM] = "self_attn.o_norm.weight",
    [SK_KDA_O] = "self_attn.o_proj.weight",
    [SK_MLA_QA] = "self_attn.q_a_proj.weight",
    [SK_MLA_QA_NORM] = "self_attn.q_a_layernorm.weight",
    [SK_MLA_QB] = "self_attn.q_b_proj.weight",
    [SK_MLA_KVA] = "self_attn.kv_a_proj_with_mqa.weight",
    [SK_MLA_KVA_NORM] = "self_attn.kv_a_layernorm.weight",
    [SK_MLA_KVB] = "self_attn.kv_b_proj.weight",
    [SK_MLA_G] = "self_attn.g_proj.weight",
    [SK_MLA_O] = "self_attn.o_proj.weight",
    [SK_MLP_GATE] = "mlp.gate_proj.weight",
    [SK_MLP_UP] = "mlp.up_proj.weight",
    [SK_MLP_DOWN] = "mlp.down_proj.weight",
    [SK_MOE_GATE] = "block_sparse_moe.gate.weight",
    [SK_MOE_BIAS] = "block_sparse_moe.gate.e_score_correction_bias",
    [SK_MOE_LDOWN] = "block_sparse_moe.routed_expert_down_proj.weight",
    [SK_MOE_LUP] = "block_sparse_moe.routed_expert_up_proj.weight",
    [SK_MOE_LNORM] = "block_sparse_moe.routed_expert_norm.weight",
    [SK_SH_GATE] = "block_sparse_moe.shared_experts.gate_proj.weight",
    [SK_SH_UP] = "block_sparse_moe.shared_experts.up_proj.weight",
    [SK_SH_DOWN] = "block_sparse_moe.shared_experts.down_proj.weight",
    [SK_EXP_W1_P] = "w1.weight_packed",
    [SK_EXP_W1_S] = "w1.weight_scale",
    [SK_EXP_W2_P] = "w2.weight_packed",
    [SK_EXP_W2_S] = "w2.weight_scale",
    [SK_EXP_W3_P] = "w3.weight_packed",
    [SK_EXP_W3_S] = "w3.weight_scale",
    [SK_EXP_W1] = "w1.weight",
    [SK_EXP_W2] = "w2.weight",
    [SK_EXP_W3] = "w3.weight",
    [SK_VIS_PATCH] = "vision_tower.patch_embed.proj.weight",
    [SK_VIS_NORM] = "vision_tower.encoder.blocks.0.norm1.weight",
    [SK_VIS_PROJ] = "multi_modal_projector.linear_1.weight",
};

int k3_synth_tensor_name(const k3_synth_tensor *t, char *buf, size_t cap)
{
    if (t->layer == UINT32_MAX)
        return snprintf(buf, cap, "%s", kind_suffix[t->kind]);
    if (t->kind >= SK_EXP_W1_P)
        return snprintf(buf, cap, "language_model.model.layers.%u.block_sparse_moe.experts.%u.%s", t->layer,
                        t->expert, kind_suffix[t->kind]);
    return snprintf(buf, cap, "language_model.model.layers.%u.%s", t->layer, kind_suffix[t->kind]);
}

int k3_synth_kind_has_data_when_sparse(int kind)
{
    switch (kind) {
    case SK_EMBED: case SK_NORM: case SK_OUT_RES_NORM: case SK_OUT_RES_PROJ:
    case SK_IN_NORM: case SK_POST_NORM: case SK_SA_RES_NORM: case SK_SA_RES_PROJ:
    case SK_MLP_RES_NORM: case SK_MLP_RES_PROJ:
    case SK_KDA_ALOG: case SK_KDA_DTBIAS: case SK_KDA_ONORM:
    case SK_MLA_QA_NORM: case SK_MLA_KVA_NORM:
    case SK_MOE_GATE: case SK_MOE_BIAS: case SK_MOE_LNORM:
        return 1;
    default:
        return 0;
    }
}

static int is_vector_kind(int kind)
{
    return k3_synth_kind_has_data_when_sparse(kind) && kind != SK_EMBED && kind != SK_MOE_GATE;
}

/* dtype of a vector under the policy; the mixed policy flips on a hash of
 * the name alone, so that the layout does not depend on the seed. */
static k3_dtype vector_dtype(const k3_synth_opts *o, int kind, const char *name)
{
    uint64_t key = k3_synth_key(0, name);
    switch (o->vec_dtype) {
    case K3_SYNTH_VEC_BF16: return K3_DT_BF16;
    case K3_SYNTH_VEC_F32: return K3_DT_F32;
    case K3_SYNTH_VEC_MIXED: return (key >> 17) & 1 ? K3_DT_F32 : K3_DT_BF16;
    default:
        return kind == SK_MOE_BIAS || kind == SK_KDA_ALOG || kind == SK_KDA_DTBIAS ? K3_DT_F32 : K3_DT_BF16;
    }
}

static int is_res_proj(int kind)
{
    return kind == SK_SA_RES_PROJ || kind == SK_MLP_RES_PROJ || kind == SK_OUT_RES_PROJ;
}

/* dtype of a trunk (non-expert) tensor under the trunk policy; vec is what
 * the vector policy gives for a vector. Hashes of the name alone, so the
 * layout does not depend on the seed. */
static k3_dtype trunk_dtype(const k3_synth_opts *o, int kind, const char *name, int vector, k3_dtype vec)
{
    switch (o->trunk_dtype) {
    case K3_SYNTH_TRUNK_F32: return K3_DT_F32;
    case K3_SYNTH_TRUNK_F16: return K3_DT_F16;
    case K3_SYNTH_TRUNK_MIXED: {
        static const k3_dtype three[3] = {K3_DT_BF16, K3_DT_F16, K3_DT_F32};
        /* salt 1, not 0: with salt 0 the gate checkpoint of seed 1 had one
         * ill-conditioned position (k3-run 1.24e-4 from the float64
         * reference); salts 1..4 all stay below 6.2e-5 on seeds 1, 4, 7 */
        return three[(k3_synth_key(1, name) >> 23) % 3];
    }
    case K3_SYNTH_TRUNK_REAL:
        if (kind == SK_MOE_GATE || kind == SK_KDA_QCONV || kind == SK_KDA_KCONV || kind == SK_KDA_VCONV ||
            is_res_proj(kind))
            return K3_DT_F32;
        return vector ? vec : K3_DT_BF16;
    default:
        return vector ? vec : K3_DT_BF16;
    }
}

typedef struct list {
    k3_synth_tensor *t;
    uint64_t n, cap;
    const k3_synth_opts *o;
} list;

static int push(list *l, uint32_t layer, uint32_t expert, int kind, uint32_t ndim, uint64_t d0, uint64_t d1,
                uint64_t d2, k3_err *e)
{
    if (l->n == l->cap) {
        uint64_t nc = l->cap ? l->cap * 2 : 1024;
        k3_synth_tensor *t = realloc(l->t, (size_t)nc * sizeof *t);
        if (!t)
            return k3_err_set(e, K3_ENOMEM, "out of memory for %" PRIu64 " tensor descriptors", nc);
        l->t = t;
        l->cap = nc;
    }
    k3_synth_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    t->layer = layer;
    t->expert = expert;
    t->kind = (uint16_t)kind;
    t->ndim = (uint8_t)ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shape[2] = d2;
    char name[256];
    k3_synth_tensor_name(t, name, sizeof name);
    t->key = k3_synth_key(l->o->seed, name);
    k3_dtype dt = K3_DT_BF16;
    if (kind >= SK_EXP_W1_P && kind <= SK_EXP_W3_S)
        dt = K3_DT_U8;
    else if (kind >= SK_EXP_W1 && kind <= SK_EXP_W3)
        dt = K3_DT_BF16;                         /* routed experts: not trunk */
    else if (kind >= SK_VIS_PATCH && kind <= SK_VIS_PROJ)
        dt = K3_DT_BF16;
    else
        dt = trunk_dtype(l->o, kind, name, is_vector_kind(kind),
                         is_vector_kind(kind) ? vector_dtype(l->o, kind, name) : K3_DT_BF16);
    /* an F32 AttnRes projection is stored as [1][E], as exporters do */
    if (is_res_proj(kind) && dt == K3_DT_F32 && l->o->trunk_dtype != K3_SYNTH_TRUNK_BF16 &&
        l->o->trunk_dtype != K3_SYNTH_TRUNK_F32 && t->ndim == 1) {
        t->ndim = 2;
        t->shape[1] = t->shape[0];
        t->shape[0] = 1;
    }
    t->dtype = (uint8_t)dt;
    uint64_t b = k3_dtype_size(dt);
    for (uint32_t k = 0; k < t->ndim; k++)
        b *= t->shape[k];
    t->bytes = b;
    return 0;
}

#define V(kind, d0) rc = rc ? rc : push(&l, L, 0, kind, 1, d0, 0, 0, e)
#define M(kind, d0, d1) rc = rc ? rc : push(&l, L, 0, kind, 2, d0, d1, 0, e)

int k3_synth_tensors(const k3_synth_opts *o, k3_synth_tensor **out, uint64_t *count, k3_err *e)
{
    const k3_synth_model *m = &o->m;
    list l = {NULL, 0, 0, o};
    int rc = 0;
    uint64_t E = m->hidden, H = m->kda_heads, D = m->kda_head_dim, P = H * D;
    uint32_t L = UINT32_MAX;
    M(SK_EMBED, m->vocab, E);
    for (L = 0; L < m->layers && rc == 0; L++) {
        V(SK_IN_NORM, E);
        V(SK_POST_NORM, E);
        V(SK_SA_RES_NORM, E);
        V(SK_SA_RES_PROJ, E);
        V(SK_MLP_RES_NORM, E);
        V(SK_MLP_RES_PROJ, E);
        if (!m->is_mla[L]) {
            M(SK_KDA_Q, P, E);
            M(SK_KDA_K, P, E);
            M(SK_KDA_V, P, E);
            for (int k = SK_KDA_QCONV; k <= SK_KDA_VCONV; k++)
                rc = rc ? rc : push(&l, L, 0, k, 3, P, 1, m->conv, e);
            M(SK_KDA_FA, D, E);
            M(SK_KDA_FB, P, D);
            M(SK_KDA_B, H, E);
            V(SK_KDA_ALOG, o->alog_padded ? (D > H ? D : H) : H);
            V(SK_KDA_DTBIAS, P);
            M(SK_KDA_G, P, E);
            V(SK_KDA_ONORM, D);
            M(SK_KDA_O, E, P);
        } else {
            uint64_t nh = m->mla_heads;
            M(SK_MLA_QA, m->q_lora, E);
            V(SK_MLA_QA_NORM, m->q_lora);
            M(SK_MLA_QB, nh * (m->nope + m->rope), m->q_lora);
            M(SK_MLA_KVA, m->kv_lora + m->rope, E);
            V(SK_MLA_KVA_NORM, m->kv_lora);
            M(SK_MLA_KVB, nh * (m->nope + m->v_dim), m->kv_lora);
            M(SK_MLA_G, nh * m->v_dim, E);
            M(SK_MLA_O, E, nh * m->v_dim);
        }
        if (L < m->first_dense) {
            M(SK_MLP_GATE, m->dense_inter, E);
            M(SK_MLP_UP, m->dense_inter, E);
            M(SK_MLP_DOWN, E, m->dense_inter);
            continue;
        }
        uint64_t Lt = m->latent, I = m->moe_inter, S = (uint64_t)m->moe_inter * m->shared;
        M(SK_MOE_GATE, m->experts, E);
        V(SK_MOE_BIAS, m->experts);
        M(SK_MOE_LDOWN, Lt, E);
        M(SK_MOE_LUP, E, Lt);
        V(SK_MOE_LNORM, Lt);
        if (m->shared) {
            M(SK_SH_GATE, S, E);
            M(SK_SH_UP, S, E);
            M(SK_SH_DOWN, E, S);
        }
        for (uint32_t x = 0; x < m->experts && rc == 0; x++) {
            if (o->experts_bf16) {
                rc = rc ? rc : push(&l, L, x, SK_EXP_W1, 2, I, Lt, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W2, 2, Lt, I, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W3, 2, I, Lt, 0, e);
            } else {
                rc = rc ? rc : push(&l, L, x, SK_EXP_W1_P, 2, I, Lt / 2, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W1_S, 2, I, Lt / 32, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W2_P, 2, Lt, I / 2, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W2_S, 2, Lt, I / 32, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W3_P, 2, I, Lt / 2, 0, e);
                rc = rc ? rc : push(&l, L, x, SK_EXP_W3_S, 2, I, Lt / 32, 0, e);
            }
        }
    }
    L = UINT32_MAX;
    V(SK_NORM, E);
    V(SK_OUT_RES_NORM, E);
    V(SK_OUT_RES_PROJ, E);
    M(SK_LM_HEAD, m->vocab, E);
    if (o->vision) {                     /* a token vision tower: left out by k3-convert */
        M(SK_VIS_PATCH, 64, 48);
        V(SK_VIS_NORM, 64);
        M(SK_VIS_PROJ, E, 64);
    }
    if (rc) {
        free(l.t);
        return rc;
    }
    *out = l.t;
    *count = l.n;
    return 0;
}

/* ---- config.json ---------------------------------------------------------- */

static cJSON *layer_list(const k3_synth_model *m, int mla)
{
    cJSON *a = cJSON_CreateArray();
    for (uint32_t l = 0; l < m->layers; l++)
        if (!!m->is_mla[l] == mla)
            cJSON_AddItemToArray(a, cJSON_CreateNumber(l + 1));
    return a;
}

char *k3_synth_config_json(const k3_synth_opts *o)
{
    const k3_synth_model *m = &o->m;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "architectures", cJSON_CreateStringArray((const char *[]){"KimiK3ForCausalLM"}, 1));
    cJSON_AddStringToObject(root, "model_type", "kimi_k3");
    cJSON *tc = root, *lin = root;
    if (o->nested) {
        tc = cJSON_AddObjectToObject(root, "text_config");
        cJSON_AddStringToObject(tc, "model_type", "kimi_k3_text");
        lin = cJSON_AddObjectToObject(tc, "linear_attn_config");
    }
    cJSON_AddNumberToObject(tc, "hidden_size", m->hidden);
    cJSON_AddNumberToObject(tc, "num_hidden_layers", m->layers);
    cJSON_AddNumberToObject(tc, "vocab_size", m->vocab);
    cJSON_AddNumberToObject(tc, "rms_norm_eps", m->rms_eps);
    cJSON_AddNumberToObject(lin, o->nested ? "num_heads" : "kda_num_heads", m->kda_heads);
    cJSON_AddNumberToObject(lin, o->nested ? "head_dim" : "kda_head_dim", m->kda_head_dim);
    cJSON_AddNumberToObject(lin, "short_conv_kernel_size", m->conv);
    cJSON_AddNumberToObject(lin, "gate_lower_bound", m->gate_lower_bound);
    cJSON_AddNumberToObject(tc, "num_attention_heads", m->mla_heads);
    cJSON_AddNumberToObject(tc, "q_lora_rank", m->q_lora);
    cJSON_AddNumberToObject(tc, "kv_lora_rank", m->kv_lora);
    cJSON_AddNumberToObject(tc, "qk_nope_head_dim", m->nope);
    cJSON_AddNumberToObject(tc, "qk_rope_head_dim", m->rope);
    cJSON_AddNumberToObject(tc, "v_head_dim", m->v_dim);
    cJSON_AddBoolToObject(tc, "mla_use_output_gate", 1);
    cJSON_AddNumberToObject(tc, "num_experts", m->experts);
    cJSON_AddNumberToObject(tc, "num_experts_per_token", m->top_k);
    cJSON_AddNumberToObject(tc, "num_shared_experts", m->shared);
    cJSON_AddNumberToObject(tc, "routed_expert_hidden_size", m->latent);
    cJSON_AddNumberToObject(tc, "moe_intermediate_size", m->moe_inter);
    cJSON_AddNumberToObject(tc, "routed_scaling_factor", m->routed_scaling);
    cJSON_AddBoolToObject(tc, "moe_renormalize", 1);
    cJSON_AddBoolToObject(tc, "latent_moe_use_norm", 1);
    cJSON_AddNumberToObject(tc, "first_k_dense_replace", m->first_dense);
    cJSON_AddNumberToObject(tc, "intermediate_size", m->dense_inter);
    cJSON_AddNumberToObject(tc, "attn_res_block_size", m->attn_res_block);
    cJSON_AddNumberToObject(tc, o->nested ? "activation_situ_beta" : "situ_beta", m->situ_beta);
    cJSON_AddNumberToObject(tc, o->nested ? "activation_situ_linear_beta" : "situ_linear_beta",
                            m->situ_linear_beta);
    cJSON_AddItemToObject(lin, "full_attn_layers", layer_list(m, 1));
    if (o->nested)
        cJSON_AddItemToObject(lin, "kda_layers", layer_list(m, 0));
    if (!o->experts_bf16) {
        cJSON *q = cJSON_AddObjectToObject(root, "quantization_config");
        cJSON_AddStringToObject(q, "quant_method", "mxfp4");
        cJSON_AddNumberToObject(q, "group_size", 32);
        cJSON_AddItemToObject(q, "modules_to_quantize",
                              cJSON_CreateStringArray((const char *[]){"block_sparse_moe.experts"}, 1));
    }
    cJSON_AddStringToObject(root, "torch_dtype", "bfloat16");
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}
