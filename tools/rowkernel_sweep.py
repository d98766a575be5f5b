"""Time the 1x128 row-block data-path kernels alone at other (rows per step, warps[, registers
per thread]) settings than `kernels.datapath_triton`'s tables (`CHUNKED_ROWS`, `WHOLE_ROWS`)
(device; prints ms and GB/s over the bytes each must move).

    python tools/rowkernel_sweep.py [--shapes mixtral,dsv3] [--kernels swiglu,dispatch,combine]
"""

from __future__ import annotations

import argparse

import torch
import triton
from moe_mxfp8.kernels import datapath_triton as K

from moe_mxfp8 import datapath as DP

SHAPES = {"mixtral": (16384, 2, 8, 4096, 14336), "dsv3": (65536, 2, 8, 7168, 2048)}  # T k E D H
SETTINGS = {"swiglu": ((128, 16), (128, 8), (128, 8, 128), (128, 8, 152), (128, 8, 168),
                       (128, 16, 96)),
            "dispatch": ((32, 4), (32, 8), (64, 4), (64, 8), (128, 8)),
            "combine": ((32, 4), (32, 8), (64, 4), (64, 8), (128, 8))}  # rows, warps[, regs]


def sweep(name: str, kinds: list[str]) -> None:
    """Every setting of ``kinds`` at shape ``name``, the shipped setting restored after."""
    t, k, e, d, hh = SHAPES[name]
    bf = torch.bfloat16
    ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k]
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    _, src, offs = DP.route_layout(ids, counts, 16)
    m = src.numel()
    tbl = DP.block_table(offs, m, 128)
    x, dout = (torch.randn(t, d, device="cuda", dtype=bf) for _ in range(2))
    y = torch.randn(m, d, device="cuda", dtype=bf)
    w = torch.rand(t, k, device="cuda")
    part = torch.empty(-(-d // K.COL_TILE), m, device="cuda")
    h = torch.randn(m, 2 * hh, device="cuda", dtype=bf) * 3
    da = torch.randn(m, hh, device="cuda", dtype=bf)
    o_d = DP._outputs(m, d, e, True, True, False, x)
    o_h = DP._outputs(m, hh, e, True, True, False, h)
    o_2h = DP._outputs(m, 2 * hh, e, True, True, False, h)
    cases = {
        "swiglu": [
            (K.WHOLE_ROWS, "swiglu_fwd",
             lambda: K.swiglu_fwd(h, src, tbl, o_h, 128, True), m * hh * 6),
            (K.WHOLE_ROWS, "swiglu_bwd",
             lambda: K.swiglu_bwd(da, h, src, tbl, o_2h, 128, True), m * hh * 10)],
        "dispatch": [(K.WHOLE_ROWS, "dispatch",
                      lambda: K.dispatch(x, src, tbl, k, o_d, 128, True), m * d * 4)],
        "combine": [(K.CHUNKED_ROWS, "combine_bwd",
                     lambda: K.combine_bwd(dout, y, w, src, tbl, k, o_d, part, 128, True),
                     m * d * 6)],
    }
    for kind in kinds:
        for table, kern, fn, nbytes in cases[kind]:
            shipped = table[128]
            for setting in SETTINGS[kind]:
                table[128] = setting
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                rb, warps, *regs = setting
                print(f"{name:8s} {kern:12s} rows {rb:4d} warps {warps:3d} maxnreg "
                      f"{regs[0] if regs else '-':>3} {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s",
                      flush=True)
            table[128] = shipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,dsv3")
    ap.add_argument("--kernels", default="swiglu,dispatch,combine")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        sweep(name, args.kernels.split(","))


if __name__ == "__main__":
    main()
