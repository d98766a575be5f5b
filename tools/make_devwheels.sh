#!/usr/bin/env bash
# Build .devwheels/torchao-<version>.tar.xz (git-ignored) for tools/gpu_bench_gemm_peers.sh:
# torchao's wheel installed with --no-deps and xz-compressed WITHOUT its CUDA extensions
# (_C*.so, ~13 MiB, built for another torch; the FP8-rowwise MoE training op is Python plus
# Triton and never loads them), ~0.7 MiB, so that it fits beside .devsite under the device
# tool's 64 MiB carry limit (the whole wheel, 3.4 MB, does not). The device script unpacks it
# and sets TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1.
set -euo pipefail
VERSION="${1:-0.18.0}"
root="$(git rev-parse --show-toplevel)"; cd "$root"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/dl" "torchao==$VERSION"
python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/dl/torchao-*.whl
find "$tmp/site" -name "_C*.so" -delete
rm -rf "$tmp/site/bin" "$tmp/site/test"  # its own tests would shadow the stdlib `test` package
mkdir -p .devwheels && tar -cf - -C "$tmp/site" . | xz -T0 -9e > ".devwheels/torchao-$VERSION.tar.xz"
ls -la ".devwheels/torchao-$VERSION.tar.xz"
