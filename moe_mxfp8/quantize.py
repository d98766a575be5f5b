"""Public MXFP8 quantizers: argument checks, then the reference or a kernel per ``backend``.

All return `MXFP8Tensor`. The kernels (`kernels/quantize.py`, the same SIMT source for the
sm90 and sm100 backends) take checked, contiguous inputs and return plain ``(data, packed
scales)`` tensors, which this module wraps; ``scale_layout="dense"`` on a kernel backend unpacks
the scales afterwards (an inspection path, not a hot one). Every ``scale_blocks`` recipe runs on
the kernels: 1x32 or 1x128 activation blocks, 1x32, 32x32 or 128x128 weight scale tiles.

Every backend accepts the same inputs and returns the same bytes (the domain table in
``docs/numerics.md``): a non-contiguous or not 16-byte aligned input is copied before a kernel
reads it, empty tensors give empty results, and the quantizers are not differentiable (an input
that would record autograd history is refused on every backend).
"""

from __future__ import annotations

import torch

from . import checks as C
from . import layout as L
from . import reference as R
from . import stages as ST
from .backend import resolve_backend
from .kernels.grouped_gemm.problem import kernel_offs
from .kernels.mx_format import ACT_BLOCK, SCALE_BLOCKS, WEIGHT_BLOCK_ROWS
from .mx_tensor import MXFP8Tensor


def _check_common(fn: str, name: str, x: torch.Tensor, ndim, rounding: str, scale_layout: str,
                  offs):
    C.check_float_input(name, x, ndim)
    C.check_extents(name, x)
    C.check_not_differentiable(fn, name, x)
    C.check_rounding(rounding)
    C.check_scale_layout(scale_layout)
    if offs is not None:
        C.check_offs(offs, x.shape[0])  # values only where they live on the host (no GPU sync)
        C.check_same_device(**{name: x, "offs": offs})


def _kernel_offs(offs: torch.Tensor | None) -> torch.Tensor | None:
    """``offs`` as the kernels read it: a dense int32 array (a strided view is copied)."""
    return offs if offs is None else kernel_offs(offs)


def _colwise_ref(x: torch.Tensor, rounding: str, scale_layout: str, offs,
                 scale_blocks: str = "1x32", block_rows: int = 1):
    """The reference colwise, plus K == 0 with groups (the reference's reshape needs K > 0)."""
    if x.shape[1] or offs is None:
        return R.quantize_colwise_ref(x, rounding, scale_layout, offs, scale_blocks, block_rows)
    m = x.shape[0]
    data = torch.empty(0, m, dtype=torch.float8_e4m3fn, device=x.device)
    if scale_layout == "dense":
        scale = torch.zeros(0, L.grouped_k_num_blocks(offs), dtype=torch.uint8, device=x.device)
    else:
        scale = torch.zeros(L.grouped_k_scale_bytes(0, m, offs.numel()), dtype=torch.uint8,
                            device=x.device)
    return MXFP8Tensor(data, scale, scale_layout, offs, "k", block_rows)


def _kernel_module():
    """The quantizer kernels' entry points, `kernels/quantize_launch.py` (one SIMT source for
    the sm90 and sm100 backends). They import CuTeDSL only to compile a kernel: one loaded from
    the compile cache launches without it."""
    from .kernels import quantize_launch  # noqa: PLC0415

    return quantize_launch


def _to_dense(t: MXFP8Tensor) -> MXFP8Tensor:
    return MXFP8Tensor(t.data, t.dense_scales(), "dense", t.offs, t.group_axis, t.block_rows)


def _act_block(scale_blocks) -> int:
    """Elements per activation scale block of the recipe ``scale_blocks``: 32 or 128."""
    if not isinstance(scale_blocks, str) or scale_blocks not in ACT_BLOCK:
        raise ValueError(f"scale_blocks must be one of {SCALE_BLOCKS}, got {scale_blocks!r}")
    return ACT_BLOCK[scale_blocks]


