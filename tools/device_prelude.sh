#!/usr/bin/env bash
# The opening of a device command (tools/gpu.sh, or pytest by hand), after `set -uo pipefail`:
#   source tools/device_prelude.sh FIELDS
# tools/device_env.sh; pytest from a carried ".pyt" where the image has none; OUT (default
# /tmp/out, created); one line of nvidia-smi --query-gpu=FIELDS (e.g. name,driver_version).
source tools/device_env.sh
python -c "import pytest" 2>/dev/null || {
  mkdir -p /tmp/pyt && tar -xJf .pyt/pytest.tar.xz -C /tmp/pyt && export PYTHONPATH=/tmp/pyt:$PYTHONPATH; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu="$1" --format=csv,noheader
