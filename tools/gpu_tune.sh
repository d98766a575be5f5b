#!/usr/bin/env bash
# One device call: the sm90 GEMM GPU tests (correctness of the current defaults), then the
# tuning sweep (benchmarks/tune_grouped_gemm_sm90.py).
#   run  carry=[".devsite"]  command: bash tools/gpu_tune.sh
# Env: TESTS (pytest targets, "" to skip), CASES / CONFIGS (sweep arguments), NCU (1: profile).
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ -n "${TESTS-tests/kernels/test_grouped_gemm_sm90.py}" ]; then
  echo "== GPU tests"
  timeout ${TEST_TIMEOUT:-240} python -m pytest -q -m gpu -x -p no:cacheprovider \
    ${TESTS-tests/kernels/test_grouped_gemm_sm90.py} 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
echo "== ceilings"
timeout 60 python -m benchmarks.ceilings 2>&1 | tail -4 | tee "$OUT/ceilings.txt"
echo "== sweep"
timeout ${SWEEP_TIMEOUT:-400} python -m benchmarks.tune_grouped_gemm_sm90 --json "$OUT/tune.json" \
  ${CASES:+--cases $CASES} ${CONFIGS:+--configs "$CONFIGS"} 2>&1 | tee "$OUT/tune.txt"
if [ -n "${NCU:-}" ]; then
  echo "== ncu (${NCU_CONFIGS}, ${NCU_CASE})"
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:kernel_cutlass \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python -m benchmarks.tune_grouped_gemm_sm90 --once --cases "$NCU_CASE" \
    --configs "$NCU_CONFIGS" --modes "${NCU_MODES:-32}" > "$OUT/ncu.txt" 2>&1
  grep -E "==PROF==|Duration|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Stall|Executed Ipc A|SM Busy|Tensor|L2 Cache Through|DRAM Through|Compute \(SM\)|Memory Through|  kernel" "$OUT/ncu.txt" | head -80
fi
