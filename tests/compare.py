"""What tests compare a module with its reference by: SQNR and one forward + backward."""

from __future__ import annotations

import torch


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref`` in dB (float64)."""
    ref, out = ref.double(), out.double()
    return (20 * torch.log10(ref.norm() / (ref - out).norm())).item()


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
