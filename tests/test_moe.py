"""`MXFP8MoE` against its BF16 twin (``precision="bf16"``, ``torch._grouped_mm``), same weights.

The router runs in float32 in both, so both twins route every token identically; the difference
is the MXFP8 quantization of the expert GEMMs, which a SwiGLU MLP compounds. Measured per stage
(1024 tokens, D = H = 128, E = 8, k = 2; one E4M3 quantization of Gaussian data is 31.5 dB)::

    forward   h = x W_gu^T 28.5 dB -> a = silu(gate) * up 25.3 dB -> y = a W_down^T 23.6 dB
    backward  da (dgrad of down) 28.5 dB -> dh (SwiGLU backward on the noisy gate/up) 25.0 dB
              -> dx (dgrad of gate/up, two more quantized operands) 23.4 dB

So the input gradient lands where the output does (23.2-23.6 dB on every configuration tried).
The brief asked for 25 dB there, which no MXFP8 dgrad can reach once the gradient entering it is
at 25.0 dB; the bound below is 22.5 dB (see the report).

torchao's 25 dB comes from a torchtitan MoE with one shared expert, of which only the routed
experts ("experts") are converted to MXFP8 (test/prototype/moe_training/test_training.py). The
shared expert's BF16 output and input gradient are exact, which dilutes the routed experts' error.
That configuration (``num_shared_experts=1``, the same shapes as `CONFIGS`) is tested against the
issue's thresholds: out >= 23, input grad >= 25, param grads >= 21 dB. Measured on CPU
(2026-11-22, seeds 0-3 and 5 fresh runs; min-max over the six `CONFIGS`): out 27.9-30.8 dB, input
grad 27.2-30.3 dB, routed w_gate_up/w_down grads 23.3-25.3 dB, router 22.6-24.5 dB; the shared
expert's grads are bit-identical to the twin's (same BF16 ops on the same x and dy).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe_mxfp8 import MXFP8MoE, NonFiniteInputError
from tests.compare import sqnr_db

OUT_MIN_DB = 23.0
INPUT_GRAD_MIN_DB = 22.5  # no shared expert: measured 23.2-23.6 dB (see the module docstring)
SHARED_INPUT_GRAD_MIN_DB = 25.0  # one BF16 shared expert (torchao's setting): measured 27.2-30.3
PARAM_GRAD_MIN_DB = 21.0
COMPILE_MIN_DB = 40.0  # inductor (emulating eager's BF16 rounding) vs eager
BF16 = torch.bfloat16
PARAM_NAMES = ["router.weight", "w_gate_up", "w_down"]
SHARED_PARAM_NAMES = ["shared_w_gate_up", "shared_w_down"]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def rng(gen):
    """Fresh random data every run, module init included: the global RNG (parameter init) gets
    a seed drawn from `gen` (the data), so that the two streams are not the same numbers."""
    torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    return gen


def twins(dim, hidden, experts, top_k, device="cpu", seed=0, **kw):
    """An MXFP8 module and its BF16 twin holding the same weights (init seeded: the SQNR
    bounds hold with margin for the seeded weights; unseeded they would depend on test order)."""
    torch.manual_seed(seed)
    mx = MXFP8MoE(dim, hidden, experts, top_k, backend=kw.pop("backend", "reference"),
                  device=device, **kw)
    bf = MXFP8MoE(dim, hidden, experts, top_k, precision="bf16", device=device, **kw)
    bf.load_state_dict(mx.state_dict())
    return mx, bf


def fwd_bwd(module, x, dy):
    """Output, input grad and every parameter's grad for the loss ``<y, dy> + aux_loss``."""
    module.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    y = module(xa)
    ((y.float() * dy.float()).sum() + module.aux_loss).backward()
    params = getattr(module, "_orig_mod", module).named_parameters()
    return y, xa.grad, {n: p.grad for n, p in params}


def compare_twins(mx, bf, x, label, seed, input_grad_min_db=INPUT_GRAD_MIN_DB):
    dy = torch.randn_like(x)
    y, dx, pg = fwd_bwd(mx, x, dy)
    yr, dxr, pgr = fwd_bwd(bf, x, dy)
    assert torch.equal(mx.tokens_per_expert, bf.tokens_per_expert)  # identical routing
    torch.testing.assert_close(mx.aux_loss, bf.aux_loss, rtol=0, atol=0)
    assert sorted(pg) == sorted(pgr)
    db = {"out": sqnr_db(yr, y), "dx": sqnr_db(dxr, dx)}
    db.update({n: sqnr_db(pgr[n], pg[n]) for n in pg})
    print(f"MXFP8MoE vs BF16 twin [{label}] SQNR dB:", {k: round(v, 2) for k, v in db.items()})
    assert y.shape == x.shape and y.dtype == x.dtype and dx.shape == x.shape
    assert db["out"] >= OUT_MIN_DB, (db, seed)
    assert db["dx"] >= input_grad_min_db, (db, seed)
    for n in pg:
        assert db[n] >= PARAM_GRAD_MIN_DB, (n, db, seed)
    return pg, pgr


