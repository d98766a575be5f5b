#!/usr/bin/env bash
# One device call: every GPU test, a short GPU-preset training timing, and the layer benchmark.
#   run  carry=[".devsite", ".pyt"]  command: bash tools/gpu_validate.sh
# Logs and JSON land in $OUT (tests.txt, train_timing.txt, layer.txt, layer.json, layer.png).
set -uo pipefail
source tools/device_env.sh
python -c "import pytest" 2>/dev/null || {
  mkdir -p /tmp/pyt && tar -xJf .pyt/pytest.tar.xz -C /tmp/pyt && export PYTHONPATH=/tmp/pyt:$PYTHONPATH; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
echo "== GPU tests"
timeout 240 python -m pytest -q -m gpu -x -p no:cacheprovider tests 2>&1 | tail -40 | tee "$OUT/tests.txt"
echo "== training step timing (gpu preset)"
for p in bf16 mxfp8; do
  timeout 90 python -m train_example.train --precision $p --steps ${TRAIN_STEPS:-15} --device cuda \
    --preset gpu --out /tmp/train_$p 2>&1 | tail -4
done | tee "$OUT/train_timing.txt"
echo "== layer benchmark"
timeout ${LAYER_TIMEOUT:-300} python -m benchmarks.bench_moe_layer --json "$OUT/layer.json" \
  --png "$OUT/layer.png" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.txt"
