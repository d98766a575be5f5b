"""The quantizer kernels of both recipes back to back: 1x32 (exact MXFP8) against 1x128 (one
scale per 128 elements, 128x128 weight tiles), at the dsv3 layer's shapes, next to a
device-to-device copy measured in the same process (device):

    python -m benchmarks.bench_quantize_recipes [--json FILE]

Both recipes are the same kernel class (``act_block`` 32 / 128, weights ``block_rows`` 1 / 128).
Bytes per element as in `benchmarks.bench_quantize` (2 B read, 1 + 1/32 B per output); "offs":
8 uneven groups whose sizes are no multiples of 16 (`bench_quantize.grouped_offs`).
"""

from __future__ import annotations

import argparse
import json

import torch
from moe_mxfp8.kernels import quantize as Q

from benchmarks.bench_quantize import grouped_offs, model_bytes
from benchmarks.ceilings import copy_bandwidth
from benchmarks.timing import Rotating, bench_us, device_info

T, D, H, E = 131072, 7168, 2048, 8  # dsv3: sorted rows, dim, hidden, experts
RECIPES = {"1x32": (32, 1), "1x128": (128, 128)}  # activation block, weight block rows


def cases():
    """(name, shape, outputs, {recipe: fn})."""
    for shape, what in (((T, D), "x / dy (T, dim)"), ((T, H), "h (T, hidden)")):
        offs = grouped_offs(shape[0])
        for op, n_out, grouped in (("rowwise", 1, False), ("dual", 2, False),
                                   ("rowwise", 1, True), ("colwise", 1, True),
                                   ("dual", 2, True)):
            fn = getattr(Q, f"quantize_{op}")
            o = offs if grouped else None
            yield (f"{op}{' offs' if grouped else ''} {what}", shape, n_out,
                   {r: (lambda x, fn=fn, o=o, b=b: fn(x, offs=o, act_block=b))
                    for r, (b, _) in RECIPES.items()})
    for shape in ((E, 2 * H, D), (E, D, H)):
        for axis in ("K", "N"):
            yield (f"weights {axis} {'x'.join(map(str, shape))}", shape, 1,
                   {r: (lambda w, axis=axis, br=br: Q.quantize_weights(w, axis=axis,
                                                                      block_rows=br))
                    for r, (_, br) in RECIPES.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    info = device_info()
    copy = copy_bandwidth()
    print(f"{info}  copy {copy:.3f} TB/s", flush=True)
    rows = []
    for name, shape, n_out, fns in cases():
        sets = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        numel = sets[0].numel()
        nbytes = model_bytes(numel, 2, n_out)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "copy_TBps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
