"""Triton kernels of the expert-parallel MXFP8 payload (`moe_mxfp8.expert_parallel`): pack and
unpack the uint8 rows ``[D E4M3 bytes | D/32 E8M0 scale bytes]`` that travel in the all-to-all.

* `pack_rows`: ``out[r] = payload(x[index[r]])``: the rowwise MXFP8 quantization of the gathered
  BF16 row (docs/numerics.md: RCEIL, one scale per 32 elements; the data path's `_row_blocks`),
  written straight into the payload row -- one read of each gathered row, one write.
* `unpack_rows`: ``out[r] = bf16(E4M3 * 2^(s - 127))`` (0xFF scale bytes give NaN).

Their references are `moe_mxfp8.expert_parallel.pack_mxfp8_rows_ref` / `unpack_mxfp8_rows_ref`,
bit for bit (the GPU tests check it). Optional GPU dependency (``triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .datapath_triton import INTERPRET, QBLK, _row_blocks
from .device import on_device
from .mx_format import BLOCK_SIZE

# Per program: ROWS payload rows x COLS features, 4 warps. The unpack takes 256 features (H100,
# 2026-11-27: 0.64 against 0.70 ms at 65536 x 7168, 0.196 against 0.207 ms at 65536 x 2048);
# the pack keeps 128 (256 was 9 % slower at 2048 features, 6 % faster at 7168). Rows 8-64 and
# 8 warps changed neither by more than 3 %.
ROWS = 16
PACK_COLS = 128
UNPACK_COLS = 256
WARPS = 4
# Triton types of the kernels' arguments for a build without a launch (the CPU tests' sm_90
# builds, tools/triton_sass.py): pointers not named here are uint8, other scalars int32
# (the packed payload rows: uint8; the unpacked rows: bf16)
ARG_TYPES = {"x_ptr": "*bf16", "idx_ptr": "*i64"}
KERNEL_ARG_TYPES = {"_unpack_kernel": {"out_ptr": "*bf16"}}


@triton.jit
def _to_bf16(v, INTERP: tl.constexpr):
    """fp32 -> BF16, round to nearest even. The interpreter's cast mis-converts subnormals, so
    there the rounding is done on the bits (the high half, after adding the rounding bias)."""
    if INTERP:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _pack_kernel(x_ptr, idx_ptr, out_ptr, R, D, W, INTERP: tl.constexpr, RB: tl.constexpr,
                 CB: tl.constexpr):
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = r < R
    cols = tl.program_id(1) * CB + tl.arange(0, CB)
    cmask = cols < D
    src = tl.load(idx_ptr + r, mask=rmask, other=0).to(tl.int64)
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + src[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    q, byte = _row_blocks(x, INTERP, RB, CB, QBLK)
    row = out_ptr + r.to(tl.int64)[:, None] * W
    tl.store(row + cols[None, :], q, mask=m2)
    blk = tl.program_id(1) * (CB // QBLK) + tl.arange(0, CB // QBLK)
    tl.store(row + D + blk[None, :], byte.to(tl.uint8),
             mask=rmask[:, None] & (blk < D // QBLK)[None, :])


@triton.jit
def _unpack_kernel(rows_ptr, out_ptr, R, D, W, INTERP: tl.constexpr, RB: tl.constexpr,
                   CB: tl.constexpr):
    r = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = r < R
    cols = tl.program_id(1) * CB + tl.arange(0, CB)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    row = rows_ptr + r.to(tl.int64)[:, None] * W
    code = tl.load(row + cols[None, :], mask=m2, other=0)
    # E4M3 code s eeee mmm as the fp32 bits s 0000eeee mmm 0..0: exactly q * 2^-120 (subnormal
    # codes included); NaN codes (x 1111 111) get the fp32 NaN.
    ci = code.to(tl.int32)
    sign = (ci & 0x80) << 24
    mag = ci & 0x7F
    q = ((mag << 20) | sign).to(tl.float32, bitcast=True)
    q = tl.where(mag == 0x7F, float("nan"), q)
    # the tile's CB / 32 scale bytes of each row, loaded once and repeated over their blocks
    nb: tl.constexpr = CB // QBLK
    blk = tl.program_id(1) * nb + tl.arange(0, nb)
    sb = tl.load(row + D + blk[None, :], mask=rmask[:, None] & (blk < D // QBLK)[None, :],
                 other=127).to(tl.int32)
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (RB, nb, QBLK)), (RB, CB))
    # value = q * 2^120 * 2^(s - 127) = q * 2^(s - 7), as two exact power-of-two factors that
    # are normal fp32 numbers: 2^(min(s, 134) - 7) and 2^(max(s, 134) - 134). The first product
    # is the final value for s <= 134 (exact: at least 2^-136, above fp32's 2^-149); above 134
    # the second overflows to Inf exactly where the FP32 dequantization does. NaN for 0xFF.
    lo = ((tl.minimum(sb, 134) + 120) << 23).to(tl.float32, bitcast=True)
    hi = ((tl.maximum(sb, 134) - 7) << 23).to(tl.float32, bitcast=True)
    v = q * lo * hi
    v = tl.where(sb == 255, float("nan"), v)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :],
             _to_bf16(v, INTERP), mask=m2)


def pack_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x (T, D)`` BF16 contiguous, ``index (R,)`` int -> payload ``(R, D + D/32)`` uint8."""
    t, d = x.shape
    r = index.numel()
    out = x.new_empty(r, d + d // BLOCK_SIZE, dtype=torch.uint8)
    if r == 0 or d == 0:
        return out
    grid = (triton.cdiv(r, ROWS), triton.cdiv(d, PACK_COLS))
    with on_device(x.device):
        _pack_kernel[grid](x, index, out, r, d, out.shape[1], INTERP=INTERPRET, RB=ROWS,
                           CB=PACK_COLS, num_warps=WARPS)
    return out


def unpack_rows(rows: torch.Tensor, d: int) -> torch.Tensor:
    """Payload ``(R, D + D/32)`` uint8 contiguous -> ``(R, D)`` BF16."""
    r = rows.shape[0]
    out = rows.new_empty(r, d, dtype=torch.bfloat16)
    if r == 0 or d == 0:
        return out
    grid = (triton.cdiv(r, ROWS), triton.cdiv(d, UNPACK_COLS))
    with on_device(rows.device):
        _unpack_kernel[grid](rows, out, r, d, rows.shape[1], INTERP=INTERPRET, RB=ROWS,
                             CB=UNPACK_COLS, num_warps=WARPS)
    return out
