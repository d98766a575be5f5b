"""The routing layout on the GPU (`kernels.routing_triton`, operators
``moe_mxfp8::route_layout_tables`` / ``moe_mxfp8::row_tables``): the rows, src, offs, block
table and tile ends of `routing.route_layout` + `routing.row_tables`, bit for bit.

CPU: the operators' fake shapes against the references' (CI), the kernels in Triton's
interpreter and compiled for sm_90 without spills (where Triton is installed). GPU (``-m gpu``):
the compiled kernels against the references on the device."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_mxfp8 import routing as RT
from tests.triton_sm90 import interpreter_only, run_check_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (T, k, E, align, block): the layer's alignments (1 twin, 16, 128) and blocks (32, 128); no
# tokens; one expert; E not a power of two and wider than one 256-expert step; pairs over one
# chunk (1024) and over the prefix pass's 32 chunks; int32 ids
CASES = [
    (53, 3, 7, 16, 32), (53, 3, 7, 1, 32), (53, 3, 7, 128, 128), (0, 2, 5, 16, 32),
    (0, 2, 5, 1, 32), (1, 1, 1, 16, 32), (700, 2, 8, 128, 128), (400, 8, 128, 16, 32),
    (300, 4, 20, 128, 32), (1500, 1, 3, 16, 128), (37, 2, 300, 16, 32),
    (17000, 2, 8, 16, 32),
]


def _ids(gen, t, k, e, dtype=torch.int64):
    """Distinct experts per token, skewed to the first k experts, the last expert idle."""
    used = e - 1 if e > k else e
    ids = (torch.stack([torch.randperm(used, generator=gen)[:k] for _ in range(t)]) if t
           else torch.zeros(0, k, dtype=torch.int64))
    ids[: t // 3] = torch.arange(k)
    return ids.to(dtype)


def check_layout_kernels(gen, device):
    """Every case through the operators on ``device`` against the PyTorch compositions (the
    references) on the same ids, every tensor equal (dtype, shape, values)."""
    for i, (t, k, e, align, block) in enumerate(CASES):
        ids = _ids(gen, t, k, e, torch.int32 if i % 2 else torch.int64).to(device)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
        want = RT.route_layout(ids, counts, align)
        want = (*want, *RT.row_tables(want[2], want[1].numel(), block))
        got = torch.ops.moe_mxfp8.route_layout_tables(ids, e, align, block)
        for name, a, b in zip(("rows", "src", "offs", "table", "tile_ends"), got, want,
                              strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
            assert torch.equal(a, b), (name, (t, k, e, align, block), (a != b).nonzero()[:4])
        got = torch.ops.moe_mxfp8.row_tables(want[2], want[1].numel(), block)
        assert torch.equal(got[0], want[3]) and torch.equal(got[1], want[4]), (t, k, e, block)
        # block 0 (expert parallelism's layout): the same layout, no tables
        *layout, table, tile_ends = torch.ops.moe_mxfp8.route_layout_tables(ids, e, align, 0)
        assert all(torch.equal(a, b) for a, b in zip(layout, want[:3], strict=True)), (t, k, e)
        assert table.shape == (0, 6) and tile_ends.shape == (0,)


def test_fake_shapes_are_the_references(gen):
    """The operators' fake implementations (what torch.compile traces) give the shapes and
    dtypes of the references' outputs."""
    for t, k, e, align, block in CASES[:-1]:
        ids = _ids(gen, t, k, e)
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        rows, src, offs = RT.route_layout(ids, counts, align)
        want = (rows, src, offs, *RT.row_tables(offs, src.numel(), block))
        with FakeTensorMode() as mode:
            got = torch.ops.moe_mxfp8.route_layout_tables(mode.from_tensor(ids), e, align,
                                                          block)
            tables = torch.ops.moe_mxfp8.row_tables(mode.from_tensor(offs), src.numel(), block)
            untabled = torch.ops.moe_mxfp8.route_layout_tables(mode.from_tensor(ids), e, align, 0)
        for a, b in zip((*got, *tables), (*want, *want[3:]), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert [tuple(a.shape) for a in untabled[3:]] == [(0, 6), (0,)]


def test_step_layout_off_the_kernels_is_route_layout(gen):
    ids = _ids(gen, 40, 2, 6)
    counts = torch.bincount(ids.reshape(-1), minlength=6)
    *layout, tables = RT.step_layout(ids, counts, 16, 32, kernels=False)
    assert tables is None
    assert all(torch.equal(a, b) for a, b in zip(layout, RT.route_layout(ids, counts, 16),
                                                 strict=True))
    with pytest.raises(ValueError, match="step_layout: align must be a positive int, got 0"):
        RT.step_layout(ids, counts, 0, 32, kernels=False)


@interpreter_only
def test_kernels_interpreter(gen):
    run_check_interpreted("tests.test_routing_kernels:check_layout_kernels", gen)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("experts", [8, 128, 300, 1500])
def test_kernels_compile_for_sm90_without_spills(experts, tmp_path):
    """Each kernel builds for sm_90 with the launch constants of ``experts`` experts (one-hot
    steps of 8192 pairs x experts at 4 warps) and keeps them in registers."""
    from moe_mxfp8.kernels import routing_triton as K

    from tests.triton_sm90 import check_sm90_builds

    meta = K._meta(experts)
    warps = meta.pop("num_warps")
    kernels = [(K._hist_kernel, meta),
               (K._scan_kernel, {"ALIGN": 128, "EP": meta["EP"], "CR": K.scan_rows(meta["EP"])}),
               (K._place_kernel, {**meta, "BLK": 32, "TILE": 128,
                                  "TB": K.table_rows(meta["EP"])})]
    # no atomics: the layout must not depend on timing
    check_sm90_builds(kernels, warps, tmp_path, f"{experts} experts", ("atom.",))


@pytest.mark.gpu
@cuda
def test_gpu_kernels_equal_references(gen):
    check_layout_kernels(gen, "cuda")
