"""`MXFP8Tensor`: FP8 E4M3 data plus E8M0 scales, always quantized along the last dimension."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import layout as L
from .kernels.mx_format import E8M0_NAN

GROUP_AXES = (None, "rows", "k", "experts")
FP8 = torch.float8_e4m3fn  # the element dtype of every MXFP8 tensor


def e8m0_to_float32(b: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> float32 ``2^(b-127)``; 0xFF -> NaN. Exact (built from the bits)."""
    bi = b.to(torch.int32)
    # b = 0 is 2^-127, an fp32 subnormal (bits 0x00400000), exact as a fill value; a fill,
    # not a tensor built from a Python int, which would be a host->device copy (a host sync).
    normal = (bi << 23).view(torch.float32)
    val = torch.where(bi == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(bi == E8M0_NAN, torch.full_like(val, float("nan")), val)


@dataclass
class MXFP8Tensor:
    """An MXFP8 matrix (or a stack of expert matrices).

    Attributes:
        data: ``(R, K)`` or ``(E, R, K)`` ``torch.float8_e4m3fn``; blocks of 32 run along the last
            dim (the reduced axis of the GEMM that consumes it). A columnwise quantization of
            ``x (M, K)`` stores ``x.T`` here, shape ``(K, M)``.
        scale: uint8 E8M0 bytes. ``scale_layout == "dense"``: ``(R, C)`` (or ``(E, R, C)``) with
            ``C = ceil(K/32)``, or ``(R, sum_g ceil(m_g/32))`` for K-groups. ``"packed"``: a flat
            buffer in the tcgen05 layout (see `moe_mxfp8.layout`).
        scale_layout: ``"packed"`` or ``"dense"``.
        offs: int32 cumulative group ends, or None.
        group_axis: None; ``"rows"`` (offs splits dim 0; each group's scale rows start on a
            128-row tile); ``"k"`` (offs splits the last dim; blocks restart per group); or
            ``"experts"`` (3D data, one packed matrix per expert).
        block_rows: rows sharing each block's scale (replicated over them): 1 for blocks of one
            row; 32 / 128 for weights in 32x32 / 128x128 tiles; 128 for a 1x128 columnwise copy
            in 128 x 128 tiles (the weight gradient's activation operand, docs/numerics.md).
    """

    data: torch.Tensor
    scale: torch.Tensor
    scale_layout: str = "packed"
    offs: torch.Tensor | None = None
    group_axis: str | None = None
    block_rows: int = 1

    def __post_init__(self) -> None:
        if self.data.dtype != FP8:
            raise TypeError(f"MXFP8Tensor.data must be float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype != torch.uint8:
            raise TypeError(f"MXFP8Tensor.scale must be uint8 E8M0 bytes, got {self.scale.dtype}")
        if self.group_axis not in GROUP_AXES:
            raise ValueError(f"group_axis must be one of {GROUP_AXES}, got {self.group_axis!r}")
        if (self.group_axis in ("rows", "k")) != (self.offs is not None):
            raise ValueError("offs is required exactly for group_axis 'rows' and 'k'")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def num_blocks(self) -> int:
        """Blocks per row along the last dim, ``ceil(K/32)`` (per whole row for K-groups: dense)."""
        return L.ceil_div(self.data.shape[-1], L.BLOCK_SIZE)

    def dense_scales(self) -> torch.Tensor:
        """The scales as dense uint8: ``(R, C)`` / ``(E, R, C)`` / ``(R, sum_g ceil(m_g/32))``."""
        if self.scale_layout == "dense":
            return self.scale
        if self.group_axis == "experts":
            e, rows, _ = self.data.shape
            return L.unpack_scales_experts(self.scale, e, rows, self.num_blocks)
        rows = self.data.shape[0]
        if self.group_axis == "rows":
            return L.unpack_scales_grouped_rows(self.scale, self.offs, rows, self.num_blocks)
        if self.group_axis == "k":
            return L.unpack_scales_grouped_k(self.scale, self.offs, rows)
        return L.unpack_scales(self.scale, rows, self.num_blocks)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``float(q) * 2^(b - 127)`` in ``dtype``, same shape as ``data``.

        A NaN scale (0xFF) makes its block NaN. Computed in float32, then cast.
        """
        scales = e8m0_to_float32(self.dense_scales())
        if self.group_axis == "k":
            _, block_id, _ = L.grouped_k_block_index(self.offs, self.data.shape[-1])
            per_elem = scales[:, block_id]
        else:
            per_elem = scales.repeat_interleave(L.BLOCK_SIZE, dim=-1)[..., : self.data.shape[-1]]
        return (self.data.to(torch.float32) * per_elem).to(dtype)
