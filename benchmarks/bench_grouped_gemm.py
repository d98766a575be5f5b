"""Grouped MXFP8 GEMM (sm90 kernel, both scale modes) vs torch._grouped_mm bf16 and
torch._scaled_grouped_mm fp8 rowwise, for the MoE gate+up GEMM (N = 2f) of three models.

    python -m benchmarks.bench_grouped_gemm [--json out.json] [--shapes dsv3,qwen3,mixtral]

GEMMs per shape (E experts, T routed rows, hidden d, expert width f):
  fprop  Y  (T, 2f) = X (T, d) . W_g^T,  W (E, 2f, d)
  dgrad  dX (T, d)  = dY (T, 2f) . W_g
  wgrad  dW (E, 2f, d) = dY_g^T . X_g
FLOPs = 2 * T * 2f * d each. Times: CUDA-graph replays (benchmarks.timing.bench_us), two
rotating input sets. Inputs are random; group sizes are random around T/E (+-25%).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.timing import Rotating, bench_us, device_info
from moe_mxfp8 import reference as R

SHAPES = {  # name: (E, T, d, f)
    "dsv3": (8, 131072, 7168, 2048),
    "qwen3": (128, 131072, 2048, 768),
    "mixtral": (8, 32768, 4096, 14336),
}
# wgrad16: wgrad with group sizes that are multiples of 16 tokens (every group start is 16-byte
# aligned, so the kernel's TMA path runs; other starts take its slow copy path)
OPS = ("fprop", "dgrad", "wgrad", "wgrad16")


def group_sizes(e: int, t: int, seed: int = 0, align: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    w = 0.75 + 0.5 * torch.rand(e, generator=g)
    sizes = (w / w.sum() * t / align).floor().to(torch.int64) * align
    sizes[-1] += t - int(sizes.sum())
    return sizes.tolist()


def _offs(sizes, dev):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _fp8_rowwise(x: torch.Tensor):
    """Per-row fp32 scale + e4m3 (baseline inputs only)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    s = amax / 448.0
    return (x.float() / s).to(torch.float8_e4m3fn), s.squeeze(-1)


