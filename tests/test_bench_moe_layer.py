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
