#!/usr/bin/env bash
# One device call, one GPU: the data-path GPU tests, the layer benchmark (both recipes, with
# memory) and the 1x128 grouped GEMMs against bf16 / fp8 rowwise, on the tree of the call.
#   run  carry=[".devsite"]  timeout_s=600  command: bash tools/gpu_recheck.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
echo "== data-path GPU tests"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_datapath.py \
  > "$OUT/tests_datapath.txt" 2>&1
echo "rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests_datapath.txt" | tail -5
echo "== layer"
timeout 200 python -m benchmarks.bench_moe_layer --shapes qwen3,mixtral,dsv3 --skews 0 \
  --passes fwd+bwd --scale-blocks 1x32,1x128 --memory --json "$OUT/layer.json" 2>&1 \
  | grep -E "^(qwen3|mixtral|dsv3) |peak GiB|mxfp8 fwd\+bwd kernels" | tee "$OUT/layer.txt"
echo "== grouped GEMM, 1x128"
for sh in dsv3 mixtral qwen3; do
  timeout 120 python -m benchmarks.bench_grouped_gemm --shapes $sh --ops fprop,dgrad,wgrad16 \
    --modes 1x128 --reps 10 --rounds 3 --json "$OUT/gemm_$sh.json" 2>&1 \
    | grep -E "^$sh \|" | tee -a "$OUT/gemm.txt"
done
