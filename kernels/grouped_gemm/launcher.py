"""The one launcher of the grouped GEMM kernels: describe -> align -> config -> compile -> launch.

`grouped_mm` takes an arch's host class (``GroupedGemmSm90Host``, ``GroupedGemmSm100Host``,
or the kernel class, which subclasses it; the caller imports it, this module never imports an
arch file) and MXFP8 operands, and launches on the operands' GPU (`device.on_device`) and its
current stream, without a host sync.
`compile_config` compiles one configuration with fake pointers -- the same signature the
launch uses -- so CPU CI compiles exactly what a GPU runs; compiled kernels are cached per
(kernel, config, arch) in memory and on disk. This module imports no CuTeDSL: a kernel loaded
from the disk cache is launched without it (`native`); CuTeDSL is imported where a kernel is
compiled, or where a cluster of several CTAs is sized for the first time on this machine.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from .. import compile_cache
from ..compile_cache import CompileCache, launch_arch, target_arch
from ..device import on_device
from ..mx_format import TILE_BYTES
from ..native import Ptr, cu_stream, current_stream
from . import problem as P

OFFS_ALIGN = 4  # offs may be a view at any int32 offset; kernels read it by scalar loads
_CACHE = CompileCache("grouped_gemm", cute=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _host(host_cls, config):
    """The host object of a configuration for host-side decisions (limits, grid), made once:
    the launch path asks it on every call. Always of the arch's host class (a kernel class
    passed in would build its CuTeDSL state for nothing)."""
    return host_cls.host_class()(config)


_PLANS: dict = {}
MAX_PLANS = 4096  # distinct (kernel, problem) pairs kept; a training loop has a handful


def _plan(kernel_cls, prob: P.GroupedProblem, tuning: dict | None):
    """``(config, host, can_implement's answer)`` for ``prob``: the per-call host decisions,
    made once per kernel class and problem (a frozen dataclass of static sizes, token count,
    groups and device; a step launches the same few problems every time) unless ``tuning``
    overrides them."""
    key = (kernel_cls, prob)
    plan = None if tuning else _PLANS.get(key)
    if plan is None:
        config = kernel_cls.select_config(prob, tuning)
        host = _host(kernel_cls, config)
        plan = (config, host, host.can_implement(prob))
        if not tuning:
            if len(_PLANS) >= MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def compile_config(kernel_cls, config, options: str | None = None, stream=None,
                   arch: str | None = None):
    """The compiled kernel of one configuration for ``arch`` (the arch CuTeDSL compiles for,
    default `compile_cache.target_arch`; a launch passes `compile_cache.launch_arch`). Token
    count, group count, scale buffer sizes and the grid are runtime Int32 arguments, so one
    compile serves every call. ``options`` (e.g. ``"--keep-cubin"``): compile here, never load
    from disk."""

    def build():
        import cutlass
        import cutlass.cute as cute
        from cutlass import Int32
        from cutlass.cute.runtime import make_ptr

        from ..common import TORCH_TO_CUTLASS

        def ptr(dtype, align=16):
            return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)

        kern = kernel_cls.kernel_class()(config)  # a fresh object: tracing stores IR values
        fp8, u8 = cutlass.Float8E4M3FN, cutlass.Uint8
        out = TORCH_TO_CUTLASS[config.out_dtype]
        ptrs = [ptr(t) for t in (fp8, fp8, u8, u8, out)] + [ptr(Int32, OFFS_ALIGN)]
        st = cu_stream(stream) if stream is not None else cute.runtime.make_fake_stream()
        kw = {"options": options} if options else {}
        return cute.compile(kern, *ptrs, Int32(1), Int32(1), Int32(TILE_BYTES),
                            Int32(TILE_BYTES), Int32(1), st, **kw)

    key = (kernel_cls.kernel_name, config, arch or target_arch(), options)
    return _CACHE.get(key, build, persist=not options)


@functools.cache
def _max_active_clusters(index: int, cluster_size: int) -> int:
    """Clusters of ``cluster_size`` CTAs (one CTA per SM) the GPU runs at once: a persistent
    grid larger than that would leave whole clusters waiting for a second wave. The driver
    query loads a probe kernel through CuTeDSL (docs/design/compile_cache.md): once per GPU
    and cluster size, kept on disk (`compile_cache.device_fact`), and never for single-CTA
    clusters, which are one per SM by construction."""
    props = torch.cuda.get_device_properties(index)
    sms = props.multi_processor_count
    if cluster_size == 1:
        return sms

    def query() -> int:
        try:
            from cutlass.utils import HardwareInfo

            return HardwareInfo(index).get_max_active_clusters(cluster_size)
        except Exception:  # driver query unavailable: one cluster per cluster_size SMs
            return sms // cluster_size

    # the answer depends on the GPU model and driver only: kept on disk with the kernels, so
    # a later process neither imports CuTeDSL nor loads the probe kernel for it
    # (per physical GPU: how its SMs split into GPCs decides the answer)
    gpu = getattr(props, "uuid", None) or f"{props.name} {index}"
    return compile_cache.device_fact(f"max_active_clusters {gpu} cluster={cluster_size}", query)


def _grid_clusters(host, problem: P.GroupedProblem, max_clusters: int | None,
                   leave_sms: int = 0) -> int:
    """Persistent grid in clusters: no more than the walk has units for, nor than fit, and
    ``leave_sms`` SMs left free (for a collective running beside the GEMM: with one CTA per SM
    and the register file full, a kernel launched later gets no SM until the GEMM ends)."""
    dev = problem.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    per = host.units_per_cluster()
    units = -(-host.units_bound(problem.m, problem.num_groups) // per)
    size = host.cluster_size()
    fit = _max_active_clusters(index, size)
    if leave_sms:
        fit -= -(-leave_sms // size)
    clusters = min(units, fit)
    if max_clusters is not None:
        clusters = min(clusters, max_clusters)
    return max(1, clusters)


def grouped_mm(kernel_cls, mode: str, a, b, offs: torch.Tensor, out_dtype: torch.dtype, *,
               scale_blocks: str = "1x32", **launch) -> torch.Tensor:
    """Describe (the operand checks) and `run` one grouped GEMM with ``kernel_cls``; ``mode``
    "m" (M-grouped) or "k" (K-grouped, ``scale_blocks`` its operands' choice; M-grouped the
    choice comes from ``b``)."""
    if mode == P.MODE_M:
        prob = P.describe_m(a, b, offs, out_dtype)
    else:
        prob = P.describe_k(a, b, offs, out_dtype, scale_blocks)
    return run(kernel_cls, prob, a, b, offs, **launch)


def run(kernel_cls, prob: P.GroupedProblem, a, b, offs: torch.Tensor, *,
        aligned_groups: bool = False, out: torch.Tensor | None = None,
        tuning: dict | None = None, max_clusters: int | None = None, leave_sms: int = 0,
        first_use: Callable | None = None) -> torch.Tensor:
    """Launch ``kernel_cls`` on the described problem ``prob`` of operands ``a``, ``b``.

    * ``aligned_groups`` (K-grouped): the caller guarantees 16-token aligned group starts and
      ``M % 16 == 0``; otherwise the fp8 data is first re-laid out (`problem.align_k_groups`:
      exact, scales and result unchanged).
    * ``out``: a preallocated output the kernel overwrites entirely (tests, benchmarks).
    * ``tuning``: overrides of the configuration's tuning fields (benchmarks).
    * ``max_clusters``: cap on the persistent grid (first-use checks: many tiles per CTA).
    * ``leave_sms``: SMs the persistent grid leaves free (a collective overlapping the GEMM).
      Each output tile is still computed whole by one CTA: the result does not change.
    * ``first_use(kernel_cls, config, device)``: called before the launch when the class asks
      for a first-use check (``check_on_first_use``); the API passes `moe_mxfp8.selfcheck`'s.
    """
    result = P.output(prob, out)
    if prob.m == 0:
        return result if prob.mode == P.MODE_M else result.zero_()
    with on_device(prob.device):  # the operands' GPU, whichever device is current
        _launch(kernel_cls, prob, a, b, offs, result, aligned_groups, tuning, max_clusters,
                leave_sms, first_use)
    return result


def _launch(kernel_cls, prob, a, b, offs, result, aligned_groups, tuning, max_clusters,
            leave_sms, first_use) -> None:
    """`run` on the operands' device: align, configure, check, compile or load, launch."""
    a_data, b_data = a.data, b.data
    offs = P.kernel_offs(offs)  # kept alive to the launch, which reads E consecutive int32
    if prob.mode == P.MODE_K and not aligned_groups:
        a_data, b_data, offs = P.align_k_groups(a_data, b_data, offs)
        prob = dataclasses.replace(prob, m=a_data.shape[1])
    config, host, (ok, why) = _plan(kernel_cls, prob, tuning)
    name = kernel_cls.kernel_name
    if not ok:
        raise ValueError(f"{name} cannot run this problem: {why}")
    for t in (a_data, b_data, a.scale, b.scale, result):
        if t.data_ptr() % P.TMA_ALIGN_BYTES:
            raise ValueError(f"{name} needs 16-byte aligned buffers")
    if first_use is not None and kernel_cls.check_on_first_use:
        # the class as given (host or kernel): the check needs no CuTeDSL to look up its verdict
        first_use(kernel_cls, config, prob.device)
    clusters = _grid_clusters(host, prob, max_clusters, leave_sms)
    stream = current_stream(prob.device)
    fn = compile_config(kernel_cls, config, stream=stream, arch=launch_arch(prob.device))
    fp8, u8 = "float8_e4m3fn", "uint8"
    fn(Ptr(fp8, a_data.data_ptr()), Ptr(fp8, b_data.data_ptr()),
       Ptr(u8, a.scale.data_ptr()), Ptr(u8, b.scale.data_ptr()),
       Ptr(_dtype_name(prob.out_dtype), result.data_ptr()),
       Ptr("int32", offs.data_ptr(), OFFS_ALIGN),
       prob.m, prob.num_groups,
       a.scale.numel() // TILE_BYTES * TILE_BYTES,
       b.scale.numel() // TILE_BYTES * TILE_BYTES, clusters, stream)
