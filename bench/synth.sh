#!/bin/sh
# bench/synth.sh - how fast k3-synth writes, against the disk's own sequential
# write speed measured in the same run, and in how much memory; then the full
# K3 shape as a sparse checkpoint, and how long the reader takes to index it.
#
#   make bench && sh bench/synth.sh [WORKDIR]     (default /tmp/synth-bench)
#
# Needs ~30 GB free in WORKDIR for the k3-width checkpoint (deleted after) and a
# few GB for the sparse K3 one (1.56 TB apparent; deleted after).
set -eu
cd "$(dirname "$0")/.."
W=${1:-/tmp/synth-bench}
B=bin
mkdir -p "$W"
rm -rf "$W/probe" "$W/width" "$W/width.tmp" "$W/k3" "$W/k3.tmp"

probe() {
    dd if=/dev/zero of="$W/probe" bs=64M count=64 oflag=direct conv=fsync 2>&1 | tail -1
    rm -f "$W/probe"
}
echo "== load: $(cat /proc/loadavg) (the machine is shared: figures move with it)"
echo "== generator alone, per core (CPU time)"
$B/bench-synth_gen
echo
echo "== disk: O_DIRECT sequential write, 64 MiB requests, 4 GiB, fsync (2 runs before)"
probe
probe

echo
echo "== k3-synth --preset k3-width --layers 2 (real K3 matrix sizes, MXFP4 experts)"
/usr/bin/time -v $B/k3-synth "$W/width" --preset k3-width --layers 2 --json --quiet \
    >"$W/width.json" 2>"$W/width.time"
cat "$W/width.json"
grep -E "Maximum resident|Elapsed|Percent of CPU" "$W/width.time"
python3 - "$W/width.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("write rate: %.2f GB/s (%d bytes in %.1f s)" % (r["logical_bytes"] / r["seconds"] / 1e9, r["logical_bytes"], r["seconds"]))
PY
ls -l "$W/width" | head -5
echo "== disk again, right after (1 run)"
probe
$B/bench-synth_index "$W/width" 3
rm -rf "$W/width"

echo
echo "== k3-synth --preset k3 --sparse (the full K3 shape, holes for all-zero data)"
/usr/bin/time -v $B/k3-synth "$W/k3" --preset k3 --sparse --json --quiet >"$W/k3.json" 2>"$W/k3.time"
cat "$W/k3.json"
grep -E "Maximum resident|Elapsed" "$W/k3.time"
echo "apparent: $(du -sb --apparent-size "$W/k3" | cut -f1) bytes, on disk: $(du -s --block-size=1 "$W/k3" | cut -f1) bytes, shards: $(ls "$W/k3"/*.safetensors | wc -l)"
$B/bench-synth_index "$W/k3" 3
rm -rf "$W/k3"