# (dim, hidden, experts, top_k, input shape, options). 1024 tokens: the router gradient's SQNR
# scatters most (std 0.4-0.5 dB at 1024 tokens, 0.7 dB at 384; min 22.3 dB over 180 runs).
CONFIGS = [
    (128, 128, 8, 2, (4, 256), {}),
    (128, 96, 8, 2, (2, 4, 128), {"score_func": "sigmoid"}),
    (256, 128, 4, 1, (1024,), {"score_func": "sigmoid", "renormalize": False}),
    (128, 64, 8, 4, (4, 256), {"renormalize": False, "aux_loss_coef": 0.1}),
    (128, 128, 6, 2, (1024,), {"wgrad": "bf16"}),
    (128, 128, 6, 2, (1024,), {"save_colwise": True}),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"E{c[2]}k{c[3]}-{c[4]}-{c[5]}")
def test_matches_bf16_twin(rng, cfg):
    dim, hidden, e, k, lead, opts = cfg
    mx, bf = twins(dim, hidden, e, k, **opts)
    x = torch.randn(*lead, dim, generator=rng).to(BF16)
    compare_twins(mx, bf, x, str(cfg), rng.initial_seed())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"E{c[2]}k{c[3]}-{c[4]}-{c[5]}")
def test_matches_bf16_twin_with_shared_expert(rng, cfg):
    """torchao's configuration: one BF16 shared expert beside the MXFP8 routed experts; the
    issue's thresholds (input grad >= 25 dB). The shared expert's grads are exact."""
    dim, hidden, e, k, lead, opts = cfg
    mx, bf = twins(dim, hidden, e, k, num_shared_experts=1, **opts)
    x = torch.randn(*lead, dim, generator=rng).to(BF16)
    pg, pgr = compare_twins(mx, bf, x, "shared " + str(cfg), rng.initial_seed(),
                            input_grad_min_db=SHARED_INPUT_GRAD_MIN_DB)
    assert sorted(pg) == sorted(PARAM_NAMES + SHARED_PARAM_NAMES)
    for n in SHARED_PARAM_NAMES:
        assert torch.equal(pg[n], pgr[n]), n


# 32x32 weight tiles: on Gaussian weights the tile's scale is at most ~1 binade coarser than a
# 1x32 block's, which E4M3's 17 binades absorb (12 of 295k elements differ at 512x256x192), so
# the module measures as with 1x32 (CPU, seeds 0-2, 2026-11-22): out 23.42-23.65 dB, input grad
# 23.32-23.48, routed param grads 23.3-25.3, router 22.6-24.5. Same bounds as 1x32.
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], CONFIGS[4]],
                         ids=lambda c: f"E{c[2]}k{c[3]}-{c[4]}-{c[5]}")
def test_weight_blocks_32x32_matches_bf16_twin(rng, cfg):
    dim, hidden, e, k, lead, opts = cfg
    mx, bf = twins(dim, hidden, e, k, weight_blocks="32x32", **opts)
    x = torch.randn(*lead, dim, generator=rng).to(BF16)
    compare_twins(mx, bf, x, "32x32 " + str(cfg), rng.initial_seed())


def test_uneven_routing_and_empty_expert(rng):
    """About 2x the mean load on expert 0, none on expert E-1: zero gradient for the idle one.

    Feature 0 of every token is a constant 2; router row 0 gets +0.5 and row E-1 gets -10 there.
    """
    dim, e = 128, 6
    mx, bf = twins(dim, 128, e, 2)
    with torch.no_grad():
        for m in (mx, bf):
            m.router.weight[0, 0] = 0.5
            m.router.weight[e - 1, 0] = -10.0
    x = torch.randn(8, 128, dim, generator=rng)
    x[..., 0] = 2.0
    pg, _ = compare_twins(mx, bf, x.to(BF16), "uneven", rng.initial_seed())
    counts = mx.tokens_per_expert
    assert counts[e - 1] == 0 and counts[0] > 1.5 * counts.sum() / e, counts
    assert torch.count_nonzero(pg["w_gate_up"][e - 1]) == 0
    assert torch.count_nonzero(pg["w_down"][e - 1]) == 0


