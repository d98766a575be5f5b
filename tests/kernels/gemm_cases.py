"""Shared case tables and checks of the grouped GEMM GPU tests (test_grouped_gemm*.py)."""

from __future__ import annotations

import torch

from moe_mxfp8 import reference as R

BF16_TOL = 5e-3
FP32_TOL = 1e-3

GROUPINGS = {
    "E1": [384],
    "E8_edge": [0, 1, 31, 129, 0, 200, 7, 0],  # empty / 1 / 31 / 129 / unbalanced
    "E8_unbal": [1000, 3, 0, 0, 17, 256, 64, 8],
    # multiples of 16 (wgrad: every group start 16-byte aligned -> TMA path + smem zeroing)
    "E8_a16": [0, 48, 16, 256, 0, 112, 32, 16],
}


def _e128_sizes(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 40, (128,), generator=g)
    sizes[::7] = 0
    sizes[5] = 129
    return sizes.tolist()


def _sizes(name: str, seed: int) -> list[int]:
    sizes = _e128_sizes(seed) if name == "E128" else list(GROUPINGS[name])
    # wgrad needs M % 16 == 0 (TMA row stride); pad the last group
    pad = (-sum(sizes)) % 16
    sizes[-1] += pad
    return sizes


def _wgrad_operands(m: int, n: int, k: int, offs: torch.Tensor):
    """Fresh random dY (M, N) and X (M, K) quantized along the tokens per group: a (N, M),
    b (K, M), on offs' device."""
    dy = torch.randn(m, n, device=offs.device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=offs.device, dtype=torch.bfloat16)
    return R.quantize_colwise_ref(dy, offs=offs), R.quantize_colwise_ref(x, offs=offs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _check(out, ref, out_dtype):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output elements"
    tol = BF16_TOL if out_dtype == torch.bfloat16 else FP32_TOL
    err = _rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol}"


def _check_wgrad(out, ref, sizes, out_dtype):
    """A K-grouped GEMM's ``out (E, N, K)``: empty groups exactly zero, then `_check`."""
    for g, s in enumerate(sizes):
        if s == 0:
            assert torch.count_nonzero(out[g]) == 0, f"empty group {g} not zero"
    _check(out, ref, out_dtype)


def _offs(sizes, dev):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)


def fprop_case(offs: torch.Tensor, n: int, k: int, block_rows: int):
    """Fresh random fprop operands on offs' device -- X (M, K) rowwise, W (E, N, K) with
    ``block_rows`` weight blocks -- and a NaN-poisoned bf16 output ``(M, N)``."""
    m, dev = int(offs[-1]), offs.device
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(offs.numel(), n, k, device=dev, dtype=torch.bfloat16) * 0.05
    a = R.quantize_rowwise_ref(x, offs=offs)
    b = R.quantize_weights_ref(w, axis="K", block_rows=block_rows)
    return a, b, torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
