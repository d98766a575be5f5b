"""The 1x128 row kernels' tilings (`kernels.datapath_triton.RowTiling`) other than the shipped
`ROW_TILING`, bit for bit against the references: chunk walks of other lengths than the shipped
ones (each chunk recomputed from its inputs for the columnwise copy) in Triton's interpreter on
the CPU, and every tiling `benchmarks.bench_rowkernels` sweeps on the GPU (``-m gpu``), so that
whichever the sweep picks is already checked. The shipped tilings are `tests/test_datapath.py`'s.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from moe_mxfp8.kernels import quantize_launch as QL

from benchmarks.bench_rowkernels import KIND_VARIANTS, VARIANTS
from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8 import routing as RT
from moe_mxfp8 import stages as ST
from tests.test_datapath import (
    _assert_mx_same_values,
    _check_kernels,
    _kernel_module,
    assert_mx_equal,
    make_routing,
)
from tests.triton_sm90 import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                 reason="Triton interpreter run (CPU machine with Triton)")
SWIGLU = ("swiglu_fwd", "swiglu_bwd")


@contextlib.contextmanager
def tilings(K, tiling: tuple, kernels=("dispatch",) + SWIGLU):
    """Launch ``kernels``' 128-row blocks with ``RowTiling(*tiling)``, the shipped ones after."""
    saved = {n: K.ROW_TILING[n][128] for n in kernels}
    for n in kernels:
        K.ROW_TILING[n][128] = K.RowTiling(*tiling)
    try:
        yield
    finally:
        for n, t in saved.items():
            K.ROW_TILING[n][128] = t


def check_tiling(seed: int, device: str, shape: tuple, tiling: tuple, kernels=None) -> None:
    """`tests.test_datapath`'s kernels-vs-references check (every output poisoned) in 1x128
    blocks, with ``tiling`` for ``kernels`` (default: the dispatch and both SwiGLU kernels)."""
    K = _kernel_module()
    with tilings(K, tiling, *([kernels] if kernels else [])):
        _check_kernels(K, torch.Generator().manual_seed(seed), device, *shape,
                       device == "cuda", "1x128")


@interpreter
@pytest.mark.parametrize("shape,tiling", [
    # groups on no multiple of 16 (byte stores) of about 100 rows, 16-row chunks: 8 chunks a
    # block, the last one partial; D = 160 ends in a partial 128-block; H = 96: the joint
    # SwiGLU backward
    ((100, 2, 3, 160, 96, 1), (16, 4)),
    # 64-row chunks, the two-half SwiGLU backward
    ((70, 2, 3, 256, 256, 16), (64, 8)),
], ids=lambda v: "T{}k{}E{}D{}H{}a{}".format(*v) if len(v) == 6 else f"rows{v[0]}")
def test_chunk_walk_interpreter(gen, shape, tiling):
    """In a subprocess, as `test_datapath.test_kernels_interpreter` (the interpreter must be
    chosen before Triton's first import)."""
    seed = int(torch.randint(2**62, (1,), generator=gen))
    code = ("from tests.test_swiglu_kernels import check_tiling as c;"
            f"c({seed}, 'cpu', {shape!r}, {tiling!r})")
    run_interpreted(code, seed)


