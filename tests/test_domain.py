"""The quantizers' domain (docs/numerics.md, "Domain"): every edge of the table, on every backend.

CPU (CI): the reference path accepts each edge with the sizes the table states; the kernel path's
host glue (copies, empty tensors, refusals) runs against a stand-in kernel that insists on what
the real kernels need and computes with the reference.
GPU: the same edges through ``backend="auto"`` (the CuTeDSL kernels), bit-exact against the
reference on the same data; outputs of the direct kernel calls are poisoned first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from moe_mxfp8.kernels.mx_format import ACT_BLOCK

import moe_mxfp8.quantize as P
from moe_mxfp8 import checks as C
from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8.mx_tensor import MXFP8Tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (M, K) of x for the columnwise quantizer: any M, any K (odd K takes the element-load path;
# K % 8 == 0 but not % 32 the vector path with a partial block of features).
COLWISE_SHAPES = [(19, 64), (100, 96), (64, 19), (96, 100), (1, 1), (3, 7), (130, 33),
                  (129, 200), (17, 40), (33, 12), (0, 64), (5, 0), (0, 0)]
# rowwise / dual: K % 32 == 0, any M.
ROWWISE_SHAPES = [(1, 32), (19, 64), (100, 96), (127, 160), (0, 64), (5, 0), (0, 0)]
GROUP_SIZES = [[0, 5, 130, 0, 33, 1], [0, 0, 0], [19]]
# Expert weights (E, N, K), axis, block_rows.
WEIGHT_CASES = [((2, 40, 64), "K", 1), ((2, 64, 19), "N", 1), ((2, 64, 40), "N", 1),
                ((3, 64, 96), "N", 32), ((0, 32, 64), "K", 1), ((0, 32, 64), "N", 32),
                ((2, 0, 64), "K", 1), ((2, 0, 64), "N", 1), ((2, 32, 0), "K", 1),
                ((2, 32, 0), "N", 1),
                # 128x128 tiles (the 1x128 recipe): the non-reduced extent any, partial tiles
                ((2, 40, 64), "K", 128), ((2, 64, 19), "N", 128), ((1, 160, 352), "K", 128),
                ((0, 32, 64), "N", 128), ((2, 0, 64), "K", 128), ((2, 32, 0), "N", 128)]
# scale_blocks recipes whose activation blocks differ (32x32 only changes the weights)
RECIPES = ("1x32", "1x128")


def _x(shape, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    if x.numel():  # magnitudes over many octaves, per row
        x = x * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g,
                                         device=device).float())
    return x.to(dtype)


def _offs(sizes, device="cpu"):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def assert_same(got, want, what=""):
    """Same data bytes, same scale bytes, same layout metadata."""
    assert got.data.shape == want.data.shape, (what, got.data.shape, want.data.shape)
    assert got.data.dtype == want.data.dtype == torch.float8_e4m3fn, what
    assert got.scale.shape == want.scale.shape, (what, got.scale.shape, want.scale.shape)
    assert (got.scale_layout, got.group_axis, got.block_rows) == (
        want.scale_layout, want.group_axis, want.block_rows), what
    assert torch.equal(got.scale.cpu(), want.scale.cpu()), f"{what}: scale bytes differ"
    gd, wd = got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu()
    assert torch.equal(gd, wd), f"{what}: {(gd != wd).sum().item()} data bytes differ"


def _misaligned(x):
    """The same values as ``x``, contiguous, starting 2 elements into their storage."""
    buf = torch.empty(x.numel() + 2, dtype=x.dtype, device=x.device)
    v = buf[2:].view(x.shape)
    v.copy_(x)
    return v


# ---------------------------------------------------------------------------------------------
# CPU: the reference path accepts every edge, with the table's sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k", COLWISE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_colwise_any_extent(m, k, dtype):
    x = _x((m, k), dtype)
    t = P.quantize_colwise(x, backend="reference")
    assert t.data.shape == (k, m)
    assert t.scale.numel() == L.packed_scale_bytes(k, L.ceil_div(m, 32))
    # The columnwise bytes are the rowwise bytes of x.T with M zero-padded to 32 (definition).
    mp = L.round_up(m, 32)
    pad = torch.zeros(mp, k, dtype=dtype)
    pad[:m] = x
    row = P.quantize_rowwise(pad.t().contiguous(), scale_layout="dense", backend="reference")
    dense = P.quantize_colwise(x, scale_layout="dense", backend="reference")
    assert torch.equal(dense.scale, row.scale)
    assert torch.equal(dense.data.view(torch.uint8), row.data.view(torch.uint8)[:, :m])


@pytest.mark.parametrize("m,k", ROWWISE_SHAPES)
def test_rowwise_dual_empty_and_small(m, k):
    x = _x((m, k))
    row = P.quantize_rowwise(x, backend="reference")
    assert row.data.shape == (m, k) and row.scale.numel() == L.packed_scale_bytes(m, k // 32)
    r2, c2 = P.quantize_dual(x, backend="reference")
    assert_same(r2, row, "dual/row")
    assert_same(c2, P.quantize_colwise(x, backend="reference"), "dual/col")


@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("k", [0, 19, 64])
def test_grouped_edges(sizes, k):
    m = sum(sizes)
    offs = _offs(sizes)
    x = _x((m, k))
    col = P.quantize_colwise(x, offs=offs, backend="reference")
    assert col.data.shape == (k, m)
    assert col.scale.numel() == L.grouped_k_scale_bytes(k, m, len(sizes))
    dense = P.quantize_colwise(x, offs=offs, scale_layout="dense", backend="reference")
    assert dense.scale.shape == (k, L.grouped_k_num_blocks(offs))
    if k % 32 == 0:
        row, col2 = P.quantize_dual(x, offs=offs, backend="reference")
        assert row.scale.numel() == L.grouped_rows_scale_bytes(m, k // 32, len(sizes))
        assert_same(col2, col, "dual/col")
    if m == 0 or k == 0:  # nothing but pad bytes
        assert not col.scale.any()


@pytest.mark.parametrize("shape,axis,block_rows", WEIGHT_CASES)
def test_weight_edges(shape, axis, block_rows):
    e, n, k = shape
    w = _x(shape)
    t = P.quantize_weights(w, axis=axis, block_rows=block_rows, backend="reference")
    rows, red = (n, k) if axis == "K" else (k, n)
    assert t.data.shape == (e, rows, red)
    assert t.scale.numel() == e * L.expert_scale_stride(rows, L.ceil_div(red, 32))


def test_layout_of_the_input_does_not_matter():
    x = _x((96, 64))
    ref = P.quantize_dual(x, backend="reference")
    for variant in (_misaligned(x), x.t().contiguous().t(), torch.stack([x, x], -1)[..., 0]):
        got = P.quantize_dual(variant, backend="reference")
        assert_same(got[0], ref[0], "row")
        assert_same(got[1], ref[1], "col")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: P.quantize_rowwise(torch.zeros(4, 48)), "multiple of 32, got 48"),
        (lambda: P.quantize_dual(torch.zeros(4, 19)), "multiple of 32, got 19"),
        (lambda: P.quantize_weights(torch.zeros(2, 64, 19)), "axis K must be a multiple of 32"),
        (lambda: P.quantize_weights(torch.zeros(2, 40, 64), axis="N"), "axis N must be"),
        (lambda: P.quantize_weights(torch.zeros(2, 64, 40), axis="N", block_rows=32),
         "other axis"),
        (lambda: P.quantize_colwise(torch.zeros(4, 4, dtype=torch.float64)), "bfloat16"),
        (lambda: P.quantize_colwise(torch.zeros(4)), "must be 2D"),
    ],
)
def test_refusals_are_one_line(call, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_extent_limit_is_checked_on_every_backend():
    big = torch.empty(0, 2**31)  # no memory: an empty tensor with one huge extent
    with pytest.raises(ValueError, match="largest supported extent 2\\^31 - 1"):
        P.quantize_colwise(big, backend="reference")
    with pytest.raises(ValueError, match="E\\*N rows"):
        C.check_extents("w", torch.empty(2**16, 2**15, 0), rows=2**31)


# ---------------------------------------------------------------------------------------------
# CPU: the kernel path's host glue, with a stand-in kernel
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """backend "auto" resolves to "sm90"; the "kernels" check what the real ones require
    (contiguous, 16-byte aligned, no autograd) and return the reference's (data, scale)."""
    seen = []

    def stand_in(op):
        def kernel(x, **kw):
            assert x.is_contiguous() and x.data_ptr() % C.KERNEL_INPUT_ALIGN == 0
            assert kw.get("offs") is None or kw["offs"].is_contiguous()
            assert not x.requires_grad or not torch.is_grad_enabled()
            seen.append((op, tuple(x.shape)))
            if op == "quantize_weights":
                t = R.quantize_weights_ref(x, kw["axis"], kw["rounding"],
                                           block_rows=kw["block_rows"])
                return t.data, t.scale
            sb = {32: "1x32", 128: "1x128"}[kw["act_block"]]
            if op == "quantize_dual":
                return tuple((t.data, t.scale) for t in R.quantize_dual_ref(
                    x, kw["rounding"], "packed", kw["offs"], sb))
            fn = {"quantize_rowwise": R.quantize_rowwise_ref,
                  "quantize_colwise": P._colwise_ref}[op]
            t = fn(x, kw["rounding"], "packed", kw["offs"], sb)
            return t.data, t.scale

        return kernel

    ops = ("quantize_rowwise", "quantize_colwise", "quantize_dual", "quantize_weights")
    kernels = SimpleNamespace(**{op: stand_in(op) for op in ops})
    monkeypatch.setattr(P, "resolve_backend",
                        lambda backend, device: "reference" if backend == "reference" else "sm90")
    monkeypatch.setattr(P, "_kernel_module", lambda: kernels)
    return seen


