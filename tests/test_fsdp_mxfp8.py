"""The pieces of MXFP8 all-gathered expert weights (`moe_mxfp8.fsdp_mxfp8`) in one process: the
N-axis operand derived from the K-axis bytes (`quantize.weights_along_n`) against the quantizer
bit for bit, the gathered weight as the data path's operand (bit-identical to the BF16
weights), and the two tensor classes' behaviour outside FSDP2. Under FSDP2: tests/test_fsdp.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from moe_mxfp8.kernels.mx_format import WEIGHT_BLOCK_ROWS

from moe_mxfp8 import datapath as DP
from moe_mxfp8 import fsdp_mxfp8 as FM
from moe_mxfp8 import routing as RT
from moe_mxfp8.quantize import quantize_weights, weights_along_n
from tests.triton_sm90 import interpreter_only, run_check_interpreted

BF16 = torch.bfloat16
GPU = torch.cuda.is_available()


def _weights(gen, shape, special: bool = True) -> torch.Tensor:
    """Expert weights over 12 octaves (rows of different scale), with a NaN, an Inf and an
    all-zero expert when ``special``."""
    e, n, k = shape
    w = torch.randn(shape, generator=gen) * torch.logspace(-6, 6, n, base=2.0)[None, :, None]
    if special:
        w[0, 3, 5] = float("nan")
        w[-1, n - 1, 1] = float("inf")
        w[1 % e] = 0.0
    return w.to(BF16)


@pytest.mark.parametrize("block_rows", [32, 128])
@pytest.mark.parametrize("shape", [(3, 64, 96), (2, 160, 320), (1, 256, 128), (2, 384, 256)])
@pytest.mark.parametrize("scale_layout", ["packed", "dense"])
def test_weights_along_n_is_the_n_axis_quantization(gen, block_rows, shape, scale_layout):
    """32x32 and 128x128 tiles (partial ones at the edges too; N and K multiples of 128: the
    packed scales relaid chunk by chunk): the N-axis operand from the K-axis bytes equals
    ``quantize_weights(axis="N")``, data and scales, bit for bit."""
    w = _weights(gen, shape)
    kw = {"block_rows": block_rows, "scale_layout": scale_layout, "backend": "reference"}
    want = quantize_weights(w, axis="N", **kw)
    got = weights_along_n(quantize_weights(w, axis="K", **kw))
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
    assert (got.scale_layout, got.block_rows) == (want.scale_layout, want.block_rows)


def test_weights_along_n_refuses_1x32_blocks(gen):
    """1x32 blocks along K are not blocks along N: no N-axis bytes to derive."""
    q = quantize_weights(_weights(gen, (2, 64, 64)), axis="K", backend="reference")
    with pytest.raises(ValueError, match="32x32 or 128x128"):
        weights_along_n(q)


def _gathered(w: torch.Tensor, recipe: str) -> FM.MXFP8GatheredWeight:
    """``w`` as the all-gather delivers it: quantized along K, scales one row per expert."""
    q = quantize_weights(w, axis="K", block_rows=WEIGHT_BLOCK_ROWS[recipe], backend="reference")
    return FM.MXFP8GatheredWeight(q.data.view(torch.uint8), q.scale, q.block_rows, w.dtype)


@pytest.mark.parametrize("recipe", FM.MXFP8_GATHER_RECIPES)
def test_gathered_weights_give_the_bf16_weights_results(gen, recipe):
    """`routed_experts` on gathered weights (K bytes in forward, `weights_along_n` in backward)
    gives the outputs and every gradient of the BF16 weights it was quantized from, exactly."""
    t, k, e, d, hh = 40, 2, 4, 64, 96
    logits = torch.randn(t, e, generator=gen)
    ids = logits.topk(k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=e)
    rows, src, offs = RT.route_layout(ids, counts, 128 if recipe == "1x128" else 16)
    x = torch.randn(t, d, generator=gen).to(BF16)
    w_gu = _weights(gen, (e, 2 * hh, d), special=False) * d**-0.5
    w_dn = _weights(gen, (e, d, hh), special=False) * hh**-0.5
    weights = torch.rand(t, k, generator=gen)
    dout = torch.randn(t, d, generator=gen).to(BF16)
    res = []
    for gathered in (False, True):
        ws = [_gathered(w, recipe) if gathered else w.clone() for w in (w_gu, w_dn)]
        leaves = [x.clone(), *ws, weights.clone()]
        for v in leaves:
            v.requires_grad_()
        out = DP.routed_experts(*leaves, rows, src, offs, backend="reference",
                                scale_blocks=recipe)
        out.backward(dout)
        res.append([out] + [v.grad for v in leaves])
    for name, a, b in zip(["out", "dx", "dw_gu", "dw_dn", "dweights"], *res, strict=True):
        assert type(b) is torch.Tensor and torch.equal(a, b), name


def test_gathered_weight_refuses_every_other_use(gen):
    """A gathered weight holds no BF16 values: arithmetic, a reduction or a cast to another
    dtype is a one-line NotImplementedError (never values made up); the data path with another
    recipe's tiles a ValueError."""
    w = _gathered(_weights(gen, (2, 64, 64), special=False), "1x128")
    for use in (lambda: w + 1, lambda: w.sum(), lambda: w.to(torch.float16), lambda: w.clone()):
        with pytest.raises(NotImplementedError, match="read only by the layer's expert GEMMs"):
            use()
    assert w.detach().shape == w.shape and w.to(BF16) is w
    ids = torch.zeros(4, 1, dtype=torch.int64)
    rows, src, offs = RT.route_layout(ids, torch.tensor([4, 0]), 16)
    with pytest.raises(ValueError, match="128-row tiles"):
        DP.routed_experts(torch.randn(4, 64).to(BF16), w, w, torch.ones(4, 1), rows, src, offs,
                          backend="reference", scale_blocks="32x32")


