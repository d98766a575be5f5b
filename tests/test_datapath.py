"""The MoE data path (`moe_mxfp8.datapath`): routing layout, references, the routed-expert custom
ops, and the Triton kernels bit for bit against the references.

CPU/CI: the references and the custom ops (opcheck, torch.compile, autograd vs the eager
expressions they replace). Where Triton is installed without a GPU, the kernels also run in
Triton's interpreter (``TRITON_INTERPRET=1``). GPU (``-m gpu``): the compiled kernels vs the
references on the device (quantized bytes, scale bytes, BF16 values; the routing-weight gradient,
a feature-tile reduction in another order, within 1 BF16 ulp), every output poisoned first, and
two forward+backward runs of `MXFP8MoE` bitwise identical in both precisions, also replayed from
one CUDA graph.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import datapath as DP
from moe_mxfp8 import reference as R
from moe_mxfp8 import routing as RT
from moe_mxfp8 import stages as ST
from moe_mxfp8.autograd import grouped_mm
from tests.triton_sm90 import run_interpreted

BF16 = torch.bfloat16
HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_routing(gen, t, k, e, device="cpu", empty_last=True):
    """Expert ids (T, k) without repeats per token (the last expert idle) and their counts."""
    e_used = e - 1 if empty_last and e > k else e
    ids = torch.stack([torch.randperm(e_used, generator=gen)[:k] for _ in range(t)])
    ids[: t // 3] = torch.arange(k)  # skew towards the first experts
    counts = torch.zeros(e, dtype=torch.int64).scatter_add(0, ids.reshape(-1),
                                                           torch.ones(t * k, dtype=torch.int64))
    return ids.to(device), counts.to(device)


def u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_dw_close(got, ref, dout, y, rows, what="dw"):
    """Routing-weight gradients: BF16 roundings of fp32 sums of the same BF16 products
    ``dout[t] * y[rows[t, j]]`` in another order. They may differ by a BF16 ulp of the value
    (rtol 2^-7) plus the reordering's fp32 error, which a cancelling sum can make large against
    its value but not against the products' magnitudes: within 2^-18 of their sum (tree sums of
    up to 2^14 terms: about 2^-20; one product missing or doubled is above 2^-14 of it)."""
    mag = (dout.float()[:, None, :] * y.float()[rows.long()]).abs().sum(-1).to(got.device)
    err = (got.float() - ref.float()).abs()
    bound = 2**-7 * ref.float().abs() + 2**-18 * mag
    i = int((err - bound).argmax())
    assert (err <= bound).all(), (f"{what}: {float(got.flatten()[i])} vs "
                                  f"{float(ref.flatten()[i])}, bound {float(bound.flatten()[i])}")


def assert_mx_equal(a, b, what):
    assert torch.equal(u8(a.data), u8(b.data)), f"{what}: data bytes differ"
    assert torch.equal(a.scale, b.scale), f"{what}: scale bytes differ"


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 16, 128])
def test_route_layout(gen, align):
    t, k, e = 53, 3, 7
    ids, counts = make_routing(gen, t, k, e)
    rows, src, offs = RT.route_layout(ids, counts, align)
    m = src.numel()
    assert m == RT.padded_extent(t * k, e, align) and int(offs[-1]) == m
    assert rows.dtype == src.dtype == offs.dtype == torch.int32
    flat = rows.reshape(-1).long()
    assert flat.unique().numel() == t * k  # every pair its own row
    assert torch.equal(src[flat], torch.arange(t * k, dtype=torch.int32))  # src inverts rows
    assert int((src >= 0).sum()) == t * k
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    assert (starts % align == 0).all()
    g = torch.searchsorted(offs.long(), flat, right=True)
    assert torch.equal(g, ids.reshape(-1))  # each pair in its expert's group
    for e_ in range(e):  # tokens keep their order inside a group (stable)
        r = flat[ids.reshape(-1) == e_]
        assert (r[1:] > r[:-1]).all()


@pytest.mark.parametrize("align", [1, 16, 128])
def test_sorted_layout_is_route_layout_of_sorted_rows(gen, align):
    """Rows that come sorted by expert (torchtitan's experts call): the layout built from the
    counts alone equals `route_layout`'s of their expert ids bit for bit, for empty first, middle
    and last groups, uneven and aligned sizes, one busy expert, no rows, int32 and int64."""
    rand = torch.randint(0, 40, (9,), generator=gen)
    rand[torch.randperm(9, generator=gen)[:3]] = 0
    cases = [rand, torch.tensor([0, 7, 0, 19, 3, 11, 0]), torch.tensor([16, 16, 0, 128, 1]),
             torch.tensor([0, 0, 40, 0, 0]), torch.zeros(4, dtype=torch.int64),
             torch.tensor([5, 0, 300], dtype=torch.int32)]
    for counts in cases:
        ids = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        want = RT.route_layout(ids[:, None], counts, align)
        got = RT.sorted_layout(counts, ids.numel(), align)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sorted_layout_without_host_sync():
    """On CUDA counts: no host sync (sync debug mode "error"), the CPU's layout."""
    counts = torch.tensor([130, 0, 77, 301, 5, 200])
    want = RT.sorted_layout(counts, 713, 128)
    c = counts.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = RT.sorted_layout(c, 713, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(got, want, strict=True):
        assert a.is_cuda and torch.equal(a.cpu(), b)


def test_sorted_layout_bad_arguments():
    with pytest.raises(ValueError, match="sorted_layout: counts must sum to m=8, got 7"):
        RT.sorted_layout(torch.tensor([3, 4]), 8, 16)
    with pytest.raises(ValueError, match="sorted_layout: align must be a positive int"):
        RT.sorted_layout(torch.tensor([3, 4]), 7, 0)


@pytest.mark.parametrize("block", [32, 128])
def test_block_table_covers_every_row_once(gen, block):
    ids, counts = make_routing(gen, 90, 2, 6)
    _, src, offs = RT.route_layout(ids, counts, 16)
    m = src.numel()
    tbl = RT.block_table(offs, m, block).long()
    rs, re, prow0, tiles, lblk, nblk = tbl.unbind(1)
    hits = torch.zeros(m, dtype=torch.int64)
    for a, b in zip(rs.tolist(), re.tolist(), strict=True):
        hits[a:b] += 1
    assert (hits == 1).all()
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    g = torch.searchsorted(offs.long(), rs, right=True).clamp(max=offs.numel() - 1)
    live = re > rs
    assert ((rs - starts[g])[live] == block * lblk[live]).all()
    assert (re - rs <= block).all() and (lblk < nblk)[live].all()


@pytest.mark.parametrize("align", [1, 16, 128])
def test_row_tables_tile_ends_are_the_quantizers(gen, align):
    """`row_tables` (the step's tables, built once for every stage): its block table is
    `block_table`'s and its tile ends are the grouped quantizer's own (`group_tile_ends`: each
    group's 128-row tiles, empty groups included), int32 and dense as the quantizer reads them."""
    from moe_mxfp8.kernels import quantize_launch as QL

    for t in (1, 5, 300):  # the last expert idle; few tokens: more empty groups
        ids, counts = make_routing(gen, t, 2, 7)
        _, src, offs = RT.route_layout(ids, counts, align)
        m = src.numel()
        for block in (32, 128):
            table, tile_ends = RT.row_tables(offs, m, block)
            assert torch.equal(table, RT.block_table(offs, m, block))
            assert tile_ends.dtype == torch.int32 and tile_ends.is_contiguous()
            assert torch.equal(tile_ends, QL.group_tile_ends(offs))
        sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
        assert torch.equal(tile_ends.long(), torch.cumsum(-(-sizes // 128), 0))


def test_quantizer_tile_ends_argument_checked():
    """A `tile_ends` the quantizer cannot read is one error line, not a wrong launch."""
    from moe_mxfp8.kernels import quantize_launch as QL

    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    assert QL._group_tables(offs, 48, QL.group_tile_ends(offs))[1].tolist() == [1, 1, 2]
    for bad in (torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
                torch.zeros(6, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="tile_ends must be a contiguous int32"):
            QL._group_tables(offs, 48, bad)


# ---------------------------------------------------------------------------------------------
# References vs the eager expressions they replace (CPU)
# ---------------------------------------------------------------------------------------------


def _eager_block(x, w_gu, w_dn, weights, ids, counts, precision, scale_blocks="1x32"):
    """The pre-datapath composition: gather, grouped GEMMs, silu * up, index_copy, BF16 combine."""
    t, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)
    if precision == "bf16":
        offs = torch.cumsum(counts, 0).to(torch.int32)

        def mm(a, w):
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    else:
        offs = torch.cumsum(counts, 0).to(torch.int32)

        def mm(a, w):
            return grouped_mm(a, w.transpose(-2, -1), offs, backend="reference",
                              scale_blocks=scale_blocks)
    h = mm(x[order // k], w_gu)
    gate, up = h.chunk(2, dim=-1)
    ys = mm(F.silu(gate) * up, w_dn)
    pairs = torch.empty_like(ys).index_copy_(0, order, ys).reshape(t, k, -1)
    return (pairs * weights.to(BF16).unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("precision,scale_blocks,shape", [
    ("bf16", "1x32", (45, 2, 5, 64, 96)), ("mxfp8", "1x32", (45, 2, 5, 64, 96)),
    ("mxfp8", "1x128", (45, 2, 5, 64, 96)),
    # few experts, small H: the down projection's weight gradient is computed early (its dY
    # operand is the larger tensor), not after the gate/up GEMMs
    ("bf16", "1x32", (100, 2, 2, 64, 32)), ("mxfp8", "1x32", (100, 2, 2, 64, 32))])
def test_routed_experts_matches_eager_composition(gen, precision, scale_blocks, shape):
    """Same values as the expressions the data path replaced (k = 2: the fp32 segmented sum of
    dx equals the BF16 index_put accumulation), reference backend, exact. 1x128: the old
    sort-and-pad path's unpadded grouped GEMMs (zero pad rows raise no 128-block's amax)."""
    t, k, e, d, hh = shape
    ids, counts = make_routing(gen, t, k, e)
    x = torch.randn(t, d, generator=gen).to(BF16)
    w_gu = (torch.randn(e, 2 * hh, d, generator=gen) * d**-0.5).to(BF16)
    w_dn = (torch.randn(e, d, hh, generator=gen) * hh**-0.5).to(BF16)
    weights = torch.rand(t, k, generator=gen)
    dout = torch.randn(t, d, generator=gen).to(BF16)
    align = {"bf16": 1, "1x32": 16, "1x128": 128}["bf16" if precision == "bf16" else scale_blocks]
    rows, src, offs = RT.route_layout(ids, counts, align)
    res = []
    for fused in (True, False):
        leaves = [v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)]
        if fused:
            out = DP.routed_experts(*leaves, rows, src, offs, precision=precision,
                                    backend="reference", scale_blocks=scale_blocks)
        else:
            out = _eager_block(*leaves, ids, counts, precision, scale_blocks)
        out.backward(dout)
        res.append([out] + [v.grad for v in leaves])
    for name, a, b in zip(["out", "dx", "dw_gu", "dw_dn", "dweights"], *res, strict=True):
        assert torch.equal(a, b), name


def test_references_against_autograd(gen):
    """dispatch_backward = autograd of the gather (fixed order); combine_backward's dY and dw =
    autograd of the BF16 combine; swiglu_backward = autograd of silu(gate) * up."""
    t, k, e, d, hh = 40, 3, 4, 64, 32
    ids, counts = make_routing(gen, t, k, e)
    rows, src, offs = RT.route_layout(ids, counts, 1)
    m = src.numel()
    y = torch.randn(m, d, generator=gen).to(BF16).requires_grad_()
    w = torch.rand(t, k, generator=gen).requires_grad_()
    out = ST.combine_ref(y, rows, w)
    dout = torch.randn(t, d, generator=gen).to(BF16)
    out.backward(dout)
    _, _, dy, dw = ST.combine_backward_ref(dout, y.detach(), src, rows, w.detach(), offs,
                                           qrow=False, qcol=False, keep_bf16=True)
    assert torch.equal(dy, y.grad)
    assert_dw_close(dw, w.grad, dout, y.detach(), rows)  # BF16 sums in another order
    h = torch.randn(m, 2 * hh, generator=gen).to(BF16).requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    da = torch.randn_like(a)
    a.backward(da)
    _, _, a_ref = ST.swiglu_ref(h.detach(), src, offs, qrow=False, qcol=False, keep_bf16=True)
    assert torch.equal(a_ref, a.detach())
    _, _, dh = ST.swiglu_backward_ref(da, h.detach(), src, offs, qrow=False, qcol=False,
                                      keep_bf16=True)
    assert torch.equal(dh, h.grad)
    dxs = torch.randn(m, d, generator=gen).to(BF16)
    acc = sum(dxs[rows[:, j].long()].float() for j in range(k))
    assert torch.equal(ST.dispatch_backward_ref(dxs, rows), acc.to(BF16))


def _op_args(gen, precision, wgrad, save, scale_blocks="1x32", t=24, hh=32):
    """The forward op's arguments (k 2, E 3, D 64) on fresh random data, groups aligned as the
    layer aligns them for ``scale_blocks``."""
    k, e, d = 2, 3, 64
    ids, counts = make_routing(gen, t, k, e)
    align = 1 if precision != "mxfp8" else 128 if scale_blocks == "1x128" else 16
    rows, src, offs = RT.route_layout(ids, counts, align)
    x = torch.randn(t, d, generator=gen).to(BF16)
    w_gu = torch.randn(e, 2 * hh, d, generator=gen).to(BF16)
    w_dn = torch.randn(e, d, hh, generator=gen).to(BF16)
    weights = torch.rand(t, k, generator=gen)
    return (x, w_gu, w_dn, weights, rows, src, offs, precision, "reference", wgrad, scale_blocks,
            save)


@pytest.mark.parametrize("precision,wgrad", [("mxfp8", "mxfp8"), ("mxfp8", "bf16"),
                                             ("bf16", "mxfp8")])
def test_opcheck(gen, precision, wgrad):
    args = _op_args(gen, precision, wgrad, True)
    grads = [a.requires_grad_() if i < 4 else a for i, a in enumerate(args)]
    torch.library.opcheck(torch.ops.moe_mxfp8.routed_experts_fwd.default, tuple(grads),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
    out = torch.ops.moe_mxfp8.routed_experts_fwd(*[a.detach() if i < 4 else a
                                                   for i, a in enumerate(args)])
    opcheck_backward_phases(args, out, precision, wgrad, "1x32")


def opcheck_backward_phases(args, out, precision, wgrad, scale_blocks, optional=()):
    """`torch.library.opcheck` (schema, fake implementation) of backward's four operators on
    the saved tensors of a forward (``args`` its inputs, ``out`` its outputs), the down
    projection's weight gradient in the first phase and in the last; ``optional``: the tables
    and the N-axis weights."""
    x, w_gu, w_dn, weights, rows, src, offs = (a.detach() for a in args[:7])
    _, sx, sxs, h, sa, sas, y = out[:7]
    table, tile_ends, gu_n, gu_ns, dn_n, dn_ns = (*optional, *[None] * 6)[:6]
    dout = torch.randn_like(out[0])
    cfg = (precision, "reference", wgrad, scale_blocks)
    checks = ("test_schema", "test_faketensor")
    ops = torch.ops.moe_mxfp8
    for late in (False, True):
        down = (dout, y, w_dn, weights, rows, src, offs, sa, sas, *cfg, True, True, True, late,
                table, tile_ends, dn_n, dn_ns)
        torch.library.opcheck(ops.routed_experts_bwd_down.default, down, test_utils=checks)
        da, dy_w, dy_w_s, _, _ = ops.routed_experts_bwd_down(*down)
        swiglu = (da, h, src, offs, *cfg, True, True, table, tile_ends)
        torch.library.opcheck(ops.routed_experts_bwd_swiglu.default, swiglu, test_utils=checks)
        dh_rows, dh_rows_s, dh_w, dh_w_s = ops.routed_experts_bwd_swiglu(*swiglu)
        torch.library.opcheck(
            ops.routed_experts_bwd_dx.default,
            (dh_rows, dh_rows_s, w_gu, rows, offs, precision, "reference", scale_blocks, gu_n,
             gu_ns), test_utils=checks)
        if precision != "mxfp8":
            dh_w, dh_w_s = dh_rows, dh_rows_s
        torch.library.opcheck(
            ops.routed_experts_bwd_dw.default,
            (dh_w, dh_w_s, sx, sxs, dy_w, dy_w_s, sa, sas, offs, *cfg, late), test_utils=checks)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_compile_fullgraph_matches_eager(gen, precision):
    args = _op_args(gen, precision, "mxfp8", True)
    x, w_gu, w_dn, weights, rows, src, offs = args[:7]
    dout = torch.randn(x.shape, generator=gen).to(BF16)

    def f(x, w_gu, w_dn, weights):
        return DP.routed_experts(x, w_gu, w_dn, weights, rows, src, offs, precision=precision,
                                 backend="reference")

    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out] + [v.grad for v in leaves])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("scale_blocks", ["1x32", "32x32", "1x128"])
def test_down_along_n_kept_from_forward(gen, monkeypatch, scale_blocks):
    """``keep_down_n``: forward quantizes ``w_down`` along both axes from one read and
    backward's first GEMM reads the N-axis copy instead of quantizing the BF16 weights again.
    Its bytes are `quantize_weights(axis="N")`'s, every output and gradient equals the path
    without it bit for bit, and the op's schema, fake and autograd registration hold with it."""
    x, w_gu, w_dn, weights, rows, src, offs = _op_args(
        gen, "mxfp8", "mxfp8", True, scale_blocks, t=40, hh=64 if scale_blocks == "1x128" else 32
    )[:7]
    dout = torch.randn(x.shape, generator=gen).to(BF16)
    rows_w = {"1x32": 1, "32x32": 32, "1x128": 128}[scale_blocks]
    calls = []  # (shape, axis) of every one-axis weight quantization
    one_axis = DP.quantize_weights

    def counted(w, *, axis, **kw):
        calls.append((tuple(w.shape), axis))
        return one_axis(w, axis=axis, **kw)

    monkeypatch.setattr(DP, "quantize_weights", counted)

    def run(keep):
        leaves = [v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)]
        outs = torch.ops.moe_mxfp8.routed_experts_fwd(
            *leaves, rows, src, offs, "mxfp8", "reference", "mxfp8", scale_blocks, True,
            *[None] * 10, keep)
        outs[0].backward(dout)
        return outs, [outs[0].detach()] + [v.grad for v in leaves]

    gate_up = [(tuple(w_gu.shape), axis) for axis in "KN"]
    calls.clear()
    outs, kept = run(True)
    assert sorted(calls) == gate_up
    ref_n = one_axis(w_dn, axis="N", block_rows=rows_w, backend="reference")
    assert torch.equal(outs[7], ref_n.data.view(torch.uint8)) and torch.equal(outs[8],
                                                                                ref_n.scale)
    calls.clear()
    outs_plain, plain = run(False)
    assert sorted(calls) == sorted(gate_up + [(tuple(w_dn.shape), axis) for axis in "KN"])
    assert all(o.numel() == 0 for o in outs_plain[7:])
    for a, b in zip(kept, plain, strict=True):
        assert torch.equal(a, b)
    args = (*[v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)], rows, src, offs,
            "mxfp8", "reference", "mxfp8", scale_blocks, True, *[None] * 10, True)
    torch.library.opcheck(torch.ops.moe_mxfp8.routed_experts_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


def test_routed_experts_keeps_down_n_only_for_its_dgrad(gen, monkeypatch):
    """`routed_experts` asks forward for ``w_down`` along N only when backward's first GEMM
    will read it: a gradient for x or an expert weight, MXFP8, weights not given quantized."""
    args = _op_args(gen, "mxfp8", "mxfp8", True)
    x, w_gu, w_dn, weights, rows, src, offs = args[:7]
    seen = []
    op = torch.ops.moe_mxfp8.routed_experts_fwd

    class Spy:
        def __call__(self, *a, **kw):
            seen.append(a[-1] if len(a) > 12 else False)
            return op(*a, **kw)

    monkeypatch.setattr(torch.ops.moe_mxfp8, "routed_experts_fwd", Spy())
    for x_grad, w_grad in ((True, False), (False, True), (False, False)):
        DP.routed_experts(x.clone().requires_grad_(x_grad), w_gu.clone().requires_grad_(w_grad),
                          w_dn, weights.clone().requires_grad_(), rows, src, offs,
                          backend="reference")
    DP.routed_experts(x.clone().requires_grad_(), w_gu, w_dn, weights, rows, src, offs,
                      precision="bf16", backend="reference")
    assert seen == [True, True, False, False]


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_backward_twice_with_retain_graph(gen, precision):
    """Backward frees its saved tensors phase by phase only when the graph is not retained: a
    second backward with ``retain_graph=True`` gives the same gradients bit for bit, and one
    without it raises torch's own error (not a wrong result)."""
    args = _op_args(gen, precision, "mxfp8", True)
    x, w_gu, w_dn, weights, rows, src, offs = args[:7]
    dout = torch.randn(x.shape, generator=gen).to(BF16)
    leaves = [v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)]
    out = DP.routed_experts(*leaves, rows, src, offs, precision=precision, backend="reference")
    grads = [torch.autograd.grad(out, leaves, dout, retain_graph=True) for _ in range(2)]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    torch.autograd.grad(out, leaves, dout)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_backward_frees_each_saved_tensor_after_its_last_phase(gen, monkeypatch, precision):
    """The saved ``y`` (read by the combine backward) and down's N-axis weights are freed before
    the SwiGLU backward runs, ``h`` before the gate/up dgrad, and nothing else holds them: the
    storages are gone (not merely unreferenced here) when those phases start."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x, w_gu, w_dn, weights, rows, src, offs = _op_args(gen, precision, "mxfp8", True)[:7]
    ops = torch.ops.moe_mxfp8
    fwd = ops.routed_experts_fwd
    watched, expired_at = {}, {}

    def spy_fwd(*a, **kw):
        outs = fwd(*a, **kw)
        names = {"h": outs[3], "y": outs[6]}
        if precision == "mxfp8":
            names["down along N"] = outs[7]
        watched.update({k: StorageWeakRef(v.untyped_storage()) for k, v in names.items()})
        return outs

    def spy(name, op):
        def call(*a, **kw):
            expired_at[name] = {k: ref.expired() for k, ref in watched.items()}
            return op(*a, **kw)
        return call

    monkeypatch.setattr(ops, "routed_experts_fwd", spy_fwd)
    monkeypatch.setattr(ops, "routed_experts_bwd_swiglu",
                        spy("swiglu", ops.routed_experts_bwd_swiglu))
    monkeypatch.setattr(ops, "routed_experts_bwd_dx", spy("dx", ops.routed_experts_bwd_dx))
    leaves = [v.clone().requires_grad_() for v in (x, w_gu, w_dn, weights)]
    out = DP.routed_experts(*leaves, rows, src, offs, precision=precision, backend="reference")
    assert not any(ref.expired() for ref in watched.values())  # alive until backward
    out.backward(torch.randn(out.shape, generator=gen).to(BF16))
    freed_before_swiglu = {"y", "down along N"} & set(watched)
    assert all(expired_at["swiglu"][k] for k in freed_before_swiglu), expired_at
    assert not expired_at["swiglu"]["h"]
    assert all(expired_at["dx"].values()), expired_at


def test_bad_arguments():
    x = torch.randn(4, 64, dtype=BF16)
    w = torch.randn(2, 64, 64, dtype=BF16)
    rows = torch.zeros(4, 2, dtype=torch.int32)
    src = torch.zeros(8, dtype=torch.int32)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="precision"):
        DP.routed_experts(x, w, w[:, :, :32], torch.rand(4, 2), rows, src, offs, precision="x")
    with pytest.raises(TypeError, match="bfloat16"):
        DP.routed_experts(x.float(), w, w[:, :, :32], torch.rand(4, 2), rows, src, offs)
    with pytest.raises(ValueError, match="rows"):
        DP.routed_experts(x, w, w[:, :, :32], torch.rand(4, 3), rows, src, offs)
    with pytest.raises(ValueError, match="align"):
        RT.route_layout(rows.long(), torch.tensor([4, 4]), 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        ST.dispatch(torch.randn(4, 48, dtype=BF16), src, offs, 2)


# ---------------------------------------------------------------------------------------------
# Kernels vs references (interpreter on CPU where Triton is installed; compiled on the GPU)
# ---------------------------------------------------------------------------------------------


def _kernel_module():
    from moe_mxfp8.kernels import datapath_triton

    return datapath_triton


# Walks of a 128-row block the row kernels can be launched with (`RowTiling`), besides their
# shipped `ROW_TILING`: the whole block as one tile, or 32-row chunks recomputed.
_WALKS = {"whole": (128, 8), "recomputed": (32, 4)}
_WALK_KERNELS = ("dispatch", "swiglu_fwd", "swiglu_bwd", "combine_bwd")


@contextlib.contextmanager
def row_walk(K, walk: str | None):
    """Launch every row-block kernel's 128-row blocks with walk ``walk`` (None: shipped)."""
    saved = {n: K.ROW_TILING[n][128] for n in _WALK_KERNELS}
    if walk is not None:
        for n in _WALK_KERNELS:
            K.ROW_TILING[n][128] = K.RowTiling(*_WALKS[walk])
    try:
        yield
    finally:
        for n, t in saved.items():
            K.ROW_TILING[n][128] = t


def poisoned_outputs(m: int, f: int, e: int, like, keep_bf16: bool = True) -> dict:
    """The row kernels' outputs (`ST._outputs`, both quantized copies) with every data byte
    poisoned, so that a byte a kernel fails to write cannot pass for a right one."""
    o = ST._outputs(m, f, e, True, True, keep_bf16, like)
    o["qrow"].fill_(0xAB)
    o["qcol"].fill_(0xAB)
    if keep_bf16:
        o["bf16"].fill_(float("nan"))
    return o


def check_kernels_against_references(gen, device, t, k, e, d, hh, align, exact_silu_bwd=True,
                                     scale_blocks="1x32", walk=None):
    """Every kernel with every output poisoned, vs its reference on the same device, in the
    activation blocks of ``scale_blocks`` (32, or 128 for "1x128"); ``walk``: `row_walk`'s."""
    K = _kernel_module()
    with row_walk(K, walk):
        _check_kernels(K, gen, device, t, k, e, d, hh, align, exact_silu_bwd, scale_blocks)


def _check_kernels(K, gen, device, t, k, e, d, hh, align, exact_silu_bwd, scale_blocks):
    sb = scale_blocks
    ablk = R.ACT_BLOCK[sb]
    aligned = align % 16 == 0  # the 16-byte columnwise stores where groups allow them
    ids, counts = make_routing(gen, t, k, e)
    rows, src, offs = (v.to(device) for v in RT.route_layout(ids, counts, align))
    m = src.numel()
    tbl = RT.block_table(offs, m, ablk)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(BF16).to(device)

    x = rnd(t, d)
    o = poisoned_outputs(m, d, e, src)
    col_rows = ST.forward_col_rows(sb)  # the forward stages' columnwise copies (1x128: tiles)
    K.dispatch(x, src, tbl, k, o, ablk, aligned, col_tile=col_rows > 1)
    got, ref = ST._wrap(o, offs, col_rows), ST.dispatch_ref(x, src, offs, k, keep_bf16=True,
                                                            scale_blocks=sb)
    assert_mx_equal(got[0], ref[0], "dispatch rowwise")
    assert_mx_equal(got[1], ref[1], "dispatch colwise")
    assert torch.equal(got[2], ref[2])

    dxs = rnd(m, d)
    dx = torch.full((t, d), float("nan"), dtype=BF16, device=device)
    K.gather_sum(dxs, rows, dx)
    assert torch.equal(dx, ST.dispatch_backward_ref(dxs, rows))

    h = rnd(m, 2 * hh, scale=3.0)
    o = poisoned_outputs(m, hh, e, src)
    K.swiglu_fwd(h, src, tbl, o, ablk, aligned, col_tile=col_rows > 1)
    got, ref = (ST._wrap(o, offs, col_rows),
                ST.swiglu_ref(h, src, offs, keep_bf16=True, scale_blocks=sb))
    assert torch.equal(got[2], ref[2]), "swiglu BF16"
    assert_mx_equal(got[0], ref[0], "swiglu rowwise")
    assert_mx_equal(got[1], ref[1], "swiglu colwise")

    da = rnd(m, hh)
    o = poisoned_outputs(m, 2 * hh, e, src)
    K.swiglu_bwd(da, h, src, tbl, o, ablk, aligned)
    got = ST._wrap(o, offs)
    ref = ST.swiglu_backward_ref(da, h, src, offs, keep_bf16=True, scale_blocks=sb)
    if exact_silu_bwd:
        assert torch.equal(got[2], ref[2]), "swiglu backward BF16"
    else:  # the CPU's silu_backward evaluates its exp differently: 1 BF16 ulp
        torch.testing.assert_close(got[2], ref[2], rtol=2**-7, atol=1e-30)
    # the quantized copies are the contract's quantization of the kernel's own BF16 values
    assert_mx_equal(got[0], R.quantize_rowwise_ref(got[2], offs=offs, scale_blocks=sb),
                    "swiglu bwd rowwise")
    assert_mx_equal(got[1], R.quantize_colwise_ref(got[2], offs=offs, scale_blocks=sb),
                    "swiglu bwd colwise")
    if exact_silu_bwd:
        assert_mx_equal(got[0], ref[0], "swiglu bwd rowwise vs ref")

    w = torch.rand(t, k, generator=gen).to(device)
    y = rnd(m, d)
    out = torch.full((t, d), float("nan"), dtype=BF16, device=device)
    K.combine_fwd(y, rows, w, out)
    assert torch.equal(out, ST.combine_ref(y, rows, w))

    dout = rnd(t, d)
    o = poisoned_outputs(m, d, e, src)
    part = torch.full((-(-d // K.COL_TILE), m), float("nan"), device=device)
    K.combine_bwd(dout, y, w, src, tbl, k, o, part, ablk, aligned)
    got = ST._wrap(o, offs)
    ref = ST.combine_backward_ref(dout, y, src, rows, w, offs, keep_bf16=True, scale_blocks=sb)
    assert torch.equal(got[2], ref[2]), "combine backward BF16"
    assert_mx_equal(got[0], ref[0], "combine bwd rowwise")
    assert_mx_equal(got[1], ref[1], "combine bwd colwise")
    dw = part.sum(0).to(BF16).float()[rows.long()]
    assert_dw_close(dw, ref[3], dout, y, rows)


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="Triton interpreter run (CPU machine with Triton installed)")
@pytest.mark.parametrize("case", [
    ((37, 2, 5, 96, 64, 16), "1x32", None),
    # 1x128: D = 160 ends in a partial 128-block; H = 96 makes the [dgate | dup] row's blocks
    # straddle its halves (the joint SwiGLU backward); align 16 and 128 (the layer's); each walk
    # of a 128-row block
    ((37, 2, 5, 160, 96, 16), "1x128", None),
    ((70, 2, 3, 128, 128, 128), "1x128", None),
    ((70, 2, 3, 128, 128, 128), "1x128", "whole"),
    ((37, 2, 5, 160, 96, 16), "1x128", "recomputed"),
], ids=lambda c: "T{}k{}E{}D{}H{}a{}".format(*c[0]) + "-" + c[1] + (f"-{c[2]}" if c[2] else ""))
def test_kernels_interpreter(gen, case):
    """In a subprocess: the interpreter must be chosen before Triton is first imported (which
    torch.compile in this process may already have done for its own kernels)."""
    shape, sb, walk = case
    seed = int(torch.randint(2**62, (1,), generator=gen))
    code = ("import torch; from tests.test_datapath import check_kernels_against_references as c;"
            f"c(torch.Generator().manual_seed({seed}), 'cpu', *{shape!r}, "
            f"exact_silu_bwd=False, scale_blocks={sb!r}, walk={walk!r})")
    run_interpreted(code, seed)


# (kernel, extra constexprs, its `ROW_TILING` key)
_ROW_KERNELS = [("_dispatch_kernel", {}, "dispatch"),
                ("_swiglu_fwd_kernel", {}, "swiglu_fwd"),
                ("_swiglu_bwd_kernel", {"JOINT": False}, "swiglu_bwd"),
                ("_swiglu_bwd_kernel", {"JOINT": True}, "swiglu_bwd"),
                ("_combine_bwd_kernel", {"DW": True}, "combine_bwd")]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("ablk", [32, 128])
@pytest.mark.parametrize("name,extra,rows", _ROW_KERNELS,
                         ids=[n + "".join(f"-{k}{v}" for k, v in e.items())
                              for n, e, _ in _ROW_KERNELS])
def test_row_kernels_compile_for_sm90(name, extra, rows, ablk, tmp_path):
    """Each row-block kernel compiles for sm_90 without a GPU (Triton's own ptxas), with the
    launch constants the layer uses. The dispatch keeps everything in registers in both block
    lengths (a 128-row block: one tile at 8 warps; docs/design/datapath.md)."""
    from tests.triton_sm90 import compile_for_sm90

    K = _kernel_module()
    meta = {**K._row_meta(ablk, True, rows), **extra, "QROW": True, "QCOL": True,
            "BF16": True}
    warps, regs = meta.pop("num_warps"), meta.pop("maxnreg", None)
    # as launched: 16-byte aligned buffers and sizes (Triton's specialization of such args)
    k = compile_for_sm90(getattr(K, name), meta, warps, aligned_except=("TOPK",), maxnreg=regs)
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    # IEEE division as PyTorch's silu kernels (Triton's `/` is the approximate div.full.f32)
    assert "div.full" not in ptx
    # the columnwise copy's transposed rows go out as 16-byte stores (aligned groups)
    assert "st.global.v4.b32" in ptx
    if name == "_dispatch_kernel" or (name == "_swiglu_fwd_kernel" and ablk == 32):
        from tests.triton_sm90 import assert_no_spills

        assert_no_spills(k, tmp_path, f"{name} (ABLK {ablk})")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(37, 2, 5, 96, 64, 16), (300, 8, 16, 256, 160, 16),
                                   (1000, 2, 8, 1024, 512, 128), (513, 4, 7, 160, 96, 1)],
                         ids=lambda s: "T{}k{}E{}D{}H{}a{}".format(*s))
@pytest.mark.parametrize("scale_blocks,walk", [("1x32", None), ("1x128", None),
                                               ("1x128", "whole"), ("1x128", "recomputed")])
def test_gpu_kernels_bit_exact(gen, shape, scale_blocks, walk):
    check_kernels_against_references(gen, "cuda", *shape, scale_blocks=scale_blocks, walk=walk)


def _assert_mx_same_values(a, b, what):
    """Scale bytes equal and the dequantized values equal, NaN where NaN: the element bytes of a
    NaN/Inf block (scale 0xFF) are unspecified (docs/numerics.md), every other byte counts."""
    assert torch.equal(a.scale, b.scale), f"{what}: scale bytes differ"
    torch.testing.assert_close(a.dequantize(torch.float32), b.dequantize(torch.float32), rtol=0,
                               atol=0, equal_nan=True, msg=f"{what}: values differ")


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_gpu_kernels_nonfinite_blocks(gen, scale_blocks):
    """Inf and NaN inputs: the blocks holding them get scale 0xFF exactly as the reference
    quantizer gives them, and every other block's bytes are the reference's (the GPU kernels
    let the hardware conversion saturate instead of clamping first; docs/design/datapath.md)."""
    K = _kernel_module()
    sb, ablk = scale_blocks, R.ACT_BLOCK[scale_blocks]
    t, k, e, d, hh, align = 300, 2, 8, 256, 256, 128
    ids, counts = make_routing(gen, t, k, e)
    rows, src, offs = (v.cuda() for v in RT.route_layout(ids, counts, align))
    m = src.numel()
    tbl = RT.block_table(offs, m, ablk)
    x = (torch.randn(t, d, generator=gen) * 4).to(BF16).cuda()
    h = (torch.randn(m, 2 * hh, generator=gen) * 3).to(BF16).cuda()
    for v in (x, h):  # +-Inf and NaN at random places (a few blocks each)
        flat = v.view(-1)
        idx = torch.randint(flat.numel(), (12,), generator=gen).cuda()
        flat[idx] = torch.tensor([float("inf"), -float("inf"), float("nan")] * 4, dtype=BF16,
                                 device="cuda")
    o = poisoned_outputs(m, d, e, src, keep_bf16=False)
    col_rows = ST.forward_col_rows(sb)
    K.dispatch(x, src, tbl, k, o, ablk, True, col_tile=col_rows > 1)
    got, ref = ST._wrap(o, offs, col_rows), ST.dispatch_ref(x, src, offs, k, scale_blocks=sb)
    assert (got[0].scale == 0xFF).any(), "no non-finite block was made"
    _assert_mx_same_values(got[0], ref[0], "dispatch rowwise")
    _assert_mx_same_values(got[1], ref[1], "dispatch colwise")
    o = poisoned_outputs(m, hh, e, src, keep_bf16=False)
    K.swiglu_fwd(h, src, tbl, o, ablk, True, col_tile=col_rows > 1)
    got, ref = ST._wrap(o, offs, col_rows), ST.swiglu_ref(h, src, offs, scale_blocks=sb)
    _assert_mx_same_values(got[0], ref[0], "swiglu rowwise")
    _assert_mx_same_values(got[1], ref[1], "swiglu colwise")


def check_routed_experts_kernels(gen, device, precision, scale_blocks, backend,
                                 shape=(1000, 2, 8, 512, 384), exact_backward=True):
    """The whole routed-expert block with the Triton data path vs with its PyTorch references
    (the same GEMMs of ``backend``): the output bit for bit; the gradients bit for bit where the
    SwiGLU backward is (``exact_backward``: the GPU), else close; the routing-weight gradient
    (its features summed in another order) within 1 BF16 ulp."""
    t, k, e, d, hh = shape
    ids, counts = make_routing(gen, t, k, e)
    align = {"bf16": 1, "1x32": 16, "1x128": 128}["bf16" if precision == "bf16" else scale_blocks]
    rows, src, offs = (v.to(device) for v in RT.route_layout(ids, counts, align))

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, BF16)

    inputs = (rnd(t, d), rnd(e, 2 * hh, d, scale=d**-0.5), rnd(e, d, hh, scale=hh**-0.5),
              torch.rand(t, k, generator=gen).to(device))
    dout = rnd(t, d)
    res = []
    use_triton = ST.use_triton
    try:
        for kernels in (True, False):
            ST.use_triton = lambda _t, _backend, on=kernels: on  # noqa: E731
            leaves = [v.clone().requires_grad_() for v in inputs]
            out = DP.routed_experts(*leaves, rows, src, offs, precision=precision,
                                    scale_blocks=scale_blocks, backend=backend)
            out.backward(dout)
            res.append([out] + [v.grad for v in leaves])
    finally:
        ST.use_triton = use_triton
    for name, a, b in zip(["out", "dx", "dw_gu", "dw_dn", "dweights"], *res, strict=True):
        if name == "out" or (exact_backward and name != "dweights"):
            assert torch.equal(a, b), name
        elif name == "dweights" and exact_backward:
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
        else:  # 1-ulp SwiGLU-backward differences, re-quantized downstream
            err = (a.float() - b.float()).norm() / b.float().norm()
            assert err < 2**-4, (name, float(err))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision,scale_blocks", [("mxfp8", "1x32"), ("mxfp8", "1x128"),
                                                   ("bf16", "1x32")])
def test_gpu_routed_experts_kernels_equal_references(gen, precision, scale_blocks):
    check_routed_experts_kernels(gen, "cuda", precision, scale_blocks, "auto")


@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="Triton interpreter run (CPU machine with Triton installed)")
@pytest.mark.parametrize("precision,scale_blocks", [("mxfp8", "1x32"), ("mxfp8", "1x128")])
def test_routed_experts_kernels_interpreter(gen, precision, scale_blocks):
    """`check_routed_experts_kernels` on the CPU: the Triton kernels in the interpreter, the
    reference GEMMs (a subprocess, as `test_kernels_interpreter`)."""
    seed = int(torch.randint(2**62, (1,), generator=gen))
    code = ("import torch; from tests.test_datapath import check_routed_experts_kernels as c;"
            f"c(torch.Generator().manual_seed({seed}), 'cpu', {precision!r}, {scale_blocks!r}, "
            "'reference', shape=(45, 2, 3, 128, 160), exact_backward=False)")
    run_interpreted(code, seed)


