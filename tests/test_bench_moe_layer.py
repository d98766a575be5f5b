"""The layer benchmark's pure parts (CPU): its determinism check tells a bit-reproducible
forward + backward from one whose output or gradients move between two runs."""

from __future__ import annotations

import torch

from benchmarks import bench_moe_layer as B
from moe_mxfp8 import MXFP8MoE


class _NoisyGrad(torch.autograd.Function):
    """The identity forward; backward adds fresh noise to the gradient."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g + torch.rand_like(g)


class _Noisy(torch.nn.Module):
    """A linear layer whose output (``where="out"``) or, with the same output, weight gradient
    (``where="grad"``) picks up fresh noise each run: what the check must flag."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.where = where

    def invalidate_weight_cache(self) -> None:
        pass

    def forward(self, x):
        if self.where == "out":
            y = self.lin(x)
            return y + 1e-3 * torch.rand_like(y)
        return torch.nn.functional.linear(x, _NoisyGrad.apply(self.lin.weight), self.lin.bias)


def test_bitwise_twice_passes_the_layer_and_flags_noise(gen):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    for precision in ("bf16", "mxfp8"):
        layer = MXFP8MoE(64, 96, 4, 2, precision=precision, backend="reference")
        x = torch.randn(24, 64, generator=gen).to(torch.bfloat16)
        dy = torch.randn(24, 64, generator=gen).to(torch.bfloat16)
        assert B.bitwise_twice(layer, x, dy), precision
    x, dy = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    assert not B.bitwise_twice(_Noisy("out"), x, dy)
    assert not B.bitwise_twice(_Noisy("grad"), x, dy)


def test_launch_parts_times_the_entry_points_and_restores_them():
    """`launch_parts` counts and times the calls of each launch entry point by part, and puts
    every entry point back."""
    from moe_mxfp8.kernels.native import NativeKernel

    before = (torch.empty, torch.mm, torch.Tensor.new_empty, NativeKernel.__call__)
    a = torch.ones(4, 4)
    with B.launch_parts() as parts:
        torch.empty(3)
        a.new_empty(2)
        torch.zeros(5)
        torch.mm(a, a)
        torch.mm(a, a)
        torch.ones(2)  # not an entry point
    assert (torch.empty, torch.mm, torch.Tensor.new_empty, NativeKernel.__call__) == before
    assert parts.calls["allocations"] == 3
    assert parts.calls["torch.mm"] == 2
    assert parts.seconds["torch.mm"] > 0 and parts.seconds["allocations"] > 0
