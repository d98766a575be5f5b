"""The first-use self-check (`moe_mxfp8.selfcheck`) -- CPU, with stand-in kernels.

It accepts a correct kernel, refuses a wrong, hanging or faulting one with a clear error naming
the configuration, caches its verdict per compiled configuration, runs before the first launch
of a kernel class that asks for it (sm100, through the API and the launcher), and its problems
fit the sm100 kernel and make every cluster wrap the stage ring and both accumulator stages
(walked by the shared schedule code). On a Blackwell GPU the same checks run for real
(tests/kernels/test_grouped_gemm_sm100.py).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moe_mxfp8 import reference as R
from moe_mxfp8 import selfcheck

pytest.importorskip("cutlass")

from moe_mxfp8.kernels.grouped_gemm import problem as P  # noqa: E402
from schedule_walk import walk  # noqa: E402  (tests/kernels is on sys.path under pytest)


@pytest.fixture(scope="module")
def K():
    from moe_mxfp8.kernels.grouped_gemm import sm100
    from sm100_emu import sm100_target

    # host functions that build the kernel's tcgen05 layouts (stage count) need sm_100a
    with sm100_target():
        yield sm100


def test_selfcheck_problems_fit_the_kernel(K):
    """The first-use check must be runnable by the sm100 kernel (else it would refuse to run
    for the wrong reason) and must cover both M-grouped tile configurations."""
    configs = set()
    for mode, probs in selfcheck.DEFAULT_PROBLEMS.items():
        for prob in probs:
            m = sum(prob.sizes)
            p = P.GroupedProblem(mode, m, prob.n, prob.k, len(prob.sizes), prob.out_dtype,
                                 "1x32", torch.device("cpu"))
            if mode == "k":  # the launcher aligns K-grouped groups first
                p = dataclasses.replace(p, m=P.k_aligned_extent(m, len(prob.sizes)))
            cfg = K.GroupedGemmSm100.select_config(p)
            ok, why = K.GroupedGemmSm100(cfg).can_implement(p)
            assert ok, (prob, why)
            assert 0 in prob.sizes
            configs.add((mode, cfg.two_cta))
    assert configs == {("m", False), ("m", True), ("k", False)}


# Smaller than the defaults (fast on CPU) but with the same traps: empty groups, partial tiles.
SMALL = {
    "m": (selfcheck.CheckProblem((40, 0, 70), n=64, k=96),),
    "k": (selfcheck.CheckProblem((48, 0, 35), n=64, k=32, out_dtype=torch.float32),),
}


@pytest.fixture(autouse=True)
def _fresh_verdicts():
    selfcheck.reset()
    yield
    selfcheck.reset()


def _counting(fn):
    calls = []

    def kernel(a, b, offs, out_dtype, *unused, **launch):  # (max_clusters)
        calls.append(launch)
        return fn(a, b, offs, out_dtype)

    return kernel, calls


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_accepts_reference_default_problems(mode):
    assert selfcheck.run_selfcheck(R.grouped_mm, mode, "cpu") is None


def _scaled(a, b, offs, dt):
    return (R.grouped_mm(a, b, offs, torch.float32) * 1.05).to(dt)


def _last_group_zero(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    if out.dim() == 2:
        out[int(offs[-2]):] = 0  # forgot the rows of the last group
    else:
        out[-1] = 0
    return out


def _empty_group_garbage(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    out[1] = 1.0  # mode k: group 1 is empty and must be zeros
    return out


def _unwritten(a, b, offs, dt):
    out = R.grouped_mm(a, b, offs, dt)
    out.view(-1)[-5:] = float("nan")  # a few elements never stored
    return out


def _raises(a, b, offs, dt):
    raise RuntimeError("CUDA error: illegal instruction")


def _wrong_dtype(a, b, offs, dt):
    return R.grouped_mm(a, b, offs, torch.float16)


@pytest.mark.parametrize(
    "mode,bad,expect",
    [
        ("m", _scaled, "error"),
        ("m", _last_group_zero, "error"),
        ("m", _unwritten, "NaN"),
        ("m", _raises, "illegal instruction"),
        ("k", _empty_group_garbage, "empty group 1"),
        ("k", _last_group_zero, "error"),
        ("k", _wrong_dtype, "float16"),
    ],
)
def test_selfcheck_rejects_wrong_kernels(mode, bad, expect):
    why = selfcheck.run_selfcheck(bad, mode, "cpu", SMALL[mode])
    assert why is not None and expect in why


def test_ensure_verified_caches_pass():
    kernel, calls = _counting(R.grouped_mm)
    selfcheck.ensure_verified("test.op_m", kernel, "cpu", "m", problems=SMALL["m"])
    n = len(calls)
    assert n == len(SMALL["m"])
    selfcheck.ensure_verified("test.op_m", kernel, "cpu", "m", problems=SMALL["m"])
    assert len(calls) == n  # cached: the kernel is not run again
    assert selfcheck.verdict("test.op_m", "cpu") is None


def test_ensure_verified_refuses_and_caches_failure():
    kernel, calls = _counting(_scaled)
    for _ in range(2):
        with pytest.raises(selfcheck.KernelSelfCheckError) as err:
            selfcheck.ensure_verified("test.op_k", kernel, "cpu", "k", problems=SMALL["k"])
        assert "backend='reference'" in str(err.value)
        assert "test.op_k" in str(err.value)
    assert len(calls) == 1  # the failing verdict is cached; the kernel never runs again


def test_ensure_verified_needs_a_mode():
    with pytest.raises(ValueError, match="mode"):
        selfcheck.ensure_verified("test.op", R.grouped_mm, "cpu", "x")


def _stand_in_launches(monkeypatch, kernel_cls):
    """The sm100 API path through the real launcher with its compiled kernel replaced by
    ``state["kernel"](a, b, offs, dtype)`` written into the launcher's output buffer (the
    operands of the launch in progress: the check runs inside the user's launch). Returns
    ``(state, calls)``: ``calls`` gets one config per kernel launch."""
    from moe_mxfp8.kernels.grouped_gemm import launcher

    from moe_mxfp8 import grouped_gemm

    calls, state, frames = [], {}, []  # frames: the launches in progress

    def fake_compile(kernel_cls, config, options=None, stream=None, arch=None):
        def fn(*args):
            calls.append(config)
            frame = frames[-1]
            frame["out"].copy_(state["kernel"](*frame["args"], frame["out"].dtype))

        return fn

    real_output, real_run = P.output, launcher.run

    def capture_output(prob, out=None):
        frames[-1]["out"] = real_output(prob, out)
        return frames[-1]["out"]

    def run_spy(kernel_cls, prob_, a_, b_, offs_, **kw):
        frames.append({"args": (a_, b_, offs_)})
        try:
            return real_run(kernel_cls, prob_, a_, b_, offs_, **kw)
        finally:
            frames.pop()

    monkeypatch.setattr(launcher, "compile_config", fake_compile)
    monkeypatch.setattr(launcher.P, "output", capture_output)
    monkeypatch.setattr(launcher, "_grid_clusters", lambda *a: 1)
    monkeypatch.setattr(launcher, "current_stream", lambda *device: None)
    monkeypatch.setattr(launcher, "run", run_spy)
    monkeypatch.setattr(grouped_gemm, "_host_class", lambda backend: kernel_cls)
    return state, calls


def _described(mode, a, b, offs):
    return (P.describe_m(a, b, offs, torch.bfloat16) if mode == "m"
            else P.describe_k(a, b, offs, torch.bfloat16))


def _right(a, b, offs, dt):
    return R.grouped_mm(a, b, offs, dt)


@pytest.mark.parametrize("mode", ["m", "k"])
def test_sm100_launches_are_guarded(K, monkeypatch, mode):
    """The API checks a kernel class that asks for it (sm100) before its first launch of each
    configuration, through the launcher itself: a wrong kernel is refused, a right one runs."""
    from moe_mxfp8 import grouped_gemm

    state, calls = _stand_in_launches(monkeypatch, K.GroupedGemmSm100)
    prob = selfcheck.pipeline_problem(mode, 64, 96, torch.bfloat16, tile_m=128, stages=2)
    a, b, offs = selfcheck.make_operands(mode, prob, "cpu", seed=7)

    def wrong(a_, b_, offs_, dt):  # right shape, wrong values
        return (R.grouped_mm(a_, b_, offs_, torch.float32) * 1.05).to(dt)

    state["kernel"] = wrong
    with pytest.raises(selfcheck.KernelSelfCheckError, match="backend='reference'"):
        grouped_gemm.run_kernel("sm100", _described(mode, a, b, offs), a, b, offs)
    assert len(calls) == 1  # ran in the check only; the real call was refused

    selfcheck.reset()
    calls.clear()
    state["kernel"] = _right
    out = grouped_gemm.run_kernel("sm100", _described(mode, a, b, offs), a, b, offs)
    torch.testing.assert_close(out, R.grouped_mm(a, b, offs, torch.bfloat16))
    assert len(calls) == 2  # one check problem, then the call itself


@pytest.mark.parametrize("mode", ["m", "k"])
def test_verified_launch_does_no_selfcheck_work(monkeypatch, mode):
    """Once its configuration passed, an sm100 launch runs nothing of the self-check: no
    stage count, check problem, operands, verdict machinery or kernel class (CuTeDSL) -- the
    first-use hook is one look-up. (It used to build the check problem before looking the
    verdict up: 0.6-1.6 ms of host time on every launch.)"""
    from moe_mxfp8.kernels.grouped_gemm.sm100_config import GroupedGemmSm100Host

    from moe_mxfp8 import grouped_gemm

    state, calls = _stand_in_launches(monkeypatch, GroupedGemmSm100Host)
    state["kernel"] = _right
    prob = selfcheck.pipeline_problem(mode, 64, 96, torch.bfloat16, tile_m=128, stages=2)
    a, b, offs = selfcheck.make_operands(mode, prob, "cpu", seed=3)
    grouped_gemm.run_kernel("sm100", _described(mode, a, b, offs), a, b, offs)  # checks
    assert len(calls) == 2
    work = []

    def counted(owner, name):
        real = getattr(owner, name)

        def spy(*args, **kw):
            work.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, spy)

    for name in ("pipeline_problem", "ensure_verified", "run_selfcheck", "make_operands",
                 "_device_name"):
        counted(selfcheck, name)
    for name in ("selfcheck_tiling", "kernel_class"):
        counted(GroupedGemmSm100Host, name)
    for _ in range(3):
        out = grouped_gemm.run_kernel("sm100", _described(mode, a, b, offs), a, b, offs)
    assert work == [] and len(calls) == 5
    torch.testing.assert_close(out, R.grouped_mm(a, b, offs, torch.bfloat16))


class _Never:
    """A completion marker that never completes (a hung kernel)."""

    def query(self):
        return False


class _Faulted:
    """A completion marker whose query reports an asynchronous device fault."""

    def query(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_refuses_a_hang(mode):
    """A kernel whose work never completes: the watchdog gives up after the timeout and the
    check refuses, naming the problem (it does not wait forever)."""
    kernel, calls = _counting(R.grouped_mm)
    t0 = time.monotonic()
    why = selfcheck.run_selfcheck(kernel, mode, "cpu", SMALL[mode], timeout_s=0.2,
                                  fence=lambda dev: _Never())
    assert time.monotonic() - t0 < 5
    assert why is not None and "did not finish within 0.2 s" in why and "N=64" in why
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["m", "k"])
def test_selfcheck_refuses_a_device_fault(mode):
    """An asynchronous fault surfacing while waiting is caught and reported as a refusal."""
    kernel, _ = _counting(R.grouped_mm)
    why = selfcheck.run_selfcheck(kernel, mode, "cpu", SMALL[mode], timeout_s=5,
                                  fence=lambda dev: _Faulted())
    assert why is not None and "device fault" in why and "illegal memory access" in why


def test_ensure_verified_names_the_configuration_of_a_fault():
    kernel, _ = _counting(R.grouped_mm)
    cfg = ("k", 64, 32, "float32", "1cta")
    with pytest.raises(selfcheck.KernelSelfCheckError) as err:
        selfcheck.ensure_verified("test.op_k", kernel, "cpu", "k", problems=SMALL["k"],
                                  config=cfg, fence=lambda dev: _Faulted())
    assert str(cfg) in str(err.value) and "device fault" in str(err.value)
    assert selfcheck.verdict("test.op_k", "cpu", cfg) not in (None, False)


def test_verdict_is_keyed_on_the_compiled_configuration():
    """Each compiled configuration is checked once; a failure of one does not condemn another,
    and a passing one does not vouch for another."""
    good, good_calls = _counting(R.grouped_mm)
    bad, bad_calls = _counting(_scaled)
    cfg_a, cfg_b = ("m", 64, 96, "bf16"), ("m", 64, 128, "bf16")
    selfcheck.ensure_verified("test.op_m", good, "cpu", "m", problems=SMALL["m"],
                              config=cfg_a)
    selfcheck.ensure_verified("test.op_m", good, "cpu", "m", problems=SMALL["m"],
                              config=cfg_a)
    assert len(good_calls) == 1
    with pytest.raises(selfcheck.KernelSelfCheckError, match="compiled for"):
        selfcheck.ensure_verified("test.op_m", bad, "cpu", "m", problems=SMALL["m"],
                                  config=cfg_b)
    assert len(bad_calls) == 1
    assert selfcheck.verdict("test.op_m", "cpu", cfg_a) is None
    assert selfcheck.verdict("test.op_m", "cpu", cfg_b) not in (None, False)


def test_selfcheck_passes_the_grid_cap():
    kernel, calls = _counting(R.grouped_mm)
    prob = dataclasses.replace(SMALL["m"][0], max_clusters=3)
    assert selfcheck.run_selfcheck(kernel, "m", "cpu", (prob,)) is None
    assert calls == [{"max_clusters": 3}]


def _traced_smem(K, cfg) -> dict:
    """Stage count, operand ring bytes and epilogue staging bytes of the layouts the kernel
    builds (traced, as at compile time)."""
    import cutlass.cute as cute

    kern, got = K.GroupedGemmSm100(cfg), {}

    @cute.jit
    def probe():
        kern._setup()
        got["stages"] = kern.num_ab_stage
        got["ring"] = (cute.cosize(kern.a_smem_layout.outer)
                       + cute.cosize(kern.b_smem_layout.outer)
                       + cute.cosize(kern.sfa_smem_layout) + cute.cosize(kern.sfb_smem_layout))
        got["epi"] = cute.cosize(kern.c_smem_layout.outer) * cfg.out_dtype.itemsize

    probe()
    return got


@pytest.mark.parametrize("mode,mma_m,dt", [
    ("m", 128, torch.bfloat16), ("m", 128, torch.float32), ("m", 256, torch.bfloat16),
    ("m", 256, torch.float32), ("k", 128, torch.bfloat16), ("k", 128, torch.float32)])
def test_stage_count_is_the_kernels_ring(K, mode, mma_m, dt):
    """The stage count the launch path computes without CuTeDSL (`ab_stages`: the first-use
    check's problem depends on it) is the ring the kernel lays out: the traced layouts hold
    that many stages of the arithmetic's bytes, the epilogue staging is the arithmetic's, and
    the ring fills the shared memory (one more stage would not fit)."""
    from moe_mxfp8.kernels.grouped_gemm import sm100_config as C

    cfg = K.GroupedGemmSm100Config(mode, 4096, 7168, dt, mma_m, 128)
    stages = cfg.ab_stages()
    assert C.GroupedGemmSm100Host.selfcheck_tiling(cfg) == (mma_m, stages)
    got = _traced_smem(K, cfg)
    assert got["stages"] == stages and got["ring"] % stages == 0
    per_stage = got["ring"] // stages
    assert got["epi"] == cfg.epilogue_smem_bytes()
    budget = C.SMEM_CAPACITY - C.SMEM_RESERVED - got["epi"]
    assert stages * per_stage <= budget < (stages + 1) * per_stage


def test_kernel_refuses_another_epilogue_size(K, monkeypatch):
    """A CuTeDSL whose epilogue tile differs from the arithmetic's assumption fails the
    compile instead of running a ring the first-use check does not wrap."""
    from moe_mxfp8.kernels.grouped_gemm import sm100_config as C

    monkeypatch.setattr(C, "EPI_TILE", (128, 64))
    cfg = K.GroupedGemmSm100Config("m", 512, 512, torch.bfloat16, 128, 128)
    with pytest.raises(ValueError, match="epilogue staging"):
        _traced_smem(K, cfg)


# Every compiled configuration kind: mode, CTA mode, output dtype; N/K small and dsv3-sized.
_CHECK_CONFIGS = [
    ("m", 128, 160, 288, torch.bfloat16), ("m", 128, 4096, 7168, torch.float32),
    ("m", 256, 96, 160, torch.float32), ("m", 256, 7168, 2048, torch.bfloat16),
    ("k", 128, 160, 96, torch.bfloat16), ("k", 128, 4096, 7168, torch.float32),
    ("m", 128, 128, 128, torch.bfloat16),
]


@pytest.mark.parametrize("mode,mma_m,n,k,dt", _CHECK_CONFIGS)
def test_selfcheck_problems_wrap_the_pipeline(K, mode, mma_m, n, k, dt):
    """The check problem of a configuration selects that configuration, has an empty group
    and partial tiles, and -- walked by the kernel's own schedule code with its grid cap --
    gives every cluster >= 3 tiles (both accumulator stages wrap) and more k-tiles than ring
    stages (every stage barrier flips phase)."""
    cfg = K.GroupedGemmSm100Config(mode, n, k, dt, mma_m, 128)
    tile_m, stages = K.GroupedGemmSm100.selfcheck_tiling(cfg)
    assert tile_m == mma_m and 3 <= stages <= 12
    prob = selfcheck.pipeline_problem(mode, n, k, dt, tile_m=tile_m, stages=stages)
    m = sum(prob.sizes)
    p = P.GroupedProblem(mode, m, n, k, len(prob.sizes), dt, "1x32", torch.device("cpu"))
    if mode == "k":  # the launcher aligns K-grouped groups first
        p = dataclasses.replace(p, m=P.k_aligned_extent(m, len(prob.sizes)))
    assert K.GroupedGemmSm100.select_config(p) == cfg
    assert K.GroupedGemmSm100(cfg).can_implement(p)[0]
    assert 0 in prob.sizes and any(s % 128 for s in prob.sizes)
    sizes = prob.sizes if mode == "m" else tuple(-(-s // 16) * 16 for s in prob.sizes)
    walked = walk(mode, sizes, n, k, mma_m, prob.max_clusters)
    per = {}
    for r in walked:
        if r["v"] == 0:
            units, kts = per.get(r["cluster"], (0, 0))
            per[r["cluster"]] = (units + 1, kts + r["k_tiles"])
    assert len(per) == prob.max_clusters, (per, prob)
    for units, kts in per.values():
        assert units >= 3 and kts > stages, (units, kts, stages, prob)
    # Cost: the kernel's FLOPs (the fp32 reference does the same again); < 50 GFLOP at dsv3.
    assert prob.flops() < 50e9, prob.flops()
