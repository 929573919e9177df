/*
 * synth_model.c - presets, the tensor list of an upstream checkpoint (the
 * tensor schema's rows, include/k3_schema.h, with the dtypes per docs/MODEL.md
 * §2.4) and config.json in the flat or nested form.
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

/* the vision tower's tensors (outside language_model.: not in the schema) */
static const char *const vision_names[] = {
    "vision_tower.patch_embed.proj.weight",
    "vision_tower.encoder.blocks.0.norm1.weight",
    "multi_modal_projector.linear_1.weight",
};

int k3_synth_tensor_name(const k3_synth_tensor *t, char *buf, size_t cap)
{
    static const char *const parts[] = {K3_SCH_XP_PACKED, K3_SCH_XP_SCALE};
    if (t->kind >= SK_VIS_PATCH)
        return snprintf(buf, cap, "%s", vision_names[t->kind - SK_VIS_PATCH]);
    if (t->kind >= SK_EXP_W1)   /* w1, w2, w3 .weight */
        return k3_schema_expert_name(buf, cap, t->layer, t->expert, t->kind - SK_EXP_W1, K3_SCH_XP_WEIGHT);
    if (t->kind >= SK_EXP_W1_P) /* w1, w2, w3 .weight_packed / .weight_scale */
        return k3_schema_expert_name(buf, cap, t->layer, t->expert, (t->kind - SK_EXP_W1_P) / 2,
                                     parts[(t->kind - SK_EXP_W1_P) % 2]);
    return k3_schema_name(buf, cap, t->kind, t->layer, 1);
}

int k3_synth_kind_has_data_when_sparse(int kind)
{
    const k3_sch_row *r = kind < K3_SCH_COUNT ? k3_schema_row((uint32_t)kind) : NULL;
    return r && (kind == K3_SCH_EMBED || kind == K3_W_MOE_ROUTER || r->cls == K3_SCH_VECTOR || r->cls == K3_SCH_ALOG);
}

int k3_synth_has_data(const k3_synth_opts *o, int kind)
{
    if (o->sparse == K3_SYNTH_DENSE || k3_synth_kind_has_data_when_sparse(kind))
        return 1;
    return o->sparse == K3_SYNTH_SPARSE_LIVE &&
           (kind == K3_W_LM_HEAD || kind == SK_EXP_W1_S || kind == SK_EXP_W2_S || kind == SK_EXP_W3_S);
}

static int is_vector_kind(int kind)
{
    return k3_synth_kind_has_data_when_sparse(kind) && kind != K3_SCH_EMBED && kind != K3_W_MOE_ROUTER;
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
        return kind == K3_W_MOE_BIAS || kind == K3_W_KDA_ALOG || kind == K3_W_KDA_DTBIAS ? K3_DT_F32 : K3_DT_BF16;
    }
}

static int is_res_proj(int kind)
{
    return kind == K3_W_SA_RES_PROJ || kind == K3_W_MLP_RES_PROJ || kind == K3_W_OUT_RES_PROJ;
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
        if (kind == K3_W_MOE_ROUTER || kind == K3_W_KDA_QCONV || kind == K3_W_KDA_KCONV || kind == K3_W_KDA_VCONV ||
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

/* The config the options describe (what config.json says), for the schema. */
static void synth_cfg(const k3_synth_model *m, k3_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->hidden_size = m->hidden;
    c->num_hidden_layers = m->layers;
    c->vocab_size = m->vocab;
    c->kda_num_heads = m->kda_heads;
    c->kda_head_dim = m->kda_head_dim;
    c->short_conv_kernel_size = m->conv;
    c->num_attention_heads = m->mla_heads;
    c->q_lora_rank = m->q_lora;
    c->kv_lora_rank = m->kv_lora;
    c->qk_nope_head_dim = m->nope;
    c->qk_rope_head_dim = m->rope;
    c->v_head_dim = m->v_dim;
    c->mla_use_output_gate = 1;
    c->num_experts = m->experts;
    c->num_experts_per_token = m->top_k;
    c->num_shared_experts = m->shared;
    c->routed_expert_hidden_size = m->latent;
    c->moe_intermediate_size = m->moe_inter;
    c->latent_moe_use_norm = 1;
    c->first_k_dense_replace = m->first_dense;
    c->intermediate_size = m->dense_inter;
    c->attn_res_block_size = m->attn_res_block;
    memcpy(c->is_mla, m->is_mla, sizeof c->is_mla < sizeof m->is_mla ? sizeof c->is_mla : sizeof m->is_mla);
}

/* the schema's rows of group g (the embedding for UINT32_MAX - 1, the head
 * for layers) in checkpoint order */
static int push_rows(list *l, const k3_cfg *c, uint32_t g, int embed, k3_err *e)
{
    uint32_t nrows;
    const k3_sch_row *rows = k3_schema_rows(&nrows);
    const k3_sch_row *byck[K3_SCH_COUNT] = {0};
    for (uint32_t i = 0; i < nrows; i++)
        byck[rows[i].ck] = &rows[i];
    for (uint32_t k = 0; k < K3_SCH_COUNT; k++) {
        const k3_sch_row *r = byck[k];
        if (!r || (embed ? r->where != K3_SCH_IN_EMBED : !k3_schema_in_group(c, r, g)))
            continue;
        uint64_t sh[3];
        k3_schema_shape(c, r, sh);
        if (r->cls == K3_SCH_ALOG && l->o->alog_padded && c->kda_head_dim > sh[0])
            sh[0] = c->kda_head_dim;
        int rc = push(l, g == c->num_hidden_layers || embed ? UINT32_MAX : g, 0, r->slot, r->ndim, sh[0], sh[1],
                      sh[2], e);
        if (rc)
            return rc;
    }
    return 0;
}

int k3_synth_tensors(const k3_synth_opts *o, k3_synth_tensor **out, uint64_t *count, k3_err *e)
{
    const k3_synth_model *m = &o->m;
    list l = {NULL, 0, 0, o};
    k3_cfg c;
    synth_cfg(m, &c);
    int rc = push_rows(&l, &c, 0, 1, e);
    for (uint32_t L = 0; L < m->layers && rc == 0; L++) {
        rc = push_rows(&l, &c, L, 0, e);
        if (L < m->first_dense)
            continue;
        uint64_t Lt = m->latent, I = m->moe_inter;
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
    rc = rc ? rc : push_rows(&l, &c, m->layers, 0, e);
    const uint32_t L = UINT32_MAX;
    if (o->vision && rc == 0) {          /* a token vision tower: left out by k3-convert */
        rc = rc ? rc : push(&l, L, 0, SK_VIS_PATCH, 2, 64, 48, 0, e);
        rc = rc ? rc : push(&l, L, 0, SK_VIS_NORM, 1, 64, 0, 0, e);
        rc = rc ? rc : push(&l, L, 0, SK_VIS_PROJ, 2, m->hidden, 64, 0, e);
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
