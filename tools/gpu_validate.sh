#!/usr/bin/env bash
# Every GPU test, feature by feature: `tools/gpu.sh`'s test suites (SUITES="gemm layer" runs a
# subset).   run  carry=[".devsite"]  command: bash tools/gpu_validate.sh
# shellcheck disable=SC2086
exec bash tools/gpu.sh ${SUITES:-gemm layer quant rest}
