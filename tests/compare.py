"""What tests compare a module with its reference by: SQNR, BF16 results of the same FP32 sums
taken in another order, and one forward + backward."""

from __future__ import annotations

import torch


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref`` in dB (float64)."""
    ref, out = ref.double(), out.double()
    return (20 * torch.log10(ref.norm() / (ref - out).norm())).item()


def assert_same_sums(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` and ``want`` are BF16 roundings of the same FP32 sums, which CPU BLAS may take
    in another order when only the number of rows differs (a group padded to its alignment):
    an element may then round to the neighbouring BF16 value, nothing more. Each element is
    within one BF16 ulp of ``want`` (or within 2^-20 of ``want``'s largest magnitude, where
    cancellation makes the ulp smaller than FP32's reordering error), and at most 1 % of the
    elements differ at all."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.detach().double(), want.detach().double()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w)[1] - 8)  # BF16: 8 significant bits
    floor = 2.0**-20 * float(w.abs().max()) if w.numel() else 0.0
    diff = (g - w).abs()
    bad = diff > torch.clamp(ulp, min=floor)
    assert not bad.any(), (f"{int(bad.sum())} elements beyond one BF16 ulp, worst "
                           f"{float(diff.max()):.3e}")
    assert int((diff > 0).sum()) <= max(1, got.numel() // 100), "more than 1 % differ"


def fwd_bwd(module, x: torch.Tensor, dy: torch.Tensor):
    """``module(x)`` and its backward with output gradient ``dy`` from gradients set to None:
    ``(y, dx, {parameter name: its .grad})``. The gradients are the parameters' own tensors, so
    a reduction run afterwards in place (expert parallelism, FSDP) shows in them; the next call
    leaves them alone (it starts from None)."""
    module.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    y = module(xa)
    (y.float() * dy.float()).sum().backward()
    return y.detach(), xa.grad, {n: p.grad for n, p in module.named_parameters()}
