"""Grouped MXFP8 GEMMs on quantized operands: argument checks, then reference or kernel.

* `grouped_mm_m` -- 2D x 3D, M-grouped (fprop, dgrad): ``a`` rowwise ``(M, K)`` with row groups,
  ``b`` expert weights ``(E, N, K)`` quantized along K -> ``(M, N)``. Weights with 128x128
  tiles (``b.block_rows == 128``) mark the 1x128 recipe (``a`` quantized 1x128 along K).
* `grouped_mm_k` -- 2D x 2D, K-grouped (wgrad): ``a`` ``(N, M)`` and ``b`` ``(K, M)`` quantized
  along M with per-group blocks -> ``(E, N, K)``.

Kernel entry points (``moe_mxfp8.kernels.lookup("grouped_mm_m" | "grouped_mm_k", backend)``)
take ``(a, b, offs, out_dtype)`` and must not synchronise with the host.
"""

from __future__ import annotations

import torch

from . import reference as R
from .backend import resolve_backend
from .mx_tensor import MXFP8Tensor

OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_grouped_operands(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """Checks every grouped GEMM (reference or kernel) applies to its operands."""
    if not isinstance(a, MXFP8Tensor) or not isinstance(b, MXFP8Tensor):
        raise TypeError("a and b must be MXFP8Tensor (use moe_mxfp8.quantize_*)")
    if a.scale_layout != "packed" or b.scale_layout != "packed":
        raise ValueError("grouped GEMM operands need packed scales (scale_layout='packed')")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        what = f"{offs.dtype} {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else offs
        raise TypeError(f"offs must be a 1D int32 tensor of cumulative group ends, got {what}")
    if offs.numel() == 0:
        raise ValueError("offs must hold at least one group")
    devs = {a.data.device, b.data.device, offs.device, a.scale.device, b.scale.device}
    if len(devs) != 1:
        raise ValueError(f"a, b and offs must share one device, got {sorted(map(str, devs))}")


def grouped_mm_m(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, backend: str | None = "auto",
) -> torch.Tensor:
    """M-grouped ``out[rows of g] = a[rows of g] @ b[g].T``: ``(M, K) x (E, N, K) -> (M, N)``."""
    check_grouped_operands(a, b, offs, out_dtype)
    if a.data.dim() != 2 or b.data.dim() != 3 or b.group_axis != "experts":
        raise ValueError("grouped_mm_m needs a 2D rowwise `a` and 3D expert weights `b`")
    if a.group_axis not in (None, "rows"):
        raise ValueError("grouped_mm_m: `a` must be quantized rowwise (blocks along K)")
    if a.data.shape[1] != b.data.shape[2]:
        raise ValueError(f"K mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if offs.numel() != b.data.shape[0]:
        raise ValueError(f"offs has {offs.numel()} groups but b has {b.data.shape[0]} experts")
    be = resolve_backend(backend, a.device)
    if be == "reference":
        return R.grouped_mm(a, b, offs, out_dtype)
    from .kernels import lookup

    return lookup("grouped_mm_m", be)(a, b, offs, out_dtype)


def grouped_mm_k(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, backend: str | None = "auto",
    groups_aligned: bool = False, scale_blocks: str = "1x32",
) -> torch.Tensor:
    """K-grouped ``out[g] = a[:, g] @ b[:, g].T``: ``(N, M) x (K, M) -> (E, N, K)``.

    ``scale_blocks="1x128"``: both operands come from the 1x128 quantizers (one scale per 128
    tokens of a group, replicated over its 32-blocks); the Hopper kernel then promotes once per
    k-tile (and turns operands that are not 1x128 into NaN outputs, never into wrong numbers).
    The result is the same GEMM of the same MXFP8 tensors on every backend.

    ``groups_aligned``: the caller guarantees that every group starts on a multiple of 16
    tokens and ``M % 16 == 0`` (as `MXFP8MoE` arranges); the kernels then skip re-laying the
    fp8 data out to such starts (a gather of both operands, ~6% of the GEMM at dsv3).
    """
    check_grouped_operands(a, b, offs, out_dtype)
    if scale_blocks not in R.SCALE_BLOCKS:
        raise ValueError(f"scale_blocks must be one of {R.SCALE_BLOCKS}, got {scale_blocks!r}")
    if a.group_axis != "k" or b.group_axis != "k":
        raise ValueError("grouped_mm_k needs operands quantized along M per group (offs=...)")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"M mismatch: a {tuple(a.shape)} vs b {tuple(b.shape)}")
    be = resolve_backend(backend, a.device)
    if be == "reference":
        return R.grouped_mm(a, b, offs, out_dtype)
    from .kernels import lookup

    kw = {}
    if be == "sm90" and R.ACT_BLOCK[scale_blocks] != R.ACT_BLOCK["1x32"]:
        kw["scale_blocks"] = scale_blocks  # Blackwell reads 1x128 operands as the MXFP8 they are
    return lookup("grouped_mm_k", be)(a, b, offs, out_dtype, groups_aligned=groups_aligned, **kw)
