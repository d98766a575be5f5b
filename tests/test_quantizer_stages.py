"""The data path's quantized stages on the CuTeDSL quantizer tile (`kernels/quantize.py`, sources
"gather", "swiglu", "swiglu_grad", "combine_grad"; `moe_mxfp8.stages` runs them for MXFP8
outputs on Hopper and Blackwell): every output byte poisoned, bit for bit against the stages'
references on the GPU; which stage takes which path.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from moe_mxfp8.kernels import quantize_launch as QL

from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8 import routing as RT
from moe_mxfp8 import stages as ST
from tests.test_datapath import (
    _assert_mx_same_values,
    assert_dw_close,
    assert_mx_equal,
    make_routing,
)

HAS_CUTEDSL = importlib.util.find_spec("cutlass") is not None
quantizer_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_CUTEDSL
    or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a Hopper or Blackwell GPU and CuTeDSL")

# (T, k, E, H, group alignment): uneven groups and an idle expert (`make_routing`); groups on
# arbitrary rows (shifted columnwise stores), on 16 and on 128 rows (the layer's, where the
# 1x128 tiles guess their rows); H = 96 and 160 end in a partial 128-block; qwen3's H = 768;
# H = 32 (D = 64: the dispatch and the combine backward too) fills less than one 128-feature
# tile, with guessed rows
_SHAPES = [(300, 8, 16, 160, 16), (1000, 2, 8, 512, 128), (513, 4, 7, 96, 1),
           (700, 8, 33, 768, 128), (64, 2, 4, 256, 16), (600, 1, 8, 32, 128)]
_IDS = "T{}k{}E{}F{}a{}".format


def _poisoned_outs(m: int, f: int, e: int, device) -> dict:
    """The quantizer's four output buffers for ``(m, f)`` in ``e`` groups, every byte 0xAB (it
    writes every scale byte too, pads included: docs/design/quantizers.md)."""
    def fill(*shape, dtype=torch.uint8):
        return torch.full(shape, 0xAB, dtype=torch.uint8, device=device).view(dtype)

    return {"q_row": fill(m, f, dtype=torch.float8_e4m3fn),
            "s_row": fill(L.grouped_rows_scale_bytes(m, f // 32, e)),
            "q_col": fill(f, m, dtype=torch.float8_e4m3fn),
            "s_col": fill(L.grouped_k_scale_bytes(f, m, e))}


def _as_mx(res: list, rows: bool, cols: bool, offs, col_rows: int = 1):
    return ST._wrap(ST._quantizer_outputs(res, rows, cols), offs, col_rows)


def _layout(gen, t, k, e, align):
    ids, counts = make_routing(gen, t, k, e)
    rows, src, offs = (v.cuda() for v in RT.route_layout(ids, counts, align))
    return rows, src, offs, src.numel()


def _assert_copies(got, ref, what):
    for i, kind in ((0, "rowwise"), (1, "colwise")):
        if got[i] is not None or ref[i] is not None:
            assert_mx_equal(got[i], ref[i], f"{what} {kind}")


def _stage_cases(fn):
    """GPU test over `_SHAPES`, both recipes and each choice of outputs."""
    for mark in (pytest.mark.parametrize("outputs", ["both", "rows", "cols"]),
                 pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"]),
                 pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: _IDS(*s)),
                 quantizer_gpu, pytest.mark.gpu):
        fn = mark(fn)
    return fn


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()


@_stage_cases
def test_gpu_swiglu_bit_exact(gen, shape, scale_blocks, outputs):
    """``a`` and ``dh`` quantized by the quantizer tile equal the references' quantization of
    PyTorch's BF16 ``silu(gate) * up`` and its autograd, byte for byte (data and scales), on
    values from 1e-3 to 1e2 (exp under- and overflowing) with pad rows and empty groups."""
    t, k, e, hh, align = shape
    rows, cols = outputs in ("both", "rows"), outputs in ("both", "cols")
    _, src, offs, m = _layout(gen, t, k, e, align)
    # magnitudes spread over 10^-3 .. 10^2 per element: silu's exp from 0 to overflow
    mag = 10 ** (torch.rand(m, 2 * hh, generator=gen) * 5 - 3)
    h = (torch.randn(m, 2 * hh, generator=gen) * mag).to(torch.bfloat16).cuda()
    da = _bf16(gen, m, hh)
    flags = dict(rows=rows, cols=cols, act_block=R.ACT_BLOCK[scale_blocks],
                 aligned_groups=align % 16 == 0)
    # the forward stages' columnwise copy as the layer asks for it (1x128: 128 x 128 tiles)
    col_rows = ST.forward_col_rows(scale_blocks)
    got = QL.quantize_swiglu(h, src, offs, out=_poisoned_outs(m, hh, e, "cuda"),
                             col_tile=col_rows > 1, **flags)
    ref = ST.swiglu_ref(h, src, offs, qrow=rows, qcol=cols, scale_blocks=scale_blocks)
    _assert_copies(_as_mx(got, rows, cols, offs, col_rows), ref, "swiglu")
    got = QL.quantize_swiglu_grad(da, h, src, offs, out=_poisoned_outs(m, 2 * hh, e, "cuda"),
                                  **flags)
    ref = ST.swiglu_backward_ref(da, h, src, offs, qrow=rows, qcol=cols,
                                 scale_blocks=scale_blocks)
    _assert_copies(_as_mx(got, rows, cols, offs), ref, "swiglu backward")


@_stage_cases
def test_gpu_dispatch_and_combine_backward_bit_exact(gen, shape, scale_blocks, outputs):
    """The dispatch (token rows gathered) and the combine's backward (``dout[t] * bf16(w)``)
    quantized by the quantizer tile equal the references' bytes; the routing weights' gradient
    from its per-tile partial sums (summed in another order than the reference's) is within one
    BF16 ulp of it. ``F`` here is the model dim D (the H of `_SHAPES`, doubled)."""
    t, k, e, hh, align = shape
    d = 2 * hh
    rows_, cols = outputs in ("both", "rows"), outputs in ("both", "cols")
    rows, src, offs, m = _layout(gen, t, k, e, align)
    flags = dict(rows=rows_, cols=cols, act_block=R.ACT_BLOCK[scale_blocks],
                 aligned_groups=align % 16 == 0)
    x = _bf16(gen, t, d, scale=4.0)
    col_rows = ST.forward_col_rows(scale_blocks)
    got = QL.quantize_gather(x, src, offs, k, out=_poisoned_outs(m, d, e, "cuda"),
                             col_tile=col_rows > 1, **flags)
    ref = ST.dispatch_ref(x, src, offs, k, qrow=rows_, qcol=cols, scale_blocks=scale_blocks)
    _assert_copies(_as_mx(got, rows_, cols, offs, col_rows), ref, "dispatch")

    dout, y = _bf16(gen, t, d), _bf16(gen, m, d)
    w = torch.rand(t, k, generator=gen).cuda()
    part = torch.full((-(-d // 128), m), float("nan"), device="cuda")
    got = QL.quantize_combine_grad(dout, y, src, w, offs, k, part=part,
                                   out=_poisoned_outs(m, d, e, "cuda"), **flags)
    ref = ST.combine_backward_ref(dout, y, src, rows, w, offs, qrow=rows_, qcol=cols,
                                  scale_blocks=scale_blocks)
    _assert_copies(_as_mx(got, rows_, cols, offs), ref, "combine backward")
    dw = part.sum(0).to(torch.bfloat16).float()[rows.long()]
    assert_dw_close(dw, ref[3], dout, y, rows)
    assert not part.isnan().any(), "a partial sum was not written"


@pytest.mark.gpu
@quantizer_gpu
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_gpu_stages_choice_and_nonfinite(gen, scale_blocks, monkeypatch):
    """`stages` runs the `QUANTIZER_STAGES` (SwiGLU, combine backward, the dispatch; here each
    for both block lengths) on the quantizer tile for MXFP8 outputs, on the Triton kernels for
    the BF16 ones; Inf and NaN inputs give the reference's 0xFF blocks and every other value
    the reference's."""
    monkeypatch.setattr(ST, "QUANTIZER_STAGES",
                        dict.fromkeys(ST.QUANTIZER_STAGES, ST.QUANTIZER_BLOCKS))
    calls = []
    for name in ("quantize_gather", "quantize_swiglu", "quantize_swiglu_grad",
                 "quantize_combine_grad"):
        fn = getattr(QL, name)
        monkeypatch.setattr(QL, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n)
                            or _fn(*a, **kw))
    t, k, e, hh = 300, 2, 8, 256
    rows, src, offs, m = _layout(gen, t, k, e, 128)
    h, da, x = _bf16(gen, m, 2 * hh, scale=3.0), _bf16(gen, m, hh), _bf16(gen, t, hh)
    for v in (h, x):
        flat = v.view(-1)
        idx = torch.randint(flat.numel(), (12,), generator=gen).cuda()
        flat[idx] = torch.tensor([float("inf"), -float("inf"), float("nan")] * 4,
                                 dtype=torch.bfloat16, device="cuda")
    sb = scale_blocks
    flags = dict(scale_blocks=sb, aligned_groups=True)
    for got, ref, what in (
            (ST.dispatch(x, src, offs, k, **flags), ST.dispatch_ref(x, src, offs, k,
                                                                     scale_blocks=sb), "dispatch"),
            (ST.swiglu(h, src, offs, **flags), ST.swiglu_ref(h, src, offs, scale_blocks=sb),
             "swiglu"),
            (ST.swiglu_backward(da, h, src, offs, **flags),
             ST.swiglu_backward_ref(da, h, src, offs, scale_blocks=sb), "swiglu backward")):
        assert (got[0].scale == 0xFF).any(), f"{what}: no non-finite block was made"
        _assert_mx_same_values(got[0], ref[0], f"{what} rowwise")
        _assert_mx_same_values(got[1], ref[1], f"{what} colwise")
    w = torch.rand(t, k, generator=gen).cuda()
    y = _bf16(gen, m, hh)
    got = ST.combine_backward(x, y, src, rows, w, offs, **flags)
    ref = ST.combine_backward_ref(x, y, src, rows, w, offs, scale_blocks=sb)
    _assert_mx_same_values(got[0], ref[0], "combine backward rowwise")
    _assert_mx_same_values(got[1], ref[1], "combine backward colwise")
    shipped = ["quantize_gather", "quantize_swiglu", "quantize_swiglu_grad",
               "quantize_combine_grad"]
    assert calls == shipped
    ST.swiglu(h, src, offs, qrow=False, qcol=False, keep_bf16=True, scale_blocks=sb)
    ST.dispatch(x, src, offs, k, qrow=False, qcol=False, keep_bf16=True)
    assert calls == shipped, "BF16 outputs: the Triton kernels'"