def test_kernel_path_copies_strided_and_misaligned_inputs(stand_in_kernels):
    x = _x((96, 64))
    want = P.quantize_rowwise(x, backend="reference")
    for variant in (_misaligned(x), x.t().contiguous().t()):
        assert_same(P.quantize_rowwise(variant), want, "rowwise")
    w = _x((2, 64, 32))
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # (2, 64, 32) with strides of (2,32,64)
    assert_same(P.quantize_weights(wt, axis="N"),
                P.quantize_weights(w, axis="N", backend="reference"), "weights")
    assert len(stand_in_kernels) == 3


def test_kernel_path_serves_the_1x128_recipe(stand_in_kernels):
    """scale_blocks="1x128" and block_rows=128 reach the kernels (no reference detour)."""
    x = _x((200, 352))
    offs = _offs([0, 130, 70])
    for fn in (P.quantize_rowwise, P.quantize_colwise, P.quantize_dual):
        got = fn(x, offs=offs, scale_blocks="1x128")
        want = fn(x, offs=offs, scale_blocks="1x128", backend="reference")
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            assert_same(g, w, fn.__name__)
    w = _x((2, 160, 64))
    for axis in ("K", "N"):
        assert_same(P.quantize_weights(w, axis=axis, block_rows=128),
                    P.quantize_weights(w, axis=axis, block_rows=128, backend="reference"), axis)
    assert [op for op, _ in stand_in_kernels] == [
        "quantize_rowwise", "quantize_colwise", "quantize_dual", "quantize_weights",
        "quantize_weights"]


