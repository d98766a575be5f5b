"""Kernels run on their operands' GPU, whichever device is current, and are compiled, keyed and
launched for the arch CuTeDSL compiles for.

CPU: stand-ins for the CUDA queries (two GPUs, device 0 current) prove that a grouped GEMM or
quantizer launch for operands on ``cuda:1`` enters ``cuda:1``, launches on ``cuda:1``'s stream
and keys its kernel on the arch CuTeDSL compiles for (GPU 0's, or ``$CUTE_DSL_ARCH``), that a
GPU of another arch is refused, and that the self-check's completion event is recorded on the
checked device's stream.
Two GPUs: `MXFP8MoE` (both recipes) and its BF16 twin on ``cuda:1`` with ``cuda:0`` current give
the same bits as on ``cuda:0`` (forward, input and weight gradients), and so do the raw
grouped GEMMs, the quantizers and the expert-parallel payload kernels.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from moe_mxfp8.kernels import compile_cache as CC
from moe_mxfp8.kernels import native

import moe_mxfp8
from moe_mxfp8 import backend as B
from moe_mxfp8 import selfcheck

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# CPU: stand-ins for two GPUs, device 0 current
# ---------------------------------------------------------------------------------------------


class FakeCuda:
    """Two GPUs of the given capabilities, GPU 0 current. Every query must name its device
    (a query of the current device is what these tests catch: it raises); `torch.cuda.device`
    switches ``current``; streams are ``100 + index``."""

    def __init__(self, caps):
        self.caps = caps
        self.current = 0
        self.entered: list[int] = []
        self.stream_queries: list[int] = []

    def capability(self, device=None):
        if device is None:
            raise AssertionError("capability of the current device asked for")
        return self.caps[torch.device("cuda", device).index if isinstance(device, int)
                         else torch.device(device).index]

    def stream(self, device=None):
        if device is None:
            raise AssertionError("current stream of the current device asked for")
        index = device if isinstance(device, int) else torch.device(device).index
        self.stream_queries.append(index)
        return SimpleNamespace(cuda_stream=100 + index)

    def device(self, device):
        fake = self

        class Guard:
            def __enter__(self):
                self.prev, fake.current = fake.current, torch.device(device).index
                fake.entered.append(fake.current)

            def __exit__(self, *exc):
                fake.current = self.prev

        return Guard()


def _clear_device_caches():
    from moe_mxfp8.kernels.grouped_gemm import launcher

    CC._default_arch.cache_clear()
    CC.device_arch.cache_clear()
    B._capability_of_index.cache_clear()
    launcher._max_active_clusters.cache_clear()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Install `FakeCuda` (set its ``caps`` in the test; default two sm_90 GPUs)."""
    fake = FakeCuda({0: (9, 0), 1: (9, 0)})
    monkeypatch.delenv(CC.ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", fake.capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: fake.stream(index).cuda_stream, raising=False)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=132, uuid=f"GPU-{i}"))
    _clear_device_caches()
    yield fake
    _clear_device_caches()


def _recording_get(seen: dict, fake):
    """A compile cache's ``get`` stand-in: records the key into ``seen`` and returns a kernel
    that records its launch stream and the device current at launch."""

    def get(key, build, **kw):
        seen["key"] = key

        def kernel(*args):
            seen["stream"], seen["current"] = args[-1], fake.current

        return kernel

    return get


def _gemm_on(device_index: int, monkeypatch, fake):
    """One M-grouped sm90 launch through the real launcher for CPU operands described as living
    on ``cuda:<device_index>``; returns (cache key, launch stream, device current at launch)."""
    from moe_mxfp8.kernels.grouped_gemm import launcher
    from moe_mxfp8.kernels.grouped_gemm import problem as P
    from moe_mxfp8.kernels.grouped_gemm.sm90_config import GroupedGemmSm90Host

    prob = selfcheck.CheckProblem((40, 0, 70), n=64, k=96)
    a, b, offs = selfcheck.make_operands("m", prob, "cpu")
    desc = P.describe_m(a, b, offs, BF16)
    on_gpu = type(desc)(**{**vars(desc), "device": torch.device("cuda", device_index)})
    monkeypatch.setattr(launcher.P, "output", lambda p, out=None: torch.empty(p.out_shape))
    seen: dict = {}
    monkeypatch.setattr(launcher._CACHE, "get", _recording_get(seen, fake))
    launcher.run(GroupedGemmSm90Host, on_gpu, a, b, offs)
    return seen


def test_grouped_gemm_launches_on_the_operands_gpu(fake_cuda, monkeypatch):
    """Operands on cuda:1, cuda:0 current: the launch enters cuda:1, uses cuda:1's stream
    and keys the kernel on GPU 0's arch (what CuTeDSL compiles for), asking no current-device
    query. (It launched on the current device's stream, keyed by the current device's arch.)"""
    seen = _gemm_on(1, monkeypatch, fake_cuda)
    assert seen["current"] == 1 and fake_cuda.current == 0  # restored after the launch
    assert seen["stream"] == native.Stream(101) and fake_cuda.stream_queries == [1]
    assert seen["key"][2] == "sm_90a"


def test_a_gpu_of_another_arch_is_refused(fake_cuda, monkeypatch):
    """CuTeDSL compiles for GPU 0's arch: a launch on a GPU of another arch is refused with a
    clear error, not keyed and launched as GPU 0's kernel. ``$CUTE_DSL_ARCH`` is taken as the
    arch compiled for."""
    fake_cuda.caps = {0: (9, 0), 1: (10, 0)}
    with pytest.raises(RuntimeError, match=r"cuda:1 is sm_100a .* GPU 0's sm_90a"):
        _gemm_on(1, monkeypatch, fake_cuda)
    assert _gemm_on(0, monkeypatch, fake_cuda)["key"][2] == "sm_90a"
    monkeypatch.setenv(CC.ARCH_ENV, "sm_100a")
    assert _gemm_on(1, monkeypatch, fake_cuda)["key"][2] == "sm_100a"


def test_quantizer_launches_on_the_operands_gpu(fake_cuda, monkeypatch):
    from moe_mxfp8.kernels import quantize_launch as Q
    from moe_mxfp8.kernels.quantize_config import QuantConfig

    seen: dict = {}
    monkeypatch.setattr(Q._cache, "get", _recording_get(seen, fake_cuda))
    x = SimpleNamespace(device=torch.device("cuda", 1), data_ptr=lambda: 4096)
    cfg = QuantConfig(dtype="bfloat16", rounding="rceil", k=64, rows=True, cols=False)
    Q._launch("quantize_rowwise", cfg, x, None, None, None, None, None, None, 128, 1, 0, 1)
    assert seen["current"] == 1 and fake_cuda.current == 0
    assert seen["stream"] == native.Stream(101) and fake_cuda.stream_queries == [1]
    assert seen["key"] == ("quantize_rowwise", cfg, "sm_90a")


def test_selfcheck_fence_is_on_the_checked_gpus_stream(fake_cuda, monkeypatch):
    """The self-check's completion event is recorded on the checked device's stream (on the
    current device's it would not wait for the kernel: no hang would be caught)."""
    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    selfcheck.device_fence(torch.device("cuda", 1))
    assert [s.cuda_stream for s in recorded] == [101]


def test_cpu_operands_need_no_guard():
    """Off CUDA (the Triton interpreter, CPU stand-ins) the guard is nothing at all."""
    from moe_mxfp8.kernels.device import on_device

    with on_device(torch.device("cpu")):
        pass


# ---------------------------------------------------------------------------------------------
# Two GPUs: the second GPU gives the first's bits, with the first one current
# ---------------------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs")

LAYERS = {  # id -> MXFP8MoE keyword arguments
    "mxfp8-1x32": {},
    "mxfp8-1x128": {"scale_blocks": "1x128"},
    "bf16": {"precision": "bf16"},
}
DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 1024, 512, 8, 2, 4096


def _step(layer, x, dy) -> dict:
    """Forward + backward from zeroed gradients; every result on the CPU."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    res = {"y": y, "dx": x.grad}
    res.update({f"d{n}": p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return {k: v.detach().cpu() for k, v in res.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bitwise_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        g, w = got[k], want[k]
        assert torch.isfinite(w.float()).all(), (what, k)
        if g.shape != w.shape or not torch.equal(_bits(g), _bits(w)):
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            raise AssertionError(f"{what}: {k} differs from cuda:0 (relative error {err:.3g})")


def compare_layer_on_two_gpus(kind: str, move: str, seed: int) -> None:
    """The layer ``kind`` on cuda:1 (built there, or moved with ``.to``) with cuda:0 current:
    forward and backward bitwise equal to the same layer on cuda:0."""
    assert torch.cuda.current_device() == 0
    torch.manual_seed(seed)
    ref = moe_mxfp8.MXFP8MoE(DIM, HIDDEN, EXPERTS, TOP_K, device="cuda:0", **LAYERS[kind])
    if move == "device":
        other = moe_mxfp8.MXFP8MoE(DIM, HIDDEN, EXPERTS, TOP_K, device="cuda:1",
                                   **LAYERS[kind])
        other.load_state_dict(ref.state_dict())
    else:
        other = copy.deepcopy(ref).to("cuda:1")
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOKENS, DIM, generator=gen).to(BF16)
    dy = torch.randn(TOKENS, DIM, generator=gen).to(BF16)
    want = _step(ref, x.to("cuda:0"), dy.to("cuda:0"))
    for _ in range(2):  # twice: a race would not reproduce the same bits
        got = _step(other, x.to("cuda:1"), dy.to("cuda:1"))
        assert torch.cuda.current_device() == 0
        _bitwise_equal(got, want, f"{kind} ({move})")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("move", ["device", "to"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_on_second_gpu_matches_first(kind, move):
    compare_layer_on_two_gpus(kind, move, seed=0)


@pytest.mark.gpu
@two_gpus
def test_layer_on_second_gpu_with_cached_kernels(tmp_path):
    """The same comparison in two fresh processes sharing a kernel cache: the first compiles
    (CuTeDSL's launch), the second loads every kernel natively (``ctypes``) -- and once more
    with ``MOE_MXFP8_NATIVE_LAUNCH=0`` (CuTeDSL's loader)."""
    code = textwrap.dedent("""
        import sys
        from tests.test_device_placement import compare_layer_on_two_gpus
        for kind in ("mxfp8-1x32", "mxfp8-1x128"):
            compare_layer_on_two_gpus(kind, "device", seed=3)
        print("cutlass imported:", "cutlass" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env[CC.ENV_DIR] = str(tmp_path / "cache")
    env.pop(CC.ENV_DISABLE, None)
    for native_launch, cutlass in (("1", True), ("1", False), ("0", True)):
        env[CC.ENV_NATIVE] = native_launch
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"cutlass imported: {cutlass}" in res.stdout, (native_launch, res.stdout)


def _on_both(fn):
    """``fn(device)`` on cuda:0 and on cuda:1 (cuda:0 current), results on the CPU."""
    assert torch.cuda.current_device() == 0
    return [fn(torch.device("cuda", i)) for i in (0, 1)]


def _bytes(t) -> list[torch.Tensor]:
    """An MXFP8Tensor (or a tuple of them) as its data and scale bytes on the CPU."""
    if isinstance(t, tuple):
        return [b for x in t for b in _bytes(x)]
    return [t.data.view(torch.uint8).cpu(), t.scale.cpu()]


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_quantizers_on_second_gpu(scale_blocks):
    """Every quantizer on cuda:1 with cuda:0 current writes the bytes it writes on cuda:0,
    which are the reference's."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2000, 512, generator=gen).to(BF16)
    w = torch.randn(8, 256, 512, generator=gen).to(BF16)
    offs = torch.tensor([300, 300, 1100, 2000], dtype=torch.int32)
    rows = 128 if scale_blocks == "1x128" else 1
    ops = {  # (device, backend) -> MXFP8 tensor(s)
        "rowwise": lambda d, be: moe_mxfp8.quantize_rowwise(x.to(d), scale_blocks=scale_blocks,
                                                            backend=be),
        "colwise": lambda d, be: moe_mxfp8.quantize_colwise(x.to(d), offs=offs.to(d),
                                                            scale_blocks=scale_blocks,
                                                            backend=be),
        "dual": lambda d, be: moe_mxfp8.quantize_dual(x.to(d), offs=offs.to(d),
                                                      scale_blocks=scale_blocks, backend=be),
        "weights": lambda d, be: moe_mxfp8.quantize_weights(w.to(d), block_rows=rows,
                                                            backend=be),
    }
    for name, op in ops.items():
        first, second = _on_both(lambda d, op=op: _bytes(op(d, "auto")))
        ref = _bytes(op(torch.device("cuda", 0), "reference"))
        for i, (a, b, r) in enumerate(zip(first, second, ref, strict=True)):
            assert torch.equal(b, a), (name, i, "cuda:1 differs from cuda:0")
            assert torch.equal(a, r), (name, i, "cuda:0 differs from the reference")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("scale_blocks", ["1x32", "1x128"])
def test_grouped_mm_on_second_gpu(scale_blocks):
    """The differentiable grouped GEMM (fprop, dgrad, wgrad kernels) on cuda:1 with cuda:0
    current: the bits of cuda:0."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3000, 512, generator=gen).to(BF16)
    w = torch.randn(8, 768, 512, generator=gen).to(BF16)
    dy = torch.randn(3000, 768, generator=gen).to(BF16)
    offs = torch.tensor([0, 700, 700, 1500, 2100, 2500, 2900, 3000], dtype=torch.int32)

    def run(d):
        xd = x.to(d).requires_grad_()
        wd = w.to(d).requires_grad_()
        y = moe_mxfp8.grouped_mm(xd, wd.transpose(-2, -1), offs.to(d),
                                 scale_blocks=scale_blocks)
        y.backward(dy.to(d))
        return {"y": y.detach().cpu(), "dx": xd.grad.cpu(), "dw": wd.grad.cpu()}

    first, second = _on_both(run)
    _bitwise_equal(second, first, f"grouped_mm {scale_blocks}")


@pytest.mark.gpu
@two_gpus
def test_ep_payload_kernels_on_second_gpu():
    """The expert-parallel MXFP8 payload's pack and unpack kernels on cuda:1 with cuda:0
    current: the bytes of cuda:0."""
    pytest.importorskip("triton")
    from moe_mxfp8.kernels import ep_payload_triton as E

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1000, 512, generator=gen).to(BF16)
    index = torch.randperm(1000, generator=gen)[:700]

    def run(d):
        payload = E.pack_rows(x.to(d), index.to(d))
        return [payload.cpu(), E.unpack_rows(payload, 512).cpu()]

    first, second = _on_both(run)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))


def test_grid_leaves_the_sms_asked_for(fake_cuda, monkeypatch):
    """``leave_sms``: the persistent grid shrinks by whole clusters until that many SMs are free
    (132-SM GPU: 116 single CTAs for 16 SMs, 58 two-CTA clusters for 15), never below one
    cluster nor above the work or ``max_clusters``."""
    from moe_mxfp8.kernels.grouped_gemm import launcher

    # (cached as the real query is: the fixture clears it afterwards)
    monkeypatch.setattr(launcher, "_max_active_clusters",
                        functools.cache(lambda index, size: 132 // size))
    prob = SimpleNamespace(device=torch.device("cuda", 0), m=1 << 20, num_groups=8)

    def host(size, units):
        return SimpleNamespace(cluster_size=lambda: size, units_per_cluster=lambda: size,
                               units_bound=lambda m, g: units)

    grid = launcher._grid_clusters
    assert grid(host(1, 10**6), prob, None) == grid(host(1, 10**6), prob, None, 0) == 132
    assert grid(host(1, 10**6), prob, None, 16) == 116
    assert grid(host(2, 10**6), prob, None, 15) == 58 and grid(host(2, 10**6), prob, None, 16) == 58
    assert grid(host(1, 40), prob, None, 16) == 40  # fewer units than SMs left: unchanged
    assert grid(host(1, 10**6), prob, 100, 16) == 100 and grid(host(1, 10**6), prob, 7, 16) == 7
    assert grid(host(1, 10**6), prob, None, 500) == 1
