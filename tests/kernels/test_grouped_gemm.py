"""Grouped MXFP8 GEMM kernels vs the fp32 reference on the GPU, every backend, one case table.

Each test runs on the backend of the GPU present (``sm90`` on Hopper, ``sm100`` on Blackwell)
and skips the others. Operands are fresh random data quantized by the reference quantizers,
outputs are NaN-poisoned first, and results are compared with the fp32 GEMM of the same
quantized operands: relative Frobenius error <= 5e-3 for bf16 output (its rounding) and
<= 1e-3 for fp32 output (accumulation order only); empty K-grouped groups must be exactly 0.
Shapes: N, K not multiples of 128, empty / 1-row / unbalanced groups, E = 1, 8 and 128, both
output dtypes, all three scale-block choices. The kernel runs through the shared launcher with
the API's first-use check (`moe_mxfp8.selfcheck`) for kernels that ask for it.
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (  # noqa: E402  (tests/kernels is on sys.path under pytest)
    _check,
    _check_wgrad,
    _offs,
    _rel_err,
    _sizes,
    _wgrad_operands,
    fprop_case,
)

from moe_mxfp8 import reference as R
from moe_mxfp8.backend import kernel_backend_for

gpu = pytest.mark.gpu


def _present() -> str | None:
    return kernel_backend_for(torch.device("cuda")) if torch.cuda.is_available() else None


BACKENDS = pytest.mark.parametrize("backend", [
    pytest.param(b, marks=pytest.mark.skipif(_present() != b, reason=f"needs an {b} GPU"))
    for b in ("sm90", "sm100")])


def _mm(backend, mode, a, b, offs, out_dtype=torch.bfloat16, **launch):
    """The ``backend`` kernel through the shared launcher, first-use check included."""
    from moe_mxfp8.kernels.grouped_gemm import launcher

    from moe_mxfp8 import grouped_gemm, selfcheck

    return launcher.grouped_mm(grouped_gemm._host_class(backend), mode, a, b, offs, out_dtype,
                               first_use=selfcheck.verify_on_first_use, **launch)


@gpu
@BACKENDS
@pytest.mark.parametrize("grouping", ["E1", "E8_edge", "E8_unbal", "E128"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_rows", [1, 32])
def test_fprop_matches_reference(backend, grouping, out_dtype, block_rows):
    dev = "cuda"
    seed = hash((grouping, str(out_dtype), block_rows)) % 10000
    torch.manual_seed(seed)
    sizes = _sizes(grouping, seed)
    m, n, k = sum(sizes), 160, 352  # N, K not multiples of 128
    offs = _offs(sizes, dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device=dev, dtype=torch.bfloat16) * 0.05
    a = R.quantize_rowwise_ref(x, offs=offs)
    b = R.quantize_weights_ref(w, axis="K", block_rows=block_rows)
    out = torch.full((m, n), float("nan"), device=dev, dtype=out_dtype)
    _mm(backend, "m", a, b, offs, out_dtype, out=out)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    _check(out, ref, out_dtype)


@gpu
@BACKENDS
@pytest.mark.parametrize("grouping", ["E1", "E8_edge", "E128"])
@pytest.mark.parametrize("block_rows", [1, 32])
def test_dgrad_matches_reference(backend, grouping, block_rows):
    dev = "cuda"
    seed = hash(("dgrad", grouping, block_rows)) % 10000
    torch.manual_seed(seed)
    sizes = _sizes(grouping, seed)
    m, n, k = sum(sizes), 256, 96  # dY (M, N); W (E, N, K); dX (M, K)
    offs = _offs(sizes, dev)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device=dev, dtype=torch.bfloat16) * 0.05
    a = R.quantize_rowwise_ref(dy, offs=offs)
    b = R.quantize_weights_ref(w, axis="N", block_rows=block_rows)  # data (E, K, N)
    out = torch.full((m, k), float("nan"), device=dev, dtype=torch.bfloat16)
    _mm(backend, "m", a, b, offs, torch.bfloat16, out=out)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    _check(out, ref, torch.bfloat16)
    # and against the unquantized product: the MXFP8 error itself stays small
    w32 = w.float()
    bounds = [0] + offs.tolist()
    exact = torch.cat([dy[s:t].float() @ w32[g] for g, (s, t) in
                       enumerate(zip(bounds[:-1], bounds[1:], strict=True))])
    assert _rel_err(out, exact) < 0.08


@gpu
@BACKENDS
@pytest.mark.parametrize("grouping", ["E1", "E8_edge", "E8_unbal", "E8_a16", "E128"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_wgrad_matches_reference(backend, grouping, out_dtype):
    dev = "cuda"
    seed = hash(("wgrad", grouping, str(out_dtype))) % 10000
    torch.manual_seed(seed)
    sizes = _sizes(grouping, seed)
    m, n, k = sum(sizes), 160, 288
    offs = _offs(sizes, dev)
    a, b = _wgrad_operands(m, n, k, offs)
    out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=out_dtype)
    _mm(backend, "k", a, b, offs, out_dtype, out=out)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    assert not torch.isnan(out).any()
    _check_wgrad(out, ref, sizes, out_dtype)


@gpu
@BACKENDS
def test_dispatch_and_cuda_graph(backend):
    """The API (`grouped_gemm.grouped_mm_m(backend=...)`) reaches the kernel; a captured graph
    replays it with new group sizes read from offs on the GPU."""
    from moe_mxfp8 import grouped_gemm

    dev = "cuda"
    sizes = [100, 0, 300, 12]
    offs = _offs(sizes, dev)
    x = torch.randn(sum(sizes), 128, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4, 64, 128, device=dev, dtype=torch.bfloat16) * 0.05
    a = R.quantize_rowwise_ref(x, offs=offs)
    b = R.quantize_weights_ref(w, axis="K")
    out = grouped_gemm.grouped_mm_m(a, b, offs, backend=backend)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    _check(out, ref, torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out2 = grouped_gemm.grouped_mm_m(a, b, offs, backend=backend)
    # new group sizes, same buffers: the graph reads offs on the GPU
    offs.copy_(_offs([0, 200, 200, 12], dev))
    a2 = R.quantize_rowwise_ref(x, offs=offs)
    a.data.copy_(a2.data)
    a.scale.copy_(a2.scale)
    g.replay()
    torch.cuda.synchronize()
    _check(out2, R.grouped_mm(a2, b, offs, torch.float32), torch.bfloat16)


@gpu
@BACKENDS
@pytest.mark.parametrize("max_ctas", [1, 3])
@pytest.mark.parametrize("op", ["fprop", "fprop32", "wide_n", "wgrad"])
def test_persistent_loop_walks_every_tile(backend, op, max_ctas):
    """Few CTAs, many tiles: each CTA walks several tiles with the pipeline (stage index,
    phase, scale-warp round-robin) running on across them; K = 1056 gives 9 k-tiles (> the
    6 stages) per tile, and the groups include empty and partial ones."""
    dev = "cuda"
    torch.manual_seed(7 + max_ctas)
    sizes = _sizes("E8_edge", 3)
    offs = _offs(sizes, dev)
    m = sum(sizes)
    launch = {"max_clusters": max_ctas}
    if op in ("fprop", "fprop32", "wide_n"):
        n, k = (288, 1056) if op != "wide_n" else (1056, 288)  # wide_n: 9 n-tiles
        a, b, out = fprop_case(offs, n, k, 32 if op == "fprop32" else 1)
        _mm(backend, "m", a, b, offs, out=out, **launch)
    else:
        n, k = 160, 288
        a, b = _wgrad_operands(m, n, k, offs)
        out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=torch.bfloat16)
        _mm(backend, "k", a, b, offs, torch.bfloat16, out=out, **launch)
    _check(out, R.grouped_mm(a, b, offs, torch.float32), torch.bfloat16)


@gpu
@BACKENDS
@pytest.mark.parametrize("grouping", ["E1", "E8_edge", "E8_unbal", "E128"])
@pytest.mark.parametrize("op,out_dtype", [("fprop", torch.bfloat16), ("fprop", torch.float32),
                                          ("dgrad", torch.bfloat16)])
def test_1x128_m_grouped_matches_reference(backend, grouping, op, out_dtype):
    """1x128 activations x 128x128 weight tiles; N = 160 and K = 352 (fprop) or N = 256,
    K = 96 (dgrad) leave partial 128-blocks and partial weight tiles. Tolerance as the 1x32
    tests: rel. Frobenius error vs the fp32 GEMM of the same quantized operands <= 5e-3 (bf16
    output rounding) / 1e-3 (fp32 output: accumulation order only)."""
    dev = "cuda"
    seed = 7 + len(grouping) * 31 + (op == "dgrad") * 3 + (out_dtype == torch.float32)
    torch.manual_seed(seed)
    sizes = _sizes(grouping, seed)
    m = sum(sizes)
    n, k, axis = (160, 352, "K") if op == "fprop" else (256, 96, "N")
    offs = _offs(sizes, dev)
    x = torch.randn(m, k if op == "fprop" else n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device=dev, dtype=torch.bfloat16) * 0.05
    a = R.quantize_rowwise_ref(x, offs=offs, scale_blocks="1x128")
    b = R.quantize_weights_ref(w, axis=axis, block_rows=128)
    cols = n if op == "fprop" else k
    out = torch.full((m, cols), float("nan"), device=dev, dtype=out_dtype)
    _mm(backend, "m", a, b, offs, out_dtype, out=out)
    _check(out, R.grouped_mm(a, b, offs, torch.float32), out_dtype)


@gpu
@BACKENDS
@pytest.mark.parametrize("grouping", ["E1", "E8_edge", "E8_unbal", "E8_a16", "E128"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_1x128_wgrad_matches_reference(backend, grouping, out_dtype):
    """Both operands 1x128 along the tokens (blocks restart per group, partial last blocks);
    unaligned groups go through the host re-layout; empty groups must be zeros."""
    dev = "cuda"
    seed = 11 + len(grouping) * 17 + (out_dtype == torch.float32)
    torch.manual_seed(seed)
    sizes = _sizes(grouping, seed)
    m, n, k = sum(sizes), 160, 288
    offs = _offs(sizes, dev)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    a = R.quantize_colwise_ref(dy, offs=offs, scale_blocks="1x128")
    b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128")
    out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=out_dtype)
    _mm(backend, "k", a, b, offs, out_dtype, out=out, scale_blocks="1x128")
    _check_wgrad(out, R.grouped_mm(a, b, offs, torch.float32), sizes, out_dtype)



@gpu
@BACKENDS
@pytest.mark.parametrize("n,k", [(32, 384), (64, 256), (64, 64)])
def test_1x128_wgrad_few_output_rows(backend, n, k):
    """Weight gradients with fewer output rows than one 128-row tile (a model width of 64:
    the down projection's dW at D = 64) and 256-column tiles, 8 times on fresh data: on
    Hopper the second warpgroup's stores once landed on the first one's rows (a race that
    zeroed a 128-column half of a tile in 1 of 3 runs at N = 64, every run at N = 32; H100,
    2026-11-27)."""
    dev = "cuda"
    sizes = [512, 384, 0, 640]
    offs = _offs(sizes, dev)
    for rep in range(8):
        torch.manual_seed(100 + rep)
        dy = torch.randn(sum(sizes), n, device=dev, dtype=torch.bfloat16)
        x = torch.randn(sum(sizes), k, device=dev, dtype=torch.bfloat16)
        a = R.quantize_colwise_ref(dy, offs=offs, scale_blocks="1x128")
        b = R.quantize_colwise_ref(x, offs=offs, scale_blocks="1x128")
        out = torch.full((len(sizes), n, k), float("nan"), device=dev, dtype=torch.bfloat16)
        _mm(backend, "k", a, b, offs, torch.bfloat16, out=out, scale_blocks="1x128")
        ref = R.grouped_mm(a, b, offs, torch.float32)
        for g in range(len(sizes)):  # each group on its own: one bad group is not diluted
            if sizes[g]:
                _check(out[g], ref[g], torch.bfloat16)
        _check_wgrad(out, ref, sizes, torch.bfloat16)

def _random_sizes(gen, m, e, empty=1):
    """``e`` group sizes summing to ``m`` (multiples of 16 when ``m`` is), ``empty`` of them 0."""
    cuts = torch.sort(torch.randint(0, m // 16 + 1, (e - 1 - empty,), generator=gen)).values * 16
    bounds = [0, *cuts.tolist(), m]
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return tuple(sizes[:1] + [0] * empty + sizes[1:])


@gpu
@BACKENDS
@pytest.mark.parametrize("mode", ["m", "k"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k,e", [(1000, 256, 512, 4), (4096, 384, 1024, 8),
                                     (8192, 2880, 2880, 8), (96, 128, 160, 3)])
def test_model_sized_matches_reference(backend, mode, out_dtype, m, n, k, e):
    """Larger shapes through the API, uneven random groups with one empty group."""
    from moe_mxfp8 import grouped_gemm, selfcheck

    gen = torch.Generator().manual_seed(m + n + k + e)
    m = m if mode == "m" else m // 16 * 16
    prob = selfcheck.CheckProblem(_random_sizes(gen, m, e), n=n, k=k, out_dtype=out_dtype)
    a, b, offs = selfcheck.make_operands(mode, prob, "cuda", seed=e)
    fn = grouped_gemm.grouped_mm_m if mode == "m" else grouped_gemm.grouped_mm_k
    out = fn(a, b, offs, out_dtype=out_dtype, backend=backend)
    ref = R.grouped_mm(a, b, offs, torch.float32)
    assert selfcheck._compare(mode, prob, out, ref, offs) is None
