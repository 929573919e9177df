/*
 * t_cfg.c - config.json: the nested K3 shape and the flat shape, alternate
 * spellings, the layer map, all missing fields in one message, validation,
 * hostile text, and parse(to_json(c)) == c.
 */
#include "k3_cfg.h"
#include "k3_io.h"
#include "k3_test.h"

#include <stdarg.h>
#include <stdlib.h>

/* K3's text config in the nested shape, with the surrounding fields a real
 * multimodal config carries (ignored by the parser). */
static const char k3_nested[] =
    "{\n"
    "  \"architectures\": [\"KimiK3ForConditionalGeneration\"],\n"
    "  \"model_type\": \"kimi_k3\",\n"
    "  \"vocab_size\": 163840,\n"
    "  \"vision_config\": {\"hidden_size\": 1152, \"num_hidden_layers\": 27, \"patch_size\": 14},\n"
    "  \"text_config\": {\n"
    "    \"model_type\": \"kimi_linear\",\n"
    "    \"hidden_size\": 7168, \"num_hidden_layers\": 93, \"vocab_size\": 163840,\n"
    "    \"rms_norm_eps\": 1e-05, \"hidden_act\": \"situ\",\n"
    "    \"activation_situ_beta\": 4.0, \"activation_situ_linear_beta\": 25.0,\n"
    "    \"num_attention_heads\": 96, \"num_key_value_heads\": 96,\n"
    "    \"q_lora_rank\": 1536, \"kv_lora_rank\": 512, \"qk_nope_head_dim\": 128,\n"
    "    \"qk_rope_head_dim\": 64, \"v_head_dim\": 128, \"mla_use_nope\": true,\n"
    "    \"num_experts\": 896, \"num_experts_per_token\": 16, \"num_shared_experts\": 2,\n"
    "    \"routed_expert_hidden_size\": 3584, \"moe_intermediate_size\": 3072,\n"
    "    \"routed_scaling_factor\": 1.0, \"first_k_dense_replace\": 1,\n"
    "    \"intermediate_size\": 33792, \"attn_res_block_size\": 12,\n"
    "    \"rope_scaling\": null, \"rope_theta\": 50000.0, \"max_position_embeddings\": 262144,\n"
    "    \"tie_word_embeddings\": false, \"eos_token_id\": [163586],\n"
    "    \"linear_attn_config\": {\n"
    "      \"num_heads\": 96, \"head_dim\": 128, \"short_conv_kernel_size\": 4,\n"
    "      \"gate_lower_bound\": -5.0, \"use_full_rank_gate\": true,\n"
    "      \"full_attn_layers\": [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 93],\n"
    "      \"kda_layers\": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26, 27, 29, 30, 31,\n"
    "                     33, 34, 35, 37, 38, 39, 41, 42, 43, 45, 46, 47, 49, 50, 51, 53, 54, 55, 57, 58, 59,\n"
    "                     61, 62, 63, 65, 66, 67, 69, 70, 71, 73, 74, 75, 77, 78, 79, 81, 82, 83, 85, 86, 87,\n"
    "                     89, 90, 91]\n"
    "    },\n"
    "    \"quantization_config\": {\"quant_method\": \"mxfp4\", \"group_size\": 32}\n"
    "  }\n"
    "}\n";

/* The flat shape, as key/value pairs so tests can change one thing. */
static const char *flat_kv[][2] = {
    {"hidden_size", "64"},           {"num_hidden_layers", "4"},         {"vocab_size", "300"},
    {"rms_norm_eps", "1e-6"},        {"kda_num_heads", "2"},             {"kda_head_dim", "16"},
    {"short_conv_kernel_size", "4"}, {"gate_lower_bound", "-5.0"},       {"num_attention_heads", "2"},
    {"q_lora_rank", "24"},           {"kv_lora_rank", "16"},             {"qk_nope_head_dim", "16"},
    {"qk_rope_head_dim", "8"},       {"v_head_dim", "16"},               {"num_experts", "8"},
    {"num_experts_per_token", "2"},  {"num_shared_experts", "1"},        {"routed_expert_hidden_size", "32"},
    {"moe_intermediate_size", "64"}, {"routed_scaling_factor", "2.5"},   {"first_k_dense_replace", "1"},
    {"intermediate_size", "96"},     {"attn_res_block_size", "2"},       {"situ_beta", "4.0"},
    {"situ_linear_beta", "25.0"},    {"full_attn_layers", "[4]"},
};
#define NFLAT (sizeof flat_kv / sizeof flat_kv[0])

