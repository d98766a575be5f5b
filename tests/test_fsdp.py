"""FSDP2 (`fully_shard`) around `MXFP8MoE` over gloo (CPU), alone (world size 2) and with
expert parallelism on a 2-D mesh (dp_mod_ep x ep = 2 x 2, world size 4, torchtitan's layout),
against the single-process layer with the same weights; the same over NCCL on two GPUs.

Bit-identical where the math is the same:

* outputs and input gradients: FSDP all-gathers the exact weights and the layer's math is per
  token, so each rank's rows equal the single-process layer's on the whole batch;
* expert weight gradients: each rank's local gradient is the single-process layer's on the
  rank's tokens (FSDP alone) or on its EP group's tokens (EP, BF16 payload); two of them are
  summed by the reduce-scatter (one rounding of an exact sum: order-free) and divided by a power
  of two (exact).

Replicated parameters under EP (router, shared experts) are summed over four ranks in the
collective's order: compared by SQNR.

Expert weights all-gathered as MXFP8 (``mxfp8_all_gather=True``) against the BF16 all-gather of
the same sharding: everything bit-identical, the bytes on the wire counted.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import dcp as DCP
from moe_mxfp8 import expert_parallel as EP
from moe_mxfp8 import fsdp as FS
from moe_mxfp8 import fsdp_mxfp8 as FM
from tests.compare import fwd_bwd, sqnr_db
from tests.spawned import DEVICE, LAYER_BACKEND, free_port, init_rank, leave_worker

BF16 = torch.bfloat16
DIM, HIDDEN, EXPERTS, TOP_K = 128, 128, 8, 2  # 128: the 1x128 kernels refuse narrower (datapath)
TOKENS = {2: [40, 24], 4: [24, 8, 16, 32]}
REPLICATED_MIN_DB = 40.0  # BF16 gradients summed per rank, then over ranks (as the EP test)


def _layer(device, **opts):
    return MXFP8MoE(DIM, HIDDEN, EXPERTS, TOP_K, backend=LAYER_BACKEND[device], device=device,
                    num_shared_experts=1, **opts)


def _batch(seed, ws, device):
    torch.manual_seed(seed)
    ref = _layer(device)
    x = torch.randn(sum(TOKENS[ws]), DIM).to(device, BF16)
    dy = torch.randn(sum(TOKENS[ws]), DIM).to(device, BF16)
    return ref, x, dy


def _full(t):
    """A DTensor gradient or parameter -> the whole tensor (a collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _slices(ws):
    lo = [sum(TOKENS[ws][:r]) for r in range(ws)]
    return [slice(a, a + n) for a, n in zip(lo, TOKENS[ws], strict=True)]


def check_fsdp_alone(rank: int, ws: int, seed: int, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ref, x, dy = _batch(seed, ws, device)
    y_ref, dx_ref, _ = fwd_bwd(ref, x, dy)
    per_rank = [fwd_bwd(ref, x[s], dy[s])[2] for s in _slices(ws)]  # each rank's own tokens

    layer = _layer(device)
    layer.load_state_dict(ref.state_dict())
    mesh = init_device_mesh(device, (ws,))
    FS.fully_shard_moe(layer, mesh)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in layer.parameters())
    sl = _slices(ws)[rank]
    y, dx, g = fwd_bwd(layer, x[sl], dy[sl])
    assert torch.equal(y, y_ref[sl]) and torch.equal(dx, dx_ref[sl])
    for name, grad in g.items():
        want = sum(r[name] for r in per_rank) / ws  # two terms: one rounding, exact halving
        got = _full(grad)
        if ws == 2:
            assert torch.equal(got, want), name
        else:
            assert sqnr_db(want, got) >= REPLICATED_MIN_DB, name
    # a step changes only this rank's shard, and the next forward sees the update
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    opt.step()
    ref_sd = {k: v - 0.5 * sum(r[k] for r in per_rank) / ws for k, v in ref.state_dict().items()}
    for k, v in layer.state_dict().items():
        assert torch.equal(_full(v), ref_sd[k].to(v.dtype)), k


def check_fsdp_ep(rank: int, ws: int, seed: int, device: str) -> None:
    """dp_mod_ep x ep = (ws / 2) x 2. World 4: EP groups {0, 1} and {2, 3}, FSDP over {0, 2} and
    {1, 3}; world 2: one EP group, FSDP over one rank (the composition on two GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    ep = 2
    ref, x, dy = _batch(seed, ws, device)
    y_ref, dx_ref, g_ref = fwd_bwd(ref, x, dy)
    sls = _slices(ws)
    # the single-process layer on each EP group's tokens (what the all-to-all brings together)
    group_tokens = [slice(sls[d * ep].start, sls[d * ep + ep - 1].stop) for d in range(ws // ep)]
    per_group = [fwd_bwd(ref, x[s], dy[s])[2] for s in group_tokens]

    mesh = init_device_mesh(device, (ws // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    layer = _layer(device, ep_group=mesh["ep"].get_group(), ep_payload="bf16")
    layer.load_state_dict(ref.state_dict())  # full checkpoint -> this rank's experts
    FS.fully_shard_moe(layer, ep_dp_mesh=mesh["dp_mod_ep"], world_size=ws)
    sl = sls[rank]
    y, dx, g = fwd_bwd(layer, x[sl], dy[sl])
    FS.reduce_replicated_grads(layer)
    assert torch.equal(y, y_ref[sl]) and torch.equal(dx, dx_ref[sl])
    e_local = EXPERTS // ep
    experts = slice(layer.ep_rank * e_local, (layer.ep_rank + 1) * e_local)
    for name in EP.EXPERT_PARAMS:
        want = sum(r[name][experts] for r in per_group) / ws
        assert torch.equal(_full(g[name]), want), (name, (_full(g[name]) / want).nanmean().item())
    for name, _ in EP.replicated_parameters(layer):
        db = sqnr_db(g_ref[name] / ws, _full(g[name]))
        assert db >= REPLICATED_MIN_DB, (name, db)
    with pytest.raises(ValueError, match="world_size"):
        FS.fully_shard_moe(_layer(device, ep_group=mesh["ep"].get_group()),
                           ep_dp_mesh=mesh["dp_mod_ep"], world_size=ws + 2)


def check_dcp(rank: int, ws: int, seed: int, device: str, path: str) -> None:
    """DCP save of the FSDP x EP layer (dp_mod_ep 2 x ep 2); load into EP 4 without FSDP, into
    the FSDP x EP layer and into a whole layer on every rank; a differing top_k is refused (the
    load into one process outside any group runs in the test itself)."""
    from torch.distributed.device_mesh import init_device_mesh

    ref, *_ = _batch(seed, ws, device)
    full = ref.state_dict()
    mesh = init_device_mesh(device, (ws // 2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    src = _layer(device, ep_group=mesh["ep"].get_group())
    src.load_state_dict(full)
    FS.fully_shard_moe(src, ep_dp_mesh=mesh["dp_mod_ep"], world_size=ws)
    DCP.save(src, path)

    ep4 = _layer(device, ep_group=dist.group.WORLD)  # another EP size, no FSDP
    for p in ep4.parameters():
        p.data.zero_()
    DCP.load(ep4, path)
    want = EP.shard_expert_state_dict(full, rank, ws)
    assert all(torch.equal(v, want[k]) for k, v in ep4.state_dict().items())
    whole = _layer(device)
    for p in whole.parameters():
        p.data.zero_()
    DCP.load(whole, path)
    assert all(torch.equal(v, full[k]) for k, v in whole.state_dict().items())
    for p in src.parameters():  # back into the sharded layer itself
        p.data.zero_()
    DCP.load(src, path)
    assert all(torch.equal(_full(v), full[k]) for k, v in DCP.state_dict(src).items()
               if k != DCP.CONFIG_KEY)
    other = MXFP8MoE(DIM, HIDDEN, EXPERTS, TOP_K + 1, num_shared_experts=1, device=device)
    with pytest.raises(ValueError, match="top_k=2 but the model has top_k=3"):
        DCP.load(other, path)


def _mxfp8_meshes(device, ws, ep: bool):
    """(the world mesh, ``fully_shard_moe``'s mesh arguments, the layer's EP options): FSDP alone
    over all ranks, or FSDP x EP on (ws / 2) x 2."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device, (ws,))
    if not ep:
        return world, {"dp_mesh": world}, {}
    mesh = init_device_mesh(device, (ws // 2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    return (world, {"ep_dp_mesh": mesh["dp_mod_ep"], "world_size": ws},
            {"ep_group": mesh["ep"].get_group(), "ep_payload": "bf16"})


def _sharded_model(device, ws, recipe, mxfp8: bool, ep: bool, state, master: bool = False):
    """A layer of ``recipe`` holding ``state`` inside a root FSDP unit (so the layer reshards
    after forward and backward all-gathers again), its experts all-gathered as MXFP8 or BF16;
    ``master``: fp32 parameters all-gathered in BF16 (``MixedPrecisionPolicy``, torchtitan's
    setting). Returns (model, layer, the layer's all-gather byte counter)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, shard, ep_opts = _mxfp8_meshes(device, ws, ep)
    layer = _layer(device, scale_blocks=recipe, dtype=torch.float32 if master else BF16,
                   **ep_opts)
    layer.load_state_dict(state)
    model = torch.nn.Sequential(layer)
    mp_policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=BF16)} if master else {}
    FS.fully_shard_moe(model, mxfp8_all_gather=mxfp8, **shard, **mp_policy)
    fully_shard(model, mesh=world, **mp_policy)
    counter = FM.AllGatherBytes()
    layer.set_custom_all_gather(counter)
    return model, layer, counter


def check_mxfp8_all_gather(rank: int, ws: int, seed: int, device: str, path: str) -> None:
    """``mxfp8_all_gather=True`` against the BF16 all-gather: the same outputs, gradients, step
    and next step bit for bit (1x128 and 32x32 recipes; FSDP alone and FSDP x EP 1 x 2 at world
    2 -- a one-rank shard mesh, where nothing is gathered --, FSDP x EP 2 x 2 at 4), the expert
    bytes on the wire about halved (exactly FP8 + scales), DCP save and load; what it cannot do
    refused at setup."""
    for ep in (False, True) if ws == 2 else (True,):
        _check_mxfp8_all_gather(rank, ws, seed, device, f"{path}_{ep}", ep)


def _check_mxfp8_all_gather(rank: int, ws: int, seed: int, device: str, path: str, ep: bool):
    shard_size = ws // 2 if ep else ws
    sl = _slices(ws)[rank]
    ref, x, dy = _batch(seed, ws, device)
    # the recipes with BF16 parameters and SGD; 1x128 with fp32 master weights and AdamW (its
    # foreach ops on the sharded parameters) too
    cases = [(r, False) for r in FM.MXFP8_GATHER_RECIPES] + [("1x128", True)] * (not ep)
    for recipe, master in cases:
        runs = {}
        for mxfp8 in (False, True):
            model, layer, counter = _sharded_model(device, ws, recipe, mxfp8, ep,
                                                   ref.state_dict(), master)
            opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if master
                   else torch.optim.SGD(model.parameters(), lr=0.5))
            results = []
            for _ in range(2):  # a step, then the next forward on the updated weights
                y, dx, g = fwd_bwd(model, x[sl], dy[sl])
                if ep:
                    FS.reduce_replicated_grads(model)
                results.append((y, dx, {k: _full(v) for k, v in g.items()}))
                opt.step()
            state = {k: _full(v) for k, v in model.state_dict().items()}
            runs[mxfp8] = (results, state, counter.sent)
        (want, want_sd, bf16_sent), (got, got_sd, mx_sent) = runs[False], runs[True]
        for (y0, dx0, g0), (y1, dx1, g1) in zip(want, got, strict=True):
            assert torch.equal(y0, y1) and torch.equal(dx0, dx1), recipe
            assert all(torch.equal(g0[k], g1[k]) for k in g0), recipe
        assert all(torch.equal(want_sd[k], got_sd[k]) for k in want_sd), recipe
        # two steps of (forward + backward) all-gathers of the layer's unit
        per_gather = [FM.expert_gather_bytes(layer, shard_size, m) for m in (False, True)]
        if shard_size == 1:  # FSDP2 gathers nothing on one rank
            assert bf16_sent == mx_sent == 0, (bf16_sent, mx_sent)
            continue
        assert bf16_sent - mx_sent == 4 * (per_gather[0] - per_gather[1]), (bf16_sent, mx_sent)
        assert 0.5 < per_gather[1] / per_gather[0] < 0.55, per_gather
    # DCP: the MXFP8-gathered layer saves its plain weights and loads them back
    sd = DCP.state_dict(model)
    assert not any(isinstance(v, FM.MXFP8ShardedWeight) or isinstance(
        getattr(v, "_local_tensor", None), FM.MXFP8ShardedWeight) for v in sd.values())
    DCP.save(model, path)
    whole = torch.nn.Sequential(_layer(device, scale_blocks=recipe,
                                       dtype=got_sd["0.w_gate_up"].dtype))
    DCP.load(whole, path)
    if not ep:  # (with EP the state holds the layer's local experts)
        assert all(torch.equal(v, got_sd[k]) for k, v in whole.state_dict().items())
    for p in model.parameters():
        p.data.zero_()
    DCP.load(model, path)
    assert all(torch.equal(_full(v), got_sd[k]) for k, v in model.state_dict().items())
    # refused at setup: the 1x32 weights ("auto" may be 1x32), uneven shards, the weight cache
    for bad, match in (({"scale_blocks": "1x32"}, "scale_blocks"),
                       ({"scale_blocks": "auto"}, "scale_blocks"),
                       ({"num_experts": 6 if ep else 3}, "split evenly"),
                       ({"cache_weights": True}, "cache_weights"),
                       ({"precision": "bf16"}, "precision")):
        if shard_size == 1 and "num_experts" in bad:
            continue  # one rank holds whole experts whatever their number
        _, shard, ep_opts = _mxfp8_meshes(device, ws, ep)
        opts = {"scale_blocks": "1x128", "num_experts": EXPERTS, **bad}
        layer = MXFP8MoE(DIM, HIDDEN, opts.pop("num_experts"), TOP_K, device=device,
                         backend=LAYER_BACKEND[device], **opts, **ep_opts)
        with pytest.raises(ValueError, match=match):
            FS.fully_shard_moe(layer, mxfp8_all_gather=True, **shard)


class _Recomputed(torch.nn.Module):
    """``module`` under activation checkpointing (non-reentrant, as torchtitan's)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.module, x, use_reentrant=False)


def check_mxfp8_all_gather_variants(rank: int, ws: int, seed: int, device: str) -> None:
    """``mxfp8_all_gather=True`` where backward reuses the forward's gathered weights
    (``reshard_after_forward=False``) and where the forward is recomputed in backward
    (activation checkpointing): the BF16 all-gather's outputs and gradients, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (ws,))
    ref, x, dy = _batch(seed, ws, device)
    sl = _slices(ws)[rank]
    for recompute, fsdp_kwargs in ((False, {"reshard_after_forward": False}), (True, {})):
        runs = []
        for mxfp8 in (False, True):
            # 32x32 tiles: several a weight at these sizes (one 128x128 tile would not show a
            # misplaced tile scale)
            layer = _layer(device, scale_blocks="32x32")
            layer.load_state_dict(ref.state_dict())
            model = torch.nn.Sequential(_Recomputed(layer) if recompute else layer)
            FS.fully_shard_moe(model, mesh, mxfp8_all_gather=mxfp8, **fsdp_kwargs)
            fully_shard(model, mesh=mesh)
            y, dx, g = fwd_bwd(model, x[sl], dy[sl])
            runs.append((y, dx, {k: _full(v) for k, v in g.items()}))
        (y0, dx0, g0), (y1, dx1, g1) = runs
        label = (recompute, fsdp_kwargs)
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1), label
        assert all(torch.equal(g0[k], g1[k]) for k in g0), label


# CPU: FSDP alone at world 2, FSDP x EP at 4 (CI time); NCCL: every check the GPUs allow
CHECKS = {("gloo", 2): [check_fsdp_alone, check_fsdp_ep, check_mxfp8_all_gather,
                        check_mxfp8_all_gather_variants],
          ("gloo", 4): [check_fsdp_ep, check_dcp, check_mxfp8_all_gather],
          ("nccl", 2): [check_fsdp_alone, check_fsdp_ep, check_mxfp8_all_gather,
                        check_mxfp8_all_gather_variants],
          ("nccl", 4): [check_fsdp_ep, check_dcp, check_mxfp8_all_gather]}


def _worker(rank: int, ws: int, port: int, seed: int, path: str, pg_backend: str = "gloo"
            ) -> None:
    torch.set_num_threads(1)
    init_rank(rank, ws, port, pg_backend)
    try:
        for check in CHECKS[pg_backend, ws]:
            args = {check_dcp: (path,), check_mxfp8_all_gather: (path + "_mxfp8",)}
            check(rank, ws, seed, DEVICE[pg_backend], *args.get(check, ()))
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    leave_worker()  # every check passed


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("ws", [2, 4])
def test_fsdp_matches_single_process(gen, ws, tmp_path):
    seed = int(torch.randint(2**31, (1,), generator=gen))
    print("seed", seed)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = str(tmp_path / "dcp")
    mp.spawn(_worker, args=(ws, free_port(), seed, path), nprocs=ws, join=True)
    if ws == 4:  # the sharded checkpoint into one process, no process group
        full = _batch(seed, ws, "cpu")[0].state_dict()
        whole = _layer("cpu")
        DCP.load(whole, path)
        assert all(torch.equal(v, full[k]) for k, v in whole.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_fsdp_matches_single_process(gen, tmp_path):
    """FSDP2 alone and FSDP2 x EP (1 x 2) over NCCL on two GPUs, the GPU kernels, and the
    expert weights all-gathered as MXFP8 against BF16 (`check_mxfp8_all_gather`); with four
    GPUs FSDP2 x EP at 2 x 2 too."""
    seed = int(torch.randint(2**31, (1,), generator=gen))
    print("seed", seed)
    for ws in (2, 4) if torch.cuda.device_count() >= 4 else (2,):
        path = str(tmp_path / f"dcp{ws}")
        mp.spawn(_worker, args=(ws, free_port(), seed, path, "nccl"), nprocs=ws, join=True)
