#!/usr/bin/env bash
# One device call (about 9 minutes): the data path's and the expert-parallel payload's GPU tests,
# the EP dispatch timing at world size 1, then the GPU parity preset of the 1x128 recipe with a
# second BF16 run (--bf16-repeat 1: the BF16 run-to-run spread, now that the data path is
# deterministic).
#   run  carry=[".devsite"]  command: bash tools/gpu_parity_1x128.sh
# Env: PARITY_ARGS (default --scale-blocks 1x128 --bf16-repeat 1), PARITY_TIMEOUT, SKIP_TESTS.
set -uo pipefail
source tools/device_prelude.sh name,driver_version
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== data-path GPU tests"
  timeout "${TEST_TIMEOUT:-100}" python -m pytest -q -m gpu -p no:cacheprovider -rf \
    tests/test_datapath.py > "$OUT/datapath_tests.txt" 2>&1
  echo "datapath tests rc=$? (${SECONDS}s)"; tail -4 "$OUT/datapath_tests.txt"
  EP_TEST_TIMEOUT=90 EP_BENCH_TIMEOUT=45 bash tools/gpu_ep.sh > "$OUT/ep.txt" 2>&1
  echo "ep rc=$? (${SECONDS}s)"
  grep -h "passed\|failed\|host sync\|<-\|^shape\|^qwen3\|^dsv3" "$OUT/ep.txt" | cut -c1-300
fi
echo "== parity"
rm -rf /tmp/parity
timeout "${PARITY_TIMEOUT:-400}" python -m train_example.parity --device cuda --preset gpu \
  ${PARITY_ARGS:---scale-blocks 1x128 --bf16-repeat 1} --out /tmp/parity 2>&1 \
  | tr '\r' '\n' | grep -v "^step\|^ *$" | tail -40 | tee "$OUT/parity.txt"
echo "parity rc=$? (${SECONDS}s)"
# one archive: the run directories' logs and the comparison (the device returns few files)
(cd /tmp/parity && tar -czf "$OUT/parity.tar.gz" --exclude='*.safetensors' --exclude='*.pt' .)
tar -tzf "$OUT/parity.tar.gz" | head -20
