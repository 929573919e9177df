#!/usr/bin/python3
"""selftest - checks of the float64 reference's own pieces that need no C
code: format decoding on hand-computed bytes, the safetensors reader on files
written here, config parsing (nested vs flat, errors), the KDA recurrence and
MLA attention against implementations written a second way, the AttnRes block
stack, routing rules, whole-model invariants (chunked == token by token,
causality, MXFP4 == identical plain experts) on a small random checkpoint,
that every planted bug moves the logits, and the command line.

Run: /usr/bin/python3 tests/ref/selftest.py   (exit 0 = all passed)
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, HERE)
import k3ref  # noqa: E402
import minickpt  # noqa: E402
import safetensors_np as stnp  # noqa: E402

TESTS = []
TMP = None


def test(fn):
    TESTS.append(fn)
    return fn


def rel(a, b):
    """The project's logit metric: max |a-b| over max |b|."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def expect_raises(exc, fn, *contains):
    try:
        fn()
    except exc as ex:
        for c in contains:
            assert c in str(ex), f"message {str(ex)!r} lacks {c!r}"
        return
    raise AssertionError(f"{fn} did not raise {exc.__name__}")


_ckpts = {}


def ckpt(name, **kw):
    """A mini checkpoint written once per variant."""
    if name not in _ckpts:
        d = os.path.join(TMP, name)
        minickpt.write_checkpoint(d, **kw)
        _ckpts[name] = d
    return _ckpts[name]


_models = {}


def model(name, plant=None, **kw):
    key = (name, plant)
    if key not in _models:
        _models[key] = k3ref.Model(ckpt(name, **kw), plant=plant)
    return _models[key]


def run_logits(m, ids):
    return m.forward(ids, m.new_state())


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]

# ---------------------------------------------------------------- formats


@test
def bf16_is_the_top_half_of_f32():
    bits = np.array([0x0000, 0x8000, 0x3F80, 0xC000, 0x7F80, 0xFF80, 0x0001, 0x4049], dtype=np.uint16)
    got = stnp.bf16_to_f32(bits).astype(np.float64)
    want = [0.0, -0.0, 1.0, -2.0, np.inf, -np.inf, 2.0 ** -133, 3.140625]
    assert np.array_equal(got, want), got
    assert np.signbit(got[1])
    assert np.isnan(stnp.bf16_to_f32(np.array([0x7FC0], dtype=np.uint16))[0])
    # writer rounding: to nearest, ties to even
    f = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF], dtype=np.uint32).view(np.float32)
    assert list(stnp.f32_to_bf16(f)) == [0x3F80, 0x3F82, 0x3F81, 0x3F80]


@test
def f16_decoder_matches_ieee_binary16_on_every_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    mine = stnp.f16_to_f64(bits)
    ieee = bits.view(np.float16).astype(np.float64)
    same = (mine == ieee) | (np.isnan(mine) & np.isnan(ieee))
    assert same.all(), np.nonzero(~same)[0][:5]
    num = ~np.isnan(ieee)
    assert np.array_equal(np.signbit(mine[num]), np.signbit(ieee[num]))
    assert stnp.f16_to_f64(np.array([0x0001]))[0] == 2.0 ** -24


@test
def f8_decoders_follow_e4m3fn_and_e5m2():
    e4 = stnp.e4m3_to_f64(np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x3C, 0x7E, 0xFE, 0x78, 0x80]))
    assert list(e4) == [0, 2 ** -9, 7 * 2 ** -9, 2 ** -6, 1.0, 1.5, 448, -448, 256, -0.0], e4
    assert np.isnan(stnp.e4m3_to_f64(np.array([0x7F, 0xFF]))).all()
    e5 = stnp.e5m2_to_f64(np.array([0x3C, 0x01, 0x04, 0x7B, 0x7C, 0xFC, 0xC0]))
    assert list(e5) == [1.0, 2 ** -16, 2 ** -14, 57344, np.inf, -np.inf, -2.0], e5
    assert np.isnan(stnp.e5m2_to_f64(np.array([0x7D, 0x7E, 0x7F]))).all()


