"""The MXFP8 format facts that every layer of moe_mxfp8 shares (docs/numerics.md).

One place for the contract's numbers and the packed scale layout's arithmetic: the API
(`moe_mxfp8.layout`, `moe_mxfp8.reference`, the argument checks) and the kernels below it import
them from here, so a kernel never reaches up into the API for a constant. Pure Python: importing
this module imports neither CuTeDSL nor Triton (and torch only for type hints of the formulas,
which take Python ints or integer tensors alike).
"""

from __future__ import annotations

# --- values: E4M3 data, E8M0 scales (docs/numerics.md, "Formats") -----------------------------
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # the scale byte of a block that holds NaN or Inf
E4M3_EMAX_BIASED = 135  # 127 (fp32 bias) + 8 (log2 of 448's octave: 448 = 1.75 * 2^8)
RCEIL_MANTISSA_THRESHOLD = 0x600000  # mantissa field of 1.75: above it, amax > 448 * 2^e
FP32_EXP_INF = 0xFF

# --- blocks and the packed scale layout (docs/numerics.md, "Scale layouts") ------------------
BLOCK_SIZE = 32  # elements per scale block along the reduced axis
TILE_ROWS = 128  # rows per packed tile
TILE_BLOCKS = 4  # blocks per packed tile
TILE_BYTES = TILE_ROWS * TILE_BLOCKS  # 512
ROW_TABLE_COLS = 6  # the data path's block table: rs, re, prow0, tiles, lblk, nblk

# --- scale-block choice (one vocabulary for the quantizers, grouped_mm and MXFP8MoE) ---------
# "1x32": exact MXFP8 everywhere (default). "32x32": weights one scale per 32x32 tile. "1x128":
# one scale per 128 elements along the reduced axis for activations and gradients, one per
# 128x128 weight tile; every 32-block carries its 128-block's scale, so each tensor is a valid
# MXFP8 tensor (docs/numerics.md, "The 1x128 recipe").
SCALE_BLOCKS = ("1x32", "32x32", "1x128")
ACT_BLOCK = {"1x32": 32, "32x32": 32, "1x128": 128}  # activation/gradient block length
WEIGHT_BLOCK_ROWS = {"1x32": 1, "32x32": 32, "1x128": 128}  # weight tile rows (1: 1x32 blocks)
BLOCK_128 = 128
# rows of a columnwise copy ``x.T`` that share a scale: 1, or 128 -- 128 x 128 tiles of 128
# features x 128 tokens (1x128 blocks only)
COLWISE_BLOCK_ROWS = (1, BLOCK_128)
# per recipe, the block_rows of the weight-gradient GEMM's activation operand (the columnwise
# copy of x or a saved in forward; the gradient operand keeps 1): docs/numerics.md
WGRAD_ACT_BLOCK_ROWS = {"1x32": 1, "32x32": 1, "1x128": BLOCK_128}

# --- the domain every backend accepts (docs/numerics.md, "Domain: what every backend accepts")
# Largest extent of one dimension (and of E*N expert rows): kernels pass extents and token
# counts as int32 (as ``offs`` is int32 by contract); element counts and offsets are 64-bit.
MAX_EXTENT = 2**31 - 1
KERNEL_INPUT_ALIGN = 16  # bytes: the quantizer kernels' vector loads (inputs are copied if not)
# Group alignment of K-grouped (wgrad) operands, in tokens: TMA reads the tokens along rows, and
# Hopper traps on an innermost box coordinate that is not 16-byte aligned (fp8: 16 tokens).
K_GROUP_ALIGN = 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def packed_scale_offset(r, c, num_blocks):
    """Byte offset of ``scales[r, c]`` in a packed scale matrix of ``num_blocks`` blocks a row.

    ``r``, ``c`` and ``num_blocks`` may be Python ints or integer tensors (broadcast together).
    The contract's formula, and its only host-side copy (``kernels/common.py`` holds the device
    mirror)::

        tile   = (r // 128) * ceil(C / 4) + (c // 4)
        offset = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    """
    tiles_per_row_tile = (num_blocks + (TILE_BLOCKS - 1)) // TILE_BLOCKS
    tile = (r // TILE_ROWS) * tiles_per_row_tile + c // TILE_BLOCKS
    return tile * TILE_BYTES + (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4 + c % TILE_BLOCKS


def packed_scale_bytes(rows: int, num_blocks: int) -> int:
    """Size in bytes of one packed scale matrix of ``rows`` x ``num_blocks``."""
    return round_up(rows, TILE_ROWS) * round_up(num_blocks, TILE_BLOCKS)


def tiles_bound(m: int, num_groups: int, tile: int) -> int:
    """Static bound of ``sum_g ceil(m_g / tile)`` for any split of ``m`` into ``num_groups``.

    ``sum_g ceil(m_g/T) = sum_g floor((m_g + T - 1)/T) <= floor((m + (T-1) G) / T)``; exact for
    G = 1. Sizes grouped buffers and grids without reading ``offs`` on the host.
    """
    return (m + (tile - 1) * num_groups) // tile


def grouped_row_tiles_bound(m: int, num_groups: int) -> int:
    """`tiles_bound` for the packed layout's 128-row tiles."""
    return tiles_bound(m, num_groups, TILE_ROWS)


def grouped_rows_scale_bytes(m: int, num_blocks: int, num_groups: int) -> int:
    """Packed scale buffer size for an ``(m, K)`` matrix whose rows are split into groups."""
    return grouped_row_tiles_bound(m, num_groups) * TILE_ROWS * round_up(num_blocks, TILE_BLOCKS)


def grouped_k_scale_bytes(rows: int, m: int, num_groups: int) -> int:
    """Packed scale buffer size for a ``(rows, m)`` matrix whose reduced axis m is split in groups.

    Group g takes ``Rp * KBp_g`` bytes with ``KBp_g = ceil(ceil(m_g/32)/4)*4 = 4*ceil(m_g/128)``.
    """
    return round_up(rows, TILE_ROWS) * TILE_BLOCKS * grouped_row_tiles_bound(m, num_groups)


def expert_scale_stride(rows: int, num_blocks: int) -> int:
    """Bytes between consecutive experts' packed scales of ``(E, rows, K)`` weights."""
    return packed_scale_bytes(rows, num_blocks)


def group_blocks_bound(m: int, num_groups: int, block: int) -> int:
    """Static bound of ``sum_g ceil(m_g / block)`` over any split of ``m`` rows into groups:
    ``(m + (block - 1) * G) // block`` (blocks that restart at every group: the data path's
    block table, K-grouped 32-blocks)."""
    return (m + (block - 1) * num_groups) // block


def padded_extent(m: int, num_groups: int, align: int) -> int:
    """Static bound of ``sum_g round_up(m_g, align)`` over any split of ``m`` rows into groups,
    rounded up to ``align``: ``round_up(m + (align - 1) * G, align)`` (``m`` for ``align`` 1).
    The one copy of the group-padded extent (sorted MoE rows, re-laid K-grouped operands)."""
    return round_up(m + (align - 1) * num_groups, align)


def scale_tiles_per_row_tile(k: int) -> int:
    """Packed 512-byte tiles per 128-row tile for a reduced extent ``k``: ``ceil(ceil(k/32)/4)``."""
    return ceil_div(ceil_div(k, BLOCK_SIZE), TILE_BLOCKS)
