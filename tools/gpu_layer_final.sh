#!/usr/bin/env bash
# One device call (about 6 minutes): the dual-axis weight quantizer's bit-exactness, the data
# path's and the layer's GPU tests, the data-path kernels alone at the dsv3 shape, then the
# layer benchmark at the three shapes in both recipes (per-phase kernel times, peak memory).
#   run  carry=[".devsite"]  command: bash tools/gpu_layer_final.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
echo "== dual-axis weight quantizer (GPU tests)"
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/kernels/test_quantize_kernels.py -k "weights_dual or weights_bit_exact" \
  > "$OUT/tests_quant.txt" 2>&1
echo "rc=$? (${SECONDS}s)"; tail -3 "$OUT/tests_quant.txt"
echo "== data path and layer (GPU tests)"
timeout "${TEST_TIMEOUT:-210}" python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/test_datapath.py tests/test_moe.py > "$OUT/tests_layer.txt" 2>&1
echo "rc=$? (${SECONDS}s)"; tail -3 "$OUT/tests_layer.txt"
SKIP_LAYER=1 SKIP_TESTS=1 KERNEL_TIMEOUT=45 bash tools/gpu_datapath_mem.sh 2>&1 | tail -10
echo "== layer benchmark (${SECONDS}s)"
timeout "${LAYER_TIMEOUT:-200}" python -m benchmarks.bench_moe_layer --shapes qwen3,mixtral,dsv3 \
  --skews 0 --passes fwd+bwd --scale-blocks 1x32,1x128 --memory --json "$OUT/layer.json" 2>&1 \
  | grep -v "Warn\|range_const" > "$OUT/layer.txt"
echo "rc=$? (${SECONDS}s)"
grep -A1 "^qwen3\|^mixtral\|^dsv3" "$OUT/layer.txt" | grep -v "^--"
grep "outside expert gemm" "$OUT/layer.txt" | sed 's/^ *//' | cut -c1-260