@test
def mxfp4_low_nibble_is_the_even_element():
    # one row of 32 inputs = 16 bytes; byte 0x21 -> even code 1 (0.5), odd code 2 (1.0)
    packed = np.zeros((3, 16), dtype=np.uint8)
    packed[:, 0] = 0x21
    packed[:, 1] = 0xF7  # even 7 (6.0), odd 15 (-6.0)
    packed[:, 2] = 0x98  # even 8 (-0.0), odd 9 (-0.5)
    scale = np.array([[127], [130], [255]], dtype=np.uint8)
    got = k3ref.mxfp4_dequant(packed, scale, 32)
    assert list(got[0, :6]) == [0.5, 1.0, 6.0, -6.0, -0.0, -0.5], got[0, :6]
    assert list(got[1, :4]) == [4.0, 8.0, 48.0, -48.0]
    assert not got[2].any()  # scale 255 contributes zero
    assert not got[0, 6:].any()
    swapped = k3ref.mxfp4_dequant(packed, scale, 32, nibble_swap=True)
    assert list(swapped[0, :6]) == [1.0, 0.5, -6.0, 6.0, -0.5, -0.0]
    # scale 0 is 2^-127, exact in float64
    tiny = k3ref.mxfp4_dequant(np.full((1, 16), 0x77, np.uint8), np.zeros((1, 1), np.uint8), 32)
    assert (tiny == 6.0 * 2.0 ** -127).all()
    # every code in both positions, scale 127: the E2M1 table itself
    allc = np.array([[(c2 << 4) | c for c, c2 in zip(range(16), range(16))]], dtype=np.uint8)
    v = k3ref.mxfp4_dequant(allc, np.full((1, 1), 127, np.uint8), 32)
    table = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert list(v[0, 0::2]) == table and list(v[0, 1::2]) == table
    expect_raises(ValueError, lambda: k3ref.mxfp4_dequant(packed, scale, 64))


@test
def safetensors_reader_round_trips_every_dtype():
    d = os.path.join(TMP, "st1")
    os.makedirs(d)
    rng = np.random.default_rng(5)
    vals = {
        "a.bf16": ("BF16", np.array([[0x3F80, 0xC000], [0x4049, 0x0000]], dtype=np.uint16)),
        "b.f16": ("F16", np.array([0x3C00, 0xC000, 0x0001], dtype=np.uint16)),
        "c.f32": ("F32", rng.standard_normal((2, 3, 4)).astype(np.float32)),
        "d.u8": ("U8", np.arange(7, dtype=np.uint8)),
        "e.i8": ("I8", np.array([-128, -1, 0, 127], dtype=np.int8)),
        "f.i32": ("I32", np.array([-2 ** 31, 5, 2 ** 31 - 1], dtype=np.int32)),
        "g.e4m3": ("F8_E4M3", np.array([0x38, 0x7E], dtype=np.uint8)),
        "h.e5m2": ("F8_E5M2", np.array([0x3C, 0xFC], dtype=np.uint8)),
        "i.empty": ("F32", np.zeros((0, 3), dtype=np.float32)),
    }
    stnp.save_file(os.path.join(d, "x.safetensors"), vals, {"k": "v"})
    r = stnp.SafetensorsDir(d)
    assert r.names() == sorted(vals)
    assert np.array_equal(r.get("a.bf16"), np.array([[1.0, -2.0], [3.140625, 0.0]], dtype=np.float32))
    assert list(r.get("b.f16")) == [1.0, -2.0, 2.0 ** -24]
    assert np.array_equal(r.get("c.f32"), vals["c.f32"][1]) and r.shape("c.f32") == (2, 3, 4)
    assert list(r.get("d.u8")) == list(range(7)) and r.get("d.u8").dtype == np.uint8
    assert list(r.get("e.i8")) == [-128, -1, 0, 127]
    assert list(r.get("f.i32")) == [-2 ** 31, 5, 2 ** 31 - 1]
    assert list(r.get("g.e4m3")) == [1.0, 448.0]
    assert list(r.get("h.e5m2")) == [1.0, -np.inf]
    assert r.get("i.empty").shape == (0, 3)
    expect_raises(stnp.SafetensorsError, lambda: r.get("nope"), "missing tensor nope")
    expect_raises(stnp.SafetensorsError, lambda: r.get_f64("d.u8"), "not a float")


