"""`MXFP8MoE` as an object: the constructor validates every argument, and the layer copies
(``copy.deepcopy``, pickle) after a forward with grad enabled while ``aux_loss`` keeps working."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from moe_mxfp8 import MXFP8MoE

BF16 = torch.bfloat16


def _layer(**kw):
    kw.setdefault("backend", "reference")
    return MXFP8MoE(64, 64, 4, 2, **kw)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "auto" falling back on the CPU
        yield


# ---- constructor validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"backend": "bogus"}, ValueError, "backend must be one of"),
        ({"backend": None}, ValueError, "backend must be one of"),
        ({"backend": "bogus", "precision": "bf16"}, ValueError, "backend must be one of"),
        ({"renormalize": "yes"}, TypeError, "renormalize must be a bool"),
        ({"save_colwise": 1}, TypeError, "save_colwise must be a bool"),
        ({"aux_loss_coef": float("nan")}, ValueError, "aux_loss_coef must be a finite"),
        ({"aux_loss_coef": -0.1}, ValueError, "aux_loss_coef must be a finite"),
        ({"aux_loss_coef": "0.01"}, ValueError, "aux_loss_coef must be a finite"),
        ({"aux_loss_coef": True}, ValueError, "aux_loss_coef must be a finite"),
        ({"top_k": 2.0}, ValueError, "top_k"),
        ({"dim": True}, ValueError, "dim"),
        ({"hidden_dim": -32}, ValueError, "hidden_dim"),
    ],
)
def test_constructor_refuses_bad_arguments_in_one_line(kwargs, exc, match):
    args = {"dim": 64, "hidden_dim": 64, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(exc, match=match) as info:
        MXFP8MoE(args.pop("dim"), args.pop("hidden_dim"), args.pop("num_experts"),
                 args.pop("top_k"), **args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("backend", ["auto", "reference", "sm90", "sm100"])
def test_constructor_accepts_every_backend_name(backend, monkeypatch):
    # Where CUDA exists, a kernel backend is only checked against the GPU at the first forward:
    # the layer may be built on the CPU and moved to the GPU afterwards.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _layer(backend=backend).backend == backend
    assert _layer(aux_loss_coef=0).aux_loss_coef == 0.0


@pytest.mark.parametrize("backend", ["sm90", "sm100"])
def test_kernel_backend_without_cuda_fails_in_the_constructor(backend, monkeypatch):
    """On a machine without CUDA a kernel backend can never run: one line at construction
    (not a traceback from deep inside the first forward); the BF16 twin ignores the name."""
    from moe_mxfp8 import backend as B

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=f"backend='{backend}' needs a CUDA GPU, but torch "
                                           "sees none") as info:
        _layer(backend=backend)
    assert "\n" not in str(info.value)
    monkeypatch.setenv(B.ENV_VAR, backend)
    with pytest.raises(RuntimeError, match=f"MOE_MXFP8_BACKEND='{backend}' needs a CUDA GPU"):
        _layer(backend="auto")
    _layer(backend="reference")
    _layer(backend=backend, precision="bf16")


def test_bad_backend_environment_variable_fails_in_the_constructor(monkeypatch):
    from moe_mxfp8 import backend as B

    monkeypatch.setenv(B.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="MOE_MXFP8_BACKEND='tpu' is not one of"):
        _layer(backend="auto")
    _layer(backend="reference")  # an explicit backend does not read it
    _layer(backend="auto", precision="bf16")  # nor does the BF16 twin


# ---- copies after a forward with grad ---------------------------------------------------------


def _forward(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 64, generator=g).to(BF16)
    return layer(x)


def test_deepcopy_after_forward_keeps_the_aux_loss_api():
    moe = _layer()
    y = _forward(moe)
    assert moe.aux_loss.requires_grad and moe.aux_loss.grad_fn is not None
    twin = copy.deepcopy(moe)  # raised "Only Tensors created explicitly by the user" before
    # The copy holds the last value, detached; the original's tensor is untouched and in graph.
    assert not twin.aux_loss.requires_grad and twin.aux_loss.grad_fn is None
    assert torch.equal(twin.aux_loss, moe.aux_loss.detach())
    assert moe.aux_loss.grad_fn is not None
    (y.float().square().mean() + moe.aux_loss).backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert twin.router.weight.grad is None
    for (n, p), (n2, p2) in zip(moe.named_parameters(), twin.named_parameters(), strict=True):
        assert n == n2 and p is not p2 and torch.equal(p.detach(), p2.detach())


def test_aux_loss_alone_trains_the_router():
    moe = _layer()
    _forward(moe)
    copy.deepcopy(moe)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_ema_pattern_in_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, dtype=BF16), _layer())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = None
    for _ in range(3):
        y = model(torch.randn(16, 64, dtype=BF16))
        loss = y.float().square().mean() + model[1].aux_loss
        if ema is None:
            ema = copy.deepcopy(model)  # after the forward, before backward: graph still live
            for p in ema.parameters():
                p.requires_grad_(False)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(p, 0.5)
    with torch.no_grad():
        out = ema(torch.randn(4, 64, dtype=BF16))
    assert out.shape == (4, 64) and torch.isfinite(out.float()).all()
    # The EMA weights moved towards the trained ones and are not the same tensors.
    assert not torch.equal(ema[1].w_gate_up, model[1].w_gate_up)


def test_eval_copy_and_pickle():
    moe = _layer()
    y = _forward(moe)
    evaluator = copy.deepcopy(moe).eval()
    with torch.no_grad():
        y2 = _forward(evaluator)
    torch.testing.assert_close(y2, y.detach(), rtol=0, atol=0)
    assert evaluator.aux_loss.grad_fn is None  # set by its own no-grad forward
    buf = io.BytesIO()
    torch.save(moe, buf)  # a whole-module pickle after a forward with grad
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded.aux_loss, moe.aux_loss.detach())
    assert torch.equal(loaded.w_down, moe.w_down)
    assert moe.aux_loss.grad_fn is not None  # the live layer keeps its graph


def test_copy_before_any_forward():
    moe = _layer()
    assert copy.deepcopy(moe).aux_loss is None


@pytest.mark.parametrize("option, value", [("save_colwise", False), ("weight_blocks", "32x32")])
def test_layer_deprecated_options_warn_and_are_honoured(option, value):
    """``save_colwise`` and ``weight_blocks`` still work on the layer, with one
    DeprecationWarning naming the option; left out, the layer does not warn."""
    with pytest.warns(DeprecationWarning, match=f"MXFP8MoE: {option} is deprecated"):
        layer = MXFP8MoE(64, 64, 4, 2, backend="reference", **{option: value})
    assert getattr(layer, option) == value
    if option == "weight_blocks":
        assert layer.scale_blocks == "32x32"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        MXFP8MoE(64, 64, 4, 2, backend="reference")
