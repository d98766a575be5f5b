"""Activation checkpointing around a block holding `MXFP8MoE`: ``torch.utils.checkpoint``
(non-reentrant) and torchtitan's selective AC (an op-level policy through
``create_selective_checkpoint_contexts``) give the gradients of the plain block bit for bit,
``aux_loss`` included: the recomputation runs the same deterministic forward again (and sets
``aux_loss`` / ``tokens_per_expert`` to the same values)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from moe_mxfp8 import MXFP8MoE

BF16 = torch.bfloat16


class Block(torch.nn.Module):
    """A transformer block's feed-forward half: x + moe(norm(x))."""

    def __init__(self, dim, **opts):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, dtype=BF16)
        self.moe = MXFP8MoE(dim, 64, 8, 2, num_shared_experts=1, **opts)

    def forward(self, x):
        return x + self.moe(self.norm(x))


def _save_matmuls(ctx, op, *args, **kwargs):
    """torchtitan's selective-AC idea: keep the GEMM outputs, recompute the cheap ops."""
    save = op in (torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


WRAPS = {
    "none": lambda block, x: block(x),
    "full": lambda block, x: checkpoint(block, x, use_reentrant=False),
    "selective": lambda block, x: checkpoint(
        block, x, use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls)),
}


def _grads(block, x, dy, wrap):
    block.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    y = WRAPS[wrap](block, xa)
    aux = block.moe.aux_loss
    ((y.float() * dy.float()).sum() + aux).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return y.detach(), aux.detach(), xa.grad, grads, block.moe.tokens_per_expert.clone()


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
@pytest.mark.parametrize("wrap", ["full", "selective"])
def test_checkpointed_block_has_the_plain_gradients(gen, precision, wrap):
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    block = Block(64, precision=precision, backend="reference")
    x = torch.randn(2, 24, 64, generator=gen).to(BF16)
    dy = torch.randn(2, 24, 64, generator=gen).to(BF16)
    calls = []
    block.moe.register_forward_pre_hook(lambda *_: calls.append(1))
    want = _grads(block, x, dy, "none")
    got = _grads(block, x, dy, wrap)
    assert len(calls) == 3  # the checkpointed forward ran again in backward
    for name, a, b in zip(["y", "aux_loss", "dx"], want[:3], got[:3], strict=True):
        assert torch.equal(a, b), name
    assert want[3].keys() == got[3].keys()
    for name in want[3]:
        assert torch.equal(want[3][name], got[3][name]), name
    assert torch.equal(want[4], got[4])  # tokens_per_expert after the recomputation