@test
def safetensors_reader_follows_the_index_and_rejects_bad_files():
    d = os.path.join(TMP, "st2")
    os.makedirs(d)
    stnp.save_file(os.path.join(d, "s1.safetensors"), {"x": ("F32", np.ones(3, np.float32))})
    stnp.save_file(os.path.join(d, "s2.safetensors"), {"y": ("U8", np.arange(4, dtype=np.uint8))})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}}, f)
    r = stnp.SafetensorsDir(d)
    assert r.names() == ["x", "y"] and list(r.get("y")) == [0, 1, 2, 3]
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"x": "s2.safetensors"}}, f)
    expect_raises(stnp.SafetensorsError, lambda: stnp.SafetensorsDir(d), "lacks it")
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    stnp.save_file(os.path.join(d, "s3.safetensors"), {"x": ("F32", np.ones(3, np.float32))})
    expect_raises(stnp.SafetensorsError, lambda: stnp.SafetensorsDir(d), "in two shards")
    os.remove(os.path.join(d, "s3.safetensors"))
    # header length past the end of the file
    with open(os.path.join(d, "s1.safetensors"), "r+b") as f:
        f.write((10 ** 6).to_bytes(8, "little"))
    expect_raises(stnp.SafetensorsError, lambda: stnp.SafetensorsDir(d), "past end of file")
    # size != shape x dtype
    hdr = json.dumps({"z": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}).encode()
    with open(os.path.join(d, "s1.safetensors"), "wb") as f:
        f.write(len(hdr).to_bytes(8, "little") + hdr + bytes(12))
    expect_raises(stnp.SafetensorsError, lambda: stnp.SafetensorsDir(d), "expected 8")


# ---------------------------------------------------------------- config


@test
def config_nested_and_flat_give_the_same_model_config():
    flat = k3ref.parse_config(dict(minickpt.MINI))
    nested = k3ref.parse_config(minickpt.nest(minickpt.MINI))
    assert vars(flat) == vars(nested), (flat, nested)
    assert flat.mla_layers == [1, 4] and flat.H == 2 and flat.D == 16 and flat.b1 == 4.0


@test
def config_names_every_missing_field_and_defaults_only_the_three_booleans():
    c = dict(minickpt.MINI)
    for k in ("hidden_size", "rms_norm_eps", "situ_beta", "full_attn_layers",
              "mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"):
        del c[k]
    try:
        k3ref.parse_config(c)
        raise AssertionError("accepted a config with missing fields")
    except k3ref.ConfigError as ex:
        msg = str(ex)
    for k in ("hidden_size", "rms_norm_eps", "situ_beta", "full_attn_layers"):
        assert k in msg, msg
    for k in ("mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"):
        assert k not in msg, msg
    c = dict(minickpt.MINI)
    for k in ("mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"):
        del c[k]
    cfg = k3ref.parse_config(c)
    assert cfg.mla_gate and cfg.renorm and cfg.moe_norm


@test
def config_layer_lists_and_validation():
    n = minickpt.MINI["num_hidden_layers"]
    c = dict(minickpt.MINI)
    del c["full_attn_layers"]
    c["kda_layers"] = [1, 3, 4]
    assert k3ref.parse_config(c).mla_layers == [1, 4]
    c["full_attn_layers"] = [2, 5]
    assert k3ref.parse_config(c).mla_layers == [1, 4]
    c["full_attn_layers"] = [2]
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), "not complementary")
    c = dict(minickpt.MINI, full_attn_layers=[0, 2])
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), f"outside 1..{n}")
    c = dict(minickpt.MINI, full_attn_layers=[])
    assert k3ref.parse_config(c).mla_layers == []
    c = dict(minickpt.MINI, num_experts_per_token=9)
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), "num_experts_per_token 9 > num_experts 8")
    c = dict(minickpt.MINI, moe_intermediate_size=48)
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), "multiples of 32")
    c = dict(minickpt.MINI, quantization_config={"group_size": 64})
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), "group_size")
    nested = minickpt.nest(minickpt.MINI)
    nested["text_config"]["situ_beta"] = 3.0  # disagrees with activation_situ_beta 4.0
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(nested), "conflicting")
    c = dict(minickpt.MINI, hidden_size="64")
    expect_raises(k3ref.ConfigError, lambda: k3ref.parse_config(c), "hidden_size is not an integer")


# ---------------------------------------------------------------- pieces


def kda_second_way(q, k, v, g, beta, S0):
    """Delta rule as a transition: S_t = (I - b k k^T) diag(e^g) S_{t-1} + b k v^T,
    o_t = S_t^T q_t; one head at a time with explicit matrices."""
    T, H, D = q.shape
    o = np.zeros_like(v)
    S = S0.copy()
    eye = np.eye(D)
    for h in range(H):
        Sh = S[h]
        for t in range(T):
            kk = k[t, h][:, None]
            A = (eye - beta[t, h] * (kk @ kk.T)) @ np.diag(np.exp(g[t, h]))
            Sh = A @ Sh + beta[t, h] * (kk @ v[t, h][None, :])
            o[t, h] = Sh.T @ q[t, h]
        S[h] = Sh
    return o, S


