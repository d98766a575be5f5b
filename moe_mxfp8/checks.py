"""Argument validation shared by the reference, the kernels' entry points and the autograd layer.

Every error names the argument and says what was expected, so a user sees *which* tensor is wrong.
"""

from __future__ import annotations

import torch

# the one offs check, and whether a tensor's values can be read without a device sync
from .kernels.grouped_gemm.problem import check_offs, values_on_host  # noqa: F401
from .kernels.mx_format import KERNEL_INPUT_ALIGN, MAX_EXTENT  # noqa: F401  (the domain's edges)

FLOAT_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
COMPUTE_DTYPE = torch.bfloat16  # expert GEMM inputs, outputs and gradients (MXFP8 inside GEMMs)
ROUNDING_MODES = ("rceil", "floor")
SCALE_LAYOUTS = ("packed", "dense")


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the SIMT kernels read it (16-byte vector loads): contiguous from a 16-byte
    aligned address, a copy if not."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % KERNEL_INPUT_ALIGN:
        x = x.clone()  # a fresh allocation is aligned (the caching allocator gives 512 bytes)
    return x


def check_float_input(name: str, x: torch.Tensor, ndim: int | tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in ndims:
        want = " or ".join(f"{d}D" for d in ndims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")


def check_multiple_of(name: str, value: int, multiple: int, what: str) -> None:
    if value % multiple != 0:
        raise ValueError(f"{name}: {what} must be a multiple of {multiple}, got {value}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    dev0 = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev0:
            raise ValueError(
                f"{k} is on {v.device} but {items[0][0]} is on {dev0}; "
                "all tensors must share a device"
            )


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")


def check_scale_layout(scale_layout: str) -> None:
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")


def check_extents(name: str, x: torch.Tensor, rows: int | None = None) -> None:
    """Every dimension (and ``rows``, e.g. the E*N rows of expert weights) below 2^31."""
    for what, v in [*((f"dim {i}", d) for i, d in enumerate(x.shape)), ("E*N rows", rows)]:
        if v is not None and v > MAX_EXTENT:
            raise ValueError(
                f"{name}: {what} is {v}, above the largest supported extent 2^31 - 1 "
                f"(shape {tuple(x.shape)})"
            )


def check_not_differentiable(fn: str, name: str, x: torch.Tensor) -> None:
    """Quantizers are not differentiable: refuse an input that would record autograd history.

    The FP8 bytes would otherwise carry a straight-through ``grad_fn`` on one backend and none on
    another. Inside autograd Functions and custom ops grad mode is off, so this never fires there.
    """
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{fn}: {name} requires grad, but MXFP8 quantization is not differentiable; pass "
            f"{name}.detach() or run under torch.no_grad() (for training, use "
            "moe_mxfp8.grouped_mm / MXFP8MoE, whose backward is defined)"
        )


class NonFiniteInputError(ValueError):
    """NaN or Inf where a finite value is required: `MXFP8MoE` with ``check_finite="raise"``
    raises it (one type on every backend, in eager mode and under ``torch.compile``)."""