def bench_op(op: str, e: int, t: int, d: int, f: int, dev="cuda") -> dict:
    from moe_mxfp8.kernels import grouped_gemm_sm90 as K

    n2 = 2 * f
    sizes = group_sizes(e, t, align=16 if op == "wgrad16" else 1)
    offs = _offs(sizes, dev)
    flops = 2.0 * t * n2 * d
    res = {"op": op, "E": e, "T": t, "d": d, "f": f, "flops": flops}
    torch.manual_seed(1)
    w = torch.randn(e, n2, d, device=dev, dtype=torch.bfloat16) * 0.02
    if op == "fprop":
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        a = R.quantize_rowwise_ref(x, offs=offs)
        bs = {br: R.quantize_weights_ref(w, axis="K", block_rows=br) for br in (1, 32)}
        fn = K.grouped_mm_m
        bf16 = (x, w.transpose(-2, -1))
        ref_pair = (a.dequantize(torch.bfloat16), bs[1].dequantize(torch.bfloat16)
                    .transpose(-2, -1))
    elif op == "dgrad":
        dy = torch.randn(t, n2, device=dev, dtype=torch.bfloat16)
        a = R.quantize_rowwise_ref(dy, offs=offs)
        bs = {br: R.quantize_weights_ref(w, axis="N", block_rows=br) for br in (1, 32)}
        fn = K.grouped_mm_m
        bf16 = (dy, w)
        ref_pair = (a.dequantize(torch.bfloat16), bs[1].dequantize(torch.bfloat16)
                    .transpose(-2, -1))
    elif SYNTHETIC_K or op == "wgrad":
        # unaligned group starts: torch._grouped_mm on T-contiguous operands asserts (it needs
        # 16-byte aligned groups), so no at-scale check here; the tests cover correctness
        # random fp8 bytes and random (finite) scale bytes in the packed layout: timing only
        dy = torch.randn(t, n2, device=dev, dtype=torch.bfloat16)
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        a = _synthetic_k(dy.t().contiguous(), offs)
        bs = {1: _synthetic_k(x.t().contiguous(), offs)}
        fn = K.grouped_mm_k
        bf16 = (dy.t(), x)
        ref_pair = None
    else:
        dy = torch.randn(t, n2, device=dev, dtype=torch.bfloat16)
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        a = R.quantize_colwise_ref(dy, offs=offs)
        bs = {1: R.quantize_colwise_ref(x, offs=offs)}
        fn = K.grouped_mm_k
        bf16 = (dy.t(), x)
        ref_pair = (a.dequantize(torch.bfloat16), bs[1].dequantize(torch.bfloat16).t())
    del w

    # correctness at scale (1x32 mode) vs a bf16 grouped GEMM of the dequantized operands
    out = fn(a, bs[1], offs, torch.bfloat16)
    torch.cuda.synchronize()
    if ref_pair is not None:
        ref = torch._grouped_mm(ref_pair[0], ref_pair[1], offs=offs)
        res["rel_err_vs_dequant_bf16"] = _rel(out, ref)
        del ref
    del out, ref_pair

    for br, b in bs.items():
        b2 = type(b)(b.data.clone(), b.scale.clone(), b.scale_layout, b.offs, b.group_axis,
                     b.block_rows)
        rot = Rotating([(a, b), (a, b2)])

        def run(fn=fn, rot=rot):
            aa, bb = rot.next()
            return fn(aa, bb, offs, torch.bfloat16)

        us = bench_us(run)
        res[f"mx_{br}x32_us"] = us
        del b2, rot

    rot = Rotating([bf16, (bf16[0].clone(), bf16[1].clone())])
    try:
        res["bf16_us"] = bench_us(lambda: torch._grouped_mm(*rot.next(), offs=offs))
    except Exception as err:  # noqa: BLE001
        res["bf16_err"] = repr(err)[:200]
    del rot

    try:
        fp8 = _scaled_args(op, bf16)
        rot = Rotating([fp8])
        torch._scaled_grouped_mm(*fp8, offs=offs, out_dtype=torch.bfloat16)
        res["fp8_rowwise_us"] = bench_us(
            lambda: torch._scaled_grouped_mm(*rot.next(), offs=offs, out_dtype=torch.bfloat16))
    except Exception as err:  # noqa: BLE001
        res["fp8_err"] = repr(err)[:200]
    torch.cuda.empty_cache()
    return res


SYNTHETIC_K = False


def _synthetic_k(xt: torch.Tensor, offs: torch.Tensor):
    from moe_mxfp8 import layout as L
    from moe_mxfp8.mx_tensor import MXFP8Tensor

    rows, m = xt.shape
    nbytes = L.grouped_k_scale_bytes(rows, m, offs.numel())
    scale = torch.randint(120, 134, (nbytes,), device=xt.device, dtype=torch.uint8)
    return MXFP8Tensor(xt.to(torch.float8_e4m3fn), scale, "packed", offs, "k")


def _scaled_args(op, bf16):
    """(mat_a, mat_b, scale_a, scale_b) for torch._scaled_grouped_mm, rowwise fp8."""
    a, b = bf16
    if op in ("fprop", "dgrad"):
        # a (T, K) row-major; b (E, K, N) must be column-major (i.e. (E, N, K) contiguous)
        qa, sa = _fp8_rowwise(a.contiguous())
        bt = b.transpose(-2, -1).contiguous()  # (E, N, K)
        qb, sb = _fp8_rowwise(bt)
        return qa, qb.transpose(-2, -1), sa, sb
    # wgrad: a = dY^T (N, T) row-major, b = X (T, K) column-major
    qa, sa = _fp8_rowwise(a.contiguous())
    qbt, sb = _fp8_rowwise(b.t().contiguous())  # (K, T)
    e = None  # scales per group for 2d-2d: (E * N,), (E * K,) -- rowwise over each group
    del e
    return qa, qbt.t(), sa, sb


