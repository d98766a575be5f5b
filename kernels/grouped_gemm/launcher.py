"""The one launcher of the grouped GEMM kernels: describe -> align -> config -> compile -> launch.

`grouped_mm` takes the kernel class (``GroupedGemmSm90``, ``GroupedGemmSm100``; the caller
imports it, this module never imports an arch file) and MXFP8 operands, and launches on the
current stream without a host sync. `compile_config` compiles one configuration with fake
pointers -- the same signature the launch uses -- so CPU CI compiles exactly what a GPU runs;
compiled kernels are cached per (kernel class, config, arch) in memory and on disk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from ..common import TORCH_TO_CUTLASS, CompileCache, current_stream, target_arch
from ..mx_format import TILE_BYTES
from . import problem as P

OFFS_ALIGN = 4  # offs may be a view at any int32 offset; kernels read it by scalar loads
_CACHE = CompileCache("grouped_gemm")


def _ptr(dtype, addr: int, align: int = 16):
    from cutlass.cute.runtime import make_ptr

    return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@functools.cache
def _kernel(kernel_cls, config):
    """The kernel object of a configuration for host-side decisions (limits, grid), made once:
    the launch path asks it on every call."""
    return kernel_cls(config)


def compile_config(kernel_cls, config, options: str | None = None, stream=None):
    """The compiled kernel of one configuration for ``target_arch()``. Token count, group
    count, scale buffer sizes and the grid are runtime Int32 arguments, so one compile serves
    every call. ``options`` (e.g. ``"--keep-cubin"``): compile here, never load from disk."""

    def build():
        kern = kernel_cls(config)  # a fresh object: tracing stores IR values on it
        fp8, u8 = cutlass.Float8E4M3FN, cutlass.Uint8
        out = TORCH_TO_CUTLASS[config.out_dtype]
        ptrs = [_ptr(t, 0) for t in (fp8, fp8, u8, u8, out)] + [_ptr(Int32, 0, OFFS_ALIGN)]
        st = stream if stream is not None else cute.runtime.make_fake_stream()
        kw = {"options": options} if options else {}
        return cute.compile(kern, *ptrs, Int32(1), Int32(1), Int32(TILE_BYTES),
                            Int32(TILE_BYTES), Int32(1), st, **kw)

    key = (kernel_cls.__name__, config, target_arch(), options)
    return _CACHE.get(key, build, persist=not options)


@functools.cache
def _max_active_clusters(index: int, cluster_size: int) -> int:
    """Clusters of ``cluster_size`` CTAs (one CTA per SM) the GPU runs at once: a persistent
    grid larger than that would leave whole clusters waiting for a second wave. The driver
    query loads a probe kernel (0.2 s of a new process's first step, docs/NOTES.md "What a
    second process's first step is made of"): once per device and cluster size, never per call,
    and not for single-CTA clusters, which are one per SM by construction."""
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    if cluster_size == 1:
        return sms
    try:
        from cutlass.utils import HardwareInfo

        return HardwareInfo(index).get_max_active_clusters(cluster_size)
    except Exception:  # driver query unavailable: one cluster per cluster_size SMs
        return sms // cluster_size


def _grid_clusters(kern, problem: P.GroupedProblem, max_clusters: int | None) -> int:
    """Persistent grid in clusters: no more than the walk has units for, nor than fit."""
    dev = problem.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    per = kern.units_per_cluster()
    units = -(-kern.sched.units_bound(problem.m, problem.num_groups) // per)
    clusters = min(units, _max_active_clusters(index, kern.cluster_size()))
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
        tuning: dict | None = None, max_clusters: int | None = None,
        first_use: Callable | None = None) -> torch.Tensor:
    """Launch ``kernel_cls`` on the described problem ``prob`` of operands ``a``, ``b``.

    * ``aligned_groups`` (K-grouped): the caller guarantees 16-token aligned group starts and
      ``M % 16 == 0``; otherwise the fp8 data is first re-laid out (`problem.align_k_groups`:
      exact, scales and result unchanged).
    * ``out``: a preallocated output the kernel overwrites entirely (tests, benchmarks).
    * ``tuning``: overrides of the configuration's tuning fields (benchmarks).
    * ``max_clusters``: cap on the persistent grid (first-use checks: many tiles per CTA).
    * ``first_use(kernel_cls, config, device)``: called before the launch when the class asks
      for a first-use check (``check_on_first_use``); the API passes `moe_mxfp8.selfcheck`'s.
    """
    result = P.output(prob, out)
    if prob.m == 0:
        return result if prob.mode == P.MODE_M else result.zero_()
    a_data, b_data = a.data, b.data
    if prob.mode == P.MODE_K and not aligned_groups:
        a_data, b_data, offs = P.align_k_groups(a_data, b_data, offs)
        prob = dataclasses.replace(prob, m=a_data.shape[1])
    config = kernel_cls.select_config(prob, tuning)
    kern = _kernel(kernel_cls, config)
    ok, why = kern.can_implement(prob)
    if not ok:
        raise ValueError(f"{kernel_cls.__name__} cannot run this problem: {why}")
    for t in (a_data, b_data, a.scale, b.scale, result):
        if t.data_ptr() % P.TMA_ALIGN_BYTES:
            raise ValueError(f"{kernel_cls.__name__} needs 16-byte aligned buffers")
    if first_use is not None and kernel_cls.check_on_first_use:
        first_use(kernel_cls, config, prob.device)
    clusters = _grid_clusters(kern, prob, max_clusters)
    stream = current_stream()
    fn = compile_config(kernel_cls, config, stream=stream)
    fp8, u8 = cutlass.Float8E4M3FN, cutlass.Uint8
    fn(_ptr(fp8, a_data.data_ptr()), _ptr(fp8, b_data.data_ptr()),
       _ptr(u8, a.scale.data_ptr()), _ptr(u8, b.scale.data_ptr()),
       _ptr(TORCH_TO_CUTLASS[prob.out_dtype], result.data_ptr()),
       _ptr(Int32, offs.data_ptr(), OFFS_ALIGN),
       Int32(prob.m), Int32(prob.num_groups),
       Int32(a.scale.numel() // TILE_BYTES * TILE_BYTES),
       Int32(b.scale.numel() // TILE_BYTES * TILE_BYTES), Int32(clusters), stream)
    return result
