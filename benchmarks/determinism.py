"""Which GPU op makes a BF16 training run not reproduce bit for bit? (device probe)

Runs each candidate twice on the same inputs and prints whether the two results are bitwise
equal: ``torch._grouped_mm`` (the BF16 twin's expert GEMMs: fprop, dgrad, wgrad) at the parity
preset's routed-row count, and one forward+backward of ``MXFP8MoE`` in each precision and
recipe at that shape. ``--deterministic`` turns PyTorch's deterministic algorithms on first.

    python -m benchmarks.determinism [--deterministic]
"""

from __future__ import annotations

import argparse
import os

import torch

from moe_mxfp8 import MXFP8MoE


def twice(fn):
    a = fn()
    torch.cuda.synchronize()
    b = fn()
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--tokens", type=int, default=16 * 1024)  # the GPU parity preset's batch
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    args = p.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    m, e, d, h = args.tokens * args.top_k, args.experts, args.dim, args.hidden
    counts = torch.distributions.Multinomial(m, torch.rand(e)).sample().long()
    offs = torch.cumsum(counts, 0).to(dev, torch.int32)
    x = torch.randn(m, d, device=dev, dtype=bf)
    w = torch.randn(e, 2 * h, d, device=dev, dtype=bf) * d**-0.5
    g = torch.randn(m, 2 * h, device=dev, dtype=bf)
    rows = [
        ("torch._grouped_mm fprop", lambda: [torch._grouped_mm(x, w.transpose(-2, -1), offs)]),
        ("torch._grouped_mm dgrad", lambda: [torch._grouped_mm(g, w, offs)]),
        ("torch._grouped_mm wgrad", lambda: [torch._grouped_mm(g.t(), x, offs=offs)]),
    ]
    xt = torch.randn(args.tokens, d, device=dev, dtype=bf)
    dy = torch.randn(args.tokens, d, device=dev, dtype=bf)
    for precision, sb in (("bf16", "1x32"), ("mxfp8", "1x32"), ("mxfp8", "1x128")):
        torch.manual_seed(1)
        layer = MXFP8MoE(d, h, e, args.top_k, precision=precision, scale_blocks=sb, device=dev)

        def step(layer=layer):
            layer.zero_grad(set_to_none=True)
            xa = xt.clone().requires_grad_()
            layer(xa).backward(dy)
            layer.aux_loss = None
            return [xa.grad] + [q.grad for q in layer.parameters()]

        rows.append((f"MXFP8MoE {precision} {sb} fwd+bwd", step))
    print(f"deterministic algorithms: {args.deterministic}; {m} routed rows, E={e}, D={d}, H={h}")
    for name, fn in rows:
        print(f"{name:36s} bitwise equal twice: {twice(fn)}", flush=True)


if __name__ == "__main__":
    main()
