"""The ``moe_mxfp8`` operator namespace: `define_op` registers a Python function as a torch
operator (``torch.ops.moe_mxfp8.<name>``), like ``torch.library.custom_op`` but through the
lower-level ``torch.library.Library``.

Why not ``custom_op``: its backend wrapper imports ``torch._dynamo`` on the op's first call
(``torch._compile._disable_dynamo``), 0.9 s of a new process's first step on an H100/H200 host
(docs/NOTES.md, "What a second process's first step is made of"). An op defined here has the
same schema (inferred from the annotations by ``torch.library.infer_schema``), the same fake
and autograd registration (``register_fake``, ``torch.library.register_autograd``) and is
traced by ``torch.compile(fullgraph=True)`` the same way; its first call imports nothing.
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
