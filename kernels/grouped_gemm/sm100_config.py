"""The Blackwell grouped GEMM's configuration and heuristics, without CuTeDSL: the config
dataclass (`GroupedGemmSm100Config`) and `GroupedGemmSm100Host` (config choice, shape checks,
cluster shape). The kernel class (`sm100.GroupedGemmSm100`) subclasses the host class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mx_format import TILE_BYTES, TILE_ROWS
from .host import TILE_K, GroupedGemmHost
from .problem import MODE_K, MODE_M, GroupedProblem

SMEM_CAPACITY = 232448  # sm_100 opt-in shared memory per CTA (227 KiB)
SMEM_RESERVED = 1024  # barriers, TMEM pointer, alignment slack
# The epilogue's shared-memory subtile (rows x columns of the output) and its stages: what
# CuTeDSL's `compute_epilogue_tile_shape` picks for a 128 x 128 CTA tile without a source
# tensor (128 rows, 4096 elements); the kernel checks its traced layout against this size.
EPI_TILE = (128, 32)
EPI_STAGES = 2


@dataclass(frozen=True)
class GroupedGemmSm100Config:
    """Static configuration of one compiled kernel.

    ``mma_m`` 128: one CTA per MMA tile; 256: a CTA pair (cluster (2, 1)) runs cta_group::2
    MMAs of 256 x ``mma_n``, each CTA holding 128 rows. ``n`` and ``k`` are the static extents
    (`problem.GroupedProblem`); tokens and the group count stay dynamic. The scale-block choice
    does not enter: 1x128 operands are MXFP8 tensors the block32 MMA reads as they are.
    """

    mode: str
    n: int
    k: int
    out_dtype: torch.dtype = torch.bfloat16
    mma_m: int = 128
    mma_n: int = 128

    @property
    def two_cta(self) -> bool:
        return self.mma_m == 256

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        return (2, 1) if self.two_cta else (1, 1)

    @property
    def cta_tile_m(self) -> int:
        """Output rows per CTA (a CTA pair splits a 256-row MMA tile)."""
        return self.mma_m // 2 if self.two_cta else self.mma_m

    def epilogue_smem_bytes(self) -> int:
        """Shared memory of the output staging buffer, all stages."""
        return EPI_TILE[0] * EPI_TILE[1] * self.out_dtype.itemsize * EPI_STAGES

    def ab_stages(self) -> int:
        """Operand ring stages (one 128-wide k-tile of A, B and their scale tiles each): as
        many as the shared memory left by the epilogue holds. Plain arithmetic, so the
        launch path (the first-use check's problem) needs no CuTeDSL to know it."""
        b_rows = self.mma_n // 2 if self.two_cta else self.mma_n
        sf_tiles = self.cta_tile_m // TILE_ROWS + -(-self.mma_n // TILE_ROWS)
        stage = (self.cta_tile_m + b_rows) * TILE_K + TILE_BYTES * sf_tiles
        return (SMEM_CAPACITY - SMEM_RESERVED - self.epilogue_smem_bytes()) // stage


class GroupedGemmSm100Host(GroupedGemmHost):
    """Host-side decisions of the Blackwell kernel (`sm100.GroupedGemmSm100`)."""

    kernel_module = "sm100"
    kernel_name = "GroupedGemmSm100"
    check_on_first_use = True  # no Blackwell GPU has run it in this project's CI

    def __init__(self, config: GroupedGemmSm100Config):
        self.tile_m, self.tile_n = config.mma_m, config.mma_n  # the schedule's unit: an MMA tile
        super().__init__(config)

    @classmethod
    def select_config(cls, problem: GroupedProblem, tuning: dict | None = None):
        """Tile choice. cta_group::2 halves B traffic per CTA but needs groups of >= 256 rows
        to fill its tiles; with unknown (device-side) group sizes the mean group size decides.
        The K-grouped kernel zeroes group tails in SMEM from the MMA warp, which only sees its
        own CTA's SMEM, so it stays on one CTA per tile."""
        if tuning:
            raise ValueError("the sm100 kernel takes no tuning overrides")
        mma_m = 128
        if problem.mode == MODE_M and problem.m >= 256 * max(problem.num_groups, 1):
            mma_m = 256
        return GroupedGemmSm100Config(problem.mode, problem.n, problem.k, problem.out_dtype,
                                      mma_m, 128)

    def can_implement(self, problem: GroupedProblem) -> tuple[bool, str]:
        if self.mode == MODE_K and self.cfg.two_cta:
            return False, "K-grouped kernel runs one CTA per tile (SMEM tail fix-up)"
        if self.cfg.mma_n != 128:
            # 256 would need one accumulator stage (2 x 256 + scale columns > 512 TMEM
            # columns); not built or compile-tested.
            return False, f"mma_n must be 128, got {self.cfg.mma_n}"
        return super().can_implement(problem)

    def cluster_size(self) -> int:
        return 2 if self.cfg.two_cta else 1

    @classmethod
    def selfcheck_tiling(cls, config: GroupedGemmSm100Config) -> tuple[int, int]:
        """(output tile rows, operand ring stages): what a first-use check must wrap."""
        return config.mma_m, config.ab_stages()
