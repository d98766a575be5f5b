"""Expert parallelism (EP) for `MXFP8MoE` over ``torch.distributed``: the exchanges, state.

With ``MXFP8MoE(..., ep_group=group)`` each of the ``P = group.size()`` ranks holds
``E_l = E / P`` experts -- rank ``r`` holds experts ``[r E_l, (r+1) E_l)``, so ``w_gate_up`` is
``(E_l, 2H, D)`` and ``w_down`` ``(E_l, D, H)`` -- while the router and the shared experts are
replicated. The layer's dispatcher is then a `moe_mxfp8.dispatcher.AllToAllDispatcher`, built
from the pieces here. Every rank routes its own tokens; the (token, slot) pairs travel to their
expert's rank and the expert outputs travel back (two ``all_to_all_single`` per direction, no
transport of our own: NCCL on GPUs, gloo on CPUs)::

    route     weights, expert ids, counts (E,) of the rank's T tokens          (as on one GPU)
    sizes     all_to_all_single of counts (E,) int64 -> recv_counts (P, E_l)   on the device
    splits    send/recv rows per peer to the host: the one sync the collective needs
    dispatch  payload "mxfp8": quantize the T tokens rowwise ONCE (E4M3 + E8M0 per 32 along D),
              gather the T k pairs in expert order as rows [D data bytes | D/32 scale bytes]
              (uint8: gloo has no float8; one collective carries both), all_to_all_single;
              payload "bf16": the BF16 rows themselves (`PairsToExperts`).
    land      the received rows (source-major, then expert; dequantized to BF16) go to their
              rows of the local experts' expert-sorted layout (`make_plan`: expert j's group
              holds the pairs of source 0, then 1, ... -- the single-GPU order of the
              concatenated batch; groups start on multiples of 16 rows, 128 for the 1x128
              recipe, as on one GPU). This landing is the lean data path's dispatch
              (`moe_mxfp8.datapath`, every recipe and the BF16 twin), fused with the MXFP8
              quantization of the GEMM operands: the received rows enter its routed-expert
              block as tokens with one slot of weight 1.
    experts   the local experts' SwiGLU on that layout, the single-GPU layer's code path
    combine   output rows back to their source rank in BF16 (`OutputsToSources`), weighted
              there by the data path's combine stage, as on one GPU
              (`moe_mxfp8.stages.weighted_combine`).

Backward is the mirror image, through autograd: the combine's backward dispatches ``dy`` to the
experts (payload ``ep_grad_payload``: ``"bf16"``, default, or ``"mxfp8"``) and ``dx`` returns in
BF16 to the source ranks, where the dispatch's backward sums the k copies of a token. The ``dx``
return starts inside the experts' backward, as soon as their dgrad has made it, and runs beside
their weight gradients (`start_input_grad_return`, on a communicator of at most `RETURN_SMS`
CTAs, with the GEMMs leaving that many SMs free); the dispatch's backward waits for it.

Numerics (`docs/numerics.md`). The GEMM re-quantizes its BF16 operand rowwise along D with the
same 32-blocks as the dispatch; the E4M3 x 2^e values of a dequantized block quantize back to
themselves, so the fprop GEMM with an MXFP8 payload sees exactly the values the single-GPU layer
computes with, and the layer output is the same bit for bit. What differs is the columnwise (along
tokens) copy of ``x`` for the ``w_gate_up`` weight gradient: it is quantized from the dequantized
tokens; likewise ``w_down``'s weight gradient with an MXFP8 ``dy`` payload. Rounding to E4M3
twice is rounding once for every element that is normal in both blocks (a 3-bit mantissa
relative to the element's own exponent, whatever the block scale), so only elements ~2^-14 below
their block's maximum differ (SQNR against the single-GPU gradient:
docs/design/expert_parallel.md, "Numerics"). Everything else -- output, input gradient, the
other expert gradients -- is bit-identical to the single-GPU layer on the concatenated batch
(tests/test_expert_parallel.py). With ``scale_blocks="1x128"`` the payload's 1x32 blocks are not
the GEMM's 1x128 blocks, so an MXFP8 payload rounds the tokens once more (use ``"bf16"`` there
for the single-GPU numerics).
The straight-through backward of the dispatch (``dx`` of the dequantized tokens is ``dx`` of the
tokens) is the one the single-GPU layer has too: its quantization lives inside the GEMM.

Replicated parameters (router, shared experts) get each rank's local gradient; sum them over the
group (data parallelism does; `all_reduce_replicated_grads` otherwise). ``aux_loss`` is computed
from the rank's own tokens (as torchtitan's per-rank load-balancing statistics are), and so is
``tokens_per_expert`` (its pairs per global expert).

Checkpoints: a rank's ``state_dict`` holds its expert shard under the usual keys. A full
(single-GPU) checkpoint loads into an EP layer directly -- a load hook (`load_full_hook`)
slices the rank's experts; `full_state_dict` gathers the shards back into a single-GPU
checkpoint (a collective); `merge_expert_shards` / `shard_expert_state_dict` do the same offline
on saved per-rank dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor

from . import layout as L
from . import routing as RT
from . import stages as ST
from .checks import COMPUTE_DTYPE
from .kernels.mx_format import padded_extent
from .mx_tensor import FP8
from .quantize import quantize_rowwise
from .reference import e8m0_to_float32

EXPERT_PARAMS = ("w_gate_up", "w_down")  # sharded on dim 0; every other parameter is replicated


# ---------------------------------------------------------------------------------------------
# Group and options
# ---------------------------------------------------------------------------------------------


def group_info(group, num_experts: int, who: str = "MXFP8MoE") -> tuple[int, int]:
    """``(ep_size, ep_rank)`` of ``group``; checks that the experts split evenly over it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}: ep_group needs an initialized torch.distributed process group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: ep_group must be a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{who}: this process is not a member of ep_group")
    if num_experts % size:
        raise ValueError(
            f"{who}: num_experts={num_experts} must be a multiple of the expert-parallel group "
            f"size {size} (each rank holds num_experts / ep_size experts)"
        )
    return size, rank


