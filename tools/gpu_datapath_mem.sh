#!/usr/bin/env bash
# One device call for the lean MoE data path's memory and the 1x128 data path:
#  1. the layer benchmark with --memory: per precision, the forward and backward peaks from one
#     fair starting point and what is alive at the step's peak by allocating line
#     (torch.cuda.memory history), then the fwd+bwd time vs the BF16 twin in the same run;
#  2. the data path's GPU tests (Triton kernels bit-exact vs the references with 32- and
#     128-element activation blocks, determinism, CUDA-graph replay);
#  3. the quantizing data-path kernels alone at the dsv3 shape: warps per program and the
#     16-byte columnwise stores (ms, GB/s over the bytes each must move).
#   run  carry=[".devsite"]  command: bash tools/gpu_datapath_mem.sh
# Env: SHAPES (default qwen3,mixtral,dsv3), LAYER_OPTS (default: --no-breakdown --memory),
#      LAYER_ARGS, LAYER2_ARGS (a second benchmark run),
#      TESTS (pytest paths), TEST_K (pytest -k), SKIP_LAYER, SKIP_TESTS, SKIP_KERNELS, *_TIMEOUT.
set -uo pipefail
source tools/device_prelude.sh name,driver_version
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "${SKIP_LAYER:-}" ]; then
  echo "== layer: memory (per phase, alive at the peak) and time, fwd+bwd"
  timeout "${LAYER_TIMEOUT:-120}" python -m benchmarks.bench_moe_layer \
    --shapes "${SHAPES:-qwen3,mixtral,dsv3}" --skews 0 --passes fwd+bwd \
    ${LAYER_OPTS---no-breakdown --memory} ${LAYER_ARGS:-} --json "$OUT/layer.json" 2>&1 \
    | grep -v "Warn\|range_const" > "$OUT/layer.txt"
  echo "layer rc=$? (${SECONDS}s)"
fi
if [ -n "${LAYER2_ARGS:-}" ]; then
  echo "== layer (2): $LAYER2_ARGS"
  timeout "${LAYER2_TIMEOUT:-80}" python -m benchmarks.bench_moe_layer --skews 0 --passes fwd+bwd \
    --no-breakdown $LAYER2_ARGS --json "$OUT/layer2.json" 2>&1 | grep -v "Warn\|range_const" \
    > "$OUT/layer2.txt"
  echo "layer2 rc=$? (${SECONDS}s)"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"
  timeout "${TEST_TIMEOUT:-85}" python -m pytest -q -m gpu -p no:cacheprovider -rf \
    ${TESTS:-tests/test_datapath.py tests/test_moe.py::test_gpu_router_bf16_gemm_matches_the_fp32_router} \
    ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? (${SECONDS}s)"
fi
if [ -z "${SKIP_KERNELS:-}" ]; then
  echo "== data-path kernels alone at dsv3"
  timeout "${KERNEL_TIMEOUT:-40}" python - > "$OUT/kernels.txt" 2>&1 <<'PYEOF'
import torch
import triton

from moe_mxfp8 import datapath as DP
from moe_mxfp8.kernels import datapath_triton as K

torch.manual_seed(0)
T, k, E, D, H = 65536, 2, 8, 7168, 2048
ids = torch.rand(T, E, device="cuda").argsort(1)[:, :k]
counts = torch.bincount(ids.reshape(-1), minlength=E)
rows, src, offs = DP.route_layout(ids, counts, 16)
M = src.numel()
bf = torch.bfloat16
x, dout = (torch.randn(T, D, device="cuda", dtype=bf) for _ in range(2))
h = torch.randn(M, 2 * H, device="cuda", dtype=bf) * 3
da, y = torch.randn(M, H, device="cuda", dtype=bf), torch.randn(M, D, device="cuda", dtype=bf)
w = torch.rand(T, k, device="cuda")
part = torch.empty(D // 128, M, device="cuda")
print(f"{'kernel':12s} ablk   rows warps      ms     GB/s")
for ablk in (32, 128):
    tbl = DP.block_table(offs, M, ablk)
    o_d = DP._outputs(M, D, E, True, True, False, x)
    o_h = DP._outputs(M, H, E, True, True, False, x)
    o_2h = DP._outputs(M, 2 * H, E, True, True, False, x)
    cases = [
        ("dispatch", lambda: K.dispatch(x, src, tbl, k, o_d, ablk, True),
         M * D * 4),
        ("swiglu_fwd", lambda: K.swiglu_fwd(h, src, tbl, o_h, ablk, True),
         M * H * 6),
        ("swiglu_bwd", lambda: K.swiglu_bwd(da, h, src, tbl, o_2h, ablk, True),
         M * H * 10),
        ("combine_bwd",
         lambda: K.combine_bwd(dout, y, w, src, tbl, k, o_d, part, ablk, True), M * D * 6),
    ]
    for name, fn, nbytes in cases:
        ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        rb, warps = K.ROW_TILING[name][ablk][:2]
        print(f"{name:12s} {ablk:4d} {rb:6d} {warps:5d} {ms:7.3f} {nbytes / ms / 1e6:8.0f}",
              flush=True)
PYEOF
  echo "kernels rc=$? (${SECONDS}s)"
fi
echo "== summary"
tail -6 "$OUT/tests.txt" 2>/dev/null
cat "$OUT/kernels.txt" 2>/dev/null | tail -24
tail -70 "$OUT/layer.txt"
tail -12 "$OUT/layer2.txt" 2>/dev/null