def test_kernel_path_strided_offs(stand_in_kernels):
    x = _x((40, 64))
    offs = torch.stack([_offs([10, 0, 30]), _offs([1, 1, 1])], 1)[:, 0]  # stride 2
    assert not offs.is_contiguous()
    for fn in (P.quantize_rowwise, P.quantize_colwise):
        assert_same(fn(x, offs=offs), fn(x, offs=offs.contiguous(), backend="reference"),
                    fn.__name__)


def test_kernel_path_dense_layout_and_empty(stand_in_kernels):
    for m, k in [(0, 64), (5, 0), (64, 19)]:
        x = _x((m, k))
        assert_same(P.quantize_colwise(x, scale_layout="dense"),
                    P.quantize_colwise(x, scale_layout="dense", backend="reference"), "colwise")
    offs = _offs([3, 0, 2])
    x = _x((5, 0))
    assert_same(P.quantize_colwise(x, offs=offs),
                P.quantize_colwise(x, offs=offs, backend="reference"), "K=0 grouped")


# ---------------------------------------------------------------------------------------------
# Autograd: quantizers are not differentiable (refused, the same on every backend)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rowwise", "colwise", "dual", "weights"])
def test_requires_grad_input_is_refused(name):
    fn = getattr(P, f"quantize_{name}")
    x = _x((2, 32, 64) if name == "weights" else (32, 64), torch.float32).requires_grad_()
    with pytest.raises(ValueError, match="requires grad, but MXFP8 quantization is not "
                                         "differentiable") as info:
        fn(x, backend="reference")
    assert "\n" not in str(info.value)
    with torch.no_grad():  # the documented ways out
        a = fn(x, backend="reference")
    b = fn(x.detach(), backend="reference")
    for ta, tb in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                      strict=True):
        assert not ta.data.requires_grad and ta.data.grad_fn is None
        assert_same(ta, tb, name)


def test_requires_grad_refused_on_the_kernel_path_too(stand_in_kernels):
    x = _x((32, 64), torch.float32).requires_grad_()
    with pytest.raises(ValueError, match="requires grad"):
        P.quantize_rowwise(x)
    assert stand_in_kernels == []


def test_autograd_functions_still_quantize_their_inputs():
    """Inside the layer's autograd Function the inputs require grad but grad mode is off."""
    from moe_mxfp8 import grouped_mm

    x = _x((64, 64), torch.bfloat16).requires_grad_()
    w = (_x((2, 64, 64), torch.bfloat16) / 8).requires_grad_()
    offs = _offs([30, 34])
    y = grouped_mm(x, w.transpose(-2, -1), offs, backend="reference")
    y.float().square().mean().backward()
    assert x.grad is not None and w.grad is not None and torch.isfinite(x.grad.float()).all()


# ---------------------------------------------------------------------------------------------
# Index tensors: every entry that takes ``offs``, every kind of bad ``offs``
# ---------------------------------------------------------------------------------------------

# M = 96 tokens in E = 4 groups, each starting on a multiple of 16 (the K-grouped kernels' need)
IDX_SIZES = [16, 0, 48, 32]
IDX_M, IDX_E, IDX_K, IDX_N = 96, 4, 64, 32


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _strided(offs: torch.Tensor) -> torch.Tensor:
    """The same values as ``offs``, as a column of an ``(E, 2)`` tensor (stride 2)."""
    view = torch.stack([offs, torch.full_like(offs, 7)], 1)[:, 0]
    assert not view.is_contiguous()
    return view


