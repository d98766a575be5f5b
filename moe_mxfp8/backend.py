"""Backend selection: ``"reference"`` (pure PyTorch), ``"sm90"`` (Hopper kernels), ``"sm100"``
(Blackwell kernels), or ``"auto"``.

``auto`` picks the kernels of the GPU the tensors live on, and the reference elsewhere, warning
once that it fell back. Asking for a kernel backend that cannot run is an error, never a silent
fallback. The ``MOE_MXFP8_BACKEND`` environment variable replaces ``"auto"`` (an explicit
non-auto argument wins over it).

The scale-block recipe has an ``"auto"`` too (`auto_scale_blocks`): the fastest recipe that
trains like BF16 on the device's kind of GPU, the exact ``"1x32"`` wherever no other is known to
be better.
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

AUTO = "auto"  # scale_blocks="auto": the recipe chosen per kind of device (`auto_scale_blocks`)
# The recipe of scale_blocks="auto" on Hopper, chosen by the loss-parity protocol
# (`python -m train_example.parity --seeds N`) and speed: "1x128" where the protocol supports it,
# else the exact "1x32". H100, GPU preset: 3 seeds x 250 steps (2026-11-26) 1x32 PASS (+0.45 %),
# 1x128 FAIL (-1.68 %, below BF16's loss, outside the 1 % band); 4 seeds x 1000 steps, the
# preset's length (2026-11-27): 1x128 PASS (-0.69 %); the same protocol after the wgrad's
# activation operand went to 128 x 128 tiles (2026-11-27): FAIL, -1.22 % (below BF16, 95 %
# interval -9.6 .. +7.3 %: no bias resolved), while on this model's trained activations the
# expert gradients with tiles and with per-feature scales differ by ~0.1 % and have the same
# SQNR to 0.01 dB -- kept. So "1x128": 1.03-1.52x the BF16 twin's layer speed where 1x32 runs
# 0.54-0.65x (benchmarks/RESULTS.md). Its one GPU fault found on the way (a store race in the
# Hopper wgrad at 64 output rows or fewer: model widths of 64) is fixed and tested
# (`GroupedGemmSm90.store_boxes`).
HOPPER_AUTO_SCALE_BLOCKS = "1x128"
# Kernel backend -> the recipe "auto" means there. Blackwell's tensor cores take 1x32 scales
# natively, so the exact recipe costs nothing there; everything else (CPU, other GPUs) runs the
# exact recipe too.
AUTO_SCALE_BLOCKS_BY_ARCH = {"sm90": HOPPER_AUTO_SCALE_BLOCKS, "sm100": "1x32"}
EXACT_SCALE_BLOCKS = "1x32"


@functools.cache
def cutedsl_available() -> bool:
    """Whether CuTeDSL is installed, asked once per process: ``find_spec`` walks ``sys.path``
    while ``cutlass`` is not imported (a launch from the compile cache never imports it), 0.15
    ms a call, measured, and ``backend="auto"`` asks at every quantizer and GEMM call."""
    return importlib.util.find_spec("cutlass") is not None


def kernel_backend_for(device: torch.device) -> str | None:
    """The kernel backend for a device, or None (CPU, or a GPU without MXFP8 kernels)."""
    cap = device_capability(device)
    return None if cap is None else ARCH_BY_MAJOR.get(cap[0])


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``, None for any other device (one place, so
    tests can stand in for a GPU). Asked once per GPU index: `resolve_backend` asks at every
    quantizer and GEMM call (about ten a step), and torch's query is a properties lookup each
    time; a test that stands in for a GPU starts from an empty cache (tests/conftest.py)."""
    if device.type != "cuda":
        return None
    if device.index is None:  # "cuda": whichever device is current, asked anew
        return _ask_capability(None)
    return _capability_of_index(device.index)


def _ask_capability(index: int | None) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(index) if torch.cuda.is_available() else None


_capability_of_index = functools.cache(_ask_capability)


