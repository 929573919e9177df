#!/usr/bin/python3
"""k3ref - an independent float64 NumPy reference of the Kimi K3 forward pass,
written from the description of the model alone, docs/MODEL.md §1 and §2
(no runtime code was read).

Owns: reading config.json (nested and flat), loading the weights of an
upstream-format checkpoint (bf16/f16/f32 widened, MXFP4 or plain routed
experts dequantized), the forward pass of docs/MODEL.md §1.4 in float64, greedy decoding,
and the command line others compare against:

  /usr/bin/python3 tests/ref/k3ref.py CKPT_DIR --ids 1,2,3 [--gen N]
      [--logits-all OUT] [--logits OUT] [--plant BUG] [--verbose]

stdout: one JSON object {"prompt_ids": [...], "generated_ids": [...]}.
--logits-all: float32 LE logits of every prompt position, [T][V] row-major;
--logits: float32 LE logits of the last prompt position, [V].
--plant: compute a deliberately WRONG model (see PLANTS) so that comparison
gates can be shown to fail.

Invariants: every arithmetic step is float64; state carried between calls of
Model.forward (KDA state, conv history, MLA latents) makes feeding a sequence
in one chunk or token by token give the same numbers up to float64 rounding.
The interpretation chosen for every point that needed one is listed in
tests/ref/README.md.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_np as stnp  # noqa: E402

PLANTS = ("nibble_swap", "biased_combine", "no_attnres_reset", "conv_reverse")

PFX = "language_model.model."
HEAD = "language_model.lm_head.weight"

# E2M1 code -> value; bit 3 is the sign (docs/MODEL.md §2.5)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


class ConfigError(Exception):
    pass


# ---------------------------------------------------------------- config

# (attribute, flat spelling, alternate spelling or None, kind, scope of the
# alternate spelling). kind: "int", "float", "bool" (default true), "list".
# scope "lac": the alternate spelling is looked up in linear_attn_config only.
_FIELDS = [
    ("E", "hidden_size", None, "int", None),
    ("n_layers", "num_hidden_layers", None, "int", None),
    ("V", "vocab_size", None, "int", None),
    ("eps", "rms_norm_eps", None, "float", None),
    ("H", "kda_num_heads", "num_heads", "int", "lac"),
    ("D", "kda_head_dim", "head_dim", "int", "lac"),
    ("conv", "short_conv_kernel_size", None, "int", None),
    ("lb", "gate_lower_bound", None, "float", None),
    ("n_heads", "num_attention_heads", None, "int", None),
    ("q_lora", "q_lora_rank", None, "int", None),
    ("kv_lora", "kv_lora_rank", None, "int", None),
    ("nope", "qk_nope_head_dim", None, "int", None),
    ("rope", "qk_rope_head_dim", None, "int", None),
    ("v_dim", "v_head_dim", None, "int", None),
    ("mla_gate", "mla_use_output_gate", None, "bool", None),
    ("n_exp", "num_experts", None, "int", None),
    ("topk", "num_experts_per_token", None, "int", None),
    ("n_shared", "num_shared_experts", None, "int", None),
    ("L_lat", "routed_expert_hidden_size", None, "int", None),
    ("I", "moe_intermediate_size", None, "int", None),
    ("scale", "routed_scaling_factor", None, "float", None),
    ("renorm", "moe_renormalize", None, "bool", None),
    ("moe_norm", "latent_moe_use_norm", None, "bool", None),
    ("k_dense", "first_k_dense_replace", None, "int", None),
    ("I_dense", "intermediate_size", None, "int", None),
    ("B", "attn_res_block_size", None, "int", None),
    ("b1", "situ_beta", "activation_situ_beta", "float", "any"),
    ("b2", "situ_linear_beta", "activation_situ_linear_beta", "float", "any"),
]


class Config:
    """The normalised config; attribute names are the symbols of docs/MODEL.md §1.1."""

    def __repr__(self):
        return "Config(%s)" % ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()))


def _lookup(scopes, lac, flat, alt, alt_scope):
    """All (where, value) pairs for a field: the flat spelling in every scope,
    then the alternate spelling where it is allowed."""
    found = []
    for where, d in scopes:
        if flat in d:
            found.append((f"{where}{flat}", d[flat]))
    if alt is not None:
        alt_in = [("text_config.linear_attn_config." if lac is not None else "", lac or {})] \
            if alt_scope == "lac" else scopes
        for where, d in alt_in:
            if alt in d:
                found.append((f"{where}{alt}", d[alt]))
    return found


def _as_kind(name, v, kind, errors):
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            # integral floats such as 4.0 are accepted
            if isinstance(v, float) and v.is_integer():
                return int(v)
            errors.append(f"{name} is not an integer ({v!r})")
            return None
        return v
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            errors.append(f"{name} is not a number ({v!r})")
            return None
        return float(v)
    if kind == "bool":
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        errors.append(f"{name} is not a boolean ({v!r})")
        return None
    raise AssertionError(kind)


def parse_config(root):
    """config.json contents (a dict) -> Config. Raises ConfigError naming
    every missing field at once, or the first inconsistency."""
    if not isinstance(root, dict):
        raise ConfigError("config.json: not a JSON object")
    tc = root.get("text_config")
    if tc is not None and not isinstance(tc, dict):
        raise ConfigError("config.json: text_config is not an object")
    lac = None
    if tc is not None:
        lac = tc.get("linear_attn_config")
    if lac is None:
        lac = root.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise ConfigError("config.json: linear_attn_config is not an object")
    # most specific scope first
    scopes = []
    if lac is not None:
        scopes.append(("text_config.linear_attn_config." if tc is not None else "linear_attn_config.", lac))
    if tc is not None:
        scopes.append(("text_config.", tc))
    scopes.append(("", root))

    cfg = Config()
    missing, errors = [], []
    for attr, flat, alt, kind, alt_scope in _FIELDS:
        found = _lookup(scopes, lac, flat, alt, alt_scope)
        if not found:
            if kind == "bool":
                setattr(cfg, attr, True)  # the three "default true" booleans
                continue
            missing.append(flat)
            setattr(cfg, attr, None)
            continue
        vals = [_as_kind(w, v, kind, errors) for w, v in found]
        if len(set(vals)) > 1:
            errors.append(f"{flat}: conflicting values " + ", ".join(f"{w}={v!r}" for w, v in found))
        setattr(cfg, attr, vals[0])

    def layer_list(key):
        got = _lookup(scopes, lac, key, None, None)
        if not got:
            return None
        where, v = got[0]
        if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            errors.append(f"{where} is not a list of integers")
            return None
        if len(got) > 1 and any(sorted(g[1]) != sorted(v) for g in got[1:] if isinstance(g[1], list)):
            errors.append(f"{key}: conflicting values in {', '.join(g[0] for g in got)}")
        return v

    n_err = len(errors)
    full = layer_list("full_attn_layers")
    kda = layer_list("kda_layers")
    if full is None and kda is None and len(errors) == n_err:
        missing.append("full_attn_layers (or kda_layers)")
    if missing:
        raise ConfigError("config.json: missing required field(s): " + ", ".join(missing))
    if errors:
        raise ConfigError("config.json: " + "; ".join(errors))

    qc = root.get("quantization_config", tc.get("quantization_config") if tc else None)
    cfg.group_size = 32
    if isinstance(qc, dict) and "group_size" in qc:
        if qc["group_size"] != 32 or isinstance(qc["group_size"], bool):
            raise ConfigError(f"config.json: quantization_config.group_size is {qc['group_size']!r}, must be 32")

    n = cfg.n_layers
    for a in ("E", "n_layers", "V", "H", "D", "conv", "n_heads", "q_lora", "kv_lora", "v_dim",
              "n_exp", "topk", "L_lat", "I", "I_dense", "B"):
        if getattr(cfg, a) <= 0:
            raise ConfigError(f"config.json: {dict((f[0], f[1]) for f in _FIELDS)[a]} must be positive, "
                              f"it is {getattr(cfg, a)}")
    for a in ("nope", "rope", "n_shared", "k_dense"):
        if getattr(cfg, a) < 0:
            raise ConfigError(f"config.json: {dict((f[0], f[1]) for f in _FIELDS)[a]} is negative")
    if cfg.nope + cfg.rope <= 0:
        raise ConfigError("config.json: qk_nope_head_dim + qk_rope_head_dim must be positive")
    if cfg.topk > cfg.n_exp:
        raise ConfigError(f"config.json: num_experts_per_token {cfg.topk} > num_experts {cfg.n_exp}")
    if cfg.k_dense > n:
        raise ConfigError(f"config.json: first_k_dense_replace {cfg.k_dense} > num_hidden_layers {n}")
    if cfg.L_lat % 32 or cfg.I % 32:
        raise ConfigError(f"config.json: routed_expert_hidden_size {cfg.L_lat} and moe_intermediate_size "
                          f"{cfg.I} must be multiples of 32 (MXFP4 blocks)")
    if cfg.eps <= 0:
        raise ConfigError(f"config.json: rms_norm_eps must be positive, it is {cfg.eps}")
    if cfg.b1 <= 0 or cfg.b2 <= 0:
        raise ConfigError("config.json: SiTU betas must be positive")

    for key, lst in (("full_attn_layers", full), ("kda_layers", kda)):
        if lst is None:
            continue
        bad = [i for i in lst if not 1 <= i <= n]
        if bad:
            raise ConfigError(f"config.json: {key} has indices outside 1..{n}: {bad}")
        if len(set(lst)) != len(lst):
            raise ConfigError(f"config.json: {key} repeats an index")
    if full is not None and kda is not None:
        if set(full) & set(kda) or set(full) | set(kda) != set(range(1, n + 1)):
            raise ConfigError("config.json: full_attn_layers and kda_layers are not complementary")
    if full is not None:
        mla1 = set(full)
    else:
        mla1 = set(range(1, n + 1)) - set(kda)
    cfg.mla_layers = sorted(i - 1 for i in mla1)  # zero-based
    return cfg


def load_config(ckpt_dir):
    path = os.path.join(ckpt_dir, "config.json")
    try:
        with open(path, "rb") as f:
            root = json.loads(f.read().decode("utf-8"))
    except OSError as ex:
        raise ConfigError(f"{path}: {ex.strerror}")
    except (UnicodeDecodeError, ValueError) as ex:
        raise ConfigError(f"{path}: not valid JSON: {ex}")
    return parse_config(root)


# ---------------------------------------------------------------- building blocks

def rmsnorm(x, w, eps):
    """w * x / sqrt(mean(x^2) + eps) over the last axis (eps inside the root)."""
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def sigmoid(x):
    # two branches so neither overflows
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def silu(x):
    return x * sigmoid(x)


def situ_glu(g, u, b1, b2):
    """[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]; the sigmoid sees the
    uncapped g."""
    return (b1 * np.tanh(g / b1) * sigmoid(g)) * (b2 * np.tanh(u / b2))


def mxfp4_dequant(packed, scale, n_in, nibble_swap=False):
    """weight_packed [rows][n_in/2] u8 + weight_scale [rows][n_in/32] u8 ->
    float64 [rows][n_in]. Low nibble = even element (high with nibble_swap,
    the planted bug); value = E2M1[nibble] * 2^(scale-127); scale 255 -> 0."""
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.uint8)
    rows = packed.shape[0]
    if packed.shape != (rows, n_in // 2) or scale.shape != (rows, n_in // 32) or n_in % 32:
        raise ValueError(f"MXFP4 shapes {packed.shape} / {scale.shape} do not fit {rows}x{n_in}")
    lo = packed & 0x0F
    hi = packed >> 4
    even, odd = (hi, lo) if nibble_swap else (lo, hi)
    codes = np.stack([even, odd], axis=-1).reshape(rows, n_in)
    s = scale.astype(np.int32)
    factor = np.where(s == 255, 0.0, np.ldexp(1.0, s - 127))
    return E2M1[codes] * np.repeat(factor, 32, axis=1)


def attn_res(sources, f, eps):
    """AttnRes over sources S_0..S_n (each [T][E]) with f = norm_w * proj_w:
    softmax over s of (S_s / rms(S_s)) . f, output sum_s p_s S_s (raw S)."""
    S = np.stack(sources)  # [n][T][E]
    k = S / np.sqrt(np.mean(S * S, axis=-1, keepdims=True) + eps)
    score = k @ f  # [n][T]
    score = score - score.max(axis=0, keepdims=True)
    p = np.exp(score)
    p = p / p.sum(axis=0, keepdims=True)
    return np.einsum("nt,nte->te", p, S)


def causal_conv(x, hist, w):
    """Depthwise causal conv. x [T][P] new inputs, hist [conv-1][P] the
    previous inputs (oldest first, zeros at stream start), w [P][conv] with
    tap 0 the oldest. Returns (y [T][P], new history)."""
    conv = w.shape[1]
    full = np.concatenate([hist, x], axis=0)  # [conv-1+T][P]
    T = x.shape[0]
    y = np.zeros_like(x)
    for j in range(conv):
        y += w[:, j] * full[j:j + T]
    new_hist = full[full.shape[0] - (conv - 1):] if conv > 1 else hist
    return y, new_hist


def kda_recurrence(q, k, v, g, beta, S):
    """The delta rule in the order of docs/MODEL.md §1.4, per token t, all heads at once.
    q,k,v,g [T][H][D]; beta [T][H]; S [H][D][D] (rows = key channels),
    updated in place. Returns o [T][H][D]."""
    T = q.shape[0]
    o = np.empty_like(v)
    for t in range(T):
        S *= np.exp(g[t])[:, :, None]                       # S := diag(exp g) S
        u = np.einsum("hij,hi->hj", S, k[t])                 # u := S^T k
        S += k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
        o[t] = np.einsum("hij,hi->hj", S, q[t])              # read the updated state
    return o


# ---------------------------------------------------------------- model

class Model:
    """Weights of one checkpoint in float64 plus the forward pass.
    state = model.new_state(); logits = model.forward(ids, state)."""

    def __init__(self, ckpt_dir, plant=None, dtype=np.float64):
        if plant is not None and plant not in PLANTS:
            raise ValueError(f"unknown plant {plant!r}; known: {', '.join(PLANTS)}")
        self.plant = plant
        # float64 is the reference; float32 only emulates a float32 runtime to
        # estimate how far a correct one may sit from the reference
        self.dt = np.dtype(dtype)
        self.cfg = cfg = load_config(ckpt_dir)
        self.st = stnp.SafetensorsDir(ckpt_dir)
        self.min_margin = np.inf  # smallest routing margin seen (diagnostics)
        E = cfg.E
        self.embed = self.w("embed_tokens.weight", (cfg.V, E))
        self.norm = self.w("norm.weight", (E,))
        self.out_res = self.w("output_attn_res_norm.weight", (E,)) * self.w("output_attn_res_proj.weight", (E,))
        self.head = self._get(HEAD, (cfg.V, E))
        self.layers = [self._load_layer(L) for L in range(cfg.n_layers)]

    # weights -----------------------------------------------------------

    def _get(self, name, shape):
        a = self.st.get_f64(name).astype(self.dt)
        if int(np.prod(a.shape)) != int(np.prod(shape)):
            raise stnp.SafetensorsError(f"tensor {name}: shape {list(a.shape)}, expected {list(shape)}")
        if a.ndim == len(shape) and tuple(a.shape) != tuple(shape):
            raise stnp.SafetensorsError(f"tensor {name}: shape {list(a.shape)}, expected {list(shape)}")
        return a.reshape(shape)

    def w(self, name, shape):
        return self._get(PFX + name, shape)

    def _expert(self, L, e, which, rows, n_in):
        base = f"{PFX}layers.{L}.block_sparse_moe.experts.{e}.{which}."
        if self.st.has(base + "weight_packed"):
            packed = self.st.get(base + "weight_packed")
            scale = self.st.get(base + "weight_scale")
            if self.st.dtype(base + "weight_packed") != "U8" or self.st.dtype(base + "weight_scale") != "U8":
                raise stnp.SafetensorsError(f"tensor {base}weight_packed/_scale: MXFP4 parts must be U8")
            return mxfp4_dequant(packed, scale, n_in, nibble_swap=(self.plant == "nibble_swap")).astype(self.dt)
        return self._get(base + "weight", (rows, n_in))

    def _load_layer(self, L):
        c = self.cfg
        E, P, D, H = c.E, c.H * c.D, c.D, c.H
        p = f"layers.{L}."
        ly = {"index": L, "mla": L in c.mla_layers, "dense": L < c.k_dense}
        ly["in_norm"] = self.w(p + "input_layernorm.weight", (E,))
        ly["post_norm"] = self.w(p + "post_attention_layernorm.weight", (E,))
        ly["attn_res"] = self.w(p + "self_attention_res_norm.weight", (E,)) * \
            self.w(p + "self_attention_res_proj.weight", (E,))
        ly["mlp_res"] = self.w(p + "mlp_res_norm.weight", (E,)) * self.w(p + "mlp_res_proj.weight", (E,))
        a = p + "self_attn."
        if ly["mla"]:
            qk = c.nope + c.rope
            ly["q_a"] = self.w(a + "q_a_proj.weight", (c.q_lora, E))
            ly["q_a_norm"] = self.w(a + "q_a_layernorm.weight", (c.q_lora,))
            ly["q_b"] = self.w(a + "q_b_proj.weight", (c.n_heads * qk, c.q_lora))
            ly["kv_a"] = self.w(a + "kv_a_proj_with_mqa.weight", (c.kv_lora + c.rope, E))
            ly["kv_a_norm"] = self.w(a + "kv_a_layernorm.weight", (c.kv_lora,))
            ly["kv_b"] = self.w(a + "kv_b_proj.weight", (c.n_heads * (c.nope + c.v_dim), c.kv_lora))
            ly["o"] = self.w(a + "o_proj.weight", (E, c.n_heads * c.v_dim))
            if c.mla_gate:
                ly["g"] = self.w(a + "g_proj.weight", (c.n_heads * c.v_dim, E))
        else:
            for nm in ("q", "k", "v", "g"):
                ly[nm] = self.w(a + f"{nm}_proj.weight", (P, E))
            ly["o"] = self.w(a + "o_proj.weight", (E, P))
            ly["f_a"] = self.w(a + "f_a_proj.weight", (D, E))
            ly["f_b"] = self.w(a + "f_b_proj.weight", (P, D))
            ly["b"] = self.w(a + "b_proj.weight", (H, E))
            for nm in ("q", "k", "v"):
                wc = self.w(a + f"{nm}_conv1d.weight", (P, 1, c.conv)).reshape(P, c.conv)
                ly[nm + "_conv"] = wc[:, ::-1].copy() if self.plant == "conv_reverse" else wc
            alog = self.st.get_f64(PFX + a + "A_log").reshape(-1)
            if alog.size < H:
                raise stnp.SafetensorsError(f"tensor {PFX}{a}A_log: {alog.size} values, need at least {H}")
            ly["A"] = np.exp(alog[:H]).astype(self.dt)
            ly["dt_bias"] = self.w(a + "dt_bias", (P,))
            ly["o_norm"] = self.w(a + "o_norm.weight", (D,))
        m = p + "mlp." if ly["dense"] else p + "block_sparse_moe."
        if ly["dense"]:
            ly["gate"] = self.w(m + "gate_proj.weight", (c.I_dense, E))
            ly["up"] = self.w(m + "up_proj.weight", (c.I_dense, E))
            ly["down"] = self.w(m + "down_proj.weight", (E, c.I_dense))
        else:
            Ish = c.I * c.n_shared
            ly["router"] = self.w(m + "gate.weight", (c.n_exp, E))
            ly["bias"] = self.w(m + "gate.e_score_correction_bias", (c.n_exp,))
            ly["lat_down"] = self.w(m + "routed_expert_down_proj.weight", (c.L_lat, E))
            ly["lat_up"] = self.w(m + "routed_expert_up_proj.weight", (E, c.L_lat))
            if c.moe_norm:
                ly["lat_norm"] = self.w(m + "routed_expert_norm.weight", (c.L_lat,))
            if Ish > 0:
                ly["sh_gate"] = self.w(m + "shared_experts.gate_proj.weight", (Ish, E))
                ly["sh_up"] = self.w(m + "shared_experts.up_proj.weight", (Ish, E))
                ly["sh_down"] = self.w(m + "shared_experts.down_proj.weight", (E, Ish))
            ly["experts"] = {}  # e -> (w1, w3, w2), filled on first use
            for e in range(c.n_exp):
                for wh in ("w1", "w2", "w3"):
                    base = f"{PFX}{m}experts.{e}.{wh}."
                    if not (self.st.has(base + "weight") or
                            (self.st.has(base + "weight_packed") and self.st.has(base + "weight_scale"))):
                        raise stnp.SafetensorsError(f"{self.st.directory}: missing tensor {base}weight_packed "
                                                    f"(+ weight_scale) or {base}weight")
        return ly

    def expert(self, L, e):
        """(W1 [I][L], W3 [I][L], W2 [L][I]) of routed expert e of layer L,
        float64, loaded and dequantized on first use."""
        cache = self.layers[L]["experts"]
        if e not in cache:
            c = self.cfg
            cache[e] = (self._expert(L, e, "w1", c.I, c.L_lat), self._expert(L, e, "w3", c.I, c.L_lat),
                        self._expert(L, e, "w2", c.L_lat, c.I))
        return cache[e]

    # state ---------------------------------------------------------------

    def new_state(self):
        """Per-layer carried state for one token stream."""
        c = self.cfg
        P = c.H * c.D
        st = []
        for ly in self.layers:
            if ly["mla"]:
                st.append({"lat": np.zeros((0, c.kv_lora), self.dt), "kr": np.zeros((0, c.rope), self.dt)})
            else:
                st.append({"S": np.zeros((c.H, c.D, c.D), self.dt),
                           "hist": {nm: np.zeros((c.conv - 1, P), self.dt) for nm in "qkv"}})
        return st

    # layers --------------------------------------------------------------

    def kda(self, ly, x, st):
        c = self.cfg
        T, H, D = x.shape[0], c.H, c.D
        proj = {}
        for nm in "qkv":
            y, st["hist"][nm] = causal_conv(x @ ly[nm].T, st["hist"][nm], ly[nm + "_conv"])
            proj[nm] = silu(y).reshape(T, H, D)
        q = l2norm(proj["q"])
        k = l2norm(proj["k"])
        v = proj["v"]
        beta = sigmoid(x @ ly["b"].T)  # [T][H]
        z = ((x @ ly["f_a"].T) @ ly["f_b"].T + ly["dt_bias"]).reshape(T, H, D)
        g = c.lb * sigmoid(ly["A"][None, :, None] * z)
        q = q * D ** -0.5
        o = kda_recurrence(q, k, v, g, beta, st["S"])
        o = rmsnorm(o, ly["o_norm"], c.eps).reshape(T, H * D)
        o = o * sigmoid(x @ ly["g"].T)
        return o @ ly["o"].T

    def mla(self, ly, x, st):
        c = self.cfg
        T, nh, qk = x.shape[0], c.n_heads, c.nope + c.rope
        q = (rmsnorm(x @ ly["q_a"].T, ly["q_a_norm"], c.eps) @ ly["q_b"].T).reshape(T, nh, qk)
        cc = x @ ly["kv_a"].T
        st["lat"] = np.concatenate([st["lat"], rmsnorm(cc[:, :c.kv_lora], ly["kv_a_norm"], c.eps)])
        st["kr"] = np.concatenate([st["kr"], cc[:, c.kv_lora:]])
        N = st["lat"].shape[0]
        kv = (st["lat"] @ ly["kv_b"].T).reshape(N, nh, c.nope + c.v_dim)
        k_nope, vv = kv[:, :, :c.nope], kv[:, :, c.nope:]
        score = (np.einsum("thd,shd->hts", q[:, :, :c.nope], k_nope)
                 + np.einsum("thd,sd->hts", q[:, :, c.nope:], st["kr"])) * qk ** -0.5
        pos_t = np.arange(N - T, N)[:, None]
        pos_s = np.arange(N)[None, :]
        score = np.where(pos_s <= pos_t, score, -np.inf)
        score = score - score.max(axis=-1, keepdims=True)
        p = np.exp(score)
        p = p / p.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p, vv).reshape(T, nh * c.v_dim)
        if c.mla_gate:
            o = o * sigmoid(x @ ly["g"].T)
        return o @ ly["o"].T

    def mlp(self, x, gate, up, down):
        c = self.cfg
        return situ_glu(x @ gate.T, x @ up.T, c.b1, c.b2) @ down.T

    def route(self, ly, x):
        """-> (idx [T][k] in top-k order, weights [T][k])."""
        c = self.cfg
        s = sigmoid(x @ ly["router"].T)  # [T][E_exp]
        sel = s + ly["bias"]
        T = x.shape[0]
        idx = np.empty((T, c.topk), dtype=np.int64)
        ar = np.arange(c.n_exp)
        for t in range(T):
            order = np.lexsort((ar, -sel[t]))  # score descending, ties -> lower index
            idx[t] = order[:c.topk]
            if c.topk < c.n_exp:
                self.min_margin = min(self.min_margin, sel[t, order[c.topk - 1]] - sel[t, order[c.topk]])
        src = sel if self.plant == "biased_combine" else s
        wts = np.take_along_axis(src, idx, axis=1)
        if c.renorm:
            wts = wts / (wts.sum(axis=1, keepdims=True) + 1e-20)
        return idx, wts * c.scale

    def moe(self, ly, x):
        c = self.cfg
        L = ly["index"]
        idx, wts = self.route(ly, x)
        z = x @ ly["lat_down"].T  # [T][L]
        acc = np.zeros((x.shape[0], c.L_lat), self.dt)
        for t in range(x.shape[0]):
            for j in range(c.topk):  # sum in top-k order
                e = idx[t, j]
                w1, w3, w2 = self.expert(L, e)
                acc[t] += wts[t, j] * (w2 @ situ_glu(w1 @ z[t], w3 @ z[t], c.b1, c.b2))
        if c.moe_norm:
            acc = rmsnorm(acc, ly["lat_norm"], c.eps)
        y = acc @ ly["lat_up"].T
        if "sh_gate" in ly:
            y = y + self.mlp(x, ly["sh_gate"], ly["sh_up"], ly["sh_down"])
        return y

    # forward -------------------------------------------------------------

    def forward(self, ids, state, trace=None):
        """Feed token ids (continuing the stream held in `state`); returns
        float64 logits [len(ids)][V]. `trace`, if a list, receives
        (layer, where, number of AttnRes sources) for the self-tests."""
        c = self.cfg
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= c.V:
            raise ValueError(f"token ids must be 0..{c.V - 1}")
        h = self.embed[ids]
        stack = []
        for L, ly in enumerate(self.layers):
            prefix = h
            if stack:
                h = attn_res(stack + [prefix], ly["attn_res"], c.eps)
                if trace is not None:
                    trace.append((L, "attn", len(stack) + 1))
            new_block = (L == 0) if self.plant == "no_attnres_reset" else (L % c.B == 0)
            if new_block:
                stack.append(prefix)
                prefix = None
            xin = rmsnorm(h, ly["in_norm"], c.eps)
            a = self.mla(ly, xin, state[L]) if ly["mla"] else self.kda(ly, xin, state[L])
            prefix = a if prefix is None else prefix + a
            h = attn_res(stack + [prefix], ly["mlp_res"], c.eps)
            if trace is not None:
                trace.append((L, "mlp", len(stack) + 1))
            xm = rmsnorm(h, ly["post_norm"], c.eps)
            m = self.mlp(xm, ly["gate"], ly["up"], ly["down"]) if ly["dense"] else self.moe(ly, xm)
            h = prefix + m
        h = attn_res(stack + [h], self.out_res, c.eps)
        if trace is not None:
            trace.append((c.n_layers, "out", len(stack) + 1))
        return rmsnorm(h, self.norm, c.eps) @ self.head.T


def greedy(model, prompt, n_gen):
    """Logits of every prompt position and n_gen greedy tokens (argmax, ties
    to the lowest id), each generated token fed back one at a time."""
    state = model.new_state()
    logits = model.forward(prompt, state)
    prompt_logits = logits
    out = []
    last = logits[-1]
    model.min_gap = np.inf
    for i in range(n_gen):
        tok = int(np.argmax(last))  # first maximum = lowest id
        top2 = np.sort(last)[-2:] if last.size > 1 else np.array([0.0, np.inf])
        model.min_gap = min(model.min_gap, top2[1] - top2[0])
        out.append(tok)
        if i + 1 < n_gen:
            last = model.forward([tok], state)[-1]
    return prompt_logits, out


def _parse_ids(text):
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part or not part.isdigit():
            raise ValueError(f"bad token id {part!r}")
        ids.append(int(part))
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(prog="k3ref", description="float64 reference forward pass of K3")
    ap.add_argument("ckpt")
    ap.add_argument("--ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--gen", type=int, default=0, help="greedy tokens to generate")
    ap.add_argument("--logits-all", dest="logits_all", help="write f32 LE logits [T][V] of every prompt position")
    ap.add_argument("--logits", help="write f32 LE logits [V] of the last prompt position")
    ap.add_argument("--plant", choices=PLANTS, help="compute a deliberately wrong model")
    ap.add_argument("--verbose", action="store_true", help="diagnostics on stderr")
    ap.add_argument("--float32", action="store_true",
                    help="NOT the reference: compute in float32 to see how far a correct float32 runtime may drift")
    a = ap.parse_args(argv)
    try:
        ids = _parse_ids(a.ids)
    except ValueError as ex:
        print(f"k3ref: error: --ids: {ex}", file=sys.stderr)
        return 2
    if a.gen < 0:
        print("k3ref: error: --gen must be >= 0", file=sys.stderr)
        return 2
    try:
        model = Model(a.ckpt, plant=a.plant, dtype=np.float32 if a.float32 else np.float64)
    except (ConfigError, stnp.SafetensorsError, ValueError) as ex:
        print(f"k3ref: error: {ex}", file=sys.stderr)
        return 3
    if max(ids) >= model.cfg.V:
        print(f"k3ref: error: --ids: token id {max(ids)} >= vocab_size {model.cfg.V}", file=sys.stderr)
        return 2
    prompt_logits, gen = greedy(model, ids, a.gen)
    if a.logits_all:
        prompt_logits.astype("<f4").tofile(a.logits_all)
    if a.logits:
        prompt_logits[-1].astype("<f4").tofile(a.logits)
    if a.verbose:
        print(f"k3ref: {model.cfg}", file=sys.stderr)
        print(f"k3ref: smallest routing margin (k-th minus (k+1)-th biased score): {model.min_margin:.3e}",
              file=sys.stderr)
        if a.gen:
            print(f"k3ref: smallest greedy logit gap (best minus second best): {model.min_gap:.3e}",
                  file=sys.stderr)
    print(json.dumps({"prompt_ids": ids, "generated_ids": gen}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
