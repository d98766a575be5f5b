"""Backend selection: ``"reference"`` (pure PyTorch), ``"sm90"`` (Hopper kernels), ``"sm100"``
(Blackwell kernels), or ``"auto"``.

``auto`` picks the kernels of the GPU the tensors live on, and the reference elsewhere, warning
once that it fell back. Asking for a kernel backend that cannot run is an error, never a silent
fallback. The ``MOE_MXFP8_BACKEND`` environment variable replaces ``"auto"`` (an explicit
non-auto argument wins over it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

BACKENDS = ("auto", "reference", "sm90", "sm100")
KERNEL_BACKENDS = ("sm90", "sm100")
ENV_VAR = "MOE_MXFP8_BACKEND"

# Compute capability major -> kernel backend. One table; the kernels' own arch table
# (moe_mxfp8.kernels.KERNEL_CLASSES) maps a backend to its kernel classes.
ARCH_BY_MAJOR = {9: "sm90", 10: "sm100"}

_warned: set[str] = set()


@functools.cache
def cutedsl_available() -> bool:
    """Whether CuTeDSL is installed, asked once per process: ``find_spec`` walks ``sys.path``
    while ``cutlass`` is not imported (a launch from the compile cache never imports it), 0.15
    ms a call, measured, and ``backend="auto"`` asks at every quantizer and GEMM call."""
    return importlib.util.find_spec("cutlass") is not None


def kernel_backend_for(device: torch.device) -> str | None:
    """The kernel backend for a device, or None (CPU, or a GPU without MXFP8 kernels)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return ARCH_BY_MAJOR.get(major)


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def check_backend_name(backend, who: str, *, env: bool = True) -> None:
    """Fail early (e.g. in a constructor) on a backend name `resolve_backend` would refuse later;
    with ``env``, also on a bad ``MOE_MXFP8_BACKEND`` that ``"auto"`` would read."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
    value = os.environ.get(ENV_VAR)
    if env and backend == "auto" and value and value not in BACKENDS:
        raise ValueError(f"{who}: {ENV_VAR}={value!r} is not one of {BACKENDS}")


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return the concrete backend (``"reference"``, ``"sm90"`` or ``"sm100"``) for ``device``."""
    if backend is None or backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={backend!r} is not one of {BACKENDS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    arch = kernel_backend_for(device)
    if backend == "auto":
        if arch is not None and cutedsl_available():
            return arch
        if device.type != "cuda":
            why = f"tensors on {device.type}"
        elif arch is None:
            cap = torch.cuda.get_device_capability(device)
            why = f"no MXFP8 kernels for compute capability {cap[0]}.{cap[1]}"
        else:
            why = "nvidia-cutlass-dsl is not importable"
        _warn_once(f"moe_mxfp8: {why}; falling back to the pure-PyTorch 'reference' backend")
        return "reference"
    if device.type != "cuda":
        raise RuntimeError(f"backend={backend!r} needs CUDA tensors, got tensors on {device}")
    if arch != backend:
        cap = torch.cuda.get_device_capability(device)
        raise RuntimeError(
            f"backend={backend!r} cannot run on a GPU of compute capability {cap[0]}.{cap[1]} "
            f"(sm90 needs 9.x, sm100 needs 10.x); use backend='auto' or 'reference'"
        )
    if not cutedsl_available():
        raise RuntimeError(
            f"backend={backend!r} needs nvidia-cutlass-dsl (pip install nvidia-cutlass-dsl)"
        )
    return backend
