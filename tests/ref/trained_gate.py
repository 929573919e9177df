#!/usr/bin/python3
"""The fidelity gate on trained weights (models/kjv-tiny).

    /usr/bin/python3 tests/ref/trained_gate.py MODEL_DIR --k3-run BIN [--ref REF_JSON]
        [--run-model DIR] [--candidate k3-run|k3ref] [--plant BUG] [--no-greedy]

REF_JSON (default MODEL_DIR/reference.json) holds what the training script's
PyTorch float64 forward pass computed once: the per-token log-probabilities of
a held-out passage (teacher-forced) and the greedy continuations of five
prompts. The gate:

1. tests/ref/k3ref.py (NumPy float64), run live on MODEL_DIR, matches the
   PyTorch numbers: log-probabilities within 1e-9 (two float64 implementations
   of the same weights), greedy continuations identical;
2. the candidate (k3-run, float32) matches both: every log-probability within
   1e-4 relative (|d| <= 1e-4 * max(1, |ref|)), the passage perplexity within
   1e-4 relative (so equal to 4 significant digits), greedy continuations
   identical.

--candidate k3ref --plant BUG runs the reference itself with a planted bug as
the candidate: the gate must then fail (exit 1). Exit 0 pass, 1 fail, 2 usage.
Needs only NumPy.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def logprobs(path, ids, vocab):
    z = np.fromfile(path, dtype="<f4").astype(np.float64)
    if z.size != len(ids) * vocab:
        raise SystemExit("trained_gate: error: %s: %d floats, expected %d x %d" % (path, z.size, len(ids), vocab))
    z = z.reshape(len(ids), vocab)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return np.array([z[t, ids[t + 1]] - lse[t] for t in range(len(ids) - 1)])


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.returncode != 0:
        sys.stderr.write(p.stderr.decode(errors="replace"))
        raise SystemExit("trained_gate: error: %s exited %d" % (cmd[0], p.returncode))
    return p.stdout.decode()


def k3ref(model, ids, gen, logits=None, plant=None):
    cmd = ["/usr/bin/python3", os.path.join(HERE, "k3ref.py"), model, "--ids", ",".join(map(str, ids)),
           "--gen", str(gen)]
    if logits:
        cmd += ["--logits-all", logits]
    if plant:
        cmd += ["--plant", plant]
    return json.loads(run(cmd))["generated_ids"]


def k3run(binary, model, ids, gen, logits=None):
    cmd = [binary, model, "--ids", ",".join(map(str, ids)), "--gen", str(gen), "--json", "--threads", "1"]
    if logits:
        cmd += ["--logits-all", logits]
    return json.loads(run(cmd))["generated_ids"]


def compare(what, got, ref, tol):
    d = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    ppl_g, ppl_r = math.exp(-got.mean()), math.exp(-ref.mean())
    rel = abs(ppl_g - ppl_r) / ppl_r
    ok = d.max() <= tol and rel <= tol
    print("%s: worst log-prob error %.2e (position %d), perplexity %.6f vs %.6f (relative %.1e): %s"
          % (what, d.max(), int(d.argmax()), ppl_g, ppl_r, rel, "ok" if ok else "FAIL"))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--k3-run", dest="k3run")
    ap.add_argument("--ref")
    ap.add_argument("--candidate", default="k3-run", choices=["k3-run", "k3ref"])
    ap.add_argument("--plant")
    ap.add_argument("--run-model", help="run k3-run on this directory (e.g. the packed model) instead of MODEL_DIR")
    ap.add_argument("--no-greedy", action="store_true", help="compare the passage only")
    a = ap.parse_args()
    if a.candidate == "k3-run" and not a.k3run:
        ap.error("--k3-run BIN is needed for the k3-run candidate")
    with open(a.ref or os.path.join(a.model, "reference.json")) as f:
        ref = json.load(f)
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    ids = ref["passage"]["ids"]
    want = np.array(ref["passage"]["logprobs"], dtype=np.float64)
    rm = a.run_model or a.model
    label = a.candidate + ("+" + a.plant if a.plant else "")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        r_bin, c_bin = os.path.join(tmp, "ref.f32"), os.path.join(tmp, "cand.f32")
        # the float64 reference, live; its float32-rounded logits still agree to ~1e-7
        k3ref(a.model, ids, 0, r_bin)
        r_lp = logprobs(r_bin, ids, vocab)
        ok &= compare("k3ref vs PyTorch", r_lp, want, 1e-6)
        if a.candidate == "k3ref":
            k3ref(a.model, ids, 0, c_bin, a.plant)
        else:
            k3run(a.k3run, rm, ids, 0, c_bin)
        c_lp = logprobs(c_bin, ids, vocab)
        ok &= compare("%s vs PyTorch" % label, c_lp, want, 1e-4)
        ok &= compare("%s vs k3ref" % label, c_lp, r_lp, 1e-4)
        if a.candidate == "k3-run":
            # the runtime's tokenizer gives the training tokenizer's ids
            for what, text, want_ids in ([("passage", ref["passage"]["text"], ids)]
                                         + [(g["prompt"], g["prompt"], g["prompt_ids"]) for g in ref["greedy"]]):
                tf = os.path.join(tmp, "text")
                with open(tf, "w") as f:
                    f.write(text)
                got = [int(x) for x in run([a.k3run, rm, "--prompt-file", tf, "--tokenize"]).split(",")]
                same = got == want_ids
                ok &= same
                if not same:
                    print("tokenize %r: k3-run %s, training tokenizer %s: FAIL" % (what[:40], got[:20], want_ids[:20]))
            print("tokenizer: the passage and the %d prompts give the training ids" % len(ref["greedy"]))
        for g in ([] if a.no_greedy else ref["greedy"]):
            n = len(g["generated_ids"])
            r_ids = k3ref(a.model, g["prompt_ids"], n)
            if a.candidate == "k3ref":
                c_ids = k3ref(a.model, g["prompt_ids"], n, None, a.plant)
            else:
                c_ids = k3run(a.k3run, rm, g["prompt_ids"], n)
            same = g["generated_ids"] == r_ids == c_ids
            ok &= same
            print("greedy %-38r PyTorch == k3ref == %s: %s" % (g["prompt"], label, "yes" if same else
                                                                   "NO (ref %s, k3ref %s, cand %s)"
                                                                   % (g["generated_ids"], r_ids, c_ids)))
    print("trained gate: %s" % ("pass" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
