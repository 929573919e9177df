#!/usr/bin/python3
"""Train the small K3 on the King James Bible and publish it in the upstream format.

    /usr/bin/python3 train/train.py WORK [--seed 1] [--steps N] [--threads 1] [--out DIR]

WORK receives the data split, the tokenizer, the trained weights (trained.pt) and
the training log; --out (default WORK/kjv-tiny) receives the published checkpoint:
config.json, model.safetensors.index.json, two safetensors shards (routed experts
MXFP4, large matrices BF16, norms, gates, convolution taps, routers and
attention-residual vectors F32), tiktoken.model, tokenizer_config.json,
reference.json (float64 log-probabilities of a held-out passage and greedy
continuations of five prompts), train_log.json and SHA256SUMS.
--export-only reuses WORK/trained.pt.
Everything is a function of the seed and of the bible-kjv-text package.
"""
import argparse
import hashlib
import json
import math
import os
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3model  # noqa: E402
import kjvtok  # noqa: E402

N_RANKS = 3072
SEQ = 64
BATCH = 16
HELD_EVERY = 40          # chapter i is held out when i % 40 == 20 (30 of 1,189 chapters)
PASSAGE = 256            # tokens of the held-out passage in reference.json
GREEDY = 32              # greedy tokens per prompt in reference.json
PROMPTS = ["In the beginning God created",
           "And the LORD said unto Moses,",
           "The LORD is my shepherd;",
           "Blessed are the",
           "And it came to pass, when the king"]

CONFIG = {
    "architectures": ["KimiK3ForCausalLM"],
    "model_type": "kimi_k3",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "vocab_size": N_RANKS + len(kjvtok.SPECIALS),
    "rms_norm_eps": 1e-5,
    "kda_num_heads": 4,
    "kda_head_dim": 32,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_output_gate": True,
    "num_experts": 32,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "routed_expert_hidden_size": 64,
    "moe_intermediate_size": 64,
    "routed_scaling_factor": 1.0,
    "moe_renormalize": True,
    "latent_moe_use_norm": True,
    "first_k_dense_replace": 1,
    "intermediate_size": 256,
    "attn_res_block_size": 2,
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "full_attn_layers": [2, 4],
    "quantization_config": {"quant_method": "mxfp4", "group_size": 32,
                            "modules_to_quantize": ["block_sparse_moe.experts"]},
    "torch_dtype": "bfloat16",
}


