"""``torch.distributed.checkpoint`` (DCP) for models holding `MXFP8MoE`, sharded or not, with the
configuration check of `moe_mxfp8.checkpoint`.

An expert-parallel layer's ``w_gate_up`` is ``(E / ep_size, 2H, D)`` on every rank -- a different
tensor on each EP rank under the same key -- so its plain ``state_dict`` cannot be saved by DCP
(which would take the ranks' tensors for copies of one). `state_dict` presents each expert
tensor as what it is: one DTensor of the global shape ``(E, 2H, D)``, sharded on dim 0 over the
EP ranks (rank r holds experts ``[r E_l, (r+1) E_l)``) and, under FSDP2 (`moe_mxfp8.fsdp`), within
that over the ranks holding the same experts. The DTensors share the parameters' storage, so
`load` writes straight into the parameters, whatever the saving run's EP size, FSDP sharding or
process count was (DCP reshards)::

    from moe_mxfp8 import dcp
    dcp.save(model, "ckpt/step100")          # every rank, collective
    dcp.load(model, "ckpt/step100")          # any EP size / FSDP layout / one process

The layers' configuration (`MXFP8MoE.checkpoint_config`, with every expert present) is saved
under `CONFIG_KEY` and compared with the model's before any tensor is loaded: a mismatch is one
ValueError naming the layer, the field and both values.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as CK
from . import expert_parallel as EP
from . import fsdp_mxfp8 as FM
from .moe import MXFP8MoE

CONFIG_KEY = CK.LAYERS_KEY  # the one name of the layers' configuration record


def _global_configs(model: nn.Module) -> dict[str, dict]:
    """The layers' configuration with every expert present (the DCP state is global)."""
    return {name: {**cfg, "expert_shard": None} for name, cfg in CK.layer_configs(model).items()}


def _expert_mesh(layer: Any, param: torch.Tensor):
    # layer: an MXFP8MoE; Any because expert parallelism sets its ep_* attributes at run time
    """The mesh an EP layer's expert tensor is sharded on: ``ep`` (1-D) or ``(ep, ep_dp)`` under
    FSDP2 (EP outermost: a rank's experts are one contiguous block of the global E)."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    device = param.device.type
    if not isinstance(param, DTensor):
        return DeviceMesh.from_group(layer.ep_group, device, mesh_dim_names=("ep",))
    dp_mesh = param.device_mesh
    # every rank's (ep rank, ep_dp rank): the 2-D layout of the global ranks
    coords: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(coords, (layer.ep_rank, dp_mesh.get_local_rank()))
    layout = torch.empty(layer.ep_size, dp_mesh.size(), dtype=torch.int64)
    for rank, (e, d) in enumerate(coords):
        layout[e, d] = rank
    return DeviceMesh.from_group([layer.ep_group, dp_mesh.get_group()], device, mesh=layout,
                                 mesh_dim_names=("ep", "ep_dp"))


def state_dict(model: nn.Module) -> dict:
    """``model.state_dict()`` with every expert-parallel layer's expert tensors as global
    DTensors (sharing the parameters' storage), plus the layers' configuration record."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    sd = model.state_dict()
    for name, layer in model.named_modules():
        if not isinstance(layer, MXFP8MoE) or layer.ep_group is None:
            continue
        for pname in EP.EXPERT_PARAMS:
            key = f"{name}.{pname}" if name else pname
            param = getattr(layer, pname)
            # the plain shard (MXFP8 all-gathered weights wrap it: `moe_mxfp8.fsdp_mxfp8`)
            local = FM.plain(param.to_local() if isinstance(param, DTensor) else param.detach())
            mesh = _expert_mesh(layer, param)
            shape = (layer.num_experts, *param.shape[1:])
            sd[key] = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False,
                                         shape=torch.Size(shape),
                                         stride=torch.empty(shape, device="meta").stride())
    sd[CONFIG_KEY] = json.dumps(_global_configs(model), sort_keys=True)
    return sd


def save(model: nn.Module, checkpoint_id: str | os.PathLike) -> None:
    """Save ``model`` with DCP (a collective when distributed)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    dcp.save(state_dict(model), checkpoint_id=checkpoint_id)


def load(model: nn.Module, checkpoint_id: str | os.PathLike) -> None:
    """Check the saved configuration against ``model``, then load every tensor in place."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    record = {CONFIG_KEY: ""}
    dcp.load(record, checkpoint_id=checkpoint_id)
    CK.check_layer_configs(model, json.loads(record[CONFIG_KEY]),
                           source=f"checkpoint {os.fspath(checkpoint_id)}")
    sd = state_dict(model)
    del sd[CONFIG_KEY]
    dcp.load(sd, checkpoint_id=checkpoint_id)
    # plain tensors of the state dict are the parameters themselves (detached views): loaded
