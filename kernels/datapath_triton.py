"""Triton kernels of the MoE data path (`moe_mxfp8.stages`): dispatch, SwiGLU and combine,
fused with MXFP8 quantization, and their backward passes. Optional GPU dependency (``triton``).

Every kernel mirrors a pure-PyTorch reference in `moe_mxfp8.stages` bit for bit (quantized
bytes, scale bytes, BF16 roundings, sums in a fixed order); the GPU tests check it.

Activation blocks. ``ABLK`` (a constexpr) is the scale-block length of the quantized copies:
32 (MXFP8, the "1x32" and "32x32" recipes) or 128 (the "1x128" recipe, docs/numerics.md: one
scale per 128 elements along the reduced axis, RCEIL over the 128 values, its byte written into
each of the block's 32-blocks, so the copies stay valid MXFP8 tensors).

Row-block grid: the expert-sorted, group-padded buffer of ``M`` rows is cut into blocks of
``ABLK`` rows that restart at every group start (the K-grouped blocks of the contract),
described by a table built on the device (`moe_mxfp8.routing.block_table`, one int32 row per
block):

    rs, re       rows [rs, re) of the block (re == rs: an unused block of the static bound)
    prow0        packed row of row r in the grouped-rows scale layout is prow0 + r
    tiles        T_g = sum_{h<g} ceil(m_h / 128): the group's K-grouped scale base / (Rp * 4)
    lblk, nblk   the block's index inside its group and the group's block count (ABLK blocks)

One program owns an ABLK-row block x CB features (CB a multiple of ABLK), so it can write both
quantized copies: rowwise (blocks of ABLK along the features) and columnwise (the block's rows of
every feature, stored transposed). It computes the block RB rows at a time (`ROW_TILING`):
each chunk's values go out as the BF16 and rowwise copies and update the running column maxima.
With one chunk (RB == ABLK) its registers give the columnwise copy too (one read of the
inputs); with smaller chunks of a 128-row block the columnwise copy needs the whole block's
maxima first, so a second walk recomputes each chunk from its inputs (re-read from L2) and
stores it, instead of holding 128 rows in registers.
Every row of ``[0, M)`` belongs to exactly one block, so every data byte is written (pad rows as
zeros); scale buffers start zeroed (the layout's padding bytes), their real bytes are written here.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import on_device
from .mx_format import BLOCK_128, BLOCK_SIZE, K_GROUP_ALIGN

try:  # libdevice's expf is what PyTorch's CUDA silu calls (bit-identical SwiGLU)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton layouts
    from triton.language.extra.cuda import libdevice

BLOCK = BLOCK_SIZE  # MXFP8 block: the scale layout's unit
QBLK: tl.constexpr = tl.constexpr(BLOCK)  # the same, visible inside @triton.jit
ACT_BLOCKS = (BLOCK_SIZE, BLOCK_128)  # activation block lengths (ABLK) the kernels take
COL_TILE = 128  # features per program (a multiple of every ABLK)
TOK_TILE = 16  # tokens per program in the per-token kernels


class RowTiling(NamedTuple):
    """How a row-block kernel walks an ABLK-row block: ``rows`` (RB) at a time with ``warps``
    (RB < ABLK: the chunks are recomputed from their inputs for the columnwise copy, see the
    module doc); ``maxnreg``: a cap on registers per thread (Triton's), if any."""

    rows: int
    warps: int
    maxnreg: int | None = None


# Per kernel and activation block length (H100, docs/design/datapath.md;
# benchmarks/bench_rowkernels.py). 32-row blocks: the block at 4 warps (8 were 38-65% slower).
# 128-row blocks: the combine backward walks 32-row chunks at 4 warps (1.2x faster than one
# 128-row tile), re-reading them from L2; the dispatch and the SwiGLU kernels hold one 128-row
# tile at 8 warps (dispatch 1.36x faster than 32-row chunks at dsv3, no spills; SwiGLU faster
# than at 16 or 32 warps, than 32-row chunks recomputed or held in registers, and than with a
# register cap once it divides with IEEE rounding).
ROW_TILING = {
    "dispatch": {BLOCK_SIZE: RowTiling(BLOCK_SIZE, 4), BLOCK_128: RowTiling(BLOCK_128, 8)},
    "swiglu_fwd": {BLOCK_SIZE: RowTiling(BLOCK_SIZE, 4), BLOCK_128: RowTiling(BLOCK_128, 8)},
    "swiglu_bwd": {BLOCK_SIZE: RowTiling(BLOCK_SIZE, 4), BLOCK_128: RowTiling(BLOCK_128, 8)},
    "combine_bwd": {BLOCK_SIZE: RowTiling(BLOCK_SIZE, 4), BLOCK_128: RowTiling(BLOCK_SIZE, 4)},
}
# Group alignment the row kernels can be told of (the MXFP8 layer's: K_GROUP_ALIGN rows, the
# wgrad TMA's); one byte a token in the columnwise copy, so 16 rows = one 16-byte store.
ROW_ALIGN = K_GROUP_ALIGN
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Triton types of the kernels' arguments for a build without a launch (the CPU tests' sm_90
# builds, tools/triton_sass.py): pointers not named here are uint8, other scalars int32
ARG_TYPES = {**{n: "*bf16" for n in ("x_ptr", "h_ptr", "da_ptr", "dout_ptr", "y_ptr", "out_ptr")},
             **{n: "*i32" for n in ("src_ptr", "tbl_ptr", "rows_ptr")},
             "w_ptr": "*fp32", "part_ptr": "*fp32"}


# ---------------------------------------------------------------------------------------------
# Quantization helpers (the contract of docs/numerics.md, from the bits of amax)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scale_from_amax(amax_bits):
    """int32 |amax| bits -> (E8M0 byte as int32, fp32 2^-e): RCEIL, clamp, 0xFF for NaN/Inf."""
    ex = amax_bits >> 23
    e = ex - 135 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    nonfinite = ex == 255
    byte = tl.where(nonfinite, 255, e + 127)
    e = tl.where(nonfinite, 0, e)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return byte, inv


@triton.jit
def _e4m3_byte(v, INTERP: tl.constexpr):
    """E4M3 byte (uint8) of fp32 ``v`` (a value times its block's 2^-e), round-to-nearest-even,
    saturating to +-448.

    On the GPU this is the hardware conversion (``cvt.rn.satfinite``), which saturates itself:
    no clamp instructions (the RCEIL scale keeps every finite block within +-448 anyway; only
    the elements of a NaN/Inf block, scale 0xFF, whose bytes the contract leaves unspecified,
    could differ from a clamp's). The interpreter's conversion mis-rounds at octave carries, so
    there the value is clamped and the rounding done on the integer bits.
    """
    if INTERP:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        bits = v.to(tl.int32, bitcast=True)
        sign = ((bits >> 31) & 1) << 7
        a = bits & 0x7FFFFFFF
        ex = a >> 23
        r = a >> 20  # exponent and the top 3 mantissa bits
        rem = a & 0xFFFFF
        up = (rem > 0x80000) | ((rem == 0x80000) & ((r & 1) == 1))
        normal = r + up.to(tl.int32) - (120 << 3)
        s = (a & 0x7FFFFF) | 0x800000
        sh = tl.minimum(tl.maximum(141 - ex, 1), 30)
        q = s >> sh
        rem2 = s & (((q * 0 + 1) << sh) - 1)
        half = (q * 0 + 1) << (sh - 1)
        up2 = (rem2 > half) | ((rem2 == half) & ((q & 1) == 1))
        sub = tl.where(ex >= 117, q + up2.to(tl.int32), 0)
        code = tl.where(ex >= 121, normal, sub)
        return (code | sign).to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _rbf(v, INTERP: tl.constexpr):
    """fp32 ``v`` rounded to the nearest BF16 (ties to even), as fp32. The interpreter's cast
    truncates, so there the rounding is done on the bits (finite values only)."""
    if INTERP:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _packed_offset(r, c, nb):
    """Byte offset of scales[r, c] in a packed matrix of ``nb`` blocks a row (layout.py)."""
    tile = (r // 128) * ((nb + 3) // 4) + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@triton.jit
def _row_blocks(x, INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                ABLK: tl.constexpr):
    """Rowwise MXFP8 of the fp32 tile ``x (RB, CB)`` in blocks of ABLK along the features (the
    tile starts on a block): E4M3 bytes ``(RB, CB)`` and the scale byte of each 32-block
    ``(RB, CB // 32)`` (an ABLK-block's byte repeated over its 32-blocks)."""
    x3 = tl.reshape(x, (RB, CB // ABLK, ABLK))
    bits = x3.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    byte, inv = _scale_from_amax(tl.max(bits, axis=2))
    q = tl.reshape(_e4m3_byte(x3 * inv[:, :, None], INTERP), (RB, CB))
    if ABLK != QBLK:  # one byte per 32-block: repeat each ABLK-block's byte
        byte = tl.reshape(tl.broadcast_to(byte[:, :, None], (RB, CB // ABLK, ABLK // QBLK)),
                          (RB, CB // QBLK))
    return q, byte


@triton.jit
def _quant_rows(x, rows, rmask, prow, cols, cmask, blk, bmask, q_ptr, s_ptr, ld, nb,
                INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, ABLK: tl.constexpr):
    """Rowwise MXFP8 of the fp32 tile ``x (RB, CB)`` (`_row_blocks`) stored: the bytes at
    ``q[rows, cols]``, each 32-block's scale byte in the packed layout.

    ``cols``: output columns (CB,), ``blk``: their 32-block indices (CB // 32,) and ``bmask``
    which of them hold real columns, ``prow``: packed scale row of each tile row, ``ld``:
    output row stride, ``nb``: 32-blocks per output row.
    """
    q, byte = _row_blocks(x, INTERP, RB, CB, ABLK)
    rows64 = rows.to(tl.int64)
    tl.store(q_ptr + rows64[:, None] * ld + cols[None, :], q,
             mask=rmask[:, None] & cmask[None, :])
    off = _packed_offset(prow.to(tl.int64)[:, None], blk[None, :], nb)
    tl.store(s_ptr + off, byte.to(tl.uint8), mask=rmask[:, None] & bmask[None, :])


@triton.jit
def _col_amax(x):
    """(RB, CB) fp32 -> (CB,) int32 bits of each column's |amax| (rows outside the block are
    zero in ``x``)."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)


@triton.jit
def _tile_amax(camax, COLT: tl.constexpr):
    """Column amaxes ``(CB,)`` -> the same, or (``COLT``: 128 x 128 columnwise tiles, CB ==
    128 features from a multiple of 128) their maximum for every column (columns past the
    features hold 0: neutral)."""
    if COLT:
        return tl.zeros_like(camax) + tl.max(camax, axis=0)
    return camax


@triton.jit
def _store_cols(x, inv, rows, rmask, feats, fmask, q_ptr, m, INTERP: tl.constexpr):
    """Columnwise E4M3 bytes of the fp32 tile ``x (RB, CB)`` with the per-feature ``inv`` =
    2^-e, stored transposed at ``q[feat, row]`` (row stride ``m``)."""
    q = _e4m3_byte(x * inv[None, :], INTERP)
    tl.store(q_ptr + feats.to(tl.int64)[None, :] * m + rows[:, None], q,
             mask=rmask[:, None] & fmask[None, :])


@triton.jit
def _store_col_scales(byte, feats, fmask, s_ptr, base, lblk, nblk, nrows, ABLK: tl.constexpr):
    """The block's byte per feature, into each of its 32-blocks that holds a row, at ``base +
    packed(feat, 32-block)`` of the group's matrix (``lblk``, ``nblk``: the block's index and
    count in ABLK blocks, ``nrows``: its rows)."""
    sub: tl.constexpr = ABLK // QBLK
    f64 = feats.to(tl.int64)
    for i in tl.static_range(sub):
        off = base + _packed_offset(f64, lblk * sub + i, nblk * sub)
        tl.store(s_ptr + off, byte.to(tl.uint8), mask=fmask & (nrows > QBLK * i))


@triton.jit
def _block(tbl_ptr, b, RALIGN: tl.constexpr):
    """ABLK-row block ``b``: rows [rs, re) and the layout constants (see the module doc).
    ``RALIGN``: every group starts (and so every block starts and ends) on a multiple of it;
    told to the compiler, it lets the columnwise copy's transposed rows go out as 16-byte stores
    instead of single bytes."""
    j = b.to(tl.int64) * 6
    rs = tl.load(tbl_ptr + j)
    re = tl.load(tbl_ptr + j + 1)
    if RALIGN > 1:
        rs = tl.multiple_of(rs, RALIGN)
        re = tl.multiple_of(re, RALIGN)
    prow0 = tl.load(tbl_ptr + j + 2)
    tiles = tl.load(tbl_ptr + j + 3).to(tl.int64)
    lblk = tl.load(tbl_ptr + j + 4)
    nblk = tl.load(tbl_ptr + j + 5)
    return rs, re, prow0, tiles, lblk, nblk


@triton.jit
def _chunk(rs, re, c, RB: tl.constexpr):
    """Rows of chunk ``c`` (RB rows) of the block [rs, re) and which of them are in it."""
    rows = rs + c * RB + tl.arange(0, RB)
    return rows, rows < re


@triton.jit
def _cols(F, ct, CB: tl.constexpr):
    """Column tile ``ct``: its CB of the ``F`` features and which of them exist."""
    cols = ct * CB + tl.arange(0, CB)
    return cols, cols < F


@triton.jit
def _pairs(src_ptr, rows, rmask):
    """The source pair of every row (-1 on pad rows) and which rows hold one."""
    src = tl.load(src_ptr + rows, mask=rmask, other=-1)
    return src, rmask & (src >= 0)


@triton.jit
def _write_rows(v, rows, rmask, prow0, ct, cols, cmask, off, n, ld, qr_ptr, sr_ptr, out_ptr,
                QROW: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr,
                RB: tl.constexpr, CB: tl.constexpr, ABLK: tl.constexpr):
    """A chunk's fp32 tile ``v``, features ``cols`` (column tile ``ct``) of ``n``, stored at
    column ``cols + off`` of output rows ``ld`` wide: BF16 and/or rowwise MXFP8 (blocks of ABLK
    along the features)."""
    if BF16:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * ld + (cols + off)[None, :],
                 v.to(tl.bfloat16), mask=rmask[:, None] & cmask[None, :])
    if QROW:
        blk = ct * (CB // QBLK) + tl.arange(0, CB // QBLK)
        _quant_rows(v, rows, rmask, prow0 + rows, cols + off, cmask, blk + off // QBLK,
                    blk < n // QBLK, qr_ptr, sr_ptr, ld, ld // QBLK, INTERP, RB, CB, ABLK)


@triton.jit
def _tile_copies(v, rows, rmask, prow0, ct, cols, cmask, off, n, ld, qr_ptr, sr_ptr, out_ptr,
                 qc_ptr, sc_ptr, M, base, lblk, nblk, nrows, QROW: tl.constexpr,
                 QCOL: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr,
                 RB: tl.constexpr, CB: tl.constexpr, ABLK: tl.constexpr, COLT: tl.constexpr):
    """Every copy of a whole block's tile ``v`` (RB == ABLK), features ``cols`` of ``n`` at
    column ``cols + off``: BF16 and rowwise (`_write_rows`), then the columnwise copy and its
    scales (``COLT``: one per 128 x 128 tile), so that the tile is dead before the kernel's
    next tile is needed."""
    _write_rows(v, rows, rmask, prow0, ct, cols, cmask, off, n, ld, qr_ptr, sr_ptr, out_ptr,
                QROW, BF16, INTERP, RB, CB, ABLK)
    if QCOL:
        byte, inv = _scale_from_amax(_tile_amax(_col_amax(v), COLT))
        _store_cols(v, inv, rows, rmask, cols + off, cmask, qc_ptr, M, INTERP)
        _store_col_scales(byte, cols + off, cmask, sc_ptr, base, lblk, nblk, nrows, ABLK)


@triton.jit
def _walk_block(VALUES: tl.constexpr, in_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr,
                out_ptr, F, M, TOPK, RP, QROW: tl.constexpr, QCOL: tl.constexpr,
                BF16: tl.constexpr, INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                ABLK: tl.constexpr, RALIGN: tl.constexpr, COLT: tl.constexpr):
    """A row-block program whose output tile is ``VALUES(in_ptr, src_ptr, rows, rmask, cols,
    cmask, F, TOPK, INTERP)`` (F features wide): one tile (`_tile_copies`), or the chunk walk of
    the module doc -- BF16 and rowwise copies per chunk, then the columnwise copy from the
    block's column maxima (``COLT``: the tile's maximum, `_tile_amax`)."""
    b, ct = tl.program_id(0), tl.program_id(1)
    rs, re, prow0, tiles, lblk, nblk = _block(tbl_ptr, b, RALIGN)
    cols, cmask = _cols(F, ct, CB)
    if RB == ABLK:  # one tile: its registers give every copy (one read of the inputs)
        rows, rmask = _chunk(rs, re, 0, RB)
        v = VALUES(in_ptr, src_ptr, rows, rmask, cols, cmask, F, TOPK, INTERP)
        _tile_copies(v, rows, rmask, prow0, ct, cols, cmask, 0, F, F, qr_ptr, sr_ptr, out_ptr,
                     qc_ptr, sc_ptr, M, tiles * RP * 4, lblk, nblk, re - rs, QROW, QCOL, BF16,
                     INTERP, RB, CB, ABLK, COLT)
        return
    camax = tl.zeros((CB,), dtype=tl.int32)
    for c in range(ABLK // RB):
        rows, rmask = _chunk(rs, re, c, RB)
        v = VALUES(in_ptr, src_ptr, rows, rmask, cols, cmask, F, TOPK, INTERP)
        _write_rows(v, rows, rmask, prow0, ct, cols, cmask, 0, F, F, qr_ptr, sr_ptr, out_ptr,
                    QROW, BF16, INTERP, RB, CB, ABLK)
        if QCOL:
            camax = tl.maximum(camax, _col_amax(v))
    if QCOL:
        byte, inv = _scale_from_amax(_tile_amax(camax, COLT))
        for c in range(ABLK // RB):  # recompute (inputs from L2): no 128 rows in registers
            rows, rmask = _chunk(rs, re, c, RB)
            v = VALUES(in_ptr, src_ptr, rows, rmask, cols, cmask, F, TOPK, INTERP)
            _store_cols(v, inv, rows, rmask, cols, cmask, qc_ptr, M, INTERP)
        _store_col_scales(byte, cols, cmask, sc_ptr, tiles * RP * 4, lblk, nblk, re - rs, ABLK)


@triton.jit
def _token_tile(T, D, TB: tl.constexpr, CB: tl.constexpr):
    """The per-token kernels' tile: TB tokens (``t``, ``tmask``) x CB features (``cols``) and
    its (TB, CB) mask."""
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    tmask = t < T
    cols = tl.program_id(1) * CB + tl.arange(0, CB)
    return t, tmask, cols, tmask[:, None] & (cols < D)[None, :]


# ---------------------------------------------------------------------------------------------
# Dispatch: x (T, D) -> expert-sorted padded rows, quantized (rowwise + columnwise) and/or BF16
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dispatch_rows(x_ptr, src_ptr, rows, rmask, cols, cmask, D, TOPK, INTERP: tl.constexpr):
    """fp32 ``x[token of the row's pair]`` of a chunk's rows (zero on pad rows)."""
    src, valid = _pairs(src_ptr, rows, rmask)
    tok = tl.where(valid, src // TOPK, 0).to(tl.int64)
    return tl.load(x_ptr + tok[:, None] * D + cols[None, :], mask=valid[:, None] & cmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _dispatch_kernel(x_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, out_ptr,
                     D, M, TOPK, RP,
                     QROW: tl.constexpr, QCOL: tl.constexpr, BF16: tl.constexpr,
                     INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                     ABLK: tl.constexpr, RALIGN: tl.constexpr, COLT: tl.constexpr):
    _walk_block(_dispatch_rows, x_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, out_ptr,
                D, M, TOPK, RP, QROW, QCOL, BF16, INTERP, RB, CB, ABLK, RALIGN, COLT)


@triton.jit
def _gather_sum_kernel(src_ptr, rows_ptr, out_ptr, T, D, TOPK: tl.constexpr,
                       INTERP: tl.constexpr, TB: tl.constexpr, CB: tl.constexpr):
    """out[t] = sum_{j < k} src[rows[t, j]] in fp32, j in order (dispatch backward)."""
    t, tmask, cols, mask = _token_tile(T, D, TB, CB)
    acc = tl.zeros((TB, CB), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(rows_ptr + t.to(tl.int64) * TOPK + j, mask=tmask, other=0).to(tl.int64)
        acc += tl.load(src_ptr + r[:, None] * D + cols[None, :], mask=mask, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + cols[None, :],
             _rbf(acc, INTERP).to(tl.bfloat16), mask=mask)


# ---------------------------------------------------------------------------------------------
# SwiGLU: h = [gate | up] (M, 2H) -> a = silu(gate) * up, quantized and/or BF16; and backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _exp(x, INTERP: tl.constexpr):
    if INTERP:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _div(a, b, INTERP: tl.constexpr):
    """IEEE fp32 division, as PyTorch's CUDA silu kernels divide: Triton's ``/`` compiles to
    the approximate ``div.full.f32`` (up to 2 ulp), which made a BF16 SwiGLU-backward value
    differ from PyTorch's by 1 ulp for rare inputs (a 1x128 layer test seed;
    docs/design/datapath.md)."""
    if INTERP:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def _gate_up(h_ptr, rows, ok, cols, cmask, H, INTERP: tl.constexpr):
    """The fp32 gate and up tiles of the rows ``ok`` (zero elsewhere), ``valid`` their mask,
    and PyTorch's BF16 ``F.silu(gate)`` (silu in fp32 rounded to BF16)."""
    valid = ok[:, None] & cmask[None, :]
    base = h_ptr + rows.to(tl.int64)[:, None] * (2 * H) + cols[None, :]
    g = tl.load(base, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(base + H, mask=valid, other=0.0).to(tl.float32)
    return valid, g, u, _rbf(_div(g, 1.0 + _exp(-g, INTERP), INTERP), INTERP)


@triton.jit
def _swiglu_rows(h_ptr, src_ptr, rows, rmask, cols, cmask, H, TOPK, INTERP: tl.constexpr):
    """A chunk's fp32 ``a``: PyTorch's BF16 `F.silu(gate) * up` (silu in fp32 rounded to BF16,
    the product rounded to BF16); zero on pad rows. (``TOPK``: unused, `_walk_block`'s.)"""
    _, ok = _pairs(src_ptr, rows, rmask)
    _, g, u, s = _gate_up(h_ptr, rows, ok, cols, cmask, H, INTERP)
    return _rbf(s * u, INTERP)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, out_ptr,
                       H, M, RP,
                       QROW: tl.constexpr, QCOL: tl.constexpr, BF16: tl.constexpr,
                       INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                       ABLK: tl.constexpr, RALIGN: tl.constexpr, COLT: tl.constexpr):
    _walk_block(_swiglu_rows, h_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, out_ptr,
                H, M, 1, RP, QROW, QCOL, BF16, INTERP, RB, CB, ABLK, RALIGN, COLT)


@triton.jit
def _swiglu_grads(da, g, u, s, INTERP: tl.constexpr):
    """Autograd of the BF16 `F.silu(gate) * up`: mul backward in BF16, then PyTorch's CUDA
    silu_backward formula dy * sig * (1 + x * (1 - sig)) in fp32. Returns (dgate, dup)."""
    dup = _rbf(da * s, INTERP)
    ds = _rbf(da * u, INTERP)
    sig = _div(tl.full(g.shape, 1.0, tl.float32), 1.0 + _exp(-g, INTERP), INTERP)
    return _rbf(ds * sig * (1.0 + g * (1.0 - sig)), INTERP), dup


@triton.jit
def _swiglu_bwd_rows(da_ptr, h_ptr, src_ptr, rows, rmask, feats, fmask, H, INTERP: tl.constexpr):
    """A chunk's fp32 (dgate, dup) of features ``feats`` (zero on pad rows)."""
    _, ok = _pairs(src_ptr, rows, rmask)
    valid, g, u, s = _gate_up(h_ptr, rows, ok, feats, fmask, H, INTERP)
    da = tl.load(da_ptr + rows.to(tl.int64)[:, None] * H + feats[None, :], mask=valid,
                 other=0.0).to(tl.float32)
    return _swiglu_grads(da, g, u, s, INTERP)


@triton.jit
def _swiglu_bwd_kernel(da_ptr, h_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, out_ptr,
                       H, M, RP,
                       QROW: tl.constexpr, QCOL: tl.constexpr, BF16: tl.constexpr,
                       INTERP: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                       ABLK: tl.constexpr, JOINT: tl.constexpr,
                       RALIGN: tl.constexpr):
    """``dh = [dgate | dup]`` rows 2H wide. ``JOINT == False`` (``H % ABLK == 0``): a program
    owns CB features and writes them in both halves, like the forward's output. ``JOINT``: a
    block along the 2H features may straddle the halves (1x128 blocks, H % 128 != 0), so a
    program owns CB of the 2H output columns and reads, per column, its feature's inputs."""
    b, ct = tl.program_id(0), tl.program_id(1)
    rs, re, prow0, tiles, lblk, nblk = _block(tbl_ptr, b, RALIGN)
    if JOINT:
        cols, cmask = _cols(2 * H, ct, CB)
        feats = tl.where(cols < H, cols, cols - H)
    else:
        cols, cmask = _cols(H, ct, CB)
        feats = cols
    base = tiles * RP * 4
    if RB == ABLK:  # one tile: each half's copies out before the next is made
        rows, rmask = _chunk(rs, re, 0, RB)
        dg, dup = _swiglu_bwd_rows(da_ptr, h_ptr, src_ptr, rows, rmask, feats, cmask, H, INTERP)
        if JOINT:
            _tile_copies(tl.where((cols < H)[None, :], dg, dup), rows, rmask, prow0, ct, cols,
                         cmask, 0, 2 * H, 2 * H, qr_ptr, sr_ptr, out_ptr, qc_ptr, sc_ptr, M,
                         base, lblk, nblk, re - rs, QROW, QCOL, BF16, INTERP, RB, CB, ABLK,
                         False)
        else:
            _tile_copies(dg, rows, rmask, prow0, ct, cols, cmask, 0, H, 2 * H, qr_ptr, sr_ptr,
                         out_ptr, qc_ptr, sc_ptr, M, base, lblk, nblk, re - rs, QROW, QCOL, BF16,
                         INTERP, RB, CB, ABLK, False)
            _tile_copies(dup, rows, rmask, prow0, ct, cols, cmask, H, H, 2 * H, qr_ptr, sr_ptr,
                         out_ptr, qc_ptr, sc_ptr, M, base, lblk, nblk, re - rs, QROW, QCOL, BF16,
                         INTERP, RB, CB, ABLK, False)
        return
    amax_g = tl.zeros((CB,), dtype=tl.int32)  # JOINT: of dh
    amax_u = tl.zeros((CB,), dtype=tl.int32)
    for c in range(ABLK // RB):
        rows, rmask = _chunk(rs, re, c, RB)
        dg, dup = _swiglu_bwd_rows(da_ptr, h_ptr, src_ptr, rows, rmask, feats, cmask, H, INTERP)
        if JOINT:
            dg = tl.where((cols < H)[None, :], dg, dup)
            _write_rows(dg, rows, rmask, prow0, ct, cols, cmask, 0, 2 * H, 2 * H, qr_ptr, sr_ptr,
                        out_ptr, QROW, BF16, INTERP, RB, CB, ABLK)
        else:
            _write_rows(dg, rows, rmask, prow0, ct, cols, cmask, 0, H, 2 * H, qr_ptr, sr_ptr,
                        out_ptr, QROW, BF16, INTERP, RB, CB, ABLK)
            _write_rows(dup, rows, rmask, prow0, ct, cols, cmask, H, H, 2 * H, qr_ptr, sr_ptr,
                        out_ptr, QROW, BF16, INTERP, RB, CB, ABLK)
        if QCOL:
            amax_g = tl.maximum(amax_g, _col_amax(dg))
            if not JOINT:
                amax_u = tl.maximum(amax_u, _col_amax(dup))
    if QCOL:
        byte_g, inv_g = _scale_from_amax(amax_g)
        byte_u, inv_u = _scale_from_amax(amax_u)
        for c in range(ABLK // RB):  # recompute (inputs from L2): no 128 rows in registers
            rows, rmask = _chunk(rs, re, c, RB)
            dg, dup = _swiglu_bwd_rows(da_ptr, h_ptr, src_ptr, rows, rmask, feats, cmask, H,
                                       INTERP)
            if JOINT:
                dg = tl.where((cols < H)[None, :], dg, dup)
            _store_cols(dg, inv_g, rows, rmask, cols, cmask, qc_ptr, M, INTERP)
            if not JOINT:
                _store_cols(dup, inv_u, rows, rmask, cols + H, cmask, qc_ptr, M, INTERP)
        _store_col_scales(byte_g, cols, cmask, sc_ptr, base, lblk, nblk, re - rs, ABLK)
        if not JOINT:
            _store_col_scales(byte_u, cols + H, cmask, sc_ptr, base, lblk, nblk, re - rs, ABLK)


# ---------------------------------------------------------------------------------------------
# Combine: out[t] = sum_j bf16(y[rows[t, j]] * bf16(w[t, j])) in fp32 -> BF16; and backward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _combine_fwd_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, T, D, TOPK: tl.constexpr,
                        INTERP: tl.constexpr, TB: tl.constexpr, CB: tl.constexpr):
    t, tmask, cols, mask = _token_tile(T, D, TB, CB)
    t64 = t.to(tl.int64)
    acc = tl.zeros((TB, CB), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(rows_ptr + t64 * TOPK + j, mask=tmask, other=0).to(tl.int64)
        w = tl.load(w_ptr + t64 * TOPK + j, mask=tmask, other=0.0)
        w = _rbf(w, INTERP)
        yv = tl.load(y_ptr + r[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += _rbf(yv * w[:, None], INTERP)
    tl.store(out_ptr + t64[:, None] * D + cols[None, :], _rbf(acc, INTERP).to(tl.bfloat16),
             mask=mask)


@triton.jit
def _combine_bwd_rows(dout_ptr, w_ptr, src_ptr, rows, rmask, cols, cmask, D, TOPK,
                      INTERP: tl.constexpr):
    """A chunk's fp32 dy = bf16(dout[t] * bf16(w[t, j])) (zero on pad rows), the fp32 dout
    rows ``g`` it came from and their mask."""
    src, valid = _pairs(src_ptr, rows, rmask)
    m2 = valid[:, None] & cmask[None, :]
    tok = tl.where(valid, src // TOPK, 0).to(tl.int64)
    w = _rbf(tl.load(w_ptr + tl.where(valid, src, 0), mask=valid, other=0.0), INTERP)
    g = tl.load(dout_ptr + tok[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    return _rbf(g * w[:, None], INTERP), g, m2


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, w_ptr, src_ptr, tbl_ptr, qr_ptr, sr_ptr, qc_ptr,
                        sc_ptr, out_ptr, part_ptr, D, M, TOPK, RP,
                        QROW: tl.constexpr, QCOL: tl.constexpr, BF16: tl.constexpr,
                        DW: tl.constexpr, INTERP: tl.constexpr, RB: tl.constexpr,
                        CB: tl.constexpr, ABLK: tl.constexpr,
                        RALIGN: tl.constexpr):
    """Sorted-row gradient dy[r] = bf16(dout[t] * bf16(w[t, j])) for the pair (t, j) of row r
    (zero for pad rows), quantized and/or BF16, and the partial routing-weight gradients
    part[col tile, r] = sum over the tile's features of bf16(dout[t] * y[r]) (fp32)."""
    rs, re, prow0, tiles, lblk, nblk = _block(tbl_ptr, tl.program_id(0), RALIGN)
    cols, cmask = _cols(D, tl.program_id(1), CB)
    camax = tl.zeros((CB,), dtype=tl.int32)
    dy = tl.zeros((RB, CB), dtype=tl.float32)  # the last chunk's (the block's, 32-row blocks)
    for c in range(ABLK // RB):
        rows, rmask = _chunk(rs, re, c, RB)
        dy, g, m2 = _combine_bwd_rows(dout_ptr, w_ptr, src_ptr, rows, rmask, cols, cmask, D,
                                      TOPK, INTERP)
        _write_rows(dy, rows, rmask, prow0, tl.program_id(1), cols, cmask, 0, D, D, qr_ptr,
                    sr_ptr, out_ptr, QROW, BF16, INTERP, RB, CB, ABLK)
        if QCOL:
            camax = tl.maximum(camax, _col_amax(dy))
        if DW:
            yv = tl.load(y_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            part = tl.sum(_rbf(g * yv, INTERP), axis=1)
            tl.store(part_ptr + tl.program_id(1).to(tl.int64) * M + rows, part, mask=rmask)
    if QCOL:
        byte, inv = _scale_from_amax(camax)
        for c in range(ABLK // RB):
            rows, rmask = _chunk(rs, re, c, RB)
            if ABLK != RB:  # read again (L2) rather than hold the whole block in registers
                dy, g, m2 = _combine_bwd_rows(dout_ptr, w_ptr, src_ptr, rows, rmask, cols, cmask,
                                              D, TOPK, INTERP)
            _store_cols(dy, inv, rows, rmask, cols, cmask, qc_ptr, M, INTERP)
        _store_col_scales(byte, cols, cmask, sc_ptr, tiles * RP * 4, lblk, nblk, re - rs, ABLK)


# ---------------------------------------------------------------------------------------------
# Host wrappers (allocation and launch only; argument checks live in moe_mxfp8.stages).
# Each launches on its inputs' GPU (`device.on_device`): Triton launches on the current one.
# ---------------------------------------------------------------------------------------------


def _u8(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A disabled output (its constexpr flag off) still needs a valid pointer: one element."""
    return like.new_empty(1, dtype=torch.uint8) if t is None else t


def _bf(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(1, dtype=torch.bfloat16) if t is None else t


def _grid_rows(tbl: torch.Tensor, feats: int) -> tuple[int, int]:
    return (tbl.shape[0], triton.cdiv(feats, COL_TILE))


def _row_meta(ablk: int, aligned: bool, kernel: str) -> dict:
    """Launch constants of row-block kernel ``kernel`` (a `ROW_TILING` key) for activation
    blocks of ``ablk`` rows; ``aligned``: every group starts on a multiple of `ROW_ALIGN` rows."""
    if ablk not in ACT_BLOCKS:
        raise ValueError(f"activation block must be one of {ACT_BLOCKS}, got {ablk}")
    t = ROW_TILING[kernel][ablk]
    meta = {"INTERP": INTERPRET, "RB": t.rows, "CB": COL_TILE, "ABLK": ablk,
            "RALIGN": ROW_ALIGN if aligned else 1, "num_warps": t.warps}
    if t.maxnreg:
        meta["maxnreg"] = t.maxnreg
    return meta


def _check_col_tile(col_tile: bool, ablk: int) -> None:
    """128 x 128 columnwise tiles are one 128-feature program's columns over a 128-row block."""
    if col_tile and (ablk != BLOCK_128 or COL_TILE != BLOCK_128):
        raise ValueError("128 x 128 columnwise tiles need 128-row activation blocks")


def _quant_outs(outs: dict, like: torch.Tensor) -> tuple[list, dict]:
    """Pointers of the five optional outputs (a one-element stand-in where off) and the flags."""
    qr, sr, qc, sc, ob = (outs.get(k) for k in ("qrow", "srow", "qcol", "scol", "bf16"))
    ptrs = [_u8(qr, like), _u8(sr, like), _u8(qc, like), _u8(sc, like), _bf(ob, like)]
    return ptrs, {"QROW": qr is not None, "QCOL": qc is not None, "BF16": ob is not None}


def dispatch(x, src, tbl, top_k, outs, ablk=BLOCK, aligned=False, col_tile=False):
    """``outs``: dict with any of qrow/srow/qcol/scol (uint8) and bf16 (M, D) preallocated;
    ``tbl``: `block_table` of ``ablk``-row blocks (the activation block length); ``aligned``:
    every group starts on a multiple of `ROW_ALIGN` rows (a promise: stores rely on it);
    ``col_tile``: the columnwise copy in 128 x 128 tiles (``ablk`` 128)."""
    _check_col_tile(col_tile, ablk)
    d, m = x.shape[1], src.numel()
    if tbl.shape[0] == 0 or d == 0:
        return
    ptrs, flags = _quant_outs(outs, x)
    with on_device(x.device):
        _dispatch_kernel[_grid_rows(tbl, d)](x, src, tbl, *ptrs, d, m, top_k,
                                             (d + 127) // 128 * 128, **flags, COLT=col_tile,
                                             **_row_meta(ablk, aligned, "dispatch"))


def gather_sum(src, rows, out):
    t, k = rows.shape
    d = src.shape[1]
    if t == 0 or d == 0:
        return
    grid = (triton.cdiv(t, TOK_TILE), triton.cdiv(d, COL_TILE))
    with on_device(src.device):
        _gather_sum_kernel[grid](src, rows, out, t, d, TOPK=k, INTERP=INTERPRET, TB=TOK_TILE,
                                 CB=COL_TILE, num_warps=4)


def swiglu_fwd(h, src, tbl, outs, ablk=BLOCK, aligned=False, col_tile=False):
    _check_col_tile(col_tile, ablk)
    hh, m = h.shape[1] // 2, src.numel()
    if tbl.shape[0] == 0 or hh == 0:
        return
    ptrs, flags = _quant_outs(outs, h)
    with on_device(h.device):
        _swiglu_fwd_kernel[_grid_rows(tbl, hh)](h, src, tbl, *ptrs, hh, m,
                                                (hh + 127) // 128 * 128, **flags,
                                                COLT=col_tile,
                                                **_row_meta(ablk, aligned, "swiglu_fwd"))


def swiglu_bwd(da, h, src, tbl, outs, ablk=BLOCK, aligned=False):
    hh, m = h.shape[1] // 2, src.numel()
    if tbl.shape[0] == 0 or hh == 0:
        return
    ptrs, flags = _quant_outs(outs, h)
    joint = hh % ablk != 0
    with on_device(h.device):
        _swiglu_bwd_kernel[_grid_rows(tbl, 2 * hh if joint else hh)](
            da, h, src, tbl, *ptrs, hh, m, (2 * hh + 127) // 128 * 128, **flags, JOINT=joint,
            **_row_meta(ablk, aligned, "swiglu_bwd"))


def combine_fwd(y, rows, weights, out):
    t, k = rows.shape
    d = y.shape[1]
    if t == 0 or d == 0:
        return
    grid = (triton.cdiv(t, TOK_TILE), triton.cdiv(d, COL_TILE))
    with on_device(y.device):
        _combine_fwd_kernel[grid](y, rows, weights, out, t, d, TOPK=k, INTERP=INTERPRET,
                                  TB=TOK_TILE, CB=COL_TILE, num_warps=4)


def combine_bwd(dout, y, weights, src, tbl, top_k, outs, part, ablk=BLOCK, aligned=False):
    """``part``: (ceil(D / COL_TILE), M) fp32 partial sums, or None (no weight gradient)."""
    d, m = dout.shape[1], src.numel()
    if tbl.shape[0] == 0 or d == 0:
        return
    ptrs, flags = _quant_outs(outs, y)
    with on_device(y.device):
        _combine_bwd_kernel[_grid_rows(tbl, d)](
            dout, y, weights, src, tbl, *ptrs,
            dout.new_empty(1, dtype=torch.float32) if part is None else part,
            d, m, top_k, (d + 127) // 128 * 128, **flags, DW=part is not None,
            **_row_meta(ablk, aligned, "combine_bwd"))
