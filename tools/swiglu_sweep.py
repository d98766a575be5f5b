"""Time the 1x128 SwiGLU data-path kernels alone at other (rows per step, warps) settings than
`kernels.datapath_triton.WHOLE_ROWS` (device; prints ms and GB/s over the bytes each moves).

    python tools/swiglu_sweep.py [--shapes mixtral,dsv3]
"""

from __future__ import annotations

import argparse

import torch
import triton
from moe_mxfp8.kernels import datapath_triton as K

from moe_mxfp8 import datapath as DP

SHAPES = {"mixtral": (16384, 2, 8, 14336), "dsv3": (65536, 2, 8, 2048)}  # tokens, top-k, E, H
SETTINGS = ((128, 16), (128, 32), (128, 8), (64, 8), (64, 16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,dsv3")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        t, k, e, hh = SHAPES[name]
        ids = torch.rand(t, e, device="cuda").argsort(1)[:, :k]
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        _, src, offs = DP.route_layout(ids, counts, 16)
        m = src.numel()
        h = torch.randn(m, 2 * hh, device="cuda", dtype=torch.bfloat16) * 3
        da = torch.randn(m, hh, device="cuda", dtype=torch.bfloat16)
        tbl = DP.block_table(offs, m, 128)
        o_h = DP._outputs(m, hh, e, True, True, False, h)
        o_2h = DP._outputs(m, 2 * hh, e, True, True, False, h)
        for rb, warps in SETTINGS:
            K.WHOLE_ROWS[128] = (rb, warps)
            for kern, fn, nbytes in (
                    ("fwd", lambda: K.swiglu_fwd(h, src, tbl, o_h, 128, True), m * hh * 6),
                    ("bwd", lambda: K.swiglu_bwd(da, h, src, tbl, o_2h, 128, True),
                     m * hh * 10)):
                ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                print(f"{name:8s} {kern} rows {rb:4d} warps {warps:3d} {ms:7.3f} ms "
                      f"{nbytes / ms / 1e6:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
