"""`MXFP8MoE(cache_weights=True)`: expert weights quantized once per optimizer step
(`moe_mxfp8.weight_cache`). Counts the weight quantizer's runs and compares every output and
gradient bit for bit with the uncached layer on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
from moe_mxfp8.kernels.mx_format import WEIGHT_BLOCK_ROWS, expert_scale_stride
from torch.utils.checkpoint import checkpoint

from moe_mxfp8 import MXFP8MoE
from moe_mxfp8 import datapath as DP
from moe_mxfp8 import routing as RT
from moe_mxfp8 import weight_cache as WC
from tests.test_datapath import opcheck_backward_phases

BF16 = torch.bfloat16
D, H, E, K, T = 64, 32, 4, 2, 48
RECIPES = ["1x32", "1x128"]
CPU_RECIPES = [*RECIPES, "32x32"]


@pytest.fixture
def counts(monkeypatch):
    """Weight quantizer runs: ``single`` (one axis) and ``fwd_dual`` (both axes in forward, the
    N-axis copy kept for backward) on the uncached path, ``dual`` (the cache)."""
    n = {"single": 0, "fwd_dual": 0, "dual": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            n[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(DP, "quantize_weights", count("single", DP.quantize_weights))
    monkeypatch.setattr(DP, "quantize_weights_dual", count("fwd_dual",
                                                           DP.quantize_weights_dual))
    monkeypatch.setattr(WC, "quantize_weights_dual", count("dual", WC.quantize_weights_dual))
    return n


def _uncached_weights(counts) -> float:
    """Weights the uncached path quantized along both axes: each from one read in forward
    (``fwd_dual``, `datapath._keep_weights_n`) or one axis per pass (two ``single`` runs)."""
    return counts["fwd_dual"] + counts["single"] / 2


def _pair(scale_blocks="1x32", dtype=BF16, seed=0):
    """A cached layer and an uncached one with the same parameters."""
    torch.manual_seed(seed)
    kw = dict(backend="reference", scale_blocks=scale_blocks, dtype=dtype)
    cached = MXFP8MoE(D, H, E, K, cache_weights=True, **kw)
    plain = MXFP8MoE(D, H, E, K, **kw)
    plain.load_state_dict(cached.state_dict())
    return cached, plain


def _inputs(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(T, D, generator=g).to(BF16), torch.randn(T, D, generator=g).to(BF16))
            for _ in range(n)]


def _step(m, x, dy):
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    return y.detach(), x.grad


def _assert_same_grads(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("scale_blocks", CPU_RECIPES)
def test_micro_batches_quantize_once_and_match_bitwise(counts, scale_blocks):
    cached, plain = _pair(scale_blocks)
    batches = _inputs(3)
    for i, x_dy in enumerate(batches):
        y1, dx1 = _step(cached, *x_dy)
        assert _uncached_weights(counts) == 2 * i
        y0, dx0 = _step(plain, *x_dy)
        assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    # both weights, once each; the uncached layer quantizes both weights along both axes per
    # micro-batch
    assert counts["dual"] == 2 and cached._weight_cache.quantizations == 2
    assert _uncached_weights(counts) == 2 * len(batches)
    _assert_same_grads(cached, plain)


def test_cache_bytes_are_one_fp8_byte_per_parameter_and_axis():
    cached, _ = _pair()
    assert cached.weight_cache_bytes() == 0
    x, dy = _inputs(1)[0]
    _step(cached, x, dy)
    rows = WEIGHT_BLOCK_ROWS["1x32"]
    assert rows == 1
    scales = 0
    for e, n, k in ((E, 2 * H, D), (E, D, H)):
        scales += e * (expert_scale_stride(n, k // 32) + expert_scale_stride(k, n // 32))
    assert cached.weight_cache_bytes() == 2 * (2 * H * D + D * H) * E + scales


@pytest.mark.parametrize("optim", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),  # leaves param._version unchanged
], ids=["sgd", "adamw_foreach", "adamw_fused"])
def test_optimizer_step_requantizes(counts, optim):
    cached, plain = _pair()
    opts = [optim(list(m.parameters())) for m in (cached, plain)]
    for x, dy in _inputs(3):
        for m, opt in zip((cached, plain), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            _step(m, x, dy)
            opt.step()
        assert len(cached._weight_cache) == 0  # dropped at the step: no memory held through it
        _assert_same_grads(cached, plain)
        for p, q in zip(cached.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p, q)
    assert counts["dual"] == 2 * 3


def test_fused_adam_leaves_the_version_counter_alone():
    """Why the cache keys on optimizer steps too (if torch starts bumping it, this says so)."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    p.grad = torch.ones(4, 4)
    opt = torch.optim.AdamW([p], fused=True)
    before, v = p.detach().clone(), p._version
    opt.step()
    assert not torch.equal(p.detach(), before)
    assert p._version == v


