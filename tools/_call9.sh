set -uo pipefail
source tools/device_prelude.sh name,driver_version,clocks.max.sm
for s in layer datapath gemm quant; do
  WORKERS=6 LIMIT=200 OUT=$OUT bash tools/gpu.sh $s 2>&1 | grep -E "rc=|passed|failed|FAILED|ERROR" | tail -6
done