def test_sharded_weight_is_its_shard():
    """The sharded parameter's local tensor behaves as the plain shard: out-of-place results are
    plain tensors, in-place ones update the shard, views keep the all-gather extension."""
    inner = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    s = FM.MXFP8ShardedWeight(inner, 128, "reference")
    out = s * 2
    assert type(out) is torch.Tensor and torch.equal(out, inner * 2)
    assert s.add_(1) is s and torch.equal(inner[0, 0], torch.arange(1.0, 5.0))
    v = s.view(-1)
    assert isinstance(v, FM.MXFP8ShardedWeight) and v.shard.data_ptr() == inner.data_ptr()
    assert type(FM.plain(s)) is torch.Tensor and FM.plain(s) is inner


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("block_rows", [32, 128])
def test_gpu_weights_along_n_matches_the_kernel(gen, block_rows):
    """On the GPU quantizer kernels: the N-axis operand derived from the kernel's K-axis bytes
    equals the kernel's own N-axis quantization, bit for bit (mixtral-like tile counts)."""
    w = _weights(gen, (4, 1024, 512)).cuda()
    kw = {"block_rows": block_rows, "backend": "auto"}
    want = quantize_weights(w, axis="N", **kw)
    got = weights_along_n(quantize_weights(w, axis="K", **kw))
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


def check_transpose_kernel(gen, device: str) -> None:
    """`weights_triton.transpose_experts` is the per-expert byte transpose: sizes that are not
    multiples of the tile, one expert, and the mixtral-like 128-multiples."""
    from moe_mxfp8.kernels import weights_triton as K

    for shape in [(3, 100, 200), (1, 64, 64), (2, 256, 384), (2, 33, 7)]:
        data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)
        got = K.transpose_experts(data)
        assert torch.equal(got.cpu(), data.cpu().transpose(-2, -1)), shape


@interpreter_only
def test_transpose_kernel_interpreter(gen):
    """`check_transpose_kernel` in Triton's interpreter (a subprocess: the interpreter must be
    chosen before Triton is first imported)."""
    run_check_interpreted("tests.test_fsdp_mxfp8:check_transpose_kernel", gen)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_transpose_kernel_compiles_for_sm90():
    """The transpose kernel builds for sm_90 without a GPU (Triton's own ptxas)."""
    from moe_mxfp8.kernels import weights_triton as K

    from tests.triton_sm90 import compile_for_sm90

    k = compile_for_sm90(K._transpose_kernel, {"T": K.TILE}, 4, aligned_except=())
    assert ".target sm_90" in k.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_gpu_transpose_kernel(gen):
    check_transpose_kernel(gen, "cuda")
