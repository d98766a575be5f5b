"""CuTeDSL kernels of moe_mxfp8, installed as ``moe_mxfp8.kernels``.

Importing this package is cheap: CuTeDSL (``cutlass``) is imported only by the kernel modules,
which `lookup` loads on first use. ``KERNEL_OPS`` is the one arch table: for each backend
(``"sm90"``, ``"sm100"``) and op name, the module and function that implement it.
"""

from __future__ import annotations

import importlib

# op name -> backend -> "module:function" (module relative to this package).
KERNEL_OPS: dict[str, dict[str, str]] = {}


def lookup(op: str, backend: str):
    """The callable implementing ``op`` on ``backend``; a clear error if there is none."""
    try:
        target = KERNEL_OPS[op][backend]
    except KeyError:
        have = sorted(b for b in KERNEL_OPS.get(op, {}))
        raise NotImplementedError(
            f"moe_mxfp8: no {backend} kernel for {op!r} (kernels exist for: {have or 'none'}); "
            "use backend='reference'"
        ) from None
    mod_name, fn_name = target.split(":")
    mod = importlib.import_module(f"{__name__}.{mod_name}")
    return getattr(mod, fn_name)

# Hopper grouped MXFP8 GEMMs (issue 7).
KERNEL_OPS.setdefault("grouped_mm_m", {})["sm90"] = "grouped_gemm_sm90:grouped_mm_m"
KERNEL_OPS.setdefault("grouped_mm_k", {})["sm90"] = "grouped_gemm_sm90:grouped_mm_k"

# Blackwell grouped MXFP8 GEMMs (issue 8): compiled and SASS-checked, first use self-checked.
KERNEL_OPS.setdefault("grouped_mm_m", {})["sm100"] = "grouped_gemm_sm100:grouped_mm_m"
KERNEL_OPS.setdefault("grouped_mm_k", {})["sm100"] = "grouped_gemm_sm100:grouped_mm_k"

# MXFP8 quantizers (kernels/quantize.py): one SIMT source for both archs.
for _op in ("quantize_rowwise", "quantize_colwise", "quantize_dual", "quantize_weights"):
    KERNEL_OPS[_op] = {"sm90": f"quantize:{_op}", "sm100": f"quantize:{_op}"}
del _op
