#!/usr/bin/env bash
# One device call: every GPU test, feature by feature, each group under its own time limit so a
# slow group cannot hide the others' results.
#   run  carry=[".devsite"]  command: bash tools/gpu_validate.sh
# pytest comes from the device image; where it is missing, carry ".pyt" too (tools/make_devsite.sh).
# Logs land in $OUT (one file per group); SUITES="gemm layer" runs a subset.
set -uo pipefail
source tools/device_prelude.sh name,driver_version,clocks.sm
python -c "import torch, pytest; print('torch', torch.__version__, 'pytest', pytest.__version__)"
declare -A FILES=(
  [gemm]="tests/kernels/test_grouped_gemm.py tests/kernels/test_grouped_gemm_sm90.py tests/test_1x128_recipe.py tests/kernels/test_grouped_gemm_sm100.py tests/kernels/test_selfcheck.py"
  [layer]="tests/test_moe.py tests/test_autograd.py tests/test_datapath.py tests/kernels/test_align_k_groups.py"
  [quant]="tests/kernels/test_quantize_kernels.py tests/test_domain.py"
  [rest]="tests/test_compile_cache.py tests/test_expert_parallel.py tests/test_module_object.py tests/test_checkpoint.py tests/test_errors_and_backend.py"
)
declare -A LIMIT=([gemm]=${LIMIT_GEMM:-240} [layer]=${LIMIT_LAYER:-240} [quant]=${LIMIT_QUANT:-150} [rest]=${LIMIT_REST:-120})
for g in ${SUITES:-gemm layer quant rest}; do
  echo "== $g: ${FILES[$g]}"
  timeout "${LIMIT[$g]}" python -m pytest -q -m gpu -p no:cacheprovider -rfE ${FILES[$g]} \
    > "$OUT/tests_$g.txt" 2>&1
  echo "rc=$?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests_$g.txt" | tail -15
done
