"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models holding `MXFP8MoE` layers, alone or
with expert parallelism on a 2-D device mesh (EP x data-parallel shard, as torchtitan composes
them).

Each `MXFP8MoE` is its own FSDP unit: its forward reads ``router.weight`` and the expert tensors
directly (not through submodule calls), so the layer's parameters must be all-gathered together.
Inside the unit's forward the parameters are plain unsharded tensors, so the MXFP8 weight
quantizer reads the whole (unsharded) weights, exactly as on one process; after backward the
gradients are reduce-scattered back to the DTensor shards.

Without EP the layer is sharded over the data-parallel mesh like any other module. With EP
(``MXFP8MoE(..., ep_group=mesh["ep"].get_group())``) the ranks of one EP group hold *different*
experts, so the layer is sharded over ``ep_dp_mesh``: the data-parallel ranks that hold the same
experts (torchtitan's ``dp_shard_mod_ep``). Then:

* the expert gradients are the sum over the EP group's tokens (the all-to-all brought them to
  this rank), reduce-scattered over ``ep_dp_mesh``;
* the replicated parameters (router, shared experts) are reduce-scattered over ``ep_dp_mesh``
  too, and `reduce_replicated_grads` adds them up over the EP group (call it after backward,
  before the optimizer step): the EP ranks saw different tokens;
* every gradient of the layer is divided by the whole data-parallel world (``ep_size x
  ep_dp_mesh.size()``), so all of them are gradients of the mean of the ranks' losses, as the
  rest of a data-parallel model's are.

::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    moe = MXFP8MoE(..., ep_group=mesh["ep"].get_group())
    fully_shard_moe(model, ep_dp_mesh=mesh["dp_mod_ep"], world_size=dp * ep)
    ...  # fully_shard the other blocks / the root over all ranks as usual
    loss.backward(); reduce_replicated_grads(model); opt.step()
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from . import expert_parallel as EP
from . import fsdp_mxfp8 as FM
from .moe import MXFP8MoE


def moe_layers(model: nn.Module) -> list[MXFP8MoE]:
    """Every `MXFP8MoE` in ``model`` (``model`` itself included)."""
    return [m for m in model.modules() if isinstance(m, MXFP8MoE)]


def fully_shard_moe(model: nn.Module, dp_mesh=None, *, ep_dp_mesh=None, world_size=None,
                    mxfp8_all_gather: bool = False, **fsdp_kwargs) -> list[MXFP8MoE]:
    """``fully_shard`` every `MXFP8MoE` in ``model`` as its own FSDP unit; returns the layers.

    ``dp_mesh``: the data-parallel mesh of layers without EP. ``ep_dp_mesh``: the 1-D mesh of
    the ranks that hold the same experts, for layers with ``ep_group``; ``world_size``: all
    data-parallel ranks (``ep_size * ep_dp_mesh.size()``; the gradient divide factor).
    ``mxfp8_all_gather``: all-gather the expert weights as MXFP8 (quantized on each rank before
    the all-gather: about half the bytes, the same results bit for bit; `moe_mxfp8.fsdp_mxfp8`)
    instead of BF16; for the ``"1x128"`` and ``"32x32"`` recipes, with whole experts per shard.
    ``fsdp_kwargs`` go to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...).
    Shard the layers before their parents: a parent unit then leaves their parameters alone.
    """
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    layers = moe_layers(model)
    for layer in layers:
        if layer.ep_group is None:
            if dp_mesh is None:
                raise ValueError("fully_shard_moe: dp_mesh is required for a layer without "
                                 "ep_group")
            _gather_as_mxfp8(layer, dp_mesh, mxfp8_all_gather)
            fully_shard(layer, mesh=dp_mesh, **fsdp_kwargs)
            continue
        if ep_dp_mesh is None or world_size is None:
            raise ValueError("fully_shard_moe: an expert-parallel layer needs ep_dp_mesh (the "
                             "ranks holding the same experts) and world_size")
        if world_size != layer.ep_size * ep_dp_mesh.size():
            raise ValueError(
                f"fully_shard_moe: world_size={world_size} is not ep_size={layer.ep_size} x "
                f"ep_dp_mesh.size()={ep_dp_mesh.size()}"
            )
        _gather_as_mxfp8(layer, ep_dp_mesh, mxfp8_all_gather)
        fully_shard(layer, mesh=ep_dp_mesh, **fsdp_kwargs)
        # Divide by all data-parallel ranks, not the ep_dp_mesh's (see the module doc). A sum
        # then one division (a power of two is exact): gloo has no pre-multiplied sum, and the
        # same order on NCCL keeps CPU and GPU runs alike.
        sharded: Any = layer  # fully_shard made it an FSDPModule in place
        sharded.set_gradient_divide_factor(float(world_size))
        # A one-rank ep_dp_mesh communicates nothing, and there torch (2.13) divides by the
        # factor in its copy and again as the forced sum's post-divide: force sums only where a
        # reduce-scatter runs.
        sharded.set_force_sum_reduction_for_comms(ep_dp_mesh.size() > 1)
    return layers


def _gather_as_mxfp8(layer: MXFP8MoE, mesh, on: bool) -> None:
    """With ``mxfp8_all_gather``: check the layer, then make its expert weights all-gather as
    MXFP8 (`moe_mxfp8.fsdp_mxfp8`). A one-rank shard mesh gathers nothing (FSDP2 then uses the
    sharded tensor itself): the weights stay as they are."""
    if not on:
        return
    shard_size = mesh.size(mesh.ndim - 1)  # FSDP shards over the mesh's last dim
    FM.check_layer(layer, shard_size)
    if shard_size > 1:
        FM.wrap_expert_weights(layer)


def reduce_replicated_grads(model: nn.Module) -> None:
    """After backward: sum the replicated parameters' gradient shards (router, shared experts)
    of every expert-parallel, FSDP-sharded `MXFP8MoE` over its EP group (a collective).

    The members of an EP group sit at the same position of their ``ep_dp_mesh`` and so hold the
    same shard of each replicated parameter: the local shards add up directly.
    """
    for layer in moe_layers(model):
        if layer.ep_group is None:
            continue
        for _, p in EP.replicated_parameters(layer):
            if p.grad is None:
                continue
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=layer.ep_group)
