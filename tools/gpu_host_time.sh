#!/usr/bin/env bash
# One device call (at most 9 minutes on an H100): the weight cache's GPU tests; the host time of
# one forward+backward launched while the GPU is busy, at a small (E 64, T 4096, D 1024, H 512,
# top-4) and a large shape (mixtral), both recipes and the BF16 twin, with a cProfile of the
# launches; then mixtral's 1x128 layer with cache_weights off and on, one micro-batch per step
# and four (gradient accumulation). The later runs reuse the kernels the first one compiled.
#   run  carry=[".devsite", ".pyt"]  command: bash tools/gpu_host_time.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
echo "== weight cache (GPU tests)"
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_weight_cache.py \
  > "$OUT/tests_weight_cache.txt" 2>&1
echo "rc=$? (${SECONDS}s)"; tail -3 "$OUT/tests_weight_cache.txt"
echo "== host time per forward+backward, GPU busy ahead (${SECONDS}s)"
timeout "${HOST_TIMEOUT:-240}" python -m benchmarks.bench_moe_layer --shapes small,mixtral \
  --skews 0 --passes fwd+bwd --scale-blocks 1x32,1x128 --no-breakdown --reps 3 --host-time \
  --host-profile 30 --json "$OUT/host_time.json" 2>&1 | grep -v "Warn\|range_const" \
  > "$OUT/host_time.txt"
echo "rc=$? (${SECONDS}s)"; grep "^  host \|host ms per step" "$OUT/host_time.txt"
for acc in 1 4; do
  echo "== mixtral 1x128, cache_weights 0,1, ${acc} micro-batch(es) per step (${SECONDS}s)"
  timeout $((75 + 15 * acc)) python -m benchmarks.bench_moe_layer --shapes mixtral --skews 0 \
    --passes fwd+bwd --scale-blocks 1x128 --cache-weights 0,1 --accumulate "$acc" \
    --no-breakdown --reps 3 --json "$OUT/cache_acc${acc}.json" 2>&1 \
    | grep -v "Warn\|range_const" > "$OUT/cache_acc${acc}.txt"
  echo "rc=$? (${SECONDS}s)"; grep -A3 "^mixtral" "$OUT/cache_acc${acc}.txt" | grep -v "^--"
done