def test_single_token_is_batch_invariant(rng):
    """A token's output does not depend on the other tokens (row-wise quantization of x and
    per-token routing), whatever the leading shape; also vs the twin (loosely: one row)."""
    dim = 256
    mx, bf = twins(dim, 256, 8, 2)
    x = torch.randn(5, dim, generator=rng).to(BF16)
    with torch.no_grad():
        y_batch = mx(x)
        for shape in [(dim,), (1, dim), (1, 1, dim)]:
            y1 = mx(x[2].reshape(shape))
            assert y1.shape == shape
            assert sqnr_db(y_batch[2], y1.reshape(-1)) >= 40.0
        assert sqnr_db(bf(x[2]), mx(x[2])) >= 18.0
    xa = x[:1].clone().requires_grad_()
    mx(xa).backward(torch.randn(1, dim, generator=rng).to(BF16))
    assert xa.grad.shape == (1, dim) and torch.isfinite(xa.grad.float()).all()


def test_zero_tokens():
    mx = MXFP8MoE(64, 64, 4, 2, backend="reference")
    x = torch.randn(2, 0, 64, dtype=BF16, requires_grad=True)
    y = mx(x)
    y.backward(torch.randn_like(y))
    assert y.shape == x.shape and mx.aux_loss.item() == 0.0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss(rng, score_func):
    dim, e, k, coef = 64, 8, 2, 0.05
    mx = MXFP8MoE(dim, 64, e, k, backend="reference", score_func=score_func, aux_loss_coef=coef)
    assert mx.aux_loss is None
    x = torch.randn(3, 50, dim, generator=rng).to(BF16)
    mx(x)
    aux = mx.aux_loss
    assert aux.dim() == 0 and aux.dtype == torch.float32 and aux.requires_grad
    # Recompute: E * sum_e f_e * P_e * coef.
    logits = x.reshape(-1, dim).float() @ mx.router.weight.float().t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    ids = scores.topk(k, dim=-1).indices
    f = torch.bincount(ids.reshape(-1), minlength=e).float() / ids.numel()
    p = scores / scores.sum(-1, keepdim=True)
    expect = coef * e * (f * p.mean(0)).sum()
    torch.testing.assert_close(aux, expect, rtol=1e-5, atol=1e-7)
    assert torch.equal(mx.tokens_per_expert, torch.bincount(ids.reshape(-1), minlength=e))
    # Perfectly uniform scores give exactly coef; the loss reaches only the router.
    with torch.no_grad():
        mx.router.weight.zero_()
    mx(x)
    torch.testing.assert_close(mx.aux_loss, torch.tensor(coef), rtol=1e-5, atol=0)
    mx.router.weight.data.normal_(generator=rng)
    mx(x)
    mx.aux_loss.backward()
    assert mx.router.weight.grad.abs().sum() > 0
    assert mx.w_gate_up.grad is None and mx.w_down.grad is None
    # A new forward replaces it.
    old = mx.aux_loss
    mx(x[:1])
    assert mx.aux_loss is not old


def test_state_dict_and_repr():
    mx = MXFP8MoE(64, 96, 4, 2, backend="reference")
    bf = MXFP8MoE(64, 96, 4, 2, precision="bf16")
    for m in (mx, bf):
        sd = m.state_dict()
        assert sorted(sd) == sorted(PARAM_NAMES)
        assert sd["router.weight"].shape == (4, 64)
        assert sd["w_gate_up"].shape == (4, 192, 64) and sd["w_down"].shape == (4, 64, 96)
        assert all(t.dtype == BF16 for t in sd.values())
    assert "precision='mxfp8'" in repr(mx) and "top_k=2" in repr(mx) and "wgrad=" in repr(mx)
    assert "precision='bf16'" in repr(bf) and "backend" not in repr(bf)
    assert "shared" not in repr(mx) and "weight_blocks" not in repr(mx)  # defaults stay quiet


def test_shared_experts_state_dict_and_repr():
    s, hidden = 2, 96
    mx = MXFP8MoE(64, hidden, 4, 2, backend="reference", num_shared_experts=s,
                  weight_blocks="32x32")
    bf = MXFP8MoE(64, hidden, 4, 2, precision="bf16", num_shared_experts=s)
    for m in (mx, bf):
        sd = m.state_dict()
        assert sorted(sd) == sorted(PARAM_NAMES + SHARED_PARAM_NAMES)
        # torchtitan: FeedForward(dim, hidden_dim * num_shared_experts)
        assert sd["shared_w_gate_up"].shape == (2 * s * hidden, 64)
        assert sd["shared_w_down"].shape == (64, s * hidden)
        assert m.shared_hidden_dim == s * hidden
        assert "num_shared_experts=2 (bf16)" in repr(m)
    assert "weight_blocks='32x32'" in repr(mx) and "weight_blocks" not in repr(bf)


