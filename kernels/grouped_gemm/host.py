"""The host side of a grouped GEMM kernel, without CuTeDSL: the configuration choice, the shape
checks, the cluster shape and the persistent grid's bound -- everything the launcher decides
before it calls a compiled kernel. A process that loads its kernels from the compile cache
(`compile_cache`, `native`) launches them through this class alone and never imports CuTeDSL.

Per arch, ``<arch>_config.py`` subclasses `GroupedGemmHost` with its config dataclass and
heuristics; the kernel class (``<arch>.py``, CuTeDSL) subclasses that and `base.GroupedGemmBase`
and adds the device code. `kernel_class` imports the kernel class only where a kernel is
compiled.
"""

from __future__ import annotations

import importlib

from .. import mx_format as F
from .problem import MODE_K, MODE_M, GroupedProblem, can_implement, output_columns

TILE_K = 128  # reduced elements per k-tile: 4 scale blocks = one packed 512-byte scale tile


class GroupedGemmHost:
    """Host-side decisions shared by the arch kernels; subclasses set the class attributes."""

    # the first call of each compiled configuration on a device is checked against the
    # reference before use (kernels no GPU of this project has run: moe_mxfp8.selfcheck)
    check_on_first_use = False
    tile_m = 128  # output tile rows (the schedule's unit)
    tile_n = 128
    band_m = 1  # raster band (`schedule.GroupedTileSchedule.tile_coords`)
    # the kernel class: ``kernel_module`` (in this package) and its ``kernel_name``, which also
    # names its compiled configurations in the compile cache
    kernel_module = ""
    kernel_name = ""

    def __init__(self, config):
        self.cfg = config
        self.mode = config.mode
        self.is_m = config.mode == MODE_M

    @classmethod
    def host_class(cls):
        """The arch's host class: the class that names the kernel (this one, or the one a
        kernel class derives from)."""
        return next(c for c in cls.__mro__ if "kernel_name" in vars(c))

    @classmethod
    def kernel_class(cls):
        """The CuTeDSL kernel class of this arch (imports CuTeDSL)."""
        mod = importlib.import_module(f"{__package__}.{cls.kernel_module}")
        return getattr(mod, cls.kernel_name)

    @classmethod
    def select_config(cls, problem: GroupedProblem, tuning: dict | None = None):
        """The configuration for ``problem`` (per-arch heuristics)."""
        raise NotImplementedError

    def limits(self) -> dict:
        """Divisibility needs (`problem.check_implementable`): 16-byte TMA row strides of the
        fp8 operands (K or tokens) and of the output rows (N or K), 32-element blocks."""
        return dict(n_multiple=32, k_multiple=32, m_multiple=16 if self.mode == MODE_K else 1)

    def can_implement(self, problem: GroupedProblem) -> tuple[bool, str]:
        """(True, "") or (False, why this kernel cannot run ``problem``)."""
        key = (problem.mode, problem.n, problem.k, problem.out_dtype)
        mine = (self.cfg.mode, self.cfg.n, self.cfg.k, self.cfg.out_dtype)
        if key != mine:
            return False, f"kernel compiled for {mine}, problem is {key}"
        return can_implement(problem, **self.limits())

    def cluster_size(self) -> int:
        """CTAs per cluster (the launch's cluster shape along x)."""
        return 1

    def units_per_cluster(self) -> int:
        """Work units a cluster takes per step of the persistent walk."""
        return 1

    def tiles_x(self) -> int:
        """Output tiles along a group's fast axis (M-grouped N, K-grouped K)."""
        return -(-output_columns(self.mode, self.cfg.n, self.cfg.k) // self.tile_n)

    def units_bound(self, m: int, num_groups: int) -> int:
        """Static bound of the schedule's unit count (the persistent grid never needs more)."""
        if self.is_m:
            return self.tiles_x() * F.tiles_bound(m, num_groups, self.tile_m)
        return self.tiles_x() * -(-self.cfg.n // self.tile_m) * num_groups


__all__ = ["GroupedGemmHost", "MODE_K", "MODE_M", "TILE_K"]
