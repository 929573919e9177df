"""minickpt - writes a small random upstream-format checkpoint for the
reference's self-tests only (the real test checkpoints come from
`k3-synth --preset tiny`).

Owns: a default mini config (every docs/MODEL.md §1.1 field, a few layers, both
attention kinds, dense and MoE layers, more layers than one AttnRes block) and
deterministic random weights named as in docs/MODEL.md §2.3, with routed experts as MXFP4
or as plain BF16 holding exactly the same values.

Invariant: for a given seed and config every tensor's values are the same
whatever the expert encoding, shard count or config shape (flat/nested), so
those variants must give identical logits.
"""

import json
import os

import numpy as np

import safetensors_np as stnp

PFX = "language_model.model."

MINI = {
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "vocab_size": 97,
    "rms_norm_eps": 1e-5,
    "kda_num_heads": 2,
    "kda_head_dim": 16,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_output_gate": True,
    "num_experts": 8,
    "num_experts_per_token": 3,
    "num_shared_experts": 1,
    "routed_expert_hidden_size": 32,
    "moe_intermediate_size": 32,
    "routed_scaling_factor": 1.5,
    "moe_renormalize": True,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "intermediate_size": 96,
    "attn_res_block_size": 2,
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "full_attn_layers": [2, 5],
}

# fields that a nested config keeps in text_config.linear_attn_config, with
# their nested spelling
_LAC = {"kda_num_heads": "num_heads", "kda_head_dim": "head_dim",
        "short_conv_kernel_size": "short_conv_kernel_size", "gate_lower_bound": "gate_lower_bound",
        "full_attn_layers": "full_attn_layers"}


def nest(flat):
    """Flat config dict -> the nested shape (text_config + linear_attn_config),
    with the alternate SiTU spellings and a few ignored extras."""
    tc, lac = {}, {}
    for k, v in flat.items():
        if k in _LAC:
            lac[_LAC[k]] = v
        elif k == "situ_beta":
            tc["activation_situ_beta"] = v
        elif k == "situ_linear_beta":
            tc["activation_situ_linear_beta"] = v
        else:
            tc[k] = v
    n = flat["num_hidden_layers"]
    lac["kda_layers"] = [i for i in range(1, n + 1) if i not in flat["full_attn_layers"]]
    tc["linear_attn_config"] = lac
    tc["rope_scaling"] = None
    return {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": tc,
            "vision_config": {"hidden_size": 12}, "quantization_config": {"group_size": 32}}