def test_shared_expert_is_a_bf16_swiglu_added_to_the_routed_output(rng):
    """The module with a shared expert = the same module without it + a BF16 SwiGLU FFN."""
    dim, hidden = 64, 96
    mx = MXFP8MoE(dim, hidden, 4, 2, backend="reference", num_shared_experts=1)
    plain = MXFP8MoE(dim, hidden, 4, 2, backend="reference")
    plain.load_state_dict({n: t for n, t in mx.state_dict().items() if "shared" not in n})
    x = torch.randn(3, 40, dim, generator=rng).to(BF16)
    with torch.no_grad():
        gate, up = F.linear(x.reshape(120, dim), mx.shared_w_gate_up).chunk(2, dim=-1)
        shared = F.linear(F.silu(gate) * up, mx.shared_w_down).reshape(x.shape)
        assert torch.equal(mx(x), plain(x) + shared)


def test_init_std():
    dim, hidden, s = 256, 512, 2
    mx = MXFP8MoE(dim, hidden, 8, 2, backend="reference", num_shared_experts=s)
    for p, std in ((mx.router.weight, dim**-0.5), (mx.w_gate_up, dim**-0.5),
                   (mx.w_down, hidden**-0.5), (mx.shared_w_gate_up, dim**-0.5),
                   (mx.shared_w_down, (s * hidden)**-0.5)):
        assert abs(p.float().std().item() / std - 1) < 0.05
        assert abs(p.float().mean().item()) < 5 * std / p.numel() ** 0.5  # 5 sigma


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("src,dst", [("mxfp8", "mxfp8"), ("mxfp8", "bf16"), ("bf16", "mxfp8")])
def test_safetensors_roundtrip_and_cross_load(rng, tmp_path, src, dst, shared):
    kw = {"backend": "reference", "num_shared_experts": shared}
    torch.manual_seed(1)  # the parameters' init (else the SQNR below depends on test order)
    a = MXFP8MoE(128, 64, 4, 2, precision=src, **kw)
    path = tmp_path / "moe.safetensors"
    save_file(a.state_dict(), str(path))
    b = MXFP8MoE(128, 64, 4, 2, precision=dst, **kw)
    b.load_state_dict(load_file(str(path)))
    assert len(a.state_dict()) == len(PARAM_NAMES) + shared * len(SHARED_PARAM_NAMES)
    for name, t in a.state_dict().items():
        u = b.state_dict()[name]
        assert u.dtype == t.dtype and torch.equal(u.view(torch.int16), t.view(torch.int16))
    # 1024 tokens: the twins' SQNR on fresh data concentrates near its mean (about 23.5 dB
    # without shared experts); with 64 tokens one draw in some hundreds fell under the floor.
    x = torch.randn(1024, 128, generator=rng).to(BF16)
    with torch.no_grad():
        if src == dst:
            assert torch.equal(a(x), b(x))
        else:
            assert sqnr_db(a(x), b(x)) >= OUT_MIN_DB


def test_fp32_params_and_input(rng):
    """float32 parameters (master weights) and input: BF16 experts, float32 grads and output."""
    mx, bf = twins(128, 128, 4, 2, dtype=torch.float32)
    x = torch.randn(1024, 128, generator=rng)
    pg, _ = compare_twins(mx, bf, x, "fp32 params", rng.initial_seed())
    assert all(g.dtype == torch.float32 for g in pg.values())


@pytest.mark.parametrize("opts", [{}, {"num_shared_experts": 1, "weight_blocks": "32x32"}],
                         ids=["default", "shared-32x32"])