# name -> (offs, error type, message pattern); every value satisfies all but one rule
BAD_OFFS = {
    "int64": (_offs(IDX_SIZES).long(), TypeError, "offs must be int32"),
    "float": (_offs(IDX_SIZES).float(), TypeError, "offs must be int32"),
    "list": (_offs(IDX_SIZES).tolist(), TypeError, "offs must be a torch.Tensor"),
    "2D": (_offs(IDX_SIZES)[None], ValueError, "non-empty 1D"),
    "empty": (_offs(IDX_SIZES)[:0], ValueError, "non-empty 1D"),
    "device": (_offs(IDX_SIZES).to("meta"), ValueError, "device"),
    "length": (_offs([16, 80]), ValueError, "groups"),  # 2 groups ending at M
    "decreasing": (_i32([16, 64, 16, 96]), ValueError, "non-decreasing and non-negative"),
    "negative": (_i32([-16, 16, 64, 96]), ValueError, "non-decreasing and non-negative"),
    "beyond M": (_i32([16, 16, 64, 112]), ValueError, "offs\\[-1\\] must (equal|be at most) "
                 "the grouped extent 96, got 112"),
    "short of M": (_i32([16, 16, 64, 80]), ValueError, "offs\\[-1\\] must equal the grouped "
                   "extent 96, got 80"),
}


def _idx_data():
    x = _x((IDX_M, IDX_K), torch.bfloat16, seed=1)
    w = _x((IDX_E, IDX_N, IDX_K), torch.bfloat16, seed=2) / 8
    dy = _x((IDX_M, IDX_N), torch.bfloat16, seed=3)
    return x, w, dy


def _gemm_operands(mode: str):
    """Quantized operands of an M-grouped (fprop) or K-grouped (wgrad) GEMM, grouped by the
    good ``offs``."""
    x, w, dy = _idx_data()
    offs = _offs(IDX_SIZES)
    if mode == "m":
        return (P.quantize_rowwise(x, offs=offs, backend="reference"),
                P.quantize_weights(w, backend="reference"))
    return (P.quantize_colwise(dy, offs=offs, backend="reference"),
            P.quantize_colwise(x, offs=offs, backend="reference"))


def _entry(name: str, backend: str):
    """The public entry ``name`` as a function of ``offs`` alone (everything else valid)."""
    from moe_mxfp8.kernels.grouped_gemm import problem as GP

    from moe_mxfp8 import grouped_gemm as G
    from moe_mxfp8 import grouped_mm

    x, w, _ = _idx_data()
    if name == "grouped_mm":
        return lambda offs: grouped_mm(x, w.transpose(-2, -1), offs, backend=backend)
    if name in ("grouped_mm_m", "grouped_mm_k"):
        a, b = _gemm_operands(name[-1])
        return lambda offs: getattr(G, name)(a, b, offs, backend=backend)
    if name == "align_k_groups":
        a, b = _gemm_operands("k")
        return lambda offs: GP.align_k_groups(a.data, b.data, offs)
    return lambda offs: getattr(P, name)(x, offs=offs, backend=backend)


OFFS_ENTRIES = ("grouped_mm", "grouped_mm_m", "grouped_mm_k", "quantize_rowwise",
                "quantize_colwise", "quantize_dual", "align_k_groups")
# (entry, bad kind) pairs that are valid: a quantizer takes any group count; align_k_groups
# (kernel internal) leaves tokens past offs[-1] ungrouped
OFFS_VALID = {(q, "length") for q in ("quantize_rowwise", "quantize_colwise", "quantize_dual",
                                      "align_k_groups")} | {("align_k_groups", "short of M")}


@pytest.mark.parametrize("kind", list(BAD_OFFS))
@pytest.mark.parametrize("entry", OFFS_ENTRIES)
def test_bad_offs_one_line_on_every_backend(entry, kind):
    """Each bad ``offs`` gets one error line, raised before any backend is chosen: the
    reference and both kernel backends answer with the very same message."""
    offs, exc, match = BAD_OFFS[kind]
    if (entry, kind) in OFFS_VALID:
        _entry(entry, "reference")(offs)  # accepted
        return
    messages = set()
    for backend in ("reference", "sm90", "sm100"):
        with pytest.raises(exc, match=match) as info:
            _entry(entry, backend)(offs)
        messages.add(str(info.value))
    assert len(messages) == 1, messages
    assert "\n" not in messages.pop()


def _outputs(result):
    return [t.data.view(torch.uint8) if isinstance(t, MXFP8Tensor) else t
            for t in (result if isinstance(result, tuple) else (result,))]


@pytest.mark.parametrize("entry", OFFS_ENTRIES)
def test_strided_offs_gives_the_contiguous_answer(entry):
    offs = _offs(IDX_SIZES)
    got, want = (_outputs(_entry(entry, "reference")(o)) for o in (_strided(offs), offs))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), entry


def test_strided_offs_gradients_match(gen):
    from moe_mxfp8 import grouped_mm

    x, w, dy = _idx_data()
    offs = _offs(IDX_SIZES)
    grads = []
    for o in (_strided(offs), offs):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        grouped_mm(xa, wa.transpose(-2, -1), o, backend="reference").backward(dy)
        grads.append((xa.grad, wa.grad))
    for g, w_ in zip(*grads, strict=True):
        assert torch.equal(g, w_)


