"""The grouped GEMMs' device tile walk (`schedule.GroupedTileSchedule`) run on the host.

A CuTeDSL host function executes the schedule's own ``@cute.jit`` code -- the cursor over
``offs``, tile coordinates, operand origins, k-tile counts and scale tiles -- for every cluster
of a persistent grid, one record per (work unit, 128-row slice of its A tile).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack
from moe_mxfp8.kernels.grouped_gemm.schedule import GroupedTileSchedule

WALK_COLS = ("cluster", "g", "mt", "nt", "v", "a_row", "b_row", "b_l", "k0", "k_tiles", "sfa",
             "sfb", "sfb_step")


def walk(mode, sizes, n, k, tile_m, clusters, tile_n=128, band_m=1, x_granule=1):
    """Records of the walk over groups ``sizes`` (dicts keyed by `WALK_COLS`), each cluster
    visiting units ``c, c + clusters, ...`` as the kernels do."""
    sched = GroupedTileSchedule(mode, n, k, tile_m, tile_n, band_m, x_granule)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rec = torch.full((16384, len(WALK_COLS)), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    slices = tile_m // 128

    @cute.jit
    def run(offs_t, rec_t, cnt, n_clusters):
        sched.bind(Int32(offs_t[cute.size(offs_t) - 1]))
        r = Int32(0)
        for c in cutlass.range(n_clusters, unroll=1):
            unit = c
            cur = sched.seek(offs_t, unit, sched.start(offs_t))
            while cur[0] < cute.size(offs_t):
                mt, nt = sched.tile_coords(unit, cur)
                a_row, b_row, b_l, k0 = sched.origins(mt, nt, cur)
                for v in cutlass.range_constexpr(slices):
                    sfa, sfb, step = sched.scale_tiles(mt, nt, Int32(v), cur)
                    vals = (c, cur[0], mt, nt, Int32(v), a_row, b_row, b_l, k0,
                            sched.k_tiles(cur), sfa, sfb, step)
                    for j in cutlass.range_constexpr(len(vals)):
                        rec_t[r, j] = Int32(vals[j])
                    r = r + 1
                unit = unit + n_clusters
                cur = sched.seek(offs_t, unit, cur)
        cnt[0] = r

    run(from_dlpack(offs), from_dlpack(rec), from_dlpack(count), Int32(clusters))
    assert int(count) < rec.shape[0]
    return [dict(zip(WALK_COLS, row, strict=True)) for row in rec[: int(count)].tolist()]
