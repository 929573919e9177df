/*
 * cfg.c - config.json: the two upstream shapes (nested under text_config /
 * text_config.linear_attn_config, or flat), the layer map, validation, and
 * the normalised flat form (see k3_cfg.h).
 *
 * Invariants: a k3_cfg returned by k3_cfg_parse has every required field
 * from the text (no invented defaults except the three "default true"
 * booleans), has passed k3_cfg_validate, and has is_mla[] set for exactly
 * num_hidden_layers layers (zero beyond). Every message names the file and
 * the field as spelled in the file.
 */
#include "k3_cfg.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "k3_io.h"
#include "st_json.h"

#define MAX_CONFIG_BYTES (16u << 20)
/* Bound on any width or count, so that products of two fit easily in 64 bits. */
#define MAX_DIM (1u << 24)

enum { T_U32, T_F64, T_BOOL };

typedef struct field {
    const char *name;       /* flat spelling, also searched in linear_attn_config */
    const char *alt[2];     /* other spellings, searched in both places */
    const char *lac_alt;    /* spelling valid only inside linear_attn_config */
    int type;
    size_t off;
    int optional_true;      /* boolean defaulting to true */
    uint32_t min, max;      /* for T_U32 */
} field;

#define U32(n, a0, a1, lac, mn, mx) {#n, {a0, a1}, lac, T_U32, offsetof(k3_cfg, n), 0, mn, mx}
#define F64(n, a0, lac) {#n, {a0, NULL}, lac, T_F64, offsetof(k3_cfg, n), 0, 0, 0}
#define BOOL(n, a0) {#n, {a0, NULL}, NULL, T_BOOL, offsetof(k3_cfg, n), 1, 0, 0}

static const field fields[] = {
    U32(hidden_size, NULL, NULL, NULL, 1, MAX_DIM),
    U32(num_hidden_layers, NULL, NULL, NULL, 1, K3_CFG_MAX_LAYERS),
    U32(vocab_size, NULL, NULL, NULL, 1, MAX_DIM),
    F64(rms_norm_eps, NULL, NULL),
    U32(kda_num_heads, NULL, NULL, "num_heads", 1, MAX_DIM),
    U32(kda_head_dim, NULL, NULL, "head_dim", 1, MAX_DIM),
    U32(short_conv_kernel_size, NULL, NULL, NULL, 1, 1024),
    F64(gate_lower_bound, NULL, NULL),
    U32(num_attention_heads, NULL, NULL, NULL, 1, MAX_DIM),
    U32(q_lora_rank, NULL, NULL, NULL, 1, MAX_DIM),
    U32(kv_lora_rank, NULL, NULL, NULL, 1, MAX_DIM),
    U32(qk_nope_head_dim, NULL, NULL, NULL, 0, MAX_DIM),
    U32(qk_rope_head_dim, NULL, NULL, NULL, 0, MAX_DIM),
    U32(v_head_dim, NULL, NULL, NULL, 1, MAX_DIM),
    BOOL(mla_use_output_gate, NULL),
    U32(num_experts, "n_routed_experts", NULL, NULL, 1, MAX_DIM),
    U32(num_experts_per_token, "num_experts_per_tok", NULL, NULL, 1, MAX_DIM),
    U32(num_shared_experts, "n_shared_experts", NULL, NULL, 0, MAX_DIM),
    U32(routed_expert_hidden_size, NULL, NULL, NULL, 32, MAX_DIM),
    U32(moe_intermediate_size, NULL, NULL, NULL, 32, MAX_DIM),
    F64(routed_scaling_factor, NULL, NULL),
    BOOL(moe_renormalize, "norm_topk_prob"),
    BOOL(latent_moe_use_norm, NULL),
    U32(first_k_dense_replace, NULL, NULL, NULL, 0, K3_CFG_MAX_LAYERS),
    U32(intermediate_size, NULL, NULL, NULL, 0, MAX_DIM),
    U32(attn_res_block_size, NULL, NULL, NULL, 1, K3_CFG_MAX_LAYERS),
    F64(situ_beta, "activation_situ_beta", NULL),
    F64(situ_linear_beta, "activation_situ_linear_beta", NULL),
};
#define NFIELDS (sizeof fields / sizeof fields[0])

/* Where fields are looked up. */
typedef struct scope {
    const cJSON *lm;        /* root or text_config */
    const char *lm_name;    /* "" or "text_config." */
    const cJSON *lac;       /* linear_attn_config or NULL */
    const char *lac_name;
    const cJSON *root;
    const char *path;
    k3_err *e;
} scope;

