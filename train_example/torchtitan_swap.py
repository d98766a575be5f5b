"""Swap torchtitan's ``GroupedExperts`` for `moe_mxfp8.experts.MXFP8GroupedExperts`.

torchtitan (``torchtitan/models/moe/moe.py``) builds each MoE layer as ``router``, ``reorderer``,
``experts`` (a ``GroupedExperts`` with ``w1 (E, H, D)``, ``w2 (E, D, H)``, ``w3 (E, H, D)``) and
optional ``shared_experts`` (a ``FeedForward``). Its MoE routes and permutes the tokens and, with
expert parallelism, dispatches them itself; the experts module only sees
``experts(x, num_tokens_per_expert)``. Replacing that one module runs the routed experts' GEMMs
in MXFP8 and leaves everything else -- router, shared experts, EP dispatch, FSDP -- as it is::

    from train_example.torchtitan_swap import swap_grouped_experts
    model = build_model(...)                     # a torchtitan model, before parallelize
    n = swap_grouped_experts(model, backend="auto")
    # ... then torchtitan's parallelize_fn / optimizer as usual; checkpoints load unchanged.

The new module takes over the old module's ``Parameter`` objects (same names, shapes, dtype,
device, DTensor placements), so nothing is copied and a torchtitan checkpoint keeps loading. Swap
before the optimizer is built (parameters are reused, so after works too). torchtitan pads each
expert's token group to ``TOKEN_GROUP_ALIGN_SIZE_M``; when that is a multiple of 16 pass
``aligned_groups=True`` (the MXFP8 wgrad then skips its re-layout).

`mxfp8moe_state_dict` converts one torchtitan MoE layer's state dict into `moe_mxfp8.MXFP8MoE`'s
(the layer that also dispatches MXFP8 tokens itself, ``ep_group=...``).

This file only needs PyTorch and moe_mxfp8; torchtitan is recognised by duck typing (a module
with 3-D parameters ``w1``, ``w2``, ``w3`` of the shapes above), so it runs without torchtitan.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_mxfp8.experts import MXFP8GroupedExperts


def is_grouped_experts(module: nn.Module) -> bool:
    """torchtitan's ``GroupedExperts`` shape: parameters ``w1 (E, H, D)``, ``w2 (E, D, H)``,
    ``w3 (E, H, D)`` (an `MXFP8GroupedExperts` itself is not swapped again)."""
    if isinstance(module, MXFP8GroupedExperts):
        return False
    ws = [getattr(module, n, None) for n in ("w1", "w2", "w3")]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in ws):
        return False
    (e, h, d), w2, w3 = ws[0].shape, ws[1], ws[2]
    return tuple(w2.shape) == (e, d, h) and tuple(w3.shape) == (e, h, d)


def swap_grouped_experts(model: nn.Module, **options) -> int:
    """Replace every torchtitan ``GroupedExperts`` in ``model`` in place; returns how many.

    ``options`` go to `MXFP8GroupedExperts` (``precision``, ``backend``, ``wgrad``,
    ``scale_blocks``, ``aligned_groups``, ...).
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if is_grouped_experts(child)
    ]
    for parent, name, old in targets:
        e, h, d = old.w1.shape
        new = MXFP8GroupedExperts(d, h, e, getattr(old, "use_grouped_mm", True),
                                  device="meta", **options)
        for n in ("w1", "w2", "w3"):
            setattr(new, n, getattr(old, n))  # the same Parameter objects: nothing copied
        new.train(old.training)
        setattr(parent, name, new)
    return len(targets)


def mxfp8moe_state_dict(moe_sd: dict, prefix: str = "") -> dict:
    """One torchtitan ``MoE`` layer's state dict -> `MXFP8MoE`'s (keys under ``prefix``).

    ``router.gate.weight`` -> ``router.weight``; ``experts.w1``/``w3`` -> ``w_gate_up``
    (gate rows first); ``experts.w2`` -> ``w_down``; ``shared_experts.w1/w3/w2.weight`` ->
    ``shared_w_gate_up`` / ``shared_w_down``. torchtitan's ``expert_bias`` (aux-loss-free
    balancing) has no counterpart and is refused rather than dropped silently when non-zero.
    """
    g = {k[len(prefix):]: v for k, v in moe_sd.items() if k.startswith(prefix)}
    bias = g.get("expert_bias")
    if bias is not None and torch.count_nonzero(bias):
        raise ValueError("mxfp8moe_state_dict: a non-zero expert_bias has no MXFP8MoE counterpart")
    out = {
        "router.weight": g["router.gate.weight"],
        "w_gate_up": torch.cat([g["experts.w1"], g["experts.w3"]], dim=1),
        "w_down": g["experts.w2"],
    }
    if "shared_experts.w1.weight" in g:
        out["shared_w_gate_up"] = torch.cat(
            [g["shared_experts.w1.weight"], g["shared_experts.w3.weight"]], dim=0
        )
        out["shared_w_down"] = g["shared_experts.w2.weight"]
    return out