/* The flat config with overrides: pairs (key, value) ending with NULL; a NULL
 * value deletes the key, a key not in the base is appended. Heap. */
static char *flat(const char *k0, ...)
{
    const char *ok[16], *ov[16];
    int n = 0;
    va_list ap;
    va_start(ap, k0);
    for (const char *k = k0; k && n < 16; k = va_arg(ap, const char *)) {
        ok[n] = k;
        ov[n] = va_arg(ap, const char *);
        n++;
    }
    va_end(ap);
    char *s = malloc(16384);
    size_t len = (size_t)sprintf(s, "{");
    int first = 1, used[16] = {0};
    for (size_t i = 0; i < NFLAT; i++) {
        const char *v = flat_kv[i][1];
        for (int j = 0; j < n; j++)
            if (!strcmp(ok[j], flat_kv[i][0])) {
                v = ov[j];
                used[j] = 1;
            }
        if (!v)
            continue;
        len += (size_t)sprintf(s + len, "%s\"%s\": %s", first ? "" : ", ", flat_kv[i][0], v);
        first = 0;
    }
    for (int j = 0; j < n; j++)
        if (!used[j] && ov[j]) {
            len += (size_t)sprintf(s + len, "%s\"%s\": %s", first ? "" : ", ", ok[j], ov[j]);
            first = 0;
        }
    sprintf(s + len, "}");
    return s;
}

static int parse_text(k3_cfg *c, const char *text, k3_err *e)
{
    k3_err_clear(e);
    return k3_cfg_parse(c, text, strlen(text), "cfg/config.json", e);
}

/* Expect text (heap, freed) rejected with K3_EFORMAT and a message naming
 * the file and containing substr. */
static void check_bad(char *text, const char *substr)
{
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(parse_text(&c, text, &e), K3_EFORMAT);
    CHECK_STR_CONTAINS(e.msg, "cfg/config.json: ");
    CHECK_STR_CONTAINS(e.msg, substr);
    free(text);
}

static void check_round_trip(const k3_cfg *c)
{
    char *j1 = k3_cfg_to_json(c);
    CHECK(j1 != NULL);
    k3_cfg d;
    k3_err e = {0};
    CHECK_EQ_INT(k3_cfg_parse(&d, j1, strlen(j1), "normalised", &e), 0);
    CHECK_STR_EQ(e.msg, "");
    CHECK(memcmp(c, &d, sizeof d) == 0);
    char *j2 = k3_cfg_to_json(&d);
    CHECK_STR_EQ(j1, j2);
    free(j1);
    free(j2);
}

K3_TEST(cfg_reads_the_nested_k3_config)
{
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(parse_text(&c, k3_nested, &e), 0);
    CHECK_EQ_INT(c.hidden_size, 7168);
    CHECK_EQ_INT(c.num_hidden_layers, 93);
    CHECK_EQ_INT(c.vocab_size, 163840);
    CHECK(c.rms_norm_eps == 1e-5);
    CHECK_EQ_INT(c.kda_num_heads, 96);
    CHECK_EQ_INT(c.kda_head_dim, 128);
    CHECK_EQ_INT(c.short_conv_kernel_size, 4);
    CHECK(c.gate_lower_bound == -5.0);
    CHECK_EQ_INT(c.num_attention_heads, 96);
    CHECK_EQ_INT(c.q_lora_rank, 1536);
    CHECK_EQ_INT(c.kv_lora_rank, 512);
    CHECK_EQ_INT(c.qk_nope_head_dim, 128);
    CHECK_EQ_INT(c.qk_rope_head_dim, 64);
    CHECK_EQ_INT(c.v_head_dim, 128);
    CHECK_EQ_INT(c.mla_use_output_gate, 1);
    CHECK_EQ_INT(c.num_experts, 896);
    CHECK_EQ_INT(c.num_experts_per_token, 16);
    CHECK_EQ_INT(c.num_shared_experts, 2);
    CHECK_EQ_INT(c.routed_expert_hidden_size, 3584);
    CHECK_EQ_INT(c.moe_intermediate_size, 3072);
    CHECK(c.routed_scaling_factor == 1.0);
    CHECK_EQ_INT(c.moe_renormalize, 1);
    CHECK_EQ_INT(c.latent_moe_use_norm, 1);
    CHECK_EQ_INT(c.first_k_dense_replace, 1);
    CHECK_EQ_INT(c.intermediate_size, 33792);
    CHECK_EQ_INT(c.attn_res_block_size, 12);
    CHECK(c.situ_beta == 4.0);
    CHECK(c.situ_linear_beta == 25.0);
    CHECK_EQ_INT(c.group_size, 32);
    /* docs/MODEL.md §1.2: 24 MLA layers, zero-based 3, 7, ..., 87, 91, 92 */
    int mla = 0;
    for (uint32_t l = 0; l < 93; l++) {
        int expect = (l % 4 == 3) || l == 92;
        CHECK_EQ_INT(k3_cfg_layer_is_mla(&c, l), expect);
        mla += k3_cfg_layer_is_mla(&c, l);
    }
    CHECK_EQ_INT(mla, 24);
    CHECK(!k3_cfg_layer_is_mla(&c, 0) && k3_cfg_layer_is_dense(&c, 0));
    CHECK(!k3_cfg_layer_is_dense(&c, 1));
    CHECK_EQ_INT(c.is_mla[93], 0);
    check_round_trip(&c);
}

