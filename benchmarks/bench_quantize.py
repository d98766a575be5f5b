"""Bandwidth of the MXFP8 quantizer kernels vs a device-to-device copy and torch.compile of the
reference (the alternative a user has). Run on the device:

    source tools/device_env.sh && python -m benchmarks.bench_quantize --json $OUT/quant.json

Bytes per element (the fewest any quantizer must move): the input read once (2 B for bf16), and
per output 1 B of e4m3 plus 1/32 B of scale. Dual writes two outputs from one read. Effective
bandwidth = those bytes / time; "% of copy" compares it with a large copy measured in the same run
(read + write bytes, CUDA-graph replays).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.ceilings import copy_bandwidth
from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8 import reference as R

ACT_SHAPES = [(16384, 16384), (131072, 7168), (131072, 2048), (32768, 4096)]
WEIGHT_SHAPES = [(8, 4096, 7168), (128, 1536, 2048), (8, 28672, 4096)]
INPUT_SETS = 2  # rotate between input sets (every shape here is larger than L2 anyway)
# MoE grouped case: 8 groups of uneven sizes (not multiples of 16 -> colwise byte-store path).
GROUPED_SHAPE = (131072, 2048)
GROUP_WEIGHTS = [11, 17, 9, 13, 19, 7, 15, 9]


def grouped_offs(m: int) -> torch.Tensor:
    total = sum(GROUP_WEIGHTS)
    sizes = [m * w // total + 3 for w in GROUP_WEIGHTS[:-1]]
    sizes.append(m - sum(sizes))
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def model_bytes(numel: int, in_bytes: int, outputs: int) -> float:
    return numel * in_bytes + outputs * numel * (1 + 1 / 32)


def _time(fn, rot):
    def call():
        fn(rot.next())

    try:
        return bench_us(call)
    except Exception:  # noqa: BLE001 -- some compiled baselines refuse graph capture
        torch.cuda.synchronize()
        return bench_us(call, use_graph=False)


def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def cases(dtype):
    from moe_mxfp8.kernels import quantize_launch as Q

    ref = {
        "rowwise": _compiled(lambda x: R.quantize_rowwise_ref(x)),
        "colwise": _compiled(lambda x: R.quantize_colwise_ref(x)),
        "dual": _compiled(lambda x: R.quantize_dual_ref(x)),
        "weights_K": _compiled(lambda w: R.quantize_weights_ref(w, "K")),
        "weights_N": _compiled(lambda w: R.quantize_weights_ref(w, "N")),
    }
    kern = {
        "rowwise": lambda x: Q.quantize_rowwise(x, rounding="rceil", offs=None),
        "colwise": lambda x: Q.quantize_colwise(x, rounding="rceil", offs=None),
        "dual": lambda x: Q.quantize_dual(x, rounding="rceil", offs=None),
        "weights_K": lambda w: Q.quantize_weights(w, axis="K", rounding="rceil", block_rows=1),
        "weights_N": lambda w: Q.quantize_weights(w, axis="N", rounding="rceil", block_rows=1),
    }
    for shape in ACT_SHAPES:
        for mode in ("rowwise", "colwise", "dual"):
            yield mode, shape, kern[mode], ref[mode], 2 if mode == "dual" else 1
    for shape in WEIGHT_SHAPES:
        for mode in ("weights_K", "weights_N"):
            yield mode, shape, kern[mode], ref[mode], 1
    offs = grouped_offs(GROUPED_SHAPE[0])  # no torch.compile baseline for the grouped forms
    yield "row_offs", GROUPED_SHAPE, lambda x: Q.quantize_rowwise(x, offs=offs), None, 1
    yield "col_offs", GROUPED_SHAPE, lambda x: Q.quantize_colwise(x, offs=offs), None, 1
    yield "dual_offs", GROUPED_SHAPE, lambda x: Q.quantize_dual(x, offs=offs), None, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--only", default="", help="comma-separated modes")
    args = ap.parse_args()
    dtype = torch.bfloat16
    info = device_info()
    copy_tbps = copy_bandwidth()
    print(f"{info}  copy {copy_tbps:.3f} TB/s", flush=True)
    rows = []
    for mode, shape, kfn, rfn, outputs in cases(dtype):
        if args.only and mode not in args.only.split(","):
            continue
        numel = 1
        for d in shape:
            numel *= d
        sets = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(INPUT_SETS)]
        nbytes = model_bytes(numel, dtype.itemsize, outputs)
        us = _time(kfn, Rotating(sets))
        ref_us = None
        if not args.no_compile and rfn is not None:
            t0 = time.time()
            try:
                ref_us = _time(rfn, Rotating(sets))
            except Exception as e:  # noqa: BLE001 -- report, keep benchmarking the kernels
                print(f"torch.compile baseline failed for {mode} {shape}: {e!r}"[:300])
            print(f"  (baseline {mode} {shape}: {time.time() - t0:.0f} s incl. compile)")
        gbps = nbytes / (us * 1e-6) / 1e9
        row = {
            "mode": mode, "shape": list(shape), "dtype": str(dtype), "us": us, "GBps": gbps,
            "pct_copy": 100 * gbps / (copy_tbps * 1e3), "bytes": nbytes,
            "torch_compile_us": ref_us, "speedup": (ref_us / us) if ref_us else None,
        }
        rows.append(row)
        print(_fmt(row), flush=True)
        if args.json:  # rewritten after every row: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({**info, "copy_TBps": copy_tbps, "rows": rows}, f, indent=1)
        del sets
        torch.cuda.empty_cache()
    print(f"\n{info['gpu']}, {info['date']}, torch {info['torch']}; copy {copy_tbps:.3f} TB/s; "
          "bf16 input, rceil")
    print(f"{'mode':>10} {'shape':>20} {'us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'compile us':>10} {'speedup':>7}")
    for row in rows:
        print(_fmt(row))


def _fmt(r) -> str:
    shape = "x".join(str(d) for d in r["shape"])
    ref = f"{r['torch_compile_us']:10.1f}" if r["torch_compile_us"] else f"{'n/a':>10}"
    sp = f"{r['speedup']:7.2f}" if r["speedup"] else f"{'':>7}"
    return (f"{r['mode']:>10} {shape:>20} {r['us']:9.1f} {r['GBps']:7.0f} {r['pct_copy']:6.1f} "
            f"{ref} {sp}")


if __name__ == "__main__":
    main()
