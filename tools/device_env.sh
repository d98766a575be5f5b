#!/usr/bin/env bash
# Source this at the start of every device-machine command:  source tools/device_env.sh
# Brings CuTeDSL (nvidia-cutlass-dsl 4.8.1, cu13 libs) to the device machine in ONE call: carry
# ".devsite" (made here by `bash tools/make_devsite.sh`, ~62 MiB: xz of the unpacked wheels, with
# the aarch64/QNX stubs, a static archive and the profiler-injection library left out).
# A warm machine keeps /tmp/site between calls, so the unpack (~20 s) happens once per machine.
if [ ! -f /tmp/site/cutlass_ok ]; then
  if [ ! -f .devsite/site.tar.xz ]; then
    echo "device_env: .devsite/site.tar.xz missing: carry [\".devsite\"]" >&2; return 1 2>/dev/null || exit 1
  fi
  mkdir -p /tmp/site && xz -dc -T0 .devsite/site.tar.xz | tar -x -C /tmp/site && touch /tmp/site/cutlass_ok
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
