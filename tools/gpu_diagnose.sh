#!/usr/bin/env bash
# One device call: host-sync checks, save_colwise time/memory, and an MXFP8 training run on the
# reference backend (to tell kernel bugs from MXFP8 numerics in the GPU parity gap).
#   run  carry=[".devsite"]  command: bash tools/gpu_diagnose.sh
set -uo pipefail
source tools/device_env.sh
python -c "import pytest" 2>/dev/null || {
  mkdir -p /tmp/pyt && tar -xJf .pyt/pytest.tar.xz -C /tmp/pyt && export PYTHONPATH=/tmp/pyt:$PYTHONPATH; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout 60 python tools/sync_probe.py 2>&1 | grep -v Warn | tail -8 | tee "$OUT/sync.txt"
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_moe.py tests/test_autograd.py 2>&1 \
  | tail -5 | tee -a "$OUT/sync.txt"
for sc in "--save-colwise 0" "--save-colwise 1"; do
  timeout 60 python -m benchmarks.bench_moe_layer --shapes dsv3 --skews 0 --no-breakdown $sc 2>&1 \
    | grep "fwd+bwd |" | sed "s/^/save_colwise=${sc:-off} /" | tee -a "$OUT/save_colwise.txt"
done
timeout ${REF_TIMEOUT:-270} python -m train_example.train --precision mxfp8 --backend reference \
  --preset gpu --steps 1000 --stop-after ${REF_STEPS:-400} --device cuda --out /tmp/ref --quiet \
  2>&1 | tail -3 | tee "$OUT/ref_train.txt"
cp /tmp/ref/log.csv "$OUT/ref_log.csv" 2>/dev/null
