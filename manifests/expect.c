/*
 * expect.c - the trunk tensors a config implies (docs/MODEL.md §2.3 names and §1.4
 * shapes) and the parser of routed-expert tensor names.
 *
 * Matrices are checked shape for shape; vectors by element count only (an
 * exporter may write [E] or [1, E]); A_log may hold H or D values.
 */
#include "k3_man.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct builder {
    k3_man_expect *v;
    uint32_t n, cap;
    int oom;
} builder;

static void add(builder *b, int32_t layer, k3_man_tkind kind, uint32_t ndim, uint64_t d0, uint64_t d1,
                uint64_t d2, const char *fmt, ...) __attribute__((format(printf, 8, 9)));

#include <stdarg.h>
static void add(builder *b, int32_t layer, k3_man_tkind kind, uint32_t ndim, uint64_t d0, uint64_t d1,
                uint64_t d2, const char *fmt, ...)
{
    if (b->oom)
        return;
    if (b->n == b->cap) {
        uint32_t nc = b->cap ? b->cap * 2 : 64;
        k3_man_expect *nv = realloc(b->v, nc * sizeof *nv);
        if (!nv) {
            b->oom = 1;
            return;
        }
        b->v = nv;
        b->cap = nc;
    }
    char name[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    k3_man_expect *x = &b->v[b->n];
    memset(x, 0, sizeof *x);
    x->name = strdup(name);
    if (!x->name) {
        b->oom = 1;
        return;
    }
    x->kind = kind;
    x->layer = layer;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->shape[2] = d2;
    b->n++;
}

#define P K3_MAN_PREFIX
#define MAT(layer, r, c, ...) add(&b, layer, K3_MAN_T_MATRIX, 2, r, c, 0, __VA_ARGS__)
#define VEC(layer, n, ...) add(&b, layer, K3_MAN_T_VECTOR, 1, n, 0, 0, __VA_ARGS__)

static int expect_cmp(const void *a, const void *b)
{
    return strcmp(((const k3_man_expect *)a)->name, ((const k3_man_expect *)b)->name);
}

int k3_man_expect_trunk(const k3_cfg *c, k3_man_expect **out, uint32_t *n, k3_err *e)
{
    builder b = {0};
    uint64_t E = c->hidden_size, V = c->vocab_size;
    MAT(K3_PK_LAYER_EMBED, V, E, P "embed_tokens.weight");
    VEC(K3_PK_LAYER_HEAD, E, P "norm.weight");
    VEC(K3_PK_LAYER_HEAD, E, P "output_attn_res_norm.weight");
    VEC(K3_PK_LAYER_HEAD, E, P "output_attn_res_proj.weight");
    MAT(K3_PK_LAYER_HEAD, V, E, K3_MAN_HEAD_NAME);
    uint64_t H = c->kda_num_heads, D = c->kda_head_dim, Pk = H * D;
    uint64_t nh = c->num_attention_heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    for (uint32_t L = 0; L < c->num_hidden_layers; L++) {
        int32_t l = (int32_t)L;
        const char *pre = P "layers.";
        VEC(l, E, "%s%u.input_layernorm.weight", pre, L);
        VEC(l, E, "%s%u.post_attention_layernorm.weight", pre, L);
        VEC(l, E, "%s%u.self_attention_res_norm.weight", pre, L);
        VEC(l, E, "%s%u.self_attention_res_proj.weight", pre, L);
        VEC(l, E, "%s%u.mlp_res_norm.weight", pre, L);
        VEC(l, E, "%s%u.mlp_res_proj.weight", pre, L);
        if (k3_cfg_layer_is_mla(c, L)) {
            MAT(l, c->q_lora_rank, E, "%s%u.self_attn.q_a_proj.weight", pre, L);
            VEC(l, c->q_lora_rank, "%s%u.self_attn.q_a_layernorm.weight", pre, L);
            MAT(l, nh * qk, c->q_lora_rank, "%s%u.self_attn.q_b_proj.weight", pre, L);
            MAT(l, (uint64_t)c->kv_lora_rank + c->qk_rope_head_dim, E, "%s%u.self_attn.kv_a_proj_with_mqa.weight",
                pre, L);
            VEC(l, c->kv_lora_rank, "%s%u.self_attn.kv_a_layernorm.weight", pre, L);
            MAT(l, nh * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank, "%s%u.self_attn.kv_b_proj.weight",
                pre, L);
            MAT(l, E, nh * c->v_head_dim, "%s%u.self_attn.o_proj.weight", pre, L);
            if (c->mla_use_output_gate)
                MAT(l, nh * c->v_head_dim, E, "%s%u.self_attn.g_proj.weight", pre, L);
        } else {
            static const char *qkvg[] = {"q_proj", "k_proj", "v_proj", "g_proj"};
            for (int i = 0; i < 4; i++)
                MAT(l, Pk, E, "%s%u.self_attn.%s.weight", pre, L, qkvg[i]);
            MAT(l, E, Pk, "%s%u.self_attn.o_proj.weight", pre, L);
            MAT(l, D, E, "%s%u.self_attn.f_a_proj.weight", pre, L);
            MAT(l, Pk, D, "%s%u.self_attn.f_b_proj.weight", pre, L);
            MAT(l, H, E, "%s%u.self_attn.b_proj.weight", pre, L);
            static const char *conv[] = {"q_conv1d", "k_conv1d", "v_conv1d"};
            for (int i = 0; i < 3; i++)
                add(&b, l, K3_MAN_T_MATRIX, 3, Pk, 1, c->short_conv_kernel_size, "%s%u.self_attn.%s.weight", pre,
                    L, conv[i]);
            add(&b, l, K3_MAN_T_ALOG, 1, H, D, 0, "%s%u.self_attn.A_log", pre, L);
            VEC(l, Pk, "%s%u.self_attn.dt_bias", pre, L);
            VEC(l, D, "%s%u.self_attn.o_norm.weight", pre, L);
        }
        if (k3_cfg_layer_is_dense(c, L)) {
            MAT(l, c->intermediate_size, E, "%s%u.mlp.gate_proj.weight", pre, L);
            MAT(l, c->intermediate_size, E, "%s%u.mlp.up_proj.weight", pre, L);
            MAT(l, E, c->intermediate_size, "%s%u.mlp.down_proj.weight", pre, L);
        } else {
            const char *m = "block_sparse_moe";
            uint64_t Lt = c->routed_expert_hidden_size, Is = (uint64_t)c->moe_intermediate_size * c->num_shared_experts;
            MAT(l, c->num_experts, E, "%s%u.%s.gate.weight", pre, L, m);
            VEC(l, c->num_experts, "%s%u.%s.gate.e_score_correction_bias", pre, L, m);
            MAT(l, Lt, E, "%s%u.%s.routed_expert_down_proj.weight", pre, L, m);
            MAT(l, E, Lt, "%s%u.%s.routed_expert_up_proj.weight", pre, L, m);
            VEC(l, Lt, "%s%u.%s.routed_expert_norm.weight", pre, L, m);
            if (Is) {
                MAT(l, Is, E, "%s%u.%s.shared_experts.gate_proj.weight", pre, L, m);
                MAT(l, Is, E, "%s%u.%s.shared_experts.up_proj.weight", pre, L, m);
                MAT(l, E, Is, "%s%u.%s.shared_experts.down_proj.weight", pre, L, m);
            }
        }
    }
    if (b.oom) {
        k3_man_expect_free(b.v, b.n);
        return k3_err_set(e, K3_ENOMEM, "out of memory listing the expected tensors");
    }
    qsort(b.v, b.n, sizeof *b.v, expect_cmp);
    *out = b.v;
    *n = b.n;
    return 0;
}

void k3_man_expect_free(k3_man_expect *x, uint32_t n)
{
    if (!x)
        return;
    for (uint32_t i = 0; i < n; i++)
        free(x[i].name);
    free(x);
}

const k3_man_expect *k3_man_expect_find(const k3_man_expect *x, uint32_t n, const char *name)
{
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(x[mid].name, name);
        if (c == 0)
            return &x[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int k3_man_expect_match(const k3_man_expect *x, const k3_st_tensor *t)
{
    uint64_t count = 1;
    for (uint32_t d = 0; d < t->ndim; d++) {
        if (t->shape[d] && count > UINT64_MAX / t->shape[d])
            return 0;
        count *= t->shape[d];
    }
    switch (x->kind) {
    case K3_MAN_T_MATRIX:
        if (t->ndim != x->ndim)
            return 0;
        for (uint32_t d = 0; d < x->ndim; d++)
            if (t->shape[d] != x->shape[d])
                return 0;
        return 1;
    case K3_MAN_T_VECTOR:
        return count == x->shape[0];
    case K3_MAN_T_ALOG:
        return count == x->shape[0] || count == x->shape[1];
    }
    return 0;
}

/* Parse a decimal index without sign or leading zeros; advances *s. */
static int parse_index(const char **s, uint32_t *v)
{
    const char *p = *s;
    if (*p < '0' || *p > '9' || (*p == '0' && p[1] >= '0' && p[1] <= '9'))
        return 0;
    uint64_t x = 0;
    while (*p >= '0' && *p <= '9') {
        x = x * 10 + (uint64_t)(*p - '0');
        if (x > UINT32_MAX)
            return 0;
        p++;
    }
    *v = (uint32_t)x;
    *s = p;
    return 1;
}

int k3_man_expert_name(const char *name, uint32_t *layer, uint32_t *expert, int *which, int *part)
{
    static const char pre[] = K3_MAN_PREFIX "layers.";
    static const char mid[] = ".block_sparse_moe.experts.";
    if (strncmp(name, pre, sizeof pre - 1))
        return 0;
    const char *s = name + sizeof pre - 1;
    if (!parse_index(&s, layer) || strncmp(s, mid, sizeof mid - 1))
        return 0;
    s += sizeof mid - 1;
    if (!parse_index(&s, expert) || s[0] != '.' || s[1] != 'w' || s[2] < '1' || s[2] > '3' || s[3] != '.')
        return 0;
    *which = s[2] - '1';
    s += 4;
    static const char *parts[K3_MAN_XP_COUNT] = {"weight_packed", "weight_scale", "weight", "weight_scale_inv"};
    for (int i = 0; i < K3_MAN_XP_COUNT; i++)
        if (!strcmp(s, parts[i])) {
            *part = i;
            return 1;
        }
    return 0;
}
