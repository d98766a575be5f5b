"""Token dispatchers of `MXFP8MoE`: how a forward's routed (token, slot) pairs reach their
experts, and how the experts' outputs come back to their tokens, weighted and summed.

The layer's forward is one code path, with or without expert parallelism::

    check x (..., D) -> x_flat (T, D)
    route     layer.route(x_flat) -> `Routing`: weights (T, k), expert ids (T, k), counts (E,), aux
    experts   `Experts`: this process's expert weights and the forward's resolved options
    dispatch  layer.dispatcher.run(x_flat, routing, experts, shared) -> (T, D) BF16: the routed
              output plus the shared experts' (``shared``, if any)
    finish    x's dtype and shape

* `LocalDispatcher` (``ep_group=None``): every expert in this process. `datapath.route_layout`
  lays the pairs out expert-sorted and group-padded, `datapath.routed_experts` runs the fused
  dispatch (quantizing on the way), the expert GEMMs with SwiGLU, and the combine.
* `AllToAllDispatcher` (``ep_group=group``): expert parallelism over ``torch.distributed``
  (`moe_mxfp8.expert_parallel`: the plan, the MXFP8/BF16 payloads, the two exchanges). The pairs
  travel to their experts' ranks, the local experts run the same routed-expert block on the
  received rows, the outputs travel back in BF16 and are weighted on the source rank by the
  data path's combine stage (`stages.weighted_combine`), the single-process layer's math.

A dispatcher also owns ``check_finite="raise"``'s error (`nonfinite_rows_or_raise`): in one
process the batch's count is read; across an expert-parallel group it is summed over the group
first, so every rank raises together (one rank raising alone would leave the others waiting in
the next all-to-all).

`setup_layer` installs a layer's dispatcher (and its expert-parallel attributes) when the layer
is built. An `AllToAllDispatcher` holds the process group; its copies (``copy.deepcopy`` of the
layer: EMA and eval copies) share it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from typing import NamedTuple, TypeAlias

import torch
from torch import Tensor

from . import datapath as DP
from . import expert_parallel as EP
from . import routing as RT
from . import stages as ST
from .checks import COMPUTE_DTYPE, NonFiniteInputError
from .mx_tensor import MXFP8Tensor
from .op_library import define_op
from .router import Routing, nonfinite_rows


class Experts(NamedTuple):
    """This process's routed experts as one forward runs them (`MXFP8MoE`'s expert block)."""

    w_gate_up: Tensor  # (E_l, 2H, D) bf16
    w_down: Tensor  # (E_l, D, H) bf16
    precision: str
    backend: str
    wgrad: str
    scale_blocks: str  # the forward's resolved recipe ("1x32" for the BF16 twin)
    align: int  # rows each expert group starts on (1: packed, the BF16 twin)
    weights_q: tuple[MXFP8Tensor, MXFP8Tensor, MXFP8Tensor, MXFP8Tensor] | None  # cached FP8


def run_experts(x: Tensor, weights: Tensor, rows: Tensor, src: Tensor, offs: Tensor,
                experts: Experts, tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`datapath.routed_experts` with ``experts``' weights and options: ``x (T, D)`` bf16 ->
    ``(T, D)`` bf16 on the layout ``rows/src/offs`` (and its row tables, if given)."""
    return DP.routed_experts(
        x, experts.w_gate_up, experts.w_down, weights, rows, src, offs,
        precision=experts.precision, backend=experts.backend, wgrad=experts.wgrad,
        scale_blocks=experts.scale_blocks, weights_q=experts.weights_q, tables=tables,
    )


# ---------------------------------------------------------------------------------------------
# check_finite="raise"
# ---------------------------------------------------------------------------------------------


def nonfinite_error(who: str, count: int, of: str) -> NonFiniteInputError:
    """The one message of ``check_finite="raise"``: ``count`` tokens of ``of`` are not finite."""
    return NonFiniteInputError(
        f"{who}: router scores are not finite for {count} token(s) of {of} (NaN or Inf in the "
        "input or in router.weight)")


@define_op("moe_mxfp8::nonfinite_rows_or_raise")
def _nonfinite_rows_or_raise(logits: Tensor, who: str) -> Tensor:
    """``(T,)`` bool: rows of ``logits`` holding NaN/Inf; raises `NonFiniteInputError` if any
    (reads the count on the host). An operator, so that ``torch.compile`` (also with
    ``fullgraph=True``) calls it at run time and the same exception reaches the caller. Its
    output must feed the step (`router.route` counts it): a compiled graph drops an operator
    whose output nobody reads."""
    bad = nonfinite_rows(logits)
    count = int(bad.sum())
    if count:
        raise nonfinite_error(who, count, f"{logits.shape[0]} in this batch")
    return bad