def _tensors(cfg, rng):
    """name -> ("bf16"|"f32"|"mx", values or (packed, scale, n_in)) in a fixed
    generation order."""
    E, V = cfg["hidden_size"], cfg["vocab_size"]
    H, D = cfg["kda_num_heads"], cfg["kda_head_dim"]
    P = H * D
    conv = cfg["short_conv_kernel_size"]
    nh, nope, rope, vd = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                          cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    qlr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    ne, Lr, I = cfg["num_experts"], cfg["routed_expert_hidden_size"], cfg["moe_intermediate_size"]
    Ish = I * cfg["num_shared_experts"]
    mla = {i - 1 for i in cfg["full_attn_layers"]}
    out = {}

    def mat(name, rows, cols, gain=1.0):
        out[name] = ("bf16", rng.standard_normal((rows, cols)) * gain / np.sqrt(cols))

    def vec(name, n, base=1.0, spread=0.2, kind="f32"):
        out[name] = (kind, base + spread * rng.standard_normal(n))

    def mx(name, rows, n_in):
        packed = rng.integers(0, 256, size=(rows, n_in // 2), dtype=np.uint8)
        # typical |E2M1| ~ 2.5: 2^(s-127) ~ 0.4/sqrt(n_in) keeps rows near unit gain
        base = 127 + int(np.round(np.log2(0.4 / np.sqrt(n_in))))
        scale = (base + rng.integers(-1, 2, size=(rows, n_in // 32))).astype(np.uint8)
        scale[rng.random(scale.shape) < 0.03] = 255  # NaN scale: contributes zero
        out[name] = ("mx", (packed, scale, n_in))

    out[PFX + "embed_tokens.weight"] = ("bf16", rng.standard_normal((V, E)))
    vec(PFX + "norm.weight", E)
    vec(PFX + "output_attn_res_norm.weight", E)
    out[PFX + "output_attn_res_proj.weight"] = ("bf16", rng.standard_normal((1, E)))
    out["language_model.lm_head.weight"] = ("bf16", rng.standard_normal((V, E)) * 2.0 / np.sqrt(E))
    for L in range(cfg["num_hidden_layers"]):
        p = f"{PFX}layers.{L}."
        vec(p + "input_layernorm.weight", E, kind="bf16")
        vec(p + "post_attention_layernorm.weight", E)
        vec(p + "self_attention_res_norm.weight", E)
        out[p + "self_attention_res_proj.weight"] = ("bf16", rng.standard_normal((1, E)))
        vec(p + "mlp_res_norm.weight", E, kind="bf16")
        out[p + "mlp_res_proj.weight"] = ("f32", rng.standard_normal((1, E)))
        a = p + "self_attn."
        if L in mla:
            mat(a + "q_a_proj.weight", qlr, E)
            vec(a + "q_a_layernorm.weight", qlr)
            mat(a + "q_b_proj.weight", nh * (nope + rope), qlr, 2.0)
            mat(a + "kv_a_proj_with_mqa.weight", kvr + rope, E, 2.0)
            vec(a + "kv_a_layernorm.weight", kvr)
            mat(a + "kv_b_proj.weight", nh * (nope + vd), kvr, 2.0)
            mat(a + "o_proj.weight", E, nh * vd)
            mat(a + "g_proj.weight", nh * vd, E)
        else:
            for nm in ("q", "k", "v", "g"):
                mat(a + f"{nm}_proj.weight", P, E, 1.5)
            mat(a + "o_proj.weight", E, P)
            mat(a + "f_a_proj.weight", D, E)
            mat(a + "f_b_proj.weight", P, D)
            mat(a + "b_proj.weight", H, E)
            for nm in ("q", "k", "v"):
                out[a + f"{nm}_conv1d.weight"] = ("bf16", rng.standard_normal((P, 1, conv)) * 0.7)
            out[a + "A_log"] = ("f32", rng.uniform(-1.0, 1.0, D))  # padded to D, first H used
            vec(a + "dt_bias", P, base=0.0, spread=1.0)
            vec(a + "o_norm.weight", D)
        if L < cfg["first_k_dense_replace"]:
            m = p + "mlp."
            mat(m + "gate_proj.weight", cfg["intermediate_size"], E, 3.0)
            mat(m + "up_proj.weight", cfg["intermediate_size"], E, 3.0)
            mat(m + "down_proj.weight", E, cfg["intermediate_size"])
        else:
            m = p + "block_sparse_moe."
            mat(m + "gate.weight", ne, E, 2.0)
            vec(m + "gate.e_score_correction_bias", ne, base=0.0, spread=0.3)
            mat(m + "routed_expert_down_proj.weight", Lr, E)
            mat(m + "routed_expert_up_proj.weight", E, Lr)
            vec(m + "routed_expert_norm.weight", Lr)
            if Ish:
                mat(m + "shared_experts.gate_proj.weight", Ish, E, 3.0)
                mat(m + "shared_experts.up_proj.weight", Ish, E, 3.0)
                mat(m + "shared_experts.down_proj.weight", E, Ish)
            for e in range(ne):
                mx(m + f"experts.{e}.w1", I, Lr)
                mx(m + f"experts.{e}.w3", I, Lr)
                mx(m + f"experts.{e}.w2", Lr, I)
    return out


def write_checkpoint(directory, seed=1, cfg=None, experts="mxfp4", nested=False, shards=1,
                     alog_padded=True):
    """Write config.json and the shards into `directory` (created). experts:
    "mxfp4" (weight_packed/weight_scale U8) or "bf16"/"f32" (plain .weight
    with the dequantized values, exact in both). shards > 1 also writes
    model.safetensors.index.json. alog_padded=False stores A_log with only
    its H meaningful values. Returns the flat config dict."""
    import k3ref  # the dequantizer under test defines the plain-expert values

    cfg = dict(MINI if cfg is None else cfg)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (kind, val) in _tensors(cfg, rng).items():
        if name.endswith("A_log") and not alog_padded:
            val = val[:cfg["kda_num_heads"]]
        if kind == "bf16":
            tensors[name] = ("BF16", stnp.f32_to_bf16(np.asarray(val, dtype=np.float32)))
        elif kind == "f32":
            tensors[name] = ("F32", np.asarray(val, dtype=np.float32))
        elif experts == "mxfp4":
            packed, scale, _ = val
            tensors[name + ".weight_packed"] = ("U8", packed)
            tensors[name + ".weight_scale"] = ("U8", scale)
        else:
            packed, scale, n_in = val
            deq = k3ref.mxfp4_dequant(packed, scale, n_in).astype(np.float32)
            if experts == "bf16":
                bits = stnp.f32_to_bf16(deq)
                assert np.array_equal(stnp.bf16_to_f32(bits), deq), "MXFP4 value not exact in bf16"
                tensors[name + ".weight"] = ("BF16", bits)
            else:
                tensors[name + ".weight"] = ("F32", deq)
    names = sorted(tensors)
    if shards <= 1:
        stnp.save_file(os.path.join(directory, "model.safetensors"), tensors, {"format": "pt"})
    else:
        wm = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for i, n in enumerate(names) if i % shards == s}
            stnp.save_file(os.path.join(directory, fn), part, {"format": "pt"})
            wm.update({n: fn for n in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(nest(cfg) if nested else cfg, f, indent=1)
    return cfg
