"""The MoE data path outside the expert GEMMs: dispatch, SwiGLU and combine, fused with MXFP8
quantization; deterministic (no atomics); the same kernels for the MXFP8 layer and its BF16 twin.

The expert block, `routed_experts`: dispatch (`moe_mxfp8.stages`, on the layout of
`moe_mxfp8.routing`), the gate/up GEMM, SwiGLU, the down GEMM and the combine as one autograd
unit, serving `MXFP8MoE` and `MXFP8GroupedExperts` alike.

Autograd. FP8 tensors cannot carry gradients, so the autograd boundary is the whole routed-
expert block, `routed_experts` (custom ops ``moe_mxfp8::routed_experts_fwd`` / ``_bwd_*`` with
fake implementations, so ``torch.compile(fullgraph=True)`` traces it; no host syncs, every size
static, so it is CUDA-graph capturable). It saves for backward only what backward reads: the
FP8 columnwise copies of the dispatched ``x`` and of ``a`` (wgrad operands), ``h`` (BF16, for
the SwiGLU backward) and ``y`` (BF16, for the routing-weight gradient); with BF16 weight
gradients (``wgrad="bf16"`` or the BF16 twin) BF16 copies of ``x`` and ``a`` instead. The expert
weights are quantized along each axis the GEMMs need (along K in forward, along N in backward;
down's N-axis copy in forward, from the same read), or come quantized already (``weights_q``:
`moe_mxfp8.weight_cache`, once per optimizer step). Backward runs as four operators that free,
between them, what only an earlier one read (see "Backward runs in four operators" below).
A caller may be told the input gradient as soon as it exists, before the weight gradients
(`on_input_grad`: the expert-parallel dispatcher starts its return exchange there).
The expert GEMMs are `moe_mxfp8.grouped_gemm.grouped_mm_m` / ``grouped_mm_k`` (MXFP8) or
``torch._grouped_mm`` (BF16 twin).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from . import layout as L
from . import stages as ST
from .config import (
    PRECISIONS,
    WGRAD_MODES,
    check_choice,
    check_scale_blocks,
    resolve_scale_blocks,
)
from .grouped_gemm import grouped_mm_k, grouped_mm_m, leave_sms
from .kernels.mx_format import ACT_BLOCK, WEIGHT_BLOCK_ROWS
from .mx_tensor import FP8, MXFP8Tensor
from .op_library import define_op
from .quantize import quantize_weights, quantize_weights_dual
from .routing import check_layout, numel_of, step_layout

BF16 = torch.bfloat16

# ---------------------------------------------------------------------------------------------
# The routed-expert block: custom ops + autograd
# ---------------------------------------------------------------------------------------------


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty(0, dtype=dtype)


def _modes(precision: str, wgrad: str, save: bool) -> tuple[bool, bool, bool]:
    """(MXFP8 GEMMs, save FP8 columnwise wgrad operands, save BF16 wgrad operands)."""
    mx = precision == "mxfp8"
    mx_wgrad = mx and wgrad == "mxfp8"
    return mx, save and mx_wgrad, save and not mx_wgrad


def _i16(t: Tensor | None, like: Tensor) -> Tensor:
    """BF16 saved tensors travel as int16 (non-differentiable outputs: no gradient buffers)."""
    return _empty(like, torch.int16) if t is None else t.view(torch.int16)


def _u8(t: MXFP8Tensor | None, like: Tensor) -> tuple[Tensor, Tensor]:
    if t is None:
        return _empty(like, torch.uint8), _empty(like, torch.uint8)
    return t.data.view(torch.uint8), t.scale


def _row_recipe(mx: bool, scale_blocks: str) -> str:
    """The recipe the row kernels and their tables run in: ``scale_blocks`` for the MXFP8
    layer, ``"1x32"`` for the BF16 twin (nothing quantized, 32-row programs)."""
    return scale_blocks if mx else "1x32"


def _step_tables(like: Tensor, offs: Tensor, m: int, scale_blocks: str, backend: str
                 ) -> tuple[Tensor | None, Tensor | None]:
    """The row kernels' `block_table` and the quantizer's tile ends (`routing.row_tables`),
    built once per step ((None, None) where the references run)."""
    if not ST.use_triton(like, backend):
        return None, None
    return torch.ops.moe_mxfp8.row_tables(offs, m, ACT_BLOCK[scale_blocks])


def layout(expert_ids: Tensor, counts: Tensor, align: int, precision: str, scale_blocks: str,
           backend: str) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """The step's routing layout ``rows, src, offs`` (`routing.route_layout` with ``align``)
    and, where the data path's kernels run, the row tables they read (`routed_experts`'
    ``tables``), from one set of launches (`routing.step_layout`)."""
    sb = _row_recipe(precision == "mxfp8", scale_blocks)
    return step_layout(expert_ids, counts, align, ACT_BLOCK[sb],
                       ST.use_triton(expert_ids, backend))


def _weights_q(w: Tensor, axis: str, scale_blocks: str, backend: str,
               data: Tensor | None = None, scale: Tensor | None = None) -> MXFP8Tensor:
    """Expert weights ``w`` quantized along ``axis``: the pre-quantized ``data`` (uint8) and
    ``scale`` given (`routed_experts`' ``weights_q``), else quantized now."""
    rows = WEIGHT_BLOCK_ROWS[scale_blocks]
    if data is not None:
        return MXFP8Tensor(data.view(FP8), scale, "packed", None, "experts", rows)
    return quantize_weights(w.contiguous(), axis=axis, block_rows=rows, backend=backend)


# The ops' optional trailing inputs (plain optional tensors: a tensor list would route every call
# through torch.library's pytree wrapper). ``table``, ``tile_ends``: the step's `block_table`
# and the quantizer's tile ends (`routing.row_tables`), built once by `routed_experts` for both
# passes (else each pass builds them: some 30 small device ops each; the SwiGLU stages on the
# quantizer read the tile ends); ``gu_k ... dn_n_scale``: `routed_experts`' ``weights_q`` as
# uint8 data and scales, gate_up (gu) and down (dn) along K (forward) and along N (backward).
# ``keep_down_n``: quantize ``w_down`` along both axes from its one read in forward and return
# the N-axis copy for backward (`_forward_weights`, `_keep_down_n`).


@define_op("moe_mxfp8::routed_experts_fwd")
def _routed_experts_fwd(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, precision: str, backend: str, wgrad: str, scale_blocks: str, save: bool,
    table: Tensor | None = None, tile_ends: Tensor | None = None,
    gu_k: Tensor | None = None, gu_k_scale: Tensor | None = None,
    dn_k: Tensor | None = None, dn_k_scale: Tensor | None = None,
    gu_n: Tensor | None = None, gu_n_scale: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
    keep_down_n: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(out (T, D) bf16, sx, sx_scale, h, sa, sa_scale, y, dn_n, dn_n_scale)``: the
    saved tensors (empty unless ``save``): wgrad operands of x and a (FP8 bytes + scales, or
    BF16 as int16), h and y (BF16 as int16), and ``w_down`` along N (uint8 bytes + packed
    scales; empty unless ``keep_down_n`` and the weight was quantized here). The optional
    inputs: see above."""
    mx, qcol, keep = _modes(precision, wgrad, save)
    top_k = rows.shape[1]
    sb = _row_recipe(mx, scale_blocks)
    if table is None:  # called on its own: this pass builds the step's tables
        table, tile_ends = _step_tables(x, offs, src.numel(), sb, backend)
    dn_n_kept = None
    if mx:
        # MXFP8: groups start on multiples of 16 rows (the contract of this op, see
        # `routed_experts`; the wgrad GEMMs rely on it too)
        xr, xc, xb = ST.dispatch(x, src, offs, top_k, qrow=True, qcol=qcol, keep_bf16=keep,
                              scale_blocks=sb, aligned_groups=True, table=table,
                              tile_ends=tile_ends, backend=backend)
        h = grouped_mm_m(xr, _weights_q(w_gate_up, "K", sb, backend, gu_k, gu_k_scale), offs,
                         out_dtype=BF16, backend=backend)
        del xr
        ar, ac, ab = ST.swiglu(h, src, offs, qrow=True, qcol=qcol, keep_bf16=keep, scale_blocks=sb,
                            aligned_groups=True, table=table, tile_ends=tile_ends,
                            backend=backend)
        w, dn_n_kept = _forward_weights(w_down, sb, backend, dn_k, dn_k_scale,
                                        _quantizes_down_n(keep_down_n, precision, dn_k, dn_n))
        y = grouped_mm_m(ar, w, offs, out_dtype=BF16, backend=backend)
        del ar, w
    else:
        _, _, xb = ST.dispatch(x, src, offs, top_k, qrow=False, qcol=False, keep_bf16=True,
                            table=table, backend=backend)
        h = torch._grouped_mm(xb, w_gate_up.transpose(-2, -1), offs=offs)
        _, _, ab = ST.swiglu(h, src, offs, qrow=False, qcol=False, keep_bf16=True, table=table,
                          backend=backend)
        y = torch._grouped_mm(ab, w_down.transpose(-2, -1), offs=offs)
        xc = ac = None
    out = ST.combine(y, rows, weights, backend=backend)
    kept = _u8(dn_n_kept, x)
    if not save:
        e8 = _empty(x, torch.uint8)
        e16 = _empty(x, torch.int16)
        return out, e8, e8.clone(), e16, e8.clone(), e8.clone(), e16.clone(), *kept
    sx, sxs = _u8(xc, x) if qcol else (_i16(xb, x), _empty(x, torch.uint8))
    sa, sas = _u8(ac, x) if qcol else (_i16(ab, x), _empty(x, torch.uint8))
    return out, sx, sxs, _i16(h, x), sa, sas, _i16(y, x), *kept


def _quantizes_down_n(keep_down_n: bool, precision: str, dn_k: Tensor | None,
                      dn_n: Tensor | None) -> bool:
    """Whether the forward op quantizes ``w_down`` along both axes and returns the N-axis copy:
    asked to (``keep_down_n``), MXFP8, and the weights not given quantized along either axis."""
    return keep_down_n and precision == "mxfp8" and dn_k is None and dn_n is None


def _forward_weights(w: Tensor, scale_blocks: str, backend: str, data: Tensor | None,
                     scale: Tensor | None, keep_n: bool
                     ) -> tuple[MXFP8Tensor, MXFP8Tensor | None]:
    """Expert weights ``w`` along K for a forward GEMM (``data``/``scale`` given: those) and,
    with ``keep_n`` (`_quantizes_down_n`: nothing given), along N for backward's GEMM, both
    from one read of the BF16 weights
    (`quantize_weights_dual`: 4.06 bytes a parameter, against 3.03 in forward and 3.03 again
    in backward; the same bytes). Backward frees the N-axis copy once its GEMM has run
    (`_backward`)."""
    if not keep_n:
        return _weights_q(w, "K", scale_blocks, backend, data, scale), None
    along_k, along_n = quantize_weights_dual(w.contiguous(),
                                             block_rows=WEIGHT_BLOCK_ROWS[scale_blocks],
                                             backend=backend)
    return along_k, along_n


@_routed_experts_fwd.register_fake
def _routed_experts_fwd_fake(x, w_gate_up, w_down, weights, rows, src, offs, precision, backend,
                             wgrad, scale_blocks, save, table=None, tile_ends=None, gu_k=None,
                             gu_k_scale=None, dn_k=None, dn_k_scale=None, gu_n=None,
                             gu_n_scale=None, dn_n=None, dn_n_scale=None,
                             keep_down_n=False):
    t, d = x.shape
    e, h2, _ = w_gate_up.shape
    m = src.numel()
    out = x.new_empty(t, d, dtype=BF16)
    e8, e16 = _empty(x, torch.uint8), _empty(x, torch.int16)

    kept = (e8.clone(), e8.clone())  # `_forward_weights`' N-axis copy (E, H, D), its scales
    if _quantizes_down_n(keep_down_n, precision, dn_k, dn_n):
        ne, n, k = w_down.shape
        kept = (x.new_empty(ne, k, n, dtype=torch.uint8),
                x.new_empty(ne * L.expert_scale_stride(k, n // L.BLOCK_SIZE), dtype=torch.uint8))
    if not save:
        return out, e8, e8.clone(), e16, e8.clone(), e8.clone(), e16.clone(), *kept
    _, qcol, _ = _modes(precision, wgrad, save)
    if qcol:
        sx = x.new_empty(d, m, dtype=torch.uint8)
        sxs = x.new_empty(L.grouped_k_scale_bytes(d, m, e), dtype=torch.uint8)
        sa = x.new_empty(h2 // 2, m, dtype=torch.uint8)
        sas = x.new_empty(L.grouped_k_scale_bytes(h2 // 2, m, e), dtype=torch.uint8)
    else:
        sx, sxs = x.new_empty(m, d, dtype=torch.int16), e8.clone()
        sa, sas = x.new_empty(m, h2 // 2, dtype=torch.int16), e8.clone()
    return out, sx, sxs, x.new_empty(m, h2, dtype=torch.int16), sa, sas, x.new_empty(
        m, d, dtype=torch.int16), *kept


def _weight_grad(dyc: MXFP8Tensor, dyb: Tensor, saved: Tensor, saved_scale: Tensor, offs: Tensor,
                 qcol: bool, scale_blocks: str, backend: str) -> Tensor:
    """A weight gradient ``dy^T @ saved`` per group: from the columnwise MXFP8 copies (``dyc``
    and the saved FP8 operand, ``qcol``) or the BF16 ones (``dyb`` and the saved int16 bits)."""
    if qcol:
        # the saved copy is a forward stage's: 128 x 128 tiles for 1x128 (stages.forward_col_rows)
        col = MXFP8Tensor(saved.view(FP8), saved_scale, "packed", offs, "k",
                          ST.forward_col_rows(scale_blocks))
        return grouped_mm_k(dyc, col, offs, out_dtype=BF16, backend=backend, aligned_groups=True,
                            scale_blocks=scale_blocks)
    return torch._grouped_mm(dyb.t(), saved.view(BF16), offs=offs)


# Backward runs in four operators, so that what only one phase reads is freed before the next
# (`_backward` drops the saved tensors once read; measured: the weight gradients were the step's
# memory peak at Qwen3-30B-A3B shapes, with h and y still alive):
#   1. `routed_experts_bwd_down`: the combine backward (dY, the routing-weight gradient; reads
#      y), the down projection's dgrad (dA; reads its N-axis weights) and its weight gradient
#      unless it waits for the last phase;
#   2. `routed_experts_bwd_swiglu`: the SwiGLU backward (dH; reads h and dA);
#   3. `routed_experts_bwd_dx`: the gate/up dgrad and the dispatch backward (dX; reads the
#      gate/up N-axis weights);
#   4. `routed_experts_bwd_dw`: the weight gradients (dW; reads the saved wgrad operands).
# Between phases the tensors cross as BF16, uint8 FP8 bytes + scales or int16 BF16 bits.


U8, F32 = torch.uint8, torch.float32


def _made(t: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A phase's output ``t``, or where the configuration did not make it (None) an empty
    tensor of its dtype (made only then: every empty tensor is an op of host time)."""
    return _empty(like, dtype) if t is None else t


def _fp8_or_bf16(q: MXFP8Tensor | None, b: Tensor | None, like: Tensor
                 ) -> tuple[Tensor, Tensor | None]:
    """A phase's MXFP8 operand as (uint8 bytes, scales), else a BF16 one as (int16 bits, None:
    no scales)."""
    if q is not None:
        return _u8(q, like)
    return _i16(b, like), None


def _colwise(data: Tensor, scale: Tensor, offs: Tensor) -> tuple[MXFP8Tensor | None,
                                                                  Tensor | None]:
    """`_fp8_or_bf16`'s pair back: (columnwise MXFP8 operand, None) or (None, BF16 tensor)."""
    if data.dtype == torch.uint8:
        return MXFP8Tensor(data.view(FP8), scale, "packed", offs, "k"), None
    return None, data.view(BF16)


def late_down_wgrad(m: int, d: int, e: int, hh: int, fp8_operand: bool) -> bool:
    """Whether the down projection's weight gradient waits for the last phase (after the gate/up
    GEMMs) rather than running in phase 1: whichever keeps fewer bytes alive through the phases
    between, its result (E, D, H) BF16 or its dY operand (M, D) (FP8 columnwise, or BF16).
    Static sizes: at mixtral the operand is 7x smaller, at dsv3 4x larger. Every GEMM is the
    same either way (deterministic)."""
    return m * d * (1 if fp8_operand else 2) < e * d * hh * 2


@define_op("moe_mxfp8::routed_experts_bwd_down")
def _bwd_down(
    dout: Tensor, y: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, sa: Tensor, sa_scale: Tensor, precision: str, backend: str, wgrad: str,
    scale_blocks: str, need_chain: bool, need_dw: bool, need_dweights: bool, late: bool,
    table: Tensor | None = None, tile_ends: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 1. Returns ``(da, dy_w, dy_w_scale, dw_down, dweights)``: dA (M, H) bf16 for the
    SwiGLU backward (``need_chain``: dX or dW wanted), dY for the down weight gradient of the
    last phase (``late``: columnwise FP8, or BF16 bits), the down weight gradient (unless
    ``late``) and the routing-weight gradient (fp32); unneeded ones empty."""
    mx, qcol, _ = _modes(precision, wgrad, True)
    keep = need_dw and not qcol
    qcol = need_dw and qcol
    da = dwdn = dy_w = dy_w_scale = None  # made as needed (`_made`)
    dout = dout.to(BF16).contiguous()
    sb = _row_recipe(mx, scale_blocks)
    if table is None:  # called on its own: this pass builds the step's tables
        table, tile_ends = _step_tables(dout, offs, src.numel(), sb, backend)
    dyr, dyc, dyb, dwts = ST.combine_backward(
        dout, y.view(BF16), src, rows, weights, offs, qrow=mx and need_chain, qcol=qcol,
        keep_bf16=(not mx and need_chain) or keep, need_dw=need_dweights, scale_blocks=sb,
        aligned_groups=mx, table=table, tile_ends=tile_ends, backend=backend)
    if need_chain and mx:
        da = grouped_mm_m(dyr, _weights_q(w_down, "N", sb, backend, dn_n, dn_n_scale), offs,
                          out_dtype=BF16, backend=backend)
    elif need_chain:
        da = torch._grouped_mm(dyb, w_down, offs=offs)
    if need_dw and not late:
        dwdn = _weight_grad(dyc, dyb, sa, sa_scale, offs, qcol, sb, backend)
    elif need_dw:
        dy_w, dy_w_scale = _fp8_or_bf16(dyc, dyb, dout)
    return (_made(da, dout, BF16), _made(dy_w, dout, U8), _made(dy_w_scale, dout, U8),
            _made(dwdn, dout, BF16), _made(dwts, dout, F32))


@_bwd_down.register_fake
def _bwd_down_fake(dout, y, w_down, weights, rows, src, offs, sa, sa_scale, precision, backend,
                   wgrad, scale_blocks, need_chain, need_dw, need_dweights, late, table=None,
                   tile_ends=None, dn_n=None, dn_n_scale=None):
    _, qcol, _ = _modes(precision, wgrad, True)
    qcol = need_dw and qcol
    m = src.numel()
    e, d, hh = w_down.shape
    t, k = rows.shape
    da, dwdn = _empty(dout, BF16), _empty(dout, BF16)
    dy_w = (_empty(dout, torch.uint8), _empty(dout, torch.uint8))
    dwts = dout.new_empty(t, k, dtype=torch.float32) if need_dweights else _empty(
        dout, torch.float32)
    if not need_chain:
        return da, *dy_w, dwdn, dwts
    da = dout.new_empty(m, hh, dtype=BF16)
    if need_dw and not late:
        dwdn = dout.new_empty(e, d, hh, dtype=BF16)
    elif need_dw:
        dy_w = ((dout.new_empty(d, m, dtype=torch.uint8),
                 dout.new_empty(L.grouped_k_scale_bytes(d, m, e), dtype=torch.uint8)) if qcol
                else (dout.new_empty(m, d, dtype=torch.int16), _empty(dout, torch.uint8)))
    return da, *dy_w, dwdn, dwts


@define_op("moe_mxfp8::routed_experts_bwd_swiglu")
def _bwd_swiglu(
    da: Tensor, h: Tensor, src: Tensor, offs: Tensor, precision: str, backend: str, wgrad: str,
    scale_blocks: str, need_dx: bool, need_dw: bool, table: Tensor | None = None,
    tile_ends: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Phase 2. Returns ``(dh_rows, dh_rows_scale, dh_w, dh_w_scale)``: dH (M, 2H) for the
    gate/up dgrad (rowwise FP8; the twin: BF16 bits) and for its weight gradient (columnwise
    FP8, or BF16 bits; empty for the twin, whose ``dh_rows`` serves both); unneeded ones
    empty."""
    mx, qcol, _ = _modes(precision, wgrad, True)
    keep = need_dw and not qcol
    qcol = need_dw and qcol
    dh_rows = dh_rows_scale = dh_w = dh_w_scale = None  # made as needed (`_made`)
    sb = _row_recipe(mx, scale_blocks)
    if table is None:
        table, tile_ends = _step_tables(da, offs, src.numel(), sb, backend)
    if mx:
        dhr, dhc, dhb = ST.swiglu_backward(da, h.view(BF16), src, offs, qrow=need_dx, qcol=qcol,
                                        keep_bf16=keep, scale_blocks=sb, aligned_groups=True,
                                        table=table, tile_ends=tile_ends, backend=backend)
        if need_dx:
            dh_rows, dh_rows_scale = _u8(dhr, da)
        if need_dw:
            dh_w, dh_w_scale = _fp8_or_bf16(dhc, dhb, da)
    else:
        _, _, dh = ST.swiglu_backward(da, h.view(BF16), src, offs, qrow=False, qcol=False,
                                      keep_bf16=True, table=table, backend=backend)
        dh_rows = _i16(dh, da)
    return (_made(dh_rows, da, U8), _made(dh_rows_scale, da, U8), _made(dh_w, da, U8),
            _made(dh_w_scale, da, U8))


@_bwd_swiglu.register_fake
def _bwd_swiglu_fake(da, h, src, offs, precision, backend, wgrad, scale_blocks, need_dx,
                     need_dw, table=None, tile_ends=None):
    mx, qcol, _ = _modes(precision, wgrad, True)
    qcol = need_dw and qcol
    m, h2 = h.shape
    e = offs.numel()
    dh_rows = (_empty(da, torch.uint8), _empty(da, torch.uint8))
    dh_w = (_empty(da, torch.uint8), _empty(da, torch.uint8))
    if not mx:
        return da.new_empty(m, h2, dtype=torch.int16), dh_rows[1], *dh_w
    if need_dx:
        dh_rows = (da.new_empty(m, h2, dtype=torch.uint8),
                   da.new_empty(L.grouped_rows_scale_bytes(m, h2 // L.BLOCK_SIZE, e),
                                dtype=torch.uint8))
    if need_dw:
        dh_w = ((da.new_empty(h2, m, dtype=torch.uint8),
                 da.new_empty(L.grouped_k_scale_bytes(h2, m, e), dtype=torch.uint8)) if qcol
                else (da.new_empty(m, h2, dtype=torch.int16), dh_w[1]))
    return *dh_rows, *dh_w


@define_op("moe_mxfp8::routed_experts_bwd_dx")
def _bwd_dx(
    dh_rows: Tensor, dh_rows_scale: Tensor, w_gate_up: Tensor, rows: Tensor, offs: Tensor,
    precision: str, backend: str, scale_blocks: str, gu_n: Tensor | None = None,
    gu_n_scale: Tensor | None = None,
) -> Tensor:
    """Phase 3. ``dx (T, D)`` bf16: the gate/up dgrad of dH's rows (phase 2's ``dh_rows``) and
    the dispatch backward (each token's k rows summed)."""
    if precision == "mxfp8":
        sb = _row_recipe(True, scale_blocks)
        dhr = MXFP8Tensor(dh_rows.view(FP8), dh_rows_scale, "packed", offs, "rows")
        dxs = grouped_mm_m(dhr, _weights_q(w_gate_up, "N", sb, backend, gu_n, gu_n_scale), offs,
                           out_dtype=BF16, backend=backend)
    else:
        dxs = torch._grouped_mm(dh_rows.view(BF16), w_gate_up, offs=offs)
    return ST.dispatch_backward(dxs, rows, backend=backend)


@_bwd_dx.register_fake
def _bwd_dx_fake(dh_rows, dh_rows_scale, w_gate_up, rows, offs, precision, backend,
                 scale_blocks, gu_n=None, gu_n_scale=None):
    return dh_rows.new_empty(rows.shape[0], w_gate_up.shape[-1], dtype=BF16)


@define_op("moe_mxfp8::routed_experts_bwd_dw")
def _bwd_dw(
    dh_w: Tensor, dh_w_scale: Tensor, sx: Tensor, sx_scale: Tensor, dy_w: Tensor,
    dy_w_scale: Tensor, sa: Tensor, sa_scale: Tensor, offs: Tensor, precision: str,
    backend: str, wgrad: str, scale_blocks: str, late: bool,
) -> tuple[Tensor, Tensor]:
    """Phase 4. ``(dw_gate_up (E, 2H, D), dw_down (E, D, H) or empty unless ``late``)`` bf16:
    ``dH^T x`` per group (phase 2's ``dh_w``; the twin's ``dh_rows``) and, ``late``, ``dY^T a``
    (phase 1's ``dy_w``)."""
    mx, qcol, _ = _modes(precision, wgrad, True)
    sb = _row_recipe(mx, scale_blocks)
    dhc, dhb = _colwise(dh_w, dh_w_scale, offs)
    dwgu = _weight_grad(dhc, dhb, sx, sx_scale, offs, qcol, sb, backend)
    dwdn = _empty(dh_w, BF16)
    if late:
        dyc, dyb = _colwise(dy_w, dy_w_scale, offs)
        dwdn = _weight_grad(dyc, dyb, sa, sa_scale, offs, qcol, sb, backend)
    return dwgu, dwdn


@_bwd_dw.register_fake
def _bwd_dw_fake(dh_w, dh_w_scale, sx, sx_scale, dy_w, dy_w_scale, sa, sa_scale, offs,
                 precision, backend, wgrad, scale_blocks, late):
    _, qcol, _ = _modes(precision, wgrad, True)
    e = offs.numel()
    h2 = dh_w.shape[0] if qcol else dh_w.shape[1]
    d = sx.shape[0] if qcol else sx.shape[1]
    dwdn = dh_w.new_empty(e, d, h2 // 2, dtype=BF16) if late else _empty(dh_w, BF16)
    return dh_w.new_empty(e, h2, d, dtype=BF16), dwdn


InputGradHook = Callable[[Tensor], int]
_INPUT_GRAD_HOOK: ContextVar[InputGradHook | None] = ContextVar("moe_mxfp8_input_grad_hook",
                                                               default=None)


@contextlib.contextmanager
def on_input_grad(hook: InputGradHook) -> Iterator[None]:
    """Routed-expert blocks whose forward runs inside call ``hook(dx)`` in their backward as
    soon as their input gradient ``dx (T, D)`` bf16 exists -- after the gate/up dgrad, before
    the two weight-gradient GEMMs, which do not read it -- and launch those GEMMs leaving the
    number of SMs ``hook`` returns free. The expert-parallel dispatcher starts the return
    exchange of ``dx`` there, so that it runs beside the weight gradients rather than after
    them. ``dx`` is also the block's returned gradient, unchanged. Eager forwards only: a
    forward traced by ``torch.compile`` does not read the hook."""
    token = _INPUT_GRAD_HOOK.set(hook)
    try:
        yield
    finally:
        _INPUT_GRAD_HOOK.reset(token)


N_SAVED = 12  # tensors `_setup_context` saves before the optional ones (N-axis weights, tables)
# the forward op's optional trailing inputs (tables, K- and N-axis weights, keep_down_n) and
# their defaults
OPTIONAL_DEFAULTS = (None,) * 10 + (False,)
N_WEIGHTS_N = 4  # saved after them: gate_up and down along N (data, scale), each or None


def _setup_context(ctx, inputs, output) -> None:
    (x, w_gate_up, w_down, weights, rows, src, offs, precision, backend, wgrad, scale_blocks,
     _, *extra) = inputs
    table, tile_ends, _, _, _, _, *weights_n, _ = extra
    _, sx, sxs, h, sa, sas, y, dn_n_kept, dn_n_kept_scale = output
    if dn_n_kept.numel():  # w_down along N, quantized in forward (`_forward_weights`)
        weights_n[2:] = dn_n_kept, dn_n_kept_scale
    ctx.cfg = (precision, backend, wgrad, scale_blocks)
    ctx.input_grad_hook = None if torch.compiler.is_compiling() else _INPUT_GRAD_HOOK.get()
    # backward returns one entry per argument autograd saw: the dispatcher drops the trailing
    # ones equal to their default (`inputs` has them filled in)
    while extra and extra[-1] is OPTIONAL_DEFAULTS[len(extra) - 1]:
        extra.pop()
    ctx.n_extra = len(extra)
    # The saved-tensor outputs get no gradient; without this autograd would allocate and fill
    # zero "gradients" of their size at the start of backward (measured at dsv3: ~0.9 ms and
    # GiBs of peak memory).
    ctx.set_materialize_grads(False)
    ctx.has_tables = (table is not None, tile_ends is not None)
    ctx.save_for_backward(w_gate_up, w_down, weights, rows, src, offs, sx, sxs, h, sa, sas, y,
                          *weights_n, *[t for t in (table, tile_ends) if t is not None])


def _backward(ctx, dout, *_unused):
    need_dx = ctx.needs_input_grad[0]
    need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    need_dwts = ctx.needs_input_grad[3]
    cfg = ctx.cfg  # precision, backend, wgrad, scale_blocks
    saved = list(ctx.saved_tensors)
    # The saved tensors are now referenced here alone (unless the graph is kept for another
    # backward), so each is freed once the last phase that reads it has run.
    ctx.maybe_clear_saved_tensors()
    w_gate_up, w_down, weights, rows, src, offs, sx, sxs, h, sa, sas, y = saved[:N_SAVED]
    gu_n, gu_n_scale, dn_n, dn_n_scale = saved[N_SAVED:N_SAVED + N_WEIGHTS_N]
    tables = iter(saved[N_SAVED + N_WEIGHTS_N:])
    table, tile_ends = (next(tables) if has else None for has in ctx.has_tables)
    del saved
    mx, qcol, _ = _modes(cfg[0], cfg[2], True)
    e, d, hh = w_down.shape
    late = need_dw and late_down_wgrad(src.numel(), d, e, hh, mx and qcol)
    chain = need_dx or need_dw
    ops = torch.ops.moe_mxfp8
    da, dy_w, dy_w_scale, dwdn, dwts = ops.routed_experts_bwd_down(
        dout, y, w_down, weights, rows, src, offs, sa, sas, *cfg, chain, need_dw,
        need_dwts, late, table, tile_ends, dn_n, dn_n_scale)
    del dout, y, dn_n, dn_n_scale
    dx = dwgu = None
    free_sms = 0  # SMs the weight-gradient GEMMs leave to what the input-gradient hook started
    if chain:
        dh_rows, dh_rows_scale, dh_w, dh_w_scale = ops.routed_experts_bwd_swiglu(
            da, h, src, offs, *cfg, need_dx, need_dw, table, tile_ends)
        del da, h
        if need_dx:
            dx = ops.routed_experts_bwd_dx(dh_rows, dh_rows_scale, w_gate_up, rows, offs, cfg[0],
                                           cfg[1], cfg[3], gu_n, gu_n_scale)
            if ctx.input_grad_hook is not None:
                free_sms = ctx.input_grad_hook(dx)
        del gu_n, gu_n_scale
        if need_dw:
            if not mx:  # the twin's dH serves its dgrad and its weight gradient
                dh_w, dh_w_scale = dh_rows, dh_rows_scale
            del dh_rows, dh_rows_scale
            with leave_sms(free_sms):
                dwgu, dwdn_late = ops.routed_experts_bwd_dw(
                    dh_w, dh_w_scale, sx, sxs, dy_w, dy_w_scale, sa, sas, offs, *cfg, late)
            if late:
                dwdn = dwdn_late
    return (
        dx,
        dwgu if ctx.needs_input_grad[1] else None,
        dwdn if ctx.needs_input_grad[2] else None,
        dwts if need_dwts else None,
        None, None, None, None, None, None, None, None,
        *[None] * ctx.n_extra,
    )


_routed_experts_fwd.register_autograd(_backward, setup_context=_setup_context)

# The routed-expert operators' pre-quantized weight arguments: the forward reads the weights
# along K, backward's phases along N (the down projection's in phase 1, gate/up's in phase 2).
# Weights that arrive quantized (MXFP8 all-gathered under FSDP2, `moe_mxfp8.fsdp_mxfp8`) fill
# them by name: op -> (axis, {weight argument: (data argument, scale argument)}).
PREQUANTIZED_OPS = {
    torch.ops.moe_mxfp8.routed_experts_fwd.default: (
        "K", {"w_gate_up": ("gu_k", "gu_k_scale"), "w_down": ("dn_k", "dn_k_scale")}),
    torch.ops.moe_mxfp8.routed_experts_bwd_down.default: (
        "N", {"w_down": ("dn_n", "dn_n_scale")}),
    torch.ops.moe_mxfp8.routed_experts_bwd_dx.default: (
        "N", {"w_gate_up": ("gu_n", "gu_n_scale")}),
}


def _keep_down_n(precision: str, save: bool, prequantized: bool, x: Tensor, w_gate_up: Tensor,
                 w_down: Tensor) -> bool:
    """Whether forward quantizes ``w_down`` along N too (`_forward_weights`), for backward's
    first GEMM (dA, on the way to dX and dW): not when the weights come quantized
    (``weights_q``), nor when only the routing weights need a gradient.

    Why down's alone: its copy is read by backward's first phase and freed before the SwiGLU
    backward, the step's memory peak; it moved no peak at the three benchmark shapes. Keeping
    gate/up's too (alive through that peak, to the gate/up dgrad) put the step's peak above the
    BF16 twin's at qwen3 and mixtral (5.41 / 12.41 against 5.28 / 12.08 GiB) and saved no
    measurable time at dsv3 (H100, 2026-11-27, `docs/design/datapath.md`)."""
    return (save and precision == "mxfp8" and not prequantized
            and (x.requires_grad or w_gate_up.requires_grad or w_down.requires_grad))


def routed_experts(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, *, precision: str = "mxfp8", backend: str = "auto", wgrad: str = "mxfp8",
    scale_blocks: str = "1x32", weight_blocks: str | None = None,
    weights_q: tuple[MXFP8Tensor, MXFP8Tensor, MXFP8Tensor, MXFP8Tensor] | None = None,
    tables: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The routed experts of a SwiGLU MoE layer on the layout of `route_layout`, with autograd.

    ``x (T, D)`` bf16, ``w_gate_up (E, 2H, D)`` and ``w_down (E, D, H)`` bf16, ``weights (T, k)``
    routing weights (fp32), ``rows/src/offs`` from `route_layout` (``align >= 16`` for
    ``precision="mxfp8"``: the wgrad kernels and the data path's 16-byte columnwise stores
    rely on 16-aligned groups; 128 for
    ``scale_blocks="1x128"``: each 128-token k-tile of wgrad is one group's 1x128 block).
    ``scale_blocks``: the MXFP8 recipe (docs/numerics.md; ``weight_blocks`` is the older name
    of "1x32" / "32x32"). Returns ``(T, D)`` bf16::

        out[t] = sum_j w[t, j] * (silu(x[t] Wg_e^T) * (x[t] Wu_e^T)) Wd_e^T,  e = expert of (t, j)

    Gradients flow to x, both weights and ``weights``.

    ``weights_q`` (``precision="mxfp8"``): the expert weights already quantized with
    ``scale_blocks``' weight tiles, ``(w_gate_up along K, w_down along K, w_gate_up along N,
    w_down along N)`` (`moe_mxfp8.weight_cache`); they must be ``w_gate_up``'s and
    ``w_down``'s current values (the GEMMs read them instead of quantizing the weights).

    ``tables``: this layout's row tables as `layout` gives them with it (None: built here
    where the kernels run).
    """
    check_choice("routed_experts", "precision", precision, PRECISIONS)
    check_choice("routed_experts", "wgrad", wgrad, WGRAD_MODES)
    scale_blocks = resolve_scale_blocks(scale_blocks, weight_blocks, "routed_experts")
    check_scale_blocks(scale_blocks, "routed_experts")  # a recipe ("auto" resolved by the caller)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != BF16:
            raise TypeError(f"routed_experts: {name} must be bfloat16, got {t.dtype}")
    check_layout("routed_experts", x, numel_of(src), rows=rows, src=src, offs=offs,
                 pairs=numel_of(rows))
    if rows.shape != weights.shape or rows.dim() != 2 or rows.shape[0] != x.shape[0]:
        raise ValueError(f"routed_experts: rows {tuple(rows.shape)} and weights "
                         f"{tuple(weights.shape)} must both be (T={x.shape[0]}, k)")
    if offs.numel() != w_gate_up.shape[0]:
        raise ValueError(f"routed_experts: offs has {offs.numel()} groups but w_gate_up has "
                         f"{w_gate_up.shape[0]} experts")
    wq: tuple = ()
    if weights_q is not None:
        if precision != "mxfp8":
            raise ValueError("routed_experts: weights_q is for precision='mxfp8'")
        wq = tuple(v for t in weights_q for v in (t.data.view(torch.uint8), t.scale))
    save = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, w_gate_up, w_down, weights))
    # the step's tables, once for forward and backward (None: the references run)
    table, tile_ends = tables if tables is not None else _step_tables(
        x, offs, src.numel(), _row_recipe(precision == "mxfp8", scale_blocks), backend)
    keep_down_n = _keep_down_n(precision, save, bool(wq), x, w_gate_up, w_down)
    if not wq:
        wq = (None,) * 8
    out = torch.ops.moe_mxfp8.routed_experts_fwd(
        x, w_gate_up, w_down, weights.float(), rows, src, offs, precision, backend, wgrad,
        scale_blocks, save, table, tile_ends, *wq, keep_down_n)[0]
    return out
