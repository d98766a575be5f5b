"""The stages of the MoE data path outside the expert GEMMs: dispatch, SwiGLU and combine,
fused with MXFP8 quantization, and their backward passes; deterministic (no atomics); the same
kernels for the MXFP8 layer and its BF16 twin, on the layout of `moe_mxfp8.routing`.

Stages (``F``: features; MXFP8 copies follow docs/numerics.md: rowwise = blocks of 32 along the
features with grouped-rows packed scales, the fprop/dgrad operand; columnwise = the transpose
``(F, M)`` with blocks of 32 tokens restarting at each group, the wgrad operand; with
``scale_blocks="1x128"`` the blocks are 128 long, each 32-block carrying its 128-block's
scale byte, "The 1x128 recipe")::

    dispatch          x (T, D) -> sorted rows, MXFP8 rowwise + columnwise and/or BF16 (M, D)
    dispatch_backward dX_sorted (M, D) -> dx[t] = sum_j dX_sorted[rows[t, j]], fp32, j in order
    swiglu            h = [gate | up] (M, 2H) -> a = silu(gate) * up, MXFP8 and/or BF16 (M, H)
    swiglu_backward   dA (M, H), h -> dh = [dgate | dup], MXFP8 and/or BF16 (M, 2H)
    combine           y (M, D) -> out[t] = sum_j bf16(y[rows[t, j]] * bf16(w[t, j])), fp32 sum
    combine_backward  dout (T, D) -> dY[rows[t, j]] = bf16(dout[t] * bf16(w[t, j])), MXFP8
                      and/or BF16 (M, D) (pad rows 0), and dw[t, j] = <dout[t], y[rows[t, j]]>

The BF16 roundings are those of the eager PyTorch expressions they replace (``F.silu(g) * u``
and its autograd, the BF16 combine product and its autograd), so the layer's numerics do not
change. Every stage has a pure-PyTorch reference (``*_ref``, next to it; CPU and CI) and a
Triton kernel (``moe_mxfp8.kernels.datapath_triton``, used on CUDA when Triton is installed: an
optional GPU dependency); the GPU tests check the kernels bit for bit against the references.
The quantized SwiGLU stages, the combine backward and the 1x128 dispatch run instead as
sources of the CuTeDSL quantizer tile (`kernels.quantize`, ``source="swiglu"`` /
``"swiglu_grad"`` / ``"combine_grad"`` / ``"gather"``) wherever the quantizer kernels run
(`QUANTIZER_STAGES`; docs/design/datapath.md says why).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from . import layout as L
from . import reference as R
from .backend import _warn_once, cutedsl_available, kernel_backend_for
from .checks import kernel_input
from .config import check_scale_blocks
from .kernels.grouped_gemm.problem import kernel_offs
from .kernels.mx_format import ACT_BLOCK, BLOCK_128, BLOCK_SIZE, WGRAD_ACT_BLOCK_ROWS
from .mx_tensor import FP8, MXFP8Tensor
from .routing import block_table, check_layout, numel_of

BF16 = torch.bfloat16

# ---------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------


@functools.cache
def _triton_kernels():
    """The Triton module, or None where Triton is not installed (CPU machines, CI). Any other
    import error is the package's own bug and is raised, never hidden behind the fallback."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from .kernels import datapath_triton

    return datapath_triton


def use_triton(t: Tensor, backend: str) -> bool:
    """Kernels run for CUDA tensors unless ``backend == "reference"`` or Triton is missing (then
    the references run, with the same results, and a one-time warning says why it is slower)."""
    if not t.is_cuda or backend == "reference":
        return False
    if _triton_kernels() is None:
        _warn_once("moe_mxfp8: Triton is not installed; the MoE data path (dispatch, SwiGLU, "
                   "combine) runs its PyTorch reference on the GPU (pip install 'moe_mxfp8[gpu]')")
        return False
    return True


