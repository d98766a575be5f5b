"""The MoE data path outside the expert GEMMs: dispatch, SwiGLU and combine, fused with MXFP8
quantization; deterministic (no atomics); the same kernels for the MXFP8 layer and its BF16 twin.

The expert block, `routed_experts`: dispatch (`moe_mxfp8.stages`, on the layout of
`moe_mxfp8.routing`), the gate/up GEMM, SwiGLU, the down GEMM and the combine as one autograd
unit, serving `MXFP8MoE` and `MXFP8GroupedExperts` alike.

Autograd. FP8 tensors cannot carry gradients, so the autograd boundary is the whole routed-
expert block, `routed_experts` (custom ops ``moe_mxfp8::routed_experts_fwd`` / ``_bwd`` with
fake implementations, so ``torch.compile(fullgraph=True)`` traces it; no host syncs, every size
static, so it is CUDA-graph capturable). It saves for backward only what backward reads: the
FP8 columnwise copies of the dispatched ``x`` and of ``a`` (wgrad operands), ``h`` (BF16, for
the SwiGLU backward) and ``y`` (BF16, for the routing-weight gradient); with BF16 weight
gradients (``wgrad="bf16"`` or the BF16 twin) BF16 copies of ``x`` and ``a`` instead. The expert
weights are quantized along each axis the GEMMs need (along K in forward, along N in backward),
or come quantized already (``weights_q``: `moe_mxfp8.weight_cache`, once per optimizer step).
The expert GEMMs are `moe_mxfp8.grouped_gemm.grouped_mm_m` / ``grouped_mm_k`` (MXFP8) or
``torch._grouped_mm`` (BF16 twin).
"""

from __future__ import annotations

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
from .grouped_gemm import grouped_mm_k, grouped_mm_m
from .kernels.mx_format import ACT_BLOCK, WEIGHT_BLOCK_ROWS
from .mx_tensor import FP8, MXFP8Tensor
from .op_library import define_op
from .quantize import quantize_weights
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
# uint8 data and scales, gate_up (gu) and down (dn) along K (forward) and along N (kept for
# backward).