@pytest.mark.parametrize("mode", ["m", "k"])
def test_kernel_launch_reads_offs_values_not_its_storage(monkeypatch, mode):
    """The GEMM kernels read ``E`` consecutive int32 at ``offs``' address. A stand-in kernel
    reads exactly that (CPU memory here) at launch: a strided ``offs`` must arrive as a dense
    copy holding its values, alive through the launch."""
    import ctypes

    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm import problem as GP

    from moe_mxfp8 import grouped_gemm as G

    read = []

    def fake_compile(kernel_cls, config, options=None, stream=None, arch=None):
        def kernel(*args):
            offs_ptr, num_groups = args[5], args[7]
            read.append(list((ctypes.c_int32 * num_groups).from_address(offs_ptr.addr)))

        return kernel

    monkeypatch.setattr(launcher, "compile_config", fake_compile)
    monkeypatch.setattr(launcher, "_grid_clusters", lambda *a: 1)
    monkeypatch.setattr(launcher, "current_stream", lambda *a: None)
    offs = _strided(_offs(IDX_SIZES))
    a, b = _gemm_operands(mode)
    prob = (GP.describe_m(a, b, offs, torch.bfloat16) if mode == "m"
            else GP.describe_k(a, b, offs, torch.bfloat16))
    for backend in ("sm90", "sm100"):
        # K-grouped with aligned groups: the caller's offs goes to the kernel as given
        launcher.run(G._host_class(backend), prob, a, b, offs, aligned_groups=mode == "k")
    assert read == [offs.tolist()] * 2


def test_kernel_offs_copies_only_a_strided_view():
    from moe_mxfp8.kernels.grouped_gemm import problem as GP

    offs = _offs(IDX_SIZES)
    assert GP.kernel_offs(offs) is offs  # the hot path: no copy, nothing allocated
    dense = GP.kernel_offs(_strided(offs))
    assert dense.is_contiguous() and torch.equal(dense, offs)


# The data path's stages and its routed-expert block take a route_layout layout: rows, src, offs

DP_T, DP_K, DP_E, DP_D, DP_H = 6, 2, 3, 64, 32


def _dp_layout():
    from moe_mxfp8 import routing as RT

    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1], [2, 1], [1, 0]])
    counts = torch.bincount(ids.reshape(-1), minlength=DP_E)
    return RT.route_layout(ids, counts, 16)  # rows (T, k), src (M,), offs (E,): M = 64


def _dp_entry(name: str, backend: str = "reference"):
    """The data-path entry ``name`` as a function of ``(rows, src, offs)``."""
    from moe_mxfp8 import datapath as DP
    from moe_mxfp8 import stages as ST

    m = _dp_layout()[1].numel()
    x = _x((DP_T, DP_D), torch.bfloat16, seed=4)
    h = _x((m, 2 * DP_H), torch.bfloat16, seed=5)
    da = _x((m, DP_H), torch.bfloat16, seed=6)
    y = _x((m, DP_D), torch.bfloat16, seed=7)
    wts = torch.rand(DP_T, DP_K, generator=torch.Generator().manual_seed(8))
    w_gu = _x((DP_E, 2 * DP_H, DP_D), torch.bfloat16, seed=9) / 8
    w_dn = _x((DP_E, DP_D, DP_H), torch.bfloat16, seed=10) / 8
    be = {"backend": backend}
    return {
        "dispatch": lambda r, s, o: ST.dispatch(x, s, o, DP_K, **be),
        "dispatch_backward": lambda r, s, o: ST.dispatch_backward(y, r, **be),
        "swiglu": lambda r, s, o: ST.swiglu(h, s, o, **be),
        "swiglu_backward": lambda r, s, o: ST.swiglu_backward(da, h, s, o, **be),
        "combine": lambda r, s, o: ST.combine(y, r, wts, **be),
        "combine_backward": lambda r, s, o: ST.combine_backward(x, y, s, r, wts, o, **be),
        "routed_experts": lambda r, s, o: DP.routed_experts(x, w_gu, w_dn, wts, r, s, o, **be),
    }[name]


DP_USES = {"dispatch": "so", "dispatch_backward": "r", "swiglu": "so", "swiglu_backward": "so",
           "combine": "r", "combine_backward": "rso", "routed_experts": "rso"}


def _dp_bad():
    """(which tensor: r/s/o, a bad value for it, error type, message pattern) by name."""
    rows, src, offs = _dp_layout()
    m, pairs = src.numel(), rows.numel()
    src_hi, src_lo, rows_hi = src.clone(), src.clone(), rows.clone()
    src_hi[0], src_lo[0], rows_hi[0, 0] = pairs, -2, m
    return {
        "rows float": ("r", rows.float(), TypeError, "rows must be an int32 .*got torch.float32"),
        "rows bool": ("r", rows > 0, TypeError, "rows must be an int32 .*got torch.bool"),
        "rows 1D": ("r", rows.reshape(-1), ValueError, "rows must be 2D"),
        "rows device": ("r", rows.to("meta"), ValueError, "on meta"),
        "rows beyond M": ("r", rows_hi, ValueError, f"rows values must lie in \\[0, {m}\\)"),
        "src float": ("s", src.float(), TypeError, "src must be an int32 .*got torch.float32"),
        "src 2D": ("s", src[None], ValueError, "src must be 1D"),
        "src device": ("s", src.to("meta"), ValueError, "on meta"),
        "src length": ("s", src[:-16], ValueError, f"src has {m - 16} rows but|offs\\[-1\\]"),
        "src beyond pairs": ("s", src_hi, ValueError, "src values must lie in"),
        "src below -1": ("s", src_lo, ValueError, "src values must lie in"),
        "offs int64": ("o", offs.long(), TypeError, "offs must be int32"),
        "offs device": ("o", offs.to("meta"), ValueError, "device|on meta"),
        "offs decreasing": ("o", offs.flip(0), ValueError, "non-decreasing"),
        "offs short": ("o", offs - 16, ValueError, "must equal the grouped extent"),
    }