/* The member named key of obj (case-sensitive); *dup set if it occurs twice.
 * A null member counts as absent (upstream configs write null for unset). */
static const cJSON *member(const cJSON *obj, const char *key, int *dup)
{
    const cJSON *found = NULL;
    *dup = 0;
    if (!obj)
        return NULL;
    for (const cJSON *c = obj->child; c; c = c->next)
        if (c->string && !strcmp(c->string, key)) {
            if (found)
                *dup = 1;
            else
                found = c;
        }
    return found && !cJSON_IsNull(found) ? found : NULL;
}

/* A found value and where it was. */
typedef struct hit {
    const cJSON *v;
    char where[160];
} hit;

static int lookup_in(scope *s, const cJSON *obj, const char *prefix, const char *key, hit *hits, int *nhits)
{
    int dup;
    const cJSON *v = member(obj, key, &dup);
    if (dup)
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s%s given twice", s->path, prefix, key);
    if (v && *nhits < 8) {
        hits[*nhits].v = v;
        snprintf(hits[*nhits].where, sizeof hits[*nhits].where, "%s%s", prefix, key);
        (*nhits)++;
    }
    return 0;
}

/* Every spelling of f in every place it may be. */
static int lookup(scope *s, const field *f, hit *hits, int *n)
{
    int rc;
    *n = 0;
    const char *names[3] = {f->name, f->alt[0], f->alt[1]};
    for (int i = 0; i < 3; i++) {
        if (!names[i])
            continue;
        if ((rc = lookup_in(s, s->lm, s->lm_name, names[i], hits, n)))
            return rc;
        if (s->lac && (rc = lookup_in(s, s->lac, s->lac_name, names[i], hits, n)))
            return rc;
    }
    if (f->lac_alt && s->lac && (rc = lookup_in(s, s->lac, s->lac_name, f->lac_alt, hits, n)))
        return rc;
    return 0;
}

static int get_u32(scope *s, const hit *h, uint32_t min, uint32_t max, uint32_t *out)
{
    if (!cJSON_IsNumber(h->v))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must be an integer, found %s", s->path, h->where,
                          cJSON_IsString(h->v) ? "a string" : cJSON_IsBool(h->v) ? "a boolean" : cJSON_IsArray(h->v) ? "an array" : "an object");
    double d = h->v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must be an integer, found %g", s->path, h->where, d);
    if (d < 0)
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must not be negative, found %.0f", s->path, h->where, d);
    if (d < min || d > max)
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s = %.0f is outside [%u, %u]", s->path, h->where, d, min, max);
    *out = (uint32_t)d;
    return 0;
}

static int get_f64(scope *s, const hit *h, double *out)
{
    if (!cJSON_IsNumber(h->v) || !isfinite(h->v->valuedouble))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must be a finite number", s->path, h->where);
    *out = h->v->valuedouble;
    return 0;
}

static int get_bool(scope *s, const hit *h, int *out)
{
    if (!cJSON_IsBool(h->v))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must be true or false", s->path, h->where);
    *out = cJSON_IsTrue(h->v);
    return 0;
}

/* Two spellings of one field must agree. */
static int same_value(const cJSON *a, const cJSON *b)
{
    if (cJSON_IsNumber(a) && cJSON_IsNumber(b))
        return a->valuedouble == b->valuedouble;
    if (cJSON_IsBool(a) && cJSON_IsBool(b))
        return cJSON_IsTrue(a) == cJSON_IsTrue(b);
    if (cJSON_IsArray(a) && cJSON_IsArray(b)) {
        const cJSON *x = a->child, *y = b->child;
        for (; x && y; x = x->next, y = y->next)
            if (!same_value(x, y))
                return 0;
        return !x && !y;
    }
    return 0;
}

static int agree(scope *s, const hit *hits, int n)
{
    for (int i = 1; i < n; i++)
        if (!same_value(hits[0].v, hits[i].v))
            return k3_err_set(s->e, K3_EFORMAT, "%s: %s and %s are given with different values", s->path,
                              hits[0].where, hits[i].where);
    return 0;
}

/* A one-based layer list into mark[] (1 per listed layer). */
static int layer_list(scope *s, const hit *h, uint32_t layers, uint8_t *mark)
{
    if (!cJSON_IsArray(h->v))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s must be an array of one-based layer numbers", s->path, h->where);
    int i = 0;
    for (const cJSON *c = h->v->child; c; c = c->next, i++) {
        if (!cJSON_IsNumber(c) || !isfinite(c->valuedouble) || c->valuedouble != floor(c->valuedouble))
            return k3_err_set(s->e, K3_EFORMAT, "%s: %s[%d] must be an integer", s->path, h->where, i);
        double d = c->valuedouble;
        if (d < 1 || d > layers)
            return k3_err_set(s->e, K3_EFORMAT, "%s: %s[%d] = %.0f is outside 1..%u (layer numbers are one-based)",
                              s->path, h->where, i, d, layers);
        if (mark[(uint32_t)d - 1])
            return k3_err_set(s->e, K3_EFORMAT, "%s: %s lists layer %.0f twice", s->path, h->where, d);
        mark[(uint32_t)d - 1] = 1;
    }
    return 0;
}

