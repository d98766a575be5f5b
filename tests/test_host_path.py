"""The layer's GPU host path on a CPU (`tools/host_path_probe.py`: every launch a no-op): what a
forward + backward launches, so that a change that adds launches or host work shows here."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
from moe_mxfp8.kernels import native

from moe_mxfp8 import MXFP8MoE

PROBE = Path(__file__).resolve().parents[1] / "tools" / "host_path_probe.py"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("host_path_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def launches(probe, monkeypatch):
    """Launch counts by kind while the GPU host path runs."""
    n = Counter()
    call = native.NativeKernel.__call__

    def native_call(self, *args):
        n["native"] += 1
        return call(self, *args)

    def triton_launch(self, grid):
        n["triton"] += 1
        return lambda *a, **k: None

    monkeypatch.setattr(native.NativeKernel, "__call__", native_call)
    monkeypatch.setattr(probe._Launcher, "__getitem__", triton_launch)
    with probe.gpu_host_path():
        yield n


def _step(m, x, dy):
    xi = x.clone().requires_grad_()
    m(xi).backward(dy)
    return xi.grad


@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_mxfp8_step_launches(launches, scale_blocks):
    """A forward + backward: 3 weight quantizations (gate/up along K in forward and along N in
    backward, down along both axes in forward), 6 grouped GEMMs
    (fprop 2, dgrad 2, wgrad 2) and the quantized stages on the quantizer tile (SwiGLU and
    its backward, the combine backward; with 1x128 blocks the dispatch too) through ctypes,
    the Triton data-path kernels (the 1x32 dispatch, the combine, the dispatch backward), the
    router's 3 (forward, its reduction, backward: `kernels.router_triton`) and the 3 of the
    routing layout with its row tables (`kernels.routing_triton`); with the weight cache 2
    dual quantizations in the first step and none in the second."""
    torch.manual_seed(0)
    x, dy = torch.randn(2, 40, 128).to(BF16), torch.randn(2, 40, 128).to(BF16)
    plain = MXFP8MoE(128, 128, 8, 2, scale_blocks=scale_blocks)
    cached = MXFP8MoE(128, 128, 8, 2, scale_blocks=scale_blocks, cache_weights=True)
    tile_dispatch = int(scale_blocks == "1x128")
    for m, counts in ((plain, [12, 12]), (cached, [11, 9])):
        for want in counts:
            launches.clear()
            _step(m, x, dy)
            assert launches == {"native": want + tile_dispatch, "triton": 9 - tile_dispatch}


@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_swiglu_quantizer_tile_ends_built_once_per_step(launches, monkeypatch, scale_blocks):
    """Both quantized SwiGLU stages (forward ``a``, backward ``dh``) run on the quantizer and
    read the step's tile ends (`routing.row_tables`, built with the block table): no stage
    builds its own (`group_tile_ends`)."""
    from moe_mxfp8.kernels import quantize_launch as QL

    seen, built = [], []
    for name in ("quantize_swiglu", "quantize_swiglu_grad"):
        fn = getattr(QL, name)
        monkeypatch.setattr(QL, name, lambda *a, _fn=fn, _n=name, **kw: seen.append(
            (_n, kw.get("tile_ends"))) or _fn(*a, **kw))
    tile_ends = QL.group_tile_ends
    monkeypatch.setattr(QL, "group_tile_ends", lambda offs: built.append(1) or tile_ends(offs))
    torch.manual_seed(0)
    m = MXFP8MoE(128, 128, 8, 2, scale_blocks=scale_blocks)
    _step(m, torch.randn(80, 128).to(BF16), torch.randn(80, 128).to(BF16))
    assert [n for n, _ in seen] == ["quantize_swiglu", "quantize_swiglu_grad"]
    (_, fwd), (_, bwd) = seen
    assert fwd is not None and bwd is fwd and not built


def test_bf16_twin_step_launches(launches):
    """The twin's six row kernels (dispatch, SwiGLU, combine and their backward passes), the
    router's 3 and the routing layout's 3."""
    torch.manual_seed(0)
    m = MXFP8MoE(128, 128, 8, 2, precision="bf16")
    _step(m, torch.randn(80, 128).to(BF16), torch.randn(80, 128).to(BF16))
    assert launches == {"triton": 12}


# aten ops of one forward + backward on the GPU host path, those inside the custom ops included
# (on a GPU each is a launch or an allocation, ~30 us of host time; views and no-op casts count
# too): the router GEMM, the router's and the routing layout's buffers, autograd and the stages'
# buffers; backward's four operators (`datapath._backward`) pass their tensors as views and the
# outputs a configuration does not make as empty tensors (about a dozen ops more than one
# backward operator); the 1x128 dispatch on the quantizer tile allocates its outputs with 3
# ops fewer than its Triton kernel. D = H = 128 (at H = 64 the 1x128 step takes 108)
STEP_ATEN_OPS = {"bf16": 114, "1x32": 112, "1x128": 109}
HOST_SYNC_OPS = {"aten.item", "aten._local_scalar_dense", "aten.is_nonzero"}


@pytest.mark.parametrize("variant", sorted(STEP_ATEN_OPS))
def test_step_aten_ops(probe, launches, variant):
    """The aten ops a step dispatches, pinned: one more shows here (update the pin when a change
    removes some). None reads a device value on the host (a sync on a GPU): the probe runs the
    GPU's branches, not the value checks that run only for CPU tensors."""
    torch.manual_seed(0)
    opts = {"precision": "bf16"} if variant == "bf16" else {"scale_blocks": variant}
    m = MXFP8MoE(128, 128, 8, 2, **opts)
    x, dy = torch.randn(80, 128).to(BF16), torch.randn(80, 128).to(BF16)
    _step(m, x, dy)  # the first step's one-time decisions
    xi = x.clone().requires_grad_()
    with probe.OpCounter() as counter:
        m(xi).backward(dy)
    assert not HOST_SYNC_OPS & set(counter.ops), counter.ops
    assert sum(counter.ops.values()) == STEP_ATEN_OPS[variant], counter.ops