# SwiGLU reads only the sign of src (a pad row or not): any pair index is its answer
DP_VALID = {(e, k) for e in ("swiglu", "swiglu_backward")
            for k in ("src beyond pairs", "src below -1")}


@pytest.mark.parametrize("kind", list(_dp_bad()))
@pytest.mark.parametrize("entry", list(DP_USES))
def test_bad_layout_one_line_on_every_backend(entry, kind):
    which, bad, exc, match = _dp_bad()[kind]
    if which not in DP_USES[entry]:
        pytest.skip(f"{entry} takes no {which}")
    args = dict(zip("rso", _dp_layout(), strict=True))
    args[which] = bad
    if (entry, kind) in DP_VALID:
        _dp_entry(entry)(args["r"], args["s"], args["o"])  # accepted
        return
    messages = set()
    for backend in ("reference", "auto"):
        with pytest.raises(exc, match=match) as info:
            _dp_entry(entry, backend)(args["r"], args["s"], args["o"])
        messages.add(str(info.value))
    assert len(messages) == 1 and "\n" not in messages.pop()


@pytest.mark.parametrize("entry", list(DP_USES))
def test_strided_or_int64_layout_gives_the_same_answer(entry):
    rows, src, offs = _dp_layout()
    strided = (rows.t().contiguous().t(), _strided(src), _strided(offs))
    assert not any(t.is_contiguous() for t in strided)
    wide = (rows.long(), src.long(), offs)  # int64 rows / src index alike
    want = _dp_entry(entry)(rows, src, offs)
    for lay in (strided, wide):
        got = _dp_entry(entry)(*lay)
        for g, w in zip(*(_outputs(r) if isinstance(r, tuple) else [r] for r in (got, want)),
                        strict=True):
            if g is None:
                assert w is None
            else:
                assert torch.equal(g, w), entry


def _ep_index_cases():
    idx = torch.tensor([3, 0, 5, 5, 1], dtype=torch.int64)
    return {
        "float": (idx.float(), TypeError, "index must be an int32 or int64 tensor"),
        "2D": (idx[None], ValueError, "index must be 1D"),
        "device": (idx.to("meta"), ValueError, "on meta"),
        "beyond T": (idx + 1, ValueError, "index values must lie in \\[0, 6\\)"),
        "negative": (idx - 1, ValueError, "index values must lie in"),
    }


@pytest.mark.parametrize("kind", list(_ep_index_cases()))
def test_ep_payload_index_one_line(kind):
    """The expert-parallel payload's row index (the pairs a rank sends), on every backend."""
    from moe_mxfp8 import expert_parallel as EP

    bad, exc, match = _ep_index_cases()[kind]
    x = _x((6, 64), torch.bfloat16, seed=12)
    messages = set()
    for backend in ("reference", "auto"):
        with pytest.raises(exc, match=match) as info:
            EP.pack_mxfp8_rows(x, bad, backend)
        messages.add(str(info.value))
    assert len(messages) == 1 and "\n" not in messages.pop()


def test_ep_payload_strided_index():
    from moe_mxfp8 import expert_parallel as EP

    x = _x((6, 64), torch.bfloat16, seed=12)
    idx = torch.tensor([3, 0, 5, 5, 1], dtype=torch.int64)
    both = torch.stack([idx, idx.flip(0)], 1)
    assert torch.equal(EP.pack_mxfp8_rows(x, both[:, 0], "reference"),
                       EP.pack_mxfp8_rows(x, idx, "reference"))
    assert torch.equal(EP.pack_mxfp8_rows(x, idx.int(), "reference"),
                       EP.pack_mxfp8_rows(x, idx, "reference"))


# ---------------------------------------------------------------------------------------------
# Integer widths: sizes the kernels take as 32-bit integers are bounded where they are known
# ---------------------------------------------------------------------------------------------


def _meta_operands(m: int, k: int, n: int, e: int):
    """M-grouped operands of ``m`` tokens described by shape alone (meta tensors: nothing is
    allocated), with scale buffers of the sizes the layout needs."""
    from moe_mxfp8.kernels import mx_format as F

    nb = F.ceil_div(k, F.BLOCK_SIZE)
    meta = {"device": "meta"}
    a = SimpleNamespace(
        data=torch.empty(m, k, dtype=torch.float8_e4m3fn, **meta), shape=(m, k),
        scale=torch.empty(F.grouped_rows_scale_bytes(m, nb, e), dtype=torch.uint8, **meta),
        scale_layout="packed", group_axis="rows", block_rows=1, offs=None)
    b = SimpleNamespace(
        data=torch.empty(e, n, k, dtype=torch.float8_e4m3fn, **meta), shape=(e, n, k),
        scale=torch.empty(e * F.expert_scale_stride(n, nb), dtype=torch.uint8, **meta),
        scale_layout="packed", group_axis="experts", block_rows=1, offs=None)
    return a, b, torch.empty(e, dtype=torch.int32, **meta)