@_nonfinite_rows_or_raise.register_fake
def _nonfinite_rows_or_raise_fake(logits, who):
    return logits.new_empty(logits.shape[0], dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


SharedExperts = Callable[[Tensor], Tensor]  # x (T, D) -> the shared experts' output (T, D) bf16


class LocalDispatcher:
    """Every expert in this process: the lean data path's fused dispatch, experts and combine
    (`moe_mxfp8.datapath`; every recipe and the BF16 twin). The dispatch writes the sorted,
    group-padded rows already quantized, SwiGLU and combine are fused with (de)quantization, the
    backward sums in a fixed order (deterministic)."""

    group = None  # no process group

    def run(self, x: Tensor, routing: Routing, experts: Experts,
            shared: SharedExperts | None = None) -> Tensor:
        """``x (T, D)`` this process's tokens -> ``(T, D)`` bf16: the routed output, plus
        ``shared(x)`` if given."""
        rows, src, offs, tables = DP.layout(routing.expert_ids, routing.counts, experts.align,
                                            experts.precision, experts.scale_blocks,
                                            experts.backend)
        out = run_experts(x.to(COMPUTE_DTYPE), routing.weights, rows, src, offs, experts, tables)
        return out if shared is None else out + shared(x)

    def nonfinite_rows_or_raise(self, logits: Tensor) -> Tensor:
        """``(T,)`` bool: tokens whose ``logits`` hold NaN/Inf; `NonFiniteInputError` if any."""
        return torch.ops.moe_mxfp8.nonfinite_rows_or_raise(logits, "MXFP8MoE")


# ---------------------------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------------------------


class AllToAllDispatcher:
    """Expert parallelism over ``group``: this rank's pairs travel to their experts' ranks and
    the outputs come back (`moe_mxfp8.expert_parallel`, docs/design/expert_parallel.md).

    ``payload`` (``"mxfp8"`` or ``"bf16"``): the tokens' dispatch; ``grad_payload``: the output
    gradient's dispatch in backward. Expert outputs and input gradients return in BF16.

    ``return_sms``: in backward the input gradients' return starts as soon as the local experts'
    dgrad has made them, beside the experts' weight-gradient GEMMs, which leave that many SMs
    free for it (`expert_parallel.RETURN_SMS`); None: the return waits for the whole expert
    block's backward.

    ``overlap_shared``: on a GPU, the shared experts (if any) run on a second CUDA stream,
    queued before the routing's host sync, so that their GEMMs -- forward, and through autograd,
    which runs each backward op on its forward op's stream, backward -- fill the time the GPU
    would spend waiting for the host and for the exchanges; False: after the routed experts, on
    the current stream. Either choice gives the same results bit for bit."""

    def __init__(self, group, payload: str, grad_payload: str,
                 return_sms: int | None = EP.RETURN_SMS, overlap_shared: bool = True) -> None:
        self.group = group
        self.payload = payload
        self.grad_payload = grad_payload
        self.return_sms = return_sms
        self.overlap_shared = overlap_shared

    def __deepcopy__(self, memo) -> AllToAllDispatcher:
        """Copies share the process group: a communicator is a handle, not state, and cannot
        be copied ("cannot pickle ProcessGroup"). Pickling still refuses it (save
        ``state_dict``s instead)."""
        new = copy.copy(self)
        memo[id(self)] = new
        return new

    def run(self, x: Tensor, routing: Routing, experts: Experts,
            shared: SharedExperts | None = None) -> Tensor:
        """``x (T, D)`` this rank's tokens (any count, 0 included) -> ``(T, D)`` bf16: the
        routed output, plus ``shared(x)`` if given. Collective: every rank of the group calls
        it."""
        side = (self.overlap_shared and shared is not None and x.is_cuda
                and not torch.compiler.is_compiling())
        if side:
            shared_out = _on_side_stream(shared, x)
        out = self._routed(x, routing, experts)
        if shared is None:
            return out
        if side:
            torch.cuda.current_stream(x.device).wait_stream(_side_stream(x.device))
            return out + shared_out
        return out + shared(x)

    def _routed(self, x: Tensor, routing: Routing, experts: Experts) -> Tensor:
        k = routing.expert_ids.shape[1]
        # the pairs in expert order with no padding: src[i] is the pair of sorted row i (the
        # stable sort), rows[t, j] the sorted row of pair (t, j)
        rows, src, offs, _ = RT.step_layout(routing.expert_ids, routing.counts, 1, None,
                                            ST.use_triton(routing.expert_ids, experts.backend))
        order = src.to(torch.int64)
        plan = EP.make_plan(routing.counts, self.group, experts.align)
        x_recv = EP.PairsToExperts.apply(x, order, k, plan, self.payload, experts.backend)
        early = self.return_sms is not None and x_recv.requires_grad
        with (DP.on_input_grad(functools.partial(EP.start_input_grad_return, plan,
                                                 sms=self.return_sms))
              if early else contextlib.nullcontext()):
            y_recv = self._local_experts(x_recv, plan, experts)  # (R, D)
        y_local = EP.OutputsToSources.apply(y_recv, plan, self.grad_payload, experts.backend)
        # From here on the single-process layer's combine stage: bf16(y * bf16(w)) summed over
        # k in fp32, in slot order, and its backward.
        return ST.weighted_combine(y_local, routing.weights, rows, src, offs,
                                   backend=experts.backend)

    @staticmethod
    def _local_experts(x_recv: Tensor, plan: EP.Plan, experts: Experts) -> Tensor:
        """The local experts on the received pairs ``(R, D)`` -> their outputs ``(R, D)`` bf16,
        on `LocalDispatcher`'s code path: the routed-expert block, each received pair a "token"
        with one slot of weight 1. Its dispatch lands row i at plan.land[i] (quantizing on the
        way), its combine returns y[land[i]] (bf16(y * 1) summed once: exact) -- and its
        backward takes dy rows as they come (bf16(dy * 1))."""
        r = x_recv.shape[0]
        ar = torch.arange(r, dtype=torch.int32, device=x_recv.device)
        src = torch.full((plan.rows,), -1, dtype=torch.int32, device=x_recv.device)
        src = src.index_put_((plan.land,), ar)
        ones = torch.ones(r, 1, dtype=torch.float32, device=x_recv.device)
        return run_experts(x_recv, ones, plan.land.to(torch.int32).view(r, 1), src, plan.offs,
                           experts)

    def nonfinite_rows_or_raise(self, logits: Tensor) -> Tensor:
        """``(T,)`` bool: tokens whose ``logits`` hold NaN/Inf; `NonFiniteInputError` on every
        rank if any rank of the group has one (a collective)."""
        bad = nonfinite_rows(logits)
        total = EP.group_sum(bad.sum(), self.group)
        if total:
            raise nonfinite_error("MXFP8MoE", total, "the expert-parallel group")
        return bad


Dispatcher: TypeAlias = LocalDispatcher | AllToAllDispatcher  # what `MXFP8MoE.dispatcher` holds

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # GPU index -> the shared experts' stream


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _on_side_stream(fn: SharedExperts, x: Tensor) -> Tensor:
    """``fn(x)`` queued on the GPU's second stream after what the current stream has queued
    (x's producers). The caching allocator is told that each stream uses the other's tensor
    (``record_stream``), so neither block is reused while the other stream may still read
    it; the caller makes the current stream wait for the side stream before reading the
    result."""
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)
    # A view made on the current stream: x's gradient from the side stream then arrives through
    # a node of the current stream, so a leaf x's AccumulateGrad (of the current stream) is not
    # fed from another stream (autograd warns of that, and syncs more).
    xs = x.view_as(x)
    with torch.cuda.stream(side):
        x.record_stream(side)
        out = fn(xs)
    out.record_stream(main)
    return out


def setup_layer(layer, group) -> int:
    """Install the dispatcher of an `MXFP8MoE` being built (`AllToAllDispatcher` over ``group``
    with the payloads of the layer's config, `LocalDispatcher` when None) with its
    expert-parallel attributes (``ep_size``, ``ep_rank``, ``num_local_experts``, the
    full-checkpoint load hook); returns its local expert count."""
    if group is None:
        layer.ep_size, layer.ep_rank = 1, 0
        layer.dispatcher = LocalDispatcher()
    else:
        layer.ep_size, layer.ep_rank = EP.group_info(group, layer.num_experts)
        layer.dispatcher = AllToAllDispatcher(group, layer.ep_payload, layer.ep_grad_payload)
        layer.register_load_state_dict_pre_hook(EP.load_full_hook)
    layer.num_local_experts = layer.num_experts // layer.ep_size
    return layer.num_local_experts