def test_compile_matches_eager(rng, opts):
    """torch.compile(module, fullgraph=True): no graph break inside the layer, same results.

    aot_eager (the traced graph run op by op) is bit-exact. Inductor fuses BF16 pointwise chains
    in fp32; a value one BF16 ulp away can round to the neighbouring E4M3 code, which makes
    default-config inductor differ from eager by 30-45 dB (far below the 23.5 dB of the MXFP8
    quantization itself). With ``emulate_precision_casts`` inductor rounds like eager: the
    expert weight grads are then bit-exact and the rest within BF16 rounding.
    """
    import torch._inductor.config as inductor_config  # imported here: slow, and only needed here

    dim = 64
    mx = MXFP8MoE(dim, 64, 4, 2, backend="reference", **opts)
    x = torch.randn(2, 24, dim, generator=rng).to(BF16)
    dy = torch.randn_like(x)
    y, dx, pg = fwd_bwd(mx, x, dy)
    aux = mx.aux_loss.detach()
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        with inductor_config.patch(emulate_precision_casts=True):
            cm = torch.compile(mx, fullgraph=True, backend=backend)
            yc, dxc, pgc = fwd_bwd(cm, x, dy)
        torch.testing.assert_close(mx.aux_loss.detach(), aux, rtol=1e-6, atol=0)
        assert sorted(pg) == sorted(pgc)
        pairs = [(y, yc), (dx, dxc)] + [(pg[n], pgc[n]) for n in pg]
        if backend == "aot_eager":
            assert all(torch.equal(a, b) for a, b in pairs)
        else:
            dbs = [sqnr_db(a, b) for a, b in pairs]
            print("compiled (inductor) vs eager SQNR dB:", [round(d, 1) for d in dbs])
            assert min(dbs) >= COMPILE_MIN_DB, dbs
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"top_k": 5}, ValueError, "top_k"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"dim": 48}, ValueError, "multiple of 32"),
        ({"hidden_dim": 80}, ValueError, "multiple of 32"),
        ({"precision": "fp8"}, ValueError, "precision"),
        ({"score_func": "relu"}, ValueError, "score_func"),
        ({"wgrad": "fp8"}, ValueError, "wgrad"),
        ({"dtype": torch.float64}, TypeError, "dtype"),
        ({"num_experts": 0}, ValueError, "num_experts"),
        ({"num_shared_experts": -1}, ValueError, "num_shared_experts"),
        ({"num_shared_experts": 1.0}, ValueError, "num_shared_experts"),
        ({"weight_blocks": "16x16"}, ValueError, "weight_blocks"),
        ({"weight_blocks": 32}, ValueError, "weight_blocks"),
        ({"check_finite": "warn"}, ValueError, "check_finite must be one of"),
        ({"check_finite": None}, ValueError, "check_finite must be one of"),
    ],
)
def test_bad_constructor_args(kwargs, exc, match):
    args = {"dim": 64, "hidden_dim": 64, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(exc, match=match):
        MXFP8MoE(args.pop("dim"), args.pop("hidden_dim"), args.pop("num_experts"),
                 args.pop("top_k"), **args)


def test_bf16_twin_allows_other_dims():
    MXFP8MoE(48, 80, 4, 2, precision="bf16")  # no MXFP8 block constraint


def test_bad_forward_inputs():
    mx = MXFP8MoE(64, 64, 4, 2, backend="reference")
    with pytest.raises(ValueError, match="dim=64"):
        mx(torch.randn(3, 32, dtype=BF16))
    with pytest.raises(TypeError, match="x must be one of"):
        mx(torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be one of"):
        mx(torch.ones(3, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="parameters are on"):
        mx(torch.randn(3, 64, dtype=BF16, device="meta"))


# ---------------------------------------------------------------------------------------------
# Non-finite tokens: never an error by default, and only the token itself is affected
# ---------------------------------------------------------------------------------------------

NONFINITE_LAYERS = [{}, {"scale_blocks": "1x128"}, {"precision": "bf16"}]
NONFINITE_IDS = ["mxfp8-1x32", "mxfp8-1x128", "bf16"]


def _out_and_input_grad(layer, x, dy):
    """Output and input gradient of the task loss ``<y, dy>`` alone (the batch-level aux loss
    depends on every token's routing, so it is left out here)."""
    xa = x.clone().requires_grad_()
    y = layer(xa)
    (y.float() * dy.float()).sum().backward()
    return y.detach(), xa.grad


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("opts", NONFINITE_LAYERS, ids=NONFINITE_IDS)
def test_nonfinite_token_affects_only_itself(rng, opts, score_func, bad):
    """Default ``check_finite="flag"``: no error; the token's output and input gradient are NaN,
    every other token's are bit for bit those of the same batch with a finite token there, and
    ``nonfinite_tokens`` counts it (on the device)."""
    layer = MXFP8MoE(128, 128, 4, 2, backend="reference", score_func=score_func, **opts)
    x = torch.randn(70, 128, generator=rng).to(BF16)  # 70 pairs per expert: partial blocks too
    dy = torch.randn(70, 128, generator=rng).to(BF16)
    t = 33
    y, dx = _out_and_input_grad(layer, x, dy)
    assert layer.nonfinite_tokens.item() == 0
    xb = x.clone()
    xb[t, 5] = bad
    yb, dxb = _out_and_input_grad(layer, xb, dy)
    assert layer.nonfinite_tokens.dtype == torch.int64 and layer.nonfinite_tokens.item() == 1
    others = torch.arange(70) != t
    assert torch.equal(yb[others], y[others]) and torch.equal(dxb[others], dx[others])
    assert yb[t].isnan().all() and dxb[t].isnan().all()


@pytest.mark.parametrize("opts", NONFINITE_LAYERS, ids=NONFINITE_IDS)
def test_nonfinite_token_routing_is_fixed(opts):
    """A non-finite token goes to experts 0..k-1 (top-k of NaN scores is unspecified; this is
    the same choice on every backend)."""
    layer = MXFP8MoE(64, 64, 8, 3, backend="reference", **opts)
    x = torch.full((2, 64), float("nan"), dtype=BF16)
    x[1] = torch.inf
    y = layer(x)
    assert layer.tokens_per_expert.tolist() == [2, 2, 2, 0, 0, 0, 0, 0]
    assert y.isnan().all()


def test_nonfinite_router_weight_makes_every_output_nan(rng):
    """NaN in router.weight: every token is non-finite and every output NaN, never a finite
    output from the stand-in routing."""
    layer = MXFP8MoE(64, 64, 4, 2, backend="reference", score_func="sigmoid",
                     renormalize=False)
    with torch.no_grad():
        layer.router.weight[3, 7] = float("nan")  # only expert 3's score is NaN
    y = layer(torch.randn(9, 64, generator=rng).to(BF16))
    assert layer.nonfinite_tokens.item() == 9 and y.isnan().all()


def test_check_finite_raise_is_one_error_type_eager_and_compiled(rng):
    """``check_finite="raise"``: `NonFiniteInputError` (a ValueError) in eager mode and under
    ``torch.compile(fullgraph=True)``; a clean batch passes in both; the bools are the older
    spellings."""
    layer = MXFP8MoE(64, 64, 4, 2, backend="reference", check_finite="raise")
    assert issubclass(NonFiniteInputError, ValueError)
    x = torch.randn(2, 12, 64, generator=rng).to(BF16)
    xb = x.clone()
    xb[1, 3, 0] = float("nan")
    xb[0, 0, 9] = float("inf")
    with pytest.raises(NonFiniteInputError, match="not finite for 2 token.s. of 24 in this batch"):
        layer(xb)
    want = layer(x)
    assert layer.nonfinite_tokens.item() == 0
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), want)
        with pytest.raises(NonFiniteInputError, match="not finite for 2 token"):
            compiled(xb)
        assert torch.equal(compiled(x), want)
    finally:
        torch._dynamo.reset()
    layer.check_finite = False
    assert layer.check_finite == "flag" and layer(xb)[0, 0].isnan().all()
    layer.check_finite = True
    assert layer.check_finite == "raise"
    with pytest.raises(ValueError, match="check_finite must be one of"):
        layer.check_finite = "off"


def nan_batch_then_clean_step(device: str, opts: dict, seed: int = 0):
    """A training loop that skips a step whose gradient norm is not finite (as loss scalers and
    grad-norm guards do): a batch with one NaN token, then a clean batch, in one process.

    Checks: the NaN step is skipped and leaves the parameters finite and unchanged; the clean
    step then gives the output, gradients and updated parameters of a fresh layer (bit for bit).
    """
    torch.manual_seed(seed)
    layer = MXFP8MoE(128, 256, 4, 2, device=device, **opts)
    fresh = copy.deepcopy(layer)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 96, 128, generator=g).to(device, BF16)
    x_bad = x.clone()
    x_bad[1, 17, 40] = float("nan")

    def step(m, opt, batch):
        y = m(batch)
        (y.float().pow(2).mean() + m.aux_loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        stepped = bool(torch.isfinite(norm))  # the loop's one host sync
        if stepped:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return y.detach(), grads, stepped

    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    y_bad, g_bad, stepped = step(layer, opt, x_bad)
    assert not stepped and layer.nonfinite_tokens.item() == 1
    assert y_bad[1, 17].isnan().all() and torch.isfinite(y_bad[0]).all()
    for n, p in layer.named_parameters():
        assert torch.isfinite(p).all() and torch.equal(p, before[n]), n
    y, grads, stepped = step(layer, opt, x)
    y_f, grads_f, stepped_f = step(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), x)
    assert stepped and stepped_f and layer.nonfinite_tokens.item() == 0
    assert torch.equal(y, y_f)
    for n, p in layer.named_parameters():
        assert torch.equal(grads[n], grads_f[n]), n
        assert torch.equal(p, dict(fresh.named_parameters())[n]) and torch.isfinite(p).all(), n


