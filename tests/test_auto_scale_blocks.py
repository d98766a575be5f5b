"""``scale_blocks="auto"`` (the default of `MXFP8MoE`, `MXFP8GroupedExperts` and `grouped_mm`):
the recipe of the kind of device the layer runs on, on the CPU with stand-ins for the GPU's
compute capability (`moe_mxfp8.backend.device_capability`). The reference backend computes
every recipe, so the stand-ins run the recipe they choose end to end."""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_mxfp8 import MXFP8MoE, checkpoint, grouped_mm, quantize_rowwise
from moe_mxfp8 import backend as B
from moe_mxfp8.experts import MXFP8GroupedExperts

D, H, E, K = 128, 128, 4, 2  # a 1x128 block spans four 32-blocks
HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


@pytest.fixture
def gpu_standin(monkeypatch):
    """``set(cap)``: every device (the CPU included) reports compute capability ``cap``."""
    state = {"cap": None}
    monkeypatch.setattr(B, "device_capability", lambda device: state["cap"])

    def set_cap(cap):
        state["cap"] = cap

    return set_cap


@pytest.fixture
def hopper_picks_1x128(monkeypatch):
    """The resolution machinery with Hopper's choice differing from Blackwell's (a protocol
    that chose "1x128"), whatever `HOPPER_AUTO_SCALE_BLOCKS` is today: moving between the two
    kinds must then re-resolve, warn and re-align."""
    monkeypatch.setitem(B.AUTO_SCALE_BLOCKS_BY_ARCH, "sm90", "1x128")


def _layer(scale_blocks=B.AUTO, seed=0, **kw):
    torch.manual_seed(seed)
    return MXFP8MoE(D, H, E, K, backend="reference", scale_blocks=scale_blocks, **kw)


