#!/usr/bin/env bash
# One device call (at most 10 minutes on an H100): the layer's host time per forward+backward,
# launched while the GPU is busy, at a small (E 64, T 4096, D 1024, H 512, top-4) and a large
# shape (mixtral), both recipes and the BF16 twin: eager in a process that loads the kernels
# the first process compiled (their native launch), with the torch ops each step dispatches, a
# cProfile and the host time inside its launches and allocations (--host-parts); then the same
# under torch.compile(mode="reduce-overhead") (CUDA-graph replays); then the GPU tests of the
# CUDA-graph path and of the quantizer kernels.
#   run  carry=[".devsite", ".pyt"]  command: bash tools/gpu_host_time.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
LAYER=(python -m benchmarks.bench_moe_layer --shapes "${SHAPES:-small,mixtral}" --skews 0
       --passes fwd+bwd --scale-blocks 1x32,1x128 --no-breakdown --reps 3)
quiet() { grep -v "Warn\|range_const"; }
echo "== compile the kernels (first process) (${SECONDS}s)"
timeout 150 "${LAYER[@]}" 2>&1 | quiet > "$OUT/warm.txt"
echo "rc=$? (${SECONDS}s)"; grep -E "^ +(small|mixtral)" "$OUT/warm.txt"
echo "== host time, eager, a second process (${SECONDS}s)"
timeout 150 "${LAYER[@]}" --host-time --host-ops --host-parts --host-profile 25 \
  --json "$OUT/host_eager.json" 2>&1 | quiet > "$OUT/host_eager.txt"
echo "rc=$? (${SECONDS}s)"; grep -E "^  host |torch ops per step|^ +(small|mixtral) " \
  "$OUT/host_eager.txt" | cut -c1-400
echo "== host time and step time under torch.compile(mode=reduce-overhead) (${SECONDS}s)"
timeout 200 "${LAYER[@]}" --host-time --compile reduce-overhead \
  --json "$OUT/host_graphs.json" 2>&1 | quiet > "$OUT/host_graphs.txt"
echo "rc=$? (${SECONDS}s)"; grep -E "^  host |^ +(small|mixtral) " "$OUT/host_graphs.txt"
echo "== GPU tests: the CUDA-graph path, the weight cache, the quantizer kernels (${SECONDS}s)"
timeout $((590 - SECONDS)) python -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/test_host_path.py tests/kernels/test_quantize_kernels.py tests/test_weight_cache.py \
  > "$OUT/tests.txt" 2>&1
echo "rc=$? (${SECONDS}s)"; tail -5 "$OUT/tests.txt"
