#!/usr/bin/env bash
# One device call, one GPU: Nsight Compute metrics of the 1x128 SwiGLU kernels and their BF16
# twins (one launch each, tools/rowkernel_sweep.py --once, mixtral shape): DRAM and L2
# throughput, issue activity, occupancy, registers, stall reasons; then the data path's
# non-finite-block GPU test.
#   run  carry=[".devsite"]  timeout_s=400  command: bash tools/gpu_ncu_rowkernels.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M="$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum"
M="$M,lts__t_sectors.avg.pct_of_peak_sustained_elapsed"
M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active"
M="$M,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread"
M="$M,launch__occupancy_limit_registers,smsp__inst_executed.sum"
timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k "regex:_swiglu_(fwd|bwd)_kernel" \
  --metrics "$M" python tools/rowkernel_sweep.py --once --kernels swiglu --shapes mixtral \
  > "$OUT/ncu.txt" 2>&1
echo "rc=$?"
grep -vE "^\s*$|==PROF== Profiling|==PROF== Connected" "$OUT/ncu.txt" \
  | grep -E "_kernel|\.ratio|pct|duration|registers|occupancy|inst_executed" \
  | awk '$NF+0 > 0.05 || /kernel|pct|duration|registers|occupancy|inst_executed/' | head -120
echo "== non-finite blocks test"
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_datapath.py \
  -k nonfinite 2>&1 | tail -3
