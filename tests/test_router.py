"""The router (`moe_mxfp8.router`): the GPU operator ``moe_mxfp8::route_scores``
(`kernels.router_triton`) against the PyTorch composition `route_reference`, forward and
backward, both score functions, with and without renormalisation, non-finite tokens, no tokens,
one expert, more experts than one power-of-two step.

CPU: fake shapes (CI); the kernels in Triton's interpreter and compiled for sm_90 without
spills (where Triton is installed). GPU (``-m gpu``): the compiled kernels on the device."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_mxfp8 import router as R
from moe_mxfp8.config import SCORE_FUNCS
from tests.compare import sqnr_db
from tests.triton_sm90 import interpreter_only, run_check_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (T, k, E): the layer's top-2 of 8 and top-8 of 128; one token; no tokens; one expert; k = E;
# 300 experts (a 512-wide expert axis)
SHAPES = [(37, 2, 8), (50, 8, 128), (1, 1, 4), (0, 2, 6), (5, 1, 1), (33, 5, 5), (20, 4, 300)]
# the weights and the loss: the same fp32 formulas, sums maybe in another order (the logits'
# gradient cancels in s * (g - sum(g * s)): an absolute floor at its O(1) scale)
FWD_RTOL = 2e-6
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


@contextlib.contextmanager
def _kernels_chosen(on: bool):
    """`stages.use_triton` answering ``on`` for every tensor and backend (the layer's router,
    layout and row kernels on, in the interpreter, or off)."""
    from moe_mxfp8 import stages as ST

    saved = ST.use_triton
    ST.use_triton = lambda _t, _backend: on  # noqa: E731
    try:
        yield
    finally:
        ST.use_triton = saved


def _spaced_logits(gen, t, e):
    """Random logits whose scores cannot tie in fp32: each row a random order of E values
    spaced 6/E apart over [-3, 3], plus a random offset (sigmoid scores near 1 stay
    distinguishable; plain normal logits put a few per run within an ulp of each other there,
    where the two implementations' last bits then pick either)."""
    order = torch.argsort(torch.rand(t, e, generator=gen), dim=1).float()
    return (order - (e - 1) / 2) * (6 / e) + torch.randn(t, 1, generator=gen)


def _compare(gen, device, t, k, e, score_func, renormalize, nonfinite=()):
    logits = _spaced_logits(gen, t, e)
    for row, value in nonfinite:
        logits[row, row % e] = value
    logits = logits.to(device)
    scale = 0.01 * e
    ref_in, got_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref, ref_bad = R.route_reference(ref_in, k, score_func, renormalize, scale)
    got, got_bad = R.route(got_in, k, score_func, renormalize, scale, kernels=True)
    what = (t, k, e, score_func, renormalize)
    # Spaced logits: no two scores of a token tie, so both pick the same experts in order
    assert torch.equal(got.expert_ids, ref.expert_ids), what
    assert torch.equal(got.counts, ref.counts) and got.counts.dtype == torch.int64, what
    assert torch.equal(got_bad, ref_bad) and got_bad.dtype == torch.int64, what
    torch.testing.assert_close(got.weights, ref.weights, rtol=FWD_RTOL, atol=0, equal_nan=True)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=FWD_RTOL, atol=0,
                               equal_nan=True)
    dw = torch.randn(t, k, generator=gen).to(device)
    daux = torch.randn((), generator=gen).to(device)
    for use_w, use_aux in ((True, True), (True, False), (False, True)):
        grads = []
        for out, x in ((ref, ref_in), (got, got_in)):
            x.grad = None
            outs = [o for o, on in ((out.weights, use_w), (out.aux_loss, use_aux)) if on]
            torch.autograd.backward(outs, [g for g, on in ((dw, use_w), (daux, use_aux)) if on],
                                    retain_graph=True)
            grads.append(x.grad)
        torch.testing.assert_close(grads[1], grads[0], equal_nan=True, **GRAD_TOL)


