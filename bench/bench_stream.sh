#!/bin/sh
# bench_stream.sh - k3-run --ram on a k3-width checkpoint (layer 0 dense, layers
# 1-2 MoE, real K3 matrix sizes: ~38 GB packed, experts far larger than any
# budget tried), at the floor, 4 GiB and 16 GiB, against two lower bounds
# measured in the same run:
#   I/O bound     = bytes the run read per decode token, trunk and experts
#                   each divided by the O_DIRECT read bandwidth of the same
#                   files read the same way (bench-bench_stream: parallel
#                   preads into huge pages), the mean of a probe right
#                   before and one right after the run (the device drifts);
#   compute bound = decode s/token minus the time the model waited for reads
#                   (what the same run would take with free I/O).
# And, from the run itself, the share of the decode with no read in flight:
# a device kept busy is at the I/O bound of that minute, whatever its speed.
# Also prints the memory plan of the real K3 shape (93 layers, 896 experts)
# from its config alone (bench-bench_stream --plan).
#
#   sh bench/bench_stream.sh [WORKDIR]      (default /tmp/stream-bench)
#
# Environment: BIN (default bin), BUDGETS (default "floor 4G 16G"), GEN
# (generated tokens, default 4), RUNARGS (more k3-run options, e.g.
# --no-expert-guess), SPARSE chooses the checkpoint:
#   SPARSE=0        synthesised dense (random weights; needs ~80 GB free:
#                   source + packed);
#   SPARSE=densify  synthesised sparse (all-zero weights but the small
#                   ones), converted, then every packed data file rewritten
#                   with cp --sparse=never: the same bytes and hashes, but
#                   every read now reaches the device (needs ~40 GB free).
#                   The I/O is real; the weights are zeros, which cost the
#                   kernels the same time as any others (they have no
#                   data-dependent branches: measured in runtime/STREAM.md);
#   SPARSE=1        sparse packed files (holes): reads are served by the
#                   kernel zeroing pages, not by the device - the I/O figures
#                   are not the device's; say so when quoting.
# Default: 0 if df says 90 GB are free, densify if 45 GB, else 1. TRACE=1
# writes each run's expert trace and replays it against LRU, LFU and the
# offline optimum at 16..1024 slots. WORKDIR is deleted at the end unless
# KEEP=1 (a kept packed model is used as it is by the next run).
set -eu
BIN=${BIN:-bin}
W=${1:-/tmp/stream-bench}
BUDGETS=${BUDGETS:-"floor 4G 16G"}
GEN=${GEN:-4}
IDS=1,2,3,4
mkdir -p "$W"
free_gb=$(df -Pk "$W" | awk 'NR==2 {print int($4 / 1048576)}')
SPARSE=${SPARSE:-auto}
if [ "$SPARSE" = auto ]; then
    if [ "$free_gb" -ge 90 ]; then SPARSE=0; elif [ "$free_gb" -ge 45 ]; then SPARSE=densify; else SPARSE=1; fi