# ---------------------------------------------------------------------------------------------
# The plan: sizes exchanged, split sizes on the host, landing rows of the received pairs
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    group: dist.ProcessGroup
    send_splits: list[int]  # rows this rank sends to each peer (its pairs, expert-sorted)
    recv_splits: list[int]  # rows it receives from each peer
    land: Tensor  # (R,) int64: row of the expert-sorted layout for each received row
    offs: Tensor  # (E_l,) int32 cumulative group ends of that layout
    rows: int  # M: rows of that layout (R, or the aligned static extent)
    # backward: the input-gradient return started early (`start_input_grad_return`):
    # (the sent gradient, the receive buffer, the collective's work handle)
    returning: tuple | None = field(default=None, repr=False)


def exchange_counts(counts: Tensor, group) -> Tensor:
    """``counts (E,)`` int64 of this rank's pairs per global expert -> ``(P, E_l)``: pairs that
    each source rank sends to each local expert. One equal-split all-to-all, on the device."""
    size = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts.contiguous(), group=group)
    return recv.view(size, -1)


def group_sum(count: Tensor, group) -> int:
    """``count`` (an integer scalar on the device) summed over ``group``, read on the host: a
    collective every rank runs, so an error that follows is raised on every rank together
    (one rank raising alone would leave the others waiting in the next all-to-all)."""
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return int(total)


