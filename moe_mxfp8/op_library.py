"""The ``moe_mxfp8`` operator namespace: `define_op` registers a Python function as a torch
operator (``torch.ops.moe_mxfp8.<name>``), like ``torch.library.custom_op`` but through the
lower-level ``torch.library.Library``.

Why not ``custom_op``: its backend wrapper imports ``torch._dynamo`` on the op's first call
(``torch._compile._disable_dynamo``), a noticeable part of a new process's first step
(docs/design/compile_cache.md). An op defined here has the
same schema (inferred from the annotations by ``torch.library.infer_schema``), the same fake
registration (``register_fake``) and is traced by ``torch.compile(fullgraph=True)`` the same
way; its first call imports nothing.

`OpDef.register_autograd` is ``torch.library.register_autograd`` (the same ``backward`` and
``setup_context`` contract, the same Autograd-key kernel: an ``autograd.Function`` that
redispatches below autograd) less its per-call cost: torch's kernel gives ``setup_context`` the
arguments the dispatcher dropped (trailing ones equal to their default) by walking the schema,
and every ``schema.arguments`` read builds the whole argument list again -- quadratic in the
arguments, about 0.25 ms a call for the routed-expert op's 21. Here the defaults are read once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

NAMESPACE = "moe_mxfp8"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # alive as long as the module


class OpDef:
    """What `define_op` returns: the operator (callable) and a ``register_fake`` decorator."""

    def __init__(self, qualname: str):
        self.qualname = qualname
        ns, name = qualname.split("::")
        self._op = getattr(getattr(torch.ops, ns), name)

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as
        ``torch.library.register_autograd`` takes them (positional arguments only)."""
        op = self._op.default
        args = op._schema.arguments
        if any(a.kwarg_only for a in args):
            raise ValueError(f"{self.qualname}: register_autograd takes positional arguments only")
        _LIB.impl(self.qualname.split("::")[1], _autograd_kernel(op, args, backward, setup_context),
                  "Autograd", with_keyset=True)


def _autograd_kernel(op, schema_args, backward: Callable, setup_context: Callable) -> Callable:
    """The Autograd-key kernel of ``op`` (see the module doc)."""
    defaults = tuple(a.default_value for a in schema_args)
    below_autograd = torch._C._after_autograd_keyset

    def run(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    class Function(torch.autograd.Function):
        # inputs: the op's arguments, then the dispatch keyset (no gradient)
        @staticmethod
        def forward(ctx, *args_keyset):
            *args, keyset = args_keyset
            output = run(keyset, args)
            setup_context(ctx=ctx, inputs=(*args, *defaults[len(args):]), output=output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[:-1]  # as backward sees the op: no keyset
            try:
                result = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = needs
            return (*result, None) if isinstance(result, tuple) else (result, None)

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Function.apply(*args, keyset)
        return run(keyset, args)

    Function.__name__ = Function.__qualname__ = f"{op._opname}_autograd"
    return kernel


def define_op(qualname: str, *, mutates_args: tuple = ()) -> Callable[[Callable], OpDef]:
    """Decorator: ``@define_op("moe_mxfp8::name")`` over a type-annotated function."""
    ns, name = qualname.split("::")
    if ns != NAMESPACE:
        raise ValueError(f"operators live in the {NAMESPACE!r} namespace, got {qualname!r}")

    def wrap(fn: Callable) -> OpDef:
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))

        @functools.wraps(fn)
        def impl(*args, **kwargs):
            # the op's gradient is its registered autograd formula, never autograd through its
            # body: run it without recording (as custom_op's implementations run)
            with torch.no_grad():
                return fn(*args, **kwargs)

        _LIB.impl(name, impl, "CompositeExplicitAutograd")
        return OpDef(qualname)

    return wrap
