"""Grouped MXFP8 GEMMs on quantized operands: one operand check, then the reference or a kernel.

* `grouped_mm_m` -- 2D x 3D, M-grouped (fprop, dgrad): ``a`` rowwise ``(M, K)`` with row groups,
  ``b`` expert weights ``(E, N, K)`` quantized along K -> ``(M, N)``. Weights with 128x128
  tiles (``b.block_rows == 128``) mark the 1x128 recipe (``a`` quantized 1x128 along K).
* `grouped_mm_k` -- 2D x 2D, K-grouped (wgrad): ``a`` ``(N, M)`` and ``b`` ``(K, M)`` quantized
  along M with per-group blocks -> ``(E, N, K)``.

Operands are checked once, by `kernels.grouped_gemm.problem` (every backend accepts the same
domain); the kernels run through `kernels.grouped_gemm.launcher` with the arch's host class,
imported here explicitly (the launcher imports CuTeDSL only to compile). Kernels that no GPU
of this project has run check themselves against the reference on first use (`selfcheck`).
Nothing here synchronises with the host.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from . import reference
from .backend import resolve_backend
from .kernels.grouped_gemm import problem
from .mx_tensor import MXFP8Tensor


@functools.cache
def _host_class(backend: str):
    """The grouped GEMM host class of a kernel backend (no CuTeDSL import: the launcher
    imports the kernel class only where it compiles one); looked up once per backend."""
    if backend == "sm90":
        from .kernels.grouped_gemm.sm90_config import GroupedGemmSm90Host

        return GroupedGemmSm90Host
    from .kernels.grouped_gemm.sm100_config import GroupedGemmSm100Host

    return GroupedGemmSm100Host


def _check_types(a, b) -> None:
    if not isinstance(a, MXFP8Tensor) or not isinstance(b, MXFP8Tensor):
        raise TypeError("a and b must be MXFP8Tensor (use moe_mxfp8.quantize_*)")


_LEAVE_SMS: ContextVar[int] = ContextVar("moe_mxfp8_leave_sms", default=0)


@contextlib.contextmanager
def leave_sms(n: int) -> Iterator[None]:
    """Kernel GEMMs launched inside leave ``n`` SMs free: their persistent grids (one CTA per
    SM, the register file full) would otherwise hold every SM until they end, so that a
    collective issued just before them (an all-to-all's NCCL kernel) could not run beside them.
    The results do not change (each output tile is computed whole by one CTA)."""
    token = _LEAVE_SMS.set(n)
    try:
        yield
    finally:
        _LEAVE_SMS.reset(token)


def run_kernel(backend: str, prob: problem.GroupedProblem, a: MXFP8Tensor, b: MXFP8Tensor,
               offs: torch.Tensor, **launch) -> torch.Tensor:
    """Launch the ``backend`` kernel on the described problem; ``launch``: the launcher's
    keyword arguments (`kernels.grouped_gemm.launcher.run`; ``leave_sms`` defaults to the
    enclosing `leave_sms`). The first use of each compiled configuration of a kernel that asks
    for it is checked against the reference."""
    from . import selfcheck
    from .kernels.grouped_gemm import launcher

    launch.setdefault("leave_sms", _LEAVE_SMS.get())
    return launcher.run(_host_class(backend), prob, a, b, offs,
                        first_use=selfcheck.verify_on_first_use, **launch)


def grouped_mm_m(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, backend: str | None = "auto",
) -> torch.Tensor:
    """M-grouped ``out[rows of g] = a[rows of g] @ b[g].T``: ``(M, K) x (E, N, K) -> (M, N)``."""
    _check_types(a, b)
    prob = problem.describe_m(a, b, offs, out_dtype)
    be = resolve_backend(backend, a.device)
    if be == "reference":
        return reference.grouped_mm(a, b, offs, out_dtype)
    return run_kernel(be, prob, a, b, offs)


def grouped_mm_k(
    a: MXFP8Tensor, b: MXFP8Tensor, offs: torch.Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, backend: str | None = "auto",
    aligned_groups: bool = False, scale_blocks: str = "1x32",
) -> torch.Tensor:
    """K-grouped ``out[g] = a[:, g] @ b[:, g].T``: ``(N, M) x (K, M) -> (E, N, K)``.

    ``scale_blocks="1x128"``: both operands come from the 1x128 quantizers (one scale per 128
    tokens of a group, replicated over its 32-blocks); the Hopper kernel then promotes once per
    k-tile (and turns operands that are not 1x128 into NaN outputs, never into wrong numbers).
    The result is the same GEMM of the same MXFP8 tensors on every backend.

    ``aligned_groups``: the caller guarantees that every group starts on a multiple of 16
    tokens and ``M % 16 == 0`` (as `MXFP8MoE` arranges); the kernels then skip re-laying the
    fp8 data out to such starts (a gather of both operands).
    """
    _check_types(a, b)
    prob = problem.describe_k(a, b, offs, out_dtype, scale_blocks)
    be = resolve_backend(backend, a.device)
    if be == "reference":
        return reference.grouped_mm(a, b, offs, out_dtype)
    return run_kernel(be, prob, a, b, offs, aligned_groups=aligned_groups)