def debug_k(sizes: list[int], n=256, k=256):
    """One small K-grouped problem vs the reference (device triage, one process per case)."""
    from moe_mxfp8.kernels import grouped_gemm_sm90 as K

    offs = _offs(sizes, "cuda")
    m = sum(sizes)
    a = R.quantize_colwise_ref(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), offs=offs)
    b = R.quantize_colwise_ref(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), offs=offs)
    out = K.grouped_mm_k(a, b, offs, torch.float32)
    torch.cuda.synchronize()
    ref = R.grouped_mm(a, b, offs, torch.float32)
    per_group = [_rel(out[g], ref[g]) if sizes[g] else float(out[g].abs().max())
                 for g in range(len(sizes))]
    print("debug_k", sizes, "rel", _rel(out, ref), "per group", per_group, flush=True)


def profile(op: str, shape: str, block_rows: int, rows: int):
    """Prepare one problem, then run the kernel once between cudaProfilerStart/Stop (for ncu
    --profile-from-start off)."""
    from moe_mxfp8.kernels import grouped_gemm_sm90 as K

    e, _, d, f = SHAPES[shape]
    sizes = group_sizes(e, rows, align=16 if op == "wgrad16" else 1)
    offs = _offs(sizes, "cuda")
    n2 = 2 * f
    if op in ("wgrad", "wgrad16"):
        a = R.quantize_colwise_ref(torch.randn(rows, n2, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        b = R.quantize_colwise_ref(torch.randn(rows, d, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        fn = K.grouped_mm_k
    else:
        kk, nn = (d, n2) if op == "fprop" else (n2, d)
        a = R.quantize_rowwise_ref(torch.randn(rows, kk, device="cuda", dtype=torch.bfloat16),
                                   offs=offs)
        w = torch.randn(e, nn, kk, device="cuda", dtype=torch.bfloat16) * 0.02
        b = R.quantize_weights_ref(w, axis="K", block_rows=block_rows)
        fn = K.grouped_mm_m
    fn(a, b, offs, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(a, b, offs, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic-k", action="store_true",
                    help="wgrad operands from random bytes (no reference quantizer)")
    ap.add_argument("--debug-k", default=None, help="comma-separated group sizes")
    ap.add_argument("--profile", default=None, help="op:shape:block_rows:rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    global SYNTHETIC_K
    SYNTHETIC_K = args.synthetic_k
    if args.debug_k:
        debug_k([int(v) for v in args.debug_k.split(",")])
        return
    if args.profile:
        op, shape, br, rows = args.profile.split(":")
        profile(op, shape, int(br), int(rows))
        return
    info = device_info()
    rows = []
    for name in args.shapes.split(","):
        e, t, d, f = SHAPES[name]
        for op in args.ops.split(","):
            try:
                r = bench_op(op, e, t, d, f)
            except Exception as err:  # noqa: BLE001
                print(f"{name} {op} FAILED: {err!r}"[:300], flush=True)
                continue
            r["shape"] = name
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{info['gpu']} {info['date']} torch {info['torch']}")
    hdr = ("shape", "op", "mx1x32 us", "TF/s", "mx32x32 us", "TF/s", "bf16 us", "TF/s",
           "fp8row us", "TF/s", "x bf16 (1x32)", "x bf16 (32x32)", "relerr")
    print(" | ".join(hdr))
    for r in rows:
        def tf(key, r=r):
            return f"{r['flops'] / r[key] / 1e6:.0f}" if key in r else "-"

        def us(key, r=r):
            return f"{r[key]:.0f}" if key in r else "-"

        sp1 = f"{r['bf16_us'] / r['mx_1x32_us']:.2f}" if "bf16_us" in r else "-"
        sp32 = (f"{r['bf16_us'] / r['mx_32x32_us']:.2f}"
                if "bf16_us" in r and "mx_32x32_us" in r else "-")
        print(" | ".join([r["shape"], r["op"], us("mx_1x32_us"), tf("mx_1x32_us"),
                          us("mx_32x32_us"), tf("mx_32x32_us"), us("bf16_us"), tf("bf16_us"),
                          us("fp8_rowwise_us"), tf("fp8_rowwise_us"), sp1, sp32,
                          f"{r.get('rel_err_vs_dequant_bf16', float('nan')):.1e}"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": info, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
