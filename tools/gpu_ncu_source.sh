#!/usr/bin/env bash
# One device call: ncu warp-stall sampling per SASS instruction (SourceCounters) of the sm90
# grouped GEMM, exported as CSV for tools/stall_by_role.py (which splits the samples by the
# warp role / k-loop region they belong to).
#   run  carry=[".devsite"]  command: bash tools/gpu_ncu_source.sh
# Env: NCU_CASE (tune case, default fprop:dsv3:8192), NCU_CONFIGS (default "default"),
#      NCU_MODES (weight block rows, default 32).
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout ${NCU_TIMEOUT:-300} ncu --clock-control none -k regex:kernel_cutlass --import-source no \
  --section SourceCounters --section WarpStateStats -f -o /tmp/src \
  python -m benchmarks.tune_grouped_gemm_sm90 --once --cases "${NCU_CASE:-fprop:dsv3:8192}" \
  --configs "${NCU_CONFIGS:-default}" --modes "${NCU_MODES:-32}" > "$OUT/ncu_log.txt" 2>&1
tail -3 "$OUT/ncu_log.txt"
ncu -i /tmp/src.ncu-rep --page source --print-source sass --csv > "$OUT/source_sass.csv" 2> "$OUT/export_err.txt"
echo "export rc=$? lines=$(wc -l < "$OUT/source_sass.csv")"; head -c 600 "$OUT/export_err.txt"
head -3 "$OUT/source_sass.csv" | cut -c1-1500
ncu -i /tmp/src.ncu-rep --page details --section WarpStateStats > "$OUT/warp_state.txt" 2>&1
grep -E "Stall|Warp Cycles|stall" "$OUT/warp_state.txt" | head -20
