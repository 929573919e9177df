#!/bin/sh
# bench_pack.sh - k3-pack at K3 width: repack time and bytes written for a
# trunk-only change (experts linked), against an O_DIRECT write probe and
# an O_DIRECT read probe of the same disk taken in the same run; the floors
# k3-pack reports for the presets; a repack with a pinned prefix for an
# 8 GiB budget; k3-run s/token on both layouts at the same budgets, with
# their logits compared.
#
# Usage: bench/bench_pack.sh [WORKDIR] [LAYERS] [TOKENS]
#   WORKDIR  default /tmp/pack/bench (deleted at the end unless KEEP=1)
#   LAYERS   k3-width layers (default 2: one dense, one MoE with 896 experts)
#   TOKENS   tokens generated per k3-run (default 3)
#
# The synthetic checkpoint is --sparse (only routers, norms, biases and
# embeddings carry data) so that it fits a shared disk: the expert files are
# holes, which makes no difference to linking them, and the repacks write
# their trunk with --dense so every trunk byte really goes to the disk (the
# source trunk, converted sparse, is mostly holes: its reads cost no disk
# time). k3-run figures are taken on the dense layouts A and B; their expert
# records are holes, so expert reads are cheaper than on a real model, and
# the synthetic weights are mostly zero (the tokens say nothing).
set -eu
BIN=${BIN:-$(cd "$(dirname "$0")/.." && pwd)/bin}
W=${1:-/tmp/pack/bench}
LAYERS=${2:-2}
TOKENS=${3:-3}
IDS=${IDS:-1,2,3,4}
PINRAM=${PINRAM:-8G}
mkdir -p "$W"
cd "$W"
log() { printf '%s\n' "$*"; }
now() { date +%s.%N; }

if [ ! -f up/config.json ]; then
    log "# k3-synth --preset k3-width --layers $LAYERS --sparse"
    "$BIN/k3-synth" up --preset k3-width --layers "$LAYERS" --sparse --quiet
fi
if [ ! -f src/manifest.json ]; then
    log "# k3-convert up src"
    "$BIN/k3-convert" --quiet up src
fi

# --- probes: O_DIRECT write (with fsync) and read, 4 GiB, 64 MiB requests
log "# probes (dd, O_DIRECT, 64 MiB requests, 4 GiB)"
t0=$(now)
dd if=/dev/zero of=probe.bin bs=64M count=64 oflag=direct conv=fsync status=none
t1=$(now)
wprobe=$(echo "4294967296 / ($t1 - $t0) / 1000000000" | bc -l)
t0=$(now)
dd if=probe.bin of=/dev/null bs=64M iflag=direct status=none
t1=$(now)
rprobe=$(echo "4294967296 / ($t1 - $t0) / 1000000000" | bc -l)
rm -f probe.bin
printf 'probe: write %.2f GB/s, read %.2f GB/s\n' "$wprobe" "$rprobe"

# --- a trunk-only repack, three times (median), experts linked
i=0
: >pack_times.txt
while [ $i -lt 3 ]; do
    rm -rf A
    sync
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    /usr/bin/time -f '%e %M %U %S' -o time.txt "$BIN/k3-pack" --quiet --dense --json --ram floor src A >pack.json
    read -r secs rss usr sys <time.txt
    written=$(sed 's/.*"bytes_written": \([0-9]*\).*/\1/' pack.json)
    linked=$(sed 's/.*"bytes_linked": \([0-9]*\).*/\1/' pack.json)
    trunk=$(sed 's/.*"trunk_bytes": \([0-9]*\).*/\1/' pack.json)
    echo "$secs $written $linked $trunk $rss $usr $sys" >>pack_times.txt
    i=$((i + 1))
done
sort -n pack_times.txt >pack_sorted.txt
med=$(sed -n 2p pack_sorted.txt)
set -- $med
min=$(head -1 pack_sorted.txt | cut -d' ' -f1)
max=$(tail -1 pack_sorted.txt | cut -d' ' -f1)
printf 'repack (trunk only, --ram floor --dense, cold cache): median %.2f s (min %.2f, max %.2f)\n' "$1" "$min" "$max"
printf '  trunk %s bytes written (%s bytes in total), experts %s bytes linked, peak RSS %s KB, CPU %s s user + %s s sys\n' \
    "$4" "$2" "$3" "$5" "$6" "$7"
printf '  %.2f GB/s written = %.0f%% of the write probe\n' "$(echo "$2 / $1 / 1000000000" | bc -l)" \
    "$(echo "100 * $2 / $1 / 1000000000 / $wprobe" | bc -l)"
du -s --apparent-size src/experts-*.k3e | awk '{s+=$1} END {printf "  expert files: %.2f GB apparent, shared by inode with the source\n", s*1024/1e9}'
for f in src/experts-*.k3e; do
    b=$(basename "$f")
    [ "$(stat -c %i "$f")" = "$(stat -c %i "A/$b")" ] || echo "  NOT LINKED: $b"
done
echo "  load average during the run: $(cut -d' ' -f1-3 /proc/loadavg) (2 cores)"

# --- floors k3-pack reports for the presets (k3-run's own planner on the layout)
for r in floor laptop workstation server; do
    "$BIN/k3-pack" --plan --ram "$r" A | grep -E 'budget|pinned prefix|floor  k3-run|below' | sed "s/^/  --ram $r: /"
done

# --- a pinned prefix for an 8 GiB budget: B = A re-laid with the pinned groups first
rm -rf B
/usr/bin/time -f '%e %M %U %S' -o time.txt "$BIN/k3-pack" --quiet --dense --json --ram "$PINRAM" A B >packB.json
read -r secs rss usr sys <time.txt
printf 'repack A -> B (--ram %s, pinned prefix): %.2f s, %s bytes written, CPU %s s user + %s s sys\n' "$PINRAM" "$secs" \
    "$(sed 's/.*"bytes_written": \([0-9]*\).*/\1/' packB.json)" "$usr" "$sys"

# --- k3-run s/token on A and B at the same budgets, logits compared
for budget in floor "$PINRAM"; do
    for m in A B; do
        if "$BIN/k3-run" "$m" --ram "$budget" --ids "$IDS" --gen "$TOKENS" --json --logits-all "$m.$budget.logits" \
            >run.json 2>run.err; then
            python3 - "$m" "$budget" <<'EOF'
import json, sys
r = json.load(open("run.json"))
s = r["stream"]
d = s["decode"]
print("k3-run %s --ram %s: budget %d, pinned groups %d, load %.2f s, decode %.3f s/token, trunk %.0f MB/token, experts %.0f MB/token, io wait %.0f%%, peak RSS %d" % (
    sys.argv[1], sys.argv[2], s["plan"]["budget"], s["plan"]["pinned_groups"], s.get("load_s", -1), d["s_per_token"],
    d["trunk_bytes_per_token"] / 1e6, d["expert_bytes_per_token"] / 1e6, 100 * d["io_wait_share"], s["peak_rss"]))
EOF
        else
            printf 'k3-run %s --ram %s: refused: %s\n' "$m" "$budget" "$(tail -1 run.err)"
        fi
    done
    if cmp -s "A.$budget.logits" "B.$budget.logits"; then echo "  logits A = B at --ram $budget: byte-identical"; else echo "  logits A, B at --ram $budget: DIFFER"; fi
done

if [ "${KEEP:-0}" != 1 ]; then
    cd /
    rm -rf "$W"
fi