def make_plan(counts: Tensor, group, align: int) -> Plan:
    """Sizes first, then where every received pair lands.

    ``align > 1``: every local expert's group starts on a multiple of ``align`` rows and the
    layout has the single-GPU layer's static extent (``layer.group_align_rows``: 16, 128 for the
    1x128 recipe); ``align == 1``: the groups are packed (precision "bf16").

    The split sizes must reach the host (the collective's API): that one device->host copy
    brings the whole ``(P, E_l)`` count matrix with them, so the layout's per-chunk arithmetic
    runs on the host (a few hundred integers) and the device builds only ``land`` (R rows) and
    ``offs``: three kernels after the sync instead of some twenty, each a host launch the idle
    GPU would wait for.
    """
    size = dist.get_world_size(group)
    recv_counts = exchange_counts(counts, group)  # (P, E_l)
    e_local = recv_counts.shape[1]
    host = torch.cat([counts.view(size, e_local).sum(1), recv_counts.reshape(-1)]).cpu()
    send_splits = host[:size].tolist()
    rc = host[size:].view(size, e_local)  # pairs each source sends to each local expert
    recv_splits = rc.sum(1).tolist()
    r = sum(recv_splits)

    grp = (rc.sum(0) + align - 1) // align * align  # (E_l,) group rows, aligned
    m = padded_extent(r, e_local, align)  # static in r
    grp_start = torch.cumsum(grp, 0) - grp
    # Chunk (s, j): pairs from source s for local expert j; received s-major, landed j-major
    # (expert j's group holds source 0's pairs, then source 1's, ...).
    before = torch.cumsum(rc, 0) - rc  # (P, E_l) pairs of j from sources < s
    sizes = rc.reshape(-1)
    src_start = torch.cumsum(sizes, 0) - sizes
    shift = (grp_start[None, :] + before).reshape(-1) - src_start  # land - arrival index
    ends = torch.cumsum(grp, 0)
    # the last group absorbs the slack up to the static extent (as datapath.route_layout)
    offs = torch.cat([ends[:-1], ends.new_full((1,), m)])
    dev = torch.cat([shift, sizes, offs])
    if counts.is_cuda:  # one host->device copy, from pinned memory: no second host sync
        dev = dev.pin_memory().to(counts.device, non_blocking=True)
    n = sizes.numel()
    land = torch.arange(r, device=counts.device) + torch.repeat_interleave(
        dev[:n], dev[n:2 * n], output_size=r)
    return Plan(group, send_splits, recv_splits, land, dev[2 * n:].to(torch.int32), m)


# ---------------------------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------------------------


def _all_to_all(send: Tensor, out_rows: int, out_splits, in_splits, group) -> Tensor:
    out = send.new_empty(out_rows, *send.shape[1:])
    dist.all_to_all_single(out, send.contiguous(), out_splits, in_splits, group=group)
    return out


def pack_mxfp8_rows(x: Tensor, index: Tensor, backend: str) -> Tensor:
    """Rows ``x[index]`` of ``x (T, D)``, quantized rowwise, as uint8 payload rows ``[D E4M3
    bytes | D/32 E8M0 scale bytes]`` ``(len(index), D + D/32)``: one Triton kernel on CUDA
    (gather, quantize and pack in one pass), `pack_mxfp8_rows_ref` otherwise."""
    RT.check_index("pack_mxfp8_rows", "index", index, 1, x, 0, x.shape[0])
    x = x.detach().to(COMPUTE_DTYPE).contiguous()
    if ST.use_triton(x, backend):
        from .kernels import ep_payload_triton

        return ep_payload_triton.pack_rows(x, index.contiguous())
    return pack_mxfp8_rows_ref(x, index, backend)


def pack_mxfp8_rows_ref(x: Tensor, index: Tensor, backend: str = "reference") -> Tensor:
    """`pack_mxfp8_rows` from the rowwise quantizer (``backend``) and PyTorch gathers."""
    t, d = x.shape
    nb = d // L.BLOCK_SIZE
    if t == 0:
        return x.new_empty(index.numel(), d + nb, dtype=torch.uint8)
    q = quantize_rowwise(x.detach().to(COMPUTE_DTYPE).contiguous(), backend=backend)  # packed
    # Each token's scale bytes straight out of the packed layout (no unpack pass).
    rr = torch.arange(t, device=x.device)[:, None]
    cc = torch.arange(nb, device=x.device)[None, :]
    scales = q.scale.reshape(-1)[L.packed_scale_offset(rr, cc, nb)]  # (T, D/32)
    # Gathered straight into the payload (no (T, D + D/32) intermediate).
    rows = x.new_empty(index.numel(), d + nb, dtype=torch.uint8)
    rows[:, :d] = q.data.view(torch.uint8)[index]
    rows[:, d:] = scales[index]
    return rows