static int object_or_absent(scope *s, const cJSON *obj, const char *prefix, const char *key, const cJSON **out)
{
    int dup;
    *out = member(obj, key, &dup);
    if (dup)
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s%s given twice", s->path, prefix, key);
    if (*out && !cJSON_IsObject(*out))
        return k3_err_set(s->e, K3_EFORMAT, "%s: %s%s must be an object", s->path, prefix, key);
    return 0;
}

static int parse_tree(k3_cfg *cfg, const cJSON *root, const char *path, k3_err *e)
{
    int rc;
    scope s = {.root = root, .lm = root, .lm_name = "", .path = path, .e = e};
    if (!cJSON_IsObject(root))
        return k3_err_set(e, K3_EFORMAT, "%s: byte 0: config is not a JSON object", path);
    const cJSON *tc;
    if ((rc = object_or_absent(&s, root, "", "text_config", &tc)))
        return rc;
    if (tc) {
        s.lm = tc;
        s.lm_name = "text_config.";
    }
    const cJSON *lac;
    if ((rc = object_or_absent(&s, s.lm, s.lm_name, "linear_attn_config", &lac)))
        return rc;
    if (lac) {
        s.lac = lac;
        s.lac_name = tc ? "text_config.linear_attn_config." : "linear_attn_config.";
    } else if (tc) {
        /* a nested config whose linear_attn_config sits at the root */
        if ((rc = object_or_absent(&s, root, "", "linear_attn_config", &lac)))
            return rc;
        s.lac = lac;
        s.lac_name = "linear_attn_config.";
    }

    char missing[K3_ERR_MSG_MAX];
    size_t mlen = 0;
    int nmissing = 0;
    missing[0] = '\0';
#define NOTE_MISSING(name)                                                                           \
    do {                                                                                             \
        int k_ = snprintf(missing + mlen, sizeof missing - mlen, "%s%s", nmissing ? ", " : "", name); \
        if (k_ > 0 && (size_t)k_ < sizeof missing - mlen)                                           \
            mlen += (size_t)k_;                                                                      \
        nmissing++;                                                                                  \
    } while (0)

    hit hits[8];
    int n;
    for (size_t i = 0; i < NFIELDS; i++) {
        const field *f = &fields[i];
        if ((rc = lookup(&s, f, hits, &n)))
            return rc;
        if (n == 0) {
            if (f->optional_true)
                *(int *)((char *)cfg + f->off) = 1;
            else
                NOTE_MISSING(f->name);
            continue;
        }
        if ((rc = agree(&s, hits, n)))
            return rc;
        if (f->type == T_U32)
            rc = get_u32(&s, &hits[0], f->min, f->max, (uint32_t *)((char *)cfg + f->off));
        else if (f->type == T_F64)
            rc = get_f64(&s, &hits[0], (double *)((char *)cfg + f->off));
        else
            rc = get_bool(&s, &hits[0], (int *)((char *)cfg + f->off));
        if (rc)
            return rc;
    }

    /* the layer map */
    static const field full_f = {"full_attn_layers", {NULL, NULL}, NULL, 0, 0, 0, 0, 0};
    static const field kda_f = {"kda_layers", {NULL, NULL}, NULL, 0, 0, 0, 0, 0};
    hit fh[8], kh[8];
    int nf, nk;
    if ((rc = lookup(&s, &full_f, fh, &nf)) || (rc = lookup(&s, &kda_f, kh, &nk)))
        return rc;
    if (!nf && !nk)
        NOTE_MISSING("full_attn_layers (or kda_layers)");

    /* the MXFP4 group: optional, 32 if present */
    cfg->group_size = 32;
    const cJSON *qc = NULL;
    hit qh;
    int qn = 0;
    if ((rc = object_or_absent(&s, s.lm, s.lm_name, "quantization_config", &qc)))
        return rc;
    if (qc && (rc = lookup_in(&s, qc, tc ? "text_config.quantization_config." : "quantization_config.", "group_size",
                              &qh, &qn)))
        return rc;
    if (!qn && tc) {
        if ((rc = object_or_absent(&s, root, "", "quantization_config", &qc)))
            return rc;
        if (qc && (rc = lookup_in(&s, qc, "quantization_config.", "group_size", &qh, &qn)))
            return rc;
    }

    if (nmissing)
        return k3_err_set(e, K3_EFORMAT, "%s: missing required field%s: %s", path, nmissing > 1 ? "s" : "", missing);
#undef NOTE_MISSING

    if (qn) {
        uint32_t g;
        if ((rc = get_u32(&s, &qh, 0, UINT32_MAX, &g)))
            return rc;
        if (g != 32)
            return k3_err_set(e, K3_EFORMAT, "%s: %s = %u: MXFP4 groups are 32 elements", path, qh.where, g);
    }

    if (nf && (rc = agree(&s, fh, nf)))
        return rc;
    if (nk && (rc = agree(&s, kh, nk)))
        return rc;
    uint32_t layers = cfg->num_hidden_layers;
    uint8_t full[K3_CFG_MAX_LAYERS] = {0}, kda[K3_CFG_MAX_LAYERS] = {0};
    if (nf && (rc = layer_list(&s, &fh[0], layers, full)))
        return rc;
    if (nk && (rc = layer_list(&s, &kh[0], layers, kda)))
        return rc;
    for (uint32_t l = 0; l < layers; l++) {
        if (nf && nk && full[l] == kda[l])
            return k3_err_set(e, K3_EFORMAT, "%s: %s and %s are not complementary: layer %u is %s", path, fh[0].where,
                              kh[0].where, l + 1, full[l] ? "in both" : "in neither");
        cfg->is_mla[l] = nf ? full[l] : !kda[l];
    }
    return k3_cfg_validate(cfg, path, e);
}

