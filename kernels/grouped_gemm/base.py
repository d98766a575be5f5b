"""What both arch kernels of the grouped GEMM share on the host side of their ``@cute.jit``:
the launch signature, the GEMM views of the torch buffers and the schedule (the shape checks
and other host decisions are `host.GroupedGemmHost`'s, which needs no CuTeDSL).

A kernel class (``GroupedGemmSm90``, ``GroupedGemmSm100``) subclasses its arch's host class
(config dataclass, heuristics: ``<arch>_config.py``) and `GroupedGemmBase`, and adds the
device code. The launcher
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

from .host import GroupedGemmHost
from .problem import MODE_K, MODE_M
from .schedule import GroupedTileSchedule


class GroupedGemmBase(GroupedGemmHost):
    """What the arch kernel classes add to their host side: the tile schedule and the views."""

    def __init__(self, config):
        super().__init__(config)
        self.sched = GroupedTileSchedule(config.mode, config.n, config.k, self.tile_m,
                                         self.tile_n, self.band_m, self.units_per_cluster())

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
