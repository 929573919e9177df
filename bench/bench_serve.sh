#!/bin/sh
# bench_serve.sh - k3-serve under B = 1, 2, 4, 8, 16 concurrent streamed
# requests, at each budget asked: aggregate generated tokens/s (all requests'
# tokens over the wall time of the round), time to first token (mean, p50,
# max), inter-token gaps (p50, p99, over every request's chunks), the
# server's bytes read per step (trunk, experts) and steps, the experts a
# step needs (the union of the B rows' routes, summed over the MoE layers)
# and how many were in memory (from /metrics, the round's delta), and the I/O
# bound beside them: tokens/s if every step only read its bytes at
# the read bandwidth BW (measure it on the same files, e.g. with
# bench/bench_stream.sh, which prints the O_DIRECT bandwidth it measured).
#
#   sh bench/bench_serve.sh MODEL_DIR [WORKDIR]
#
# MODEL_DIR: a packed model (a k3-width one for the figures that matter:
# bench/bench_stream.sh makes one). Environment: BIN (default bin), BUDGETS
# (default "floor"; e.g. "floor 16G"), CONC (default "1 2 4 8 16"), GEN
# (tokens per request, default 16), PROMPT (default a short sentence), BW
# (read bandwidth in bytes/s; without it the I/O bound is not printed), or
# BW_TRUNK and BW_EXPERTS (the two rates bench-bench_stream --json prints, in
# bytes/s: the bound is then trunk bytes / BW_TRUNK + expert bytes /
# BW_EXPERTS per step).
#
# The server's step is the engine's batched step: the trunk is read once per
# step for all B sequences, and each expert once for the union they route to.
set -eu
MODEL=${1:?usage: sh bench/bench_serve.sh MODEL_DIR [WORKDIR]}
WORK=${2:-/tmp/serve-bench}
BIN=${BIN:-bin}
BUDGETS=${BUDGETS:-floor}
CONC=${CONC:-1 2 4 8 16}
GEN=${GEN:-16}
PROMPT=${PROMPT:-The river ran past the stone and the}
mkdir -p "$WORK"
echo "bench_serve: $(uptime)"
echo "bench_serve: model $MODEL, $GEN tokens per request, budgets: $BUDGETS"
maxc=1
for b in $CONC; do [ "$b" -gt "$maxc" ] && maxc=$b; done

bw=${BW:-}

for ram in $BUDGETS; do
    log="$WORK/serve-$ram.log"
    "$BIN/k3-serve" "$MODEL" --ram "$ram" --port 0 --parallel "$maxc" --queue 64 --ctx 1024 2>"$log" &
    pid=$!
    port=""
    for _ in $(seq 600); do
        port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$log")
        [ -n "$port" ] && break
        kill -0 $pid 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.5
    done
    [ -n "$port" ] || { echo "bench_serve: k3-serve did not start" >&2; kill $pid; exit 1; }
    grep -E "budget|floor|total" "$log" | sed 's/^/  /'
    for b in $CONC; do
        python3 - "$port" "$b" "$GEN" "$PROMPT" "$ram" "${bw:-0}" <<'EOF'
import http.client, json, os, sys, threading, time

port, B, gen, prompt, ram, bw = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6])

def metrics():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("GET", "/metrics")
    m = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            m[k] = float(v)
    return m

res = [None] * B
def one(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": gen, "temperature": 0.8, "seed": i,
                       "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    times, toks = [], 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            toks = ev["usage"]["completion_tokens"]
        elif ev["choices"] and ev["choices"][0].get("finish_reason") is None:
            times.append(time.monotonic())
    res[i] = (t0, times, toks)

m0 = metrics()
t0 = time.monotonic()
th = [threading.Thread(target=one, args=(i,)) for i in range(B)]
for t in th: t.start()
for t in th: t.join()
wall = time.monotonic() - t0
m1 = metrics()

def pct(xs, p):
    if not xs: return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

tok = sum(r[2] for r in res)
ttft = [r[1][0] - r[0] for r in res if r[1]]
gaps = [b - a for r in res for a, b in zip(r[1], r[1][1:])]
steps = m1["k3_steps_total"] - m0["k3_steps_total"]
rd = m1["k3_bytes_read_total"] - m0["k3_bytes_read_total"]
per_step = rd / steps if steps else 0
d = lambda k: (m1[k] - m0[k]) / steps if steps else 0
line = (f"ram {ram:>6} B {B:2d}: {tok / wall:8.3f} tok/s aggregate ({tok} tokens, {wall:.2f} s); "
        f"TTFT mean {sum(ttft) / len(ttft):.3f} s p50 {pct(ttft, 50):.3f} max {max(ttft):.3f}; "
        f"inter-token p50 {pct(gaps, 50) * 1e3:.1f} ms p99 {pct(gaps, 99) * 1e3:.1f} ms; "
        f"{steps:.0f} steps, {per_step / 1e6:.1f} MB read/step (trunk {d('k3_trunk_bytes_read_total') / 1e6:.1f}, "
        f"experts {d('k3_expert_bytes_read_total') / 1e6:.1f}); experts per step {d('k3_expert_requests_total'):.1f} "
        f"(union over the MoE layers), {d('k3_expert_hits_total'):.1f} from memory")
bt, be = float(os.environ.get("BW_TRUNK", 0)), float(os.environ.get("BW_EXPERTS", 0))
if bt > 0 and be > 0 and steps:
    # every step advances up to B decoding sequences by one token
    t_io = d("k3_trunk_bytes_read_total") / bt + d("k3_expert_bytes_read_total") / be
    line += f"; I/O bound {B / t_io:.3f} tok/s ({t_io:.2f} s/step)" if t_io > 0 else ""
elif bw > 0 and per_step > 0:
    line += f"; I/O bound {B * bw / per_step:.3f} tok/s"
print(line, flush=True)
EOF
    done
    kill -INT $pid
    wait $pid || { echo "bench_serve: k3-serve exited $?" >&2; exit 1; }
done