def log(msg):
    print("train: " + msg, flush=True)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def prepare_data(work):
    chapters, raw = kjvtok.read_bible()
    train_txt, held_txt = [], []
    for i, (_, _, verses) in enumerate(chapters):
        (held_txt if i % HELD_EVERY == HELD_EVERY // 2 else train_txt).append(kjvtok.chapter_text(verses))
    train_txt, held_txt = "".join(train_txt), "".join(held_txt)
    t0 = time.time()
    ranks = kjvtok.train_bpe(train_txt, N_RANKS)
    tok = kjvtok.Tokenizer(ranks)
    tr = tok.encode(train_txt)
    he = tok.encode(held_txt)
    log("data: %d chapters, bible output sha256 %s; train %d chars %d tokens, held-out %d chars %d tokens "
        "(tokenizer %.0f s)" % (len(chapters), hashlib.sha256(raw).hexdigest(), len(train_txt), len(tr),
                                len(held_txt), len(he), time.time() - t0))
    with open(os.path.join(work, "heldout.txt"), "w") as f:
        f.write(held_txt)
    info = {"chapters": len(chapters), "bible_output_sha256": hashlib.sha256(raw).hexdigest(),
            "train_chars": len(train_txt), "train_tokens": len(tr),
            "heldout_chars": len(held_txt), "heldout_tokens": len(he),
            "heldout_chapters": [c[0] + " " + str(c[1]) for i, c in enumerate(chapters)
                                 if i % HELD_EVERY == HELD_EVERY // 2]}
    return tok, torch.tensor(tr, dtype=torch.long), torch.tensor(he, dtype=torch.long), info, held_txt


def lr_at(step, steps, peak):
    warm = 20
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def heldout_nll(model, held):
    """Mean NLL (nats/token) over non-overlapping SEQ windows of the held-out
    tokens, each window from a fresh state (its first token is not scored)."""
    tot, n = 0.0, 0
    with torch.no_grad():
        nwin = (len(held) - 1) // SEQ
        for b0 in range(0, nwin, BATCH):
            ids = torch.stack([held[i * SEQ:(i + 1) * SEQ + 1] for i in range(b0, min(nwin, b0 + BATCH))])
            logits = model.forward(ids[:, :-1])
            lp = torch.log_softmax(logits.double(), -1)
            tot -= lp.gather(-1, ids[:, 1:, None]).sum().item()
            n += ids[:, 1:].numel()
    return tot / n


def fit(cfg, tr, held, seed, steps, work):
    gen = torch.Generator().manual_seed(seed)
    init = k3model.init_params(cfg, gen)
    P = {k: v[0].clone().requires_grad_(not k.endswith("e_score_correction_bias")) for k, v in init.items()}
    quant = {k: v[1] for k, v in init.items()}
    model = k3model.K3(cfg, P, quant)
    decay = [t for k, t in P.items() if t.requires_grad and t.dim() >= 2 and "conv1d" not in k]
    other = [t for k, t in P.items() if t.requires_grad and not (t.dim() >= 2 and "conv1d" not in k)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=5e-3, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(seed + 1000)
    curve = []
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 5e-3)
        starts = torch.randint(0, len(tr) - SEQ - 1, (BATCH,), generator=data_gen)
        ids = torch.stack([tr[s:s + SEQ + 1] for s in starts.tolist()])
        logits = model.forward(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([t for t in P.values() if t.requires_grad], 1.0)
        opt.step()
        with torch.no_grad():
            # selection bias: push every expert's load towards the mean (no loss term)
            for L, load in model.loads.items():
                b = P["layers.%d.block_sparse_moe.gate.e_score_correction_bias" % L]
                b += 1e-3 * torch.sign(load.float().mean() - load.float())
        if step % 10 == 0 or step == steps - 1:
            curve.append([step, round(loss.item(), 4)])
            log("step %d/%d loss %.4f (%.0f s)" % (step, steps, loss.item(), time.time() - t0))
    wall = time.time() - t0
    model.quant = quant
    nll = heldout_nll(model, held)
    log("held-out: %.4f nats/token, perplexity %.3f (float32, stored weights)" % (nll, math.exp(nll)))
    torch.save({"P": {k: t.detach() for k, t in P.items()}, "quant": quant, "curve": curve, "wall": wall,
                "heldout_nll": nll}, os.path.join(work, "trained.pt"))


# --- export ---------------------------------------------------------------

def bf16_bytes(t):
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def export(cfg, tok, state, out):
    """Upstream tensors: name -> (dtype, shape, bytes), plus their exact values for the float64 model."""
    P, quant = state["P"], state["quant"]
    tensors = {}
    exact = {}
    pre = "language_model.model."
    for k in sorted(P):
        t = P[k].detach().float()
        how = quant[k]
        if how == "mxfp4":
            base = k[:-len("experts.w1")]
            w = k[-2:]
            for e in range(t.shape[0]):
                code, scale = k3model.mxfp4_codes(t[e])
                packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
                n = pre + base + "experts.%d.%s." % (e, w)
                tensors[n + "weight_packed"] = ("U8", list(packed.shape), packed.numpy().tobytes())
                tensors[n + "weight_scale"] = ("U8", list(scale.shape), scale.numpy().tobytes())
                exact.setdefault(k, []).append(k3model.mxfp4_values(code, scale))
            exact[k] = torch.stack(exact[k])
            continue
        name = ("language_model." + k) if k == "lm_head.weight" else pre + k
        if how == "bf16":
            tensors[name] = ("BF16", list(t.shape), bf16_bytes(t))
            exact[k] = t.to(torch.bfloat16).double()
        else:
            tensors[name] = ("F32", list(t.shape), t.numpy().astype("<f4").tobytes())
            exact[k] = t.double()
    os.makedirs(out, exist_ok=True)
    # two shards: everything but the head and the embedding, then those two
    big = {"language_model.lm_head.weight", pre + "embed_tokens.weight"}
    shards = [("model-00001-of-00002.safetensors", sorted(n for n in tensors if n not in big)),
              ("model-00002-of-00002.safetensors", sorted(big))]
    wmap, total = {}, 0
    for fname, names in shards:
        hdr, off = {}, 0
        for n in names:
            d, s, b = tensors[n]
            hdr[n] = {"dtype": d, "shape": s, "data_offsets": [off, off + len(b)]}
            off += len(b)
            wmap[n] = fname
            total += len(b)
        hdr["__metadata__"] = {"format": "pt"}
        h = json.dumps(hdr, separators=(",", ":")).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        with open(os.path.join(out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for n in names:
                f.write(tensors[n][2])
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg.d, f, indent=2)
        f.write("\n")
    tok.write(out)
    return exact


def reference(cfg, tok, exact, held, held_txt, out):
    """Float64 forward of the exported weights: per-token log-probabilities of a
    held-out passage and greedy continuations of PROMPTS."""
    model = k3model.K3(cfg, exact, None, exact_topk=True)
    # the passage: the first PASSAGE tokens of the held-out text
    ids = held[:PASSAGE]
    with torch.no_grad():
        lp = torch.log_softmax(model.forward(ids[None])[0], -1)
    tgt = ids[1:]
    lps = lp[:-1].gather(-1, tgt[:, None])[:, 0]
    nll = -lps.mean().item()
    passage = {"text": tok.decode(ids.tolist()), "ids": ids.tolist(),
               "logprobs": [float(x) for x in lps.tolist()],
               "mean_nll": nll, "perplexity": math.exp(nll)}
    log("reference passage: %d tokens, perplexity %.6f (float64)" % (len(ids), math.exp(nll)))
    greedy = []
    for p in PROMPTS:
        seq = tok.encode(p)
        n0 = len(seq)
        with torch.no_grad():
            for _ in range(GREEDY):
                lg = model.forward(torch.tensor([seq]))[0, -1]
                m = lg.max()
                seq.append(int((lg == m).nonzero()[0, 0]))
        greedy.append({"prompt": p, "prompt_ids": seq[:n0], "generated_ids": seq[n0:],
                       "text": tok.decode(seq[n0:])})
        log("greedy %r -> %r" % (p, tok.decode(seq[n0:])))
    return {"passage": passage, "greedy": greedy}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--export-only", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(a.seed)
    os.makedirs(a.work, exist_ok=True)
    out = a.out or os.path.join(a.work, "kjv-tiny")
    cfg = k3model.Config(CONFIG)
    tok, tr, held, info, held_txt = prepare_data(a.work)
    if not a.export_only:
        fit(cfg, tr, held, a.seed, a.steps, a.work)
    state = torch.load(os.path.join(a.work, "trained.pt"))
    exact = export(cfg, tok, state, out)
    ref = reference(cfg, tok, exact, held, held_txt, out)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    tlog = {"seed": a.seed, "steps": a.steps, "batch": BATCH, "seq": SEQ, "threads": a.threads,
            "torch": torch.__version__, "wall_seconds": round(state["wall"], 1),
            "loss_curve": state["curve"], "heldout_nll": state["heldout_nll"],
            "heldout_perplexity": math.exp(state["heldout_nll"]), "data": info}
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump(tlog, f, indent=1)
        f.write("\n")
    files = sorted(f for f in os.listdir(out) if f != "SHA256SUMS")
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for n in files:
            f.write("%s  %s\n" % (sha256(os.path.join(out, n)), n))
    log("wrote %s" % out)


if __name__ == "__main__":
    main()
