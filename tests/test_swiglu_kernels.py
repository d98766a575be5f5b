"""The 1x128 row kernels' tilings (`kernels.datapath_triton.RowTiling`) other than the shipped
`ROW_TILING`, bit for bit against the references: the staged chunk walk (each chunk's BF16 values
kept in a per-program scratch slot for the columnwise copy, on a persistent grid) in Triton's
interpreter on the CPU, compiled for sm_90 without a GPU, and every tiling
`benchmarks.bench_rowkernels` sweeps on the GPU (``-m gpu``), so that whichever the sweep picks
is already checked. The shipped tilings are `tests/test_datapath.py`'s.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from benchmarks.bench_rowkernels import KIND_VARIANTS, VARIANTS
from tests.test_datapath import (
    _check_kernels,
    _kernel_module,
    run_interpreted,
    test_gpu_kernels_nonfinite_blocks,
)

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
    # groups of about 100 rows (several chunks a block, the last one partial); D = 160 ends
    # in a partial 128-block; H = 96: the joint SwiGLU backward (one scratch half); 3 programs
    # for more tiles: each program walks several tiles and reuses its slot
    ((100, 2, 3, 160, 96, 16), (32, 4, None, "rows", 3)),
    # the layer's 128-row groups, the two-half backward, the feature-major scratch
    ((70, 2, 3, 128, 128, 128), (32, 4, None, "cols", 2)),
    # groups on no multiple of 16 (byte stores), 8 chunks a block, 64-row chunks
    ((100, 2, 3, 160, 96, 1), (16, 4, None, "rows", 2)),
    ((70, 2, 3, 256, 256, 16), (64, 8, None, "rows", 1)),
], ids=lambda v: "T{}k{}E{}D{}H{}a{}".format(*v) if len(v) == 6 else f"rows{v[0]}-{v[3]}")
def test_staged_walk_interpreter(gen, shape, tiling):
    """In a subprocess, as `test_datapath.test_kernels_interpreter` (the interpreter must be
    chosen before Triton's first import)."""
    seed = int(torch.randint(2**62, (1,), generator=gen))
    code = ("from tests.test_swiglu_kernels import check_tiling as c;"
            f"c({seed}, 'cpu', {shape!r}, {tiling!r})")
    run_interpreted(code, seed)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_staged_tiling_refused_where_unsupported():
    """The combine backward has no staged walk, and a stage is "rows" or "cols": one-line
    errors at launch rather than a kernel that ignores the setting."""
    K = _kernel_module()
    with tilings(K, (32, 4, None, "rows", 2), ("combine_bwd",)), \
            pytest.raises(ValueError, match="combine_bwd: RowTiling.stage"):
        K._row_meta(128, True, "combine_bwd")
    with tilings(K, (32, 4, None, "diagonal", 2), SWIGLU), \
            pytest.raises(ValueError, match="swiglu_fwd: RowTiling.stage"):
        K._row_meta(128, True, "swiglu_fwd")


_STAGED_KERNELS = [("_dispatch_kernel", {}, "dispatch"),
                   ("_swiglu_fwd_kernel", {}, "swiglu_fwd"),
                   ("_swiglu_bwd_kernel", {"JOINT": False}, "swiglu_bwd"),
                   ("_swiglu_bwd_kernel", {"JOINT": True}, "swiglu_bwd")]


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("stage", ["rows", "cols"])
@pytest.mark.parametrize("name,extra,kern", _STAGED_KERNELS,
                         ids=[n + "".join(f"-{k}{v}" for k, v in e.items())
                              for n, e, _ in _STAGED_KERNELS])
def test_staged_kernels_compile_for_sm90(name, extra, kern, stage):
    """Each staged kernel builds for sm_90 (Triton's own ptxas) under a register cap, with the
    IEEE division, 16-byte columnwise stores and the barriers around its scratch slot."""
    from tests.test_datapath import _PTR_TYPES
    from tests.triton_sm90 import compile_for_sm90

    K = _kernel_module()
    with tilings(K, (32, 4, 128, stage, 4), (kern,)):
        meta = {**K._row_meta(128, True, kern), **extra, "QROW": True, "QCOL": True,
                "BF16": True}
    assert meta["STAGE"] == K.STAGE_MODES[stage]
    warps, regs = meta.pop("num_warps"), meta.pop("maxnreg")
    k = compile_for_sm90(getattr(K, name), meta, {**_PTR_TYPES, "stage_ptr": "*i16"}, warps,
                         aligned_except=("TOPK",), maxnreg=regs)
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx and "div.full" not in ptx
    assert "st.global.v4.b32" in ptx
    assert ptx.count("bar.sync") >= 2  # staged -> read back -> next tile


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


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("variant", [n for n in KIND_VARIANTS["swiglu"] if "stage" in n][:3])
def test_gpu_staged_nonfinite_blocks(gen, variant):
    """`test_datapath.test_gpu_kernels_nonfinite_blocks` with staged walks: NaN and Inf survive
    the scratch slot (staged as their high 16 bits)."""
    with tilings(_kernel_module(), VARIANTS[variant]):
        test_gpu_kernels_nonfinite_blocks(gen, "1x128")
