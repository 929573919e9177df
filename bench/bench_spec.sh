#!/bin/sh
# bench_spec.sh - k3-run --spec ngram against plain decoding at the RAM floor,
# on a repetitive prompt (a passage to repeat) and a non-repetitive one, on two
# models:
#   width  a synthetic k3-width checkpoint (real K3 matrix sizes, 2 layers:
#          layer 0 dense, layer 1 MoE with 896 MXFP4 experts; random weights,
#          ~21 GB packed; no tokenizer: a random model draws ids past the
#          small synthetic tokenizer, so prompts are ids), so the floor
#          streams real amounts per pass;
#   kjv    models/kjv-tiny (trained: it repeats text), the honest case for
#          acceptance rates; small, so a pass costs little I/O;
#   live   a k3-width checkpoint made with k3-synth --sparse-live (2 layers,
#          packed files rewritten without holes so that every read reaches
#          the device; ~23 GB): its text is a function of the last id, so a
#          passage it wrote once it writes again, each id routed to its own
#          experts. The repetitive prompt is the model's own greedy walk from
#          id 101 (WALK ids, default 36, found by a plain run first) followed
#          by 101 again; the non-repetitive one is NON_IDS. This is the width
#          case with real acceptance: real matrix sizes, real reads, real
#          expert unions per pass. LIVE_DIR: use that packed model instead.
# Per (model, prompt, mode): RUNS runs (default 3), each under
# flock -x /tmp/k3-quiet.lock (the machine is shared: the lock keeps the
# cooperating benchmarks apart, not the other engineers' builds and tests);
# prints medians and min-max of decode s/token (decode_s / (ids - 1)) and ids
# per decode pass, with the load average before and after, and checks that
# both modes generated the same ids.
#
#   sh bench/bench_spec.sh [WORKDIR]      (default /tmp/spec-bench)
#
# Also, first, what one pass of T ids costs at the floor (a prompt of T ids
# with --gen 1) for T in PASS_T (default "1 2 4 8"): the price of checking
# T - 1 guesses, whatever the weights say.
# Environment: BIN (default bin), RUNS (3), GEN_WIDTH (12; 24 for live), GEN_KJV (64),
# SPEC (ngram), MODELS ("width kjv"), PASS_T ("" for none), PASS_ONLY=1 (only the pass costs),
# PROMPTS ("rep non", or one of them),
# OPTS (more k3-run options for both modes, e.g. "--temperature 0.8 --seed 1"). A packed width model already in
# WORKDIR/pk is used as it is; KEEP=1 keeps WORKDIR.
set -eu
BIN=${BIN:-bin}
W=${1:-/tmp/spec-bench}
RUNS=${RUNS:-3}
SPEC=${SPEC:-ngram}
MODELS=${MODELS:-"width kjv"}
LOCK=/tmp/k3-quiet.lock
mkdir -p "$W"
REP="And God said, Let there be light: and there was light. And God saw the light, that it was good: and God \
divided the light from the darkness. And God called the light Day, and the darkness he called Night. \
Repeat the passage. And God said, Let there be light: and there was light. And God saw the"
# the same as ids for the width model: 24 ids, again, then its first 12; 60 distinct ids
REP_IDS=$(seq -s, 101 124),$(seq -s, 101 124),$(seq -s, 101 112)
NON_IDS=$(seq -s, 1000 37 3183)
NON="The ship sailed north past the cold islands while seven merchants argued about copper, wool and the \
price of salt in distant markets"

