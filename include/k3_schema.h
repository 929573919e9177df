/*
 * k3_schema.h - the tensor schema: every language-model tensor of a K3
 * checkpoint, one row each (common/schema.c), and the questions every part of
 * k3 asks about them. Synth writes the rows, convert and verify expect them
 * (manifests/expect.c), the weight sources name them, the model checks their
 * shapes and the memory planner sizes them; none keeps a list of its own.
 *
 * A row: the slot (k3_wslot, or K3_SCH_EMBED for the embedding), the name
 * (relative to "language_model.model.layers.{L}." for layer slots and to
 * "language_model." for the embedding and the head), the layer kinds it
 * appears in, its class (how it is stored and checked), the condition under
 * which a config has it, its shape as dimensions of the config, whether the
 * streaming source may read it in row pieces, and two orders: the table's own
 * order is the order the model uses the slots within a group; ck is the
 * order of the upstream checkpoint's files (synth writes in it).
 *
 * Routed experts are not rows (they come through k3_ws_experts_acquire as
 * whole records); their names are k3_schema_expert_name's.
 */
#ifndef K3_SCHEMA_H
#define K3_SCHEMA_H

#include <stddef.h>
#include <stdint.h>

#include "k3_cfg.h"

/* Tensor slots of one trunk group (indices of a weight source's view table). */
typedef enum k3_wslot {
    /* every layer */
    K3_W_INPUT_NORM = 0, K3_W_POST_NORM,
    K3_W_SA_RES_NORM, K3_W_SA_RES_PROJ, K3_W_MLP_RES_NORM, K3_W_MLP_RES_PROJ,
    /* KDA */
    K3_W_KDA_Q, K3_W_KDA_K, K3_W_KDA_V, K3_W_KDA_G, K3_W_KDA_O, K3_W_KDA_FA, K3_W_KDA_FB,
    K3_W_KDA_B, K3_W_KDA_QCONV, K3_W_KDA_KCONV, K3_W_KDA_VCONV, K3_W_KDA_ALOG,
    K3_W_KDA_DTBIAS, K3_W_KDA_ONORM,
    /* MLA */
    K3_W_MLA_QA, K3_W_MLA_QA_NORM, K3_W_MLA_QB, K3_W_MLA_KVA, K3_W_MLA_KVA_NORM,
    K3_W_MLA_KVB, K3_W_MLA_O, K3_W_MLA_G,
    /* dense MLP */
    K3_W_MLP_GATE, K3_W_MLP_UP, K3_W_MLP_DOWN,
    /* LatentMoE (routed experts come through k3_ws_experts_acquire) */
    K3_W_MOE_ROUTER, K3_W_MOE_BIAS, K3_W_MOE_LDOWN, K3_W_MOE_LUP, K3_W_MOE_NORM,
    K3_W_MOE_SH_GATE, K3_W_MOE_SH_UP, K3_W_MOE_SH_DOWN,
    /* the head group */
    K3_W_FINAL_NORM, K3_W_OUT_RES_NORM, K3_W_OUT_RES_PROJ, K3_W_LM_HEAD,
    K3_W_COUNT
} k3_wslot;

/* The embedding's row id (not a trunk slot: read through k3_ws_embed). */
#define K3_SCH_EMBED K3_W_COUNT
#define K3_SCH_COUNT (K3_W_COUNT + 1)

/* Where a row appears. */
typedef enum k3_sch_where {
    K3_SCH_IN_EVERY = 0,   /* every layer */
    K3_SCH_IN_KDA,         /* KDA layers */
    K3_SCH_IN_MLA,         /* MLA layers */
    K3_SCH_IN_DENSE,       /* layers < first_k_dense_replace */
    K3_SCH_IN_MOE,         /* the others */
    K3_SCH_IN_HEAD,        /* the model output group */
    K3_SCH_IN_EMBED,       /* the embedding */
} k3_sch_where;

/* How a row is stored and checked (docs/MODEL.md §2.3-2.4). */
typedef enum k3_sch_class {
    K3_SCH_MATRIX = 0,   /* [rows][cols] BF16, F16 or F32; checked shape for shape */
    K3_SCH_VECTOR,       /* n values, any rank ([E] or [1][E]); checked by count; widened to f32 */
    K3_SCH_CONV,         /* [n][1][cw] upstream, n * cw values to the model */
    K3_SCH_ALOG,         /* H values, or D (padded) */
} k3_sch_class;

/* When a config has the row at all. */
typedef enum k3_sch_cond {
    K3_SCH_ALWAYS = 0,
    K3_SCH_IF_MLA_GATE,   /* mla_use_output_gate */
    K3_SCH_IF_MOE_NORM,   /* latent_moe_use_norm */
    K3_SCH_IF_SHARED,     /* num_shared_experts > 0 */
} k3_sch_cond;

