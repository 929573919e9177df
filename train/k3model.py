"""The Kimi K3 forward pass in PyTorch, for training a small model and for its
float64 reference numbers.

Written from the model description (docs/MODEL.md §1, not from the C code nor from
tests/ref): KDA (gated delta
rule with per-channel decay), gated MLA without rotation, attention residuals
over block snapshots, LatentMoE with a sigmoid router whose correction bias is
used for selection only, SiTU-GLU. Parameters live in a dict keyed by their
upstream tensor names (without the `language_model.model.` prefix), so export is
a rename-free write.

`quant` (training only) says how a tensor is stored on export: "bf16" matrices
and "mxfp4" experts are used in the forward pass rounded the way they will be
stored (straight-through gradients), so the exported model is the trained one.
"""
import math

import torch
import torch.nn.functional as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_codes(w):
    """Quantize w [rows][in] (in % 32 == 0) to MXFP4: (codes u8 [rows][in], scales u8 [rows][in/32]).
    Per group of 32: e = floor(log2(amax)) - 2 clamped to [-127, 127], values / 2^e
    rounded to the nearest E2M1 value (ties to the even mantissa), saturated at 6;
    amax 0 gives scale byte 0 and zero codes."""
    rows, n = w.shape
    g = w.detach().to(torch.float64).reshape(rows, n // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2
    e = e.clamp(-127, 127)
    a = (g / torch.pow(2.0, e)[..., None]).abs()
    # thresholds between neighbours; a tie goes to the even mantissa:
    # 0|.5 at .25 -> 0, .5|1 at .75 -> 1, 1|1.5 at 1.25 -> 1, 1.5|2 at 1.75 -> 2,
    # 2|3 at 2.5 -> 2, 3|4 at 3.5 -> 4, 4|6 at 5 -> 4
    code = torch.zeros_like(a, dtype=torch.int64)
    code += (a > 0.25).long()
    code += (a >= 0.75).long()
    code += (a > 1.25).long()
    code += (a >= 1.75).long()
    code += (a > 2.5).long()
    code += (a >= 3.5).long()
    code += (a > 5.0).long()
    code += 8 * ((g < 0) & (code > 0)).long()
    code = torch.where((amax > 0)[..., None], code, torch.zeros_like(code))
    scale = torch.where(amax > 0, e + 127, torch.zeros_like(e)).to(torch.uint8)
    return code.reshape(rows, n).to(torch.uint8), scale


def mxfp4_values(code, scale, dtype=torch.float64):
    """Exact values of MXFP4 codes [rows][in] with E8M0 scales [rows][in/32]."""
    lut = torch.tensor(E2M1, dtype=dtype)
    v = lut[code.long()]
    s = torch.pow(torch.tensor(2.0, dtype=dtype), scale.to(dtype) - 127)
    s = torch.where(scale == 255, torch.zeros_like(s), s)
    rows, n = code.shape
    return (v.reshape(rows, n // 32, 32) * s[..., None]).reshape(rows, n)


class _Ste(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, q):
        return q

    @staticmethod
    def backward(ctx, g):
        return g, None


def stored(w, how):
    """w as it will be stored ("bf16", "mxfp4" on the last two dims, or "f32"), with
    straight-through gradients."""
    if how == "f32":
        return w
    with torch.no_grad():
        if how == "bf16":
            q = w.to(torch.bfloat16).to(w.dtype)
        else:
            flat = w.reshape(-1, w.shape[-1])
            c, s = mxfp4_codes(flat)
            q = mxfp4_values(c, s, w.dtype).reshape(w.shape)
    return _Ste.apply(w, q)


class Config:
    def __init__(self, d):
        self.d = d
        for k, v in d.items():
            setattr(self, k, v)
        self.mla = [(i + 1) in d["full_attn_layers"] for i in range(d["num_hidden_layers"])]


def rmsnorm(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def situ_glu(g, u, b1, b2):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


class K3:
    """P: name -> tensor. quant: name -> "bf16"/"f32"/"mxfp4" (training) or None
    (weights used as given, e.g. float64 exported values)."""

    def __init__(self, cfg, P, quant=None, exact_topk=False):
        self.c = cfg
        self.P = P
        self.quant = quant
        self.exact_topk = exact_topk
        self.loads = {}

    def w(self, name):
        t = self.P[name]
        if self.quant is None:
            return t
        return stored(t, self.quant[name])

    def lin(self, x, name):
        return x @ self.w(name).transpose(-1, -2)

    def attn_res(self, srcs, pre):
        c = self.c
        f = self.w(pre + "_norm.weight") * self.w(pre + "_proj.weight").reshape(-1)
        S = torch.stack(srcs, 0)  # [n, ..., E]
        k = S / torch.sqrt((S * S).mean(-1, keepdim=True) + c.rms_norm_eps)
        p = torch.softmax((k * f).sum(-1), dim=0)
        return (p[..., None] * S).sum(0)

    def mlp(self, x, pre):
        return self.lin(situ_glu(self.lin(x, pre + "gate_proj.weight"), self.lin(x, pre + "up_proj.weight"),
                                 self.c.situ_beta, self.c.situ_linear_beta), pre + "down_proj.weight")

    def kda(self, x, p):
        c = self.c
        B, T, _ = x.shape
        H, D, K = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        P = H * D
        out = []
        for nm in ("q", "k", "v"):
            y = self.lin(x, p + nm + "_proj.weight")  # [B,T,P]
            cw = self.w(p + nm + "_conv1d.weight")  # [P][1][K], tap j: K-1-j tokens back
            yp = F.pad(y, (0, 0, K - 1, 0))
            acc = yp[:, K - 1:] * cw[:, 0, K - 1]
            for j in range(K - 1):
                acc = acc + yp[:, j:j + T] * cw[:, 0, j]
            out.append(F.silu(acc).reshape(B, T, H, D))
        q, k, v = out
        q = l2norm(q) * (D ** -0.5)
        k = l2norm(k)
        beta = torch.sigmoid(self.lin(x, p + "b_proj.weight"))  # [B,T,H]
        z = self.lin(self.lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight") + self.w(p + "dt_bias")
        a = torch.exp(self.w(p + "A_log").reshape(-1)[:H])
        g = c.gate_lower_bound * torch.sigmoid(a[:, None] * z.reshape(B, T, H, D))
        decay = torch.exp(g)
        # state per (batch, head): S [D_key][D_value]; one step per token
        dec = decay.transpose(1, 2).reshape(B * H, T, D, 1).unbind(1)
        kk = k.transpose(1, 2).reshape(B * H, T, D, 1).unbind(1)
        qq = q.transpose(1, 2).reshape(B * H, T, D, 1).unbind(1)
        vv = v.transpose(1, 2).reshape(B * H, T, D).unbind(1)
        bb = beta.transpose(1, 2).reshape(B * H, T, 1).unbind(1)
        S = torch.zeros(B * H, D, D, dtype=x.dtype)
        os = []
        for t in range(T):
            S = S * dec[t]
            u = (S * kk[t]).sum(1)                               # S^T k
            S = S + kk[t] * (bb[t] * (vv[t] - u))[:, None, :]
            os.append((S * qq[t]).sum(1))                        # S^T q, updated state
        o = torch.stack(os, 1).reshape(B, H, T, D).transpose(1, 2)  # [B,T,H,D]
        o = rmsnorm(o, self.w(p + "o_norm.weight"), c.rms_norm_eps).reshape(B, T, P)
        o = o * torch.sigmoid(self.lin(x, p + "g_proj.weight"))
        return self.lin(o, p + "o_proj.weight")

    def mla_attn(self, x, p):
        c = self.c
        B, T, _ = x.shape
        Hm, nope, rope, vd, R = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                 c.v_head_dim, c.kv_lora_rank)
        q = self.lin(rmsnorm(self.lin(x, p + "q_a_proj.weight"), self.w(p + "q_a_layernorm.weight"),
                             c.rms_norm_eps), p + "q_b_proj.weight").reshape(B, T, Hm, nope + rope)
        cc = self.lin(x, p + "kv_a_proj_with_mqa.weight")
        lat = rmsnorm(cc[..., :R], self.w(p + "kv_a_layernorm.weight"), c.rms_norm_eps)
        kr = cc[..., R:]
        kv = self.lin(lat, p + "kv_b_proj.weight").reshape(B, T, Hm, nope + vd)
        kn, v = kv[..., :nope], kv[..., nope:]
        s = (torch.einsum("bthd,bshd->bhts", q[..., :nope], kn)
             + torch.einsum("bthd,bsd->bhts", q[..., nope:], kr)) * ((nope + rope) ** -0.5)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, float("-inf"))
        pr = torch.softmax(s, -1)
        o = torch.einsum("bhts,bshd->bthd", pr, v).reshape(B, T, Hm * vd)
        if c.d.get("mla_use_output_gate", True):
            o = o * torch.sigmoid(self.lin(x, p + "g_proj.weight"))
        return self.lin(o, p + "o_proj.weight")

    def moe(self, x, p, layer):
        c = self.c
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        X, k = c.num_experts, c.num_experts_per_token
        s = torch.sigmoid(self.lin(x, p + "gate.weight"))
        sel = s.detach() + self.w(p + "gate.e_score_correction_bias").detach()
        if self.exact_topk:
            idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
        else:
            idx = torch.topk(sel, k, dim=-1).indices
        wt = torch.gather(s, 1, idx)
        if c.d.get("moe_renormalize", True):
            wt = wt / (wt.sum(-1, keepdim=True) + 1e-20)
        wt = wt * c.routed_scaling_factor
        self.loads[layer] = torch.bincount(idx.reshape(-1), minlength=X)
        z = self.lin(x, p + "routed_expert_down_proj.weight")
        w1 = self.w(p + "experts.w1")
        w2 = self.w(p + "experts.w2")
        w3 = self.w(p + "experts.w3")
        acc = torch.zeros_like(z)
        for e in range(X):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            ze = z[rows]
            h = situ_glu(ze @ w1[e].t(), ze @ w3[e].t(), c.situ_beta, c.situ_linear_beta)
            acc = acc.index_add(0, rows, (h @ w2[e].t()) * wt[rows, slot][:, None])
        if c.d.get("latent_moe_use_norm", True):
            acc = rmsnorm(acc, self.w(p + "routed_expert_norm.weight"), c.rms_norm_eps)
        y = self.lin(acc, p + "routed_expert_up_proj.weight")
        if c.num_shared_experts > 0:
            y = y + self.mlp(x, p + "shared_experts.")
        return y.reshape(shp)

    def forward(self, ids):
        """ids [B,T] -> logits [B,T,V]"""
        c = self.c
        h = self.w("embed_tokens.weight")[ids]
        stack = []
        for L in range(c.num_hidden_layers):
            p = "layers.%d." % L
            prefix = h
            if stack:
                h = self.attn_res(stack + [prefix], p + "self_attention_res")
            if L % c.attn_res_block_size == 0:
                stack.append(prefix)
                prefix = None
            xn = rmsnorm(h, self.w(p + "input_layernorm.weight"), c.rms_norm_eps)
            a = self.mla_attn(xn, p + "self_attn.") if c.mla[L] else self.kda(xn, p + "self_attn.")
            prefix = a if prefix is None else prefix + a
            h = self.attn_res(stack + [prefix], p + "mlp_res")
            xn = rmsnorm(h, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            if L < c.first_k_dense_replace:
                m = self.mlp(xn, p + "mlp.")
            else:
                m = self.moe(xn, p + "block_sparse_moe.", L)
            h = prefix + m
        h = self.attn_res(stack + [h], "output_attn_res")
        return self.lin(rmsnorm(h, self.w("norm.weight"), c.rms_norm_eps), "lm_head.weight")


def init_params(cfg, gen):
    """name -> (float32 tensor, storage) for a fresh model, from the generator gen."""
    c = cfg
    E, V = c.hidden_size, c.vocab_size
    out = {}
    std = 0.02
    nL = c.num_hidden_layers
    proj_std = std / math.sqrt(2 * nL)

    def mat(name, rows, cols, s=std, how="bf16"):
        out[name] = (torch.randn(rows, cols, generator=gen) * s, how)

    def vec(name, n, val, how="f32"):
        out[name] = (torch.full((n,), float(val)), how)

    mat("embed_tokens.weight", V, E, 1.0 / math.sqrt(E) * 0.5)
    mat("lm_head.weight", V, E, std)
    vec("norm.weight", E, 1.0)
    vec("output_attn_res_norm.weight", E, 1.0)
    vec("output_attn_res_proj.weight", E, 0.0)
    for L in range(nL):
        p = "layers.%d." % L
        for n in ("input_layernorm", "post_attention_layernorm"):
            vec(p + n + ".weight", E, 1.0)
        for n in ("self_attention_res", "mlp_res"):
            vec(p + n + "_norm.weight", E, 1.0)
            vec(p + n + "_proj.weight", E, 0.0)
        a = p + "self_attn."
        if c.mla[L]:
            Hm, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
            mat(a + "q_a_proj.weight", c.q_lora_rank, E)
            vec(a + "q_a_layernorm.weight", c.q_lora_rank, 1.0)
            mat(a + "q_b_proj.weight", Hm * (nope + rope), c.q_lora_rank)
            mat(a + "kv_a_proj_with_mqa.weight", c.kv_lora_rank + rope, E)
            vec(a + "kv_a_layernorm.weight", c.kv_lora_rank, 1.0)
            mat(a + "kv_b_proj.weight", Hm * (nope + vd), c.kv_lora_rank)
            mat(a + "g_proj.weight", Hm * vd, E)
            mat(a + "o_proj.weight", E, Hm * vd, proj_std)
        else:
            H, D, K = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
            P = H * D
            for n in ("q", "k", "v"):
                mat(a + n + "_proj.weight", P, E)
                w = torch.zeros(P, 1, K)
                w[:, 0, K - 1] = 1.0
                w += torch.randn(P, 1, K, generator=gen) * 0.1
                out[a + n + "_conv1d.weight"] = (w, "f32")
            mat(a + "g_proj.weight", P, E)
            mat(a + "o_proj.weight", E, P, proj_std)
            mat(a + "f_a_proj.weight", D, E)
            mat(a + "f_b_proj.weight", P, D)
            mat(a + "b_proj.weight", H, E)
            out[a + "A_log"] = (torch.zeros(H), "f32")
            out[a + "dt_bias"] = (torch.rand(P, generator=gen) * -5.0 - 1.0, "f32")
            vec(a + "o_norm.weight", D, 1.0)
        if L < c.first_k_dense_replace:
            m = p + "mlp."
            mat(m + "gate_proj.weight", c.intermediate_size, E)
            mat(m + "up_proj.weight", c.intermediate_size, E)
            mat(m + "down_proj.weight", E, c.intermediate_size, proj_std)
        else:
            m = p + "block_sparse_moe."
            X, Lt, I = c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
            mat(m + "gate.weight", X, E, std, "f32")
            vec(m + "gate.e_score_correction_bias", X, 0.0)
            mat(m + "routed_expert_down_proj.weight", Lt, E)
            mat(m + "routed_expert_up_proj.weight", E, Lt, proj_std)
            vec(m + "routed_expert_norm.weight", Lt, 1.0)
            Is = I * c.num_shared_experts
            mat(m + "shared_experts.gate_proj.weight", Is, E)
            mat(m + "shared_experts.up_proj.weight", Is, E)
            mat(m + "shared_experts.down_proj.weight", E, Is, proj_std)
            out[m + "experts.w1"] = (torch.randn(X, I, Lt, generator=gen) * (1 / math.sqrt(Lt)), "mxfp4")
            out[m + "experts.w3"] = (torch.randn(X, I, Lt, generator=gen) * (1 / math.sqrt(Lt)), "mxfp4")
            out[m + "experts.w2"] = (torch.randn(X, Lt, I, generator=gen) * (1 / math.sqrt(I)), "mxfp4")
    return out
