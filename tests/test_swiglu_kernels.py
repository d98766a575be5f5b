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

from benchmarks.bench_rowkernels import KIND_VARIANTS, VARIANTS
from tests.test_datapath import (
    _check_kernels,
    _kernel_module,
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
