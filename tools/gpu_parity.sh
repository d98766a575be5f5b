#!/usr/bin/env bash
# One device call: sync probe, the GPU-preset parity run, then the layer benchmark (eager).
#   run  carry=[".devsite"]  command: bash tools/gpu_parity.sh
set -uo pipefail
source tools/device_env.sh
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
timeout 60 python tools/sync_probe.py 2>&1 | tail -25 | tee "$OUT/sync.txt"
start=$(date +%s)
timeout ${PARITY_TIMEOUT:-330} python -m train_example.parity --device cuda --preset gpu \
  --steps ${PARITY_STEPS:-1000} --out /tmp/parity 2>&1 | grep -v "^step" | tail -30 | tee "$OUT/parity.txt"
echo "parity wall $(( $(date +%s) - start )) s" | tee -a "$OUT/parity.txt"
cp /tmp/parity/loss.csv /tmp/parity/loss.png /tmp/parity/summary.json "$OUT/" 2>/dev/null
timeout ${LAYER_TIMEOUT:-170} python -m benchmarks.bench_moe_layer --json "$OUT/layer.json" \
  --png "$OUT/layer.png" ${LAYER_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/layer.txt"
