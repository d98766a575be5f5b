"""One grouped-GEMM launch of the Hopper kernel for Nsight Compute (stall reasons, throughput).

    ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:GroupedGemm \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python tools/ncu_gemm.py fprop|dgrad|wgrad [--tokens T] [--tuning '{"tile_n": 128}']
            [--act-rows 1|128]

dsv3's expert shapes (E = 8, d = 7168, f = 2048; fewer tokens than the benchmark by default),
operands from the reference quantizers, the 1x128 recipe; the kernel runs twice (the first
launch compiles or loads it), so ``--launch-skip 1`` profiles a warm launch. ``--act-rows``: the
wgrad's activation operand X^T in 128 x 128 tiles (128, the layer's 1x128 recipe) or with one
scale per feature row (1: the kernel before the tiles, one FMUL more per element).
"""

from __future__ import annotations

import argparse
import json

import torch
from moe_mxfp8.kernels.grouped_gemm import launcher
from moe_mxfp8.kernels.grouped_gemm.sm90 import GroupedGemmSm90

from moe_mxfp8 import reference as R


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=("fprop", "dgrad", "wgrad"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--tuning", default=None, help="JSON dict of GroupedGemmSm90Config fields")
    ap.add_argument("--act-rows", type=int, choices=(1, 128), default=128,
                    help="wgrad: block rows of the activation operand's scales")
    args = ap.parse_args()
    e, t, d, f = 8, args.tokens, 7168, 2048
    dev = "cuda"
    offs = (torch.arange(1, e + 1, device=dev) * (t // e)).to(torch.int32)
    tuning = json.loads(args.tuning) if args.tuning else None
    if args.op == "wgrad":  # dW = dY^T X: (2f, d) per expert, K-grouped over the tokens
        a = R.quantize_colwise_ref(torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16),
                                   offs=offs, scale_blocks="1x128")
        b = R.quantize_colwise_ref(torch.randn(t, d, device=dev, dtype=torch.bfloat16),
                                   offs=offs, scale_blocks="1x128", block_rows=args.act_rows)

        def run():
            return launcher.grouped_mm(GroupedGemmSm90, "k", a, b, offs, torch.bfloat16,
                                       scale_blocks="1x128", aligned_groups=True, tuning=tuning)
    else:  # fprop X W^T (N = 2f, K = d); dgrad dY W (N = d, K = 2f)
        k_dim, n_dim, axis = (d, 2 * f, "K") if args.op == "fprop" else (2 * f, d, "N")
        x = torch.randn(t, k_dim, device=dev, dtype=torch.bfloat16)
        shape = (e, n_dim, k_dim) if args.op == "fprop" else (e, k_dim, n_dim)
        w = torch.randn(*shape, device=dev, dtype=torch.bfloat16) * 0.05
        a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
        b = R.quantize_weights_ref(w, axis=axis, block_rows=128)

        def run():
            return launcher.grouped_mm(GroupedGemmSm90, "m", a, b, offs, torch.bfloat16,
                                       tuning=tuning)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    print("ok", args.op, t, "act_rows", args.act_rows if args.op == "wgrad" else "-")


if __name__ == "__main__":
    main()
