"""Expert weights quantized once per optimizer step: `MXFP8MoE(cache_weights=True)`.

Every forward of the layer quantizes ``w_gate_up`` and ``w_down`` along K (fprop operands) and
every backward along N (dgrad operands): two reads of the BF16 weights per forward + backward,
and ``2 N`` of them for ``N`` micro-batches of gradient accumulation or a recomputed forward.
With the cache, the first forward after a weight change quantizes both axes of both weights
in one read each (`moe_mxfp8.quantize.quantize_weights_dual`) and every later forward and
backward reuses them while the parameters are unchanged.

An entry is valid while its parameter is the same tensor with the same contents, as far as
the host can tell without reading it: the same address, device, dtype and shape, the same
version counter (``param._version``: an in-place update of the parameter, ``load_state_dict``
and ``copy_`` under ``torch.no_grad()`` bump it) and the same count of optimizer steps. The
last one is needed because not every in-place update bumps the version: a fused optimizer
(``torch.optim.Adam(fused=True)``, measured on torch 2.13) and any write through ``param.data``
leave it unchanged. Every ``torch.optim.Optimizer`` step (a global step post-hook) drops every
entry, so the cache also holds no memory through the optimizer's own step.

What the host cannot see: a write through ``param.data`` (``p.data.copy_``, ``p.data -= ...``)
outside an optimizer step. After such a write call `MXFP8MoE.invalidate_weight_cache`; writing
the parameter itself under ``torch.no_grad()`` needs nothing.

Memory: one FP8 byte per parameter and axis (two per expert parameter) plus the scales
(1/32 of that), held from the first forward after a change until the next optimizer step;
`WeightCache.nbytes` reports it (`MXFP8MoE.weight_cache_bytes`).

Graphs: inside ``torch.compile`` and while a CUDA graph is being captured the cache is not
consulted (`usable`); the weights are quantized inside the graph as without it, so a replay
never reads FP8 weights of an older step.
"""

from __future__ import annotations

import weakref

import torch

from .kernels.mx_format import WEIGHT_BLOCK_ROWS
from .mx_tensor import MXFP8Tensor
from .quantize import quantize_weights_dual

_CACHES: weakref.WeakSet = weakref.WeakSet()  # every live cache, emptied at optimizer steps
_STEPS = [0]  # optimizer steps taken in this process (any torch.optim.Optimizer)
_HOOK: list = []


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _STEPS[0] += 1
    for cache in list(_CACHES):
        cache.clear()


def _install_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


def usable(like: torch.Tensor) -> bool:
    """Whether a forward on ``like``'s device may read or fill the cache: not while
    ``torch.compile`` traces (a hit would be baked into the graph) nor while a CUDA graph is
    being captured (its replays would read this step's FP8 weights in every later step)."""
    if torch.compiler.is_compiling():
        return False
    return not (like.is_cuda and torch.cuda.is_current_stream_capturing())


class WeightCache:
    """The quantized weights of one layer: per parameter name, the key it was made under and
    ``(along K, along N)`` `MXFP8Tensor` s. ``quantizations`` counts the quantizer runs."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, tuple[MXFP8Tensor, MXFP8Tensor]]] = {}
        self.quantizations = 0
        _CACHES.add(self)
        _install_hook()

    @staticmethod
    def _key(param: torch.Tensor, scale_blocks: str, backend: str) -> tuple:
        return (param.data_ptr(), param.device, param.dtype, tuple(param.shape),
                param._version, _STEPS[0], scale_blocks, backend)

    def get(self, name: str, param: torch.Tensor, scale_blocks: str,
            backend: str) -> tuple[MXFP8Tensor, MXFP8Tensor]:
        """``param``'s weights quantized along K and along N with the weight tiles of
        ``scale_blocks``: the cached pair, or a new one (made from ``param`` cast to BF16, the
        bytes the layer's uncached path quantizes)."""
        key = self._key(param, scale_blocks, backend)
        entry = self._entries.get(name)
        if entry is not None and entry[0] == key:
            return entry[1]
        self._entries.pop(name, None)  # free the stale copy before making the new one
        with torch.no_grad():
            w = param.detach().to(torch.bfloat16).contiguous()
            pair = quantize_weights_dual(w, block_rows=WEIGHT_BLOCK_ROWS[scale_blocks],
                                         backend=backend)
        self.quantizations += 1
        self._entries[name] = (key, pair)
        return pair

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        """Bytes held: FP8 data and scales of every entry."""
        return sum(t.data.nbytes + t.scale.nbytes
                   for _, pair in self._entries.values() for t in pair)

    def __len__(self) -> int:
        return len(self._entries)
