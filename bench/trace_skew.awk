# bench/trace_skew.awk: awk -f bench/trace_skew.awk TRACE (a k3-run --trace file)
# per MoE layer: share of requests on the most-used quarter of the experts, and
# normalised entropy of the expert use (1 = uniform)
!/^#/ { n[$2]++; c[$2" "$3]++; if ($3+1 > X) X = $3+1 }
END {
  for (l in n) {
    m = 0; H = 0
    for (e = 0; e < X; e++) { v[e] = c[l" "e] + 0; if (v[e] > 0) { p = v[e]/n[l]; H -= p*log(p) } }
    # top quarter
    q = int(X/4); s = 0
    for (i = 0; i < q; i++) { b = -1; bi = -1; for (e = 0; e < X; e++) if (v[e] > b) { b = v[e]; bi = e } s += b; v[bi] = -1 }
    printf "layer %d: %d requests, top %d of %d experts take %.1f%%, entropy %.3f of uniform\n", l, n[l], q, X, 100*s/n[l], H/log(X)
  }
}