def test_probe_restores_the_cpu_path(probe):
    """After the probe the layer runs the reference again (no stub left behind)."""
    with probe.gpu_host_path():
        pass
    torch.manual_seed(0)
    m = MXFP8MoE(128, 64, 8, 2, backend="reference")
    y = m(torch.randn(16, 128).to(BF16))
    assert torch.isfinite(y).all() and y.abs().sum() > 0


def test_launch_decisions_are_made_once_per_problem(launches, monkeypatch):
    """The grouped GEMM launcher chooses a configuration once per (kernel, problem): the
    second step of the same shapes makes no new choice (`launcher._plan`)."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm.sm90_config import GroupedGemmSm90Host

    chosen = []
    select = GroupedGemmSm90Host.select_config.__func__

    def counting(cls, problem, tuning=None):
        chosen.append(problem.static_key())
        return select(cls, problem, tuning)

    monkeypatch.setattr(GroupedGemmSm90Host, "select_config", classmethod(counting))
    monkeypatch.setattr(launcher, "_PLANS", {})
    torch.manual_seed(0)
    m = MXFP8MoE(128, 96, 8, 2)  # D 128, H 96: six different GEMM shapes; Hopper's 1x128
    x, dy = torch.randn(40, 128).to(BF16), torch.randn(40, 128).to(BF16)
    _step(m, x, dy)
    assert len(chosen) == 6 == len(set(chosen))  # fprop 2, dgrad 2, wgrad 2
    _step(m, x, dy)
    assert len(chosen) == 6 and launches["native"] == 26  # 13 a step


def _graph_steps(m, xs, dy):
    """Forward + backward of each input: (output, input grad, parameter grads) per step."""
    out = []
    for x in xs:
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(dy)
        out.append([y.detach().clone(), xi.grad.clone()]
                   + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("precision,scale_blocks", [("bf16", None), ("mxfp8", "1x32"),
                                                    ("mxfp8", "1x128")])
def test_gpu_layer_replays_as_cuda_graphs(precision, scale_blocks):
    """The host-time answer for short steps: ``torch.compile(layer, mode="reduce-overhead")``
    captures the whole forward and backward as CUDA graphs (no host sync, no capture skipped)
    and its replays, on fresh inputs every step, equal the same compiled code without graphs
    bit for bit (uneven routing: the router is random-init, so groups differ and some may be
    empty) and the eager layer within the router's rounding (inductor may fuse the softmax)."""
    import copy

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    extra = {"scale_blocks": scale_blocks} if scale_blocks else {}
    eager = MXFP8MoE(256, 128, 8, 2, precision=precision, device="cuda", **extra)
    plain = torch.compile(copy.deepcopy(eager))
    graphed = torch.compile(copy.deepcopy(eager), mode="reduce-overhead")
    xs = [torch.randn(512, 256, device="cuda", dtype=BF16) for _ in range(4)]
    dy = torch.randn(512, 256, device="cuda", dtype=BF16)
    want, got, ref = (_graph_steps(m, xs, dy) for m in (plain, graphed, eager))
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    for step_want, step_got, step_ref in zip(want, got, ref, strict=True):
        for a, b, r in zip(step_want, step_got, step_ref, strict=True):
            assert torch.equal(a, b)
            err = (a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)
            assert err < 0.02, err