/* Dimensions of the config a shape is made of. */
typedef enum k3_sch_dim {
    K3_SD_1 = 0,
    K3_SD_E,      /* hidden_size */
    K3_SD_V,      /* vocab_size */
    K3_SD_H,      /* kda_num_heads */
    K3_SD_D,      /* kda_head_dim */
    K3_SD_P,      /* H * D */
    K3_SD_CW,     /* short_conv_kernel_size */
    K3_SD_QL,     /* q_lora_rank */
    K3_SD_QB,     /* MLA heads * (qk_nope + qk_rope) */
    K3_SD_KVA,    /* kv_lora_rank + qk_rope_head_dim */
    K3_SD_KVL,    /* kv_lora_rank */
    K3_SD_KVB,    /* MLA heads * (qk_nope + v_head_dim) */
    K3_SD_HV,     /* MLA heads * v_head_dim */
    K3_SD_IDN,    /* intermediate_size (dense MLP) */
    K3_SD_NE,     /* num_experts */
    K3_SD_LAT,    /* routed_expert_hidden_size */
    K3_SD_SH,     /* moe_intermediate_size * num_shared_experts */
    K3_SD_COUNT
} k3_sch_dim;

typedef struct k3_sch_row {
    uint8_t slot;          /* k3_wslot or K3_SCH_EMBED */
    uint8_t where;         /* k3_sch_where */
    uint8_t cls;           /* k3_sch_class */
    uint8_t cond;          /* k3_sch_cond */
    uint8_t ndim;          /* upstream rank */
    uint8_t dim[3];        /* k3_sch_dim each */
    uint8_t stream;        /* may be streamed in row pieces (used once, whole, by k3_model_mm) */
    uint8_t ck;            /* place in the upstream checkpoint's order */
    uint8_t est_bytes;     /* bytes per value in a what-if size estimate (the published checkpoint's dtype) */
    const char *name;
} k3_sch_row;

/* The rows, in the model's use order within a group (embedding first, then
 * a layer's rows, then the head's). */
const k3_sch_row *k3_schema_rows(uint32_t *n);
/* The row of a slot (k3_wslot or K3_SCH_EMBED); NULL if out of range. */
const k3_sch_row *k3_schema_row(uint32_t slot);

/* Value of a dimension for cfg. */
uint64_t k3_schema_dim(const k3_cfg *c, k3_sch_dim d);
/* Upstream shape of a row for cfg (ndim from the row); returns the count of
 * values (the product). */
uint64_t k3_schema_shape(const k3_cfg *c, const k3_sch_row *r, uint64_t shape[3]);
/* 1 if the config has the row at all (its condition). */
int k3_schema_cond(const k3_cfg *c, const k3_sch_row *r);
/* 1 if the row is in trunk group g of cfg (g = num_hidden_layers: the head)
 * and the config has it. The embedding is in no group. */
int k3_schema_in_group(const k3_cfg *c, const k3_sch_row *r, uint32_t g);

/* Full upstream name of slot s in group g (layer slots: g is the layer), with
 * the "language_model." prefix or without it (prefixed 0, as some exporters
 * write). Returns what snprintf returns. */
int k3_schema_name(char *buf, size_t cap, uint32_t slot, uint32_t g, int prefixed);

/* Routed experts: "language_model.model.layers.{L}.block_sparse_moe.experts.{x}.w{1,2,3}.{part}";
 * which 0..2 is w1 (gate), w2 (down), w3 (up); part a K3_SCH_XP_* string
 * (NULL: the name up to "w{n}"). */
#define K3_SCH_XP_PACKED "weight_packed"
#define K3_SCH_XP_SCALE "weight_scale"
#define K3_SCH_XP_WEIGHT "weight"
#define K3_SCH_XP_SCALE_INV "weight_scale_inv"
int k3_schema_expert_name(char *buf, size_t cap, uint32_t layer, uint32_t expert, int which, const char *part);
/* The prefix every language-model tensor but the head has, and the head's
 * name (relative to "language_model."). */
#define K3_SCH_PREFIX "language_model.model."
#define K3_SCH_HEAD_NAME "lm_head.weight"
/* The embedding's row name and full name. */
#define K3_SCH_EMBED_REL "model.embed_tokens.weight"
#define K3_SCH_EMBED_NAME "language_model." K3_SCH_EMBED_REL
#define K3_SCH_EXPERTS ".block_sparse_moe.experts."

/* Upstream tensor name of a slot: its row's name, relative to
 * "language_model.model.layers.{L}." for layer slots and to "language_model."
 * for the head group. */
const char *k3_wslot_name(k3_wslot s);
/* 1 if slot s belongs in a layer of this kind / in the head group (whatever
 * the config's conditions). */
int k3_wslot_in_layer(k3_wslot s, int is_mla, int is_dense);
int k3_wslot_in_head(k3_wslot s);

#endif
