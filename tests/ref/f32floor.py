#!/usr/bin/python3
"""f32floor - how close to the float64 reference can ANY runtime with float32
activations get? A test tool, not a reference.

It runs the reference forward pass (k3ref.Model, float64 everywhere) with one
change: the input and the output of every matrix product (every `x @ W.T`
with a weight matrix, the routed experts and the head included) are rounded
to float32, or (--noise A) multiplied by (1 + A*u) with u uniform in [-1, 1]
from a seeded generator. Everything else stays exact. This is the error a
float32-activation runtime cannot avoid whatever it does between products
(double norms, double recurrences, ...); k3-run also accumulates the
products in float32 lanes (include/k3_kern.h), which adds to it.

  /usr/bin/python3 tests/ref/f32floor.py CKPT --ids 1,2,3 [--noise A] [--noise-seed S]
      [--logits-all OUT]

Prints one line "rel=<worst> at position <t>" with the docs/MODEL.md §4 measure
(per position max|got - ref| / max|ref|, worst position) against the plain
float64 reference computed in the same run; --logits-all writes the perturbed
logits as float32 LE [T][V] (the cmp_logits.py layout). Several --noise-seed
values give several draws of the same floor: the worst position is a heavy-
tailed random variable (see README.md, "float32 floor").
"""

import argparse
import os
import sys

import numpy as np

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3ref  # noqa: E402

_perturb = None  # function applied to product inputs and outputs


class _Weight(np.ndarray):
    """A weight matrix whose products go through _perturb on both sides."""

    def __matmul__(self, other):
        return _perturb(np.asarray(self) @ _perturb(np.asarray(other)))

    def __rmatmul__(self, other):
        return _perturb(_perturb(np.asarray(other)) @ np.asarray(self))


_MATRICES = ("q", "k", "v", "g", "o", "f_a", "f_b", "b", "q_a", "q_b", "kv_a", "kv_b",
             "gate", "up", "down", "router", "lat_down", "lat_up", "sh_gate", "sh_up", "sh_down")


class FloorModel(k3ref.Model):
    def __init__(self, ckpt):
        super().__init__(ckpt)
        self.head = self.head.view(_Weight)
        for ly in self.layers:
            for name in _MATRICES:
                if name in ly:
                    ly[name] = ly[name].view(_Weight)

    def expert(self, L, e):
        return tuple(w.view(_Weight) for w in super().expert(L, e))


def main(argv=None):
    global _perturb
    ap = argparse.ArgumentParser(prog="f32floor")
    ap.add_argument("ckpt")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--noise", type=float, default=None,
                    help="relative noise amplitude instead of float32 rounding")
    ap.add_argument("--noise-seed", type=int, default=0)
    ap.add_argument("--logits-all", dest="logits_all")
    a = ap.parse_args(argv)
    try:
        ids = k3ref._parse_ids(a.ids)
        model = FloorModel(a.ckpt)
    except (ValueError, k3ref.ConfigError, k3ref.stnp.SafetensorsError) as ex:
        print(f"f32floor: error: {ex}", file=sys.stderr)
        return 2
    _perturb = lambda x: x  # noqa: E731
    ref = model.forward(ids, model.new_state())
    if a.noise is None:
        _perturb = lambda x: np.asarray(x, dtype=np.float32).astype(np.float64)  # noqa: E731
    else:
        rng = np.random.default_rng(a.noise_seed)
        _perturb = lambda x: x * (1.0 + a.noise * rng.uniform(-1.0, 1.0, np.shape(x)))  # noqa: E731
    got = model.forward(ids, model.new_state())
    if a.logits_all:
        got.astype("<f4").tofile(a.logits_all)
    rel = np.max(np.abs(got - ref), axis=1) / np.max(np.abs(ref), axis=1)
    t = int(np.argmax(rel))
    print(f"rel={rel[t]:.3e} at position {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