def test_writes_to_the_parameter_requantize(counts):
    cached, plain = _pair()
    (x, dy), = _inputs(1)
    _step(cached, x, dy)
    new = torch.randn_like(cached.w_down)
    for m in (cached, plain):
        with torch.no_grad():
            m.w_down.copy_(new)  # bumps the version
    cached.zero_grad()
    plain.zero_grad()
    assert counts["dual"] == 2
    assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    assert counts["dual"] == 3  # only w_down again
    _assert_same_grads(cached, plain)


def test_writes_through_data_need_invalidate(counts):
    """``param.data.copy_`` bumps no version counter (pinned here): the cache cannot see it
    and `invalidate_weight_cache` is the documented remedy."""
    cached, plain = _pair()
    (x, dy), = _inputs(1)
    _step(cached, x, dy)
    new = torch.randn_like(cached.w_gate_up)
    v = cached.w_gate_up._version
    for m in (cached, plain):
        m.w_gate_up.data.copy_(new)
    assert cached.w_gate_up._version == v
    cached.invalidate_weight_cache()
    assert cached.weight_cache_bytes() == 0
    assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    assert counts["dual"] == 4


def test_load_state_dict_requantizes(counts):
    cached, plain = _pair()
    (x, dy), = _inputs(1)
    _step(cached, x, dy)
    other = MXFP8MoE(D, H, E, K, backend="reference")
    cached.load_state_dict(other.state_dict())
    plain.load_state_dict(other.state_dict())
    assert cached.weight_cache_bytes() == 0
    assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    assert counts["dual"] == 4


def test_to_requantizes(counts):
    cached, plain = _pair()
    (x, dy), = _inputs(1)
    _step(cached, x, dy)
    cached.to(torch.float32)
    plain.to(torch.float32)
    assert cached.weight_cache_bytes() == 0
    assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    assert counts["dual"] == 4


def test_fp32_master_weights_match_bitwise(counts):
    cached, plain = _pair(dtype=torch.float32)
    for x, dy in _inputs(2):
        assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    _assert_same_grads(cached, plain)
    assert counts["dual"] == 2


def test_recomputed_forward_reuses_the_weights(counts):
    cached, plain = _pair()
    (x, dy), = _inputs(1)
    outs = []
    for m in (cached, plain):
        xi = x.clone().requires_grad_()
        y = checkpoint(m, xi, use_reentrant=False)
        y.backward(dy)
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    _assert_same_grads(cached, plain)
    assert counts["dual"] == 2  # forward and its recomputation: one quantization per weight


def test_not_used_while_compiling(counts, monkeypatch):
    """Inside torch.compile the weights are quantized in the graph (a hit would be baked in)."""
    cached, plain = _pair()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    (x, dy), = _inputs(1)
    assert torch.equal(_step(cached, x, dy)[0], _step(plain, x, dy)[0])
    assert counts["dual"] == 0 and cached.weight_cache_bytes() == 0


def test_copies_start_empty_and_bf16_twin_ignores_it(counts):
    cached, _ = _pair()
    (x, dy), = _inputs(1)
    _step(cached, x, dy)
    twin = copy.deepcopy(cached)
    assert twin.weight_cache_bytes() == 0 and cached.weight_cache_bytes() > 0
    bf16 = MXFP8MoE(D, H, E, K, precision="bf16", cache_weights=True)
    _step(bf16, x, dy)
    assert bf16.weight_cache_bytes() == 0
    assert "cache_weights=True" in repr(cached)


def test_cache_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="cache_weights must be a bool"):
        MXFP8MoE(D, H, E, K, cache_weights="yes")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("scale_blocks", RECIPES)
def test_gpu_cached_matches_uncached_bitwise(scale_blocks):
    """On the kernels: the dual weight quantizer's bytes are the single-axis ones, so outputs
    and gradients of 3 accumulated micro-batches and an optimizer step match bit for bit."""
    torch.manual_seed(0)
    kw = dict(scale_blocks=scale_blocks, device="cuda")
    cached = MXFP8MoE(256, 256, 8, 2, cache_weights=True, **kw)
    plain = MXFP8MoE(256, 256, 8, 2, **kw)
    plain.load_state_dict(cached.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (cached, plain)]
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(2):  # two optimizer steps of three micro-batches
        for _ in range(3):
            x = torch.randn(512, 256, device="cuda", generator=g).to(BF16)
            dy = torch.randn(512, 256, device="cuda", generator=g).to(BF16)
            r = [_step(m, x, dy) for m in (cached, plain)]
            assert torch.equal(r[0][0], r[1][0]) and torch.equal(r[0][1], r[1][1])
        _assert_same_grads(cached, plain)
        assert cached._weight_cache.quantizations in (2, 4)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert cached._weight_cache.quantizations == 4