# The stages whose MXFP8 outputs come from the CuTeDSL quantizer tile (`kernels.quantize`: the
# tile's rows computed in its load -- SwiGLU, or gathered and scaled -- then quantized as any
# tile; one 128 x 128 tile a CTA, 2-3 CTAs an SM) instead of the Triton kernels, and the
# activation block lengths each does it for. The dispatch runs there for 128-blocks, where the
# groups start on tile boundaries (the 1x128 layout: 1.11-1.22x its Triton kernel, H100,
# 2026-11-27); its 1x32 blocks stay on Triton. docs/design/datapath.md.
QUANTIZER_BLOCKS = frozenset({BLOCK_SIZE, BLOCK_128})  # the block lengths the tile makes
QUANTIZER_STAGES = {"swiglu": QUANTIZER_BLOCKS, "combine_backward": QUANTIZER_BLOCKS,
                    "dispatch": frozenset({BLOCK_128})}


def _on_quantizer(stage: str, t: Tensor, ablk: int, quantized: bool, keep_bf16: bool) -> bool:
    """Whether ``stage`` runs on the quantizer tile: MXFP8 outputs only (the BF16 value is the
    Triton kernel's), BF16 data, and quantizer kernels for this GPU."""
    return (quantized and not keep_bf16 and ablk in QUANTIZER_STAGES.get(stage, ())
            and t.dtype == BF16
            and kernel_backend_for(t.device) is not None and cutedsl_available())


def _quantizer():
    from .kernels import quantize_launch  # noqa: PLC0415 (CuTeDSL-free; GPU only)

    return quantize_launch


def _int32(src: Tensor) -> Tensor:
    """``src`` as the quantizer reads it: dense int32 (the layout allows int64 too; the layer's
    is dense int32 already, returned as is without a dispatch)."""
    if src.dtype == torch.int32 and src.is_contiguous():
        return src
    return src.to(torch.int32).contiguous()


def _quantizer_outputs(res: list, qrow: bool, qcol: bool) -> dict:
    """The quantizer's ``[(data, scales), ...]`` (rowwise first) as `_wrap`'s outputs."""
    outs, res = {}, list(res)
    if qrow:
        outs["qrow"], outs["srow"] = res.pop(0)
    if qcol:
        outs["qcol"], outs["scol"] = res.pop(0)
    return outs


