"""The MoE data path outside the expert GEMMs: dispatch, SwiGLU and combine, fused with MXFP8
quantization; deterministic (no atomics); the same kernels for the MXFP8 layer and its BF16 twin.

Layout. The ``T*k`` (token, slot) pairs are sorted by expert (stable) into a buffer of ``M`` rows
whose expert groups start on multiples of ``align`` rows (16 for the MXFP8 layer: the Hopper wgrad
kernel's TMA alignment; 128 for its "1x128" recipe; 1 for BF16: no padding). `route_layout`
gives, on the device and without a host sync::

    rows (T, k) int32   row of pair (t, j) in the sorted buffer
    src  (M,)   int32   pair index t*k + j of each row, -1 for the zero pad rows
    offs (E,)   int32   cumulative group ends; offs[-1] == M = padded_extent(T*k, E, align)

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
change. Every stage has a pure-PyTorch reference (``*_ref``, CPU and CI) and a Triton kernel
(``moe_mxfp8.kernels.datapath_triton``, used on CUDA when Triton is installed: an optional GPU
dependency); the GPU tests check the kernels bit for bit against the references.

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

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from . import checks as C
from . import layout as L
from . import reference as R
from .backend import _warn_once
from .config import (
    PRECISIONS,
    WGRAD_MODES,
    check_choice,
    check_scale_blocks,
    resolve_scale_blocks,
)
from .grouped_gemm import grouped_mm_k, grouped_mm_m
from .kernels.mx_format import ACT_BLOCK, WEIGHT_BLOCK_ROWS, padded_extent
from .mx_tensor import FP8, MXFP8Tensor
from .op_library import define_op
from .quantize import quantize_weights

BF16 = torch.bfloat16
INDEX_DTYPES = (torch.int32, torch.int64)  # rows / src: every backend indexes with either


# ---------------------------------------------------------------------------------------------
# Routing layout
# ---------------------------------------------------------------------------------------------


def route_layout(expert_ids: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """``expert_ids (T, k)`` and ``counts (E,)`` -> ``rows (T, k)``, ``src (M,)``, ``offs (E,)``
    (int32, on the ids' device, no host sync; see the module doc). Pairs keep their token order
    inside a group (stable sort). The last group absorbs the slack up to the static extent."""
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"route_layout: align must be a positive int, got {align!r}")
    t, k = expert_ids.shape
    e = counts.numel()
    m = t * k
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    g = flat[order]
    rows_sorted = pad_start[g] + torch.arange(m, device=flat.device) - start[g]
    rows = torch.empty_like(order).scatter_(0, order, rows_sorted)
    m_pad = padded_extent(m, e, align)
    src = torch.full((m_pad,), -1, dtype=torch.int64, device=flat.device)
    src = src.scatter_(0, rows_sorted, order)
    # The last end is the static extent, built on the device (writing a Python int into a CUDA
    # tensor is a host->device copy, which syncs).
    offs = torch.cat([torch.cumsum(padded, 0)[:-1], counts.new_full((1,), m_pad)])
    return rows.to(torch.int32).reshape(t, k), src.to(torch.int32), offs.to(torch.int32)


def check_index(who: str, name: str, t, ndim: int, like: Tensor, lo: int = 0,
                hi: int | None = None) -> None:
    """An index tensor of the data path (``rows``, ``src``, the EP payload's row index): int32
    (route_layout's) or int64, ``ndim``-D on ``like``'s device, any strides (the kernels read
    dense copies). Its values, in ``[lo, hi)``, are read only where that costs no device sync
    (CPU tensors): the rule depends on the device, not the backend."""
    if not isinstance(t, Tensor) or t.dtype not in INDEX_DTYPES:
        what = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{who}: {name} must be an int32 or int64 tensor, got {what}")
    if t.dim() != ndim or t.device != like.device:
        raise ValueError(f"{who}: {name} must be {ndim}D on {like.device}, got shape "
                         f"{tuple(t.shape)} on {t.device}")
    if hi is None or t.numel() == 0 or not C.values_on_host(t):
        return
    t_min, t_max = int(t.min()), int(t.max())
    if t_min < lo or t_max >= hi:
        raise ValueError(f"{who}: {name} values must lie in [{lo}, {hi}), got "
                         f"[{t_min}, {t_max}]")


def check_layout(who: str, like: Tensor, m: int, *, rows: Tensor | None = None,
                 src: Tensor | None = None, offs: Tensor | None = None,
                 pairs: int | None = None) -> None:
    """The index tensors of a `route_layout` layout of ``m`` sorted rows, as the stage ``who``
    gets them (`check_index`): ``rows (T, k)`` in ``[0, m)``, ``src (m,)`` in ``[-1, pairs)``,
    ``offs`` (the one `checks.check_offs`, last == m), all on ``like``'s device."""
    if rows is not None:
        check_index(who, "rows", rows, 2, like, 0, m)
    if src is not None:
        check_index(who, "src", src, 1, like, -1, pairs)
        if src.numel() != m:
            raise ValueError(f"{who}: src has {src.numel()} rows but the sorted buffer has {m}")
    if offs is not None:
        C.check_offs(offs, m)
        if offs.device != like.device:
            raise ValueError(f"{who}: offs is on {offs.device} but the data is on {like.device}")


def _numel(t) -> int:
    """Rows of an index tensor, 0 for what is not one (`check_layout` then names it)."""
    return t.numel() if isinstance(t, Tensor) else 0


def block_table(offs: Tensor, m: int, block: int = L.BLOCK_SIZE) -> Tensor:
    """int32 ``(ceil-bound, 6)`` table of the ``block``-row blocks of the sorted buffer (blocks
    restart at each group; ``block`` the activation block length, 32 or 128):
    ``rs, re, prow0, tiles, lblk, nblk`` (see `kernels.datapath_triton`)."""
    e = offs.numel()
    nb_bound = (m + (block - 1) * e) // block
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    nblk = (sizes + block - 1) // block
    cum = torch.cumsum(nblk, 0)
    tiles = (sizes + L.TILE_ROWS - 1) // L.TILE_ROWS
    tiles_before = torch.cumsum(tiles, 0) - tiles
    j = torch.arange(nb_bound, device=offs.device)
    g = torch.searchsorted(cum, j, right=True)
    valid = g < e
    g = g.clamp(max=e - 1)
    lblk = j - (cum - nblk)[g]
    rs = starts[g] + block * lblk
    re = torch.where(valid, torch.minimum(rs + block, ends[g]), rs)
    prow0 = tiles_before[g] * L.TILE_ROWS - starts[g]
    tbl = torch.stack([rs, re, prow0, tiles_before[g], lblk, nblk[g]], 1)
    return tbl.to(torch.int32).contiguous()


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


def _wrap(outs: dict, offs: Tensor):
    row = col = None
    if "qrow" in outs:
        row = MXFP8Tensor(outs["qrow"].view(FP8), outs["srow"], "packed", offs, "rows")
    if "qcol" in outs:
        col = MXFP8Tensor(outs["qcol"].view(FP8), outs["scol"], "packed", offs, "k")
    return row, col, outs.get("bf16")


def _quantize_ref(v: Tensor, offs: Tensor, qrow: bool, qcol: bool, keep_bf16: bool,
                  scale_blocks: str):
    row = R.quantize_rowwise_ref(v, offs=offs, scale_blocks=scale_blocks) if qrow else None
    col = R.quantize_colwise_ref(v, offs=offs, scale_blocks=scale_blocks) if qcol else None
    return row, col, (v if keep_bf16 else None)


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
    return _quantize_ref(xs, offs, qrow, qcol, keep_bf16, scale_blocks)


def dispatch(x: Tensor, src: Tensor, offs: Tensor, top_k: int, *, qrow: bool = True,
             qcol: bool = True, keep_bf16: bool = False, scale_blocks: str = "1x32",
             aligned_groups: bool = False, table: Tensor | None = None, backend: str = "auto"):
    """Gather ``x (T, D)`` into the sorted buffer (``M = src.numel()`` rows, zero pad rows):
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, D) | None)`` from one read;
    the MXFP8 copies in the activation blocks of ``scale_blocks`` (32, or 128 for "1x128").

    ``aligned_groups`` (here and in the other row stages): the caller promises that every
    group starts on a multiple of 16 rows (`route_layout` with ``align % 16 == 0``); the
    kernels then write the columnwise copy in 16-byte stores. ``table``: the `block_table` of
    ``(offs, M, block)`` where the caller already has it (one per step)."""
    ablk = _check_rows("dispatch", x.shape[1], scale_blocks, qrow or qcol)
    check_layout("dispatch", x, _numel(src), src=src, offs=offs, pairs=x.shape[0] * top_k)
    if not use_triton(x, backend):
        return dispatch_ref(x, src, offs, top_k, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                            scale_blocks=scale_blocks)
    x = x.to(BF16).contiguous()
    m = src.numel()
    outs = _outputs(m, x.shape[1], offs.numel(), qrow, qcol, keep_bf16, x)
    _triton_kernels().dispatch(x, src.contiguous(), _table(table, offs, m, ablk), top_k, outs,
                               ablk, aligned_groups)
    return _wrap(outs, offs)


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
    return _quantize_ref(a, offs, qrow, qcol, keep_bf16, scale_blocks)


def swiglu(h: Tensor, src: Tensor, offs: Tensor, *, qrow: bool = True, qcol: bool = True,
           keep_bf16: bool = False, scale_blocks: str = "1x32", aligned_groups: bool = False,
           table: Tensor | None = None, backend: str = "auto"):
    """``h = [gate | up] (M, 2H)`` BF16 -> ``a = silu(gate) * up`` as
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, H) | None)``; pad rows 0."""
    ablk = _check_rows("swiglu", h.shape[1] // 2, scale_blocks, qrow or qcol)
    check_layout("swiglu", h, h.shape[0], src=src, offs=offs)
    if not use_triton(h, backend):
        return swiglu_ref(h, src, offs, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                          scale_blocks=scale_blocks)
    h = h.contiguous()
    m = src.numel()
    outs = _outputs(m, h.shape[1] // 2, offs.numel(), qrow, qcol, keep_bf16, h)
    _triton_kernels().swiglu_fwd(h, src.contiguous(), _table(table, offs, m, ablk), outs, ablk,
                                 aligned_groups)
    return _wrap(outs, offs)


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
                    backend: str = "auto"):
    """Gradient of `swiglu`: ``dA (M, H)`` and the saved ``h`` -> ``dh = [dgate | dup]`` as
    ``(rowwise MXFP8 | None, columnwise MXFP8 | None, BF16 (M, 2H) | None)`` in one pass (the
    MXFP8 copies blocked along the whole 2H row, as the GEMMs read them)."""
    ablk = _check_rows("swiglu_backward", h.shape[1], scale_blocks, qrow or qcol)
    check_layout("swiglu_backward", h, h.shape[0], src=src, offs=offs)
    if not use_triton(h, backend):
        return swiglu_backward_ref(da, h, src, offs, qrow=qrow, qcol=qcol, keep_bf16=keep_bf16,
                                   scale_blocks=scale_blocks)
    h, da = h.contiguous(), da.contiguous()
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
                     backend: str = "auto"):
    """Gradient of `combine` in one pass over the sorted rows: ``dY`` as ``(rowwise MXFP8 |
    None, columnwise MXFP8 | None, BF16 (M, D) | None)`` (pad rows 0) and the routing-weight
    gradient ``(T, k)`` fp32 (or None): per-row partial sums over feature tiles, then summed
    over the tiles in a fixed order (no atomics)."""
    ablk = _check_rows("combine_backward", dout.shape[1], scale_blocks,
                       qrow or qcol)
    check_layout("combine_backward", dout, y.shape[0], rows=rows, src=src, offs=offs,
                 pairs=_numel(rows))
    if not use_triton(dout, backend):
        return combine_backward_ref(dout, y, src, rows, weights, offs, qrow=qrow, qcol=qcol,
                                    keep_bf16=keep_bf16, need_dw=need_dw,
                                    scale_blocks=scale_blocks)
    kern = _triton_kernels()
    dout, y = dout.contiguous(), y.contiguous()
    m, d = src.numel(), dout.shape[1]
    outs = _outputs(m, d, offs.numel(), qrow, qcol, keep_bf16, dout)
    part = None
    if need_dw:
        part = dout.new_empty(-(-d // kern.COL_TILE), m, dtype=torch.float32)
    kern.combine_bwd(dout, y, weights.float().contiguous(), src.contiguous(),
                     _table(table, offs, m, ablk), rows.shape[1], outs, part, ablk, aligned_groups)
    dw = None
    if need_dw:
        dw = part.sum(0).to(BF16).float()[rows.to(torch.int64)]
    return (*_wrap(outs, offs), dw)


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


def _step_table(like: Tensor, offs: Tensor, m: int, scale_blocks: str, backend: str):
    """The row kernels' `block_table`, built once per pass (None where the references run)."""
    return block_table(offs, m, ACT_BLOCK[scale_blocks]) if use_triton(like, backend) else None


def _weights_q(w: Tensor, axis: str, scale_blocks: str, backend: str,
               data: Tensor | None = None, scale: Tensor | None = None) -> MXFP8Tensor:
    """Expert weights ``w`` quantized along ``axis``: the pre-quantized ``data`` (uint8) and
    ``scale`` given (`routed_experts`' ``weights_q``), else quantized now."""
    rows = WEIGHT_BLOCK_ROWS[scale_blocks]
    if data is not None:
        return MXFP8Tensor(data.view(FP8), scale, "packed", None, "experts", rows)
    return quantize_weights(w.contiguous(), axis=axis, block_rows=rows, backend=backend)


# The ops' optional trailing inputs (plain optional tensors: a tensor list would route every call
# through torch.library's pytree wrapper). ``table``: the step's `block_table`, built once by
# `routed_experts` for both passes (else each pass builds it: some 30 small device ops each);
# ``gu_k ... dn_n_scale``: `routed_experts`' ``weights_q`` as uint8 data and scales, gate_up
# (gu) and down (dn) along K (forward) and along N (kept for backward).


@define_op("moe_mxfp8::routed_experts_fwd")
def _routed_experts_fwd(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, precision: str, backend: str, wgrad: str, scale_blocks: str, save: bool,
    table: Tensor | None = None, gu_k: Tensor | None = None, gu_k_scale: Tensor | None = None,
    dn_k: Tensor | None = None, dn_k_scale: Tensor | None = None,
    gu_n: Tensor | None = None, gu_n_scale: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(out (T, D) bf16, sx, sx_scale, h, sa, sa_scale, y)``: the saved tensors (empty
    unless ``save``): wgrad operands of x and a (FP8 bytes + scales, or BF16 as int16), h and y
    (BF16 as int16). The optional inputs: see above (the N-axis weights are for backward)."""
    mx, qcol, keep = _modes(precision, wgrad, save)
    top_k = rows.shape[1]
    sb = scale_blocks if mx else "1x32"  # BF16 twin: nothing quantized, 32-row programs
    tbl = _step_table(x, offs, src.numel(), sb, backend) if table is None else table
    if mx:
        # MXFP8: groups start on multiples of 16 rows (the contract of this op, see
        # `routed_experts`; the wgrad GEMMs rely on it too)
        xr, xc, xb = dispatch(x, src, offs, top_k, qrow=True, qcol=qcol, keep_bf16=keep,
                              scale_blocks=sb, aligned_groups=True, table=tbl, backend=backend)
        h = grouped_mm_m(xr, _weights_q(w_gate_up, "K", sb, backend, gu_k, gu_k_scale), offs,
                         out_dtype=BF16, backend=backend)
        del xr
        ar, ac, ab = swiglu(h, src, offs, qrow=True, qcol=qcol, keep_bf16=keep, scale_blocks=sb,
                            aligned_groups=True, table=tbl, backend=backend)
        y = grouped_mm_m(ar, _weights_q(w_down, "K", sb, backend, dn_k, dn_k_scale), offs,
                         out_dtype=BF16, backend=backend)
        del ar
    else:
        _, _, xb = dispatch(x, src, offs, top_k, qrow=False, qcol=False, keep_bf16=True,
                            table=tbl, backend=backend)
        h = torch._grouped_mm(xb, w_gate_up.transpose(-2, -1), offs=offs)
        _, _, ab = swiglu(h, src, offs, qrow=False, qcol=False, keep_bf16=True, table=tbl,
                          backend=backend)
        y = torch._grouped_mm(ab, w_down.transpose(-2, -1), offs=offs)
        xc = ac = None
    out = combine(y, rows, weights, backend=backend)
    if not save:
        e8 = _empty(x, torch.uint8)
        e16 = _empty(x, torch.int16)
        return out, e8, e8.clone(), e16, e8.clone(), e8.clone(), e16.clone()
    sx, sxs = _u8(xc, x) if qcol else (_i16(xb, x), _empty(x, torch.uint8))
    sa, sas = _u8(ac, x) if qcol else (_i16(ab, x), _empty(x, torch.uint8))
    return out, sx, sxs, _i16(h, x), sa, sas, _i16(y, x)


@_routed_experts_fwd.register_fake
def _routed_experts_fwd_fake(x, w_gate_up, w_down, weights, rows, src, offs, precision, backend,
                             wgrad, scale_blocks, save, table=None, gu_k=None, gu_k_scale=None,
                             dn_k=None, dn_k_scale=None, gu_n=None, gu_n_scale=None, dn_n=None,
                             dn_n_scale=None):
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
    gu_n: Tensor | None = None, gu_n_scale: Tensor | None = None,
    dn_n: Tensor | None = None, dn_n_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx (T, D), dw_gate_up (E, 2H, D), dw_down (E, D, H), dweights (T, k) fp32)``;
    an unneeded one is empty. The optional inputs: the step's block table and the forward's
    N-axis weights (see `_routed_experts_fwd`)."""
    mx, qcol, _ = _modes(precision, wgrad, True)
    keep = need_dw and not qcol
    qcol = need_dw and qcol
    h = h.view(BF16)
    y = y.view(BF16)
    dout = dout.to(BF16).contiguous()
    dx = _empty(dout, BF16)
    dwgu = _empty(dout, BF16)
    dwdn = _empty(dout, BF16)
    chain = need_dx or need_dw
    sb = scale_blocks if mx else "1x32"
    tbl = _step_table(dout, offs, src.numel(), sb, backend) if table is None else table
    dyr, dyc, dyb, dwts = combine_backward(
        dout, y, src, rows, weights, offs, qrow=mx and chain, qcol=qcol,
        keep_bf16=(not mx and chain) or keep, need_dw=need_dweights, scale_blocks=sb,
        aligned_groups=mx, table=tbl, backend=backend)
    dwts = _empty(dout, torch.float32) if dwts is None else dwts
    if not chain:
        return dx, dwgu, dwdn, dwts
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
        dhr, dhc, dhb = swiglu_backward(da, h, src, offs, qrow=need_dx, qcol=qcol,
                                        keep_bf16=keep, scale_blocks=sb, aligned_groups=True,
                                        table=tbl, backend=backend)
        del da
        # dgrad before wgrad: dx is small, and its temporaries (the N-axis weights, the sorted
        # dX rows, dh's rowwise copy) are freed before the (E, 2H, D) weight gradient exists
        if need_dx:
            dxs = grouped_mm_m(dhr, _weights_q(w_gate_up, "N", sb, backend, gu_n, gu_n_scale),
                               offs, out_dtype=BF16, backend=backend)
            dx = dispatch_backward(dxs, rows, backend=backend)
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
        _, _, dh = swiglu_backward(da, h, src, offs, qrow=False, qcol=False, keep_bf16=True,
                                   table=tbl, backend=backend)
        del da
        if need_dx:  # dgrad before wgrad, as above
            dxs = torch._grouped_mm(dh, w_gate_up, offs=offs)
            dx = dispatch_backward(dxs, rows, backend=backend)
            del dxs
        if need_dw:
            dwgu = torch._grouped_mm(dh.t(), sx.view(BF16), offs=offs)
            del dh
        if late:
            dwdn = torch._grouped_mm(dyb.t(), sa.view(BF16), offs=offs)
    return dx, dwgu, dwdn, dwts


@_routed_experts_bwd.register_fake
def _routed_experts_bwd_fake(dout, w_gate_up, w_down, weights, rows, src, offs, sx, sx_scale, h,
                             sa, sa_scale, y, precision, backend, wgrad, scale_blocks, need_dx,
                             need_dw, need_dweights, table=None, gu_n=None, gu_n_scale=None,
                             dn_n=None, dn_n_scale=None):
    t, k = rows.shape
    dx = dout.new_empty(t, dout.shape[1], dtype=BF16) if need_dx else _empty(dout, BF16)
    dwgu = w_gate_up.new_empty(w_gate_up.shape, dtype=BF16) if need_dw else _empty(dout, BF16)
    dwdn = w_down.new_empty(w_down.shape, dtype=BF16) if need_dw else _empty(dout, BF16)
    dwts = (dout.new_empty(t, k, dtype=torch.float32) if need_dweights
            else _empty(dout, torch.float32))
    return dx, dwgu, dwdn, dwts


N_SAVED = 12  # tensors `_setup_context` saves before the optional ones (N-axis weights, table)


def _setup_context(ctx, inputs, output) -> None:
    (_, w_gate_up, w_down, weights, rows, src, offs, precision, backend, wgrad, scale_blocks,
     _, *extra) = inputs
    padded: list = [*extra, *[None] * (9 - len(extra))]
    table, _, _, _, _, *weights_n = padded
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
    ctx.has_table = table is not None
    ctx.save_for_backward(w_gate_up, w_down, weights, rows, src, offs, sx, sxs, h, sa, sas, y,
                          *weights_n, *([table] if ctx.has_table else []))


def _backward(ctx, dout, *_unused):
    need_dx = ctx.needs_input_grad[0]
    need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    need_dwts = ctx.needs_input_grad[3]
    saved = ctx.saved_tensors
    weights_n = saved[N_SAVED:N_SAVED + ctx.n_weights_n]
    table = saved[-1] if ctx.has_table else None
    dx, dwgu, dwdn, dwts = torch.ops.moe_mxfp8.routed_experts_bwd(
        dout, *saved[:N_SAVED], *ctx.cfg, need_dx, need_dw, need_dwts, table, *weights_n)
    return (
        dx if need_dx else None,
        dwgu if ctx.needs_input_grad[1] else None,
        dwdn if ctx.needs_input_grad[2] else None,
        dwts if need_dwts else None,
        None, None, None, None, None, None, None, None,
        *[None] * ctx.n_extra,
    )


torch.library.register_autograd(
    "moe_mxfp8::routed_experts_fwd", _backward, setup_context=_setup_context
)


def routed_experts(
    x: Tensor, w_gate_up: Tensor, w_down: Tensor, weights: Tensor, rows: Tensor, src: Tensor,
    offs: Tensor, *, precision: str = "mxfp8", backend: str = "auto", wgrad: str = "mxfp8",
    scale_blocks: str = "1x32", weight_blocks: str | None = None,
    weights_q: tuple[MXFP8Tensor, MXFP8Tensor, MXFP8Tensor, MXFP8Tensor] | None = None,
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
    """
    check_choice("routed_experts", "precision", precision, PRECISIONS)
    check_choice("routed_experts", "wgrad", wgrad, WGRAD_MODES)
    scale_blocks = resolve_scale_blocks(scale_blocks, weight_blocks, "routed_experts")
    check_scale_blocks(scale_blocks, "routed_experts")  # a recipe ("auto" resolved by the caller)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != BF16:
            raise TypeError(f"routed_experts: {name} must be bfloat16, got {t.dtype}")
    check_layout("routed_experts", x, _numel(src), rows=rows, src=src, offs=offs,
                 pairs=_numel(rows))
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
    # the row kernels' block table, once for forward and backward (None: the references run)
    table = _step_table(x, offs, src.numel(), scale_blocks if precision == "mxfp8" else "1x32",
                        backend)
    out = torch.ops.moe_mxfp8.routed_experts_fwd(
        x, w_gate_up, w_down, weights.float(), rows, src, offs, precision, backend, wgrad,
        scale_blocks, save, table, *wq)[0]
    return out
