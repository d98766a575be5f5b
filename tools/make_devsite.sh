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
# Left out: stubs and a static archive (link time only) and the iket package, which neither
# compiling nor launching imports (H100, 2026-11-23), so the archive (~61.8 MiB) leaves room
# under the 64 MiB carry limit. (cutlass/__init__.py imports cutlass.jax: it must stay.)
rm -rf "$tmp"/site/nvidia_cutlass_dsl/cu13/lib/stubs "$tmp"/site/nvidia_cutlass_dsl/cu13/lib/*.a \
  "$tmp"/site/nvidia_cutlass_dsl/dsl_packages/iket
mkdir -p .devsite && tar -cf - -C "$tmp/site" . | xz -T0 -9e > .devsite/site.tar.xz
ls -la .devsite/site.tar.xz
# pytest for the device image (which has none): .pyt/pytest.tar.xz, unpacked by the gpu_*.sh scripts.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d "$tmp/pyt_dl" pytest pluggy iniconfig packaging
mkdir -p "$tmp/pyt"; for w in "$tmp"/pyt_dl/*.whl; do unzip -q -o "$w" -d "$tmp/pyt"; done
find "$tmp/pyt" -name "*.pyi" -delete
mkdir -p .pyt && tar -cf - -C "$tmp/pyt" . | xz -T0 -9 > .pyt/pytest.tar.xz
ls -la .pyt/pytest.tar.xz