@define_op("moe_mxfp8::routed_experts_fwd")
def _routed_experts_fwd(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, precision: str, backend: str, wgrad: str, scale_blocks: str, save: bool,
    table: Tensor | None = None, tile_ends: Tensor | None = None,
    gu_k: Tensor | None = None, gu_k_scale: Tensor | None = None,
    dn_k: Tensor | None = None, dn_k_scale: Tensor | None = None,
    gu_n: Tensor | None = None, gu_n_scale: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(out (T, D) bf16, sx, sx_scale, h, sa, sa_scale, y)``: the saved tensors (empty
    unless ``save``): wgrad operands of x and a (FP8 bytes + scales, or BF16 as int16), h and y
    (BF16 as int16). The optional inputs: see above (the N-axis weights are for backward)."""
    mx, qcol, keep = _modes(precision, wgrad, save)
    top_k = rows.shape[1]
    sb = _row_recipe(mx, scale_blocks)
    if table is None:  # called on its own: this pass builds the step's tables
        table, tile_ends = _step_tables(x, offs, src.numel(), sb, backend)
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
        y = grouped_mm_m(ar, _weights_q(w_down, "K", sb, backend, dn_k, dn_k_scale), offs,
                         out_dtype=BF16, backend=backend)
        del ar
    else:
        _, _, xb = ST.dispatch(x, src, offs, top_k, qrow=False, qcol=False, keep_bf16=True,
                            table=table, backend=backend)
        h = torch._grouped_mm(xb, w_gate_up.transpose(-2, -1), offs=offs)
        _, _, ab = ST.swiglu(h, src, offs, qrow=False, qcol=False, keep_bf16=True, table=table,
                          backend=backend)
        y = torch._grouped_mm(ab, w_down.transpose(-2, -1), offs=offs)
        xc = ac = None
    out = ST.combine(y, rows, weights, backend=backend)
    if not save:
        e8 = _empty(x, torch.uint8)
        e16 = _empty(x, torch.int16)
        return out, e8, e8.clone(), e16, e8.clone(), e8.clone(), e16.clone()
    sx, sxs = _u8(xc, x) if qcol else (_i16(xb, x), _empty(x, torch.uint8))
    sa, sas = _u8(ac, x) if qcol else (_i16(ab, x), _empty(x, torch.uint8))
    return out, sx, sxs, _i16(h, x), sa, sas, _i16(y, x)


@_routed_experts_fwd.register_fake
def _routed_experts_fwd_fake(x, w_gate_up, w_down, weights, rows, src, offs, precision, backend,
                             wgrad, scale_blocks, save, table=None, tile_ends=None, gu_k=None,
                             gu_k_scale=None, dn_k=None, dn_k_scale=None, gu_n=None,
                             gu_n_scale=None, dn_n=None, dn_n_scale=None):
    t, d = x.shape
    e, h2, _ = w_gate_up.shape
    m = src.numel()
    out = x.new_empty(t, d, dtype=BF16)
    e8, e16 = _empty(x, torch.uint8), _empty(x, torch.int16)
    if not save:
        return out, e8, e8.clone(), e16, e8.clone(), e8.clone(), e16.clone()
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
        m, d, dtype=torch.int16)


def _weight_grad(dyc: MXFP8Tensor, dyb: Tensor, saved: Tensor, saved_scale: Tensor, offs: Tensor,
                 qcol: bool, scale_blocks: str, backend: str) -> Tensor:
    """A weight gradient ``dy^T @ saved`` per group: from the columnwise MXFP8 copies (``dyc``
    and the saved FP8 operand, ``qcol``) or the BF16 ones (``dyb`` and the saved int16 bits)."""
    if qcol:
        col = MXFP8Tensor(saved.view(FP8), saved_scale, "packed", offs, "k")
        return grouped_mm_k(dyc, col, offs, out_dtype=BF16, backend=backend, aligned_groups=True,
                            scale_blocks=scale_blocks)
    return torch._grouped_mm(dyb.t(), saved.view(BF16), offs=offs)


@define_op("moe_mxfp8::routed_experts_bwd")
def _routed_experts_bwd(
    dout: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, sx: Tensor, sx_scale: Tensor, h: Tensor, sa: Tensor, sa_scale: Tensor,
    y: Tensor, precision: str, backend: str, wgrad: str, scale_blocks: str, need_dx: bool,
    need_dw: bool, need_dweights: bool, table: Tensor | None = None,
    tile_ends: Tensor | None = None, gu_n: Tensor | None = None, gu_n_scale: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx (T, D), dw_gate_up (E, 2H, D), dw_down (E, D, H), dweights (T, k) fp32)``;
    an unneeded one is empty. The optional inputs: the step's tables and the forward's N-axis
    weights (see `_routed_experts_fwd`)."""
    mx, qcol, _ = _modes(precision, wgrad, True)
    keep = need_dw and not qcol
    qcol = need_dw and qcol
    h = h.view(BF16)
    y = y.view(BF16)
    dout = dout.to(BF16).contiguous()
    dx = dwgu = dwdn = None  # as computed; `_results` returns the unneeded ones empty
    chain = need_dx or need_dw
    sb = _row_recipe(mx, scale_blocks)
    if table is None:  # called on its own: this pass builds the step's tables
        table, tile_ends = _step_tables(dout, offs, src.numel(), sb, backend)
    dyr, dyc, dyb, dwts = ST.combine_backward(
        dout, y, src, rows, weights, offs, qrow=mx and chain, qcol=qcol,
        keep_bf16=(not mx and chain) or keep, need_dw=need_dweights, scale_blocks=sb,
        aligned_groups=mx, table=table, tile_ends=tile_ends, backend=backend)
    if not chain:
        return _results(dout, dx, dwgu, dwdn, dwts)
    # The down projection's weight gradient right away, or after the gate/up GEMMs: whichever
    # keeps fewer bytes alive through them, its result (E, D, H) BF16 or its dY operand (M, D)
    # (FP8 columnwise, or BF16). Static sizes: at mixtral the operand is 7x smaller, at dsv3 4x
    # larger. Every GEMM is the same either way (deterministic).
    e, d, hh = w_down.shape
    late = need_dw and src.numel() * d * (1 if mx and qcol else 2) < e * d * hh * 2
    if mx:
        da = grouped_mm_m(dyr, _weights_q(w_down, "N", sb, backend, dn_n, dn_n_scale), offs,
                          out_dtype=BF16, backend=backend)
        del dyr
        if not late:
            if need_dw:
                dwdn = _weight_grad(dyc, dyb, sa, sa_scale, offs, qcol, sb, backend)
            del dyc, dyb
        dhr, dhc, dhb = ST.swiglu_backward(da, h, src, offs, qrow=need_dx, qcol=qcol,
                                        keep_bf16=keep, scale_blocks=sb, aligned_groups=True,
                                        table=table, tile_ends=tile_ends, backend=backend)
        del da
        # dgrad before wgrad: dx is small, and its temporaries (the N-axis weights, the sorted
        # dX rows, dh's rowwise copy) are freed before the (E, 2H, D) weight gradient exists
        if need_dx:
            dxs = grouped_mm_m(dhr, _weights_q(w_gate_up, "N", sb, backend, gu_n, gu_n_scale),
                               offs, out_dtype=BF16, backend=backend)
            dx = ST.dispatch_backward(dxs, rows, backend=backend)
            del dxs
        del dhr
        if need_dw:
            dwgu = _weight_grad(dhc, dhb, sx, sx_scale, offs, qcol, sb, backend)
            del dhc, dhb
        if late:
            dwdn = _weight_grad(dyc, dyb, sa, sa_scale, offs, qcol, sb, backend)
    else:
        da = torch._grouped_mm(dyb, w_down, offs=offs)
        if not late:
            if need_dw:
                dwdn = torch._grouped_mm(dyb.t(), sa.view(BF16), offs=offs)
            del dyb
        _, _, dh = ST.swiglu_backward(da, h, src, offs, qrow=False, qcol=False, keep_bf16=True,
                                   table=table, backend=backend)
        del da
        if need_dx:  # dgrad before wgrad, as above
            dxs = torch._grouped_mm(dh, w_gate_up, offs=offs)
            dx = ST.dispatch_backward(dxs, rows, backend=backend)
            del dxs
        if need_dw:
            dwgu = torch._grouped_mm(dh.t(), sx.view(BF16), offs=offs)
            del dh
        if late:
            dwdn = torch._grouped_mm(dyb.t(), sa.view(BF16), offs=offs)
    return _results(dout, dx, dwgu, dwdn, dwts)


def _results(like: Tensor, dx, dwgu, dwdn, dwts) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_routed_experts_bwd`'s results, an unneeded one (None) as an empty tensor."""
    def given(g: Tensor | None, dtype: torch.dtype) -> Tensor:
        return _empty(like, dtype) if g is None else g

    return given(dx, BF16), given(dwgu, BF16), given(dwdn, BF16), given(dwts, torch.float32)


@_routed_experts_bwd.register_fake
def _routed_experts_bwd_fake(dout, w_gate_up, w_down, weights, rows, src, offs, sx, sx_scale, h,
                             sa, sa_scale, y, precision, backend, wgrad, scale_blocks, need_dx,
                             need_dw, need_dweights, table=None, tile_ends=None, gu_n=None,
                             gu_n_scale=None, dn_n=None, dn_n_scale=None):
    t, k = rows.shape
    dx = dout.new_empty(t, dout.shape[1], dtype=BF16) if need_dx else _empty(dout, BF16)
    dwgu = w_gate_up.new_empty(w_gate_up.shape, dtype=BF16) if need_dw else _empty(dout, BF16)
    dwdn = w_down.new_empty(w_down.shape, dtype=BF16) if need_dw else _empty(dout, BF16)
    dwts = (dout.new_empty(t, k, dtype=torch.float32) if need_dweights
            else _empty(dout, torch.float32))
    return dx, dwgu, dwdn, dwts


N_SAVED = 12  # tensors `_setup_context` saves before the optional ones (N-axis weights, tables)
N_OPTIONAL = 10  # the forward op's optional trailing inputs


def _setup_context(ctx, inputs, output) -> None:
    (_, w_gate_up, w_down, weights, rows, src, offs, precision, backend, wgrad, scale_blocks,
     _, *extra) = inputs
    padded: list = [*extra, *[None] * (N_OPTIONAL - len(extra))]
    table, tile_ends, _, _, _, _, *weights_n = padded
    _, sx, sxs, h, sa, sas, y = output
    ctx.cfg = (precision, backend, wgrad, scale_blocks)
    # backward returns one entry per argument autograd saw: the dispatcher drops the trailing
    # ones equal to their default (None; `inputs` has them filled in)
    while extra and extra[-1] is None:
        extra.pop()
    ctx.n_extra = len(extra)
    # The saved-tensor outputs get no gradient; without this autograd would allocate and fill
    # zero "gradients" of their size at the start of backward (measured at dsv3: ~0.9 ms and
    # GiBs of peak memory).
    ctx.set_materialize_grads(False)
    weights_n = [t for t in weights_n if t is not None]  # pre-quantized: backward's operands
    ctx.n_weights_n = len(weights_n)
    ctx.has_tables = (table is not None, tile_ends is not None)
    ctx.save_for_backward(w_gate_up, w_down, weights, rows, src, offs, sx, sxs, h, sa, sas, y,
                          *weights_n, *[t for t in (table, tile_ends) if t is not None])


def _backward(ctx, dout, *_unused):
    need_dx = ctx.needs_input_grad[0]
    need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    need_dwts = ctx.needs_input_grad[3]
    saved = ctx.saved_tensors
    weights_n = saved[N_SAVED:N_SAVED + ctx.n_weights_n]
    tables = iter(saved[N_SAVED + ctx.n_weights_n:])
    table, tile_ends = (next(tables) if has else None for has in ctx.has_tables)
    dx, dwgu, dwdn, dwts = torch.ops.moe_mxfp8.routed_experts_bwd(
        dout, *saved[:N_SAVED], *ctx.cfg, need_dx, need_dw, need_dwts, table, tile_ends,
        *weights_n)
    return (
        dx if need_dx else None,
        dwgu if ctx.needs_input_grad[1] else None,
        dwdn if ctx.needs_input_grad[2] else None,
        dwts if need_dwts else None,
        None, None, None, None, None, None, None, None,
        *[None] * ctx.n_extra,
    )


_routed_experts_fwd.register_autograd(_backward, setup_context=_setup_context)

# The routed-expert operators' pre-quantized weight arguments, per pass: forward reads the
# weights along K, backward along N. Weights that arrive quantized (MXFP8 all-gathered under
# FSDP2, `moe_mxfp8.fsdp_mxfp8`) fill them by name.
PREQUANTIZED_OPS = {torch.ops.moe_mxfp8.routed_experts_fwd.default: "K",
                    torch.ops.moe_mxfp8.routed_experts_bwd.default: "N"}
PREQUANTIZED_ARGS = {
    axis: {"w_gate_up": (f"gu_{axis.lower()}", f"gu_{axis.lower()}_scale"),
           "w_down": (f"dn_{axis.lower()}", f"dn_{axis.lower()}_scale")}
    for axis in ("K", "N")
}


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
    out = torch.ops.moe_mxfp8.routed_experts_fwd(
        x, w_gate_up, w_down, weights.float(), rows, src, offs, precision, backend, wgrad,
        scale_blocks, save, table, tile_ends, *wq)[0]
    return out
