#!/usr/bin/env bash
# One device call: baseline self-check, then the grouped-GEMM benchmark at the three shapes.
#   run  carry=[".devsite"]  command: bash tools/gpu_bench_gemm.sh
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout 120 python -m benchmarks.bench_grouped_gemm --check-baselines 2>&1 | grep -v Warn \
  | tail -12 | tee "$OUT/check_baselines.txt"
for sh in ${SHAPES:-dsv3 qwen3 mixtral}; do
  timeout ${SHAPE_TIMEOUT:-200} python -m benchmarks.bench_grouped_gemm --shapes $sh \
    --json "$OUT/bench_$sh.json" 2>&1 | grep -v "Warn\|range_constexpr\|^ *$" | tail -8 \
    | tee "$OUT/bench_$sh.txt"
done