def device_kind(device: torch.device | str) -> str:
    """``"cpu"``, ``"cuda sm_90"``, ...: what `auto_scale_blocks` depends on."""
    device = torch.device(device)
    cap = device_capability(device)
    return device.type if cap is None else f"{device.type} sm_{cap[0]}{cap[1]}"


def auto_scale_blocks(device: torch.device | str) -> str:
    """The recipe ``scale_blocks="auto"`` resolves to on ``device``: `HOPPER_AUTO_SCALE_BLOCKS`
    on sm_90, the exact ``"1x32"`` on sm_100, on CPUs and on every other GPU."""
    cap = device_capability(torch.device(device))
    arch = None if cap is None else ARCH_BY_MAJOR.get(cap[0])
    return AUTO_SCALE_BLOCKS_BY_ARCH.get(arch, EXACT_SCALE_BLOCKS)


class AutoScaleBlocks:
    """``scale_blocks="auto"`` of one layer: resolved once per kind of device (`device_kind`,
    at the layer's first forward there); a forward that resolves to another recipe than the
    layer's previous one (the layer moved to another kind of GPU) warns once. Forwards traced
    by ``torch.compile`` resolve it without recording (no guard on this object's state)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.ran: tuple[str, str] | None = None  # (device kind, recipe) of the last forward

    def peek(self, device: torch.device) -> tuple[str, str]:
        """``(recipe, device kind)`` on ``device``, recording nothing."""
        kind = device_kind(device)
        if torch.compiler.is_compiling():
            # A traced forward neither reads nor records ``ran``: a guard on it would fail
            # once the first forward recorded it and recompile the model a second time (6 s
            # of the GPU training preset's second step, H100, 2026-11-27). The recipe is a
            # function of the device kind, which the compiled code is specialised on anyway.
            return auto_scale_blocks(device), kind
        if self.ran is not None and self.ran[0] == kind:
            return self.ran[1], kind
        return auto_scale_blocks(device), kind

    def for_forward(self, device: torch.device) -> str:
        """The recipe of a forward on ``device`` (recorded; warns if it changed)."""
        recipe, kind = self.peek(device)
        if torch.compiler.is_compiling():  # see `peek`: eager forwards record and warn
            return recipe
        if self.ran is not None and self.ran[0] != kind:
            if self.ran[1] != recipe:
                warnings.warn(f"{self.who}: scale_blocks='auto' now resolves to {recipe!r} on "
                              f"{kind} (was {self.ran[1]!r} on {self.ran[0]})", RuntimeWarning,
                              stacklevel=3)
        self.ran = (kind, recipe)
        return recipe


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def check_backend_name(backend, who: str, *, env: bool = True) -> None:
    """Fail early (e.g. in a constructor) on a backend name `resolve_backend` would refuse later.
    With ``env`` (the backend will be used), also on a bad ``MOE_MXFP8_BACKEND`` that ``"auto"``
    would read, and on a kernel backend on a machine without CUDA (one line, not a traceback
    from the first forward). Only the machine is checked: the layer may be built on the CPU and
    moved to a GPU later."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{who}: backend must be one of {BACKENDS}, got {backend!r}")
    if not env:
        return
    value = os.environ.get(ENV_VAR)
    if backend == "auto" and value and value not in BACKENDS:
        raise ValueError(f"{who}: {ENV_VAR}={value!r} is not one of {BACKENDS}")
    chosen = value if backend == "auto" and value else backend
    if chosen in KERNEL_BACKENDS and not torch.cuda.is_available():
        where = f"{ENV_VAR}={chosen!r}" if chosen != backend else f"backend={chosen!r}"
        raise RuntimeError(f"{who}: {where} needs a CUDA GPU, but torch sees none; use "
                           "backend='auto' or 'reference'")


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
            why = ("nvidia-cutlass-dsl is not importable (pip install 'moe_mxfp8[gpu]', or "
                   "'moe_mxfp8[gpu-cu13]' for a CUDA 13 torch)")
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
            f"backend={backend!r} needs nvidia-cutlass-dsl (pip install 'moe_mxfp8[gpu]')"
        )
    return backend
