#!/usr/bin/env bash
# One device call, one GPU: the 1x128 row-block kernels at every tiling of
# tools/rowkernel_sweep.py (with the copy and BF16-twin ceilings of the same process and, with
# --parts, the SwiGLU kernels writing one kind of output at a time); FASTMATH=1: then the SwiGLU
# kernels with approximate math (Triton's `/` and exp2-based exp in place of IEEE division and
# libdevice's expf, a generated copy of the module that is never shipped): how much of their
# time is arithmetic. Then the data-path GPU tests (every walk, bit-exact).
#   run  carry=[".devsite"]  timeout_s=600  command: bash tools/gpu_rowkernels.sh
# Env: KERNELS (default swiglu,dispatch), SHAPES (default mixtral,dsv3), FASTMATH.
set -uo pipefail
source tools/device_prelude.sh name,driver_version
echo "== sweep"
timeout 270 python tools/rowkernel_sweep.py --kernels "${KERNELS:-swiglu,dispatch}" --parts \
  --shapes "${SHAPES:-mixtral,dsv3}" 2>&1 | tee "$OUT/sweep.txt"
if [ -n "${FASTMATH:-}" ]; then
echo "== sweep (approximate math, diagnostic)"
sed -e 's/        return tl.math.div_rn(a, b)/        return a \/ b/' \
    -e 's/        return libdevice.exp(x)/        return tl.exp(x)/' \
    kernels/datapath_triton.py > kernels/datapath_triton_fastmath.py
timeout 130 python tools/rowkernel_sweep.py --kernels swiglu --shapes mixtral \
  --module moe_mxfp8.kernels.datapath_triton_fastmath 2>&1 | tee "$OUT/sweep_fastmath.txt"
rm -f kernels/datapath_triton_fastmath.py
fi
echo "== data-path GPU tests"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_datapath.py \
  > "$OUT/tests_datapath.txt" 2>&1
echo "rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests_datapath.txt" | tail -5