@pytest.mark.parametrize("opts", NONFINITE_LAYERS, ids=NONFINITE_IDS)
def test_training_loop_skips_a_nan_batch_and_goes_on(opts):
    nan_batch_then_clean_step("cpu", {"backend": "reference", **opts})


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("opts", NONFINITE_LAYERS, ids=NONFINITE_IDS)
def test_gpu_nan_batch_never_stops_the_process(opts):
    """On CUDA (the kernels: GEMMs and the Triton data path): a NaN batch forward+backward
    raises nothing and poisons nothing (no device-side assert), a skipped step keeps the
    parameters finite, and the next clean step in the same process equals a fresh layer's bit
    for bit; the non-finite token's own output is NaN, the other tokens' outputs are those of
    the clean batch."""
    nan_batch_then_clean_step("cuda", opts)
    torch.manual_seed(1)
    layer = MXFP8MoE(256, 256, 8, 2, device="cuda", **opts)
    x = torch.randn(1000, 256, device="cuda").to(BF16)
    dy = torch.randn_like(x)
    y, dx = _out_and_input_grad(layer, x, dy)
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[500, 100] = bad
        yb, dxb = _out_and_input_grad(layer, xb, dy)
        others = torch.arange(1000, device="cuda") != 500
        assert torch.equal(yb[others], y[others]) and torch.equal(dxb[others], dx[others])
        assert yb[500].isnan().all() and dxb[500].isnan().all()
        assert layer.nonfinite_tokens.item() == 1
    torch.cuda.synchronize()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("opts", NONFINITE_LAYERS, ids=NONFINITE_IDS)
