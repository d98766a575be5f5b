"""The Hopper grouped GEMM's configuration and heuristics, without CuTeDSL: the config
dataclass (`GroupedGemmSm90Config`), its tuning fields and `GroupedGemmSm90Host` (config choice,
shape checks, cluster shape). The kernel class (`sm90.GroupedGemmSm90`) subclasses the host
class; a process that loads its kernels from the compile cache needs only this file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..mx_format import COLWISE_BLOCK_ROWS, SCALE_BLOCKS
from .host import GroupedGemmHost
from .problem import MODE_M, MODES, GroupedProblem, output_columns

DIAG_MODES = ("", "no_promote", "no_scale_wait", "promote_only", "no_store")
# diagnostics that apply to every recipe (the others measure the exact-MXFP8 promotion)
DIAG_ANY_RECIPE = ("no_store",)
# "no_store" keeps the epilogue's stores behind a test no output pair passes (so the
# accumulators stay live and nothing is folded away): the bits of this int32 value
NO_STORE_SENTINEL = -0x0BADF00D
TILE_M = 128  # two consumer warpgroups of 64 rows; one packed scale tile's 128 rows
TILE_N = 128  # the wgmma's N: one packed scale tile of B per k-tile
TILE_NS = (TILE_N, 2 * TILE_N)  # output tile widths: one or two wgmma column halves
RASTER_BAND = 16  # rows of tiles per raster band of the 1x128 kernels (docs/design/hopper_gemm.md)
# 1x128: 256-column tiles pay only over a long enough reduction per tile. With the TMA-store
# epilogue, at Qwen3-30B-A3B shapes on an H100 (2026-11-27), they were 17 % faster than
# 128-column tiles at wgrad (1024 tokens per expert) and level at dgrad (reduced axis 1536);
# with direct stores (2026-11-26) 128-column tiles had been 7-8 % faster at such lengths. The
# reduced length per tile from which `select_config` takes 256 columns (shorter: unmeasured):
WIDE_TILE_MIN_REDUCTION = 1024


@dataclass(frozen=True)
class GroupedGemmSm90Config:
    """Compile-time choices: the problem's static part (``mode``, ``n``, ``k``, ``out_dtype``,
    ``scale_blocks``) and the tuning fields below (measured effects: docs/design/
    hopper_gemm.md). ``scale_blocks``: "1x32" (exact MXFP8, 2 FP32 ops per element per k=32
    step), "32x32" (M-grouped 32x32 weight tiles, 1 FFMA) or "1x128" (one promotion per
    k=128; M-grouped with 128x128 weight tiles)."""

    mode: str
    n: int
    k: int
    out_dtype: torch.dtype = torch.bfloat16
    scale_blocks: str = "1x32"
    # 1x128: issue the wgmmas of two k-tiles, then promote the first while the second's run
    # (two temporaries, k-loop unrolled by two) instead of waiting for each k-tile's wgmmas
    # before promoting it. None: on M-grouped, off K-grouped (measured per grouping).
    overlap_promotion: bool | None = None
    stages: int = 0  # 0: as many as fit in shared memory (<= MAX_STAGES)
    double_tmp: bool = True  # two temporaries: promote step j while wgmma j+1 runs
    # k-tiles of packed scale words each scale warp keeps in flight: 1, since deeper rings
    # spill in the 40-register producer warps and did not pay (measured)
    scale_lookahead: int = 1
    # read a block's scales from smem before waiting for its wgmma (None: on for 32x32 only;
    # in 1x32 mode its 32 column scales held across the wait make ptxas spill)
    hoist_scales: bool | None = None
    # 32x32 mode: the scale warps write the 8 row x column-group products per consumer thread
    # (None: on in 32x32 mode) instead of the consumers forming them with 8 FMULs per k-step
    scale_products: bool | None = None
    # CTAs per cluster along the output tile's fast axis (1 or 2). With 2, the CTAs of a
    # cluster take adjacent tiles that share the A rows, and each TMA-loads half of the A tile
    # and multicasts it to both. Needs an even number of tiles along the fast axis
    # (`can_cluster`; otherwise `select_config` uses 1). On for 1x128 K-grouped only, where the
    # kernel is feed-bound again (measured).
    cluster_n: int = 1
    # output tile width: 128 (one wgmma of N = 128 per k=32 step) or 256 (the 1x128 recipe
    # only: two column halves sharing the A tile, one temporary reused for both halves, so
    # the A tile is loaded half as often per output and the per-tile cost is amortised over
    # twice the work; `select_config` picks 256 for the 1x128 recipe when the output has more
    # than 128 columns and the reduction per tile is long enough: WIDE_TILE_MIN_REDUCTION)
    tile_n: int = TILE_N
    # raster band: the schedule walks bands of this many rows of tiles, x-tile by x-tile (a
    # cluster's tiles together) with the band's rows fastest, so the CTAs running at once
    # share B tiles in L2 (`schedule.GroupedTileSchedule.tile_coords`). 1: row by row.
    # `select_config`: RASTER_BAND for the 1x128 recipe (measured), else 1.
    band_m: int = 1
    # epilogue through shared memory and TMA stores (16-bit outputs): each consumer
    # warpgroup writes its 64 rows of the tile into 64 x 64 swizzled boxes and one of its warps
    # issues their TMA stores, which drain while the next tile's k-loop runs, instead of every
    # thread storing its column pairs to global memory and stalling on them. The tile's
    # buffer (TILE_M x tile_n x 2 bytes) takes shared memory from the stages. M-grouped, a
    # warpgroup whose 64 rows cross the group's end stores directly (a box would write the
    # next group's rows). None: on for 16-bit outputs of the 1x128 recipe (measured: H100,
    # 2026-11-27, fprop / dgrad / wgrad 1.22 / 1.24 / 1.19x the direct stores at qwen3,
    # 1.02 / 1.21 / 1.05x at dsv3, 1.08 / 1.09 / 1.08x at mixtral, although it leaves
    # 256-column tiles 3 stages instead of 4; no change for 1x32, promotion-bound).
    tma_store: bool | None = None
    # diagnostics for measuring the kernel's limits (results are WRONG; never dispatched):
    # "no_promote": the wgmmas accumulate straight into acc (the same pipeline without the
    # CUDA-core promotion); "no_scale_wait": scale warps idle, consumers do not wait for them;
    # "promote_only": no wgmma is issued (the promotion and the pipeline alone); "no_store": the
    # epilogue converts but stores (almost) nothing (the cost of writing the output).
    diag: str = ""
    # K-grouped: rows of B sharing a scale (the problem's ``b_block_rows``): 128 with 1x128
    # blocks makes B's scale one per 128 x 128 tile, so the promotion is one FFMA per element
    # as M-grouped (the scale warps write the row x tile products)
    b_block_rows: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.scale_blocks not in SCALE_BLOCKS:
            raise ValueError(f"scale_blocks must be one of {SCALE_BLOCKS}")
        if self.mode != MODE_M and self.scale_blocks == "32x32":
            raise ValueError("the K-grouped kernel uses per-row (1xK) blocks only")
        if self.scale_blocks == "1x128" and self.diag not in ("", *DIAG_ANY_RECIPE):
            raise ValueError("diag modes measure the exact-MXFP8 kernel")
        if self.scale_lookahead < 1:
            raise ValueError("scale_lookahead must be >= 1")
        if self.cluster_n not in (1, 2):
            raise ValueError("cluster_n must be 1 or 2")
        if self.diag not in DIAG_MODES:
            raise ValueError(f"diag must be one of {DIAG_MODES}, got {self.diag!r}")
        if self.tile_n not in TILE_NS:
            raise ValueError(f"tile_n must be one of {TILE_NS}, got {self.tile_n}")
        if self.tile_n != TILE_N and self.scale_blocks != "1x128":
            raise ValueError("256-column tiles are built for the 1x128 recipe only")
        if self.b_block_rows not in COLWISE_BLOCK_ROWS or (
                self.b_block_rows != 1 and (self.mode == MODE_M or self.scale_blocks != "1x128")):
            raise ValueError("b_block_rows 128 (128 x 128 B tiles) is K-grouped 1x128 only")
        if self.tma_store and self.out_dtype.itemsize != 2:
            raise ValueError("the TMA-store epilogue is built for 16-bit outputs")
        if self.band_m < 1:
            raise ValueError("band_m must be >= 1")


TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(GroupedGemmSm90Config)
                      if f.name not in ("mode", "n", "k", "out_dtype", "scale_blocks",
                                        "b_block_rows"))


def reduction_per_tile(problem: GroupedProblem) -> int:
    """The reduced length an output tile walks: ``k`` M-grouped; K-grouped the mean group's
    token count (the groups' sizes live on the device; their mean is ``m / E``)."""
    if problem.mode == MODE_M:
        return problem.k
    return problem.m // max(problem.num_groups, 1)


def can_cluster(mode: str, n: int, k: int, cluster_n: int, tile_n: int = TILE_N) -> bool:
    """Whether output tiles along the fast axis pair up evenly into clusters of ``cluster_n``
    CTAs (the cluster's CTAs must share every tile's A rows)."""
    return -(-output_columns(mode, n, k) // tile_n) % cluster_n == 0


class GroupedGemmSm90Host(GroupedGemmHost):
    """Host-side decisions of the Hopper kernel (`sm90.GroupedGemmSm90`)."""

    kernel_module = "sm90"
    kernel_name = "GroupedGemmSm90"
    tile_m = TILE_M

    def __init__(self, config: GroupedGemmSm90Config):
        self.tile_n = config.tile_n  # the schedule's unit and raster
        self.band_m = config.band_m
        super().__init__(config)

    @classmethod
    def select_config(cls, problem: GroupedProblem, tuning: dict | None = None):
        """The configuration: the problem's static part; for the 1x128 recipe 256-column
        tiles (more than 128 output columns and at least WIDE_TILE_MIN_REDUCTION reduced
        elements per tile: `reduction_per_tile`), raster bands of RASTER_BAND rows of tiles
        and, K-grouped, 2-CTA clusters where the tiles pair up; then ``tuning``'s overrides
        (benchmarks)."""
        k128 = problem.scale_blocks == "1x128"
        wide = (k128 and output_columns(problem.mode, problem.n, problem.k) > TILE_N
                and reduction_per_tile(problem) >= WIDE_TILE_MIN_REDUCTION)
        fields: dict[str, Any] = dict(cluster_n=2 if problem.mode != MODE_M and k128 else 1,
                      tile_n=TILE_NS[1] if wide else TILE_N,
                      band_m=RASTER_BAND if k128 else 1)
        if tuning:
            bad = sorted(set(tuning) - set(TUNING_FIELDS))
            if bad:
                raise ValueError(f"tuning may only set {TUNING_FIELDS}, got {bad}")
            fields.update(tuning)
        cfg = GroupedGemmSm90Config(problem.mode, problem.n, problem.k, problem.out_dtype,
                                    problem.scale_blocks, b_block_rows=problem.b_block_rows,
                                    **fields)
        if cfg.cluster_n > 1 and not can_cluster(cfg.mode, cfg.n, cfg.k, cfg.cluster_n,
                                                 cfg.tile_n):
            cfg = dataclasses.replace(cfg, cluster_n=1)
        return cfg

    def can_implement(self, problem: GroupedProblem) -> tuple[bool, str]:
        if problem.scale_blocks != self.cfg.scale_blocks:
            # the promotion depends on the scale blocks: another choice would give wrong sums
            return False, (f"kernel compiled for {self.cfg.scale_blocks} scale blocks, the "
                           f"operands have {problem.scale_blocks}")
        if problem.b_block_rows != self.cfg.b_block_rows:
            return False, (f"kernel compiled for B rows sharing a scale {self.cfg.b_block_rows}, "
                           f"the operand has {problem.b_block_rows}")
        return super().can_implement(problem)

    def cluster_size(self) -> int:
        return self.cfg.cluster_n

    def units_per_cluster(self) -> int:
        return self.cfg.cluster_n