def unpack_mxfp8_rows(rows: Tensor, d: int, backend: str = "auto") -> Tensor:
    """Payload rows ``(R, D + D/32)`` uint8 -> ``(R, D)`` BF16 (``E4M3 * 2^(s - 127)``): one
    Triton kernel on CUDA, `unpack_mxfp8_rows_ref` otherwise."""
    if ST.use_triton(rows, backend):
        from .kernels import ep_payload_triton

        return ep_payload_triton.unpack_rows(rows.contiguous(), d)
    return unpack_mxfp8_rows_ref(rows, d)


def unpack_mxfp8_rows_ref(rows: Tensor, d: int) -> Tensor:
    """`unpack_mxfp8_rows` in PyTorch, in BF16 throughout: E4M3 values and powers of two are
    exact in BF16, and a BF16 product is the FP32 product rounded once, so this equals the FP32
    dequantization rounded to BF16 while moving half the bytes."""
    data = rows[:, :d].view(FP8).to(COMPUTE_DTYPE)
    scale = e8m0_to_float32(rows[:, d:]).to(COMPUTE_DTYPE)  # (R, D/32), exact
    data = rearrange(data, "r (b k) -> r b k", k=L.BLOCK_SIZE) * scale[..., None]
    return rearrange(data, "r b k -> r (b k)")


def _send_rows(x: Tensor, index: Tensor | None, payload: str, backend: str, plan: Plan,
               reverse: bool) -> Tensor:
    """Rows ``x[index]`` (None: ``x``'s rows as they are) to the peers -> ``(rows received, D)``
    BF16. ``reverse``: the combine's direction (send as much as was received in the dispatch,
    and vice versa)."""
    out_splits, in_splits = (
        (plan.send_splits, plan.recv_splits) if reverse else (plan.recv_splits, plan.send_splits)
    )
    n_out = sum(out_splits)
    if payload == "mxfp8":
        if index is None:
            index = torch.arange(x.shape[0], device=x.device)
        rows = pack_mxfp8_rows(x, index, backend)
        got = _all_to_all(rows, n_out, out_splits, in_splits, plan.group)
        return unpack_mxfp8_rows(got, x.shape[1], backend)
    rows = x.to(COMPUTE_DTYPE) if index is None else x.to(COMPUTE_DTYPE)[index]
    return _all_to_all(rows, n_out, out_splits, in_splits, plan.group)


# SMs the expert block's weight-gradient GEMMs leave free while the input-gradient return runs
# beside them (`start_input_grad_return`), and the CTAs that return's NCCL kernel may use: the
# persistent GEMMs otherwise hold every SM to their end (one CTA per SM, the register file
# full), and an NCCL kernel's CTA takes an SM of its own beside them. Fewer CTAs move the bytes
# too slowly: at dsv3, P = 2 (2 x H100, 2026-11-27) the return took 5.0 ms beside the gate/up
# weight gradient with 8 or 16 CTAs (1.5 ms alone) and outlasted it; with 32 it took 2.8 ms,
# hidden inside the 4.1 ms the weight gradient then takes (3.2 ms on every SM).
RETURN_SMS = 32

_RETURN_GROUPS: dict = {}  # (group, CTAs) -> the group the early input-gradient return uses


