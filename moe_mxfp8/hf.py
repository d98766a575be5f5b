"""Run the routed experts of a Hugging Face transformers MoE model in MXFP8, in place.

transformers >= 5.0 stores each MoE layer's routed experts as one module (``Qwen3MoeExperts``,
``MixtralExperts``, ...) with two 3-D parameters and is called by its sparse MoE block with the
router's choices::

    gate_up_proj  (E, 2I, D)   [gate; up] rows      h = act(x gate^T) * (x up^T)
    down_proj     (E, D, I)                         out = sum_k weight_k * (h down^T)
    experts(hidden_states (T, D), top_k_index (T, k), top_k_weights (T, k)) -> (T, D)

`swap_experts` gives every such module a forward that sorts the token copies by expert and runs
both projections as MXFP8 grouped GEMMs (`moe_mxfp8.grouped_mm`); the router (the model's own
gate, softmax, top-k and normalisation), the activation (the module's ``_apply_gate`` /
``act_fn``) and the weighting by ``top_k_weights`` stay the model's, so only the expert GEMMs
change precision. The module keeps its parameters (the same objects: nothing is copied, an
optimizer built before keeps working), so the state dict has the same keys and shapes and a
transformers checkpoint loads either way. As FSDP2's ``fully_shard`` does, the swap changes the
module's class to a subclass of its own (``MXFP8Qwen3MoeExperts``): ``isinstance`` checks in
transformers (weight init, loading) still hold, and ``print(model)`` shows which layers run in
MXFP8. Call it after ``from_pretrained`` and before building the optimizer.

transformers is recognised by duck typing (the parameters above and the layout flags that
transformers' ``use_experts_implementation`` sets), so this module does not import it. Layouts
the MXFP8 path does not compute -- expert biases, transposed or interleaved ``gate_up_proj``, a
post-expert norm, ungated experts, transformers' expert parallelism -- are refused with an
error rather than computed differently. transformers < 5.0 keeps a ``ModuleList`` of per-expert
MLPs with the routing inside the MoE block's forward; that layout is refused too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .autograd import grouped_mm
from .config import check_mxfp8_dims

COMPUTE_DTYPE = torch.bfloat16
# transformers' use_experts_implementation flags and the value the MXFP8 path computes
SUPPORTED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False,
                    "is_concatenated": True, "has_post_expert_norm": False,
                    "_is_expert_parallel": False}
OPTION_NAMES = ("backend", "wgrad", "save_colwise", "scale_blocks")
_SUBCLASSES: dict[type, type] = {}


def is_hf_experts(module: nn.Module) -> bool:
    """transformers' fused experts: 3-D ``gate_up_proj (E, 2I, D)`` and ``down_proj (E, D, I)``
    parameters (a module already swapped counts too)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter)
            and gu.dim() == 3 and down.dim() == 3):
        return False
    e, two_i, d = gu.shape
    return two_i % 2 == 0 and tuple(down.shape) == (e, d, two_i // 2)


def is_swapped(module: nn.Module) -> bool:
    return type(module) in _SUBCLASSES.values()


def _check_swappable(name: str, module: Any) -> None:  # a transformers experts module
    for flag, want in SUPPORTED_LAYOUT.items():
        got = getattr(module, flag, want)
        if got != want:
            raise ValueError(f"swap_experts: {name} ({type(module).__name__}): {flag}={got}, "
                             f"but the MXFP8 experts compute only {flag}={want}")
    _, two_i, d = module.gate_up_proj.shape
    check_mxfp8_dims("mxfp8", d, two_i // 2, f"swap_experts: {name}",
                     " (hidden_size and the experts' intermediate size)")


def _check_options(options: dict) -> None:
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"swap_experts: unknown option(s) {unknown}; expected some of "
                        f"{list(OPTION_NAMES)}")


def mxfp8_experts_forward(module: Any, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call, ``(T, D), (T, k), (T, k) -> (T, D)``, with MXFP8 GEMMs."""
    num_tokens, top_k = top_k_index.shape
    num_experts = module.gate_up_proj.shape[0]
    expert_ids = top_k_index.reshape(-1)
    # the T*k token copies sorted by expert; group g's rows end at offs[g] (no host sync)
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    x = hidden_states[perm // top_k].to(COMPUTE_DTYPE)

    def mm(a, w):  # w (E, N, K) -> a (M, K) @ w[g]^T per group
        return grouped_mm(a.to(COMPUTE_DTYPE), w.to(COMPUTE_DTYPE).transpose(-2, -1), offs,
                          **module.mxfp8_options)

    h = module._apply_gate(mm(x, module.gate_up_proj))  # the model's own activation
    y = mm(h, module.down_proj).to(hidden_states.dtype)
    y = y * top_k_weights.reshape(-1)[perm, None].to(y.dtype)
    out = torch.empty_like(y).index_copy(0, perm, y)  # back to (token, slot) order
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default gating ([gate; up] rows), for experts classes without one."""
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def _mxfp8_subclass(cls: type) -> type:
    """``cls`` with the MXFP8 forward, one subclass per experts class."""
    if cls not in _SUBCLASSES:
        attrs = {"forward": mxfp8_experts_forward,
                 "extra_repr": lambda self: f"mxfp8_options={self.mxfp8_options}"}
        if not hasattr(cls, "_apply_gate"):
            attrs["_apply_gate"] = _apply_gate
        _SUBCLASSES[cls] = type(f"MXFP8{cls.__name__}", (cls,), attrs)
    return _SUBCLASSES[cls]


def swap_experts(model: nn.Module, **options) -> int:
    """Run every transformers experts module of ``model`` in MXFP8; returns how many were swapped.

    ``options`` go to `moe_mxfp8.grouped_mm`: ``backend`` (default ``"auto"``), ``wgrad``,
    ``save_colwise``, ``scale_blocks``. Modules already swapped are left as they are. Every
    module is checked before any is changed.
    """
    _check_options(options)
    targets = [(n, m) for n, m in model.named_modules() if is_hf_experts(m) and not is_swapped(m)]
    if not targets and not any(is_swapped(m) for m in model.modules()):
        _refuse_per_expert_mlps(model)
    for name, module in targets:
        _check_swappable(name or type(module).__name__, module)
    for _, module in targets:
        module.__class__ = _mxfp8_subclass(type(module))
        module.mxfp8_options = dict(options)
    return len(targets)


def _refuse_per_expert_mlps(model: nn.Module) -> None:
    """transformers < 5.0's layout: ``experts`` a ModuleList of MLPs, routed inside the block."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, nn.ModuleList):
            raise ValueError(
                f"swap_experts: {name} is a ModuleList of per-expert MLPs (transformers < 5.0); "
                "the MXFP8 experts need transformers >= 5.0's fused gate_up_proj/down_proj")