def test_scale_bytes_beyond_int32_are_refused_on_every_backend():
    """About 9.6 M tokens at K = 7168 need 2^31 scale bytes: refused where the problem is
    described (the one check every backend goes through), not wrapped in an Int32."""
    from moe_mxfp8.kernels.grouped_gemm import problem as GP

    k, n, e = 7168, 2048, 8
    ok = GP.describe_m(*_meta_operands(9_000_000, k, n, e), torch.bfloat16)
    assert ok.m == 9_000_000
    with pytest.raises(ValueError, match="a needs \\d+ scale bytes, above the largest "
                                         "supported 2\\^31 - 1") as info:
        GP.describe_m(*_meta_operands(9_600_000, k, n, e), torch.bfloat16)
    assert "\n" not in str(info.value)


def test_k_grouped_scale_bytes_beyond_int32_are_refused():
    from moe_mxfp8.kernels import mx_format as F
    from moe_mxfp8.kernels.grouped_gemm import problem as GP

    m, e = 40_000_000, 8
    meta = {"device": "meta"}

    def operand(rows):
        return SimpleNamespace(
            data=torch.empty(rows, m, dtype=torch.float8_e4m3fn, **meta), shape=(rows, m),
            scale=torch.empty(F.grouped_k_scale_bytes(rows, m, e), dtype=torch.uint8, **meta),
            scale_layout="packed", group_axis="k", block_rows=1, offs=None)

    offs = torch.empty(e, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match="b needs \\d+ scale bytes"):
        GP.describe_k(operand(128), operand(7168), offs, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# GPU: every edge through the kernels, bit-exact against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", COLWISE_SHAPES)
def test_gpu_colwise_any_extent(m, k, dtype, recipe):
    from moe_mxfp8.kernels import quantize_launch as Q

    x = _x((m, k), dtype, "cuda", seed=m * 31 + k)
    want = R.quantize_colwise_ref(x, scale_blocks=recipe)
    assert_same(P.quantize_colwise(x, scale_blocks=recipe), want, f"colwise {(m, k)}")
    nbytes = L.packed_scale_bytes(k, L.ceil_div(m, 32))
    out = {"q_col": torch.full((k, m), 0xAB, dtype=torch.uint8, device="cuda")
           .view(torch.float8_e4m3fn),
           "s_col": torch.full((nbytes,), 0xAB, dtype=torch.uint8, device="cuda")}
    got = Q.quantize_colwise(x, rounding="rceil", act_block=ACT_BLOCK[recipe], out=out)
    assert_same(MXFP8Tensor(*got, "packed"), want, "poisoned")
    if dtype == torch.float32:
        assert_same(P.quantize_colwise(x, rounding="floor", scale_blocks=recipe),
                    R.quantize_colwise_ref(x, "floor", scale_blocks=recipe), "floor")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m,k", ROWWISE_SHAPES)
def test_gpu_rowwise_dual_edges(m, k, recipe):
    x = _x((m, k), torch.bfloat16, "cuda", seed=m + k)
    want_row = R.quantize_rowwise_ref(x, scale_blocks=recipe)
    assert_same(P.quantize_rowwise(x, scale_blocks=recipe), want_row, "rowwise")
    row, col = P.quantize_dual(x, scale_blocks=recipe)
    assert_same(row, want_row, "dual/row")
    assert_same(col, R.quantize_colwise_ref(x, scale_blocks=recipe), "dual/col")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("k", [0, 19, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_edges(sizes, k, dtype, recipe):
    m = sum(sizes)
    offs = _offs(sizes, "cuda")
    x = _x((m, k), dtype, "cuda", seed=m + k)
    sb = {"scale_blocks": recipe}
    assert_same(P.quantize_colwise(x, offs=offs, **sb),
                P.quantize_colwise(x, offs=offs, backend="reference", **sb), "colwise/offs")
    assert_same(P.quantize_colwise(x, offs=offs, scale_layout="dense", **sb),
                P.quantize_colwise(x, offs=offs, scale_layout="dense", backend="reference", **sb),
                "colwise/offs/dense")
    if k % 32 == 0:
        row, col = P.quantize_dual(x, offs=offs, **sb)
        assert_same(row, R.quantize_rowwise_ref(x, offs=offs, **sb), "dual/row/offs")
        assert_same(col, P.quantize_colwise(x, offs=offs, backend="reference", **sb),
                    "dual/col/offs")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,axis,block_rows", WEIGHT_CASES)
def test_gpu_weight_edges(shape, axis, block_rows):
    w = _x(shape, torch.bfloat16, "cuda", seed=sum(shape))
    want = R.quantize_weights_ref(w, axis, block_rows=block_rows)
    assert_same(P.quantize_weights(w, axis=axis, block_rows=block_rows), want, "weights")
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not contiguous
    assert_same(P.quantize_weights(wt, axis=axis, block_rows=block_rows), want, "strided")


@pytest.mark.gpu
def test_gpu_input_layout_and_autograd_edges():
    x = _x((96, 64), torch.float16, "cuda")
    want = R.quantize_dual_ref(x)
    for variant in (_misaligned(x), x.t().contiguous().t(), torch.stack([x, x], -1)[..., 0]):
        row, col = P.quantize_dual(variant)
        assert_same(row, want[0], "row")
        assert_same(col, want[1], "col")
    offs = torch.stack([_offs([10, 0, 86], "cuda"), _offs([1, 1, 1], "cuda")], 1)[:, 0]
    row, col = P.quantize_dual(x, offs=offs)  # strided offs
    assert_same(row, R.quantize_rowwise_ref(x, offs=offs.contiguous()), "offs/row")
    assert_same(col, R.quantize_colwise_ref(x, offs=offs.contiguous()), "offs/col")
    xg = x.float().requires_grad_()
    with pytest.raises(ValueError, match="requires grad"):
        P.quantize_colwise(xg)
    with torch.no_grad():
        assert_same(P.quantize_colwise(xg), R.quantize_colwise_ref(xg.detach()), "no_grad")


@pytest.mark.gpu
@pytest.mark.parametrize("scale_blocks", RECIPES)
def test_gpu_grouped_mm_strided_offs(scale_blocks):
    """A strided ``offs`` (a column of an ``(E, 2)`` tensor) through the kernels, forward and
    backward: equal to the same call with ``offs.contiguous()`` and close to fp32 (outputs
    poisoned first: the allocator hands back NaN-filled blocks). Before the fix the kernels
    read the (E, 2) storage as offs: relative errors of 1.41 (1x32) and 1.18 (1x128)."""
    from moe_mxfp8 import grouped_mm

    dev = "cuda"
    m, k, n, e = 1024, 256, 512, 4
    sizes = [256, 0, 384, 384]  # 128-row starts: valid for both recipes' layer layouts
    rng = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(m, k, generator=rng, device=dev).to(torch.bfloat16)
    w = (torch.randn(e, n, k, generator=rng, device=dev) * k**-0.5).to(torch.bfloat16)
    dy = torch.randn(m, n, generator=rng, device=dev).to(torch.bfloat16)
    offs = _offs(sizes, dev)
    both = torch.stack([offs, torch.arange(e, dtype=torch.int32, device=dev) * 5 + 3], 1)
    strided = both[:, 0]
    assert not strided.is_contiguous()

    def run(o):
        # poison the allocator's cached blocks (large and small pool): 0xFF is NaN in any
        # float dtype, so an output element no kernel writes shows up
        junk = [torch.empty(64 << 20, dtype=torch.uint8, device=dev)]
        junk += [torch.empty(512 << 10, dtype=torch.uint8, device=dev) for _ in range(32)]
        for t in junk:
            t.fill_(0xFF)
        del junk
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xa, wa.transpose(-2, -1), o, scale_blocks=scale_blocks)
        y.backward(dy)
        return y, xa.grad, wa.grad

    got, want = run(strided), run(offs.contiguous())
    for name, g, c in zip(("out", "dx", "dw"), got, want, strict=True):
        assert torch.isfinite(g.float()).all(), name
        assert torch.equal(g, c), name
    # fp32 reference of the same GEMMs (bounds: MXFP8 operands, ~2^-4 relative per element)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    yr = torch.cat([xr[s:t] @ wr[g].t() for g, (s, t) in
                    enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True))])
    yr.backward(dy.float())
    for name, g, r in zip(("out", "dx", "dw"), got, (yr, xr.grad, wr.grad), strict=True):
        rel = ((g.float() - r).norm() / r.norm()).item()
        assert rel < 0.1, (name, rel)