_GPU_SHAPES = [(300, 8, 16, 256, 160, 16), (1000, 2, 8, 1024, 512, 128),
               (513, 4, 7, 160, 96, 1)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", _GPU_SHAPES, ids=lambda s: "T{}k{}E{}D{}H{}a{}".format(*s))
@pytest.mark.parametrize("variant", KIND_VARIANTS["swiglu"])
def test_gpu_swiglu_variants_bit_exact(gen, variant, shape):
    """Every SwiGLU tiling the benchmark sweeps (the dispatch too where it sweeps it), bit for
    bit the references, every output poisoned first."""
    kernels = SWIGLU + (("dispatch",) if variant in KIND_VARIANTS["dispatch"] else ())
    check_tiling(int(torch.randint(2**62, (1,), generator=gen)), "cuda", shape,
                 VARIANTS[variant], kernels)



# ---------------------------------------------------------------------------------------------
# The quantized SwiGLU stages on the CuTeDSL quantizer tile (kernels/quantize.py, source
# "swiglu" / "swiglu_grad"): every output byte poisoned, bit for bit against the references
# ---------------------------------------------------------------------------------------------

HAS_CUTEDSL = importlib.util.find_spec("cutlass") is not None
quantizer_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_CUTEDSL
    or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a Hopper or Blackwell GPU and CuTeDSL")

# (T, k, E, H, group alignment): uneven groups and an idle expert (`make_routing`); groups on
# arbitrary rows (shifted columnwise stores), on 16 and on 128 rows (the layer's); H = 96 and
# 160 end in a partial 128-block; qwen3's H = 768
_QUANTIZER_SHAPES = [(300, 8, 16, 160, 16), (1000, 2, 8, 512, 128), (513, 4, 7, 96, 1),
                     (700, 8, 33, 768, 128), (64, 2, 4, 256, 16)]


def _poisoned_quantizer_outs(m: int, f: int, e: int, device) -> dict:
    """The quantizer's four output buffers for ``(m, f)`` in ``e`` groups, every byte 0xAB (it
    writes every scale byte too, pads included: docs/design/datapath.md)."""
    def fill(*shape, dtype=torch.uint8):
        return torch.full(shape, 0xAB, dtype=torch.uint8, device=device).view(dtype)

    return {"q_row": fill(m, f, dtype=torch.float8_e4m3fn),
            "s_row": fill(L.grouped_rows_scale_bytes(m, f // 32, e)),
            "q_col": fill(f, m, dtype=torch.float8_e4m3fn),
            "s_col": fill(L.grouped_k_scale_bytes(f, m, e))}


def _as_mx(res: list, rows: bool, cols: bool, offs):
    return ST._wrap(ST._quantizer_outputs(res, rows, cols), offs)


@pytest.mark.gpu
@quantizer_gpu
@pytest.mark.parametrize("shape", _QUANTIZER_SHAPES, ids=lambda s: "T{}k{}E{}H{}a{}".format(*s))
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
@pytest.mark.parametrize("outputs", ["both", "rows", "cols"])
def test_gpu_quantizer_swiglu_bit_exact(gen, shape, scale_blocks, outputs):
    """``a`` and ``dh`` quantized by the quantizer tile equal the references' quantization of
    PyTorch's BF16 ``silu(gate) * up`` and its autograd, byte for byte (data and scales), on
    values from 1e-3 to 1e2 (exp under- and overflowing) with pad rows and empty groups."""
    t, k, e, hh, align = shape
    ablk = R.ACT_BLOCK[scale_blocks]
    rows, cols = outputs in ("both", "rows"), outputs in ("both", "cols")
    ids, counts = make_routing(gen, t, k, e)
    _, src, offs = (v.cuda() for v in RT.route_layout(ids, counts, align))
    m = src.numel()
    # magnitudes spread over 10^-3 .. 10^2 per element: silu's exp from 0 to overflow
    mag = 10 ** (torch.rand(m, 2 * hh, generator=gen) * 5 - 3)
    h = (torch.randn(m, 2 * hh, generator=gen) * mag).to(torch.bfloat16).cuda()
    da = torch.randn(m, hh, generator=gen).to(torch.bfloat16).cuda()
    flags = dict(rows=rows, cols=cols, act_block=ablk, aligned_groups=align % 16 == 0)

    got = _as_mx(QL.quantize_swiglu(h, src, offs, out=_poisoned_quantizer_outs(m, hh, e, "cuda"),
                                    **flags), rows, cols, offs)
    ref = ST.swiglu_ref(h, src, offs, qrow=rows, qcol=cols, scale_blocks=scale_blocks)
    for i, what in ((0, "swiglu rowwise"), (1, "swiglu colwise")):
        if got[i] is not None or ref[i] is not None:
            assert_mx_equal(got[i], ref[i], what)

    # the backward with the step's tile ends (`routing.row_tables`, as the layer passes them),
    # the forward building its own
    tile_ends = RT.row_tables(offs, m, ablk)[1]
    got = _as_mx(QL.quantize_swiglu_grad(da, h, src, offs,
                                         out=_poisoned_quantizer_outs(m, 2 * hh, e, "cuda"),
                                         tile_ends=tile_ends, **flags), rows, cols, offs)
    ref = ST.swiglu_backward_ref(da, h, src, offs, qrow=rows, qcol=cols,
                                 scale_blocks=scale_blocks)
    for i, what in ((0, "swiglu backward rowwise"), (1, "swiglu backward colwise")):
        if got[i] is not None or ref[i] is not None:
            assert_mx_equal(got[i], ref[i], what)


@pytest.mark.gpu
@quantizer_gpu
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_gpu_quantizer_swiglu_nonfinite_and_stage_choice(gen, scale_blocks, monkeypatch):
    """``stages.swiglu`` / ``swiglu_backward`` run on the quantizer tile for MXFP8 outputs (and
    on the Triton kernel for the BF16 one); Inf and NaN inputs give the reference's 0xFF blocks
    and every other value the reference's."""
    calls = []
    for name in ("quantize_swiglu", "quantize_swiglu_grad"):
        fn = getattr(QL, name)
        monkeypatch.setattr(QL, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n)
                            or _fn(*a, **kw))
    t, k, e, hh = 300, 2, 8, 256
    ids, counts = make_routing(gen, t, k, e)
    _, src, offs = (v.cuda() for v in RT.route_layout(ids, counts, 128))
    m = src.numel()
    h = (torch.randn(m, 2 * hh, generator=gen) * 3).to(torch.bfloat16).cuda()
    da = torch.randn(m, hh, generator=gen).to(torch.bfloat16).cuda()
    flat = h.view(-1)
    idx = torch.randint(flat.numel(), (12,), generator=gen).cuda()
    flat[idx] = torch.tensor([float("inf"), -float("inf"), float("nan")] * 4,
                             dtype=torch.bfloat16, device="cuda")
    sb = scale_blocks
    got = ST.swiglu(h, src, offs, scale_blocks=sb, aligned_groups=True)
    ref = ST.swiglu_ref(h, src, offs, scale_blocks=sb)
    assert (got[0].scale == 0xFF).any(), "no non-finite block was made"
    _assert_mx_same_values(got[0], ref[0], "swiglu rowwise")
    _assert_mx_same_values(got[1], ref[1], "swiglu colwise")
    got = ST.swiglu_backward(da, h, src, offs, scale_blocks=sb, aligned_groups=True)
    ref = ST.swiglu_backward_ref(da, h, src, offs, scale_blocks=sb)
    _assert_mx_same_values(got[0], ref[0], "swiglu backward rowwise")
    _assert_mx_same_values(got[1], ref[1], "swiglu backward colwise")
    assert calls == ["quantize_swiglu", "quantize_swiglu_grad"]
    ST.swiglu(h, src, offs, qrow=False, qcol=False, keep_bf16=True, scale_blocks=sb)
    assert calls == ["quantize_swiglu", "quantize_swiglu_grad"], "BF16 output: Triton's"