@test
def kda_recurrence_matches_the_transition_form_and_chunking():
    rng = np.random.default_rng(7)
    T, H, D = 9, 3, 5
    q = k3ref.l2norm(rng.standard_normal((T, H, D))) * D ** -0.5
    k = k3ref.l2norm(rng.standard_normal((T, H, D)))
    v = rng.standard_normal((T, H, D))
    g = -5.0 * k3ref.sigmoid(rng.standard_normal((T, H, D)))
    beta = k3ref.sigmoid(rng.standard_normal((T, H)))
    S0 = rng.standard_normal((H, D, D)) * 0.1
    S = S0.copy()
    o = k3ref.kda_recurrence(q, k, v, g, beta, S)
    o2, S2 = kda_second_way(q, k, v, g, beta, S0)
    assert np.allclose(o, o2, rtol=1e-12, atol=1e-13) and np.allclose(S, S2, rtol=1e-12, atol=1e-13)
    # reading the UPDATED state: at t=0 from S0=0, o = beta (k.q) v
    Sz = np.zeros((H, D, D))
    o0 = k3ref.kda_recurrence(q[:1], k[:1], v[:1], g[:1], beta[:1], Sz)
    want = beta[0][:, None] * np.sum(k[0] * q[0], axis=1)[:, None] * v[0]
    assert np.allclose(o0[0], want, rtol=1e-13)
    # two chunks with the carried state == one
    Sa = S0.copy()
    oa = np.concatenate([k3ref.kda_recurrence(q[:4], k[:4], v[:4], g[:4], beta[:4], Sa),
                         k3ref.kda_recurrence(q[4:], k[4:], v[4:], g[4:], beta[4:], Sa)])
    assert np.array_equal(oa, o) and np.array_equal(Sa, S)


@test
def causal_conv_takes_the_oldest_tap_first_and_carries_history():
    rng = np.random.default_rng(3)
    P, conv, T = 4, 4, 7
    w = rng.standard_normal((P, conv))
    x = np.zeros((T, P))
    x[0] = 1.0  # impulse at t=0: y_t = w[:, conv-1-t]
    y, hist = k3ref.causal_conv(x, np.zeros((conv - 1, P)), w)
    for t in range(conv):
        assert np.array_equal(y[t], w[:, conv - 1 - t]), t
    assert not y[conv:].any()
    x = rng.standard_normal((T, P))
    y, hist = k3ref.causal_conv(x, np.zeros((conv - 1, P)), w)
    for t in range(T):
        direct = sum(w[:, j] * x[t - (conv - 1) + j] for j in range(conv) if t - (conv - 1) + j >= 0)
        assert np.allclose(y[t], direct, rtol=1e-14, atol=1e-15)
    h0 = np.zeros((conv - 1, P))
    ya, h0 = k3ref.causal_conv(x[:2], h0, w)
    yb, h0 = k3ref.causal_conv(x[2:3], h0, w)
    yc, h0 = k3ref.causal_conv(x[3:], h0, w)
    assert np.allclose(np.concatenate([ya, yb, yc]), y, rtol=1e-14, atol=1e-15)
    assert np.array_equal(h0, hist) and np.array_equal(hist, x[-(conv - 1):])


@test
def mla_matches_a_per_head_loop_and_is_causal():
    m = model("mx")
    c = m.cfg
    L = c.mla_layers[0]
    ly = m.layers[L]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, c.E))
    out = m.mla(ly, x, m.new_state()[L])
    # the same layer written as loops over positions and heads
    qk = c.nope + c.rope
    want = np.zeros((6, c.n_heads * c.v_dim))
    lats, krs = [], []
    for t in range(6):
        cc = ly["kv_a"] @ x[t]
        lats.append(k3ref.rmsnorm(cc[:c.kv_lora], ly["kv_a_norm"], c.eps))
        krs.append(cc[c.kv_lora:])
        q = ly["q_b"] @ k3ref.rmsnorm(ly["q_a"] @ x[t], ly["q_a_norm"], c.eps)
        for h in range(c.n_heads):
            qh = q[h * qk:(h + 1) * qk]
            scores, vals = [], []
            for s in range(t + 1):
                kv = (ly["kv_b"] @ lats[s])[h * (c.nope + c.v_dim):(h + 1) * (c.nope + c.v_dim)]
                scores.append((qh[:c.nope] @ kv[:c.nope] + qh[c.nope:] @ krs[s]) / np.sqrt(qk))
                vals.append(kv[c.nope:])
            p = np.exp(np.array(scores) - max(scores))
            want[t, h * c.v_dim:(h + 1) * c.v_dim] = (p / p.sum()) @ np.array(vals)
        gate = 1.0 / (1.0 + np.exp(-(ly["g"] @ x[t])))
        want[t] *= gate
    want = want @ ly["o"].T
    assert np.allclose(out, want, rtol=1e-11, atol=1e-12), np.max(np.abs(out - want))
    # changing a later position leaves earlier outputs alone
    x2 = x.copy()
    x2[4] += 1.0
    out2 = m.mla(ly, x2, m.new_state()[L])
    assert np.array_equal(out2[:4], out[:4]) and not np.allclose(out2[4], out[4])


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _wt(m, name):
    return m.st.get_f64(k3ref.PFX + name)