def _fwd_bwd(module, x, dy):
    module.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    y = module(xa)
    (y * dy).sum().add(module.aux_loss).backward()
    module.aux_loss = None  # drop the graph (it holds the parameters' AccumulateGrad nodes)
    return [y.detach(), xa.grad] + [p.grad for p in module.parameters()]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("precision,scale_blocks", [("mxfp8", "1x32"), ("bf16", "1x32"),
                                                   ("mxfp8", "1x128")])
def test_gpu_deterministic_and_cuda_graph(gen, precision, scale_blocks):
    """Two forward+backward runs bitwise identical; the same step replayed from a CUDA graph
    gives the same bits again (capturable: no host sync, static sizes)."""
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    mod = MXFP8MoE(1024, 512, 8, 2, precision=precision, scale_blocks=scale_blocks,
                   device="cuda")
    x = torch.randn(2048, 1024, generator=gen).to("cuda", BF16)
    dy = torch.randn(2048, 1024, generator=gen).to("cuda", BF16)
    a = _fwd_bwd(mod, x, dy)
    b = _fwd_bwd(mod, x, dy)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    # CUDA graph: static input, grads accumulate into preallocated .grad (zeroed in-graph).
    # Warm-up and capture on one side stream, no autograd graph alive in between: autograd
    # keeps a parameter's AccumulateGrad node (and its stream) while any graph holds it.
    xs = x.clone().requires_grad_()
    for p in mod.parameters():
        p.grad = torch.zeros_like(p)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            xs.grad = None
            for p in mod.parameters():
                p.grad.zero_()
            out = mod(xs)
            (out * dy).sum().add(mod.aux_loss).backward()
            mod.aux_loss = out = None
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    xs.grad = None
    with torch.cuda.graph(g, stream=s):
        for p in mod.parameters():
            p.grad.zero_()
        out = mod(xs)
        (out * dy).sum().add(mod.aux_loss).backward()
        mod.aux_loss = None
    g.replay()
    torch.cuda.synchronize()
    c = [out.detach(), xs.grad] + [p.grad for p in mod.parameters()]
    for u, v in zip(a, c, strict=True):
        assert torch.equal(u, v)


