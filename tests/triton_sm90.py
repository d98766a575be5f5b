"""Triton kernels on a machine without a GPU: compiled for sm_90 (Triton ships its own ptxas:
the CPU tests' check that a kernel builds for the device, and the PTX/cubin to inspect), and run
in Triton's interpreter (`run_interpreted`)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# a test run in Triton's interpreter: a CPU machine with Triton installed (on a GPU machine the
# compiled kernels' GPU tests cover the same checks)
interpreter_only = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="Triton interpreter run (CPU machine with Triton installed)")


def run_interpreted(code: str, seed: int) -> None:
    """Run ``code`` in a fresh Python under Triton's interpreter (it must be chosen before
    Triton's first import, which torch.compile in this process may already have made)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, (seed, res.stderr[-3000:])


def run_check_interpreted(check: str, gen: torch.Generator) -> None:
    """``check`` (``"module:function"``, called as ``function(generator, "cpu")``) in Triton's
    interpreter, its generator seeded from ``gen`` (the seed is in the failure message)."""
    module, function = check.split(":")
    seed = int(torch.randint(2**62, (1,), generator=gen))
    run_interpreted(f"import torch; from {module} import {function} as c; "
                    f"c(torch.Generator().manual_seed({seed}), 'cpu')", seed)


def assert_no_spills(kernel, tmp_path, what: str) -> None:
    """``kernel`` (`compile_for_sm90`'s) keeps everything in registers: no local-memory store
    in its SASS (nvdisasm; the test skips where it is not installed, so call it last)."""
    from tests.kernels.test_grouped_gemm_sm100 import _nvdisasm

    exe = _nvdisasm()
    if exe is None:
        pytest.skip("nvdisasm not available")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([exe, "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    assert "STL" not in sass, f"{what} spills to local memory"


def arg_types(fn) -> dict:
    """The Triton types of ``fn``'s arguments for a build without a launch: its module's
    ``ARG_TYPES``, then the kernel's own entries of ``KERNEL_ARG_TYPES`` (pointers named in
    neither are uint8, other scalars int32)."""
    module = sys.modules[fn.fn.__module__]
    own = getattr(module, "KERNEL_ARG_TYPES", {}).get(fn.fn.__name__, {})
    return {**module.ARG_TYPES, **own}


def check_sm90_builds(kernels, num_warps: int, tmp_path, label: str,
                      forbidden: tuple[str, ...] = ()) -> None:
    """Each ``(kernel, constexprs)`` of ``kernels`` compiles for sm_90 (`compile_for_sm90`), its
    PTX holds none of ``forbidden``, then none spills (`assert_no_spills`, last: it skips
    without nvdisasm)."""
    built = []
    for fn, constexprs in kernels:
        k = compile_for_sm90(fn, constexprs, num_warps)
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx
        for text in forbidden:
            assert text not in ptx, f"{fn.fn.__name__} ({label}): {text!r} in its PTX"
        built.append((fn, k))
    for fn, k in built:
        assert_no_spills(k, tmp_path, f"{fn.fn.__name__} ({label})")


def compile_for_sm90(fn, constexprs: dict, num_warps: int,
                     aligned_except: tuple[str, ...] | None = None, maxnreg: int | None = None):
    """``fn`` (a ``@triton.jit`` kernel) with ``constexprs``; every other argument has the type
    `arg_types` gives (its kernel module's table: ``*u8`` for other names ending in ``_ptr``,
    else int32).
    ``aligned_except``: specialize every runtime argument but these as 16-byte aligned /
    divisible by 16, as Triton does at a launch with such arguments (None: no specialization);
    ``maxnreg``: the launch's cap on registers per thread, if any.
    Returns the compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = arg_types(fn)
    sig = {a: "constexpr" if a in constexprs
           else types.get(a, "*u8" if a.endswith("_ptr") else "i32")
           for a in inspect.signature(fn.fn).parameters}
    attrs = None
    if aligned_except is not None:
        attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(sig.items())
                 if t != "constexpr" and a not in aligned_except}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