def _outputs(m: int, f: int, e: int, qrow: bool, qcol: bool, keep_bf16: bool, like: Tensor):
    outs = {}
    if qrow:
        outs["qrow"] = like.new_empty(m, f, dtype=torch.uint8)
        nbytes = L.grouped_rows_scale_bytes(m, f // L.BLOCK_SIZE, e)
        outs["srow"] = like.new_zeros(nbytes, dtype=torch.uint8)
    if qcol:
        outs["qcol"] = like.new_empty(f, m, dtype=torch.uint8)
        outs["scol"] = like.new_zeros(L.grouped_k_scale_bytes(f, m, e), dtype=torch.uint8)
    if keep_bf16:
        outs["bf16"] = like.new_empty(m, f, dtype=BF16)
    return outs


def _table(table: Tensor | None, offs: Tensor, m: int, block: int) -> Tensor:
    """``table`` (the caller's `block_table` of these ``offs``, ``m`` and ``block``: one per
    step, not one per stage) or a new one."""
    return block_table(offs, m, block) if table is None else table


def _fp8(data: Tensor) -> Tensor:
    """MXFP8 data bytes as e4m3 (the Triton kernels' uint8 buffers viewed; the quantizer's are
    e4m3 already, returned as they are: no view op)."""
    return data if data.dtype == FP8 else data.view(FP8)


def _wrap(outs: dict, offs: Tensor, col_block_rows: int = 1):
    row = col = None
    if "qrow" in outs:
        row = MXFP8Tensor(_fp8(outs["qrow"]), outs["srow"], "packed", offs, "rows")
    if "qcol" in outs:
        col = MXFP8Tensor(_fp8(outs["qcol"]), outs["scol"], "packed", offs, "k", col_block_rows)
    return row, col, outs.get("bf16")


def _quantize_ref(v: Tensor, offs: Tensor, qrow: bool, qcol: bool, keep_bf16: bool,
                  scale_blocks: str, col_block_rows: int = 1):
    row = R.quantize_rowwise_ref(v, offs=offs, scale_blocks=scale_blocks) if qrow else None
    col = (R.quantize_colwise_ref(v, offs=offs, scale_blocks=scale_blocks,
                                  block_rows=col_block_rows) if qcol else None)
    return row, col, (v if keep_bf16 else None)


def forward_col_rows(scale_blocks: str) -> int:
    """``block_rows`` of the forward stages' columnwise copies (dispatch: ``x``, SwiGLU: ``a``):
    the weight-gradient GEMMs' activation operands, in 128 x 128 tiles for the 1x128 recipe
    (`mx_format.WGRAD_ACT_BLOCK_ROWS`, docs/numerics.md). The backward stages' copies (the
    gradient operands) keep one scale per row."""
    return WGRAD_ACT_BLOCK_ROWS[scale_blocks]


def _check_rows(name: str, f: int, scale_blocks: str, quantized: bool) -> int:
    """The activation block length of ``scale_blocks``, after checking that ``f`` features can
    be ``quantized`` (whole 32-blocks; BF16-only outputs take any width)."""
    check_scale_blocks(scale_blocks, name)
    if quantized and f % L.BLOCK_SIZE:
        raise ValueError(f"{name}: features must be a multiple of {L.BLOCK_SIZE} to quantize, "
                         f"got {f}")
    return ACT_BLOCK[scale_blocks]


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


def _valid_rows(src: Tensor, top_k: int):
    valid = src >= 0
    pair = torch.where(valid, src, torch.zeros_like(src)).to(torch.int64)
    return valid, pair, pair // top_k


def _gather_rows(v: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
    """``v[idx]`` where ``valid``, else 0 (also for an empty ``v``: every row then pads)."""
    if v.shape[0] == 0:
        return v.new_zeros(idx.shape[0], v.shape[1])
    return torch.where(valid[:, None], v[idx], torch.zeros((), dtype=v.dtype, device=v.device))


def dispatch_ref(x, src, offs, top_k, *, qrow=True, qcol=True, keep_bf16=False,
                 scale_blocks="1x32"):
    valid, _, tok = _valid_rows(src, top_k)
    xs = _gather_rows(x.to(BF16), tok, valid)
    return _quantize_ref(xs, offs, qrow, qcol, keep_bf16, scale_blocks,
                         forward_col_rows(scale_blocks))


def dispatch(x: Tensor, src: Tensor, offs: Tensor, top_k: int, *, qrow: bool = True,
             qcol: bool = True, keep_bf16: bool = False, scale_blocks: str = "1x32",
             aligned_groups: bool = False, table: Tensor | None = None,
             tile_ends: Tensor | None = None, backend: str = "auto"):
    """Gather ``x (T, D)`` into the sorted buffer (``M = src.numel()`` rows, zero pad rows):
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, D) | None)`` from one read;
    the MXFP8 copies in the activation blocks of ``scale_blocks`` (32, or 128 for "1x128").

    ``aligned_groups`` (here and in the other row stages): the caller promises that every
    group starts on a multiple of 16 rows (`route_layout` with ``align % 16 == 0``); the
    kernels then write the columnwise copy in 16-byte stores. ``table``: the `block_table` of
    ``(offs, M, block)`` where the caller already has it (one per step); ``tile_ends``: the
    quantizer's (`swiglu`). The columnwise copy: `forward_col_rows`."""
    ablk = _check_rows("dispatch", x.shape[1], scale_blocks, qrow or qcol)
    col_rows = forward_col_rows(scale_blocks)
    check_layout("dispatch", x, numel_of(src), src=src, offs=offs, pairs=x.shape[0] * top_k)
    if not use_triton(x, backend):
        return dispatch_ref(x, src, offs, top_k, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                            scale_blocks=scale_blocks)
    x = x.to(BF16).contiguous()
    if _on_quantizer("dispatch", x, ablk, qrow or qcol, keep_bf16):
        res = _quantizer().quantize_gather(
            kernel_input(x), _int32(src), kernel_offs(offs), top_k, rows=qrow, cols=qcol,
            act_block=ablk, aligned_groups=aligned_groups, tile_ends=tile_ends,
            col_tile=col_rows > 1)
        return _wrap(_quantizer_outputs(res, qrow, qcol), offs, col_rows)
    m = src.numel()
    outs = _outputs(m, x.shape[1], offs.numel(), qrow, qcol, keep_bf16, x)
    _triton_kernels().dispatch(x, src.contiguous(), _table(table, offs, m, ablk), top_k, outs,
                               ablk, aligned_groups, col_tile=col_rows > 1)
    return _wrap(outs, offs, col_rows)


def dispatch_backward_ref(dxs: Tensor, rows: Tensor) -> Tensor:
    acc = torch.zeros(rows.shape[0], dxs.shape[1], dtype=torch.float32, device=dxs.device)
    for j in range(rows.shape[1]):
        acc = acc + dxs[rows[:, j].to(torch.int64)].float()
    return acc.to(BF16)


def dispatch_backward(dxs: Tensor, rows: Tensor, *, backend: str = "auto") -> Tensor:
    """``dx[t] = sum_j dxs[rows[t, j]]`` (fp32, j = 0..k-1 in order, BF16 out): a segmented sum,
    no atomics, bitwise reproducible."""
    check_layout("dispatch_backward", dxs, dxs.shape[0], rows=rows)
    if not use_triton(dxs, backend):
        return dispatch_backward_ref(dxs, rows)
    dxs = dxs.contiguous()
    out = dxs.new_empty(rows.shape[0], dxs.shape[1], dtype=BF16)
    _triton_kernels().gather_sum(dxs, rows.contiguous(), out)
    return out


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------


def swiglu_ref(h, src, offs, *, qrow=True, qcol=True, keep_bf16=False, scale_blocks="1x32"):
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    a = torch.where((src >= 0)[:, None], a, torch.zeros((), dtype=a.dtype, device=a.device))
    return _quantize_ref(a, offs, qrow, qcol, keep_bf16, scale_blocks,
                         forward_col_rows(scale_blocks))


def swiglu(h: Tensor, src: Tensor, offs: Tensor, *, qrow: bool = True, qcol: bool = True,
           keep_bf16: bool = False, scale_blocks: str = "1x32", aligned_groups: bool = False,
           table: Tensor | None = None, tile_ends: Tensor | None = None,
           backend: str = "auto"):
    """``h = [gate | up] (M, 2H)`` BF16 -> ``a = silu(gate) * up`` as
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, H) | None)``; pad rows 0.
    ``table`` / ``tile_ends``: the Triton kernels' `block_table` / the quantizer's tile ends of
    these ``offs`` (`routing.row_tables`) where the caller has them (one per step), else
    built here for the one that runs. The columnwise copy: `forward_col_rows`."""
    ablk = _check_rows("swiglu", h.shape[1] // 2, scale_blocks, qrow or qcol)
    col_rows = forward_col_rows(scale_blocks)
    check_layout("swiglu", h, h.shape[0], src=src, offs=offs)
    if not use_triton(h, backend):
        return swiglu_ref(h, src, offs, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                          scale_blocks=scale_blocks)
    h = h.contiguous()
    if _on_quantizer("swiglu", h, ablk, qrow or qcol, keep_bf16):
        res = _quantizer().quantize_swiglu(
            kernel_input(h), _int32(src), kernel_offs(offs), rows=qrow, cols=qcol,
            act_block=ablk, aligned_groups=aligned_groups, tile_ends=tile_ends,
            col_tile=col_rows > 1)
        return _wrap(_quantizer_outputs(res, qrow, qcol), offs, col_rows)
    m = src.numel()
    outs = _outputs(m, h.shape[1] // 2, offs.numel(), qrow, qcol, keep_bf16, h)
    _triton_kernels().swiglu_fwd(h, src.contiguous(), _table(table, offs, m, ablk), outs, ablk,
                                 aligned_groups, col_tile=col_rows > 1)
    return _wrap(outs, offs, col_rows)


def swiglu_backward_ref(da, h, src, offs, *, qrow=True, qcol=True, keep_bf16=False,
                        scale_blocks="1x32"):
    gate, up = h.chunk(2, dim=-1)
    dup = da * F.silu(gate)
    dgate = torch.ops.aten.silu_backward(da * up, gate)
    dh = torch.cat([dgate, dup], dim=1)
    dh = torch.where((src >= 0)[:, None], dh, torch.zeros((), dtype=dh.dtype, device=dh.device))
    return _quantize_ref(dh, offs, qrow, qcol, keep_bf16, scale_blocks)


def swiglu_backward(da: Tensor, h: Tensor, src: Tensor, offs: Tensor, *, qrow: bool = True,
                    qcol: bool = True, keep_bf16: bool = False, scale_blocks: str = "1x32",
                    aligned_groups: bool = False, table: Tensor | None = None,
                    tile_ends: Tensor | None = None, backend: str = "auto"):
    """Gradient of `swiglu`: ``dA (M, H)`` and the saved ``h`` -> ``dh = [dgate | dup]`` as
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, 2H) | None)`` in one pass (the
    MXFP8 copies blocked along the whole 2H row, as the GEMMs read them; ``table``,
    ``tile_ends``: as `swiglu`'s)."""
    ablk = _check_rows("swiglu_backward", h.shape[1], scale_blocks, qrow or qcol)
    check_layout("swiglu_backward", h, h.shape[0], src=src, offs=offs)
    if not use_triton(h, backend):
        return swiglu_backward_ref(da, h, src, offs, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                                   scale_blocks=scale_blocks)
    h, da = h.contiguous(), da.contiguous()
    if _on_quantizer("swiglu", h, ablk, qrow or qcol, keep_bf16) and da.dtype == BF16:
        res = _quantizer().quantize_swiglu_grad(
            kernel_input(da), kernel_input(h), _int32(src), kernel_offs(offs), rows=qrow,
            cols=qcol, act_block=ablk, aligned_groups=aligned_groups, tile_ends=tile_ends)
        return _wrap(_quantizer_outputs(res, qrow, qcol), offs)
    m = src.numel()
    outs = _outputs(m, h.shape[1], offs.numel(), qrow, qcol, keep_bf16, h)
    _triton_kernels().swiglu_bwd(da, h, src.contiguous(), _table(table, offs, m, ablk), outs, ablk,
                                 aligned_groups)
    return _wrap(outs, offs)


# ---------------------------------------------------------------------------------------------
# Combine
# ---------------------------------------------------------------------------------------------


def combine_ref(y: Tensor, rows: Tensor, weights: Tensor) -> Tensor:
    wb = weights.to(BF16)
    acc = torch.zeros(rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(rows.shape[1]):
        acc = acc + (y[rows[:, j].to(torch.int64)] * wb[:, j : j + 1]).float()
    return acc.to(BF16)


def combine(y: Tensor, rows: Tensor, weights: Tensor, *, backend: str = "auto") -> Tensor:
    """``out[t] = sum_j bf16(y[rows[t, j]] * bf16(weights[t, j]))`` (fp32 sum, j in order)."""
    check_layout("combine", y, y.shape[0], rows=rows)
    if not use_triton(y, backend):
        return combine_ref(y, rows, weights)
    y = y.contiguous()
    out = y.new_empty(rows.shape[0], y.shape[1], dtype=BF16)
    _triton_kernels().combine_fwd(y, rows.contiguous(), weights.float().contiguous(), out)
    return out


def combine_backward_ref(dout, y, src, rows, weights, offs, *, qrow=True, qcol=True,
                         keep_bf16=False, need_dw=True, scale_blocks="1x32"):
    top_k = rows.shape[1]
    valid, pair, tok = _valid_rows(src, top_k)
    wb = weights.reshape(-1).to(BF16)
    wb = _gather_rows(wb[:, None], pair, valid)
    dy = _gather_rows(dout.to(BF16), tok, valid) * wb
    dw = None
    if need_dw:
        # autograd of the BF16 product: BF16 products summed over the features, BF16 result
        dw = (dout[:, None, :] * y[rows.to(torch.int64)]).sum(-1).float()
    return (*_quantize_ref(dy, offs, qrow, qcol, keep_bf16, scale_blocks), dw)


def combine_backward(dout: Tensor, y: Tensor, src: Tensor, rows: Tensor, weights: Tensor,
                     offs: Tensor, *, qrow: bool = True, qcol: bool = True,
                     keep_bf16: bool = False, need_dw: bool = True, scale_blocks: str = "1x32",
                     aligned_groups: bool = False, table: Tensor | None = None,
                     tile_ends: Tensor | None = None, backend: str = "auto"):
    """Gradient of `combine` in one pass over the sorted rows: ``dY`` as ``(rowwise MXFP8 |
    None, columnwise MXFP8 | None, BF16 (M, D) | None)`` (pad rows 0) and the routing-weight
    gradient ``(T, k)`` fp32 (or None): per-row partial sums over feature tiles, then summed
    over the tiles in a fixed order (no atomics). ``table`` / ``tile_ends``: as `swiglu`'s."""
    ablk = _check_rows("combine_backward", dout.shape[1], scale_blocks,
                       qrow or qcol)
    check_layout("combine_backward", dout, y.shape[0], rows=rows, src=src, offs=offs,
                 pairs=numel_of(rows))
    if not use_triton(dout, backend):
        return combine_backward_ref(dout, y, src, rows, weights, offs, qrow=qrow, qcol=qcol,
                                    keep_bf16=keep_bf16, need_dw=need_dw,
                                    scale_blocks=scale_blocks)
    kern = _triton_kernels()
    dout, y = dout.contiguous(), y.contiguous()
    m, d = src.numel(), dout.shape[1]
    part = None
    if need_dw:
        part = dout.new_empty(-(-d // kern.COL_TILE), m, dtype=torch.float32)
    if (_on_quantizer("combine_backward", dout, ablk, qrow or qcol, keep_bf16)
            and y.dtype == BF16):
        res = _quantizer().quantize_combine_grad(
            kernel_input(dout), kernel_input(y), _int32(src), weights.float().contiguous(),
            kernel_offs(offs), rows.shape[1], rows=qrow, cols=qcol, act_block=ablk,
            aligned_groups=aligned_groups, part=part, tile_ends=tile_ends)
        outs = _quantizer_outputs(res, qrow, qcol)
    else:
        outs = _outputs(m, d, offs.numel(), qrow, qcol, keep_bf16, dout)
        kern.combine_bwd(dout, y, weights.float().contiguous(), src.contiguous(),
                         _table(table, offs, m, ablk), rows.shape[1], outs, part, ablk,
                         aligned_groups)
    dw = None
    if need_dw:
        dw = part.sum(0).to(BF16).float()[rows]
    return (*_wrap(outs, offs), dw)


class _WeightedCombine(torch.autograd.Function):
    """`combine` forward, `combine_backward` (BF16 ``dY`` only, no quantized copies) backward."""

    @staticmethod
    def forward(ctx, y, weights, rows, src, offs, backend):
        ctx.backend = backend
        ctx.save_for_backward(y, weights, rows, src, offs)
        return combine(y, rows, weights, backend=backend)

    @staticmethod
    def backward(ctx, dout):
        y, weights, rows, src, offs = ctx.saved_tensors
        _, _, dy, dw = combine_backward(
            dout, y, src, rows, weights, offs, qrow=False, qcol=False, keep_bf16=True,
            need_dw=ctx.needs_input_grad[1], backend=ctx.backend)
        return (dy if ctx.needs_input_grad[0] else None), dw, None, None, None, None


def weighted_combine(y: Tensor, weights: Tensor, rows: Tensor, src: Tensor, offs: Tensor, *,
                     backend: str = "auto") -> Tensor:
    """`combine` with autograd, for a combine outside the routed-expert block (expert
    parallelism's, on the rank that routed the tokens): ``y (M, D)`` BF16 rows of a
    `moe_mxfp8.routing` layout and the routing ``weights (T, k)`` -> ``(T, D)`` BF16; gradients
    to ``y`` (`combine_backward`'s BF16 ``dY``) and to ``weights`` (fp32)."""
    return _WeightedCombine.apply(y, weights.float(), rows, src, offs, backend)
