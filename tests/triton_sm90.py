"""Compile a Triton kernel for sm_90 on a machine without a GPU (Triton ships its own ptxas):
the CPU tests' check that a kernel builds for the device, and the PTX/cubin to inspect."""

from __future__ import annotations

import inspect


def compile_for_sm90(fn, constexprs: dict, pointer_types: dict, num_warps: int,
                     aligned_except: tuple[str, ...] | None = None, maxnreg: int | None = None):
    """``fn`` (a ``@triton.jit`` kernel) with ``constexprs``; every other argument is a pointer
    of ``pointer_types[name]`` (default ``*u8`` for names ending in ``_ptr``) or an int32.
    ``aligned_except``: specialize every runtime argument but these as 16-byte aligned /
    divisible by 16, as Triton does at a launch with such arguments (None: no specialization);
    ``maxnreg``: the launch's cap on registers per thread, if any.
    Returns the compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in constexprs
           else pointer_types.get(a, "*u8" if a.endswith("_ptr") else "i32")
           for a in inspect.signature(fn.fn).parameters}
    attrs = None
    if aligned_except is not None:
        attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(sig.items())
                 if t != "constexpr" and a not in aligned_except}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
