"""moe_mxfp8: a Mixture-of-Experts layer that trains in MXFP8.

Public API: the layer `MXFP8MoE` with its configuration `MXFP8MoEConfig`, the quantizers
(`quantize_rowwise`, `quantize_colwise`, `quantize_dual`, `quantize_weights`), `MXFP8Tensor`,
the scale layouts (`moe_mxfp8.layout`), the reference (`moe_mxfp8.reference`), backend selection
(`moe_mxfp8.backend`) and checkpoints that record each layer's configuration
(`moe_mxfp8.checkpoint`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _register_source_kernels() -> None:
    """Make ``moe_mxfp8.kernels`` importable from a plain source checkout (PYTHONPATH only).

    Installed (``pip install`` / ``-e``), setuptools maps ``kernels/`` to ``moe_mxfp8.kernels``.
    In a bare checkout the directory sits beside this package; load it under that name. Nothing
    named ``kernels`` is ever put on ``sys.path``.
    """
    name = f"{__name__}.kernels"
    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name) is not None:
            return
    except (ImportError, ValueError):
        pass
    root = Path(__file__).resolve().parent.parent
    init = root / "kernels" / "__init__.py"
    if not (init.is_file() and (root / "pyproject.toml").is_file()):
        return
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module


_register_source_kernels()

from . import checkpoint, expert_parallel, layout, reference  # noqa: E402
from .autograd import grouped_mm  # noqa: E402
from .backend import resolve_backend  # noqa: E402
from .checks import NonFiniteInputError  # noqa: E402
from .config import MXFP8MoEConfig  # noqa: E402
from .experts import MXFP8GroupedExperts  # noqa: E402
from .moe import MXFP8MoE  # noqa: E402
from .mx_tensor import MXFP8Tensor  # noqa: E402
from .precompile import precompile  # noqa: E402
from .quantize import (  # noqa: E402
    quantize_colwise,
    quantize_dual,
    quantize_rowwise,
    quantize_weights,
    quantize_weights_dual,
)

__all__ = [
    "MXFP8GroupedExperts",
    "MXFP8MoE",
    "MXFP8MoEConfig",
    "MXFP8Tensor",
    "NonFiniteInputError",
    "checkpoint",
    "expert_parallel",
    "grouped_mm",
    "layout",
    "precompile",
    "quantize_colwise",
    "quantize_dual",
    "quantize_rowwise",
    "quantize_weights",
    "quantize_weights_dual",
    "reference",
    "resolve_backend",
]
__version__ = "0.1.0"
