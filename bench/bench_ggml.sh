#!/bin/sh
# bench/bench_ggml.sh - k3's products against ggml's CPU backend on the same
# shapes and batch sizes, in one run, interleaved.
#
#   bench/bench_ggml.sh GGML_SRC [WORK]
#
# GGML_SRC is a ggml source tree (github.com/ggml-org/ggml, or the ggml/
# folder of llama.cpp); it is read, never changed. WORK (default
# /tmp/k3-ggml) receives a copy of it and the build. Needs: cmake >= 3.14,
# a C++17 compiler, make, python3, and k3's benchmarks built (make bench).
#
# The copy's tests/test-backend-ops.cpp gets two additions before the build:
#   - perf cases MUL_MAT(m = R, n = T, k = C) for every shape and T below, so
#     that ggml runs exactly k3's products (f32 activations given; ggml
#     rounds them to bf16 for bf16 weights and quantizes them to int8 for
#     MXFP4, k3 keeps them f32);
#   - a MUL_MAT case with the weights in the CPU backend's extra buffer type
#     (CPU_REPACK), which ggml's own runtime uses for model weights: MXFP4 is
#     then repacked (mxfp4_8x8 on x86 AVX2 builds) and run by its gemm/gemv
#     tiles. test-backend-ops alone never puts weights there.
# test-backend-ops is built with GGML_NATIVE (ggml's default, its best CPU
# path for this machine; ISA below), CPU backend only, and runs with its default thread
# count (all cores). k3's bench runs the same products with 2 threads in its
# "warm" mode (the same matrix every call, as ggml does); every CPU-heavy
# step takes /tmp/k3-quiet.lock. ROUNDS (default 3) rounds alternate ggml
# and k3; the table is the median of the rounds, GFLOP/s = 2 R C T / time.
#
# Environment: SHAPES (kind:RxC list, default the K3 shapes and ggml's
# 4096x14336), TS (default 1 2 4 8 16 32 64), ROUNDS, JOBS (build, default 2),
# ISA: "native" (default: ggml's GGML_NATIVE build, k3's own choice of path)
# or "avx2" (ggml built with GGML_NATIVE=OFF and AVX2 + FMA + F16C only, in
# WORK/build-avx2, and k3 run with K3_ISA=avx2), so that both sides use the
# same instructions on a CPU that also has AVX-512.
set -eu
[ $# -ge 1 ] || { echo "usage: bench/bench_ggml.sh GGML_SRC [WORK]" >&2; exit 2; }
SRC=$1
WORK=${2:-/tmp/k3-ggml}
SHAPES=${SHAPES:-"bf16:12288x7168 mxfp4:3072x3584 mxfp4:3584x3072 bf16:4096x14336 mxfp4:4096x14336"}
TS=${TS:-"1 2 4 8 16 32 64"}
ROUNDS=${ROUNDS:-3}
JOBS=${JOBS:-2}
ISA=${ISA:-native}
case $ISA in
native) B_SUFFIX=""; ISA_FLAGS="-DGGML_NATIVE=ON" ;;
avx2) B_SUFFIX="-avx2"; export K3_ISA=avx2
      ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
*) echo "bench_ggml: ISA is native or avx2" >&2; exit 2 ;;
esac
K3=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$K3/bin/bench-bench_kernels
LOCK="flock -x /tmp/k3-quiet.lock"
[ -f "$SRC/tests/test-backend-ops.cpp" ] || { echo "bench_ggml: $SRC is not a ggml tree (no tests/test-backend-ops.cpp)" >&2; exit 2; }
[ -x "$BENCH" ] || { echo "bench_ggml: $BENCH missing: run make bench in $K3" >&2; exit 2; }
command -v cmake >/dev/null || { echo "bench_ggml: cmake not found" >&2; exit 2; }

mkdir -p "$WORK"
if [ ! -f "$WORK/src/.k3-copied" ]; then
    rm -rf "$WORK/src"
    mkdir -p "$WORK/src"
    (cd "$SRC" && tar --exclude=.git --exclude='./build*' -cf - .) | (cd "$WORK/src" && tar -xf -)
    touch "$WORK/src/.k3-copied"
fi

# the perf cases: one line per (type, shape, T), repacked MXFP4 as well
CASES=$WORK/k3-cases.inc
: >"$CASES"
for s in $SHAPES; do
    kind=${s%%:*}; rc=${s#*:}; r=${rc%x*}; c=${rc#*x}
    case $kind in
    bf16) gt=GGML_TYPE_BF16 ;; f16) gt=GGML_TYPE_F16 ;; f32) gt=GGML_TYPE_F32 ;; mxfp4) gt=GGML_TYPE_MXFP4 ;;
    *) echo "bench_ggml: unknown kind $kind" >&2; exit 2 ;;
    esac
    for t in $TS; do
        echo "test_cases.emplace_back(new test_mul_mat($gt, GGML_TYPE_F32, $r, $t, $c, {1, 1}, {1, 1}));" >>"$CASES"
        [ "$kind" = mxfp4 ] && echo "test_cases.emplace_back(new k3_mul_mat_repack($gt, $r, $t, $c));" >>"$CASES"
    done
