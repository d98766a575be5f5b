#!/usr/bin/env bash
# One device call, one GPU: tools/overlap_probe.py (the 1x128 data-path kernels and the weight
# quantizations, alone and on two streams).
#   run  carry=[".devsite"]  timeout_s=600  command: bash tools/gpu_overlap.sh
set -uo pipefail
source tools/device_prelude.sh name,driver_version
timeout 400 python tools/overlap_probe.py ${SHAPES:+--shapes $SHAPES} 2>&1 | tee "$OUT/overlap.txt"
