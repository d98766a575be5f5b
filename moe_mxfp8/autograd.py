"""Differentiable MXFP8 grouped GEMM: `grouped_mm`, the MXFP8 counterpart of ``torch._grouped_mm``.

``y = grouped_mm(x, w_t, offs)`` computes, for each expert ``g`` and its rows
``offs[g-1] <= i < offs[g]`` of ``x``, ``y[i] = x[i] @ w_t[g]``: ``(M, K) x (E, K, N) -> (M, N)``.
The three GEMMs of training run in MXFP8 with operands quantized as the contract's table
"Which tensor is quantized along which axis" says (all GEMMs are "TN")::

    fprop  Y   = X  . W^T   X  rowwise along K (row groups)   W (E, N, K) along K
    dgrad  dX  = dY . W     dY rowwise along N (row groups)   W along N -> data (E, K, N)
    wgrad  dW_g = dY_g^T . X_g   dY^T and X^T columnwise along the tokens of each group

``dY`` is quantized once for both orientations (`quantize_dual`). ``X``'s columnwise copy is
quantized together with the rowwise copy in forward and saved in FP8 (default,
``save_colwise=True``, which keeps no BF16 ``x`` alive) or re-quantized from the saved BF16 ``x``
in backward (``save_colwise=False``). Saving the FP8 copy is the default: at the dsv3 shape
it takes the same time and less peak memory (docs/design/datapath.md).
``wgrad="bf16"`` computes the weight gradient in BF16 with ``torch._grouped_mm`` instead.

``scale_blocks`` names the scale-block recipe (one vocabulary with the quantizers and
`MXFP8MoE`): ``"auto"`` (default: the recipe of x's device, `moe_mxfp8.backend.auto_scale_blocks`),
``"1x32"`` (exact MXFP8 everywhere), ``"32x32"`` (W with one scale per
32x32 tile, X/dY 1x32) and ``"1x128"`` (X, dY and both wgrad operands one scale per 128
elements along the reduced axis, W one per 128x128 tile; every 32-block carries its 128-block's
scale, so each operand is still a valid MXFP8 tensor and the Blackwell kernel consumes it
unchanged, while the Hopper kernel promotes once per k=128 instead of per k=32:
docs/numerics.md "The 1x128 recipe"). ``weight_blocks`` is the older name of the first two.

``scale_blocks="32x32"`` quantizes W with one scale per 32x32 tile
(``quantize_weights(..., block_rows=32)``) for fprop (along K) and dgrad (along N) instead of
1x32 blocks; on Hopper the GEMM's promotion is then one FFMA per accumulator element per k-step
instead of FMUL + FFMA. The two orientations are the same tiles with the same amax, so the dgrad
operand is bit for bit the fprop operand transposed (tests/test_reference_quantize.py checks it).
It is still quantized twice -- once in forward, once in backward -- because deriving it would
mean keeping the forward's FP8 copy of W (E*N*K bytes per GEMM) alive until backward, and a
transposing byte copy plus a scale re-pack moves about as many bytes as the quantizer kernel
(2 vs 3 bytes per element), which runs at copy bandwidth.

The layer is two ``torch.library`` custom ops in the ``moe_mxfp8`` namespace --
``moe_mxfp8::grouped_mm_fwd`` and ``moe_mxfp8::grouped_mm_bwd`` -- with fake (meta)
implementations and the autograd formula registered on the forward op, so ``torch.compile``
traces through the layer without graph breaks. `MXFP8Tensor` is a dataclass, so the ops take and
return plain tensors (FP8 data, uint8 scales, ``offs``) and rebuild `MXFP8Tensor` inside.

Nothing here reads a device tensor on the host: the values of ``offs`` are checked only when
``offs`` lives on the CPU (`checks.check_offs`), so the GPU path has no host syncs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import checks as C
from . import layout as L
from .backend import AUTO, auto_scale_blocks
from .checks import COMPUTE_DTYPE
from .config import WGRAD_MODES, check_choice, check_scale_blocks, resolve_scale_blocks
from .grouped_gemm import grouped_mm_k, grouped_mm_m
from .kernels.mx_format import K_GROUP_ALIGN, WGRAD_ACT_BLOCK_ROWS
from .mx_tensor import FP8, MXFP8Tensor
from .op_library import define_op
from .quantize import quantize_colwise, quantize_dual, quantize_rowwise, quantize_weights
from .reference import WEIGHT_BLOCK_ROWS


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """A 0-element placeholder (custom ops return tensors, never None)."""
    return like.new_empty(0, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks (host-side metadata only; offs values only when offs is on the CPU)
# ---------------------------------------------------------------------------------------------


def _check_args(
    x: Tensor, w_t: Tensor, offs: Tensor, backend: str, wgrad: str, scale_blocks: str
) -> None:
    for name, t in (("x", x), ("w_t", w_t), ("offs", offs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_mm: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, nd in (("x", x, 2), ("w_t", w_t, 3)):
        if t.dtype != COMPUTE_DTYPE:
            raise TypeError(
                f"grouped_mm: {name} must be bfloat16 (MXFP8 training computes in BF16), got "
                f"{t.dtype}; cast with .to(torch.bfloat16)"
            )
        if t.dim() != nd:
            raise ValueError(f"grouped_mm: {name} must be {nd}D, got shape {tuple(t.shape)}")
    e, k, n = w_t.shape
    if x.shape[1] != k:
        raise ValueError(
            f"grouped_mm: x is (M, K) = {tuple(x.shape)} but w_t is (E, K, N) = "
            f"{tuple(w_t.shape)}; the K dims must match"
        )
    C.check_multiple_of("grouped_mm: x/w_t", k, L.BLOCK_SIZE, "K (reduced dim of fprop)")
    C.check_multiple_of("grouped_mm: w_t", n, L.BLOCK_SIZE, "N (reduced dim of dgrad)")
    C.check_same_device(x=x, w_t=w_t, offs=offs)
    C.check_offs(offs, x.shape[0], values=False)  # dtype and rank
    if offs.numel() != e:
        raise ValueError(
            f"grouped_mm: offs has {offs.numel()} groups but w_t has {e} experts (dim 0)"
        )
    C.check_offs(offs, x.shape[0])  # values only where they live on the host (no GPU sync)
    check_choice("grouped_mm", "wgrad", wgrad, WGRAD_MODES)
    check_scale_blocks(scale_blocks)
    if not isinstance(backend, str):
        raise TypeError(f"grouped_mm: backend must be a string, got {type(backend).__name__}")


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


@define_op("moe_mxfp8::grouped_mm_fwd")
def _grouped_mm_fwd(
    x: Tensor,
    w_t: Tensor,
    offs: Tensor,
    backend: str,
    wgrad: str,
    save_colwise: bool,
    scale_blocks: str,
    aligned_groups: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """fprop. Returns ``(y (M, N) bf16, xt_data (K, M) uint8, xt_scale uint8)``.

    ``xt_*`` is X's columnwise (wgrad) copy when ``save_colwise`` and empty placeholders otherwise;
    its FP8 bytes travel as uint8 so that autograd treats them as non-differentiable.
    ``wgrad`` and ``aligned_groups`` are not used here; they ride along so that the autograd
    formula sees them.
    """
    x = x.contiguous()
    sb = scale_blocks
    if save_colwise:
        xq, xtq = quantize_dual(x, offs=offs, backend=backend, scale_blocks=sb,
                                col_block_rows=WGRAD_ACT_BLOCK_ROWS[sb])
        xt_data, xt_scale = xtq.data.view(torch.uint8), xtq.scale
    else:
        xq = quantize_rowwise(x, offs=offs, backend=backend, scale_blocks=sb)
        xt_data, xt_scale = _empty(x, torch.uint8), _empty(x, torch.uint8)
    # w_t is usually the transposed view of (E, N, K) storage: then this is a free view.
    wq = quantize_weights(
        w_t.transpose(-2, -1).contiguous(),
        axis="K",
        block_rows=WEIGHT_BLOCK_ROWS[sb],
        backend=backend,
    )
    y = grouped_mm_m(xq, wq, offs, out_dtype=COMPUTE_DTYPE, backend=backend)
    return y, xt_data, xt_scale


@_grouped_mm_fwd.register_fake
def _grouped_mm_fwd_fake(x, w_t, offs, backend, wgrad, save_colwise, scale_blocks,
                         aligned_groups):
    m, k = x.shape
    e, _, n = w_t.shape
    y = x.new_empty(m, n, dtype=COMPUTE_DTYPE)
    if not save_colwise:
        return y, _empty(x, torch.uint8), _empty(x, torch.uint8)
    # The grouped-K scale buffer is sized from static bounds (layout.grouped_k_scale_bytes).
    nbytes = L.grouped_k_scale_bytes(k, m, e)
    return y, x.new_empty(k, m, dtype=torch.uint8), x.new_empty(nbytes, dtype=torch.uint8)


@define_op("moe_mxfp8::grouped_mm_bwd")
def _grouped_mm_bwd(
    grad_out: Tensor,
    x: Tensor | None,
    w_t: Tensor,
    offs: Tensor,
    xt_data: Tensor | None,
    xt_scale: Tensor | None,
    backend: str,
    wgrad: str,
    scale_blocks: str,
    aligned_groups: bool,
    need_dx: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor]:
    """dgrad and wgrad. Returns ``(dx (M, K), dw (E, N, K))``; an unneeded one is empty.

    ``dw`` is the gradient of ``w = w_t.transpose(-2, -1)`` (the ``(E, N, K)`` storage of the
    usual caller); the autograd formula hands its transposed view to ``w_t``.
    """
    dy = grad_out.contiguous()
    mx_wgrad = need_dw and wgrad == "mxfp8"
    m = dy.shape[0]
    if mx_wgrad and aligned_groups and m % K_GROUP_ALIGN:
        # With aligned groups the wgrad kernels skip their re-layout (which accepts any M) and
        # TMA-load the tokens as they are: the row stride needs M % 16 == 0. Zero rows appended
        # to the last group change no result (its last 32-block is zero-padded anyway; a block
        # that becomes all-zero adds exact zeros) -- dx is sliced back to M rows.
        mp = L.round_up(m, K_GROUP_ALIGN)
        offs = torch.cat([offs[:-1], offs.new_full((1,), mp)])
        dy = torch.cat([dy, dy.new_zeros(mp - m, dy.shape[1])])
        x = torch.cat([x, x.new_zeros(mp - m, x.shape[1])]) if x is not None else None
    dyq = dytq = None
    sb = scale_blocks
    if need_dx and mx_wgrad:
        dyq, dytq = quantize_dual(dy, offs=offs, backend=backend, scale_blocks=sb)  # read once
    elif need_dx:
        dyq = quantize_rowwise(dy, offs=offs, backend=backend, scale_blocks=sb)
    elif mx_wgrad:
        dytq = quantize_colwise(dy, offs=offs, backend=backend, scale_blocks=sb)

    dx = _empty(dy, COMPUTE_DTYPE)
    if need_dx:
        # W along N: data (E, K, N), blocks of 32 along N (dgrad reduces over N); with 32x32
        # blocks these are the forward's bytes transposed (re-quantized: see the module doc).
        wq = quantize_weights(
            w_t.transpose(-2, -1).contiguous(),
            axis="N",
            block_rows=WEIGHT_BLOCK_ROWS[sb],
            backend=backend,
        )
        dx = grouped_mm_m(dyq, wq, offs, out_dtype=COMPUTE_DTYPE, backend=backend)[:m]

    dw = _empty(dy, COMPUTE_DTYPE)
    if need_dw:
        if wgrad == "bf16":
            # dW_g = dY_g^T X_g in BF16 (fp32 accumulation), torch._grouped_mm's own wgrad.
            dw = torch._grouped_mm(dy.t(), x.contiguous(), offs=offs)
        else:
            if xt_data is not None:
                xtq = MXFP8Tensor(xt_data.view(FP8), xt_scale, "packed", offs, "k",
                                  WGRAD_ACT_BLOCK_ROWS[sb])
            else:
                xtq = quantize_colwise(x.contiguous(), offs=offs, backend=backend,
                                       scale_blocks=sb, block_rows=WGRAD_ACT_BLOCK_ROWS[sb])
            # aligned_groups: every group starts on a multiple of 16 rows (the odd-M padding
            # above only grows the last group), so the kernels skip their re-layout
            dw = grouped_mm_k(dytq, xtq, offs, out_dtype=COMPUTE_DTYPE, backend=backend,
                              aligned_groups=aligned_groups, scale_blocks=sb)
    return dx, dw


@_grouped_mm_bwd.register_fake
def _grouped_mm_bwd_fake(
    grad_out, x, w_t, offs, xt_data, xt_scale, backend, wgrad, scale_blocks, aligned_groups,
    need_dx, need_dw,
):
    m, n = grad_out.shape
    e, k, _ = w_t.shape
    dx = grad_out.new_empty(m, k) if need_dx else _empty(grad_out, COMPUTE_DTYPE)
    dw = grad_out.new_empty(e, n, k) if need_dw else _empty(grad_out, COMPUTE_DTYPE)
    return dx, dw


def _setup_context(ctx, inputs, output) -> None:
    x, w_t, offs, backend, wgrad, save_colwise, scale_blocks, aligned_groups = inputs
    _, xt_data, xt_scale = output
    ctx.backend = backend
    ctx.wgrad = wgrad
    ctx.scale_blocks = scale_blocks
    ctx.aligned_groups = aligned_groups
    ctx.use_saved_colwise = save_colwise and wgrad == "mxfp8"
    # Keep the BF16 x only if backward needs it (wgrad of a w_t that needs grad, no FP8 copy).
    keep_x = w_t.requires_grad and not ctx.use_saved_colwise
    ctx.save_for_backward(
        x if keep_x else None,
        w_t,
        offs,
        xt_data if ctx.use_saved_colwise else None,
        xt_scale if ctx.use_saved_colwise else None,
    )


def _backward(ctx, grad_y, _grad_xt_data, _grad_xt_scale):
    x, w_t, offs, xt_data, xt_scale = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dx or need_dw):
        return None, None, None, None, None, None, None, None
    dx, dw = torch.ops.moe_mxfp8.grouped_mm_bwd(
        grad_y, x, w_t, offs, xt_data, xt_scale, ctx.backend, ctx.wgrad, ctx.scale_blocks,
        ctx.aligned_groups, need_dx, need_dw,
    )
    return (
        dx if need_dx else None,
        dw.transpose(-2, -1) if need_dw else None,  # (E, N, K) -> w_t's shape (E, K, N)
        None,
        None,
        None,
        None,
        None,
        None,
    )


_grouped_mm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def grouped_mm(
    x: Tensor,
    w_t: Tensor,
    offs: Tensor,
    *,
    backend: str = "auto",
    wgrad: str = "mxfp8",
    save_colwise: bool = True,
    scale_blocks: str = AUTO,
    aligned_groups: bool = False,
    weight_blocks: str | None = None,
) -> Tensor:
    """MXFP8 grouped GEMM with autograd; the counterpart of ``torch._grouped_mm(x, w_t, offs)``.

    Args:
        x: ``(M, K)`` bfloat16 tokens sorted by expert (any strides; copied if not contiguous).
        w_t: ``(E, K, N)`` bfloat16 expert weights, typically ``w.transpose(-2, -1)`` of an
            ``(E, N, K)`` parameter ``w`` (then no copy is made). K and N multiples of 32.
        offs: ``(E,)`` int32 cumulative group ends on x's device, ``offs[-1] == M``; groups may be
            empty. Row ``i`` of group ``g`` (``offs[g-1] <= i < offs[g]``) uses expert ``g``.
        backend: ``"auto"``, ``"reference"``, ``"sm90"`` or ``"sm100"`` (`resolve_backend`).
        wgrad: ``"mxfp8"`` (weight gradient in MXFP8, default) or ``"bf16"`` (BF16 GEMM).
        save_colwise: with ``wgrad="mxfp8"``, quantize x's columnwise (wgrad) copy in forward
            together with the rowwise one and save it in FP8 instead of the BF16 ``x`` (default:
            same time, less memory); False re-quantizes x in backward. Same bytes either way.
        scale_blocks: the scale-block recipe. ``"auto"`` (default): the recipe of x's device,
            `moe_mxfp8.backend.auto_scale_blocks` (on Hopper the protocol-chosen
            `HOPPER_AUTO_SCALE_BLOCKS`, ``"1x128"``; ``"1x32"`` elsewhere); ``"1x32"`` (exact
            MXFP8, one scale per 32 elements along every GEMM's reduced axis); ``"32x32"``
            (one scale per 32x32 tile of each expert's W for fprop and dgrad; X, dY and wgrad
            unchanged); ``"1x128"``
            (X and dY one scale per 128 elements along the reduced axis, in wgrad per 128
            tokens of a group, W one per 128x128 tile: still valid MXFP8 tensors, and the
            Hopper kernel promotes once per k=128, 4x fewer FP32 ops; see docs/numerics.md).
        weight_blocks: deprecated name of ``scale_blocks`` for ``"1x32"``/``"32x32"``.
        aligned_groups: the caller guarantees that every group starts on a multiple of 16 rows
            (as `MXFP8MoE`'s padded layout does); the wgrad kernels then skip re-laying the
            FP8 operands out to such starts (a gather; docs/design/hopper_gemm.md).

    Returns:
        ``(M, N)`` bfloat16. Its gradients: ``(M, K)`` for x, ``(E, K, N)`` for w_t (a transposed
        view of a contiguous ``(E, N, K)`` tensor, i.e. contiguous for the usual ``w``).
    """
    scale_blocks = resolve_scale_blocks(scale_blocks, weight_blocks)
    if scale_blocks == AUTO and isinstance(x, torch.Tensor):  # (not a tensor: _check_args says)
        scale_blocks = auto_scale_blocks(x.device)
    _check_args(x, w_t, offs, backend, wgrad, scale_blocks)
    save = (
        bool(save_colwise)
        and wgrad == "mxfp8"
        # odd M with aligned groups: backward pads x, so keep the BF16 x
        and (x.shape[0] % K_GROUP_ALIGN == 0 or not aligned_groups)
        and torch.is_grad_enabled()
        and w_t.requires_grad
    )
    y, _, _ = torch.ops.moe_mxfp8.grouped_mm_fwd(
        x, w_t, offs, backend, wgrad, save, scale_blocks, bool(aligned_groups)
    )
    return y