def _row_tensor(data_scale: tuple[torch.Tensor, torch.Tensor], offs) -> MXFP8Tensor:
    """A rowwise kernel result ``(data, packed scales)`` as an `MXFP8Tensor`."""
    return MXFP8Tensor(*data_scale, "packed", offs, "rows" if offs is not None else None)


def _col_tensor(data_scale: tuple[torch.Tensor, torch.Tensor], offs,
                block_rows: int = 1) -> MXFP8Tensor:
    """A columnwise kernel result (``x.T`` data, packed scales) as an `MXFP8Tensor`."""
    return MXFP8Tensor(*data_scale, "packed", offs, "k" if offs is not None else None,
                       block_rows)


def quantize_rowwise(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto", scale_blocks: str = "1x32",
) -> MXFP8Tensor:
    """``x (M, K)`` bf16/fp16/fp32 -> MXFP8 ``(M, K)`` with blocks of 32 along K (K % 32 == 0).

    ``offs`` (int32 ``(G,)`` cumulative ends along M): each group's scale rows start on a
    128-row tile of the packed layout; the data is not padded. ``scale_blocks="1x128"``: one
    scale per 128 elements along K, replicated over its four 32-blocks (a valid MXFP8 tensor).
    """
    _check_common("quantize_rowwise", "x", x, 2, rounding, scale_layout, offs)
    C.check_multiple_of("x", x.shape[1], L.BLOCK_SIZE, "the last dim (K)")
    block = _act_block(scale_blocks)
    if resolve_backend(backend, x.device) == "reference":
        return R.quantize_rowwise_ref(x, rounding, scale_layout, offs, scale_blocks)
    offs = _kernel_offs(offs)
    out = _row_tensor(_kernel_module().quantize_rowwise(
        C.kernel_input(x), rounding=rounding, offs=offs, act_block=block), offs)
    return out if scale_layout == "packed" else _to_dense(out)


def quantize_colwise(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto", scale_blocks: str = "1x32",
    block_rows: int = 1,
) -> MXFP8Tensor:
    """``x (M, K)`` -> MXFP8 of ``x.T``: data ``(K, M)`` contiguous, blocks of 32 along M.

    Any M and any K (M's last block is zero-padded; K is not reduced, so needs no multiple).

    ``offs`` (groups along M): blocks restart at each group start; a group's last block is
    virtually zero-padded; scales packed per group (the 2D x 2D grouped convention).
    ``block_rows=128`` (with ``scale_blocks="1x128"``): one scale per 128 x 128 tile, 128
    features sharing each 128-token block's scale (docs/numerics.md, "The 1x128 recipe").
    """
    _check_common("quantize_colwise", "x", x, 2, rounding, scale_layout, offs)
    block = _act_block(scale_blocks)
    tiles = R.colwise_tiles(scale_blocks, block_rows)
    if resolve_backend(backend, x.device) == "reference":
        return _colwise_ref(x, rounding, scale_layout, offs, scale_blocks, block_rows)
    offs = _kernel_offs(offs)
    out = _col_tensor(_kernel_module().quantize_colwise(
        C.kernel_input(x), rounding=rounding, offs=offs, act_block=block, col_tile=tiles), offs,
        block_rows)
    return out if scale_layout == "packed" else _to_dense(out)


