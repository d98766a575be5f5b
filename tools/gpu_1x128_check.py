"""Run the 1x128 GPU tests of tests/kernels/test_grouped_gemm_sm90.py without pytest.

For a device call whose carry budget has no room for pytest: the test functions are imported
with a no-op stand-in for the ``pytest`` decorators and called with every parameter
combination their ``parametrize`` marks list (kept in sync by hand below). Prints one line per
case and exits 1 if any case fails. ``python tools/gpu_1x128_check.py``
"""

from __future__ import annotations

import importlib
import sys
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _stub_pytest() -> None:
    """A ``pytest`` module whose marks are no-op decorators (the tests are called directly)."""
    if "pytest" in sys.modules:
        return

    def mark_factory(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used bare: @pytest.mark.gpu
        return lambda f: f  # used with arguments: @pytest.mark.parametrize(...)

    class Mark:
        def __getattr__(self, name):
            return mark_factory

    stub = types.ModuleType("pytest")
    stub.mark = Mark()
    stub.fixture = mark_factory
    sys.modules["pytest"] = stub


GROUPINGS_M = ["E1", "E8_edge", "E8_unbal", "E128"]
GROUPINGS_K = ["E1", "E8_edge", "E8_unbal", "E8_a16", "E128"]


def cases(T):
    for g in GROUPINGS_M:
        for op, dt in (("fprop", torch.bfloat16), ("fprop", torch.float32),
                       ("dgrad", torch.bfloat16)):
            yield f"m_grouped[{op}-{dt}-{g}]", T.test_1x128_m_grouped_matches_reference, (g, op, dt)
    for g in GROUPINGS_K:
        for dt in (torch.bfloat16, torch.float32):
            yield f"wgrad[{dt}-{g}]", T.test_1x128_wgrad_matches_reference, (g, dt)
    yield "1x32 operands -> NaN", T.test_1x128_kernel_turns_1x32_operands_into_nan, ()
    for op in ("m", "k"):
        yield f"cluster+persistent[{op}]", T.test_1x128_cluster_and_persistent_loop, (op,)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    _stub_pytest()
    T = importlib.import_module("tests.kernels.test_grouped_gemm_sm90")
    failed = 0
    n = 0
    for name, fn, args in cases(T):
        n += 1
        try:
            fn(*args)
            print(f"PASS {name}", flush=True)
        except Exception:  # noqa: BLE001
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()[-1500:]}", flush=True)
    print(f"gpu_1x128_check: {n - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