done

python3 - "$WORK/src/tests/test-backend-ops.cpp" "$CASES" <<'EOF'
import sys
path, cases = sys.argv[1], open(sys.argv[2]).read()
s = open(path).read()
orig = path + '.orig'
try:
    s = open(orig).read()
except FileNotFoundError:
    open(orig, 'w').write(s)
cls = r'''
// added by k3's bench/bench_ggml.sh: MUL_MAT with the weights in the CPU
// backend's extra (repacking) buffer type, as ggml's runtime places them
struct k3_mul_mat_repack : public test_case {
    const ggml_type type_a;
    const int64_t m, n, k;
    k3_mul_mat_repack(ggml_type type_a, int64_t m, int64_t n, int64_t k) : type_a(type_a), m(m), n(n), k(k) {}
    std::string vars() override { return VARS_TO_STR4(type_a, m, n, k) + ",repack=1"; }
    double max_nmse_err() override { return 5e-4; }
    uint64_t op_flops(ggml_tensor * t) override { GGML_UNUSED(t); return 2 * m * n * k; }
    bool use_weight_context() override { return true; }
    ggml_tensor * build_graph(ggml_context * ctx) override { GGML_UNUSED(ctx); GGML_ABORT("weights context needed"); }
    ggml_tensor * build_graph(ggml_context * ctx, ggml_context * ctx_w) override {
        ggml_tensor * a = ggml_new_tensor_2d(ctx_w, type_a, k, m);
        ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
        return ggml_mul_mat(ctx, a, b);
    }
};

static ggml_backend_buffer_type_t k3_repack_buft(ggml_backend_t backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto get = reg ? (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts") : nullptr;
    for (ggml_backend_buffer_type_t * b = get ? get(dev) : nullptr; b && *b; b++) {
        if (strstr(ggml_backend_buft_name(*b), "REPACK")) {
            return *b;
        }
    }
    return nullptr;
}
'''
anchor = '// GGML_OP_MUL_MAT\nstruct test_mul_mat : public test_case {'
assert anchor in s, 'test_mul_mat not found'
s = s.replace(anchor, cls + '\n' + anchor, 1)
alloc = 'buf_weights.reset(ggml_backend_alloc_ctx_tensors(ctx_weights.get(), backend));'
assert s.count(alloc) == 1, 'weights allocation in eval_perf not found'
s = s.replace(alloc, '{ ggml_backend_buffer_type_t rb = getenv("K3_REPACK") ? k3_repack_buft(backend) : nullptr;\n'
              '              buf_weights.reset(rb ? ggml_backend_alloc_ctx_tensors_from_buft(ctx_weights.get(), rb)\n'
              '                                   : ggml_backend_alloc_ctx_tensors(ctx_weights.get(), backend)); }', 1)
proto = 'struct test_case {'
assert proto in s, 'struct test_case not found'
s = s.replace(proto, 'static ggml_backend_buffer_type_t k3_repack_buft(ggml_backend_t backend);\n\n' + proto, 1)
perf = 'static std::vector<std::unique_ptr<test_case>> make_test_cases_perf() {\n    std::vector<std::unique_ptr<test_case>> test_cases;\n'
assert perf in s, 'make_test_cases_perf not found'
s = s.replace(perf, perf + '    if (getenv("K3_CASES")) {\n' + cases + '        return test_cases;\n    }\n', 1)
try:
    same = open(path).read() == s
except FileNotFoundError:
    same = False
if not same:                         # unchanged cases: no rebuild
    open(path, 'w').write(s)
EOF

B=$WORK/build$B_SUFFIX
if [ ! -x "$B/bin/test-backend-ops" ] || [ "$WORK/src/tests/test-backend-ops.cpp" -nt "$B/bin/test-backend-ops" ]; then
    cmake -S "$WORK/src" -B "$B" -DCMAKE_BUILD_TYPE=Release -DGGML_BUILD_TESTS=ON -DGGML_BUILD_EXAMPLES=OFF \
        $ISA_FLAGS -DGGML_CPU_REPACK=ON -DGGML_OPENMP=ON >"$WORK/cmake.log" 2>&1 \
        || { echo "bench_ggml: cmake failed, see $WORK/cmake.log" >&2; exit 1; }
    $LOCK cmake --build "$B" --target test-backend-ops -j "$JOBS" >"$WORK/build.log" 2>&1 \
        || { echo "bench_ggml: build failed, see $WORK/build.log" >&2; exit 1; }
