"""`precompile`: compile (or load from the kernel cache) every kernel a model's `MXFP8MoE`
layers use, before training starts.

Each distinct layer configuration runs one forward and backward on random tokens through the
same code path as training, on detached copies of its parameters (no gradients, ``aux_loss`` or
random state of the model change). Token counts are symbolic in the compiled kernels, so one
small batch compiles what every batch size uses -- except the Blackwell GEMM, whose tile shape
switches once the routed rows reach 256 per expert: pass the token counts you train with.

Compiled kernels go to the persistent kernel cache (`moe_mxfp8.kernels.compile_cache`:
``$MOE_MXFP8_CACHE_DIR``, default ``~/.cache/moe_mxfp8``; ``MOE_MXFP8_DISABLE_CACHE=1`` turns
it off), so a later process loads them in milliseconds instead of compiling them again.

A later process's first step still pays one-time costs that are not kernels
(docs/design/compile_cache.md): CuTeDSL's import, Triton's per-process cache key and first launches,
cuBLAS set-up (the layer's operators do not import ``torch._dynamo``, `moe_mxfp8.op_library`).
The warm-up pass here pays them as well, so the first training step after `precompile` runs at
full speed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .backend import resolve_backend
from .moe import MXFP8MoE

DEFAULT_TOKENS = 256  # small: any count compiles the same kernels (token counts are symbolic)


def _layers(model_or_shapes, device) -> list[MXFP8MoE]:
    """The MXFP8 layers to warm: those inside a module, or new ones built from shape dicts."""
    items = model_or_shapes
    if isinstance(items, (nn.Module, Mapping)):
        items = [items]
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes)):
        raise TypeError(
            "precompile: expected an nn.Module, a dict of MXFP8MoE arguments, or a list of "
            f"them, got {type(model_or_shapes).__name__}"
        )
    layers = []
    for item in items:
        if isinstance(item, nn.Module):
            layers += [m for m in item.modules()
                       if isinstance(m, MXFP8MoE) and m.precision == "mxfp8"]
        elif isinstance(item, Mapping):
            kw = dict(item)
            default = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: nothing to compile
            kw.setdefault("device", device if device is not None else default)
            layers.append(MXFP8MoE(**kw))
        else:
            raise TypeError(
                f"precompile: list items must be nn.Module or dict, got {type(item).__name__}"
            )
    if not layers:
        raise ValueError("precompile: no MXFP8MoE layer with precision='mxfp8' found")
    return layers



def _token_counts(tokens) -> tuple[int, ...]:
    counts = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    for t in counts:
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ValueError(f"precompile: token counts must be positive ints, got {t!r}")
    if not counts:
        raise ValueError("precompile: give at least one token count")
    return counts


def warm_layer(layer: MXFP8MoE, tokens: int) -> None:
    """One forward+backward of ``layer`` on ``tokens`` random tokens (input gradient included),
    leaving the layer as it was: parameters are detached copies (their ``.grad`` stays
    untouched), ``aux_loss`` and ``tokens_per_expert`` are restored, the random state is
    forked."""
    dev = layer.w_gate_up.device
    params = {n: p.detach().requires_grad_(p.is_floating_point())
              for n, p in layer.named_parameters()}
    saved = (layer.aux_loss, layer.tokens_per_expert)
    fork = [dev] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork), torch.enable_grad():
            # x needs a gradient, as inside a model: otherwise backward skips the first dgrad
            x = torch.randn(tokens, layer.dim, device=dev, dtype=layer.w_gate_up.dtype,
                            requires_grad=True)
            out = torch.func.functional_call(layer, params, (x,))
            out.backward(torch.randn_like(out))
    finally:
        layer.aux_loss, layer.tokens_per_expert = saved


class _Progress:
    """The one-line progress message: rewritten in place on a terminal, else one line at the
    start and one at the end."""

    def __init__(self, stream, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.n = 0
        self.shown = False

    def hook(self, what, name, key, seconds=None) -> None:
        if what != "start" or not self.enabled:
            return
        self.n += 1
        if self.tty:
            desc = f"{name} {key!r}"[:100]
            self.stream.write(f"\r\x1b[Kmoe_mxfp8.precompile: kernel {self.n}: {desc}")
            self.stream.flush()
            self.shown = True
        elif not self.shown:
            self.stream.write("moe_mxfp8.precompile: compiling/loading kernels ...\n")
            self.stream.flush()
            self.shown = True

    def done(self, summary: dict) -> None:
        if not self.enabled:
            return
        line = (f"moe_mxfp8.precompile: {summary['kernels']} kernels ready in "
                f"{summary['seconds']:.1f} s ({summary['compiled']} compiled, "
                f"{summary['loaded']} loaded from the cache)")
        self.stream.write(("\r\x1b[K" if self.tty else "") + line + "\n")
        self.stream.flush()


def precompile(model_or_shapes, tokens: int | Iterable[int] = DEFAULT_TOKENS, *,
               device: torch.device | str | None = None, progress: bool = True,
               stream=None) -> dict:
    """Compile every kernel the `MXFP8MoE` layers of ``model_or_shapes`` use.

    Args:
        model_or_shapes: an ``nn.Module`` (every ``MXFP8MoE`` inside it with
            ``precision="mxfp8"``), a dict of ``MXFP8MoE`` arguments (a temporary layer is built
            on ``device``, default ``"cuda"`` where a GPU exists, else ``"cpu"``), or a list.
        tokens: token count(s) of the warm-up batch. One is enough on Hopper; on Blackwell pass
            those you train with (the GEMM tile shape depends on rows per expert).
        progress: print a one-line progress message (to ``stream``, default stderr).

    Returns a summary dict: ``kernels`` (obtained in this call), ``compiled``, ``loaded`` (from
    the persistent cache), ``seconds``, ``cache_dir`` (None when the cache is off), ``backends``.
    Layers on the ``reference`` backend (CPU, no kernels) need nothing and are skipped.
    """
    counts = _token_counts(tokens)
    layers = _layers(model_or_shapes, device)
    seen, todo, backends = set(), [], set()
    for layer in layers:
        backend = resolve_backend(layer.backend, layer.w_gate_up.device)
        backends.add(backend)
        # the layer's whole configuration (its repr): layers that print alike compile alike
        sig = (backend, str(layer.w_gate_up.device), layer.extra_repr())
        if backend != "reference" and sig not in seen:
            seen.add(sig)
            todo.append(layer)
    summary: dict[str, Any] = {"kernels": 0, "compiled": 0, "loaded": 0, "seconds": 0.0,
                               "cache_dir": None, "backends": sorted(backends)}
    if not todo:
        return summary

    from .kernels import compile_cache

    if compile_cache.enabled():
        summary["cache_dir"] = str(compile_cache.cache_dir())
    show = _Progress(stream if stream is not None else sys.stderr, progress)
    before = {(n, k) for n, k, _, _ in compile_cache.compile_events()}
    prev = compile_cache.set_progress_hook(show.hook)
    t0 = time.perf_counter()
    try:
        for layer in todo:
            for t in counts:
                warm_layer(layer, t)
        for dev in {layer.w_gate_up.device for layer in todo}:  # each layer's GPU, not GPU 0
            torch.cuda.synchronize(dev)
    finally:
        compile_cache.set_progress_hook(prev)
    summary["seconds"] = time.perf_counter() - t0
    for name, key, how, _ in compile_cache.compile_events():
        if (name, key) not in before:
            summary["kernels"] += 1
            summary[how] += 1
    show.done(summary)
    return summary


__all__ = ["precompile", "warm_layer", "DEFAULT_TOKENS"]
