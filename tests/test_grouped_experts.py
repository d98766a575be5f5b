"""`MXFP8GroupedExperts` (torchtitan's experts interface) runs the layer's expert block: the
fused stages of `MXFP8MoE` (dispatch-quantize, GEMM, SwiGLU with its quantized copies, GEMM,
combine) on its expert-sorted rows, in every recipe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_mxfp8 import grouped_mm
from moe_mxfp8.experts import MXFP8GroupedExperts
from tests.compare import assert_same_sums, sqnr_db

BF16 = torch.bfloat16
D, H, E = 64, 96, 5


def _composition(ex, x, counts, scale_blocks):
    """The experts' math as separate public ops: gate/up GEMM, BF16 SwiGLU, down GEMM, with
    the padding rows past the counts zeroed and joined to the last group."""
    m = x.shape[0]
    ends = torch.cumsum(counts, 0)
    offs = torch.cat([ends[:-1], ends.new_full((1,), m)]).to(torch.int32)
    xb = torch.where((torch.arange(m) < ends[-1])[:, None], x, 0.0)
    w13 = torch.cat([ex.w1, ex.w3], dim=1)
    h = grouped_mm(xb, w13.transpose(-2, -1), offs, backend="reference", scale_blocks=scale_blocks)
    gate, up = h.chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, ex.w2.transpose(-2, -1), offs, backend="reference",
                      scale_blocks=scale_blocks)


def _run(fn, ex, x, dy):
    ex.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = fn(xi)
    y.backward(dy)
    return [y, xi.grad, ex.w1.grad, ex.w2.grad, ex.w3.grad]


@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
@pytest.mark.parametrize("counts", [[7, 0, 19, 3, 11], [0, 0, 40, 0, 0], [16, 16, 0, 32, 16]])
def test_expert_block_against_the_composition(gen, scale_blocks, counts):
    """Uneven, empty and aligned groups, plus 6 padding rows past the counts (NaN: they must
    reach nothing): output and every gradient against the same math as separate ops (16 rows
    per group of group alignment change no sum in 1x32, only the row count CPU BLAS blocks
    by, which may flip a rounding: `assert_same_sums`; the 1x128 composition quantizes
    unaligned groups, so its blocks differ: SQNR), and zero outputs and input gradients on
    the padding rows."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    ex = MXFP8GroupedExperts(D, H, E, backend="reference", scale_blocks=scale_blocks, dtype=BF16)
    ex.init_weights(0.05)
    n = torch.tensor(counts)
    m = int(n.sum()) + 6
    x = torch.randn(m, D, generator=gen).to(BF16)
    x[-6:] = float("nan")
    dy = torch.randn(m, D, generator=gen).to(BF16)
    got = _run(lambda xi: ex(xi, n), ex, x, dy)
    assert torch.equal(got[0][-6:], torch.zeros(6, D, dtype=BF16))
    assert torch.equal(got[1][-6:], torch.zeros(6, D, dtype=BF16))
    assert all(torch.isfinite(g).all() for g in got)
    want = _run(lambda xi: _composition(ex, torch.nan_to_num(xi), n, scale_blocks), ex,
                x, dy)
    for a, b in zip(got, want, strict=True):
        if scale_blocks == "1x32":
            assert_same_sums(a[: m - 6] if a.shape[0] == m else a,
                             b[: m - 6] if b.shape[0] == m else b)
        else:
            assert sqnr_db(b.float(), a.float()) >= 25.0


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_negative_token_counts_are_refused(precision):
    """A negative ``num_tokens_per_expert`` is one error line naming it, in both precisions
    (the MXFP8 path ran on with the other groups shifted; the twin's error named ``offs``)."""
    ex = MXFP8GroupedExperts(D, H, E, precision=precision, backend="reference")
    x = torch.randn(12, D)
    with pytest.raises(ValueError, match="MXFP8GroupedExperts: num_tokens_per_expert must be "
                       r"non-negative, got \[3, -2, 5, 4, 2\]"):
        ex(x, torch.tensor([3, -2, 5, 4, 2]))
    assert ex(x, torch.tensor([3, 0, 5, 4, 0])).shape == x.shape


def test_bf16_twin_is_the_composition(gen):
    ex = MXFP8GroupedExperts(D, H, E, precision="bf16", dtype=BF16)
    ex.init_weights(0.05)
    n = torch.tensor([9, 0, 21, 2, 8])
    x = torch.randn(40, D, generator=gen).to(BF16)
    offs = torch.cumsum(n, 0).to(torch.int32)
    h = torch._grouped_mm(x, torch.cat([ex.w1, ex.w3], dim=1).transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    want = torch._grouped_mm(F.silu(gate) * up, ex.w2.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(ex(x, n), want, rtol=0, atol=0)


# (D, H, tokens per expert): the down weight gradient in backward's last phase (its dY operand
# the smaller), and in its first phase (`datapath.late_down_wgrad` false: few experts, many
# tokens), where the Hugging Face swap's GPU test found the 1x128 fault at D = 64
EXPERT_BLOCKS = {"late": (256, 384, [130, 0, 77, 301, 5, 200]), "early": (256, 128, [700, 500])}


@pytest.mark.gpu
@pytest.mark.parametrize("block", sorted(EXPERT_BLOCKS))
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_gpu_expert_block_matches_reference(gen, scale_blocks, block):
    """On the GPU (Triton data path, CuTeDSL GEMMs) against the reference backend on the CPU:
    output and every gradient within 1 % relative error (same quantized bytes; the GEMMs'
    fp32 sums differ in order), padding rows zero; outputs poisoned by NaN padding rows."""
    from moe_mxfp8.kernels.mx_format import padded_extent

    from moe_mxfp8 import datapath as DP

    d, h, counts = EXPERT_BLOCKS[block]
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    ref = MXFP8GroupedExperts(d, h, len(counts), backend="reference",
                              scale_blocks=scale_blocks, dtype=BF16)
    ref.init_weights(0.05)
    dev = MXFP8GroupedExperts(d, h, len(counts), scale_blocks=scale_blocks, dtype=BF16,
                              device="cuda")
    dev.load_state_dict(ref.state_dict())
    n = torch.tensor(counts)
    m = int(n.sum()) + 9
    rows = padded_extent(m, len(counts), 128 if scale_blocks == "1x128" else 16)
    assert DP.late_down_wgrad(rows, d, len(counts), h, True) == (block == "late")
    x = torch.randn(m, d, generator=gen).to(BF16)
    x[-9:] = float("nan")
    dy = torch.randn(m, d, generator=gen).to(BF16)
    want = _run(lambda xi: ref(xi, n), ref, x, dy)
    got = _run(lambda xi: dev(xi, n.cuda()), dev, x.cuda(), dy.cuda())
    for a, b in zip(got, want, strict=True):
        a, b = a.float().cpu(), b.float()
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()) < 1e-2