int k3_cfg_parse(k3_cfg *cfg, const char *json, uint64_t len, const char *path, k3_err *e)
{
    memset(cfg, 0, sizeof *cfg);
    size_t bad;
    if (len > MAX_CONFIG_BYTES)
        return k3_err_set(e, K3_ELIMIT, "%s: %" PRIu64 " bytes is larger than the %u-byte limit for a config", path, len,
                          MAX_CONFIG_BYTES);
    if (!k3_jc_utf8_valid((const uint8_t *)json, (size_t)len, &bad))
        return k3_err_set(e, K3_EFORMAT, "%s: byte %zu: not valid UTF-8", path, bad);
    const char *end = NULL;
    /* cJSON refuses nesting deeper than CJSON_NESTING_LIMIT (1000) levels */
    cJSON *root = cJSON_ParseWithLengthOpts(json, (size_t)len, &end, 0);
    if (!root) {
        size_t at = end && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return k3_err_set(e, K3_EFORMAT, "%s: byte %zu: not valid JSON (or nested deeper than %d levels)", path, at,
                          CJSON_NESTING_LIMIT);
    }
    /* only whitespace may follow the value */
    for (const char *p = end; p && p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return k3_err_set(e, K3_EFORMAT, "%s: byte %zu: text after the JSON object", path, (size_t)(p - json));
        }
    int rc = parse_tree(cfg, root, path, e);
    cJSON_Delete(root);
    return rc;
}

int k3_cfg_load(k3_cfg *cfg, const char *path, k3_err *e)
{
    char file[4096];
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        int rc = k3_io_path_join(file, sizeof file, path, "config.json", e);
        if (rc)
            return rc;
    } else {
        snprintf(file, sizeof file, "%s", path);
    }
    char *text;
    uint64_t len;
    int rc = k3_io_read_file(file, MAX_CONFIG_BYTES, &text, &len, e);
    if (rc)
        return rc;
    rc = k3_cfg_parse(cfg, text, len, file, e);
    free(text);
    return rc;
}