for m in $MODELS; do
    case $m in
    width)
        if [ ! -f "$W/pk/manifest.json" ]; then
            flock -x $LOCK sh -c "'$BIN/k3-synth' '$W/src' --preset k3-width --layers 2 --no-tokenizer --quiet --force &&
                '$BIN/k3-convert' --quiet '$W/src' '$W/pk' && rm -rf '$W/src'"
        fi
        dir=$W/pk gen=${GEN_WIDTH:-12} ;;
    kjv)
        [ -f "$W/kjv/manifest.json" ] || "$BIN/k3-convert" --quiet models/kjv-tiny "$W/kjv"
        dir=$W/kjv gen=${GEN_KJV:-64} ;;
    live)
        dir=${LIVE_DIR:-$W/live}
        if [ ! -f "$dir/manifest.json" ]; then
            flock -x $LOCK sh -c "'$BIN/k3-synth' '$W/lsrc' --preset k3-width --layers 2 --sparse-live --quiet --force &&
                '$BIN/k3-convert' --quiet '$W/lsrc' '$dir' && rm -rf '$W/lsrc' &&
                for f in '$dir'/*.k3t '$dir'/*.k3e; do cp --sparse=never \"\$f\" \"\$f.dense\" && mv \"\$f.dense\" \"\$f\"; done"
        fi
        gen=${GEN_WIDTH:-24}
        if [ ! -f "$W/live-walk.json" ]; then
            flock -x $LOCK "$BIN/k3-run" "$dir" --ids 101 --gen "${WALK:-36}" --ram floor --threads 2 --quiet --json \
                >"$W/live-walk.json"
        fi
        LIVE_REP=$(/usr/bin/python3 -c 'import json, sys; print(",".join(map(str, [101] + json.load(open(sys.argv[1]))["generated_ids"] + [101])))' "$W/live-walk.json")
        echo "bench_spec: live walk from 101: $LIVE_REP" ;;
    *) echo "bench_spec: unknown model $m" >&2; exit 2 ;;
    esac
    du -sh --apparent-size "$dir" | sed "s/^/bench_spec: $m packed /"
    # what one pass of T ids costs at the floor (a prompt of T ids, --gen 1):
    # the price of checking T - 1 guesses
    for t in ${PASS_T-1 2 4 8}; do
        for r in $(seq 1 "$RUNS"); do
            flock -x $LOCK "$BIN/k3-run" "$dir" --ids "$(seq -s, 201 $((200 + t)))" --gen 1 --ram floor --threads 2 \
                --quiet --json >"$W/$m-pass$t-$r.json" 2>/dev/null || { echo "bench_spec: pass of $t failed"; exit 1; }
        done
        /usr/bin/python3 - "$W" "$m" "$t" "$RUNS" <<'EOF'
import json, statistics, sys
w, m, t, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = [json.load(open("%s/%s-pass%s-%d.json" % (w, m, t, r)))["timings"]["prompt_s"] for r in range(1, runs + 1)]
print("[%s pass] %s ids in one pass at the floor: %.3f s (min %.3f max %.3f)" % (m, t, statistics.median(s), min(s), max(s)))
EOF
    done
    [ "${PASS_ONLY:-0}" = 1 ] && continue
    for p in ${PROMPTS:-rep non}; do
        if [ $m = width ]; then
            if [ $p = rep ]; then set -- --ids "$REP_IDS"; else set -- --ids "$NON_IDS"; fi
        elif [ $m = live ]; then
            if [ $p = rep ]; then set -- --ids "$LIVE_REP"; else set -- --ids "$NON_IDS"; fi
        elif [ $p = rep ]; then set -- --prompt "$REP"; else set -- --prompt "$NON"; fi
        for r in $(seq 1 "$RUNS"); do
            for mode in plain spec; do
                sp=""
                [ $mode = spec ] && sp="--spec $SPEC"
                out=$W/$m-$p-$mode-$r.json
                echo "[$m $p $mode $r] before:$(uptime | sed 's/.*load/ load/')"
                # shellcheck disable=SC2086
                flock -x $LOCK "$BIN/k3-run" "$dir" "$@" --gen "$gen" --ram floor --threads 2 \
                    --quiet --json ${OPTS:-} $sp >"$out" 2>"$out.err" || { tail -3 "$out.err"; exit 1; }
                grep 'k3-run: spec:' "$out.err" | sed "s/^/[$m $p $mode $r] /" || true
            done
        done
        /usr/bin/python3 - "$W" "$m" "$p" "$RUNS" <<'EOF'
import json, statistics, sys
w, m, p, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
res = {}
ids = {}
for mode in ("plain", "spec"):
    spt, ipp, acc = [], [], []
    for r in range(1, runs + 1):
        j = json.load(open("%s/%s-%s-%s-%d.json" % (w, m, p, mode, r)))
        n = len(j["generated_ids"]) - 1
        ids.setdefault(mode, j["generated_ids"])
        spt.append(j["timings"]["decode_s"] / n)
        s = j.get("spec")
        ipp.append(s["ids_per_pass"] if s else 1.0)
        acc.append(s["acceptance"] if s else 0.0)
    res[mode] = (spt, ipp, acc)
    print("[%s %s %s] %d ids: decode %.4f s/token (min %.4f max %.4f), ids per pass %.2f, acceptance %.1f %%"
          % (m, p, mode, n, statistics.median(spt), min(spt), max(spt), statistics.median(ipp),
             100 * statistics.median(acc)))
print("[%s %s] plain / spec s/token = %.2fx; same ids: %s"
      % (m, p, statistics.median(res["plain"][0]) / statistics.median(res["spec"][0]), ids["plain"] == ids["spec"]))
EOF
    done
done
echo "bench_spec: done:$(uptime | sed 's/.*load/ load/')"
[ "${KEEP:-0}" = 1 ] || rm -rf "$W"