@test
def kda_layer_matches_a_loop_written_from_the_spec():
    m = model("mx")
    c = m.cfg
    L = 0  # KDA + dense in the mini config
    assert L not in c.mla_layers
    rng = np.random.default_rng(13)
    T = 7
    x = rng.standard_normal((T, c.E))
    got = m.kda(m.layers[L], x, m.new_state()[L])
    a = f"layers.{L}.self_attn."
    H, D, K = c.H, c.D, c.conv
    W = {n: _wt(m, a + f"{n}_proj.weight") for n in ("q", "k", "v", "g", "o", "f_a", "f_b", "b")}
    cw = {n: _wt(m, a + f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"}
    a_log = _wt(m, a + "A_log").reshape(-1)
    dt_bias = _wt(m, a + "dt_bias")
    o_norm = _wt(m, a + "o_norm.weight")
    S = [np.zeros((D, D)) for _ in range(H)]
    pre = {n: [] for n in "qkv"}
    want = np.zeros((T, c.E))
    for t in range(T):
        act = {}
        for n in "qkv":
            pre[n].append(W[n] @ x[t])
            y = np.zeros(H * D)
            for j in range(K):  # tap j multiplies the input j - (K-1) steps away
                src = t - (K - 1) + j
                if src >= 0:
                    y += cw[n][:, j] * pre[n][src]
            act[n] = y * _sig(y)
        z = W["f_b"] @ (W["f_a"] @ x[t]) + dt_bias
        bl = W["b"] @ x[t]
        o = np.zeros(H * D)
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            qh = act["q"][sl] / np.sqrt(np.sum(act["q"][sl] ** 2) + 1e-6) / np.sqrt(D)
            kh = act["k"][sl] / np.sqrt(np.sum(act["k"][sl] ** 2) + 1e-6)
            vh = act["v"][sl]
            gh = c.lb * _sig(np.exp(a_log[h]) * z[sl])
            bh = _sig(bl[h])
            S[h] = np.diag(np.exp(gh)) @ S[h]
            u = S[h].T @ kh
            S[h] = S[h] + np.outer(kh, bh * (vh - u))
            oh = S[h].T @ qh
            o[sl] = o_norm * oh / np.sqrt(np.mean(oh ** 2) + c.eps)
        want[t] = W["o"] @ (o * _sig(W["g"] @ x[t]))
    assert np.allclose(got, want, rtol=1e-10, atol=1e-12), np.max(np.abs(got - want))


@test
def moe_and_dense_layers_match_loops_written_from_the_spec():
    m = model("mx")
    c = m.cfg
    rng = np.random.default_rng(17)
    x = rng.standard_normal((3, c.E))
    b1, b2 = c.b1, c.b2

    def situ(g, u):
        return b1 * np.tanh(g / b1) * _sig(g) * b2 * np.tanh(u / b2)

    L = c.k_dense  # first MoE layer
    pm = f"layers.{L}.block_sparse_moe."
    got = m.moe(m.layers[L], x)
    router, bias = _wt(m, pm + "gate.weight"), _wt(m, pm + "gate.e_score_correction_bias")
    for t in range(3):
        s = _sig(router @ x[t])
        chosen = sorted(range(c.n_exp), key=lambda e: (-(s[e] + bias[e]), e))[:c.topk]
        w = np.array([s[e] for e in chosen])
        w = w / (w.sum() + 1e-20) * c.scale
        z = _wt(m, pm + "routed_expert_down_proj.weight") @ x[t]
        acc = np.zeros(c.L_lat)
        for j, e in enumerate(chosen):
            ex = {}
            for n in ("w1", "w2", "w3"):
                packed = m.st.get(k3ref.PFX + pm + f"experts.{e}.{n}.weight_packed")
                sc = m.st.get(k3ref.PFX + pm + f"experts.{e}.{n}.weight_scale")
                rows, half = packed.shape
                dq = np.zeros((rows, 2 * half))
                for r in range(rows):
                    for i in range(2 * half):
                        nib = (packed[r, i // 2] >> (4 * (i % 2))) & 15
                        mag = [0, .5, 1, 1.5, 2, 3, 4, 6][nib & 7] * (-1 if nib & 8 else 1)
                        e8 = int(sc[r, i // 32])
                        dq[r, i] = 0.0 if e8 == 255 else mag * 2.0 ** (e8 - 127)
                ex[n] = dq
            acc += w[j] * (ex["w2"] @ situ(ex["w1"] @ z, ex["w3"] @ z))
        acc = _wt(m, pm + "routed_expert_norm.weight") * acc / np.sqrt(np.mean(acc ** 2) + c.eps)
        sh = pm + "shared_experts."
        y = _wt(m, pm + "routed_expert_up_proj.weight") @ acc + _wt(m, sh + "down_proj.weight") @ situ(
            _wt(m, sh + "gate_proj.weight") @ x[t], _wt(m, sh + "up_proj.weight") @ x[t])
        assert np.allclose(got[t], y, rtol=1e-10, atol=1e-12), (t, np.max(np.abs(got[t] - y)))
    pd = "layers.0.mlp."
    got = m.mlp(x, m.layers[0]["gate"], m.layers[0]["up"], m.layers[0]["down"])
    want = (situ(x @ _wt(m, pd + "gate_proj.weight").T, x @ _wt(m, pd + "up_proj.weight").T)
            @ _wt(m, pd + "down_proj.weight").T)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-13)


@test
def forward_matches_the_spec_pseudo_code_for_one_token():
    m = model("mx")
    c = m.cfg
    tok = 42

    def rms(v, w):
        return w * v / np.sqrt(np.mean(v ** 2) + c.eps)

    def attnres(srcs, pre):
        f = (_wt(m, pre + "_norm.weight").reshape(-1) * _wt(m, pre + "_proj.weight").reshape(-1))
        sc = [float((S / np.sqrt(np.mean(S ** 2) + c.eps)) @ f) for S in srcs]
        p = np.exp(np.array(sc) - max(sc))
        p /= p.sum()
        return sum(pi * S for pi, S in zip(p, srcs))

    state = m.new_state()
    h = _wt(m, "embed_tokens.weight")[tok]
    stack = []
    for L in range(c.n_layers):
        ly, pl = m.layers[L], f"layers.{L}."
        prefix = h
        if stack:
            h = attnres(stack + [prefix], pl + "self_attention_res")
        if L % c.B == 0:
            stack.append(prefix)
            prefix = None
        xa = rms(h, _wt(m, pl + "input_layernorm.weight"))[None, :]
        a = (m.mla(ly, xa, state[L]) if L in c.mla_layers else m.kda(ly, xa, state[L]))[0]
        prefix = a if prefix is None else prefix + a
        h = attnres(stack + [prefix], pl + "mlp_res")
        xm = rms(h, _wt(m, pl + "post_attention_layernorm.weight"))[None, :]
        mm = (m.mlp(xm, ly["gate"], ly["up"], ly["down"]) if L < c.k_dense else m.moe(ly, xm))[0]
        h = prefix + mm
    h = attnres(stack + [h], "output_attn_res")
    want = m.st.get_f64(k3ref.HEAD) @ rms(h, _wt(m, "norm.weight"))
    got = run_logits(m, [tok])[0]
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12), rel(got, want)


@test
def attnres_stack_grows_one_source_per_block():
    m = model("mx")  # 5 layers, block size 2
    trace = []
    m.forward([1, 2], m.new_state(), trace=trace)
    want = [(0, "mlp", 2), (1, "attn", 2), (1, "mlp", 2), (2, "attn", 2), (2, "mlp", 3),
            (3, "attn", 3), (3, "mlp", 3), (4, "attn", 3), (4, "mlp", 4), (5, "out", 4)]
    assert trace == want, trace
    bad = model("mx", plant="no_attnres_reset")
    trace = []
    bad.forward([1, 2], bad.new_state(), trace=trace)
    assert all(n == 2 for _, _, n in trace), trace


@test
def attnres_weights_raw_sources_by_softmax_of_normalised_scores():
    rng = np.random.default_rng(2)
    S0, S1 = rng.standard_normal((1, 8)), rng.standard_normal((1, 8)) * 10
    f = rng.standard_normal(8)
    assert np.array_equal(k3ref.attn_res([S0], f, 1e-5), S0)
    out = k3ref.attn_res([S0, S1], f, 1e-5)
    k0 = S0[0] / np.sqrt(np.mean(S0[0] ** 2) + 1e-5)
    k1 = S1[0] / np.sqrt(np.mean(S1[0] ** 2) + 1e-5)
    a, b = np.exp(k0 @ f), np.exp(k1 @ f)
    assert np.allclose(out[0], (a * S0[0] + b * S1[0]) / (a + b), rtol=1e-13)


@test
def situ_glu_sigmoid_sees_the_uncapped_gate():
    g, u = np.array([10.0, -3.0, 0.5]), np.array([1.0, 40.0, -2.0])
    got = k3ref.situ_glu(g, u, 4.0, 25.0)
    want = [4 * np.tanh(g[i] / 4) / (1 + np.exp(-g[i])) * 25 * np.tanh(u[i] / 25) for i in range(3)]
    assert np.allclose(got, want, rtol=1e-15)
    assert np.allclose(k3ref.rmsnorm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), 0.5),
                       [3 / np.sqrt(12.5 + 0.5), 8 / np.sqrt(12.5 + 0.5)], rtol=1e-15)
    assert np.allclose(k3ref.l2norm(np.array([3.0, 4.0])), [3 / np.sqrt(25 + 1e-6), 4 / np.sqrt(25 + 1e-6)])
    big = k3ref.sigmoid(np.array([-1000.0, 1000.0]))
    assert big[0] == 0.0 and big[1] == 1.0


@test
def routing_uses_bias_to_select_only_and_breaks_ties_by_lower_index():
    m = k3ref.Model.__new__(k3ref.Model)
    m.plant, m.min_margin = None, np.inf
    m.cfg = k3ref.Config()
    m.cfg.n_exp, m.cfg.topk, m.cfg.renorm, m.cfg.scale = 5, 2, True, 2.0
    # router rows give logits 0, 1, 1, -1, 2 on x = [1]
    ly = {"router": np.array([[0.0], [1.0], [1.0], [-1.0], [2.0]]),
          "bias": np.array([0.0, 0.0, 0.0, 5.0, 0.0])}
    idx, w = m.route(ly, np.array([[1.0]]))
    s = 1 / (1 + np.exp(-np.array([0.0, 1.0, 1.0, -1.0, 2.0])))
    assert list(idx[0]) == [3, 4], idx  # expert 3 only through its bias
    assert np.allclose(w[0], 2.0 * s[[3, 4]] / (s[3] + s[4] + 1e-20), rtol=1e-15)
    ly["bias"] = np.zeros(5)
    ly["router"][4, 0] = 1.0  # experts 1, 2, 4 tie
    idx, _ = m.route(ly, np.array([[1.0]]))
    assert list(idx[0]) == [1, 2], idx
    m.cfg.renorm = False
    _, w = m.route(ly, np.array([[1.0]]))
    assert np.allclose(w[0], 2.0 * s[[1, 2]], rtol=1e-15)
    m.plant = "biased_combine"
    ly["bias"] = np.array([0.0, 0.5, 0.0, 0.0, 0.0])
    _, w = m.route(ly, np.array([[1.0]]))
    assert np.allclose(w[0], 2.0 * np.array([s[1] + 0.5, s[2]]), rtol=1e-15)


# ---------------------------------------------------------------- whole model


@test
def model_token_by_token_equals_one_chunk_and_is_causal():
    m = model("mx")
    full = run_logits(m, PROMPT)
    st = m.new_state()
    steps = np.concatenate([m.forward([t], st) for t in PROMPT])
    assert rel(steps, full) < 1e-12, rel(steps, full)
    st = m.new_state()
    parts = np.concatenate([m.forward(PROMPT[:3], st), m.forward(PROMPT[3:7], st), m.forward(PROMPT[7:], st)])
    assert rel(parts, full) < 1e-12
    changed = run_logits(m, PROMPT[:6] + [0, 1, 2, 4])
    assert rel(changed[:6], full[:6]) < 1e-12 and rel(changed[6:], full[6:]) > 1e-3
    # alive: logits depend on the input, not flat
    assert full.std(axis=1).min() > 0.5 and rel(full[0], full[1]) > 0.1


@test
def model_is_the_same_for_mxfp4_and_plain_experts_and_any_file_layout():
    ref = run_logits(model("mx"), PROMPT)
    for name, kw in (("bf16", {"experts": "bf16"}), ("f32", {"experts": "f32"}),
                     ("nested3", {"nested": True, "shards": 3}), ("alog_h", {"alog_padded": False})):
        got = run_logits(model(name, **kw), PROMPT)
        assert np.array_equal(got, ref), (name, rel(got, ref))
    other = run_logits(model("seed2", seed=2), PROMPT)
    assert rel(other, ref) > 0.1


@test
def model_routing_is_alive():
    m = model("mx")
    seen = set()
    orig = m.route

    def spy(ly, x):
        idx, w = orig(ly, x)
        seen.update(int(e) for e in idx.reshape(-1))
        return idx, w
    m.route = spy
    try:
        run_logits(m, PROMPT)
    finally:
        del m.route
    assert len(seen) == m.cfg.n_exp, seen


@test
def every_planted_bug_moves_the_logits_far_beyond_the_gate():
    ref = run_logits(model("mx"), PROMPT)
    for plant in k3ref.PLANTS:
        got = run_logits(model("mx", plant=plant), PROMPT)
        r = rel(got, ref)
        assert r > 1e-2, (plant, r)
        print(f"     plant {plant}: relative logit difference {r:.3g}")


@test
def float32_emulation_stays_float32_and_near_the_reference():
    m32 = k3ref.Model(ckpt("mx"), dtype=np.float32)
    st = m32.new_state()
    got = m32.forward(PROMPT, st)
    assert got.dtype == np.float32 and all(v.dtype == np.float32 for d in st for v in d.values()
                                           if isinstance(v, np.ndarray))
    r = rel(got.astype(np.float64), run_logits(model("mx"), PROMPT))
    assert 1e-9 < r < 1e-3, r


# ---------------------------------------------------------------- command line


@test
def cli_prints_json_and_writes_float32_logits():
    d = ckpt("mx")
    la, l1 = os.path.join(TMP, "la.bin"), os.path.join(TMP, "l1.bin")
    p = subprocess.run([sys.executable, os.path.join(HERE, "k3ref.py"), d, "--ids", "3,14,15,92",
                        "--gen", "5", "--logits-all", la, "--logits", l1],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert list(out) == ["prompt_ids", "generated_ids"] and out["prompt_ids"] == [3, 14, 15, 92]
    m = model("mx")
    logits, gen = k3ref.greedy(m, [3, 14, 15, 92], 5)
    assert out["generated_ids"] == gen and len(gen) == 5
    V = m.cfg.V
    a = np.fromfile(la, dtype="<f4")
    assert a.size == 4 * V and np.array_equal(a.reshape(4, V), logits.astype(np.float32))
    b = np.fromfile(l1, dtype="<f4")
    assert b.size == V and np.array_equal(b, a[-V:])
    assert gen[0] == int(np.argmax(logits[-1]))
    # generation continues the stream: the first token's logits at the next position
    nxt = run_logits(m, [3, 14, 15, 92, gen[0]])[-1]
    assert gen[1] == int(np.argmax(nxt))
    for args, code in ((["--ids", "1,x"], 2), (["--ids", "1,97"], 2), (["--ids", "1", "--plant", "nope"], 2)):
        p = subprocess.run([sys.executable, os.path.join(HERE, "k3ref.py"), d] + args,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == code, (args, p.returncode, p.stderr)
        assert p.stdout == ""
    p = subprocess.run([sys.executable, os.path.join(HERE, "k3ref.py"), TMP, "--ids", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and p.stderr.startswith("k3ref: error:"), p.stderr


@test
def cli_planted_bugs_fail_the_logit_gate():
    d = ckpt("mx")
    k3 = [sys.executable, os.path.join(HERE, "k3ref.py"), d, "--ids", ",".join(map(str, PROMPT))]
    cmp = [sys.executable, os.path.join(HERE, "cmp_logits.py")]
    good = os.path.join(TMP, "good.bin")
    assert subprocess.run(k3 + ["--logits-all", good], capture_output=True, timeout=60).returncode == 0
    V = model("mx").cfg.V
    p = subprocess.run(cmp + [good, good, "--ckpt", d], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("rel=0.000e+00"), p.stdout
    for plant in k3ref.PLANTS:
        bad = os.path.join(TMP, f"{plant}.bin")
        assert subprocess.run(k3 + ["--logits-all", bad, "--plant", plant],
                              capture_output=True, timeout=60).returncode == 0
        p = subprocess.run(cmp + [bad, good, "--vocab", str(V)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 1, (plant, p.stdout, p.stderr)
    p = subprocess.run(cmp + [good, good, "--vocab", str(V + 1)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2


def main():
    global TMP
    TMP = tempfile.mkdtemp(prefix="k3ref-selftest-")
    failed = 0
    try:
        for fn in TESTS:
            try:
                fn()
                print(f"ok   {fn.__name__}")
            except Exception:
                failed += 1
                print(f"FAIL {fn.__name__}")
                traceback.print_exc()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
