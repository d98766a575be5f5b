#!/usr/bin/env bash
# One device call for the lean MoE data path (moe_mxfp8/datapath.py, kernels/datapath_triton.py):
# its GPU tests (Triton kernels bit-exact vs the references, determinism, CUDA-graph replay), the
# layer benchmark (MXFP8 vs BF16 twin: time, per-phase time outside the expert GEMMs, peak memory,
# bytes saved for backward per token), then MXFP8MoE's own GPU tests.
#   run  carry=[".devsite"]  command: source tools/device_env.sh && bash tools/gpu_datapath.sh
# Env: TESTS / TESTS2 (pytest paths before / after the benchmark), LAYER_ARGS, *_TIMEOUT.
set -uo pipefail
source tools/device_prelude.sh name,driver_version
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests (1)"
timeout ${TEST_TIMEOUT:-90} python -m pytest -v -m gpu -p no:cacheprovider -rf \
  ${TESTS:-tests/test_datapath.py} -k "${TESTS_K:-gpu}" > "$OUT/tests1.txt" 2>&1
tail -25 "$OUT/tests1.txt"
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== layer benchmark"
  timeout ${LAYER_TIMEOUT:-170} python -m benchmarks.bench_moe_layer --skews 0 --passes fwd+bwd \
    ${LAYER_ARGS:-} --json "$OUT/layer.json" 2>&1 | grep -v "Warn\|range_const" \
    > "$OUT/layer.txt"
fi
if [ -n "${LAYER2_ARGS:-}" ]; then
  echo "== layer benchmark (2): $LAYER2_ARGS"
  timeout ${LAYER2_TIMEOUT:-90} python -m benchmarks.bench_moe_layer --skews 0 --passes fwd+bwd \
    $LAYER2_ARGS --json "$OUT/layer2.json" 2>&1 | grep -v "Warn\|range_const" > "$OUT/layer2.txt"
fi
if [ -z "${SKIP_TESTS2:-}" ]; then
  echo "== GPU tests (2)"
  timeout ${TEST2_TIMEOUT:-60} python -m pytest -q -m gpu -p no:cacheprovider -rf \
    ${TESTS2:-tests/test_moe.py} > "$OUT/tests2.txt" 2>&1
fi
echo "== summary"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests1.txt" | tail -20
tail -8 "$OUT/tests2.txt" 2>/dev/null
grep -v "^    " "$OUT/layer.txt" 2>/dev/null | tail -30
grep "^    " "$OUT/layer.txt" 2>/dev/null | head -60
tail -8 "$OUT/layer2.txt" 2>/dev/null