def test_gpu_check_finite_raise_eager_and_compiled(opts):
    """``check_finite="raise"`` on CUDA: `NonFiniteInputError` in eager mode and under
    ``torch.compile`` (inductor), and the CUDA context keeps working after each."""
    torch.manual_seed(0)
    layer = MXFP8MoE(128, 256, 4, 2, device="cuda", check_finite="raise", **opts)
    x = torch.randn(4, 64, 128, device="cuda").to(BF16)
    xb = x.clone()
    xb[2, 5, 0] = float("nan")
    want = layer(x)
    with pytest.raises(NonFiniteInputError, match="not finite for 1 token.s. of 256"):
        layer(xb)
    assert torch.equal(layer(x), want)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, fullgraph=True)
        compiled(x)
        with pytest.raises(NonFiniteInputError, match="not finite for 1 token"):
            compiled(xb)
        assert torch.isfinite(compiled(x)).all()
    finally:
        torch._dynamo.reset()
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# GPU (the device machine): the kernels through backend="auto"
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("cfg", CONFIGS[:3] + [(1024, 512, 8, 2, (4, 512), {})],
                         ids=lambda c: f"E{c[2]}k{c[3]}-{c[4]}")
def test_gpu_matches_bf16_twin(rng, cfg):
    dim, hidden, e, k, lead, opts = cfg
    mx, bf = twins(dim, hidden, e, k, device="cuda", backend="auto", **opts)
    x = torch.randn(*lead, dim, generator=rng).to("cuda", BF16)
    compare_twins(mx, bf, x, "GPU " + str(cfg), rng.initial_seed())


GPU_NEW_OPTIONS = [
    {"num_shared_experts": 1},
    {"weight_blocks": "32x32"},
    {"num_shared_experts": 1, "weight_blocks": "32x32"},
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("new", GPU_NEW_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[4], (1024, 512, 8, 2, (4, 512), {})],
                         ids=lambda c: f"E{c[2]}k{c[3]}-{c[4]}-{c[5]}")
def test_gpu_shared_expert_and_32x32_match_bf16_twin(rng, cfg, new):
    """Kernel backend ("auto": sm90 on the H100) vs the BF16 twin with a shared expert and/or
    32x32 weight tiles; the thresholds of the CPU tests."""
    dim, hidden, e, k, lead, opts = cfg
    mx, bf = twins(dim, hidden, e, k, device="cuda", backend="auto", **opts, **new)
    x = torch.randn(*lead, dim, generator=rng).to("cuda", BF16)
    shared = new.get("num_shared_experts", 0) > 0
    compare_twins(mx, bf, x, f"GPU {new} {cfg}", rng.initial_seed(),
                  input_grad_min_db=SHARED_INPUT_GRAD_MIN_DB if shared else INPUT_GRAD_MIN_DB)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("new", [{}] + GPU_NEW_OPTIONS[2:],
                         ids=lambda o: "-".join(map(str, o.values())) or "default")