fi
echo "bench_stream: $free_gb GB free under $W; sparse checkpoint: $SPARSE"
if [ ! -f "$W/pk/manifest.json" ]; then
    if [ "$SPARSE" = 0 ]; then
        "$BIN/k3-synth" "$W/src" --preset k3-width --layers 3 --quiet --force
    else
        "$BIN/k3-synth" "$W/src" --preset k3-width --layers 3 --sparse --quiet --force
    fi
    "$BIN/k3-convert" --quiet "$W/src" "$W/pk"
    rm -rf "$W/src"
    if [ "$SPARSE" = densify ]; then
        for f in "$W"/pk/*.k3t "$W"/pk/*.k3e; do
            cp --sparse=never "$f" "$f.dense" && mv "$f.dense" "$f"
        done
    fi
fi
du -sh --apparent-size "$W/pk" | sed 's/^/bench_stream: packed model (logical) /'
du -sh "$W/pk" | sed 's/^/bench_stream: packed model (on disk)  /'

for b in $BUDGETS; do
    # the device's speed drifts from minute to minute: probe right before
    # and right after each run, and bound the run with the mean of the two
    probe=$("$BIN/bench-bench_stream" "$W/pk" --mb 2048 --json)
    echo "[$b] O_DIRECT probe before $probe"
    echo "[$b] before:$(uptime | sed 's/.*load/ load/')"
    tr=""
    [ "${TRACE:-0}" = 1 ] && tr="--trace $W/trace-$b.txt"
    "$BIN/k3-run" "$W/pk" --ids $IDS --gen "$GEN" --threads 2 --ram "$b" $tr ${RUNARGS:-} --json >"$W/run-$b.json" 2>"$W/run-$b.err" ||
        { echo "bench_stream: k3-run --ram $b failed:"; tail -3 "$W/run-$b.err"; continue; }
    echo "[$b] after:$(uptime | sed 's/.*load/ load/')"
    probe2=$("$BIN/bench-bench_stream" "$W/pk" --mb 2048 --json)
    echo "[$b] O_DIRECT probe after $probe2"
    grep 'k3-run:' "$W/run-$b.err" | sed "s/^/[$b] /"
    /usr/bin/python3 - "$W/run-$b.json" "$probe" "$b" "$probe2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))["stream"]
p, p2 = json.loads(sys.argv[2]), json.loads(sys.argv[4])
d = r["decode"]
s = d["s_per_token"]
trunk_gbps = (p["trunk_gbps"] + p2["trunk_gbps"]) / 2
experts_gbps = (p["experts_gbps"] + p2["experts_gbps"]) / 2
io = d["trunk_bytes_per_token"] / (trunk_gbps * 1e9) + d["expert_bytes_per_token"] / (experts_gbps * 1e9)
bw = (d["trunk_bytes_per_token"] + d["expert_bytes_per_token"]) / io if io > 0 else 0
comp = s * (1.0 - d["io_wait_share"])
lim = max(io, comp)
print("[%s] decode %.3f s/token | I/O bound %.3f s (%.2f GB/token at %.2f GB/s) | compute bound %.3f s | "
      "ratio to the larger bound %.2f | hit rate %.1f%% | peak RSS %.3f GiB of %.3f GiB"
      % (sys.argv[3], s, io, (d["trunk_bytes_per_token"] + d["expert_bytes_per_token"]) / 1e9, bw / 1e9,
         comp, s / lim if lim > 0 else 0, 100 * d["expert_hit_rate"], r["peak_rss"] / 2**30,
         r["plan"]["budget"] / 2**30))
# measured in the run itself, whatever the device's speed: the share of the
# decode with no read in flight (the device idle for us) and the mean depth
idle = d.get("io_idle_share", 0.0)
print("[%s] device: no read in flight %.1f%% of decode, %.2f reads in flight while busy, "
      "probes %.2f / %.2f GB/s trunk before / after" % (sys.argv[3], 100 * idle, d.get("io_depth", 0.0),
                                                      p["trunk_gbps"], p2["trunk_gbps"]))
EOF
    if [ -n "$tr" ]; then
        "$BIN/bench-bench_stream" --replay "$W/trace-$b.txt" 16 32 64 128 256 512 1024 | sed "s/^/[$b] /"
    fi
done

cfg=$(ls "$W"/k3-config.json 2>/dev/null || true)
if [ -z "$cfg" ]; then
    "$BIN/k3-synth" "$W/k3cfg" --preset k3 --sparse --no-tokenizer --quiet --force >/dev/null 2>&1 &&
        cp "$W/k3cfg/config.json" "$W/k3-config.json" && rm -rf "$W/k3cfg" && cfg="$W/k3-config.json"
fi
if [ -n "$cfg" ]; then
    for piece in 0 128M 16M; do
        for ctx in 4096 1024; do
            "$BIN/bench-bench_stream" --plan "$cfg" --ctx $ctx --chunk 16 --threads 2 --piece $piece --ram floor |
                sed 's/^/[K3 plan] /'
        done
    done
fi
[ "${KEEP:-0}" = 1 ] || rm -rf "$W"
