"""The router: token features -> routing weights, expert ids, tokens per expert and the
load-balancing loss (`MXFP8MoE.route`; the same for both precisions and every backend's layer).

``logits = x @ W^T`` in fp32 (`router_logits`), then, per token: ``softmax`` or ``sigmoid``
scores, the top-k experts (descending), their scores as weights (renormalised over the k if
asked), and over the batch the load-balancing loss ``aux_scale * sum_e f_e * P_e`` (``f_e`` the
share of the (token, slot) pairs routed to expert e, ``P_e`` the mean probability of e: the
softmax scores, or the sigmoid scores over their row sum). A token with a NaN or Inf logit goes
to experts ``0..k-1`` (fixed stand-in scores: the same choice on every backend) with NaN
weights, and is counted in ``nonfinite``.

Two implementations of that: `route_reference`, the PyTorch composition with autograd (CPU and
the references), and on a GPU with Triton the operator ``moe_mxfp8::route_scores`` (three
launches a step instead of some forty ops, `kernels.router_triton`, autograd by its own backward
kernel). They agree to fp32 rounding (sums may add in another order); an exact tie between two
experts' scores goes to the lower id in the kernel, to whichever ``torch.topk`` returns in the
composition.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .op_library import define_op

TINY = torch.finfo(torch.float32).tiny  # guards score sums that underflow to 0 (sigmoid)


# torch.mm(a, b, out_dtype=torch.float32) for BF16 a, b: a CUDA kernel (cuBLAS, fp32 accumulation)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class _RouterLogits(torch.autograd.Function):
    """Router logits ``x @ W^T`` (T, E) fp32 for BF16 ``x`` and ``W`` on CUDA.

    A product of two BF16 values is exact in fp32, so one BF16 GEMM with fp32 accumulation and
    fp32 output gives the logits of the fp32 router (``F.linear(x.float(), W.float())``) up to
    the order of its fp32 sums, without the fp32 copy of ``x`` that the fp32 GEMM reads, keeps
    for backward and reads again (docs/design/datapath.md, "Router"). Backward rounds the
    logits' gradient (T, E) to BF16 once and runs two BF16 GEMMs with fp32 accumulation: ``dx``
    in BF16 (x's dtype), ``dW`` in W's.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        dx = torch.mm(g, w) if ctx.needs_input_grad[0] else None
        dw = torch.mm(g.t(), x) if ctx.needs_input_grad[1] else None
        return dx, dw


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x (T, D) @ w (E, D)^T`` -> (T, E) fp32 logits, fp32 accumulation: `_RouterLogits` for
    BF16 inputs on CUDA, else the fp32 GEMM of the upcast inputs."""
    if x.is_cuda and _MM_OUT_DTYPE and x.dtype == w.dtype == torch.bfloat16:
        return _RouterLogits.apply(x, w)
    return F.linear(x.float(), w.float())


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens (`MXFP8MoE.route`; what a dispatcher takes)."""

    weights: Tensor  # (T, k) fp32 routing weights (NaN for a non-finite token), in the graph
    expert_ids: Tensor  # (T, k) int64 global expert ids
    counts: Tensor  # (E,) int64 (token, slot) pairs per global expert
    aux_loss: Tensor  # fp32 scalar, in the graph


def nonfinite_rows(logits: Tensor) -> Tensor:
    """``(T,)`` bool: the rows of ``logits (T, E)`` holding NaN or Inf. ``v * 0`` is 0 for a
    finite ``v`` and NaN for NaN and Inf, so a row's sum of them is NaN exactly where the row
    has one: three ops, where ``~isfinite(logits).all(-1)`` dispatches six (on a GPU each is a
    launch, ~30 us of host time)."""
    return (logits * 0).sum(dim=-1).isnan()


def route_reference(logits: Tensor, top_k: int, score_func: str, renormalize: bool,
                    aux_scale: float, bad: Tensor | None = None) -> tuple[Routing, Tensor]:
    """The router as a PyTorch composition (autograd through its ops): ``logits (T, E)`` fp32
    -> (`Routing`, the count of non-finite tokens (int64 scalar)). ``bad``: the non-finite rows
    if already known (`nonfinite_rows`)."""
    t, e = logits.shape
    if bad is None:
        bad = nonfinite_rows(logits.detach())
    if score_func == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    else:
        scores = logits.sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True).clamp_min(TINY)
    # A non-finite token picks experts 0..k-1 (descending stand-in scores: no ties, so the
    # same experts on every backend; top-k of NaN scores is not specified) with NaN weights:
    # its own output is NaN, and no other token's rows or routing change.
    stand_in = torch.arange(0, -e, -1, dtype=scores.dtype, device=scores.device)
    expert_ids = torch.where(bad[:, None], stand_in, scores.detach()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(TINY)
    weights = weights.masked_fill(bad[:, None], math.nan)
    # Tokens per expert by scatter_add: bincount reads its max on the host (a sync on CUDA)
    # and has a data-dependent shape; this has neither.
    flat_ids = expert_ids.reshape(-1)
    counts = torch.zeros(e, dtype=torch.int64, device=logits.device)
    counts = counts.scatter_add(0, flat_ids, torch.ones_like(flat_ids))
    # Load balance: aux_scale * sum_e f_e * P_e, with f_e = counts_e / (T k) (no gradient).
    frac = counts.to(torch.float32) / max(t * top_k, 1)
    mean_prob = probs.mean(dim=0) if t > 0 else probs.sum(dim=0)
    aux = aux_scale * (frac * mean_prob).sum()
    return Routing(weights, expert_ids, counts, aux), bad.sum()


def _kernels():
    """`kernels.router_triton`; imported on the first GPU call (it needs Triton)."""
    from .kernels import router_triton

    return router_triton


@define_op("moe_mxfp8::route_scores")
def _route_scores(logits: Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                  aux_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                             Tensor, Tensor]:
    """`route_reference` on the GPU (`kernels.router_triton`): ``weights, expert_ids, counts,
    aux, nonfinite`` and, for backward, ``scores (T, E)`` fp32, ``bad (T,)`` int8 and ``frac
    (E,)`` fp32."""
    return _kernels().route_forward(logits, top_k, sigmoid, renormalize, aux_scale)


@_route_scores.register_fake
def _route_scores_fake(logits, top_k, sigmoid, renormalize, aux_scale):
    t, e = logits.shape
    i64 = torch.int64
    return (logits.new_empty(t, top_k), logits.new_empty(t, top_k, dtype=i64),
            logits.new_empty(e, dtype=i64), logits.new_empty(()), logits.new_empty((), dtype=i64),
            logits.new_empty(t, e), logits.new_empty(t, dtype=torch.int8), logits.new_empty(e))


@define_op("moe_mxfp8::route_scores_backward")
def _route_scores_backward(dweights: Tensor | None, daux: Tensor | None, scores: Tensor,
                           expert_ids: Tensor, bad: Tensor, frac: Tensor, sigmoid: bool,
                           renormalize: bool, aux_scale: float) -> Tensor:
    """The logits' gradient of `route_scores` (`kernels.router_triton`)."""
    return _kernels().route_backward(dweights, daux, scores, expert_ids, bad, frac, sigmoid,
                                     renormalize, aux_scale)


@_route_scores_backward.register_fake
def _route_scores_backward_fake(dweights, daux, scores, expert_ids, bad, frac, sigmoid,
                                renormalize, aux_scale):
    return torch.empty_like(scores)


def _route_scores_setup(ctx, inputs, output) -> None:
    _, _, sigmoid, renormalize, aux_scale = inputs
    ctx.cfg = (sigmoid, renormalize, aux_scale)
    ctx.set_materialize_grads(False)  # no gradient of the loss or the weights: none computed
    _, ids, _, _, _, scores, bad, frac = output
    ctx.save_for_backward(scores, ids, bad, frac)


def _route_scores_grad(ctx, dweights, _ids, _counts, daux, *_unused):
    if dweights is None and daux is None:
        return None, None, None, None, None
    dlogits = torch.ops.moe_mxfp8.route_scores_backward(dweights, daux, *ctx.saved_tensors,
                                                        *ctx.cfg)
    return dlogits, None, None, None, None


_route_scores.register_autograd(_route_scores_grad, setup_context=_route_scores_setup)


def route(logits: Tensor, top_k: int, score_func: str, renormalize: bool, aux_scale: float,
          kernels: bool, bad: Tensor | None = None) -> tuple[Routing, Tensor]:
    """``logits (T, E)`` fp32 -> (`Routing`, non-finite tokens (int64 scalar)): on ``kernels``
    (CUDA with Triton, the data path's kernels in use) the operator
    ``moe_mxfp8::route_scores`` (which finds the non-finite rows itself), else
    `route_reference` (``bad``: those rows, if already known)."""
    if not kernels:
        return route_reference(logits, top_k, score_func, renormalize, aux_scale, bad)
    weights, ids, counts, aux, nonfinite, *_ = torch.ops.moe_mxfp8.route_scores(
        logits.contiguous(), top_k, score_func == "sigmoid", renormalize, aux_scale)
    if bad is not None:
        # The count of the rows already checked (``check_finite="raise"``: none, or it raised):
        # it keeps that check in a compiled graph, where an operator whose output nobody reads
        # is dead code and would be dropped.
        nonfinite = bad.sum()
    return Routing(weights, ids, counts, aux), nonfinite
