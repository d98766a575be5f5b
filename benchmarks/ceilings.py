"""Measure the device ceilings every benchmark compares against: copy bandwidth (bytes read +
written), dense bf16 and fp8 matmul rates, on random data. Run on the device:

    source tools/device_env.sh && python benchmarks/ceilings.py --json $OUT/ceilings.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.timing import bench_us, device_info


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e12  # TB/s, read + write


def matmul_tflops(dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        bt = b.t().contiguous().t()
        us = bench_us(lambda: torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16))
    else:
        us = bench_us(lambda: a @ b)
    return 2 * n**3 / (us * 1e-6) / 1e12


def measure() -> dict:
    return {
        **device_info(),
        "copy_TBps": copy_bandwidth(),
        "bf16_matmul_TFLOPs": matmul_tflops(torch.bfloat16),
        "fp8_matmul_TFLOPs": matmul_tflops(torch.float8_e4m3fn),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    res = measure()
    for k, v in res.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