def return_group(group, ctas: int):
    """The process group of the early input-gradient return over ``group``: with NCCL, a
    communicator of the same ranks whose kernels use at most ``ctas`` CTAs, so that they fit
    the SMs the weight gradients leave; ``group`` itself otherwise (gloo, or no cap). Made
    once per (group, cap), in the first backward that needs it, by the group's ranks
    (``use_local_synchronization``). Where the default group is bound to a device, torch makes
    it by splitting the default group's communicator, a collective of every rank of the job:
    every rank's first backward makes its own expert-parallel group's in the same step, so all
    take part (GPU-tested with the job's whole group as the expert-parallel group, P = 1, 2)."""
    key = (group, ctas)
    if key not in _RETURN_GROUPS:
        side = group
        if ctas > 0 and dist.get_backend(group) == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.max_ctas = ctas
            opts.config.min_ctas = min(ctas, max(1, opts.config.min_ctas))
            side = dist.new_group(dist.get_process_group_ranks(group), backend="nccl",
                                  pg_options=opts, use_local_synchronization=True,
                                  group_desc=f"moe_mxfp8_input_grad_return_{ctas}_ctas")
        _RETURN_GROUPS[key] = side
    return _RETURN_GROUPS[key]


def start_input_grad_return(plan: Plan, dx: Tensor, sms: int = RETURN_SMS) -> int:
    """Start the return of the received pairs' input gradient ``dx (R, D)`` bf16 to their
    source ranks, asynchronously (NCCL: on its own stream, after what the current stream has
    queued, on `return_group`'s communicator of at most ``sms`` CTAs), and keep it in ``plan``
    for `PairsToExperts.backward` to wait on. The expert block calls this between its dgrad and
    its weight gradients (`datapath.on_input_grad`), so the exchange runs beside them; returns
    the SMs they leave it (``sms``)."""
    if plan.returning is not None:  # never left over from an earlier backward
        plan.returning[2].wait()
    dx = dx.to(COMPUTE_DTYPE).contiguous()
    back = dx.new_empty(sum(plan.send_splits), dx.shape[1])
    work = dist.all_to_all_single(back, dx, plan.send_splits, plan.recv_splits,
                                  group=return_group(plan.group, sms), async_op=True)
    plan.returning = (dx, back, work)
    return sms


def _returned_input_grad(plan: Plan, grad: Tensor) -> Tensor:
    """The pairs' gradients back on this rank ``(T k, D)``: the exchange started early if it
    sent ``grad`` itself (waited on here), else one started now."""
    early, plan.returning = plan.returning, None
    if early is not None:
        sent, back, work = early
        work.wait()  # the current stream waits for the exchange; the host does not
        if (sent.data_ptr() == grad.data_ptr() and sent.shape == grad.shape
                and sent.dtype == grad.dtype):
            return back
    return _all_to_all(grad.to(COMPUTE_DTYPE), sum(plan.send_splits), plan.send_splits,
                       plan.recv_splits, plan.group)


class PairsToExperts(torch.autograd.Function):
    """``x (T, D)`` -> ``(R, D)`` BF16: the pairs ``x[order // k]`` this rank's experts receive,
    in arrival order (source-major, then expert); ``order`` is the stable expert sort of the
    ``T k`` (token, slot) pairs. Backward returns their gradients in BF16 and sums the k copies
    of each token."""

    @staticmethod
    def forward(ctx, x, order, k, plan, payload, backend):
        ctx.plan, ctx.t, ctx.k, ctx.dtype, ctx.backend = plan, x.shape[0], k, x.dtype, backend
        ctx.save_for_backward(order)
        return _send_rows(x, order // k, payload, backend, plan, reverse=False)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        back = _returned_input_grad(ctx.plan, grad)  # (T k, D): the pairs' gradients
        # The k copies of a token summed as on one GPU (`datapath.dispatch_backward`: fp32, slot
        # order, BF16 once; no atomics). rows[t, j]: the row of back holding pair (t, j). Not
        # index_put_(accumulate=True): on CUDA it range-checks its index on the host (two syncs).
        rows = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device))
        rows = rows.to(torch.int32).view(ctx.t, ctx.k)  # int32, as `datapath.route_layout`'s
        dx = ST.dispatch_backward(back, rows, backend=ctx.backend)
        return dx.to(ctx.dtype), None, None, None, None, None