K3_TEST(cfg_reads_the_flat_shape_and_round_trips)
{
    k3_cfg c;
    k3_err e = {0};
    char *t = flat(NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
    CHECK_EQ_INT(c.hidden_size, 64);
    CHECK(c.rms_norm_eps == 1e-6);
    CHECK(c.routed_scaling_factor == 2.5);
    CHECK_EQ_INT(c.is_mla[3], 1);
    CHECK_EQ_INT(c.is_mla[0] + c.is_mla[1] + c.is_mla[2], 0);
    check_round_trip(&c);
    char *j = k3_cfg_to_json(&c);
    CHECK_STR_CONTAINS(j, "\"full_attn_layers\": [4]");
    CHECK_STR_CONTAINS(j, "\"rms_norm_eps\": 1e-06");
    CHECK_STR_CONTAINS(j, "\"gate_lower_bound\": -5.0");
    CHECK_STR_CONTAINS(j, "\"quantization_config\": {\"group_size\": 32}");
    free(j);
}

K3_TEST(cfg_round_trips_awkward_doubles_and_false_booleans)
{
    k3_cfg c;
    k3_err e = {0};
    char *t = flat("rms_norm_eps", "1.0000000000000002e-06", "routed_scaling_factor", "0.1", "situ_beta", "3.3333333333333335",
                   "mla_use_output_gate", "false", "moe_renormalize", "false", "latent_moe_use_norm", "false", NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
    CHECK_EQ_INT(c.mla_use_output_gate + c.moe_renormalize + c.latent_moe_use_norm, 0);
    check_round_trip(&c);
}

K3_TEST(cfg_accepts_the_alternate_spellings)
{
    const char *text =
        "{\"hidden_size\": 64, \"num_hidden_layers\": 4, \"vocab_size\": 300, \"rms_norm_eps\": 1e-6,"
        " \"num_attention_heads\": 2, \"q_lora_rank\": 24, \"kv_lora_rank\": 16, \"qk_nope_head_dim\": 16,"
        " \"qk_rope_head_dim\": 8, \"v_head_dim\": 16, \"n_routed_experts\": 8, \"num_experts_per_tok\": 2,"
        " \"n_shared_experts\": 1, \"routed_expert_hidden_size\": 32, \"moe_intermediate_size\": 64,"
        " \"routed_scaling_factor\": 2.5, \"norm_topk_prob\": false, \"first_k_dense_replace\": 0,"
        " \"intermediate_size\": 0, \"attn_res_block_size\": 2, \"activation_situ_beta\": 4.0,"
        " \"activation_situ_linear_beta\": 25.0, \"head_dim\": 999,"
        " \"linear_attn_config\": {\"num_heads\": 2, \"head_dim\": 16, \"short_conv_kernel_size\": 4,"
        "   \"gate_lower_bound\": -5.0, \"kda_layers\": [1, 3]}}";
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(parse_text(&c, text, &e), 0);
    CHECK_STR_EQ(e.msg, "");
    CHECK_EQ_INT(c.num_experts, 8);
    CHECK_EQ_INT(c.num_experts_per_token, 2);
    CHECK_EQ_INT(c.num_shared_experts, 1);
    CHECK_EQ_INT(c.moe_renormalize, 0);
    CHECK_EQ_INT(c.kda_num_heads, 2);
    CHECK_EQ_INT(c.kda_head_dim, 16); /* the root's head_dim is not KDA's */
    CHECK(c.situ_beta == 4.0 && c.situ_linear_beta == 25.0);
    /* kda_layers alone: the others are MLA */
    CHECK_EQ_INT(c.is_mla[0], 0);
    CHECK_EQ_INT(c.is_mla[1], 1);
    CHECK_EQ_INT(c.is_mla[2], 0);
    CHECK_EQ_INT(c.is_mla[3], 1);
    check_round_trip(&c);
}

K3_TEST(cfg_reads_a_nested_config_with_linear_attn_config_at_the_root)
{
    char *t = strdup(k3_nested);
    /* move linear_attn_config out of text_config: cut it and append it at the root */
    char *a = strstr(t, "\"linear_attn_config\"");
    char *b = strstr(a, "},\n") + 3;
    size_t cut = (size_t)(b - a);
    char *lac = strndup(a, cut - 2);
    memmove(a, b, strlen(b) + 1);
    char *end = strrchr(t, '}');
    char *text = malloc(strlen(t) + strlen(lac) + 8);
    sprintf(text, "%.*s, %s}\n", (int)(end - t), t, lac);
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(parse_text(&c, text, &e), 0);
    CHECK_STR_EQ(e.msg, "");
    CHECK_EQ_INT(c.kda_num_heads, 96);
    CHECK_EQ_INT(c.is_mla[92], 1);
    free(t);
    free(lac);
    free(text);
}

K3_TEST(cfg_reports_every_missing_field_at_once)
{
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(parse_text(&c, "{\"model_type\": \"kimi_linear\", \"mla_use_output_gate\": true}", &e), K3_EFORMAT);
    const char *names[] = {"hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "kda_num_heads",
                           "kda_head_dim", "short_conv_kernel_size", "gate_lower_bound", "num_attention_heads",
                           "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                           "num_experts", "num_experts_per_token", "num_shared_experts", "routed_expert_hidden_size",
                           "moe_intermediate_size", "routed_scaling_factor", "first_k_dense_replace",
                           "intermediate_size", "attn_res_block_size", "situ_beta", "situ_linear_beta",
                           "full_attn_layers (or kda_layers)"};
    CHECK_STR_CONTAINS(e.msg, "cfg/config.json: missing required fields: hidden_size, num_hidden_layers, ");
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        CHECK_STR_CONTAINS(e.msg, names[i]);
    /* defaulted booleans and the group size are not required */
    CHECK(strstr(e.msg, "moe_renormalize") == NULL);
    CHECK(strstr(e.msg, "latent_moe_use_norm") == NULL);
    CHECK(strstr(e.msg, "group_size") == NULL);
    CHECK(strstr(e.msg, "mla_use_output_gate") == NULL);
}

K3_TEST(cfg_reports_two_missing_fields_and_treats_null_as_missing)
{
    check_bad(flat("vocab_size", NULL, "situ_beta", "null", NULL), "missing required fields: vocab_size, situ_beta");
    check_bad(flat("full_attn_layers", NULL, NULL), "missing required field: full_attn_layers (or kda_layers)");
}

K3_TEST(cfg_defaults_only_the_three_booleans_and_the_group_size)
{
    k3_cfg c;
    k3_err e = {0};
    char *t = flat(NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
    CHECK_EQ_INT(c.mla_use_output_gate, 1);
    CHECK_EQ_INT(c.moe_renormalize, 1);
    CHECK_EQ_INT(c.latent_moe_use_norm, 1);
    CHECK_EQ_INT(c.group_size, 32);
}

K3_TEST(cfg_ignores_unknown_fields)
{
    k3_cfg c;
    k3_err e = {0};
    char *t = flat("rope_scaling", "{\"type\": \"yarn\", \"factor\": [1, 2, {\"x\": null}]}", "torch_dtype", "\"bfloat16\"",
                   "vision_config", "{\"hidden_size\": \"not a number\"}", NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
}

K3_TEST(cfg_loads_config_json_from_a_directory)
{
    const char *dir = k3t_tmpdir();
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    k3_err e = {0};
    CHECK_EQ_INT(k3_io_write_file_atomic(path, k3_nested, strlen(k3_nested), &e), 0);
    k3_cfg c;
    CHECK_EQ_INT(k3_cfg_load(&c, dir, &e), 0);
    CHECK_EQ_INT(c.num_experts, 896);
    CHECK_EQ_INT(k3_cfg_load(&c, path, &e), 0);
    k3_err_clear(&e);
    snprintf(path, sizeof path, "%s/nope", dir);
    CHECK_EQ_INT(k3_cfg_load(&c, path, &e), K3_ENOENT);
}

/* ---- validation and hostile text ----------------------------------------- */

K3_TEST(cfg_rejects_top_k_above_the_expert_count)
{
    check_bad(flat("num_experts_per_token", "9", NULL), "num_experts_per_token = 9 is more than num_experts = 8");
}

K3_TEST(cfg_rejects_mxfp4_widths_not_divisible_by_32)
{
    check_bad(flat("routed_expert_hidden_size", "48", NULL), "routed_expert_hidden_size = 48 is not a multiple of 32");
    check_bad(flat("moe_intermediate_size", "80", NULL), "moe_intermediate_size = 80 is not a multiple of 32");
    check_bad(flat("moe_intermediate_size", "16", NULL), "moe_intermediate_size = 16 is outside [32, ");
}

K3_TEST(cfg_rejects_a_group_size_other_than_32)
{
    check_bad(flat("quantization_config", "{\"group_size\": 16}", NULL), "quantization_config.group_size = 16: MXFP4 groups");
    check_bad(flat("quantization_config", "{\"group_size\": \"32\"}", NULL), "quantization_config.group_size must be an integer");
    k3_cfg c;
    k3_err e = {0};
    char *t = flat("quantization_config", "{\"group_size\": 32, \"quant_method\": \"mxfp4\"}", NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
}

K3_TEST(cfg_rejects_non_integers_negatives_and_wrong_types)
{
    check_bad(flat("hidden_size", "64.5", NULL), "hidden_size must be an integer, found 64.5");
    check_bad(flat("hidden_size", "-64", NULL), "hidden_size must not be negative");
    check_bad(flat("hidden_size", "\"64\"", NULL), "hidden_size must be an integer, found a string");
    check_bad(flat("num_experts", "true", NULL), "num_experts must be an integer, found a boolean");
    check_bad(flat("vocab_size", "1e300", NULL), "vocab_size = ");
    check_bad(flat("hidden_size", "0", NULL), "hidden_size = 0 is outside [1, ");
    check_bad(flat("rms_norm_eps", "\"1e-6\"", NULL), "rms_norm_eps must be a finite number");
    check_bad(flat("moe_renormalize", "1", NULL), "moe_renormalize must be true or false");
}

K3_TEST(cfg_rejects_out_of_range_reals)
{
    check_bad(flat("rms_norm_eps", "0", NULL), "rms_norm_eps = 0 must be in (0, 1)");
    check_bad(flat("gate_lower_bound", "5.0", NULL), "gate_lower_bound = 5 must be negative");
    check_bad(flat("routed_scaling_factor", "-1", NULL), "routed_scaling_factor = -1 must be positive");
    check_bad(flat("situ_linear_beta", "0", NULL), "situ_linear_beta = 0 must be positive");
}

K3_TEST(cfg_rejects_too_many_layers_and_bad_dense_counts)
{
    check_bad(flat("num_hidden_layers", "1025", NULL), "num_hidden_layers = 1025 is outside [1, 1024]");
    check_bad(flat("first_k_dense_replace", "5", NULL), "first_k_dense_replace = 5 is more than num_hidden_layers = 4");
    check_bad(flat("intermediate_size", "0", NULL), "intermediate_size is 0 but 1 dense layers need it");
}

K3_TEST(cfg_rejects_bad_layer_lists)
{
    check_bad(flat("full_attn_layers", "[0, 4]", NULL), "full_attn_layers[0] = 0 is outside 1..4 (layer numbers are one-based)");
    check_bad(flat("full_attn_layers", "[5]", NULL), "full_attn_layers[0] = 5 is outside 1..4");
    check_bad(flat("full_attn_layers", "[4, 4]", NULL), "full_attn_layers lists layer 4 twice");
    check_bad(flat("full_attn_layers", "[2.5]", NULL), "full_attn_layers[0] must be an integer");
    check_bad(flat("full_attn_layers", "4", NULL), "full_attn_layers must be an array");
    check_bad(flat("kda_layers", "[1, 2]", NULL), "full_attn_layers and kda_layers are not complementary: layer 3 is in neither");
    check_bad(flat("kda_layers", "[1, 2, 3, 4]", NULL), "not complementary: layer 4 is in both");
    k3_cfg c;
    k3_err e = {0};
    char *t = flat("kda_layers", "[3, 1, 2]", NULL);
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
}

K3_TEST(cfg_rejects_two_spellings_with_different_values)
{
    check_bad(flat("activation_situ_beta", "5.0", NULL), "situ_beta and activation_situ_beta are given with different values");
    check_bad(flat("linear_attn_config", "{\"full_attn_layers\": [3]}", NULL),
              "full_attn_layers and linear_attn_config.full_attn_layers are given with different values");
    k3_cfg c;
    k3_err e = {0};
    char *t = flat("activation_situ_beta", "4", NULL); /* same value twice is fine */
    CHECK_EQ_INT(parse_text(&c, t, &e), 0);
    free(t);
}

K3_TEST(cfg_rejects_a_key_given_twice)
{
    check_bad(flat("hidden_size", "64, \"hidden_size\": 64", NULL), "hidden_size given twice");
}

K3_TEST(cfg_rejects_text_config_that_is_not_an_object)
{
    check_bad(strdup("{\"text_config\": [1]}"), "text_config must be an object");
    check_bad(strdup("{\"text_config\": {\"linear_attn_config\": 3}}"), "text_config.linear_attn_config must be an object");
}

K3_TEST(cfg_names_nested_fields_with_their_path)
{
    char *t = strdup(k3_nested);
    char *p = strstr(t, "\"num_heads\": 96");
    memcpy(p, "\"num_heads\": -6", 15);
    check_bad(t, "text_config.linear_attn_config.num_heads must not be negative");
}

K3_TEST(cfg_rejects_text_that_is_not_a_json_object)
{
    check_bad(strdup("not json"), "byte 0: not valid JSON");
    check_bad(strdup("{\"hidden_size\": 64,"), "not valid JSON");
    check_bad(strdup("[1, 2]"), "byte 0: config is not a JSON object");
    check_bad(strdup("{} {}"), "byte 3: text after the JSON object");
    check_bad(strdup("{\"a\": \"\xff\"}"), "byte 7: not valid UTF-8");
    k3_cfg c;
    k3_err e = {0};
    CHECK_EQ_INT(k3_cfg_parse(&c, "", 0, "cfg/config.json", &e), K3_EFORMAT);
}

K3_TEST(cfg_rejects_deep_json_without_crashing)
{
    size_t n = 200000;
    char *t = malloc(2 * n + 1);
    memset(t, '[', n);
    memset(t + n, ']', n);
    t[2 * n] = '\0';
    check_bad(t, "not valid JSON (or nested deeper than 1000 levels)");
    t = malloc(n * 6 + 16);
    size_t len = 0;
    for (size_t i = 0; i < n; i++)
        len += (size_t)sprintf(t + len, "{\"a\":");
    t[len] = '\0';
    check_bad(t, "nested deeper than");
}

K3_TEST(cfg_parser_survives_mutated_configs)
{
    uint64_t s = 88172645463325252ull;
    size_t blen = strlen(k3_nested);
    char *buf = malloc(blen + 64);
    int accepted = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(buf, k3_nested, blen);
        size_t n = blen;
        for (int k = 0; k < 2; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            size_t at = s % n;
            switch ((s >> 32) % 3) {
            case 0: buf[at] = (char)(s >> 40); break;
            case 1: buf[at] = "\"{}[],:0123456789-.e "[(s >> 40) % 21]; break;
            default: memmove(buf + at, buf + at + 1, n - at - 1); n--; break;
            }
        }
        char *text = malloc(n);
        memcpy(text, buf, n);
        k3_cfg c;
        k3_err e = {0};
        int rc = k3_cfg_parse(&c, text, n, "fuzz.json", &e);
        if (rc == 0) {
            accepted++;
            CHECK_EQ_INT(k3_cfg_validate(&c, "fuzz.json", &e), 0);
            char *j = k3_cfg_to_json(&c);
            k3_cfg d;
            CHECK_EQ_INT(k3_cfg_parse(&d, j, strlen(j), "again", &e), 0);
            CHECK(memcmp(&c, &d, sizeof c) == 0);
            free(j);
        } else {
            CHECK_STR_CONTAINS(e.msg, "fuzz.json: ");
        }
        free(text);
    }
    free(buf);
    fprintf(stderr, "  (%d of 3000 mutated configs accepted, all round-tripping)\n", accepted);
}
