#!/usr/bin/env bash
# Build .devsite/site.tar.xz (git-ignored) for tools/device_env.sh: the CuTeDSL wheels for
# Python 3.12 x86-64 unpacked and xz-compressed to fit the device tool's 64 MiB carry limit.
set -euo pipefail
VERSION="${1:-4.8.1}"
root="$(git rev-parse --show-toplevel)"; cd "$root"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp/dl" \
  "nvidia-cutlass-dsl==$VERSION" "nvidia-cutlass-dsl-libs-base==$VERSION" \
  "nvidia-cutlass-dsl-libs-core==$VERSION" "nvidia-cutlass-dsl-libs-cu13==$VERSION"
mkdir -p "$tmp/site"; for w in "$tmp"/dl/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
rm -rf "$tmp"/site/nvidia_cutlass_dsl/cu13/lib/stubs "$tmp"/site/nvidia_cutlass_dsl/cu13/lib/*.a \
  "$tmp"/site/nvidia_cutlass_dsl/dsl_packages/iket/profiler
mkdir -p .devsite && tar -cf - -C "$tmp/site" . | xz -T0 -9e > .devsite/site.tar.xz
ls -la .devsite/site.tar.xz
