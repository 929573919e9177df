#!/usr/bin/python3
"""cmp_logits - the docs/MODEL.md §4 logit gate on two float32 little-endian logit
files: for each position, max |got - ref| over the vocabulary divided by
max |ref|; the worst position decides.

  /usr/bin/python3 tests/ref/cmp_logits.py GOT REF (--vocab V | --ckpt DIR) [--tol 1e-4]

--ckpt takes V from DIR/config.json (vocab_size, flat or nested).

Prints one line "rel=<worst> at position <t> (tol <tol>)" and exits 0 when
within tolerance, 1 when not, 2 on bad input (sizes differ, not a multiple of
V, non-finite values).
"""

import argparse
import os
import sys

import numpy as np


def relative_error(got, ref):
    """Per-row max|got-ref| / max|ref| for [T][V] arrays (float64)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return np.max(np.abs(got - ref), axis=1) / np.max(np.abs(ref), axis=1)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="cmp_logits")
    ap.add_argument("got")
    ap.add_argument("ref")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--vocab", type=int)
    g.add_argument("--ckpt", help="checkpoint directory whose config gives vocab_size")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    if a.ckpt is not None:
        sys.dont_write_bytecode = True
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import k3ref
        try:
            a.vocab = k3ref.load_config(a.ckpt).V
        except k3ref.ConfigError as ex:
            print(f"cmp_logits: error: {ex}", file=sys.stderr)
            return 2
    got = np.fromfile(a.got, dtype="<f4")
    ref = np.fromfile(a.ref, dtype="<f4")
    if a.vocab <= 0 or got.size != ref.size or got.size == 0 or got.size % a.vocab:
        print(f"cmp_logits: error: sizes {got.size} and {ref.size} floats do not match "
              f"or are not a multiple of vocab {a.vocab}", file=sys.stderr)
        return 2
    if not (np.isfinite(got).all() and np.isfinite(ref).all()):
        print("cmp_logits: error: non-finite logits", file=sys.stderr)
        return 2
    r = relative_error(got.reshape(-1, a.vocab), ref.reshape(-1, a.vocab))
    t = int(np.argmax(r))
    print(f"rel={r[t]:.3e} at position {t} (tol {a.tol:g})")
    return 0 if r[t] <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
