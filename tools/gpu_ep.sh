#!/usr/bin/env bash
# One device call, one GPU: expert parallelism over NCCL at world size 1 -- the EP GPU tests
# (tests/test_expert_parallel.py -m gpu) and the dispatch / layer-step timing (tools/ep_bench.py).
#   run  carry=[".devsite"]  timeout_s=120  command: bash tools/gpu_ep.sh  (the image has pytest;
#   .devsite + .pyt + the tree can exceed the 64 MiB carry limit)
# Multi-GPU (when lent):  python -m pytest -m gpu tests/test_expert_parallel.py  (EP=2, 4)
#                         torchrun --nproc-per-node P tools/ep_bench.py --json $OUT/ep.json
set -uo pipefail
source tools/device_prelude.sh name,driver_version
echo "== fp32 router GEMM rows vs token count (the multi-GPU test compares ranks' slices bitwise)"
timeout 20 python -c "
import torch
x = torch.randn(192, 128, device='cuda'); w = torch.randn(8, 128, device='cuda')
full = torch.nn.functional.linear(x, w)
print('router rows independent of M:', all(torch.equal(full[a:b], torch.nn.functional.linear(x[a:b], w)) for a, b in ((0, 40), (40, 64), (64, 192))))
" 2>&1 | tee "$OUT/router.txt"
echo "== EP GPU tests (NCCL, world size 1; the 2/4-GPU test skips)"
timeout "${EP_TEST_TIMEOUT:-70}" python -m pytest -q -m gpu -s -p no:cacheprovider \
  tests/test_expert_parallel.py 2>&1 | tee "$OUT/tests.txt" | tail -25
grep -h "host sync" "$OUT/tests.txt" | cut -c1-600  # which syncs, when the count is off
echo "== EP dispatch and step timing (NCCL, world size 1)"
timeout "${EP_BENCH_TIMEOUT:-30}" python tools/ep_bench.py --shapes "${EP_SHAPES:-qwen3,dsv3}" \
  --tokens "${EP_TOKENS:-8192}" --json "$OUT/ep.json" 2>&1 | tee "$OUT/bench.txt"
