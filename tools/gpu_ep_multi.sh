#!/usr/bin/env bash
# One device call on a multi-GPU kind (nvidia-h200-x2 / -x4): the remaining expert-parallel runs.
#   run  kind="nvidia-h200-x4"  carry=[".devsite"]  command: bash tools/gpu_ep_multi.sh
# 1. NCCL correctness at EP=2 and 4 (tests/test_expert_parallel.py -m gpu: the gloo test's cases
#    with one GPU per rank and the GPU kernels; EP=4 skips on 2 GPUs);
# 2. all-to-all bytes and time, MXFP8 vs BF16 payloads, and the layer step at EP=P vs one GPU,
#    at the dsv3 and qwen3 shapes (tools/ep_bench.py, P = 2 and, with 4 GPUs, 4).
set -uo pipefail
source tools/device_prelude.sh name,driver_version
NGPU=$(nvidia-smi -L | wc -l)
echo "== EP GPU tests (NCCL, EP = 1, 2, 4 as the GPUs allow)"
timeout "${EP_TEST_TIMEOUT:-300}" python -m pytest -q -m gpu -s -p no:cacheprovider \
  tests/test_expert_parallel.py 2>&1 \
  | tee "$OUT/tests.txt" | tail -30
for P in ${EP_SIZES:-2 4}; do
  [ "$P" -le "$NGPU" ] || continue
  echo "== EP bench, $P GPUs"
  timeout "${EP_BENCH_TIMEOUT:-240}" torchrun --nproc-per-node "$P" tools/ep_bench.py \
    --shapes "${EP_SHAPES:-qwen3,dsv3}" \
    --json "$OUT/ep_$P.json" 2>&1 | tee "$OUT/bench_$P.txt" | grep -v "^W1"
done
