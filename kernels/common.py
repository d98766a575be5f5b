"""Pieces every CuTeDSL kernel of moe_mxfp8 shares: the torch -> CuTeDSL dtype map, tensor
conversion and the device mirror of the packed scale offset; target arch and compile cache
are re-exported from `compile_cache` (which imports no CuTeDSL).

Imports CuTeDSL (``cutlass``); kernel modules import this, `moe_mxfp8.kernels` does not.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from . import native
from .compile_cache import (  # noqa: F401  (re-exported for the kernel modules)
    ARCH_BY_BACKEND,
    CompileCache,
    compile_events,
    set_progress_hook,
    target_arch,
)
from .mx_format import TILE_BLOCKS, TILE_BYTES, TILE_ROWS


@cute.jit
def packed_scale_offset(r: Int32, c: Int32, num_blocks: Int32) -> Int32:
    """Device mirror of `mx_format.packed_scale_offset` (the contract's formula)."""
    tiles_per_row_tile = (num_blocks + (TILE_BLOCKS - 1)) // TILE_BLOCKS
    tile = (r // TILE_ROWS) * tiles_per_row_tile + c // TILE_BLOCKS
    return (
        tile * TILE_BYTES
        + (r % 32) * 16
        + ((r % TILE_ROWS) // 32) * 4
        + c % TILE_BLOCKS
    )


# torch dtype -> CuTeDSL type, from the one name table of the launch arguments
TORCH_TO_CUTLASS = {getattr(torch, name): getattr(cutlass, cute_name)
                    for name, cute_name in native.CUTLASS_TYPE_NAMES.items()}


def to_cute(t: torch.Tensor, assumed_align: int = 16):
    """A torch CUDA tensor as a CuTe tensor (dynamic layout, 16-byte aligned base)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=assumed_align)

