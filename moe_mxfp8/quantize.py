"""Public MXFP8 quantizers: argument checks, then the reference or a kernel per ``backend``.

All return `MXFP8Tensor`. Kernels write packed scales directly; ``scale_layout="dense"`` on a
kernel backend unpacks them afterwards (an inspection path, not a hot one).
"""

from __future__ import annotations

import torch

from . import checks as C
from . import layout as L
from . import reference as R
from .backend import resolve_backend
from .mx_tensor import MXFP8Tensor


def _check_common(name: str, x: torch.Tensor, ndim, rounding: str, scale_layout: str, offs):
    C.check_float_input(name, x, ndim)
    C.check_rounding(rounding)
    C.check_scale_layout(scale_layout)
    if offs is not None:
        C.check_offs(offs, x.shape[0], sync=False)  # type and shape
        C.check_same_device(**{name: x, "offs": offs})
        # Values of offs are checked on the host only when they live there (no GPU sync).
        if offs.device.type == "cpu":
            C.check_offs(offs, x.shape[0])


def _kernel(op: str, backend: str):
    from .kernels import lookup  # noqa: PLC0415  (CuTeDSL is imported only when a kernel runs)

    return lookup(op, backend)


def _to_dense(t: MXFP8Tensor) -> MXFP8Tensor:
    return MXFP8Tensor(t.data, t.dense_scales(), "dense", t.offs, t.group_axis, t.block_rows)


def quantize_rowwise(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto",
) -> MXFP8Tensor:
    """``x (M, K)`` bf16/fp16/fp32 -> MXFP8 ``(M, K)`` with blocks of 32 along K (K % 32 == 0).

    ``offs`` (int32 ``(G,)`` cumulative ends along M): each group's scale rows start on a
    128-row tile of the packed layout; the data is not padded.
    """
    _check_common("x", x, 2, rounding, scale_layout, offs)
    C.check_multiple_of("x", x.shape[1], L.BLOCK_SIZE, "the last dim (K)")
    be = resolve_backend(backend, x.device)
    if be == "reference":
        return R.quantize_rowwise_ref(x, rounding, scale_layout, offs)
    C.check_contiguous("x", x)
    out = _kernel("quantize_rowwise", be)(x, rounding=rounding, offs=offs)
    return out if scale_layout == "packed" else _to_dense(out)


def quantize_colwise(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto",
) -> MXFP8Tensor:
    """``x (M, K)`` -> MXFP8 of ``x.T``: data ``(K, M)`` contiguous, blocks of 32 along M (any M).

    ``offs`` (groups along M): blocks restart at each group start; a group's last block is
    virtually zero-padded; scales packed per group (the 2D x 2D grouped convention).
    """
    _check_common("x", x, 2, rounding, scale_layout, offs)
    be = resolve_backend(backend, x.device)
    if be == "reference":
        return R.quantize_colwise_ref(x, rounding, scale_layout, offs)
    C.check_contiguous("x", x)
    out = _kernel("quantize_colwise", be)(x, rounding=rounding, offs=offs)
    return out if scale_layout == "packed" else _to_dense(out)


def quantize_dual(
    x: torch.Tensor, *, rounding: str = "rceil", scale_layout: str = "packed",
    offs: torch.Tensor | None = None, backend: str | None = "auto",
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both orientations of ``x (M, K)`` from one read: (rowwise ``(M, K)``, colwise ``(K, M)``)."""
    _check_common("x", x, 2, rounding, scale_layout, offs)
    C.check_multiple_of("x", x.shape[1], L.BLOCK_SIZE, "the last dim (K)")
    be = resolve_backend(backend, x.device)
    if be == "reference":
        return R.quantize_dual_ref(x, rounding, scale_layout, offs)
    C.check_contiguous("x", x)
    row, col = _kernel("quantize_dual", be)(x, rounding=rounding, offs=offs)
    if scale_layout == "dense":
        return _to_dense(row), _to_dense(col)
    return row, col


WEIGHT_AXES = ("K", "N")


def quantize_weights(
    w: torch.Tensor, *, axis: str = "K", rounding: str = "rceil", scale_layout: str = "packed",
    block_rows: int = 1, backend: str | None = "auto",
) -> MXFP8Tensor:
    """Expert weights ``w (E, N, K)`` -> MXFP8, each expert its own packed scale matrix.

    ``axis="K"``: data ``(E, N, K)``, blocks along K (fprop operand). ``axis="N"``: data
    ``(E, K, N)``, blocks along N (dgrad operand). ``block_rows=32``: one scale per 32x32 tile
    (both orientations then share values), an option; the default is 1x32 blocks.
    """
    C.check_float_input("w", w, 3)
    C.check_rounding(rounding)
    C.check_scale_layout(scale_layout)
    if axis not in WEIGHT_AXES:
        raise ValueError(f"axis must be 'K' (fprop) or 'N' (dgrad), got {axis!r}")
    if block_rows not in (1, 32):
        raise ValueError(f"block_rows must be 1 (1x32 blocks) or 32 (32x32), got {block_rows}")
    C.check_multiple_of("w", w.shape[-1 if axis == "K" else -2], L.BLOCK_SIZE, f"axis {axis}")
    if block_rows == 32:
        C.check_multiple_of("w", w.shape[-2 if axis == "K" else -1], 32, "the other axis (32x32)")
    be = resolve_backend(backend, w.device)
    if be == "reference":
        return R.quantize_weights_ref(w, axis, rounding, scale_layout, block_rows)
    C.check_contiguous("w", w)
    out = _kernel("quantize_weights", be)(w, axis=axis, rounding=rounding, block_rows=block_rows)
    return out if scale_layout == "packed" else _to_dense(out)