def check_router_kernels(gen, device):
    """Every shape and mode on ``device``, plus a batch with NaN, +Inf and -Inf tokens."""
    for score_func, renormalize in itertools.product(SCORE_FUNCS, (True, False)):
        for t, k, e in SHAPES:
            _compare(gen, device, t, k, e, score_func, renormalize)
        _compare(gen, device, 40, 2, 8, score_func, renormalize,
                 nonfinite=((3, float("nan")), (7, float("inf")), (9, -float("inf"))))
    # exact ties: the lower expert ids first, every run
    logits = torch.zeros(6, 8, device=device)
    routing, _ = R.route(logits, 3, "softmax", True, 0.08, kernels=True)
    assert torch.equal(routing.expert_ids.cpu(), torch.arange(3).expand(6, 3))
    assert torch.equal(routing.weights.cpu(), torch.full((6, 3), 1 / 3))


def check_layer_on_the_kernels(gen, device):
    """`MXFP8MoE` forward + backward (loss: output and aux loss) with the data path's kernels
    (router, routing layout, row kernels; the reference GEMMs) against the same layer on the
    compositions: the same tokens per expert, and every output and gradient within fp32
    rounding of the router's sums (1e-6 of its largest magnitude) -- except where a last bit
    of the router's crossed a BF16 rounding downstream (``bf16(w)`` in the combine, the
    logits' gradient in BF16 for the input gradient, the BF16 products the weight gradients
    sum): at most 1 % of the elements, and the tensor at 60 dB SQNR or better (a few BF16 ulps
    in a few elements give 70-100 dB; a wrong formula, well under 40)."""
    from moe_mxfp8 import MXFP8MoE

    bf16 = torch.bfloat16
    for precision, score_func in (("bf16", "softmax"), ("mxfp8", "sigmoid")):
        torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        m = MXFP8MoE(64, 96, 6, 2, precision=precision, score_func=score_func,
                     backend="reference", device=device)
        x = torch.randn(50, 64, generator=gen).to(bf16).to(device)
        dy = torch.randn(50, 64, generator=gen).to(bf16).to(device)
        runs = []
        for on in (False, True):
            with _kernels_chosen(on):
                m.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                y = m(xi)
                ((y.float() * dy.float()).sum() + m.aux_loss).backward()
            runs.append((m.tokens_per_expert.clone(), y.detach(), xi.grad, m.aux_loss.detach(),
                         *(p.grad for p in m.parameters())))
        (counts, *ref), (got_counts, *got) = runs
        assert torch.equal(got_counts, counts), (precision, score_func)
        for a, b in zip(got, ref, strict=True):
            a, b = a.float(), b.float()
            diff, floor = (a - b).abs(), 1e-6 * float(b.abs().max())
            off = int((diff > floor).sum())
            assert off <= max(1, b.numel() // 100), (precision, score_func, off)
            assert off == 0 or sqnr_db(b, a) >= 60.0, (precision, score_func, sqnr_db(b, a))


def check_raise_mode_compiled(gen, device):
    """``check_finite="raise"`` on the kernels under ``torch.compile`` (``aot_eager``, whose
    dead-code pass drops an operator nobody reads, as inductor's does): the check's operator,
    whose rows the kernel path does not need, stays in the graph and raises."""
    from moe_mxfp8 import MXFP8MoE, NonFiniteInputError

    torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
    layer = MXFP8MoE(64, 96, 4, 2, precision="bf16", backend="reference", device=device,
                     check_finite="raise")
    x = torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16).to(device)
    bad = x.clone()
    bad[1, 5, 0] = float("nan")
    torch._dynamo.reset()
    try:
        with _kernels_chosen(True):
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
            assert torch.isfinite(compiled(x)).all()
            with pytest.raises(NonFiniteInputError, match="not finite for 1 token"):
                compiled(bad)
    finally:
        torch._dynamo.reset()


