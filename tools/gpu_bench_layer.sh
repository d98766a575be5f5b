#!/usr/bin/env bash
# One device call: the wgrad16 GEMM rows (aligned_groups), then the layer benchmark for the
# default MXFP8MoE and for LAYER_ALT (default: 32x32 weights + BF16 wgrad), balanced routing.
#   run  carry=[".devsite"]  command: bash tools/gpu_bench_layer.sh
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -z "${SKIP_WGRAD16:-}" ]; then
  for sh in dsv3 qwen3 mixtral; do
    timeout 120 python -m benchmarks.bench_grouped_gemm --shapes $sh --ops wgrad16 \
      --json "$OUT/bench_${sh}_wgrad16.json" 2>&1 | grep "| wgrad16 |" | tee -a "$OUT/wgrad16.txt"
  done
fi
timeout ${LAYER_TIMEOUT:-200} python -m benchmarks.bench_moe_layer --skews 0 \
  --json "$OUT/layer.json" --png "$OUT/layer.png" 2>&1 | grep -v "Warn\|range_const\|^ *$" \
  | tail -12 | tee "$OUT/layer.txt"
timeout ${LAYER_TIMEOUT:-200} python -m benchmarks.bench_moe_layer --skews 0 --no-breakdown \
  ${LAYER_ALT:---weight-blocks 32x32 --wgrad bf16} --json "$OUT/layer_alt.json" 2>&1 \
  | grep -v "Warn\|range_const\|^ *$" | tail -8 | tee "$OUT/layer_alt.txt"