class OutputsToSources(torch.autograd.Function):
    """``y (R, D)`` BF16 expert outputs in arrival order -> ``(T k, D)`` this rank's pairs'
    outputs, expert-sorted (BF16, exact). Backward dispatches ``dy`` with ``grad_payload``."""

    @staticmethod
    def forward(ctx, y, plan, grad_payload, backend):
        ctx.plan, ctx.grad_payload, ctx.backend = plan, grad_payload, backend
        return _all_to_all(y.to(COMPUTE_DTYPE), sum(plan.send_splits), plan.send_splits,
                           plan.recv_splits, plan.group)

    @staticmethod
    def backward(ctx, grad):
        # the pairs' rows are already in sending order: no gather (a BF16 copy of them all)
        dy = _send_rows(grad, None, ctx.grad_payload, ctx.backend, ctx.plan, reverse=False)
        return dy, None, None, None


# ---------------------------------------------------------------------------------------------
# Gradients of replicated parameters, checkpoints
# ---------------------------------------------------------------------------------------------


def replicated_parameters(layer):
    """``(name, parameter)`` of the parameters every rank holds whole (router, shared experts)."""
    return [(n, p) for n, p in layer.named_parameters() if n not in EXPERT_PARAMS]


def all_reduce_replicated_grads(layer) -> None:
    """Sum the replicated parameters' gradients over ``layer.ep_group`` (when no data-parallel
    wrapper does it): each rank's gradient covers only its own tokens."""
    for _, p in replicated_parameters(layer):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=layer.ep_group)


def _expert_keys(sd, prefix: str = ""):
    return [prefix + n for n in EXPERT_PARAMS if prefix + n in sd]


def shard_expert_state_dict(sd: dict, ep_rank: int, ep_size: int, prefix: str = "") -> dict:
    """A full (single-GPU) state dict -> rank ``ep_rank``'s: expert tensors sliced on dim 0."""
    out = dict(sd)
    for key in _expert_keys(sd, prefix):
        e = sd[key].shape[0]
        if e % ep_size:
            raise ValueError(f"{key}: {e} experts do not split over {ep_size} ranks")
        n = e // ep_size
        out[key] = sd[key][ep_rank * n:(ep_rank + 1) * n]
    return out


def merge_expert_shards(sds: list[dict], prefix: str = "") -> dict:
    """Per-rank state dicts (rank order) -> one full state dict: experts concatenated on dim 0
    on rank 0's device (gathered shards keep their ranks' devices), replicated tensors taken
    from rank 0."""
    out = dict(sds[0])
    for key in _expert_keys(sds[0], prefix):
        dev = sds[0][key].device
        out[key] = torch.cat([sd[key].to(dev) for sd in sds], dim=0)
    return out


def full_state_dict(layer) -> dict:
    """The single-GPU state dict of an EP layer, on every rank (an all-gather per expert
    tensor: a collective, call it on every rank of ``layer.ep_group``)."""
    sd = layer.state_dict()
    size = layer.ep_size
    for key in EXPERT_PARAMS:
        shard = sd[key].contiguous()
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard, group=layer.ep_group)
        sd[key] = torch.cat(parts, dim=0)
    return sd


def load_full_hook(layer, state_dict, prefix, *args, **kwargs) -> None:
    """``load_state_dict`` pre-hook: a single-GPU checkpoint's expert tensors (``E`` experts)
    are sliced to this rank's ``E_l``; a shard of the right size loads as is."""
    for name in EXPERT_PARAMS:
        key = prefix + name
        v = state_dict.get(key)
        if v is not None and v.shape[0] == layer.num_experts != layer.num_local_experts:
            n = layer.num_local_experts
            state_dict[key] = v[layer.ep_rank * n:(layer.ep_rank + 1) * n]