fi
TBO=$B/bin/test-backend-ops

# one ggml round: "ggml KIND RxC T GFLOP/s" per case (repacked: KIND mxfp4r)
ggml_round() {
    K3_CASES=1 K3_REPACK=1 $LOCK "$TBO" perf -o MUL_MAT -b CPU 2>/dev/null |
    awk '/MUL_MAT\(/ && /us\/run/ {
        p = $0; sub(/^.*MUL_MAT\(/, "", p); sub(/\).*/, "", p)
        n = split(p, kv, ","); ty = ""; m = t = k = 0
        for (i = 1; i <= n; i++) { split(kv[i], f, "=")
            if (f[1] == "type_a") ty = f[2]; if (f[1] == "m") m = f[2]
            if (f[1] == "n") t = f[2]; if (f[1] == "k") k = f[2] }
        if (p ~ /repack=1/) ty = ty "r"
        us = $0; sub(/ us\/run.*/, "", us); sub(/.* /, "", us)
        printf "ggml %s %sx%s %s %.2f\n", ty, m, k, t, 2 * m * t * k / us / 1e3 }'
}

# one k3 round: "k3 KIND RxC T GFLOP/s", 2 threads, warm; and the probes
k3_round() {
    for s in $SHAPES; do
        kind=${s%%:*}; rc=${s#*:}
        case $kind in mxfp4) only=mx ;; *) only=$kind ;; esac
        $LOCK "$BENCH" --only "$only" --shape "$rc" --mode warm --threads 2 --runs 7 --ts "$(echo $TS | tr ' ' ,)" |
        awk -v k="$kind" '$1 == "fma" || $1 == "stream" { print "probe " $0 }
                          $3 == "warm" && $4 == 2 && $5 ~ /^[0-9]+$/ { print "k3", k, $2, $5, $9 }'
    done
}

OUT=$WORK/rounds$B_SUFFIX.txt
: >"$OUT"
echo "bench_ggml: ISA $ISA; ggml $(cd "$SRC" && git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), k3 $(cd "$K3" && git rev-parse --short HEAD 2>/dev/null || echo '(no git)'); $(date -u '+%Y-%m-%d %H:%M UTC'); load $(cut -d' ' -f1-3 /proc/loadavg)"
"$BENCH" --version
r=1
while [ "$r" -le "$ROUNDS" ]; do
    ggml_round | sed "s/^/$r /" >>"$OUT"
    k3_round | sed "s/^/$r /" >>"$OUT"
    echo "bench_ggml: round $r done, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    r=$((r + 1))
done
python3 - "$OUT" <<'EOF'
import sys, statistics
from collections import defaultdict
v = defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 6 and f[1] in ('ggml', 'k3'):
        v[(f[1], f[2], f[3], int(f[4]))].append(float(f[5]))
import re
fma, tri = [], []
for line in open(sys.argv[1]):
    m = re.search(r'probe fma peak, 2 threads: ([\d.]+) GFLOP/s \(([^,]*)', line)
    if m:
        fma.append(float(m.group(1))); width = m.group(2)
    m = re.search(r'probe stream probe, 2 threads: triad ([\d.]+) GB/s', line)
    if m:
        tri.append(float(m.group(1)))
peak = statistics.median(fma) if fma else 0
if fma:
    print('probes in the k3 runs, 2 threads: fma peak (%s) %.1f GFLOP/s median (%.1f-%.1f), triad %.1f GB/s (%.1f-%.1f)'
          % (width, peak, min(fma), max(fma), statistics.median(tri), min(tri), max(tri)))
med = {k: statistics.median(x) for k, x in v.items()}
print('%-6s %-11s %3s %9s %9s %9s %7s %7s %6s' % ('kind', 'shape', 'T', 'k3', 'ggml', 'ggml rp', 'k3/ggml', 'k3/rp', 'k3/fma'))
for (who, kind, shape, t) in sorted(k for k in med if k[0] == 'k3'):
    k3 = med[(who, kind, shape, t)]
    g = med.get(('ggml', kind, shape, t))
    gr = med.get(('ggml', kind + 'r', shape, t))
    fmt = lambda x: '%9.1f' % x if x else '%9s' % '-'
    rat = lambda x: '%7.2f' % (k3 / x) if x else '%7s' % '-'
    print('%-6s %-11s %3d %s %s %s %s %s %6.2f' % (kind, shape, t, fmt(k3), fmt(g), fmt(gr), rat(g), rat(gr),
                                                  k3 / peak if peak else 0))
print('(GFLOP/s, medians of %d rounds; rp: ggml with its weights repacked)' % max(len(x) for x in v.values()))
EOF
