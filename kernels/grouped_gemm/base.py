"""What both arch kernels of the grouped GEMM share on the host side of their ``@cute.jit``:
the launch signature, the GEMM views of the torch buffers, the shape checks and the schedule.

A kernel class (``GroupedGemmSm90``, ``GroupedGemmSm100``) subclasses `GroupedGemmBase` and
adds its config dataclass, its heuristics (`select_config`) and the device code. The launcher
(`launcher.py`) drives any of them the same way: describe -> align -> `select_config` ->
`can_implement` -> compile (cached) -> launch with

    ``(a_ptr, b_ptr, sfa_ptr, sfb_ptr, out_ptr, offs_ptr, m, num_groups, sfa_bytes, sfb_bytes,
    num_clusters, stream)``

raw device pointers of the contiguous torch buffers and Int32 sizes: one compiled signature
for CPU CI (fake pointers) and the GPU, token and group counts symbolic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .problem import MODE_K, MODE_M, GroupedProblem, can_implement
from .schedule import GroupedTileSchedule


class GroupedGemmBase:
    """Host-side part common to the arch kernels; subclasses set the class attributes."""

    # the first call of each compiled configuration on a device is checked against the
    # reference before use (kernels no GPU of this project has run: moe_mxfp8.selfcheck)
    check_on_first_use = False
    tile_m = 128  # output tile rows (the schedule's unit)
    tile_n = 128
    band_m = 1  # raster band (`schedule.GroupedTileSchedule.tile_coords`)

    def __init__(self, config):
        self.cfg = config
        self.mode = config.mode
        self.is_m = config.mode == MODE_M
        self.sched = GroupedTileSchedule(config.mode, config.n, config.k, self.tile_m,
                                         self.tile_n, self.band_m, self.units_per_cluster())

    # ------------------------------------------------------------------ host-side decisions
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

    # ------------------------------------------------------------------ traced host code
    @cute.jit
    def views(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32,
              e: Int32):
        """GEMM views (rows, reduced, batch) of the contiguous torch buffers, all "TN".

        M-grouped: a (M, K) -> (M, K, 1); b (E, N, K) -> (N, K, E); out (M, N) -> (M, N, 1).
        K-grouped: a (N, M) -> (N, M, 1); b (K, M) -> (K, M, 1); out (E, N, K) -> (N, K, E).
        """
        n, k = self.cfg.n, self.cfg.k
        if cutlass.const_expr(self.is_m):
            mA = cute.make_tensor(a_ptr, cute.make_layout((m, k, 1), stride=(k, 1, 0)))
            mB = cute.make_tensor(b_ptr, cute.make_layout((n, k, e), stride=(k, 1, n * k)))
            mC = cute.make_tensor(out_ptr, cute.make_layout((m, n, 1), stride=(n, 1, 0)))
        else:
            # token rows: TMA needs 16-byte strides, which `limits` guarantees
            ms = cute.assume(m, divby=16)
            mA = cute.make_tensor(a_ptr, cute.make_layout((n, m, 1), stride=(ms, 1, 0)))
            mB = cute.make_tensor(b_ptr, cute.make_layout((k, m, 1), stride=(ms, 1, 0)))
            mC = cute.make_tensor(out_ptr, cute.make_layout((n, k, e), stride=(k, 1, n * k)))
        return mA, mB, mC


__all__ = ["GroupedGemmBase", "MODE_K", "MODE_M"]
