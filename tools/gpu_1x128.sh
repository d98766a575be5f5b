#!/usr/bin/env bash
# One device call for the 1x128 recipe (issue 16): GPU correctness of the promote-per-k=128
# kernel paths (+ a 1x32 regression subset), then the grouped-GEMM benchmark with bf16
# torch._grouped_mm and fp8 rowwise torch._scaled_grouped_mm in the same process.
#   run  carry=[".devsite"]  command: bash tools/gpu_1x128.sh
# Env: DEVSITE / PYT (other tarballs than .devsite / .pyt), SKIP_TESTS=1, SHAPES, OPS, MODES_DSV3 / MODES (bench_grouped_gemm --modes), REPS/ROUNDS.
set -uo pipefail
# the CuTeDSL site (+ pytest): .devsite as tools/device_env.sh expects, or DEVSITE=<a tar.xz
# that also holds pytest> (smaller: the working tree and the carried paths must fit 64 MiB)
if [ -n "${DEVSITE:-}" ] && [ ! -f /tmp/site/cutlass_ok ]; then
  mkdir -p /tmp/site && xz -dc -T0 "$DEVSITE" | tar -x -C /tmp/site && touch /tmp/site/cutlass_ok
fi
source tools/device_env.sh
PYT=${PYT:-.pyt/pytest.tar.xz}  # pytest (+ pluggy, iniconfig) as a tar.xz
if [ -f "$PYT" ]; then
  mkdir -p /tmp/pyt && tar -xJf "$PYT" -C /tmp/pyt && export PYTHONPATH=/tmp/pyt:$PYTHONPATH
fi
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"
  timeout ${TEST_TIMEOUT:-100} python -m pytest -q -m gpu -p no:cacheprovider -k 1x128 \
    tests/kernels/test_grouped_gemm.py tests/kernels/test_grouped_gemm_sm90.py \
    "tests/test_autograd.py::test_gpu_scale_blocks_1x128_matches_bf16_grouped_mm[4096x1024x2048x8]" \
    2>&1 | grep -v "Warn\|range_constexpr" | tail -25 | tee "$OUT/tests.txt"
fi
echo "== benchmark"
for sh in ${SHAPES:-dsv3 mixtral qwen3}; do
  modes=${MODES:-1x32,1x128,1x128o}
  [ "$sh" = dsv3 ] && modes=${MODES_DSV3:-1x32,1x128,1x128o,1x128c2}
  timeout ${SHAPE_TIMEOUT:-80} python -m benchmarks.bench_grouped_gemm --shapes $sh \
    --ops ${OPS:-fprop,dgrad,wgrad16} --modes $modes --reps ${REPS:-10} --rounds ${ROUNDS:-3} \
    --json "$OUT/bench_$sh.json" 2>&1 | grep -v "Warn\|range_constexpr\|^ *$\|^{" \
    | tee "$OUT/bench_$sh.txt"
done
echo "== summary"; cat "$OUT/tests.txt" 2>/dev/null | tail -3; cat "$OUT"/bench_*.txt | grep "|"