@pytest.mark.gpu
@cuda
def test_gpu_graph_capture_does_not_bake_the_cache():
    """A CUDA graph captured with the cache on quantizes inside the graph: replayed after the
    weights changed, it gives the new weights' output (the uncached layer's, bit for bit)."""
    torch.manual_seed(0)
    cached = MXFP8MoE(256, 256, 8, 2, cache_weights=True, device="cuda")
    plain = MXFP8MoE(256, 256, 8, 2, device="cuda")
    plain.load_state_dict(cached.state_dict())
    x = torch.randn(512, 256, device="cuda").to(BF16)
    with torch.no_grad():
        for _ in range(2):
            cached(x)  # fills the cache, compiles, verifies
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cached(x)
        for m in (cached, plain):
            m.w_gate_up.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain(x))


@pytest.mark.parametrize("cache", [False, True])
def test_block_table_is_built_once_per_step(monkeypatch, cache):
    """`routed_experts` builds the step's tables (the row kernels' block table, the
    quantizer's tile ends) once and backward reuses the forward's (each pass builds its own
    only when none is passed in), with and without pre-quantized weights (the op's other
    optional inputs)."""
    built = []
    tables = torch.arange(12, dtype=torch.int32).reshape(2, 6), torch.arange(E, dtype=torch.int32)

    def step_tables(like, offs, m, scale_blocks, backend):
        built.append(scale_blocks)
        return tables

    monkeypatch.setattr(DP, "_step_tables", step_tables)
    cached, plain = _pair()
    m = cached if cache else plain
    (x, dy), = _inputs(1)
    y, dx = _step(m, x, dy)
    assert built == ["1x32"]
    monkeypatch.undo()
    other = cached if not cache else plain
    y0, dx0 = _step(other, x, dy)
    assert torch.equal(y, y0) and torch.equal(dx, dx0)


def test_opcheck_with_the_optional_inputs():
    """The routed-expert ops with a block table and pre-quantized weights: schema, fake
    implementation and autograd registration (`torch.library.opcheck`)."""
    g = torch.Generator().manual_seed(0)
    t, k, hh = 24, 2, 32
    ids = torch.randint(0, E, (t, k), generator=g)
    counts = torch.zeros(E, dtype=torch.int64).scatter_add(0, ids.flatten(),
                                                          torch.ones(t * k, dtype=torch.int64))
    rows, src, offs = RT.route_layout(ids, counts, 16)
    x = torch.randn(t, D, generator=g).to(BF16).requires_grad_()
    w_gu = torch.randn(E, 2 * hh, D, generator=g).to(BF16).requires_grad_()
    w_dn = torch.randn(E, D, hh, generator=g).to(BF16).requires_grad_()
    weights = torch.rand(t, k, generator=g).requires_grad_()
    pairs = [WC.quantize_weights_dual(w.detach(), backend="reference") for w in (w_gu, w_dn)]
    wq = [v for q in (pairs[0][0], pairs[1][0], pairs[0][1], pairs[1][1])
          for v in (q.data.view(torch.uint8), q.scale)]
    table, tile_ends = RT.row_tables(offs, src.numel(), 32)
    args = (x, w_gu, w_dn, weights, rows, src, offs, "mxfp8", "reference", "mxfp8", "1x32", True,
            table, tile_ends, *wq)
    torch.library.opcheck(torch.ops.moe_mxfp8.routed_experts_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
    out = torch.ops.moe_mxfp8.routed_experts_fwd(*[a.detach() if i < 4 else a
                                                   for i, a in enumerate(args)])
    opcheck_backward_phases(args, out, "mxfp8", "mxfp8", "1x32", (table, tile_ends, *wq[4:]))


def test_layer_made_in_inference_mode_runs_uncached(counts):
    """Parameters made under ``torch.inference_mode`` have no version counter: no cache."""
    with torch.inference_mode():
        m = MXFP8MoE(D, H, E, K, backend="reference", cache_weights=True)
        m(torch.randn(T, D).to(BF16))
    assert counts["dual"] == 0 and counts["fwd_dual"] == 0 and counts["single"] == 2
