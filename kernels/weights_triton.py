"""Triton kernel of the tiled expert weights' change of axis (`moe_mxfp8.quantize.weights_along_n`):
the per-expert transpose of E4M3 bytes ``(E, N, K) -> (E, K, N)``.

Each program moves one ``TILE x TILE`` byte tile: loaded along K (coalesced), transposed in
registers and shared memory (`tl.trans`), stored along N (coalesced). A transposing copy through
PyTorch's elementwise kernel reads one byte per thread across rows. Reference:
``data.transpose(-2, -1).contiguous()``, byte for byte (the GPU test checks it). Optional GPU
dependency (``triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_device

TILE = 64  # bytes on each side of a program's tile
# Triton types of the kernel's arguments for a build without a launch: both pointers are FP8
# bytes (uint8), the sizes int32
ARG_TYPES: dict[str, str] = {}


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, N, K, T: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    n = tl.program_id(0) * T + tl.arange(0, T)
    k = tl.program_id(1) * T + tl.arange(0, T)
    base = e * N * K
    tile = tl.load(src_ptr + base + n.to(tl.int64)[:, None] * K + k[None, :],
                   mask=(n[:, None] < N) & (k[None, :] < K))
    tl.store(dst_ptr + base + k.to(tl.int64)[:, None] * N + n[None, :], tl.trans(tile),
             mask=(k[:, None] < K) & (n[None, :] < N))


def transpose_experts(data: torch.Tensor) -> torch.Tensor:
    """``data (E, N, K)`` uint8, contiguous -> ``(E, K, N)`` uint8: each expert's matrix
    transposed."""
    e, n, k = data.shape
    out = torch.empty((e, k, n), dtype=data.dtype, device=data.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n, TILE), triton.cdiv(k, TILE), e)
    with on_device(data.device):
        _transpose_kernel[grid](data, out, n, k, T=TILE, num_warps=4)
    return out