def test_fake_shapes_are_the_references(gen):
    """What torch.compile traces: the operators' fake outputs have the shapes and dtypes of the
    composition's (and of what backward needs)."""
    for t, k, e in SHAPES:
        logits = torch.randn(t, e, generator=gen)
        ref, bad = R.route_reference(logits, k, "softmax", True, 0.1)
        with FakeTensorMode() as mode:
            out = torch.ops.moe_mxfp8.route_scores(mode.from_tensor(logits), k, False, True, 0.1)
            dlogits = torch.ops.moe_mxfp8.route_scores_backward(
                out[0], out[3], out[5], out[1], out[6], out[7], False, True, 0.1)
        for a, b in zip(out[:5], (*ref, bad), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert out[5].shape == (t, e) and out[6].shape == (t,) and out[7].shape == (e,)
        assert dlogits.shape == logits.shape and dlogits.dtype == torch.float32


def test_route_off_the_kernels_is_the_reference(gen):
    logits = torch.randn(20, 8, generator=gen)
    got, got_bad = R.route(logits, 2, "sigmoid", False, 0.08, kernels=False)
    ref, ref_bad = R.route_reference(logits, 2, "sigmoid", False, 0.08)
    assert all(torch.equal(a, b) for a, b in zip((*got, got_bad), (*ref, ref_bad), strict=True))


@interpreter_only
def test_kernels_interpreter(gen):
    run_check_interpreted("tests.test_router:check_router_kernels", gen)


@interpreter_only
def test_layer_on_the_kernels_interpreter(gen):
    run_check_interpreted("tests.test_router:check_layer_on_the_kernels", gen)


@interpreter_only
def test_raise_mode_compiled_interpreter(gen):
    run_check_interpreted("tests.test_router:check_raise_mode_compiled", gen)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8), (300, 4), (1500, 8)])
def test_kernels_compile_for_sm90_without_spills(experts, top_k, tmp_path):
    """Each kernel builds for sm_90 (IEEE division, libdevice expf as PyTorch's kernels; no
    atomics) and keeps its tiles in registers."""
    from moe_mxfp8.kernels import router_triton as K

    from tests.triton_sm90 import check_sm90_builds

    ep = K.expert_width(experts)
    flags = {"SIGMOID": False, "RENORM": True, "EP": ep, "INTERP": False}
    kernels = [
        (K._route_fwd_kernel, {**flags, "K": top_k, "TB": K.tokens_per_program(ep)}),
        (K._route_reduce_kernel, {"EP": ep, "CR": K.reduce_rows(ep), "INTERP": False}),
        (K._route_bwd_kernel, {**flags, "K": top_k, "HAS_DW": True, "HAS_DAUX": True,
                               "TB": K.tokens_per_program(ep, backward=True)}),
    ]
    # no atomics; IEEE division (Triton's `/` is the approximate div.full)
    check_sm90_builds(kernels, 4, tmp_path, f"{experts} experts",
                      ("atom.", "div.full"))


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("sigmoid,renormalize", [(False, True), (True, False), (True, True)])
def test_score_sum_clamps_keep_nan(sigmoid, renormalize):
    """Every ``max(sum, FLT_MIN)`` of the router keeps a NaN (PTX ``max.NaN.f32``), as the
    reference's ``clamp_min`` does: the GPU's plain ``max.f32`` returns FLT_MIN for a NaN token's
    score sum, and its loss probabilities and gradients come out finite where the reference's
    are NaN. Triton's interpreter propagates NaN either way, so only the build can tell."""
    from moe_mxfp8.kernels import router_triton as K

    from tests.triton_sm90 import compile_for_sm90

    ep = K.expert_width(8)
    flags = {"SIGMOID": sigmoid, "RENORM": renormalize, "EP": ep, "INTERP": False, "K": 2}
    fwd = compile_for_sm90(K._route_fwd_kernel, {**flags, "TB": K.tokens_per_program(ep)},
                           4).asm["ptx"]
    bwd = compile_for_sm90(K._route_bwd_kernel, {**flags, "HAS_DW": True, "HAS_DAUX": True,
                                                 "TB": K.tokens_per_program(ep, True)},
                           4).asm["ptx"]
    for name, ptx in (("forward", fwd), ("backward", bwd)):
        assert "max.NaN.f32" in ptx, name
        # the softmax forward's row maximum may drop a NaN (the row is NaN either way)
        if sigmoid or name == "backward":
            assert "max.f32" not in ptx, name


@pytest.mark.gpu
@cuda
def test_gpu_kernels_match_the_reference(gen):
    check_router_kernels(gen, "cuda")


@pytest.mark.gpu
@cuda
def test_gpu_layer_on_the_kernels(gen):
    check_layer_on_the_kernels(gen, "cuda")