def test_kernel_input_copies_only_what_the_tile_cannot_read():
    """The quantizer tile's 16-byte loads need contiguous, 16-byte aligned rows: a misaligned
    or strided input is copied (`checks.kernel_input`), an aligned contiguous one is not."""
    from moe_mxfp8.checks import kernel_input

    base = torch.randn(8 * 64 + 1).to(torch.bfloat16)
    shifted = base[1:].view(8, 64)  # one element past an aligned allocation: 2-byte aligned
    assert shifted.data_ptr() % 16 and shifted.is_contiguous()
    got = kernel_input(shifted)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, shifted)
    aligned = torch.randn(8, 64).to(torch.bfloat16)
    assert kernel_input(aligned) is aligned
    strided = torch.randn(64, 8).to(torch.bfloat16).t()
    got = kernel_input(strided)
    assert got.is_contiguous() and torch.equal(got, strided)


@pytest.mark.gpu
@quantizer_gpu
def test_gpu_misaligned_inputs(gen):
    """A misaligned ``h`` / ``dA`` (views one element into their storage) gives the aligned
    inputs' bytes on the quantizer tile (copied first, never read misaligned)."""
    t, k, e, hh = 300, 2, 8, 256
    _, src, offs, m = _layout(gen, t, k, e, 128)

    def shifted(*shape):
        n = shape[0] * shape[1]
        flat = torch.empty(n + 1, dtype=torch.bfloat16, device="cuda")
        v = flat[1:].view(*shape)
        v.copy_(_bf16(gen, *shape))
        return v

    h, da = shifted(m, 2 * hh), shifted(m, hh)
    for got, ref, what in (
            (ST.swiglu(h, src, offs, scale_blocks="1x128", aligned_groups=True),
             ST.swiglu_ref(h, src, offs, scale_blocks="1x128"), "swiglu"),
            (ST.swiglu_backward(da, h, src, offs, scale_blocks="1x128", aligned_groups=True),
             ST.swiglu_backward_ref(da, h, src, offs, scale_blocks="1x128"), "swiglu backward")):
        _assert_copies(got, ref, what)