@pytest.mark.parametrize("precision", ["mxfp8", "bf16"])
def test_gpu_no_host_sync(rng, precision, new):
    mx = MXFP8MoE(1024, 512, 8, 2, precision=precision, device="cuda", **new)
    x = torch.randn(4, 512, 1024, generator=rng).to("cuda", BF16).requires_grad_()
    dy = torch.randn_like(x)
    for sync_mode in ("default", "error"):  # warm-up (kernel compilation), then checked
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            y = mx(x)
            (y * dy).sum().add(mx.aux_loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_group_alignment_padding_changes_no_result(rng):
    """The MXFP8 path pads every expert group to 16 rows (Hopper wgrad TMA alignment); the
    output and every gradient must equal the unpadded computation exactly (reference backend)."""
    from moe_mxfp8.kernels.mx_format import padded_extent

    from moe_mxfp8 import routing as RT
    from moe_mxfp8.autograd import grouped_mm
    from moe_mxfp8.moe import GROUP_ALIGN_ROWS

    mx = MXFP8MoE(64, 96, 5, 2, backend="reference")
    x = torch.randn(37, 64, generator=rng).to(BF16)
    counts = torch.tensor([0, 17, 33, 1, 23])
    ids = torch.repeat_interleave(torch.arange(5), counts)[torch.randperm(74, generator=rng)]
    rows, _, offs = RT.route_layout(ids.view(37, 2), counts, GROUP_ALIGN_ROWS)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), offs[:-1]])
    assert (starts % GROUP_ALIGN_ROWS == 0).all()
    m = padded_extent(74, 5, GROUP_ALIGN_ROWS)
    assert int(offs[-1]) == m and m % GROUP_ALIGN_ROWS == 0
    assert rows.unique().numel() == 74

    dy = torch.randn(37, 64, generator=rng).to(BF16)
    y, dx, pg = fwd_bwd(mx, x, dy)

    # The same layer by hand, without padding.
    xa = x.clone().requires_grad_()
    weights, ids, cnt, aux = mx.route(xa)
    order = torch.argsort(ids.reshape(-1), stable=True)
    offs_u = torch.cumsum(cnt, 0).to(torch.int32)
    w_gu = mx.w_gate_up.detach().clone().requires_grad_()
    w_dn = mx.w_down.detach().clone().requires_grad_()
    h = grouped_mm(xa[order // 2], w_gu.transpose(-2, -1), offs_u, backend="reference")
    gate, up = h.chunk(2, dim=-1)
    ys = grouped_mm(torch.nn.functional.silu(gate) * up, w_dn.transpose(-2, -1), offs_u,
                    backend="reference")
    pairs = torch.empty_like(ys).index_copy_(0, order, ys).reshape(37, 2, 64)
    y_ref = (pairs * weights.to(BF16).unsqueeze(-1)).sum(dim=1)  # the module's combine
    ((y_ref.float() * dy.float()).sum() + aux).backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, xa.grad)
    assert torch.equal(pg["w_gate_up"], w_gu.grad) and torch.equal(pg["w_down"], w_dn.grad)


@pytest.mark.gpu
@cuda
def test_gpu_router_bf16_gemm_matches_the_fp32_router():
    """BF16 x and router weight on CUDA: one BF16 GEMM with fp32 accumulation (exact products)
    gives the fp32 router's logits up to summation order and picks the same experts; its
    backward (the logits' gradient rounded to BF16 once) is within BF16 rounding of fp32's."""
    from moe_mxfp8.moe import router_logits

    gen = torch.Generator().manual_seed(0)
    t, d, e, k = 8192, 2048, 64, 8
    x = torch.randn(t, d, generator=gen).to("cuda", BF16)
    w = (torch.randn(e, d, generator=gen) * d**-0.5).to("cuda", BF16)
    g = torch.randn(t, e, generator=gen).cuda()
    xa, wa, xr, wr = (v.clone().requires_grad_() for v in (x, w, x, w))
    logits = router_logits(xa, wa)
    ref = F.linear(xr.float(), wr.float())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    same = (logits.topk(k).indices.sort(1).values == ref.topk(k).indices.sort(1).values)
    assert same.float().mean() >= 0.999, same.float().mean()  # near-ties may swap
    (logits * g).sum().backward()
    (ref * g).sum().backward()
    for got, want in ((xa.grad, xr.grad), (wa.grad, wr.grad)):
        assert got.dtype == BF16
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2**-7, err