def _fwd_bwd(layer, seed=1):
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(24, D, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, layer.w_gate_up.grad


def _same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("cap, recipe", [(HOPPER, B.HOPPER_AUTO_SCALE_BLOCKS),
                                         (BLACKWELL, "1x32"), (AMPERE, "1x32"), (None, "1x32")])
def test_auto_resolves_per_arch(gpu_standin, cap, recipe):
    gpu_standin(cap)
    assert B.auto_scale_blocks("cpu") == recipe
    assert B.HOPPER_AUTO_SCALE_BLOCKS in ("1x32", "1x128")  # one named choice for sm_90


def test_default_is_auto_everywhere():
    import inspect

    for fn in (MXFP8MoE.__init__, MXFP8GroupedExperts.__init__, grouped_mm):
        assert inspect.signature(fn).parameters["scale_blocks"].default == "auto", fn
    assert _layer().scale_blocks == "auto"


@pytest.mark.parametrize("cap", [HOPPER, BLACKWELL, None])
def test_layer_runs_the_resolved_recipe(gpu_standin, cap):
    """The auto layer computes exactly what the explicit layer of the resolved recipe does."""
    gpu_standin(cap)
    want = B.auto_scale_blocks("cpu")
    auto = _fwd_bwd(_layer())
    assert _same(auto, _fwd_bwd(_layer(want)))
    other = "1x32" if want == "1x128" else "1x128"
    assert not _same(auto, _fwd_bwd(_layer(other)))  # the recipe reaches the GEMMs


def test_hopper_layer_aligns_groups_for_1x128(gpu_standin, hopper_picks_1x128):
    gpu_standin(HOPPER)
    layer = _layer()
    assert layer.resolved_scale_blocks() == "1x128" and layer.group_align_rows == 128
    gpu_standin(None)
    assert layer.resolved_scale_blocks() == "1x32" and layer.group_align_rows == 16


def test_explicit_choice_is_honoured(gpu_standin):
    gpu_standin(HOPPER)
    exact = _layer("1x32")
    assert exact.resolved_scale_blocks() == "1x32"
    gpu_standin(None)
    assert _same(_fwd_bwd(exact), _fwd_bwd(_layer("1x32")))


def test_layer_moved_to_another_kind_of_gpu_warns_once(gpu_standin, hopper_picks_1x128):
    gpu_standin(HOPPER)
    layer = _layer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fwd_bwd(layer)
        _fwd_bwd(layer)  # same kind: resolved once, no warning
    gpu_standin(BLACKWELL)
    with pytest.warns(RuntimeWarning, match=r"scale_blocks='auto' now resolves to '1x32' on "
                                            r"cpu sm_100 \(was '1x128' on cpu sm_90\)"):
        _fwd_bwd(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fwd_bwd(layer)  # once
    assert _same(_fwd_bwd(layer), _fwd_bwd(_layer("1x32")))


def test_compiled_layer_compiles_once(gpu_standin, hopper_picks_1x128):
    """Under torch.compile the recipe resolves without a guard on the layer's resolution state:
    steps after the first, eager forwards in between (a training loop's evaluations), replay
    the first compilation instead of recompiling (which cost the GPU training preset 6 s at its
    second step). The compiled steps compute what the eager layer computes."""
    gpu_standin(HOPPER)
    layer = _layer()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        first = _fwd_bwd(compiled)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(2):
                assert _same(_fwd_bwd(compiled), first)
                assert _same(_fwd_bwd(layer), first)  # eager: records the resolution
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    finally:
        torch._dynamo.reset()
    assert layer.resolved_scale_blocks() == "1x128"


def test_repr_names_request_and_resolution(gpu_standin, hopper_picks_1x128):
    gpu_standin(HOPPER)
    assert "scale_blocks='auto' (1x128 on cpu sm_90)" in repr(_layer())
    gpu_standin(None)
    assert "scale_blocks='auto' (1x32 on cpu)" in repr(_layer())
    assert "scale_blocks='1x128'" in repr(_layer("1x128"))
    ex = MXFP8GroupedExperts(D, H, E, backend="reference")
    assert "scale_blocks='auto' (1x32 on cpu)" in repr(ex)


def test_checkpoint_records_request_and_resolution(gpu_standin, hopper_picks_1x128, tmp_path):
    gpu_standin(HOPPER)
    path = tmp_path / "auto.safetensors"
    checkpoint.save_file(_layer(), path)
    rec = checkpoint.read_layer_configs(path)[""]["scale_blocks"]
    assert rec == {"requested": "auto", "resolved": "1x128"}
    gpu_standin(BLACKWELL)
    dst = _layer(seed=5)
    checkpoint.load_file(dst, path)
    assert dst.scale_blocks == "auto" and dst.resolved_scale_blocks() == "1x32"


def test_checkpoint_with_explicit_recipe_keeps_it(gpu_standin, tmp_path):
    path = tmp_path / "explicit.safetensors"
    checkpoint.save_file(_layer("1x128"), path)
    assert checkpoint.read_layer_configs(path)[""]["scale_blocks"] == {
        "requested": "1x128", "resolved": "1x128"}
    gpu_standin(BLACKWELL)
    auto = _layer(seed=5)
    checkpoint.load_file(auto, path)  # an "auto" layer takes the recorded explicit recipe
    assert auto.scale_blocks == "1x128" and auto.resolved_scale_blocks() == "1x128"
    exact = _layer("1x32", seed=5)
    checkpoint.load_file(exact, path)  # never refused: the recipe does not change the weights
    assert exact.scale_blocks == "1x32"  # the layer's explicit choice wins
    twin = _layer(seed=5, precision="bf16")
    checkpoint.load_file(twin, path)


def test_grouped_mm_auto(gpu_standin, hopper_picks_1x128):
    torch.manual_seed(0)
    x = torch.randn(96, D, dtype=torch.bfloat16)
    w_t = torch.randn(E, D, H, dtype=torch.bfloat16)
    offs = torch.tensor([20, 40, 70, 96], dtype=torch.int32)
    for cap in (HOPPER, BLACKWELL):
        gpu_standin(cap)
        want = B.auto_scale_blocks("cpu")
        y = grouped_mm(x, w_t, offs, backend="reference")
        assert torch.equal(y, grouped_mm(x, w_t, offs, backend="reference", scale_blocks=want))
    with pytest.raises(ValueError, match="scale_blocks must be one of"):
        grouped_mm(x, w_t, offs, backend="reference", scale_blocks="1x64")


def test_grouped_experts_auto_and_older_weight_blocks(gpu_standin, hopper_picks_1x128):
    gpu_standin(HOPPER)
    torch.manual_seed(0)
    ex = MXFP8GroupedExperts(D, H, E, backend="reference")
    ex.init_weights(0.02)
    x = torch.randn(48, D, dtype=torch.bfloat16)
    n = torch.tensor([10, 14, 0, 24])
    ref = MXFP8GroupedExperts(D, H, E, backend="reference", scale_blocks="1x128")
    ref.load_state_dict(ex.state_dict())
    assert torch.equal(ex(x, n), ref(x, n))
    assert MXFP8GroupedExperts(D, H, E, weight_blocks="32x32").scale_blocks == "32x32"


def test_quantizers_keep_the_exact_recipe_by_default(gpu_standin):
    """A quantizer's bytes are the format's, the same on every device: no "auto" there."""
    gpu_standin(HOPPER)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    q = quantize_rowwise(x, backend="reference")
    exact = quantize_rowwise(x, backend="reference", scale_blocks="1x32")
    assert torch.equal(q.scale, exact.scale) and torch.equal(q.data.view(torch.uint8),
                                                             exact.data.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_auto_runs_the_arch_recipe():
    """On the real GPU: "auto" is the table's recipe for its compute capability, and the auto
    layer's forward and backward are bit for bit the explicit recipe's."""
    dev = torch.device("cuda")
    major = torch.cuda.get_device_capability(dev)[0]
    want = {9: B.HOPPER_AUTO_SCALE_BLOCKS, 10: "1x32"}.get(major, "1x32")
    assert B.auto_scale_blocks(dev) == want
    layers = []
    for recipe in ("auto", want):
        torch.manual_seed(0)
        layers.append(MXFP8MoE(D, H, E, K, scale_blocks=recipe, device=dev))
    outs = []
    for layer in layers:
        torch.manual_seed(1)
        x = torch.randn(256, D, dtype=torch.bfloat16, device=dev, requires_grad=True)
        y = layer(x)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad, layer.w_gate_up.grad, layer.w_down.grad))
    assert _same(*outs)
    assert f"scale_blocks='auto' ({want} on cuda sm_" in repr(layers[0])
