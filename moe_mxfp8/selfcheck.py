"""First-use self-check of a GEMM kernel against the pure-PyTorch reference.

Kernels that CI cannot run (the Blackwell grouped GEMMs are verified on the CPU by compiling
them, reading their PTX/SASS and emulating their index code; no Blackwell GPU ran them) check
themselves the first time a compiled configuration runs on a device: grouped problems with
uneven groups, an empty group and partial tiles go through the kernel and through
`moe_mxfp8.reference.grouped_mm`. If they disagree the kernel refuses to run
(`KernelSelfCheckError`, telling the user to select ``backend="reference"``) instead of
returning wrong numbers.

* The verdict is keyed on the compiled configuration (``config``: for the sm100 GEMM its
  `GroupedGemmSm100Config` -- mode, N, K, output dtype, CTA mode, hence its pipeline depth) and
  the device, and cached, good or bad. A kernel compiled for another N/K/dtype is checked anew.
* `verify_on_first_use` (the hook the grouped GEMM launcher calls for kernel classes with
  ``check_on_first_use``) builds problems for that configuration (the static N and K of the
  user's call, chosen token counts) and a grid cap (`CheckProblem.max_clusters`) so that every
  CTA runs several tiles: the shared-memory stage ring and both accumulator stages wrap (their
  barrier phases flip) and the group walk advances -- the paths one tile per CTA never runs.
* A hang cannot block the caller forever: completion is watched through a CUDA event polled up
  to ``timeout_s``; past it the check refuses ("did not finish"). An asynchronous device fault
  (illegal address, trap) surfaces while waiting or reading back; it is caught and reported as a
  refusal naming the configuration (the CUDA context is unusable afterwards: restart).

Cost per configuration: one problem of a few hundred tokens at the user's N and K, run by the
kernel and by the fp32 reference, plus drawing and quantizing its random weights with the
reference quantizers, the kernel's compile (which the first call pays anyway) and one host
sync; once per process, configuration and device (docs/design/blackwell_gemm.md).

Generic: `ensure_verified` takes the kernel callable ``fn(a, b, offs, out_dtype, **launch)``
(``launch``: ``max_clusters=`` when a problem caps the grid), so the machinery is tested on the
CPU with a correct stand-in (the reference) and wrong ones (wrong values, a hang, a fault).

The check synchronises with the host; it refuses to run inside CUDA-graph capture. Call the
op once eagerly (or `ensure_verified`) before capturing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference as R
from .kernels.device import on_device
from .kernels.grouped_gemm.problem import MODE_M, MODES

# Normalised error bounds, against the fp32 reference on identical MXFP8 operands. The kernel
# differs only in fp32 summation order (relative ~1e-6 at these K) and the output rounding
# (bf16: 2^-9 relative). A wrong tile, scale or group boundary gives O(1) errors.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}

# Watchdog: a check problem takes milliseconds; a kernel that has not finished after this many
# seconds is taken to hang. Override with MOE_MXFP8_SELFCHECK_TIMEOUT (seconds).
TIMEOUT_S = 60.0
TIMEOUT_ENV = "MOE_MXFP8_SELFCHECK_TIMEOUT"


class KernelSelfCheckError(RuntimeError):
    """A kernel gave wrong results, hung or faulted on this device; it will not be used."""


@dataclass(frozen=True)
class CheckProblem:
    """One grouped problem: ``sizes`` are the group sizes (tokens), ``n``/``k`` as in
    `kernels.grouped_gemm.problem.GroupedProblem`; ``max_clusters`` caps the kernel's
    persistent grid (None: the kernel's own grid)."""

    sizes: tuple[int, ...]
    n: int
    k: int
    out_dtype: torch.dtype = torch.bfloat16
    max_clusters: int | None = None

    def flops(self) -> int:
        """``2 M N K`` (the kernel's work; the fp32 reference does the same again)."""
        return 2 * sum(self.sizes) * self.n * self.k


# Each covers an empty group, groups that end inside a 128-row (M) or 32-token block (K), N not
# a multiple of 128 and (M mode) K not a multiple of 128. The second M problem has groups of
# >= 256 rows on average, which the sm100 kernel runs with cta_group::2 tiles.
DEFAULT_PROBLEMS = {
    "m": (
        CheckProblem((130, 0, 37, 133), n=160, k=288, out_dtype=torch.bfloat16),
        CheckProblem((300, 0, 531), n=96, k=160, out_dtype=torch.float32),
    ),
    "k": (
        CheckProblem((100, 0, 33, 171), n=160, k=96, out_dtype=torch.bfloat16),
        CheckProblem((16, 129, 0, 207), n=128, k=160, out_dtype=torch.float32),
    ),
}


def pipeline_problem(mode: str, n: int, k: int, out_dtype: torch.dtype, *, tile_m: int,
                     stages: int, acc_stages: int = 2) -> CheckProblem:
    """A check problem for one compiled configuration of a persistent grouped GEMM that walks
    ``tile_m x 128`` output tiles (K-grouped: ``128 x 128`` tiles of ``(E, N, K)``) with 128-wide
    k-tiles and a ring of ``stages`` k-tiles: group sizes with an empty group and partial tiles
    (``tile_m`` 256: groups of >= 256 rows on average, the cta_group::2 choice), and a grid
    cap such that every cluster runs at least ``acc_stages + 1`` tiles and ``stages + 1``
    k-tiles (units are dealt round-robin, ``unit % clusters``). Small N/K repeat the groups."""
    base: tuple[int, ...]
    if mode == MODE_M:
        base = (300, 0, 531) if tile_m == 256 else (130, 0, 37, 133)
    else:
        base = (100, 0, 33, 171, 400)  # tails 4, 1, 11, 16 tokens (16 after 16-alignment)
    for repeat in (1, 2, 4, 8, 16, 32):  # more groups, same mean size: same CTA mode
        sizes = base * repeat
        units = _unit_k_tiles(mode, sizes, n, k, tile_m)
        clusters = max(1, len(units) // (acc_stages + 1))
        while True:  # the largest grid (cheapest check) that wraps, in steps of 20 %
            per = [units[c::clusters] for c in range(clusters)]
            if all(len(u) > acc_stages and sum(u) > stages for u in per):
                return CheckProblem(sizes, n, k, out_dtype, max_clusters=clusters)
            if clusters == 1:
                break
            clusters = max(1, clusters * 4 // 5)
    raise ValueError(f"no check problem wraps a {stages}-stage ring for N={n}, K={k}")


def _unit_k_tiles(mode, sizes, n, k, tile_m) -> list[int]:
    """k-tiles of every work unit, in the walk's order (group by group)."""
    def cdiv(x, y):
        return -(-x // y)

    if mode == "m":
        return [cdiv(k, 128) for m_g in sizes for _ in range(cdiv(m_g, tile_m) * cdiv(n, 128))]
    # K-grouped: the host pads every group to 16 tokens before the kernel.
    return [cdiv(cdiv(m_g, 16) * 16, 128) for m_g in sizes
            for _ in range(cdiv(n, 128) * cdiv(k, 128))]


_verdicts: dict[tuple, str | None] = {}
_lock = threading.Lock()


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def make_operands(mode: str, prob: CheckProblem, device, seed: int = 0):
    """``(a, b, offs)`` MXFP8 operands of a problem, quantized by the reference quantizers
    (random data drawn on ``device``: the weights of a check problem can be large)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    sizes = torch.tensor(prob.sizes, dtype=torch.int64)
    offs = torch.cumsum(sizes, 0).to(torch.int32).to(dev)
    m, e = int(sizes.sum()), len(prob.sizes)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)

    if mode == "m":
        a = R.quantize_rowwise_ref(rnd(m, prob.k), offs=offs)
        b = R.quantize_weights_ref(rnd(e, prob.n, prob.k), axis="K")
    elif mode == "k":
        a = R.quantize_colwise_ref(rnd(m, prob.n), offs=offs)  # (N, M)
        b = R.quantize_colwise_ref(rnd(m, prob.k), offs=offs)  # (K, M)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return a, b, offs


def _compare(mode: str, prob: CheckProblem, out, ref, offs) -> str | None:
    """None if ``out`` matches ``ref``, else a one-line description of the mismatch."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if out.shape != ref.shape or out.dtype != prob.out_dtype:
        return (f"returned {out.dtype} {tuple(out.shape)}, expected {prob.out_dtype} "
                f"{tuple(ref.shape)}")
    o, r = out.float().cpu(), ref.float().cpu()
    if not torch.isfinite(o).all():
        return "returned NaN/Inf for finite operands"
    if mode == "k":
        for g, size in enumerate(prob.sizes):
            if size == 0 and bool((o[g] != 0).any()):
                return f"empty group {g} is not all zeros"
    scale = r.abs().max().clamp_min(1e-30)
    max_err = float((o - r).abs().max() / scale)
    fro_err = float((o - r).norm() / r.norm().clamp_min(1e-30))
    tol = TOLERANCE[prob.out_dtype]
    if max_err > tol or fro_err > tol:
        return (f"max error {max_err:.3g} / relative Frobenius error {fro_err:.3g} of the "
                f"reference (tolerance {tol:g})")
    return None


class _Done:
    """Completion marker of work that ran synchronously (CPU)."""

    def query(self) -> bool:
        return True


def device_fence(device):
    """A completion marker of the work queued so far on ``device``: a CUDA event recorded on
    that device's current stream (not the current device's: the kernel ran on ``device``;
    ``query()`` is True once it finished, and raises on an asynchronous device fault), or an
    always-complete marker off CUDA."""
    if torch.device(device).type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    return _Done()


def _timeout_s() -> float:
    import os

    env = os.environ.get(TIMEOUT_ENV)
    return float(env) if env else TIMEOUT_S


def _wait(fence, timeout_s: float) -> bool:
    """Poll ``fence`` until it completes (True) or ``timeout_s`` passes (False). Never blocks
    in the driver: a hung kernel leaves the caller free to refuse."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not fence.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def _describe(prob: CheckProblem) -> str:
    cap = f", grid capped at {prob.max_clusters} clusters" if prob.max_clusters else ""
    return (f"group sizes {prob.sizes}, N={prob.n}, K={prob.k}, "
            f"{str(prob.out_dtype).replace('torch.', '')}{cap}")


def run_selfcheck(kernel: Callable, mode: str, device, problems=None, *,
                  timeout_s: float | None = None, fence: Callable | None = None) -> str | None:
    """Run ``kernel`` on the check problems of ``mode``; None if all match the reference, else
    a one-line reason (wrong values, an exception at launch, no completion within
    ``timeout_s`` -- a hang -- or an asynchronous device fault while waiting or reading back).

    ``fence(device)`` returns the completion marker (default `device_fence`: a CUDA event);
    tests pass stand-ins. The output memory is poisoned first (a NaN block of the output's size
    is freed just before the call, so the caching allocator hands it to the kernel): elements
    the kernel forgets to write show up as NaN rather than as stale zeros.
    """
    problems = DEFAULT_PROBLEMS[mode] if problems is None else problems
    timeout_s = _timeout_s() if timeout_s is None else timeout_s
    fence = device_fence if fence is None else fence
    for i, prob in enumerate(problems):
        what = f"problem {i} ({_describe(prob)})"
        a, b, offs = make_operands(mode, prob, device, seed=i)
        ref = R.grouped_mm(a, b, offs, torch.float32)
        poison = torch.full(ref.shape, float("nan"), dtype=prob.out_dtype, device=device)
        del poison
        launch = {} if prob.max_clusters is None else {"max_clusters": prob.max_clusters}
        try:
            out = kernel(a, b, offs, prob.out_dtype, **launch)
        except Exception as err:  # a kernel that cannot run its own check is not usable
            return f"{what}: raised {type(err).__name__}: {err}"
        try:
            if not _wait(fence(device), timeout_s):
                return (f"{what}: did not finish within {timeout_s:g} s (a hang; the GPU may "
                        "stay busy until the process exits)")
            why = _compare(mode, prob, out, ref, offs)
        except Exception as err:  # asynchronous fault: illegal address, trap, ...
            return (f"{what}: device fault {type(err).__name__}: {err} (the CUDA context is "
                    "unusable after a fault: restart the process)")
        if why is not None:
            return f"{what}: {why}"
    return None


def ensure_verified(name: str, kernel: Callable, device, mode: str, problems=None, *,
                    config=None, timeout_s: float | None = None,
                    fence: Callable | None = None) -> None:
    """Check ``kernel`` once per (``name``, ``config``, device); raise `KernelSelfCheckError`
    naming the configuration if it is wrong, hangs or faults.

    ``mode``: "m" (2D x 3D M-grouped) or "k" (2D x 2D K-grouped); ``config``: a hashable
    description of the compiled configuration (None: one verdict per ``name``); ``problems``:
    the check problems for it (default `DEFAULT_PROBLEMS`). A failed verdict is cached too:
    later calls raise at once without running the kernel again.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    key = (name, config, _device_key(device))
    if key not in _verdicts:
        dev = torch.device(key[2])
        with on_device(dev):  # the device checked, whichever is current
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"moe_mxfp8: {name} checks itself on first use, which cannot happen during "
                    "CUDA-graph capture; run the op once eagerly before capturing"
                )
            with _lock:
                if key not in _verdicts:
                    _verdicts[key] = run_selfcheck(kernel, mode, dev, problems,
                                                   timeout_s=timeout_s, fence=fence)
    why = _verdicts[key]
    if why is not None:
        cfg = "" if config is None else f" compiled for {config}"
        raise KernelSelfCheckError(
            f"moe_mxfp8: the {name} kernel{cfg} failed its first-use self-check on "
            f"{_device_name(device)} ({key[2]}): {why}. It will not be used on this device. "
            "Select backend='reference' (or set MOE_MXFP8_BACKEND=reference) to run the "
            "pure-PyTorch implementation, and please report this."
        )


def verify_on_first_use(kernel_cls, config, device) -> None:
    """The grouped GEMM launcher's first-use hook: check ``kernel_cls`` (its host or kernel
    class) compiled for ``config`` (its ``mode``, static N/K and output dtype) on one
    `pipeline_problem` that wraps its stage ring, through the launcher itself (no hook, grid
    capped). Runs before every launch: a verified configuration returns after one dict look-up
    (no check problem is built, no CuTeDSL imported)."""
    name = f"{kernel_cls.kernel_name}.{config.mode}"
    if _verdicts.get((name, config, _device_key(device)), False) is None:
        return
    from .kernels.grouped_gemm import launcher

    tile_m, stages = kernel_cls.selfcheck_tiling(config)
    prob = pipeline_problem(config.mode, config.n, config.k, config.out_dtype, tile_m=tile_m,
                            stages=stages)

    def run(a, b, offs, out_dtype, max_clusters=None):
        return launcher.grouped_mm(kernel_cls, config.mode, a, b, offs, out_dtype,
                                   max_clusters=max_clusters)

    ensure_verified(name, run, device, config.mode, problems=(prob,), config=config)


def verdict(name: str, device, config=None) -> str | None | bool:
    """The cached verdict: None (passed), a mismatch description, or False (not checked)."""
    return _verdicts.get((name, config, _device_key(device)), False)


def reset(name: str | None = None) -> None:
    """Forget cached verdicts (all, or those of one kernel name). For tests."""
    with _lock:
        for key in [k for k in _verdicts if name is None or k[0] == name]:
            del _verdicts[key]
