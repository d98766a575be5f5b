"""Bad input gets a clear error naming the argument; backend selection never falls back silently."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe_mxfp8
from moe_mxfp8 import backend as B
from moe_mxfp8 import quantize_colwise, quantize_dual, quantize_rowwise, quantize_weights
from moe_mxfp8.grouped_gemm import grouped_mm_k, grouped_mm_m

X = torch.randn(64, 64)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e4m3fn])
def test_wrong_dtype(dtype):
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        quantize_rowwise(X.to(dtype), backend="reference")


def test_wrong_ndim():
    with pytest.raises(ValueError, match="x must be 2D"):
        quantize_rowwise(torch.randn(2, 4, 32), backend="reference")
    with pytest.raises(ValueError, match="w must be 3D"):
        quantize_weights(torch.randn(4, 32), backend="reference")


def test_not_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        quantize_rowwise(torch.randn(4, 48), backend="reference")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_dual(torch.randn(4, 48), backend="reference")
    with pytest.raises(ValueError, match="axis N must be a multiple of 32"):
        quantize_weights(torch.randn(2, 40, 64), axis="N", backend="reference")
    # colwise accepts any M (its last block is zero-padded)
    assert quantize_colwise(torch.randn(45, 32), backend="reference").data.shape == (32, 45)


def test_bad_options():
    with pytest.raises(ValueError, match="rounding"):
        quantize_rowwise(X, rounding="nearest", backend="reference")
    with pytest.raises(ValueError, match="scale_layout"):
        quantize_rowwise(X, scale_layout="swizzled", backend="reference")
    with pytest.raises(ValueError, match="axis must be"):
        quantize_weights(torch.randn(2, 32, 32), axis=1, backend="reference")
    with pytest.raises(ValueError, match="block_rows"):
        quantize_weights(torch.randn(2, 32, 32), block_rows=16, backend="reference")


@pytest.mark.parametrize(
    "offs,err,match",
    [
        (torch.tensor([32, 64], dtype=torch.int64), TypeError, "offs must be int32"),
        (torch.tensor([[64]], dtype=torch.int32), ValueError, "1D"),
        (torch.tensor([40, 20, 64], dtype=torch.int32), ValueError, "non-decreasing"),
        (torch.tensor([20, 60], dtype=torch.int32), ValueError, "must equal the grouped extent 64"),
        ([32, 64], TypeError, "offs must be a torch.Tensor"),
    ],
)
def test_bad_offs(offs, err, match):
    for fn in (quantize_rowwise, quantize_colwise, quantize_dual):
        with pytest.raises(err, match=match):
            fn(X, offs=offs, backend="reference")


def test_non_contiguous_is_fine():
    # Every backend takes any strides (the kernel path copies first: tests/test_domain.py).
    xt = torch.randn(64, 64).t()
    got = quantize_rowwise(xt, backend="reference")
    assert got.data.is_contiguous()
    want = quantize_rowwise(xt.contiguous(), backend="reference")
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


def test_requires_grad_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"quantize_dual: x requires grad.*x.detach\(\)"):
        quantize_dual(X.clone().requires_grad_(), backend="reference")


def test_nan_inf_follow_the_contract_not_an_exception():
    x = X.clone()
    x[0, 0], x[1, 40] = float("nan"), float("inf")
    s = quantize_rowwise(x, scale_layout="dense", backend="reference").scale
    assert s[0, 0] == 0xFF and s[1, 1] == 0xFF and (s[2:] != 0xFF).all()


def test_gemm_argument_checks():
    a = quantize_rowwise(X, backend="reference")
    w = quantize_weights(torch.randn(2, 32, 64), backend="reference")
    offs = torch.tensor([10, 64], dtype=torch.int32)
    with pytest.raises(TypeError, match="MXFP8Tensor"):
        grouped_mm_m(X, w, offs, backend="reference")
    with pytest.raises(ValueError, match="2 experts"):
        grouped_mm_m(a, w, torch.tensor([64], dtype=torch.int32), backend="reference")
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm_m(a, w, offs, out_dtype=torch.float16, backend="reference")
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_mm_m(quantize_rowwise(torch.randn(64, 32), backend="reference"), w, offs,
                     backend="reference")
    with pytest.raises(ValueError, match="quantized along M per group"):
        grouped_mm_k(a, a, offs, backend="reference")


# ---- backend selection -------------------------------------------------------------------


def test_auto_on_cpu_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    B._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert B.resolve_backend("auto", torch.device("cpu")) == "reference"
        assert B.resolve_backend(None, torch.device("cpu")) == "reference"
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "falling back to the pure-PyTorch 'reference'" in msgs[0]


@pytest.mark.parametrize("name", ["sm90", "sm100"])
def test_kernel_backend_on_cpu_is_an_error(name):
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        B.resolve_backend(name, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        quantize_rowwise(X, backend=name)


def test_env_var_replaces_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv(B.ENV_VAR, "sm90")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        B.resolve_backend("auto", torch.device("cpu"))
    assert B.resolve_backend("reference", torch.device("cpu")) == "reference"
    monkeypatch.setenv(B.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match="MOE_MXFP8_BACKEND='tpu'"):
        B.resolve_backend("auto", torch.device("cpu"))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        B.resolve_backend("cuda", torch.device("cpu"))


@pytest.mark.parametrize("major,want", [(9, "sm90"), (10, "sm100"), (8, None), (12, None)])
def test_arch_table(monkeypatch, major, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (major, 0))
    assert B.kernel_backend_for(torch.device("cuda", 0)) == want
    if want is None:
        with pytest.raises(RuntimeError, match=f"compute capability {major}.0"):
            B.resolve_backend("sm90", torch.device("cuda", 0))


def test_device_capability_is_asked_once_per_gpu(monkeypatch):
    """`resolve_backend` runs at every quantizer and GEMM call: each GPU's compute capability
    is asked of torch once per process, per index (a device without an index, the current
    one, every time); CPU devices never ask."""
    asked = []

    def capability(device=None):
        asked.append(device)
        return {0: (9, 0), 1: (10, 0)}[0 if device is None else device]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(B, "cutedsl_available", lambda: True)
    for _ in range(3):
        assert B.resolve_backend("sm90", torch.device("cuda", 0)) == "sm90"
        assert B.kernel_backend_for(torch.device("cuda", 1)) == "sm100"
        assert B.device_capability(torch.device("cpu")) is None
    assert asked == [0, 1]
    assert B.device_capability(torch.device("cuda")) == (9, 0) and asked == [0, 1, None]


def test_kernels_package_name_and_no_top_level_kernels():
    import importlib.util

    import moe_mxfp8.kernels as k

    assert k.__name__ == "moe_mxfp8.kernels"
    assert moe_mxfp8.kernels is k
    spec = importlib.util.find_spec("kernels")
    # Running from a source checkout puts the repo root on sys.path (pytest rootdir), where
    # `kernels/` is a directory: that is the checkout, not an installed top-level module.
    assert spec is None or "site-packages" not in (spec.origin or "")

