"""Scale-factor layouts of the MXFP8 contract (``docs/numerics.md``).

A scale matrix ``scales[r, c]`` has one E8M0 byte per row ``r`` of the quantized matrix and per
block ``c`` of 32 elements along the reduced axis. Two layouts:

* **dense** ``(R, C)`` uint8, row-major -- for inspection and tests;
* **packed** -- the layout Blackwell's ``tcgen05.mma ... block_scale`` reads (cuBLAS's "1D block
  scaling factor layout", PyTorch's ``SWIZZLE_32_4_4``): 512-byte tiles of 128 rows x 4 blocks,
  row-tile-major, rows padded to 128 and blocks to 4 with zero bytes.

`packed_scale_offset` (defined with the format's constants in ``kernels/mx_format.py``) is the one
place the packed formula lives; every packer, unpacker and the grouped forms call it (the CuTeDSL
kernels mirror it on the device in ``kernels/common.py``).

Grouped buffers are sized from static bounds (``M``, ``E``) rather than from the group sizes, so
that allocating them never needs the values of ``offs`` on the host (no device->host sync; CUDA
graphs capture the kernels). Bytes past the last group are zero.
"""

from __future__ import annotations

import torch

from .kernels.mx_format import (  # the format's constants and size formulas live there
    BLOCK_SIZE,
    TILE_BLOCKS,
    TILE_BYTES,
    TILE_ROWS,
    ceil_div,
    expert_scale_stride,
    grouped_k_scale_bytes,
    grouped_row_tiles_bound,
    grouped_rows_scale_bytes,
    packed_scale_bytes,
    packed_scale_offset,
    round_up,
)

__all__ = ["BLOCK_SIZE", "TILE_BLOCKS", "TILE_BYTES", "TILE_ROWS", "ceil_div",
           "expert_scale_stride", "grouped_k_scale_bytes", "grouped_row_tiles_bound",
           "grouped_rows_scale_bytes", "packed_scale_bytes", "packed_scale_offset", "round_up"]


def group_sizes(offs: torch.Tensor) -> torch.Tensor:
    """int64 sizes ``m_g`` from int32 cumulative ends ``offs`` (same device, no host sync)."""
    offs = offs.to(torch.int64)
    return torch.diff(offs, prepend=offs.new_zeros(1))


def group_starts(offs: torch.Tensor) -> torch.Tensor:
    offs = offs.to(torch.int64)
    return torch.cat([offs.new_zeros(1), offs[:-1]])


def group_of_index(offs: torch.Tensor, n: int) -> torch.Tensor:
    """Group id (int64) of each of the ``n`` indices along the grouped axis.

    Index i belongs to the group g with ``offs[g-1] <= i < offs[g]``; empty groups own nothing.
    """
    idx = torch.arange(n, device=offs.device, dtype=torch.int64)
    return torch.searchsorted(offs.to(torch.int64), idx, right=True)