def test_missing_triton_on_cuda_warns_once_and_runs_the_reference(monkeypatch):
    """A CUDA tensor without Triton takes the references (same results) with one warning."""

    class CudaLike:  # stands in for a CUDA tensor: use_triton reads only .is_cuda
        is_cuda = True

    monkeypatch.setattr(ST, "_triton_kernels", lambda: None)
    monkeypatch.setattr("moe_mxfp8.backend._warned", set())
    with pytest.warns(RuntimeWarning, match="Triton is not installed"):
        assert ST.use_triton(CudaLike(), "auto") is False
    assert ST.use_triton(CudaLike(), "reference") is False
    assert ST.use_triton(torch.zeros(1), "auto") is False  # CPU tensors never use Triton


def test_weighted_combine_is_the_combine_stage_with_autograd(gen):
    """`stages.weighted_combine` (expert parallelism's combine): forward = `combine_ref`,
    gradients = `combine_backward_ref`'s BF16 ``dY`` and ``dw``, and both equal the eager
    un-permute + ``(y * bf16(w)).sum`` it replaced, bit for bit, at k = 1, 2 and 3, a NaN row
    included (its token alone turns NaN)."""
    for k in (1, 2, 3):
        t, e, d = 23, 5, 64
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        rows, src, offs = RT.route_layout(ids, counts, 1)
        y = torch.randn(t * k, d, generator=gen).to(torch.bfloat16)
        y[3] = float("nan")
        w = torch.rand(t, k, generator=gen)
        dout = torch.randn(t, d, generator=gen).to(torch.bfloat16)
        yg, wg = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = ST.weighted_combine(yg, wg, rows, src, offs, backend="reference")
        out.backward(dout)
        ye, we = y.clone().requires_grad_(), w.clone().requires_grad_()
        pairs = torch.empty_like(ye).index_copy(0, src.long(), ye).reshape(t, k, d)
        eager = (pairs * we.to(torch.bfloat16).unsqueeze(-1)).sum(dim=1)
        eager.backward(dout)
        same = dict(rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(out, eager, **same)
        torch.testing.assert_close(out, ST.combine_ref(y, rows, w), **same)
        bad = int(src[3]) // k  # the token of sorted row 3
        assert out[bad].isnan().all()
        assert not out[[i for i in range(t) if i != bad]].isnan().any()
        torch.testing.assert_close(yg.grad, ye.grad, **same)
        torch.testing.assert_close(wg.grad, we.grad, rtol=0, atol=0, equal_nan=True)