@pytest.mark.gpu
def test_gpu_strided_offs_in_a_cuda_graph():
    """The dense copy of a strided ``offs`` is made inside the captured graph: a replay after
    new group sizes were written into the base tensor reads the new values."""
    from moe_mxfp8 import grouped_gemm as G

    dev = "cuda"
    rng = torch.Generator(device=dev).manual_seed(21)
    x = torch.randn(512, 128, generator=rng, device=dev).to(torch.bfloat16)
    w = (torch.randn(4, 64, 128, generator=rng, device=dev) / 8).to(torch.bfloat16)
    both = torch.stack([_offs([100, 0, 300, 112], dev), _offs([1, 1, 1, 1], dev)], 1)
    offs = both[:, 0]
    a = R.quantize_rowwise_ref(x, offs=offs.contiguous())
    b = R.quantize_weights_ref(w, axis="K")
    G.grouped_mm_m(a, b, offs)  # compile and check outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = G.grouped_mm_m(a, b, offs)
    both[:, 0] = _offs([0, 200, 200, 112], dev)
    a2 = R.quantize_rowwise_ref(x, offs=offs.contiguous())
    a.data.copy_(a2.data)
    a.scale.copy_(a2.scale)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    want = G.grouped_mm_m(a2, b, offs.contiguous(), backend="reference")
    # the same MXFP8 products summed in another order, one BF16 rounding each
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-6, atol=2**-6)
