#!/usr/bin/env bash
# One device call: ncu stall-reason and pipe-utilisation metrics of the sm90 grouped GEMM under
# a few tuning configs (benchmarks/tune_grouped_gemm_sm90.py --once).
#   run  carry=[".devsite"]  command: NCU_CONFIGS="hoist,diag no_promote" bash tools/gpu_ncu_stalls.sh
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
M="$M,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
M="$M,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"
M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
M="$M,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second"
timeout ${NCU_TIMEOUT:-200} ncu --clock-control none -k regex:kernel_cutlass --metrics "$M" \
  python -m benchmarks.tune_grouped_gemm_sm90 --once --cases "${NCU_CASE:-fprop:dsv3:8192}" \
  --configs "${NCU_CONFIGS:-hoist}" --modes "${NCU_MODES:-32}" > "$OUT/ncu.txt" 2>&1
grep -vE "^\s*$|==PROF== Profiling" "$OUT/ncu.txt" | grep -E "kernel_cutlass|\.ratio|pct|duration|per_second" \
  | awk '$NF+0 > 0.02 || /kernel|pct|duration|per_second/' | sed -E 's/kernel_cutlass_kernel_[^ ]*/KERNEL/' | head -120