int k3_cfg_validate(const k3_cfg *c, const char *path, k3_err *e)
{
    for (size_t i = 0; i < NFIELDS; i++) {
        const field *f = &fields[i];
        if (f->type != T_U32)
            continue;
        uint32_t v = *(const uint32_t *)((const char *)c + f->off);
        if (v < f->min || v > f->max)
            return k3_err_set(e, K3_EFORMAT, "%s: %s = %u is outside [%u, %u]", path, f->name, v, f->min, f->max);
    }
    if (!(c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return k3_err_set(e, K3_EFORMAT, "%s: rms_norm_eps = %g must be in (0, 1)", path, c->rms_norm_eps);
    if (!(c->gate_lower_bound < 0 && c->gate_lower_bound >= -1e6))
        return k3_err_set(e, K3_EFORMAT, "%s: gate_lower_bound = %g must be negative", path, c->gate_lower_bound);
    if (!(c->routed_scaling_factor > 0 && c->routed_scaling_factor <= 1e6))
        return k3_err_set(e, K3_EFORMAT, "%s: routed_scaling_factor = %g must be positive", path, c->routed_scaling_factor);
    if (!(c->situ_beta > 0 && c->situ_beta <= 1e6))
        return k3_err_set(e, K3_EFORMAT, "%s: situ_beta = %g must be positive", path, c->situ_beta);
    if (!(c->situ_linear_beta > 0 && c->situ_linear_beta <= 1e6))
        return k3_err_set(e, K3_EFORMAT, "%s: situ_linear_beta = %g must be positive", path, c->situ_linear_beta);
    if (c->qk_nope_head_dim + c->qk_rope_head_dim == 0)
        return k3_err_set(e, K3_EFORMAT, "%s: qk_nope_head_dim + qk_rope_head_dim must be positive", path);
    if (c->num_experts_per_token > c->num_experts)
        return k3_err_set(e, K3_EFORMAT, "%s: num_experts_per_token = %u is more than num_experts = %u", path,
                          c->num_experts_per_token, c->num_experts);
    if (c->routed_expert_hidden_size % 32)
        return k3_err_set(e, K3_EFORMAT, "%s: routed_expert_hidden_size = %u is not a multiple of 32 (MXFP4 groups)", path,
                          c->routed_expert_hidden_size);
    if (c->moe_intermediate_size % 32)
        return k3_err_set(e, K3_EFORMAT, "%s: moe_intermediate_size = %u is not a multiple of 32 (MXFP4 groups)", path,
                          c->moe_intermediate_size);
    if (c->first_k_dense_replace > c->num_hidden_layers)
        return k3_err_set(e, K3_EFORMAT, "%s: first_k_dense_replace = %u is more than num_hidden_layers = %u", path,
                          c->first_k_dense_replace, c->num_hidden_layers);
    if (c->first_k_dense_replace > 0 && c->intermediate_size == 0)
        return k3_err_set(e, K3_EFORMAT, "%s: intermediate_size is 0 but %u dense layers need it", path,
                          c->first_k_dense_replace);
    if (c->group_size != 32)
        return k3_err_set(e, K3_EFORMAT, "%s: group_size = %u: MXFP4 groups are 32 elements", path, c->group_size);
    if ((c->mla_use_output_gate | c->moe_renormalize | c->latent_moe_use_norm) & ~1)
        return k3_err_set(e, K3_EFORMAT, "%s: a boolean field is neither 0 nor 1", path);
    for (uint32_t l = 0; l < K3_CFG_MAX_LAYERS; l++)
        if (c->is_mla[l] > 1 || (l >= c->num_hidden_layers && c->is_mla[l]))
            return k3_err_set(e, K3_EFORMAT, "%s: layer map marks layer %u, beyond num_hidden_layers = %u", path, l + 1,
                              c->num_hidden_layers);
    return 0;
}

/* ---- the normalised flat form --------------------------------------------- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        char *np = realloc(b->p, b->cap * 2 + (size_t)n);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = b->cap * 2 + (size_t)n;
    }
}

/* The shortest %g form that reads back as the same double; always with a '.'
 * or an exponent so that the field is visibly a real number. */
static void put_double(sbuf *b, double d)
{
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*g", prec, d);
        if (strtod(tmp, NULL) == d)
            break;
    }
    if (!strpbrk(tmp, ".eE"))
        strcat(tmp, ".0");
    put(b, "%s", tmp);
}

char *k3_cfg_to_json(const k3_cfg *c)
{
    sbuf b = {malloc(4096), 0, 4096, 0};
    if (!b.p)
        return NULL;
    put(&b, "{\n");
    for (size_t i = 0; i < NFIELDS; i++) {
        const field *f = &fields[i];
        const char *at = (const char *)c + f->off;
        put(&b, "  \"%s\": ", f->name);
        if (f->type == T_U32)
            put(&b, "%u", *(const uint32_t *)at);
        else if (f->type == T_F64)
            put_double(&b, *(const double *)at);
        else
            put(&b, "%s", *(const int *)at ? "true" : "false");
        put(&b, ",\n");
    }
    put(&b, "  \"full_attn_layers\": [");
    int first = 1;
    for (uint32_t l = 0; l < c->num_hidden_layers && l < K3_CFG_MAX_LAYERS; l++)
        if (c->is_mla[l]) {
            put(&b, "%s%u", first ? "" : ", ", l + 1);
            first = 0;
        }
    put(&b, "],\n  \"quantization_config\": {\"group_size\": %u}\n}\n", c->group_size);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
