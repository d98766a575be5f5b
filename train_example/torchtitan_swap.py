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

torchtitan 0.3 (``torchtitan/models/common/moe.py``) names the parameters ``w1_EFD``, ``w2_EDF``,
``w3_EFD`` (under ``moe.routed_experts.inner_experts``) and gives ``GroupedExperts`` a
``_grouped_mm(A=, B_t=, offs=)`` method meant to be overridden by low-precision variants. There
`swap_grouped_experts` replaces that method on each instance with the MXFP8 grouped GEMM
(`moe_mxfp8.grouped_mm`): module, parameters, state dict keys and sharding plans all stay
torchtitan's own, so checkpoints interchange unchanged (tests/test_torchtitan.py runs torchtitan's
MoE with it on the CPU). Call it on the model before ``parallelize``.

This file only needs PyTorch and moe_mxfp8; torchtitan is recognised by duck typing (a module
with 3-D parameters ``w1``, ``w2``, ``w3`` of the shapes above, or 0.3's ``w1_EFD``, ``w2_EDF``,
``w3_EFD`` and ``_grouped_mm``), so it runs without torchtitan.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from moe_mxfp8 import grouped_mm
from moe_mxfp8.experts import MXFP8GroupedExperts

TITAN_SEAM_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")  # torchtitan >= 0.3's GroupedExperts


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


def has_grouped_mm_seam(module: nn.Module) -> bool:
    """torchtitan >= 0.3's ``GroupedExperts``: ``w1_EFD``, ``w2_EDF``, ``w3_EFD`` and an
    overridable ``_grouped_mm`` (not yet replaced)."""
    return (all(isinstance(getattr(module, n, None), nn.Parameter) for n in TITAN_SEAM_PARAMS)
            and callable(getattr(type(module), "_grouped_mm", None))
            and "_grouped_mm" not in vars(module))


def _mxfp8_grouped_mm(*, A, B_t, offs, **options):  # noqa: N803 (torchtitan's argument names)
    return grouped_mm(A.to(torch.bfloat16), B_t.to(torch.bfloat16), offs.to(torch.int32),
                      **options)


def swap_grouped_experts(model: nn.Module, **options) -> int:
    """Run every torchtitan ``GroupedExperts`` of ``model`` in MXFP8; returns how many.

    torchtitan >= 0.3: each one's ``_grouped_mm`` becomes `moe_mxfp8.grouped_mm` with
    ``options`` (``backend``, ``wgrad``, ``scale_blocks``, ``aligned_groups``, ...). Earlier
    torchtitan: each module is replaced by an `MXFP8GroupedExperts` (``options`` go to it:
    ``precision`` too) that takes over its parameters.
    """
    seams = [m for m in model.modules() if has_grouped_mm_seam(m)]
    for module in seams:
        module._grouped_mm = functools.partial(_mxfp8_grouped_mm, **options)
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
    return len(seams) + len(targets)


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
