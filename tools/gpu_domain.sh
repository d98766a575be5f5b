#!/usr/bin/env bash
# One device call: the quantizers' domain on the GPU (docs/numerics.md, "Domain").
#   run  carry=[".devsite"]  command: source tools/device_env.sh && bash tools/gpu_domain.sh
# Stages (each under its own timeout, most important first):
#   1. tests/test_domain.py -m gpu: every edge of the domain table, kernels vs reference
#   2. test_more_than_2_31_elements: 524288 x 4128 and (2^26 + 64) x 32 bf16, dual quantizer
#   3. the existing quantizer bit-exact tests (rceil: the rounding code is untouched) and the
#      CUDA-graph dispatch test, as a regression run of the changed indexing and grid
# Logs land in $OUT (domain.txt, big.txt, regress.txt, summary.txt); the summary is printed last.
set -uo pipefail
source tools/device_prelude.sh name,driver_version,memory.total
PYTEST="python -m pytest -q -m gpu -p no:cacheprovider -p no:benchmark -W ignore::RuntimeWarning \
  --maxfail=20"
# Compiling the many kernel variants is CPU-bound Python: spread tests over processes when
# pytest-xdist is importable there; the GPU work per test is small.
XDIST=""; python -c "import xdist" 2>/dev/null && XDIST="-n ${WORKERS:-8}"
KT=tests/kernels/test_quantize_kernels.py
# Correctness of freshly built kernels, not the persistent cache: skip exporting ~200 entries.
export MOE_MXFP8_DISABLE_CACHE=1

stage() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" $PYTEST "$@" 2>&1 | tee "$OUT/$name.txt" | tail -25
  local rc=${PIPESTATUS[0]}
  local line
  line=$(grep -E "passed|failed|error|skipped" "$OUT/$name.txt" | tail -1)
  printf "%-8s rc=%-3s %4ss  %s\n" "$name" "$rc" "$((SECONDS - t0))" "${line:-no summary (timeout?)}" \
    >> "$OUT/summary.txt"
}

: > "$OUT/summary.txt"
echo "== 1. domain edges";       stage domain  ${DOMAIN_TIMEOUT:-45} $XDIST -rf tests/test_domain.py
echo "== 2. >= 2^31 elements";   stage big     ${BIG_TIMEOUT:-30} -rf "$KT" -k more_than_2_31
echo "== 3. regression (rceil)"; stage regress ${REGRESS_TIMEOUT:-40} $XDIST -rf "$KT" \
  -k "(rceil or public_api) and not more_than_2_31"
echo "== summary"
cat "$OUT/summary.txt"
