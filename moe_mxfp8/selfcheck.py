"""First-use self-check of a GEMM kernel against the pure-PyTorch reference.

Kernels that CI cannot run (the Blackwell grouped GEMMs are verified by compiling and reading
their SASS; no Blackwell GPU ran them) check themselves the first time they run on a device: a
few small grouped problems -- uneven groups, an empty group, partial tiles in every dimension --
go through the kernel and through `moe_mxfp8.reference.grouped_mm`. If they disagree the kernel
refuses to run (`KernelSelfCheckError`, telling the user to select ``backend="reference"``)
instead of returning wrong numbers. The verdict, good or bad, is cached per (kernel, device), so
the check costs one round of small GEMMs and one host sync per process and device.

Generic: `ensure_verified` takes the kernel callable ``fn(a, b, offs, out_dtype) -> Tensor``,
so the machinery is tested on CPU with a correct stand-in (the reference) and a wrong one.

The check synchronises with the host; it refuses to run inside CUDA-graph capture. Call the
op once eagerly (or `ensure_verified`) before capturing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference as R

MODES = ("m", "k")

# Normalised error bounds, against the fp32 reference on identical MXFP8 operands. The kernel
# differs only in fp32 summation order (relative ~1e-6 at these K) and the output rounding
# (bf16: 2^-9 relative). A wrong tile, scale or group boundary gives O(1) errors.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


class KernelSelfCheckError(RuntimeError):
    """A kernel gave wrong results on this device; it will not be used."""


@dataclass(frozen=True)
class CheckProblem:
    """One small grouped problem: ``sizes`` are the group sizes (tokens), ``n``/``k`` as in
    `kernels.grouped_gemm_common.GroupedProblem`."""

    sizes: tuple[int, ...]
    n: int
    k: int
    out_dtype: torch.dtype = torch.bfloat16


# Each covers an empty group, groups that end inside a 128-row (M) or 32-token block (K), N not
# a multiple of 128 and (M mode) K not a multiple of 128. The second M problem has groups of
# >= 256 rows on average, which the sm100 kernel runs with cta_group::2 tiles.
DEFAULT_PROBLEMS = {
    "m": (
        CheckProblem((130, 0, 37, 133), n=160, k=288, out_dtype=torch.bfloat16),
        CheckProblem((300, 0, 531), n=96, k=160, out_dtype=torch.float32),
    ),
    "k": (
        CheckProblem((100, 0, 33, 171), n=160, k=96, out_dtype=torch.bfloat16),
        CheckProblem((16, 129, 0, 207), n=128, k=160, out_dtype=torch.float32),
    ),
}

_verdicts: dict[tuple[str, str], str | None] = {}
_lock = threading.Lock()


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def make_operands(mode: str, prob: CheckProblem, device, seed: int = 0):
    """``(a, b, offs)`` MXFP8 operands of a problem, quantized by the reference quantizers."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sizes = torch.tensor(prob.sizes, dtype=torch.int64)
    offs = torch.cumsum(sizes, 0).to(torch.int32).to(device)
    m, e = int(sizes.sum()), len(prob.sizes)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    if mode == "m":
        a = R.quantize_rowwise_ref(rnd(m, prob.k), offs=offs)
        b = R.quantize_weights_ref(rnd(e, prob.n, prob.k), axis="K")
    elif mode == "k":
        a = R.quantize_colwise_ref(rnd(m, prob.n), offs=offs)  # (N, M)
        b = R.quantize_colwise_ref(rnd(m, prob.k), offs=offs)  # (K, M)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return a, b, offs


def _compare(mode: str, prob: CheckProblem, out, ref, offs) -> str | None:
    """None if ``out`` matches ``ref``, else a one-line description of the mismatch."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if out.shape != ref.shape or out.dtype != prob.out_dtype:
        return (f"returned {out.dtype} {tuple(out.shape)}, expected {prob.out_dtype} "
                f"{tuple(ref.shape)}")
    o, r = out.float().cpu(), ref.float().cpu()
    if not torch.isfinite(o).all():
        return "returned NaN/Inf for finite operands"
    if mode == "k":
        for g, size in enumerate(prob.sizes):
            if size == 0 and bool((o[g] != 0).any()):
                return f"empty group {g} is not all zeros"
    scale = r.abs().max().clamp_min(1e-30)
    max_err = float((o - r).abs().max() / scale)
    fro_err = float((o - r).norm() / r.norm().clamp_min(1e-30))
    tol = TOLERANCE[prob.out_dtype]
    if max_err > tol or fro_err > tol:
        return (f"max error {max_err:.3g} / relative Frobenius error {fro_err:.3g} of the "
                f"reference (tolerance {tol:g})")
    return None


def run_selfcheck(kernel: Callable, mode: str, device, problems=None) -> str | None:
    """Run ``kernel`` on the check problems of ``mode``; None if all match the reference.

    The output memory is poisoned first (a NaN block of the output's size is freed just before
    the call, so the caching allocator hands it to the kernel): elements the kernel forgets to
    write show up as NaN rather than as stale zeros.
    """
    problems = DEFAULT_PROBLEMS[mode] if problems is None else problems
    for i, prob in enumerate(problems):
        a, b, offs = make_operands(mode, prob, device, seed=i)
        ref = R.grouped_mm(a, b, offs, torch.float32)
        poison = torch.full(ref.shape, float("nan"), dtype=prob.out_dtype, device=device)
        del poison
        try:
            out = kernel(a, b, offs, prob.out_dtype)
        except Exception as err:  # a kernel that cannot run its own check is not usable
            return f"problem {i} {prob}: raised {type(err).__name__}: {err}"
        why = _compare(mode, prob, out, ref, offs)
        if why is not None:
            return f"problem {i} (group sizes {prob.sizes}, N={prob.n}, K={prob.k}): {why}"
    return None


def ensure_verified(name: str, kernel: Callable, device, mode: str | None = None,
                    problems=None) -> None:
    """Check ``kernel`` once per (``name``, device); raise `KernelSelfCheckError` if it is wrong.

    ``mode`` ("m": 2D x 3D M-grouped, "k": 2D x 2D K-grouped) defaults to the suffix of
    ``name`` (``"..._m"`` / ``"..._k"``). A failed verdict is cached too: later calls raise at
    once without running the kernel again.
    """
    key = (name, _device_key(device))
    if key not in _verdicts:
        if mode is None:
            mode = name.rsplit("_", 1)[-1]
        if mode not in MODES:
            raise ValueError(f"cannot tell the GEMM mode of {name!r}; pass mode='m' or 'k'")
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"moe_mxfp8: {name} checks itself on first use, which cannot happen during "
                "CUDA-graph capture; run the op once eagerly before capturing"
            )
        with _lock:
            if key not in _verdicts:
                _verdicts[key] = run_selfcheck(kernel, mode, device, problems)
    why = _verdicts[key]
    if why is not None:
        raise KernelSelfCheckError(
            f"moe_mxfp8: the {name} kernel gave wrong results in its first-use self-check on "
            f"{_device_name(device)} ({key[1]}): {why}. It will not be used on this device. "
            "Select backend='reference' (or set MOE_MXFP8_BACKEND=reference) to run the "
            "pure-PyTorch implementation, and please report this."
        )


def verdict(name: str, device) -> str | None | bool:
    """The cached verdict: None (passed), a mismatch description, or False (not checked)."""
    return _verdicts.get((name, _device_key(device)), False)


def reset(name: str | None = None) -> None:
    """Forget cached verdicts (all, or those of one kernel name). For tests."""
    with _lock:
        for key in [k for k in _verdicts if name is None or k[0] == name]:
            del _verdicts[key]
