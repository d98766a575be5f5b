"""`grouped_gemm.problem.align_k_groups`: 16-aligned group starts for the K-grouped (wgrad) GEMM.

The claim under test: zero-padding each group's END to a multiple of 16 tokens changes neither
packed scale tensor, so the fp8 data can be re-laid out on its own (same scales, new offs) and
the grouped GEMM is bit-identical. CPU: the identities behind it, the reference GEMM on the
aligned operands vs the original (torch.equal), the layout (aligned starts, zero gaps, moved
tokens), that re-quantizing the zero-padded source gives the same bytes, and that no host sync
happens (full-graph torch.compile, fake-tensor trace). GPU: the same under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from moe_mxfp8.kernels.grouped_gemm import problem as P

from moe_mxfp8 import layout as L
from moe_mxfp8 import reference as R
from moe_mxfp8.mx_tensor import MXFP8Tensor

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# group sizes the brief singles out: empty, 1, around 16 and 32, past one 128-token tile
EDGE_SIZES = [0, 1, 15, 16, 17, 31, 33, 129]


def _sizes(num_groups: int, gen: torch.Generator) -> list[int]:
    """Random group sizes that always contain the edge sizes (for E >= 8) in random order."""
    sizes = torch.randint(0, 70, (num_groups,), generator=gen).tolist()
    if num_groups >= len(EDGE_SIZES):
        sizes[: len(EDGE_SIZES)] = EDGE_SIZES
        perm = torch.randperm(num_groups, generator=gen).tolist()
        sizes = [sizes[i] for i in perm]
    elif num_groups == 3:
        sizes = [17, 0, 33]  # unaligned second start, empty group in the middle
    else:
        sizes = [129]
    return sizes


def _offs(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _source(m: int, cols: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    """``(m, cols)`` data to quantize columnwise (tokens x features), never all zeros.

    ``"randn"``: generic normal data. ``"exact"``: small integers (exact in e4m3) times a power
    of two per feature, so every dequantized product and sum is exact in fp32 and the
    comparison does not depend on the BLAS summation order.
    """
    if kind == "randn":
        return torch.randn(m, cols, generator=gen)
    ints = torch.randint(-15, 16, (m, cols), generator=gen).float()
    ints = torch.where(ints == 0, torch.ones_like(ints), ints)
    return ints * torch.exp2(torch.randint(-3, 4, (1, cols), generator=gen).float())


def _operands(sizes, n, k, gen, kind):
    offs = _offs(sizes)
    m = int(sum(sizes))
    a = R.quantize_colwise_ref(_source(m, n, gen, kind), offs=offs)  # (N, M), dY^T
    b = R.quantize_colwise_ref(_source(m, k, gen, kind), offs=offs)  # (K, M), X^T
    return a, b, offs


def _aligned_tensor(data: torch.Tensor, like: MXFP8Tensor, offs_aligned: torch.Tensor):
    """The aligned data with the ORIGINAL scale bytes; cut at offs_aligned[-1] because the
    reference dequantizer assigns every column to a group (the kernel reads only groups)."""
    end = int(offs_aligned[-1])
    return MXFP8Tensor(data[:, :end].contiguous(), like.scale, "packed", offs_aligned, "k")


# ---------------------------------------------------------------------------------------------
# the identities
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("align", [16, 32])
def test_padding_keeps_block_and_tile_counts(align):
    for m in range(0, 4097):
        mp = L.round_up(m, align)
        assert L.ceil_div(mp, L.BLOCK_SIZE) == L.ceil_div(m, L.BLOCK_SIZE), m
        assert L.ceil_div(mp, L.TILE_ROWS) == L.ceil_div(m, L.TILE_ROWS), m


def test_align_must_divide_32():
    for bad in (0, 3, 48, 64):
        with pytest.raises(ValueError, match="divide"):
            P.k_aligned_extent(128, 2, bad)
    assert P.k_aligned_extent(131072, 8) == 131200  # dsv3: the docstring's byte count
    for m in (0, 1, 15, 16, 1000):
        for e in (1, 3, 8, 128):
            mp = P.k_aligned_extent(m, e)
            assert mp % 16 == 0 and mp >= m + 15 * e


@pytest.mark.parametrize("num_groups", [1, 3, 8, 128])
def test_scale_positions_unchanged(num_groups, gen):
    """Every (row, block) scale byte sits at the same packed offset under offs and
    offs_aligned, and both number the same blocks: the scale tensors need no change."""
    sizes = _sizes(num_groups, gen)
    offs = _offs(sizes)
    m = int(offs[-1])
    _, _, offs_al = P.align_k_groups(torch.zeros(1, m, dtype=torch.uint8),
                                      torch.zeros(1, m, dtype=torch.uint8), offs)
    assert L.grouped_k_num_blocks(offs_al) == L.grouped_k_num_blocks(offs)
    nb = L.grouped_k_num_blocks(offs)
    for rows in (32, 160):
        assert torch.equal(L.grouped_k_offsets(offs, rows, nb)[0],
                           L.grouped_k_offsets(offs_al, rows, nb)[0])


# ---------------------------------------------------------------------------------------------
# the GEMM: bit-identical with the same scales
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["exact", "randn"])
@pytest.mark.parametrize("num_groups", [1, 3, 8, 128])
def test_reference_gemm_bit_identical(num_groups, kind, gen):
    sizes = _sizes(num_groups, gen)
    a, b, offs = _operands(sizes, 64, 96, gen, kind)
    want = R.grouped_mm(a, b, offs, torch.float32)
    a_al, b_al, offs_al = P.align_k_groups(a.data, b.data, offs)
    a2 = _aligned_tensor(a_al, a, offs_al)
    b2 = _aligned_tensor(b_al, b, offs_al)
    got = R.grouped_mm(a2, b2, offs_al, torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(R.grouped_mm(a2, b2, offs_al), R.grouped_mm(a, b, offs))  # bf16 out
    # same dequantized values, moved: the aligned operands are the original ones plus zeros
    deq, deq_al = a.dequantize(torch.float32), a2.dequantize(torch.float32)
    starts = [0, *offs.tolist()[:-1]]
    pstarts = [0, *offs_al.tolist()[:-1]]
    for s, p, sz in zip(starts, pstarts, sizes, strict=True):
        assert torch.equal(deq_al[:, p:p + sz], deq[:, s:s + sz])
        assert not deq_al[:, p + sz:p + L.round_up(sz, 16)].any()


@pytest.mark.parametrize("num_groups", [1, 3, 8, 128])
def test_layout(num_groups, gen):
    """Aligned starts, tokens moved intact, every gap column (group pads and tail) zero."""
    sizes = _sizes(num_groups, gen)
    offs = _offs(sizes)
    m = int(offs[-1])
    a = torch.randint(1, 256, (5, m), dtype=torch.uint8, generator=gen)  # no zero byte
    b = torch.randint(1, 256, (7, m), dtype=torch.uint8, generator=gen)
    a_al, b_al, offs_al = P.align_k_groups(a, b, offs)
    mp = P.k_aligned_extent(m, num_groups)
    assert a_al.shape == (5, mp) and b_al.shape == (7, mp) and mp % 16 == 0
    assert offs_al.dtype == torch.int32 and offs_al.shape == offs.shape
    want_offs = torch.tensor([L.round_up(s, 16) for s in sizes]).cumsum(0)
    assert torch.equal(offs_al.long(), want_offs)
    assert (offs_al % 16 == 0).all() and int(offs_al[-1]) <= mp  # starts are the previous ends
    for src, al in ((a, a_al), (b, b_al)):
        real = torch.zeros(mp, dtype=torch.bool)
        s, p = 0, 0
        for sz in sizes:
            assert torch.equal(al[:, p:p + sz], src[:, s:s + sz])
            real[p:p + sz] = True
            s, p = s + sz, p + L.round_up(sz, 16)
        assert not al[:, ~real].any()  # gaps, including everything past offs_al[-1]
        assert al[:, real].all()


def test_fp8_dtype_and_align_32(gen):
    a, b, offs = _operands([17, 0, 33, 1], 32, 32, gen, "randn")
    a_al, b_al, offs_al = P.align_k_groups(a.data, b.data, offs, align=32)
    assert a_al.dtype == torch.float8_e4m3fn and b_al.dtype == torch.float8_e4m3fn
    assert offs_al.tolist() == [32, 32, 96, 128]
    got = R.grouped_mm(_aligned_tensor(a_al, a, offs_al), _aligned_tensor(b_al, b, offs_al),
                       offs_al, torch.float32)
    assert torch.equal(got, R.grouped_mm(a, b, offs, torch.float32))


def test_requantizing_padded_source_gives_same_bytes(gen):
    """Quantizing the zero-padded bf16 source with offs_aligned yields exactly the aligned data
    and the original scale bytes (the larger static scale buffer only adds zero bytes)."""
    sizes = [17, 0, 33, 1, 129, 16, 15, 31]
    offs = _offs(sizes)
    m = int(offs[-1])
    x = torch.randn(m, 64, generator=gen)
    q = R.quantize_colwise_ref(x, offs=offs)
    q_al, _, offs_al = P.align_k_groups(q.data, q.data, offs)
    end = int(offs_al[-1])
    x_pad = torch.zeros(end, 64)
    s, p = 0, 0
    for sz in sizes:
        x_pad[p:p + sz] = x[s:s + sz]
        s, p = s + sz, p + L.round_up(sz, 16)
    q2 = R.quantize_colwise_ref(x_pad, offs=offs_al)
    assert torch.equal(q2.data.view(torch.uint8), q_al[:, :end].view(torch.uint8))
    n = q.scale.numel()
    assert q2.scale.numel() >= n
    assert torch.equal(q2.scale[:n], q.scale) and not q2.scale[n:].any()


def test_fewer_tokens_than_m(gen):
    """offs[-1] < M: the groups and their pads are still right (the GEMM is unchanged)."""
    offs = _offs([17, 5, 0, 40])
    m = 80  # 18 ungrouped tokens
    a = torch.randint(1, 256, (4, m), dtype=torch.uint8, generator=gen)
    a_al, _, offs_al = P.align_k_groups(a, a, offs)
    assert offs_al.tolist() == [32, 48, 48, 96]
    assert torch.equal(a_al[:, :17], a[:, :17]) and not a_al[:, 17:32].any()
    assert torch.equal(a_al[:, 32:37], a[:, 17:22]) and not a_al[:, 37:48].any()
    assert torch.equal(a_al[:, 48:88], a[:, 22:62]) and not a_al[:, 88:96].any()


# ---------------------------------------------------------------------------------------------
# no host sync
# ---------------------------------------------------------------------------------------------


def test_fullgraph_compile_no_graph_break(gen):
    """Dynamo refuses (fullgraph=True) any .item()/.tolist(), data-dependent branch or
    dynamic-shape op: the whole function is one graph."""
    torch._dynamo.reset()
    fn = torch.compile(P.align_k_groups, fullgraph=True, backend="aot_eager")
    for sizes in ([17, 0, 33], [1, 15, 16, 31, 129, 0, 2, 64]):
        offs = _offs(sizes)
        m = int(offs[-1])
        a = torch.randint(1, 256, (8, m), dtype=torch.uint8, generator=gen)
        b = torch.randint(1, 256, (16, m), dtype=torch.uint8, generator=gen)
        got = fn(a, b, offs)
        want = P.align_k_groups(a, b, offs)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)


def test_inductor_compile_matches(gen):
    """The same through inductor (one fused CPU kernel per operand)."""
    torch._dynamo.reset()
    fn = torch.compile(P.align_k_groups, fullgraph=True)
    offs = _offs([17, 0, 33, 129, 1])
    m = int(offs[-1])
    a = torch.randint(1, 256, (8, m), dtype=torch.uint8, generator=gen)
    b = torch.randint(1, 256, (16, m), dtype=torch.uint8, generator=gen)
    for x, y in zip(fn(a, b, offs), P.align_k_groups(a, b, offs), strict=True):
        assert torch.equal(x, y)


def test_fake_tensor_trace():
    """A fake-tensor trace has no values: any host read of offs would raise."""
    from torch.fx.experimental.proxy_tensor import make_fx

    offs = _offs([17, 0, 33])
    a = torch.zeros(8, 50, dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 50, dtype=torch.float8_e4m3fn)
    gm = make_fx(lambda x, y, o: P.align_k_groups(x, y, o), tracing_mode="fake")(a, b, offs)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any(("item" in t or "nonzero" in t or "local_scalar" in t) for t in targets)
    # a boolean-mask index would trace with an unbacked (data-dependent) size: all static here
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert all(isinstance(d, int) for d in val.shape), (node, val.shape)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("num_groups", [1, 3, 8, 128])
def test_gpu_no_host_sync(num_groups, gen):
    sizes = _sizes(num_groups, gen)
    a, b, offs = _operands(sizes, 64, 96, gen, "randn")
    dev = torch.device("cuda")
    a_d, b_d, offs_d = a.data.to(dev), b.data.to(dev), offs.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = P.align_k_groups(a_d, b_d, offs_d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = P.align_k_groups(a.data, b.data, offs)
    for x, y in zip(got, want, strict=True):
        assert x.device.type == "cuda" and x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bytes(x.cpu()), _bytes(y))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t
