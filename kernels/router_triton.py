"""Triton kernels of the router (`moe_mxfp8.router`): fp32 logits ``(T, E)`` -> routing weights,
expert ids, tokens per expert and the load-balancing loss, and that loss's and the weights'
gradient back to the logits -- three launches a step where the PyTorch composition (the
reference, `router.route_reference`, and the CPU path) dispatches about forty small ops.

Forward, one program per ``TB`` tokens over the whole expert axis (``EP``, the expert count
rounded up to a power of two; padding experts take no part):

* a token is non-finite when any of its logits is NaN or Inf; it goes to experts ``0..k-1``
  with NaN weights (the reference's stand-in scores), and counts in ``nonfinite``;
* scores: ``softmax`` (``exp(x - max) / sum``) or ``sigmoid`` (``1 / (1 + exp(-x))``), libdevice
  ``expf`` and IEEE division as PyTorch's CUDA kernels; the probabilities of the loss are the
  softmax scores, or the sigmoid scores over their row sum (at least FLT_MIN);
* top-k by k rounds of arg-max (ties to the lower expert id, so identical scores pick the same
  experts on every run), the weights the chosen scores, renormalised over the k if asked;
* per program, the column sums of the probabilities and the count of each expert's picks
  (fixed order, no atomics); one more program adds them up in program order: ``counts``
  (int64), ``frac = counts / (T k)``, ``aux = aux_scale * sum_e frac_e * mean_t(probs)``.

Backward, one program per ``TB`` tokens: the weights' gradient through the renormalisation
(``clamp_min`` included) and the gather into score space, plus the loss's gradient through the
mean (and the sigmoid row sum), then through softmax (``s * (g - sum(g * s))``) or sigmoid
(``g * (1 - s) * s``) -- the formulas of PyTorch's autograd for the composition.

Numerics against the composition: the same formulas in fp32; sums over the experts (softmax
denominator, mean, loss) and over the k picks may add in another order, so values can differ in
the last bits and an exact tie between two experts' scores can pick the other one; the tests
compare with a tolerance and check the ids where no near-tie exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .datapath_triton import INTERPRET, _div, _exp
from .device import on_device

# A program's tile, tokens x experts, at most (forward: fewer programs for the one reducing
# them; backward: its per-token vectors of the k picks spill past these at 4 warps), and the
# partial sums (programs x experts) the reducing program adds per step
MAX_TOKENS_FWD, MAX_TOKENS_BWD = 64, 16
TILE_ELEMS_FWD, TILE_ELEMS_BWD = 2048, 1024
REDUCE_ELEMS = 8192
MIN_EXPERTS = 16  # the expert axis is at least this wide
# Triton types of the kernels' arguments for a build without a launch (the CPU tests' sm_90
# builds, tools/triton_sass.py): pointers not named here are uint8, other scalars int32
ARG_TYPES = {
    **{n: "*fp32" for n in ("logits_ptr", "scores_ptr", "w_ptr", "psum_ptr", "frac_ptr",
                            "aux_ptr", "dw_ptr", "daux_ptr", "dlogits_ptr")},
    "ids_ptr": "*i64", "counts_ptr": "*i64", "nonfinite_ptr": "*i64", "bad_ptr": "*i8",
    "pint_ptr": "*i32", "n_tokens": "fp32", "n_pairs": "fp32", "aux_scale": "fp32",
}
# torch.finfo(torch.float32).tiny: the floor of the score sums (the reference's clamp_min(TINY))
FLT_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _clamp_min_tiny(x):
    """``max(x, FLT_MIN)`` keeping NaN, as the reference's ``clamp_min(TINY)``: a NaN score sum
    (a NaN token's) stays NaN. Plain ``tl.maximum`` is the GPU's ``max.f32``, which returns the
    other operand for a NaN (while Triton's interpreter propagates it)."""
    return tl.maximum(x, FLT_MIN, propagate_nan=tl.PropagateNan.ALL)


def expert_width(num_experts: int) -> int:
    return max(MIN_EXPERTS, triton.next_power_of_2(num_experts))


def tokens_per_program(ep: int, backward: bool = False) -> int:
    """Tokens a program routes at expert width ``ep`` (forward: 64 at 16 experts, 16 at 128,
    4 at 512; backward at most 16)."""
    if backward:
        return max(2, min(MAX_TOKENS_BWD, TILE_ELEMS_BWD // ep))
    return max(2, min(MAX_TOKENS_FWD, TILE_ELEMS_FWD // ep))


def reduce_rows(ep: int) -> int:
    """Programs' partial sums the one reducing program adds per step (512 at 16 experts, 64 at
    128): its loop runs T / (tokens_per_program * reduce_rows) steps -- 2 at dsv3's 65536 tokens
    and 8 experts, 16 at qwen3's 16384 tokens and 128 experts."""
    return max(8, REDUCE_ELEMS // ep)


@triton.jit
def _scores(x, emask, SIGMOID: tl.constexpr, INTERP: tl.constexpr):
    """``(TB, EP)`` fp32 logits -> (scores, loss probabilities, row sum of the sigmoid scores);
    padding experts (``emask`` off) score 0."""
    if SIGMOID:
        s = _div(1.0, 1.0 + _exp(-x, INTERP), INTERP)
        s = tl.where(emask, s, 0.0)
        ssum = tl.sum(s, axis=1)
        return s, _div(s, _clamp_min_tiny(ssum)[:, None], INTERP), ssum
    else:
        xm = tl.where(emask, x, -float("inf"))
        ex = tl.where(emask, _exp(xm - tl.max(xm, axis=1)[:, None], INTERP), 0.0)
        s = _div(ex, tl.sum(ex, axis=1)[:, None], INTERP)
        return s, s, tl.sum(s, axis=1)


@triton.jit
def _token_tile(pid, T, E, EP: tl.constexpr, TB: tl.constexpr):
    """Program ``pid``'s tokens ``t (TB,)`` and experts ``e (EP,)``, their masks (tokens,
    experts ``(1, EP)``, both ``(TB, EP)``) and the ``(TB, EP)`` offsets into a ``(T, E)``
    row-major tensor."""
    t = pid * TB + tl.arange(0, TB)
    e = tl.arange(0, EP)
    tmask = t < T
    emask2 = (e < E)[None, :]
    return t, e, tmask, emask2, tmask[:, None] & emask2, t.to(tl.int64)[:, None] * E + e[None, :]


@triton.jit(do_not_specialize=["T"])  # one build for every token count
def _route_fwd_kernel(logits_ptr, scores_ptr, w_ptr, ids_ptr, bad_ptr, psum_ptr, pint_ptr,
                      T, E, K: tl.constexpr, SIGMOID: tl.constexpr,
                      RENORM: tl.constexpr, EP: tl.constexpr, TB: tl.constexpr,
                      INTERP: tl.constexpr):
    pid = tl.program_id(0)
    t, e, tmask, emask2, m2, off = _token_tile(pid, T, E, EP, TB)
    x = tl.load(logits_ptr + off, mask=m2, other=0.0)
    # NaN or Inf: x - x is NaN exactly there
    bad = tl.sum(tl.where(m2 & ((x - x) != 0.0), 1, 0), axis=1) > 0
    s, p, _ = _scores(x, emask2, SIGMOID, INTERP)
    tl.store(scores_ptr + off, s, mask=m2)
    # a non-finite token ranks the experts by descending stand-in scores 0, -1, -2, ...
    key = tl.where(bad[:, None], -e[None, :].to(tl.float32), s)
    key = tl.where(emask2, key, -float("inf"))
    cnt = tl.zeros((EP,), dtype=tl.int32)
    wsum = tl.zeros((TB,), dtype=tl.float32)
    for j in tl.static_range(K):
        pick = tl.argmax(key, axis=1, tie_break_left=True)
        hot = e[None, :] == pick[:, None]
        g = tl.sum(tl.where(hot, s, 0.0), axis=1)
        wsum += g
        tl.store(w_ptr + t * K + j, g, mask=tmask)
        tl.store(ids_ptr + t * K + j, pick.to(tl.int64), mask=tmask)
        cnt += tl.sum(tl.where(hot & tmask[:, None], 1, 0), axis=0)
        key = tl.where(hot, -float("inf"), key)
    if RENORM:
        c = _clamp_min_tiny(wsum)
        for j in tl.static_range(K):
            g = tl.load(w_ptr + t * K + j, mask=tmask, other=0.0)
            tl.store(w_ptr + t * K + j, _div(g, c, INTERP), mask=tmask)
    for j in tl.static_range(K):  # the non-finite tokens' weights are NaN
        tl.store(w_ptr + t * K + j, float("nan"), mask=tmask & bad)
    tl.store(bad_ptr + t, bad.to(tl.int8), mask=tmask)
    # the program's partial sums: probabilities; picks per expert, then non-finite tokens
    tl.store(psum_ptr + pid * EP + e, tl.sum(tl.where(m2, p, 0.0), axis=0))
    tl.store(pint_ptr + pid * EP + e, cnt)
    tl.store(pint_ptr + tl.num_programs(0) * EP + pid, tl.sum(tl.where(tmask & bad, 1, 0), axis=0))


@triton.jit(do_not_specialize=["NP"])
def _route_reduce_kernel(psum_ptr, pint_ptr, counts_ptr, frac_ptr, aux_ptr, nonfinite_ptr, NP,
                         E, n_tokens, n_pairs, aux_scale, EP: tl.constexpr,
                         CR: tl.constexpr, INTERP: tl.constexpr):
    e = tl.arange(0, EP)
    psum = tl.zeros((EP,), dtype=tl.float32)
    cnt = tl.zeros((EP,), dtype=tl.int32)
    nbad = tl.zeros((CR,), dtype=tl.int32)
    p0 = 0
    while p0 < NP:  # a while loop: Triton's interpreter cannot take a runtime range bound
        r = p0 + tl.arange(0, CR)
        rmask = r < NP
        psum += tl.sum(tl.load(psum_ptr + r[:, None] * EP + e[None, :], mask=rmask[:, None],
                               other=0.0), axis=0)
        cnt += tl.sum(tl.load(pint_ptr + r[:, None] * EP + e[None, :], mask=rmask[:, None],
                              other=0), axis=0)
        nbad += tl.load(pint_ptr + NP * EP + r, mask=rmask, other=0)
        p0 += CR
    emask = e < E
    frac = _div(cnt.to(tl.float32), n_pairs, INTERP)
    mean = _div(psum, n_tokens, INTERP)
    tl.store(counts_ptr + e, cnt.to(tl.int64), mask=emask)
    tl.store(frac_ptr + e, frac, mask=emask)
    tl.store(aux_ptr, aux_scale * tl.sum(tl.where(emask, frac * mean, 0.0), axis=0))
    tl.store(nonfinite_ptr, tl.sum(nbad, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["T"])
def _route_bwd_kernel(scores_ptr, ids_ptr, bad_ptr, dw_ptr, frac_ptr, daux_ptr, dlogits_ptr,
                      T, E, n_tokens, aux_scale, K: tl.constexpr, SIGMOID: tl.constexpr,
                      RENORM: tl.constexpr, HAS_DW: tl.constexpr, HAS_DAUX: tl.constexpr,
                      EP: tl.constexpr, TB: tl.constexpr, INTERP: tl.constexpr):
    t, e, tmask, emask2, m2, off = _token_tile(tl.program_id(0), T, E, EP, TB)
    s = tl.load(scores_ptr + off, mask=m2, other=0.0)
    ds = tl.zeros((TB, EP), dtype=tl.float32)
    if HAS_DW:
        bad = tl.load(bad_ptr + t, mask=tmask, other=1) != 0
        # the renormalisation w_j = g_j / max(sum g, FLT_MIN): its gradient needs sum g
        gsum = tl.zeros((TB,), dtype=tl.float32)
        if RENORM:
            for j in tl.static_range(K):
                pick = tl.load(ids_ptr + t * K + j, mask=tmask, other=0).to(tl.int32)
                gsum += tl.sum(tl.where(e[None, :] == pick[:, None], s, 0.0), axis=1)
        c = _clamp_min_tiny(gsum)
        dc = tl.zeros((TB,), dtype=tl.float32)
        if RENORM:  # d/dc of g_j / c: -dw_j * ((g_j / c) / c), summed over j
            for j in tl.static_range(K):
                pick = tl.load(ids_ptr + t * K + j, mask=tmask, other=0).to(tl.int32)
                g = tl.sum(tl.where(e[None, :] == pick[:, None], s, 0.0), axis=1)
                dw = tl.where(bad, 0.0, tl.load(dw_ptr + t * K + j, mask=tmask, other=0.0))
                dc += -dw * _div(_div(g, c, INTERP), c, INTERP)
            dc = tl.where(gsum >= FLT_MIN, dc, 0.0)
        for j in tl.static_range(K):
            pick = tl.load(ids_ptr + t * K + j, mask=tmask, other=0).to(tl.int32)
            dw = tl.where(bad, 0.0, tl.load(dw_ptr + t * K + j, mask=tmask, other=0.0))
            if RENORM:
                dw = _div(dw, c, INTERP) + dc
            ds += tl.where(e[None, :] == pick[:, None], dw[:, None], 0.0)
    if HAS_DAUX:
        # aux = aux_scale * sum_e frac_e * mean_t(probs[t, e])
        dmean = tl.load(daux_ptr) * aux_scale * tl.load(frac_ptr + e, mask=e < E, other=0.0)
        dp = _div(dmean, n_tokens, INTERP)[None, :]
        if SIGMOID:  # probs = s / max(sum s, FLT_MIN)
            ssum = tl.sum(s, axis=1)
            c2 = _clamp_min_tiny(ssum)[:, None]
            dc2 = tl.sum(tl.where(m2, -dp * _div(_div(s, c2, INTERP), c2, INTERP), 0.0), axis=1)
            dc2 = tl.where(ssum >= FLT_MIN, dc2, 0.0)
            ds += _div(dp, c2, INTERP) + dc2[:, None]
        else:
            ds += dp
    if SIGMOID:
        dx = ds * (1.0 - s) * s
    else:
        dx = s * (ds - tl.sum(tl.where(m2, ds * s, 0.0), axis=1)[:, None])
    tl.store(dlogits_ptr + off, dx, mask=m2)


# ---------------------------------------------------------------------------------------------
# Host wrappers (allocation and launch; argument checks live in moe_mxfp8.router)
# ---------------------------------------------------------------------------------------------


def _count(n: int) -> float:
    """A divisor of the loss: ``n``, at least 1 (the reference's ``max(n, 1)``; with no tokens
    the sums are 0), as the fp32 value PyTorch divides by."""
    return float(max(n, 1))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 gradient (what autograd hands over already: no op then)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def route_forward(logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                  aux_scale: float):
    """``logits (T, E)`` fp32 contiguous -> ``weights (T, k)`` fp32, ``ids (T, k)`` int64,
    ``counts (E,)`` int64, ``aux ()`` fp32, ``nonfinite ()`` int64, and for backward ``scores
    (T, E)`` fp32, ``bad (T,)`` int8, ``frac (E,)`` fp32."""
    t, e = logits.shape
    ep = expert_width(e)
    tb = tokens_per_program(ep)
    n_prog = triton.cdiv(t, tb)
    f32 = torch.float32
    scores = torch.empty_like(logits)
    weights = logits.new_empty(t, top_k)
    ids = logits.new_empty(t, top_k, dtype=torch.int64)
    bad = logits.new_empty(t, dtype=torch.int8)
    psum = logits.new_empty(n_prog * ep)  # per program: probability sums
    pint = logits.new_empty(n_prog * (ep + 1), dtype=torch.int32)  # picks, non-finite tokens
    counts = logits.new_empty(e, dtype=torch.int64)
    nonfinite = logits.new_empty((), dtype=torch.int64)
    frac = logits.new_empty(e, dtype=f32)
    aux = logits.new_empty((), dtype=f32)
    with on_device(logits.device):
        if n_prog:
            _route_fwd_kernel[(n_prog,)](
                logits, scores, weights, ids, bad, psum, pint, t, e, K=top_k, SIGMOID=sigmoid,
                RENORM=renormalize, EP=ep, TB=tb, INTERP=INTERPRET,
                num_warps=4)
        _route_reduce_kernel[(1,)](
            psum, pint, counts, frac, aux, nonfinite, n_prog, e, _count(t), _count(t * top_k),
            float(aux_scale), EP=ep, CR=reduce_rows(ep), INTERP=INTERPRET,
            num_warps=4)
    return weights, ids, counts, aux, nonfinite, scores, bad, frac


def route_backward(dweights: torch.Tensor | None, daux: torch.Tensor | None,
                   scores: torch.Tensor, ids: torch.Tensor, bad: torch.Tensor,
                   frac: torch.Tensor, sigmoid: bool, renormalize: bool,
                   aux_scale: float) -> torch.Tensor:
    """The logits' gradient ``(T, E)`` fp32 from the weights' ``(T, k)`` and the loss's
    (a 0-dim tensor) gradients, either of them None (no gradient)."""
    t, e = scores.shape
    k = ids.shape[1]
    dlogits = torch.empty_like(scores)
    ep = expert_width(e)
    tb = tokens_per_program(ep, backward=True)
    n_prog = triton.cdiv(t, tb)
    if n_prog == 0:
        return dlogits
    dw = scores if dweights is None else _f32(dweights)
    da = scores if daux is None else _f32(daux)
    with on_device(scores.device):
        _route_bwd_kernel[(n_prog,)](
            scores, ids, bad, dw, frac, da, dlogits, t, e, _count(t), float(aux_scale), K=k,
            SIGMOID=sigmoid, RENORM=renormalize, HAS_DW=dweights is not None,
            HAS_DAUX=daux is not None, EP=ep, TB=tb,
            INTERP=INTERPRET, num_warps=4)
    return dlogits