def quantize_dual(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto", scale_blocks: str = "1x32",
    col_block_rows: int = 1,
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both orientations of ``x (M, K)`` from one read: (rowwise ``(M, K)``, colwise ``(K, M)``);
    ``col_block_rows``: the colwise copy's ``block_rows`` (`quantize_colwise`)."""
    _check_common("quantize_dual", "x", x, 2, rounding, scale_layout, offs)
    C.check_multiple_of("x", x.shape[1], L.BLOCK_SIZE, "the last dim (K)")
    block = _act_block(scale_blocks)
    tiles = R.colwise_tiles(scale_blocks, col_block_rows)
    if resolve_backend(backend, x.device) == "reference":
        return (R.quantize_rowwise_ref(x, rounding, scale_layout, offs, scale_blocks),
                _colwise_ref(x, rounding, scale_layout, offs, scale_blocks, col_block_rows))
    offs = _kernel_offs(offs)
    row, col = _kernel_module().quantize_dual(C.kernel_input(x), rounding=rounding, offs=offs,
                                              act_block=block, col_tile=tiles)
    row, col = _row_tensor(row, offs), _col_tensor(col, offs, col_block_rows)
    if scale_layout == "dense":
        return _to_dense(row), _to_dense(col)
    return row, col


WEIGHT_AXES = ("K", "N")


def _check_weights(fn: str, w: torch.Tensor, axes, rounding: str, scale_layout: str,
                   block_rows: int) -> None:
    """The weight quantizers' argument checks, for the operands along each of ``axes``."""
    C.check_float_input("w", w, 3)
    C.check_extents("w", w, rows=w.shape[0] * w.shape[1])
    C.check_not_differentiable(fn, "w", w)
    C.check_rounding(rounding)
    C.check_scale_layout(scale_layout)
    for axis in axes:
        if axis not in WEIGHT_AXES:
            raise ValueError(f"axis must be 'K' (fprop) or 'N' (dgrad), got {axis!r}")
    if block_rows not in WEIGHT_BLOCK_ROWS.values():
        raise ValueError(f"block_rows must be 1 (1x32 blocks), 32 (32x32) or 128 (128x128), "
                         f"got {block_rows}")
    for axis in axes:
        C.check_multiple_of("w", w.shape[-1 if axis == "K" else -2], L.BLOCK_SIZE,
                            f"axis {axis}")
        if block_rows == 32:
            C.check_multiple_of("w", w.shape[-2 if axis == "K" else -1], 32,
                                "the other axis (32x32)")


def quantize_weights(
    w: torch.Tensor, *, axis: str = "K", rounding: str = "rceil", scale_layout: str = "packed",
    block_rows: int = 1, backend: str | None = "auto",
) -> MXFP8Tensor:
    """Expert weights ``w (E, N, K)`` -> MXFP8, each expert its own packed scale matrix.

    ``axis="K"``: data ``(E, N, K)``, blocks along K (fprop operand). ``axis="N"``: data
    ``(E, K, N)``, blocks along N (dgrad operand). ``block_rows=32``: one scale per 32x32 tile
    (both orientations then share values), an option; the default is 1x32 blocks.
    ``block_rows=128``: one scale per 128x128 tile (the "1x128" recipe's weights).
    """
    _check_weights("quantize_weights", w, (axis,), rounding, scale_layout, block_rows)
    if resolve_backend(backend, w.device) == "reference":
        return R.quantize_weights_ref(w, axis, rounding, scale_layout, block_rows)
    data, scale = _kernel_module().quantize_weights(C.kernel_input(w), axis=axis,
                                                    rounding=rounding, block_rows=block_rows)
    out = MXFP8Tensor(data, scale, "packed", None, "experts", block_rows)
    return out if scale_layout == "packed" else _to_dense(out)


def quantize_weights_dual(
    w: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    block_rows: int = 1, backend: str | None = "auto",
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both GEMM operands of expert weights ``w (E, N, K)`` from one read: ``(axis K, axis N)``,
    each the bytes `quantize_weights` gives for that axis (K and N multiples of 32)."""
    _check_weights("quantize_weights_dual", w, WEIGHT_AXES, rounding, scale_layout, block_rows)
    if resolve_backend(backend, w.device) == "reference":
        k_axis, n_axis = WEIGHT_AXES
        return (R.quantize_weights_ref(w, k_axis, rounding, scale_layout, block_rows),
                R.quantize_weights_ref(w, n_axis, rounding, scale_layout, block_rows))
    (data_k, scale_k), (data_n, scale_n) = _kernel_module().quantize_weights_dual(
        C.kernel_input(w), rounding=rounding, block_rows=block_rows)
    along_k = MXFP8Tensor(data_k, scale_k, "packed", None, "experts", block_rows)
    along_n = MXFP8Tensor(data_n, scale_n, "packed", None, "experts", block_rows)
    if scale_layout == "packed":
        return along_k, along_n
    return _to_dense(along_k), _to_dense(along_n)


TILED_WEIGHT_ROWS = (32, 128)  # weight tiles whose two axes share bytes and scale values


def weights_along_n(along_k: MXFP8Tensor, backend: str | None = "auto") -> MXFP8Tensor:
    """The N-axis (dgrad) operand of tiled expert weights from their K-axis (fprop) one, exact.

    With one scale per 32x32 or 128x128 tile (``block_rows`` 32 or 128) both orientations hold
    the same FP8 bytes (transposed) and the same tile scales: element and amax are the tile's in
    either axis (`quantize_weights`). So ``quantize_weights(w, axis="N")`` is ``along_k``'s data
    transposed per expert, with each tile's scale laid out for the transposed matrix: one byte
    copy, no quantizer, no BF16 weights (MXFP8 all-gathered weights, `moe_mxfp8.fsdp_mxfp8`).
    Where the data path's Triton kernels run (`stages.use_triton`: CUDA, Triton installed,
    ``backend`` not ``"reference"``) the bytes move through a tiled transpose kernel
    (`kernels.weights_triton`). Packed scales are relaid as whole 512-byte
    chunks (`_tiled_scales_along_n`).
    """
    if along_k.group_axis != "experts" or along_k.block_rows not in TILED_WEIGHT_ROWS:
        raise ValueError(f"weights_along_n: needs expert weights with 32x32 or 128x128 scale "
                         f"tiles, got group_axis={along_k.group_axis!r} block_rows="
                         f"{along_k.block_rows}")
    e, n, k = along_k.data.shape
    C.check_multiple_of("along_k", n, L.BLOCK_SIZE, "the N axis")
    if ST.use_triton(along_k.data, backend):
        from .kernels import weights_triton

        data = weights_triton.transpose_experts(along_k.data.view(torch.uint8).contiguous())
    else:
        data = along_k.data.view(torch.uint8).transpose(-2, -1).contiguous()
    data = data.view(along_k.data.dtype)
    if along_k.scale_layout == "packed":
        return MXFP8Tensor(data, _tiled_scales_along_n(along_k.scale, e, n, k), "packed", None,
                           "experts", along_k.block_rows)
    # dense (E, N, K/32): the scale of N-block j on row k is the tile's, on N row 32 j and
    # K block k // 32
    per_n_block = along_k.scale[:, :: L.BLOCK_SIZE, :]  # (E, N/32, K/32)
    dense_n = per_n_block.repeat_interleave(L.BLOCK_SIZE, dim=2)[:, :, :k].transpose(1, 2)
    return MXFP8Tensor(data, dense_n.contiguous(), "dense", None, "experts", along_k.block_rows)


def _tiled_scales_along_n(scale: torch.Tensor, e: int, n: int, k: int) -> torch.Tensor:
    """`weights_along_n`'s packed scales: views and one permuted copy, no index arithmetic.

    A packed chunk holds 128 rows x 4 blocks as ``[row % 32][row group of 32][block % 4]``; with
    one scale per 32x32 (or 128x128) tile its value depends on the row group and the block only,
    so a chunk is a 4x4 matrix of tile scales repeated over the 32 rows. The transposed matrix's
    chunk (k tile, n tile) holds the transposed 4x4 of chunk (n tile, k tile): its row groups are
    the blocks of 32 columns, and its blocks the row groups. N and K are multiples of 32, so a
    padding row group (past N) becomes a padding block and a padding block (past K) a padding row
    group: the zero bytes of the layout stay zero.
    """
    nt, kt = L.ceil_div(n, L.TILE_ROWS), L.ceil_div(k, L.TILE_ROWS)
    g = L.TILE_ROWS // L.BLOCK_SIZE  # row groups of a chunk (= its blocks, L.TILE_BLOCKS)
    groups = scale.view(e, nt, kt, L.BLOCK_SIZE, g, g)[:, :, :, 0]  # (E, NT, KT, group, block)
    swapped = groups.permute(0, 2, 1, 4, 3)  # (E, KT, NT, group', block')
    return swapped.unsqueeze(3).expand(e, kt, nt, L.BLOCK_SIZE, g, g).reshape(-1)
