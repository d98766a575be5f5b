#!/usr/bin/env bash
# One device call for the quantizer kernels (1x128 recipe, issue 16): the GPU tests of every
# quantizer (parallel pytest processes, each with its own compile cache and time limit), then a
# short timing of the 1x128 vs 1x32 kernels at the dsv3 shapes against a device copy measured
# in the same process.
#   run  carry=[".devsite"]  command: bash tools/gpu_1x128_quant.sh
# Env: SKIP_TESTS=1, SKIP_BENCH=1, TEST_TIMEOUT (s, per process), BENCH_TIMEOUT (s).
set -uo pipefail
source tools/device_prelude.sh name,driver_version,clocks.max.sm

KQ=tests/kernels/test_quantize_kernels.py
run_group() {  # name, then pytest arguments
  local name=$1; shift
  timeout "${TEST_TIMEOUT:-100}" python -m pytest -q -m gpu -p no:cacheprovider -rf \
    "$@" > "$OUT/test_$name.txt" 2>&1
  echo "$name rc=$?: $(tail -1 "$OUT/test_$name.txt")" >> "$OUT/tests_summary.txt"
}

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests (parallel groups)"
  : > "$OUT/tests_summary.txt"
  run_group act128 $KQ -k "test_activation_modes_bit_exact and 1x128" &
  run_group grouped128 $KQ -k "test_grouped_bit_exact and 1x128" &
  run_group weights $KQ -k "test_weights_bit_exact and (br128 or br32) or partial_tiles" &
  run_group misc $KQ tests/test_1x128_recipe.py \
    -k "public_api or more_than_2_31 or gpu_1x128_kernels" &
  run_group domain32 tests/test_domain.py -k "not 1x128" &
  run_group domain128 tests/test_domain.py -k "1x128" &
  run_group act32 $KQ -k "(test_activation_modes_bit_exact or test_grouped_bit_exact) and 1x32 and rceil" &
  run_group weights1 $KQ -k "test_weights_bit_exact and not br128 and not br32 and rceil" &
  wait
  for f in "$OUT"/test_*.txt; do
    grep -E "^(FAILED|ERROR)" "$f" | head -4 | cut -c1-300
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== timing: 1x128 vs 1x32 quantizer kernels, dsv3 shapes"
  timeout "${BENCH_TIMEOUT:-60}" python - <<'EOF' 2>&1 | grep -v "Warn\|range_constexpr" \
    | tee "$OUT/bench.txt"
import json
import os

import torch

from benchmarks.ceilings import copy_bandwidth
from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8.kernels import quantize as Q

T, D, H, E = 131072, 7168, 2048, 8  # dsv3: tokens (sorted rows), dim, hidden, experts
info = device_info()
copy = copy_bandwidth()
print(f"{info}  copy {copy:.3f} TB/s", flush=True)


def offs_for(m):  # 8 uneven groups, sizes not multiples of 16 (bench_quantize's grouped case)
    w = [11, 17, 9, 13, 19, 7, 15, 9]
    sizes = [m * x // sum(w) + 3 for x in w[:-1]]
    sizes.append(m - sum(sizes))
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def act(op, offs, blk):
    fn = getattr(Q, f"quantize_{op}")
    return lambda x: fn(x, offs=offs, act_block=blk)


def wq(axis, br):
    return lambda w: Q.quantize_weights(w, axis=axis, block_rows=br)


cases = []  # (name, shape, outputs, {recipe: fn})
for shape, name in (((T, D), "x / dy (T, dim)"), ((T, H), "h (T, hidden)")):
    offs = offs_for(shape[0])
    for op, n_out in (("rowwise", 1), ("dual", 2)):
        cases.append((f"{op} {name}", shape, n_out,
                      {r: act(op, None, b) for r, b in (("1x32", 32), ("1x128", 128))}))
    for op, n_out in (("rowwise", 1), ("colwise", 1), ("dual", 2)):
        cases.append((f"{op} offs {name}", shape, n_out,
                      {r: act(op, offs, b) for r, b in (("1x32", 32), ("1x128", 128))}))
for shape in ((E, 2 * H, D), (E, D, H)):
    for axis in ("K", "N"):
        cases.append((f"weights {axis} {'x'.join(map(str, shape))}", shape, 1,
                      {r: wq(axis, b) for r, b in (("1x32", 1), ("1x128", 128))}))
rows = []
for name, shape, n_out, fns in cases:
    sets = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    numel = sets[0].numel()
    nbytes = numel * 2 + n_out * numel * (1 + 1 / 32)
    res = {}
    for recipe, fn in fns.items():
        rot = Rotating(sets)
        us = bench_us(lambda fn=fn, rot=rot: fn(rot.next()))
        res[recipe] = (us, nbytes / (us * 1e-6) / 1e9)
    rows.append((name, res))
    r32, r128 = res["1x32"], res["1x128"]
    print(f"{name:34s} 1x32 {r32[0]:8.1f} us {r32[1]:5.0f} GB/s {r32[1] / copy / 10:5.1f}%  "
          f"1x128 {r128[0]:8.1f} us {r128[1]:5.0f} GB/s {r128[1] / copy / 10:5.1f}%  "
          f"1x128/1x32 time {r128[0] / r32[0]:.3f}", flush=True)
    del sets
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "bench.json"), "w") as f:
    json.dump({**info, "copy_TBps": copy, "rows": rows}, f, indent=1)
EOF
fi
echo "== summary"
cat "$OUT/tests_summary.txt" 2>/dev/null
grep "1x128/1x32" "$OUT/bench.txt" 2>/dev/null