def grouped_rows_packed_row(offs: torch.Tensor, m: int) -> torch.Tensor:
    """Row of the virtual padded matrix that holds the scales of each of the ``m`` data rows.

    Group g's tiles start at ``P_g = sum_{h<g} ceil(m_h/128) * 128``.
    """
    sizes = group_sizes(offs)
    padded = (sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    p_start = torch.cumsum(padded, 0) - padded
    g = group_of_index(offs, m)
    r = torch.arange(m, device=offs.device, dtype=torch.int64)
    return p_start[g] + (r - group_starts(offs)[g])


# ---------------------------------------------------------------------------------------------
# dense <-> packed
# ---------------------------------------------------------------------------------------------


def _check_dense(dense: torch.Tensor) -> None:
    if dense.dtype != torch.uint8 or dense.dim() != 2:
        raise TypeError(f"dense scales must be a 2D uint8 tensor, got {dense.dtype} {dense.dim()}D")


def pack_scales(dense: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` uint8 dense scales -> flat uint8 packed buffer of `packed_scale_bytes` bytes."""
    _check_dense(dense)
    rows, nb = dense.shape
    out = torch.zeros(packed_scale_bytes(rows, nb), dtype=torch.uint8, device=dense.device)
    r = torch.arange(rows, device=dense.device)[:, None]
    c = torch.arange(nb, device=dense.device)[None, :]
    out[packed_scale_offset(r, c, nb).reshape(-1)] = dense.reshape(-1)
    return out


def unpack_scales(packed: torch.Tensor, rows: int, num_blocks: int) -> torch.Tensor:
    """Flat packed buffer -> ``(rows, num_blocks)`` dense uint8 scales."""
    r = torch.arange(rows, device=packed.device)[:, None]
    c = torch.arange(num_blocks, device=packed.device)[None, :]
    return packed.reshape(-1)[packed_scale_offset(r, c, num_blocks)]


def _grouped_rows_offsets(offs: torch.Tensor, m: int, nb: int) -> torch.Tensor:
    rows = grouped_rows_packed_row(offs, m)[:, None]
    c = torch.arange(nb, device=offs.device)[None, :]
    return packed_scale_offset(rows, c, nb)


def pack_scales_grouped_rows(dense: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``(M, C)`` dense scales of a row-grouped matrix -> packed, each group on a 128-row tile."""
    _check_dense(dense)
    m, nb = dense.shape
    out = torch.zeros(
        grouped_rows_scale_bytes(m, nb, offs.numel()), dtype=torch.uint8, device=dense.device
    )
    out[_grouped_rows_offsets(offs, m, nb).reshape(-1)] = dense.reshape(-1)
    return out


def unpack_scales_grouped_rows(packed: torch.Tensor, offs: torch.Tensor, m: int, nb: int):
    """Inverse of `pack_scales_grouped_rows`: ``(M, C)`` dense uint8."""
    return packed.reshape(-1)[_grouped_rows_offsets(offs, m, nb)]


def grouped_k_block_index(offs: torch.Tensor, m: int):
    """For each token index along a K-grouped axis: (group id, global block id, local block id).

    Blocks of 32 restart at each group's first token. Global block ids number the blocks of all
    groups consecutively (group g's first block is ``sum_{h<g} ceil(m_h/32)``).
    """
    sizes = group_sizes(offs)
    nblocks = (sizes + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_base = torch.cumsum(nblocks, 0) - nblocks
    g = group_of_index(offs, m)
    t = torch.arange(m, device=offs.device, dtype=torch.int64)
    local = (t - group_starts(offs)[g]) // BLOCK_SIZE
    return g, block_base[g] + local, local


def grouped_k_offsets(offs: torch.Tensor, rows: int, num_blocks_total: int):
    """Packed byte offsets ``(rows, J)`` of the global blocks of a K-grouped matrix, and validity.

    Global block j belongs to group g (its local index is c); group g's packed matrix has
    ``KB_g = ceil(m_g/32)`` blocks and starts at byte ``Rp * sum_{h<g} KBp_h``. ``J`` may exceed
    the real number of blocks (a static bound); the returned ``(J,)`` bool mask marks real ones.
    """
    sizes = group_sizes(offs)
    nblocks = (sizes + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_base = torch.cumsum(nblocks, 0) - nblocks
    nblocks_padded = (nblocks + TILE_BLOCKS - 1) // TILE_BLOCKS * TILE_BLOCKS
    byte_base = (torch.cumsum(nblocks_padded, 0) - nblocks_padded) * round_up(rows, TILE_ROWS)
    j = torch.arange(num_blocks_total, device=offs.device, dtype=torch.int64)
    g = torch.searchsorted(torch.cumsum(nblocks, 0), j, right=True)
    valid = g < offs.numel()
    g = g.clamp(max=offs.numel() - 1)
    c = (j - block_base[g])[None, :]
    r = torch.arange(rows, device=offs.device)[:, None]
    return byte_base[g][None, :] + packed_scale_offset(r, c, nblocks[g][None, :]), valid


def grouped_k_num_blocks(offs: torch.Tensor) -> int:
    """``sum_g ceil(m_g / 32)`` as a Python int (host sync: inspection and dense layouts only)."""
    return int(((group_sizes(offs) + BLOCK_SIZE - 1) // BLOCK_SIZE).sum().item())


def pack_scales_grouped_k(dense: torch.Tensor, offs: torch.Tensor, m: int) -> torch.Tensor:
    """``(R, sum_g ceil(m_g/32))`` dense scales of a K-grouped matrix -> packed per group.

    ``m`` is the grouped extent (``offs[-1]``), which sizes the buffer.
    """
    _check_dense(dense)
    rows, nbt = dense.shape
    out = torch.zeros(
        grouped_k_scale_bytes(rows, m, offs.numel()), dtype=torch.uint8, device=dense.device
    )
    out[grouped_k_offsets(offs, rows, nbt)[0].reshape(-1)] = dense.reshape(-1)
    return out


def unpack_scales_grouped_k(packed: torch.Tensor, offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `pack_scales_grouped_k`: ``(rows, sum_g ceil(m_g/32))`` dense uint8."""
    nbt = grouped_k_num_blocks(offs)
    return packed.reshape(-1)[grouped_k_offsets(offs, rows, nbt)[0]]


def pack_scales_experts(dense: torch.Tensor) -> torch.Tensor:
    """``(E, R, C)`` dense scales -> flat packed buffer, expert e at ``e * expert_scale_stride``."""
    if dense.dtype != torch.uint8 or dense.dim() != 3:
        raise TypeError("expert dense scales must be a 3D uint8 tensor")
    e, rows, nb = dense.shape
    stride = expert_scale_stride(rows, nb)
    out = torch.zeros(e * stride, dtype=torch.uint8, device=dense.device)
    ee = torch.arange(e, device=dense.device)[:, None, None]
    r = torch.arange(rows, device=dense.device)[None, :, None]
    c = torch.arange(nb, device=dense.device)[None, None, :]
    out[(ee * stride + packed_scale_offset(r, c, nb)).reshape(-1)] = dense.reshape(-1)
    return out


def unpack_scales_experts(packed: torch.Tensor, e: int, rows: int, nb: int) -> torch.Tensor:
    """Inverse of `pack_scales_experts`: ``(E, rows, nb)`` dense uint8."""
    stride = expert_scale_stride(rows, nb)
    ee = torch.arange(e, device=packed.device)[:, None, None]
    r = torch.arange(rows, device=packed.device)[None, :, None]
    c = torch.arange(nb, device=packed.device)[None, None, :]
    return packed.reshape(-1)[ee * stride + packed_scale_offset(r, c, nb)]
