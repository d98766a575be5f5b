"""Hopper (sm_90a) grouped MXFP8 GEMM: FP8 e4m3 ``wgmma`` with per-32 scale promotion.

Two variants of one kernel class (`Sm90GroupedGemm`, ``config.variant``):

* ``"m"`` -- 2D x 3D M-grouped (fprop ``Y_g = X_g W_g^T``, dgrad ``dX_g = dY_g W_g``):
  ``a (M, K)`` rowwise with grouped-rows packed scales, ``b (E, N, K)`` expert weights ->
  ``out (M, N)``; the rows of group g use expert g.
* ``"k"`` -- 2D x 2D K-grouped (wgrad ``dW_g = dY_g^T X_g``): ``a (N, M)``, ``b (K, M)`` both
  quantized along the tokens M per group -> ``out (E, N, K)``; empty groups give zeros.

Structure (persistent: min(tiles, SMs) CTAs of 384 threads = 3 warpgroups; each CTA walks
output tiles t = blockIdx.x, + gridDim.x, ... of 128 x 128, n-tile fastest; every role walks the
same sequence and the smem pipeline runs on across tiles, so the next tile's loads overlap this
tile's epilogue):

* warp 0 (producer): TMA of the A and B tiles (128 rows x 128 K bytes each) into an
  ``S``-stage smem ring (PipelineTmaAsync), the tile origin read from ``offs`` on the GPU.
  K-grouped groups whose first token is not 16-byte aligned cannot be TMA'd (Hopper traps with
  "illegal instruction" on an unaligned innermost TMA coordinate, seen on the device): for
  those this warp copies the window itself (4-byte loads + funnel shift, `copy_producer`) --
  correct but ~20x slower; the host entry point avoids it by re-laying the groups out first
  (`grouped_gemm_common.align_k_groups`);
* warps 1-3 (scales, k-tiles round-robin): read the two 512-byte packed scale tiles of each
  k-tile (one packed tile is exactly 128 rows x 4 blocks = one k-tile, see
  `grouped_gemm_common`), convert the E8M0 bytes to fp32 and write them to smem in the order the
  consumers read them (32x32 mode: the 8 row x column-group products each consumer thread
  needs), then arrive on the same "full" mbarrier as the TMA (the barrier counts 1 TMA arrive +
  32 scale-lane arrives);
* warpgroups 1, 2 (consumers, 64 rows each): per k=32 step (one scale block) one
  ``wgmma.m64n128k32`` into a temporary accumulator, then "promotion"
  ``acc += tmp * (sa[row] * sb[col])`` on the CUDA cores. Two temporaries alternate so that the
  next step's wgmma is in flight while the previous one is promoted.
* epilogue: predicated direct stores (rows masked by the group end, columns by N).

Group structure comes from ``offs`` on the device (no host sync): variant "m" counts the real
m-tiles ``sum_g ceil(m_g/128)`` and finds each tile's group by a warp-parallel prefix scan over
``offs``; variant "k" walks (tile, group) pairs, empty groups storing zeros; a group's last
k-tile reads the next group's tokens, which are zeroed in smem (both operands, so garbage x 0
cannot make NaN) before the wgmma, with ``fence.proxy.async``.

What limits it (measured on an H100, docs/NOTES.md "Hopper grouped GEMM"): the promotion's
instruction issue adds to the MMA time instead of hiding under it, so the kernel runs at
roughly (MMA + feed time) + (promotion issue time); the promotion is 1 FFMA per accumulator
element per k=32 step in 32x32 mode and 2 FP32 ops (+ scale loads) in 1x32 mode.

Scale modes: 1x32 x 1x32 (default; the row scale times the column scale is formed per element,
2 FP32 ops per element per k-step) and the 32x32 weight mode (``b.block_rows == 32``: one
column scale per 32 output columns, so the 8 distinct products per thread are formed once and
promotion is one FFMA per element).

The 1x128 recipe (``promote_k = 128``; docs/numerics.md "The 1x128 recipe"): one scale per 128
elements of the reduced axis on both sides (M-grouped: 128x128 weight tiles), so the 4 wgmmas
of a k-tile accumulate in the tensor core and the promotion runs once per k-tile -- 4x fewer
FP32 operations (64 FFMA per thread per k-tile M-grouped, + 64 FMUL K-grouped). M-grouped, the
promotion of k-tile 2p overlaps the wgmmas of 2p+1 (`consumer_k128_overlapped`). The scale
warps check that the 4 replicated block bytes agree (otherwise the outputs become NaN).
Measured: this kernel runs at the speed of its own pipeline without any promotion
(docs/NOTES.md "The 1x128 recipe on Hopper").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory  # noqa: F401  (SmemAllocator)
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32

from moe_mxfp8 import reference as R

from . import grouped_gemm_common as GC
from .common import CompileCache, current_stream, target_arch

VARIANTS = ("m", "k")
DIAG_MODES = ("", "no_promote", "no_scale_wait", "promote_only")
TILE_M = 128  # two consumer warpgroups of 64 rows; equals the packed scale tile's 128 rows
TILE_N = 128  # one packed scale tile of B per k-tile
TILE_K = 128  # 4 scale blocks = one packed 512-byte tile = the 128-byte smem swizzle row
MMA_K = 32  # one fp8 wgmma step == one scale block
BLOCKS_PER_KTILE = TILE_K // MMA_K
SCALE_TILE_WORDS = 128  # 512 bytes as int32 words
THREADS_PER_WG = 128
NUM_CONSUMER_WG = 2
NUM_THREADS = THREADS_PER_WG * (1 + NUM_CONSUMER_WG)
PRODUCER_REGS = 40
CONSUMER_REGS = 232
SMEM_RESERVE = 2048  # barriers + alignment slack
MAX_STAGES = 8
E8M0_NAN = 0xFF
F32_NAN_BITS = 0x7FC00000
CONSUMER_BARRIER_ID = 1
TMA_INNER_ALIGN = 16  # bytes (= fp8 tokens): TMA's innermost coordinate must be 16B aligned
COPY_ROWS = 8  # rows per batch of independent loads in the slow copy path
SCALE_WARPS = 3  # producer-warpgroup warps 1..3 convert scales
SFA_STRIDE = TILE_M  # fp32 row scales per block
SFB_Q_STRIDE = TILE_N // 4 + 4  # 32 column scales per lane%4 group + 4 pad (bank spread)
SFB_STRIDE = 4 * SFB_Q_STRIDE
PROD_STRIDE = (TILE_M // 2) * 8  # 32x32 mode: 64 thread-row pairs x 8 products per block
# elements of K between two promotions: 32 = every wgmma (1x32 / 32x32 scales); 128 = the 1x128
# recipe: the 4 wgmmas of a k-tile accumulate in the tensor core, one promotion per k-tile
PROMOTE_INTERVALS = (MMA_K, TILE_K)
B_BLOCK_ROWS = (1, 32, TILE_N)  # 1x32 blocks, 32x32 tiles, 128x128 tiles (promote_k = 128)


@dataclass(frozen=True)
class Sm90GroupedGemmConfig:
    """Compile-time choices. ``variant``: "m" or "k"; ``b_block_rows``: 1, 32 or 128;
    ``promote_k``: 32 or 128 (the 1x128 recipe: M-grouped needs 128x128 weight tiles)."""

    variant: str = "m"
    out_dtype: str = "bfloat16"  # "bfloat16" or "float32"
    b_block_rows: int = 1
    promote_k: int = MMA_K
    # promote_k = 128: issue the wgmmas of two k-tiles, then promote the first while the
    # second's run (two temporaries, k-loop unrolled by two) instead of waiting for each
    # k-tile's wgmmas before promoting it (then only the other consumer warpgroup's wgmmas
    # overlap the promotion). None: on for M-grouped, off for K-grouped. Measured (H100,
    # 2026-11-23, benchmarks/RESULTS.md): M-grouped -2..+9% (mixtral fprop 10984 -> 10098 us),
    # K-grouped -2..0%.
    overlap_promotion: bool | None = None
    stages: int = 0  # 0: as many as fit in shared memory (<= MAX_STAGES)
    double_tmp: bool = True  # two temporaries: promote step j while wgmma j+1 runs
    # k-tiles of packed scale words each scale warp keeps in flight. Measured (H100, fprop
    # dsv3 T=32768 / qwen3): 1 vs 2 vs 3 within +-1.5%, and with the scale warps removed
    # altogether (diag "no_scale_wait") 32x32 mode gains 13%, 1x32 none: the scale feed is
    # not what limits the kernel. 1: deeper rings spill in the 40-register producer warps
    # (66 LDL/STL at N=256, K=512 with 2).
    scale_lookahead: int = 1
    # read a block's scales from smem before waiting for its wgmma (None: per scale mode).
    # Measured (H100, fprop dsv3 T=32768, benchmarks/tune_grouped_gemm_sm90.py): 32x32 mode
    # 3312 vs 3399 us (+3%); 1x32 mode 5496 vs 4816 us (-14%: its 32 column scales held across
    # the wait make ptxas spill), so None = on for 32x32 only.
    hoist_scales: bool | None = None
    # 32x32 mode: the scale warps write the 8 row x column-group products per consumer thread
    # (None: on in 32x32 mode) instead of the consumers forming them with 8 FMULs per k-step
    scale_products: bool | None = None
    # persistent grid: min(output tiles, max_ctas) CTAs walk the tiles (one CTA per SM fits:
    # ~224 KB of shared memory); the host sets the device's SM count
    max_ctas: int = 132
    # CTAs per cluster along the output tile's fast axis (1 or 2). With 2, the CTAs of a
    # cluster take adjacent tiles that share the A rows, and each TMA-loads half of the A tile
    # and multicasts it to both, so L2 serves 3/4 of the operand bytes per k-tile. Needs an
    # even number of tiles along the fast axis (`can_cluster`; otherwise the host uses 1).
    # Default 1, measured (H100, 2026-11-23, T=32768, docs/NOTES.md): 2 speeds up the kernel
    # without promotion by 4-18% (mixtral dgrad 8821 -> 7594 us, 32x32) but the real kernel,
    # bound by the consumers' promotion, only by -4..+3% (dsv3 fprop 32x32 3003 -> 3041 us,
    # mixtral fprop 32x32 15002 -> 14726, wgrad16 mixtral 20793 -> 21604).
    cluster_n: int = 1
    # diagnostics for measuring the kernel's limits (results are WRONG; never dispatched):
    # "no_promote": the wgmmas accumulate straight into acc (the same pipeline without the
    # CUDA-core promotion); "no_scale_wait": scale warps idle, consumers do not wait for them;
    # "promote_only": no wgmma is issued (the promotion and the pipeline alone).
    diag: str = ""

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.b_block_rows not in B_BLOCK_ROWS:
            raise ValueError(f"b_block_rows must be one of {B_BLOCK_ROWS}")
        if self.promote_k not in PROMOTE_INTERVALS:
            raise ValueError(f"promote_k must be one of {PROMOTE_INTERVALS}")
        if self.variant == "k" and self.b_block_rows != 1:
            raise ValueError("the K-grouped variant uses per-row (1xK) blocks only")
        if self.variant == "m" and (self.b_block_rows == TILE_N) != (self.promote_k == TILE_K):
            raise ValueError("M-grouped: promote_k = 128 goes with 128x128 weight tiles")
        if self.promote_k == TILE_K and self.diag:
            raise ValueError("diag modes measure the promote_k = 32 kernel")
        if self.scale_lookahead < 1:
            raise ValueError("scale_lookahead must be >= 1")
        if self.cluster_n not in (1, 2):
            raise ValueError("cluster_n must be 1 or 2")
        if self.diag not in DIAG_MODES:
            raise ValueError(f"diag must be one of {DIAG_MODES}, got {self.diag!r}")


def _cutlass_out_dtype(name: str):
    return {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32}[name]


class Sm90GroupedGemm:
    """Grouped MXFP8 GEMM for sm_90a; see the module docstring."""

    def __init__(self, config: Sm90GroupedGemmConfig):
        self.cfg = config
        self.is_m = config.variant == "m"
        self.block32 = config.b_block_rows == 32
        # 1x128 recipe: one promotion per k-tile; with 128x128 weight tiles the scale warps
        # write the row scale x tile scale products, so the promotion is 1 FFMA per element
        self.k128 = config.promote_k == TILE_K
        self.tile128 = config.b_block_rows == TILE_N
        self.sblocks = 1 if self.k128 else BLOCKS_PER_KTILE  # scale blocks per stage
        self.overlap = (self.is_m if config.overlap_promotion is None
                        else config.overlap_promotion)
        self.hoist_scales = self.block32 if config.hoist_scales is None else config.hoist_scales
        self.out_dtype = _cutlass_out_dtype(config.out_dtype)
        self.ab_dtype = cutlass.Float8E4M3FN
        ab_stage_bytes = (TILE_M + TILE_N) * TILE_K
        # 32x32 mode keeps the row x column-group scale products (PROD_STRIDE per block) in
        # the sSFA region instead of the row and column scales (see scale_producer)
        self.products = self.block32 and config.scale_products is not False
        self.sfa_stride = PROD_STRIDE if self.products else SFA_STRIDE
        self.sfb_stride = 4 if self.products or self.tile128 else SFB_STRIDE
        sf_stage_bytes = self.sblocks * (self.sfa_stride + self.sfb_stride) * 4
        self.stage_bytes = ab_stage_bytes + sf_stage_bytes
        cap = utils.get_smem_capacity_in_bytes("sm_90")
        self.stages = config.stages or min(MAX_STAGES, (cap - SMEM_RESERVE) // self.stage_bytes)
        self.tx_bytes = ab_stage_bytes

    # ------------------------------------------------------------------ host-side (traced)
    def _smem_layouts(self):
        def one(rows):
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype,
                                                TILE_K),
                self.ab_dtype,
            )
            return cute.tile_to_shape(atom, (rows, TILE_K, self.stages), order=(0, 1, 2))

        return one(TILE_M), one(TILE_N)

    def _make_tiled_mma(self):
        """Two consumer warpgroups, each m64 n128 k32 fp8 wgmma with K-major operands."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype,
            cute.nvgpu.warpgroup.OperandMajorMode.K, cute.nvgpu.warpgroup.OperandMajorMode.K,
            Float32, (NUM_CONSUMER_WG, 1, 1), tiler_mn=(64, TILE_N),
        )

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, sfA: cute.Tensor,
                 sfB: cute.Tensor, offs: cute.Tensor, stream):
        """``m``: mA (M, K), mB (N, K, E), mOut (M, N). ``k``: mA (N, M), mB (K, M),
        mOut (N, K, E). sfA/sfB: packed scales as int32 words. offs: (E,) int32."""
        self.tiled_mma = self._make_tiled_mma()
        a_layout, b_layout = self._smem_layouts()
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        cl = self.cfg.cluster_n
        # in a cluster each CTA loads 1/cl of the shared A tile and multicasts it
        op_a = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if cl > 1 else op
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op_a, mA, cute.slice_(a_layout, (None, None, 0)), (TILE_M, TILE_K), num_multicast=cl)
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, mB, cute.slice_(b_layout, (None, None, 0)), (TILE_N, TILE_K))
        num_groups = cute.size(offs, mode=[0])
        if cutlass.const_expr(self.is_m):
            m_rows = cute.size(mA, mode=[0])
            n_cols = cute.size(mB, mode=[0])
            # static bound of sum_g ceil(m_g / TILE_M) (grouped_gemm_common.m_tiles_bound)
            tiles_bound = ((n_cols + TILE_N - 1) // TILE_N
                           * ((m_rows + (TILE_M - 1) * num_groups) // TILE_M))
        else:
            tiles_bound = ((cute.size(mB, mode=[0]) + TILE_N - 1) // TILE_N
                           * ((cute.size(mA, mode=[0]) + TILE_M - 1) // TILE_M) * num_groups)
        # persistent grid of whole clusters (tiles_bound is a multiple of cl, see can_cluster)
        clusters = cutlass.max(cutlass.min(tiles_bound // cl, self.cfg.max_ctas // cl), 1)
        grid = (clusters * cl, 1, 1)

        stages = self.stages
        sfa_words = stages * self.sblocks * self.sfa_stride
        sfb_words = stages * self.sblocks * self.sfb_stride

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_layout)],
                                  1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_layout)],
                                  1024]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[Float32, sfa_words], 16]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[Float32, sfb_words], 16]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, tA, tma_b, tB, mA, mB, mOut, sfA, sfB, offs, self.tiled_mma,
                    a_layout, b_layout).launch(grid=grid, block=[NUM_THREADS, 1, 1],
                                               min_blocks_per_mp=1, stream=stream,
                                               **({"cluster": (cl, 1, 1)} if cl > 1 else {}))

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, tA: cute.Tensor, tma_b: cute.CopyAtom,
               tB: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor,
               sfA: cute.Tensor, sfB: cute.Tensor,
               offs: cute.Tensor, tiled_mma: cute.TiledMma, a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(),
            num_stages=self.stages,
            # full barrier: 1 TMA arrive (with the byte count) + 32 scale-warp arrives
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 if self.cfg.diag == "no_scale_wait" else 1 + 32),
            # empty barrier: one arrive per consumer warp of every CTA of the cluster (the
            # producers write A into each other's stages)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     NUM_CONSUMER_WG * 4 * self.cfg.cluster_n),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, self.cfg.cluster_n, 1)),
        )
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sSFA = storage.sSFA.get_tensor(
            cute.make_layout((self.sfa_stride, self.sblocks, self.stages)))
        sSFB = storage.sSFB.get_tensor(
            cute.make_layout((self.sfb_stride, self.sblocks, self.stages)))

        # ---- persistent tile loop: every role of every CTA walks the same tiles
        # t = bidx, bidx + grid, ... (n-tile fastest, so concurrent CTAs share A rows in L2);
        # the pipeline runs on across tiles, so the producers load the next tile while the
        # consumers store this one.
        # clusters of cl CTAs (1-D along x: the rank is bidx % cl) walk cluster tiles
        # p = cid, cid + n_clusters, ...; rank r of a cluster takes output tile
        # `cluster_tile(p, r)`, so the cluster's CTAs share the A rows (same group, same k-tiles)
        cl = self.cfg.cluster_n
        n_ctas, _, _ = cute.arch.grid_dim()
        n_clusters = n_ctas // cl
        cid = bidx // cl
        rank = bidx % cl
        num_tiles, tiles_x, tiles_xy = self.tile_counts(tA, tB, offs)
        num_ctiles = num_tiles // cl
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    self.stages)
                for p in range(cid, num_ctiles, n_clusters):
                    t = self.cluster_tile(p, rank, tiles_x)
                    tx, ty, row0, row_end, _, _, k_tiles, _, grp = \
                        self.decode_tile(tA, tB, offs, t, tiles_x, tiles_xy)
                    tma_ok = True
                    if cutlass.const_expr(not self.is_m):
                        # TMA needs a 16-byte aligned innermost (token) coordinate: groups that
                        # start elsewhere are copied by this warp (slow path, see copy_window)
                        tma_ok = row0 % TMA_INNER_ALIGN == 0
                    if tma_ok:
                        prod = self.tma_producer(pipe, prod, tma_a, tA, tma_b, tB, sA, sB,
                                                 row0, tx, ty, grp, k_tiles, rank)
                    else:
                        prod = self.copy_producer(pipe, prod, mA, mB, storage.sA.data_ptr(),
                                                  storage.sB.data_ptr(), row0, row_end, tx, ty,
                                                  k_tiles)
                if cutlass.const_expr(cl > 1):
                    # the peer's consumers still arrive on this CTA's empty barriers: wait for
                    # all of them before the CTA may exit
                    pipe.producer_tail(prod)
            if warp_idx > 0 and cutlass.const_expr(self.cfg.diag != "no_scale_wait"):
                kbase = Int32(0)  # k-tiles of this CTA's earlier tiles (pipeline position)
                for p in range(cid, num_ctiles, n_clusters):
                    t = self.cluster_tile(p, rank, tiles_x)
                    _, _, _, _, a_tile0, b_tile0, k_tiles, _, _ = \
                        self.decode_tile(tA, tB, offs, t, tiles_x, tiles_xy)
                    self.scale_producer(pipe, sfA, sfB, sSFA, sSFB, a_tile0, b_tile0, kbase,
                                        k_tiles, warp_idx - 1)
                    kbase = kbase + k_tiles
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for p in range(cid, num_ctiles, n_clusters):
                t = self.cluster_tile(p, rank, tiles_x)
                tx, ty, row0, row_end, _, _, k_tiles, tok_valid_last, grp = \
                    self.decode_tile(tA, tB, offs, t, tiles_x, tiles_xy)
                cons = self.consumer(pipe, cons, tiled_mma, sA, sB, sSFA, sSFB, mOut, tidx,
                                     wg_idx, row0, row_end, tx, ty, grp, k_tiles,
                                     tok_valid_last)

    @cute.jit
    def tile_counts(self, tA: cute.Tensor, tB: cute.Tensor, offs: cute.Tensor):
        """(real output tiles, tiles along x, tiles per (x, y) plane). M-grouped: x = n-tiles,
        y = the sum_g ceil(m_g/128) real m-tiles (read from offs: warp-collective). K-grouped:
        x = tiles of b's rows, y = tiles of a's rows, z = groups (empty groups store zeros)."""
        num_groups = cute.size(offs, mode=[0])
        if cutlass.const_expr(self.is_m):
            tiles_x = (cute.size(tB, mode=[0]) + TILE_N - 1) // TILE_N
            m_tiles = GC.sum_tiles_before(offs, num_groups, TILE_M)
            tiles_xy = tiles_x * m_tiles
            num_tiles = tiles_xy
        else:
            tiles_x = (cute.size(tB, mode=[0]) + TILE_N - 1) // TILE_N
            tiles_xy = tiles_x * ((cute.size(tA, mode=[0]) + TILE_M - 1) // TILE_M)
            num_tiles = tiles_xy * num_groups
        return num_tiles, tiles_x, tiles_xy

    @cute.jit
    def cluster_tile(self, p: Int32, rank: Int32, tiles_x: Int32):
        """Cluster tile ``p`` -> the linear output tile of CTA ``rank``: tiles ``cl * j + rank``
        along x (fastest) of the same y/z, i.e. the same A rows."""
        t = p
        if cutlass.const_expr(self.cfg.cluster_n > 1):
            cl = self.cfg.cluster_n
            per_x = tiles_x // cl
            t = (p // per_x) * tiles_x + (p % per_x) * cl + rank
        return t

    @cute.jit
    def decode_tile(self, tA: cute.Tensor, tB: cute.Tensor, offs: cute.Tensor, t: Int32,
                    tiles_x: Int32, tiles_xy: Int32):
        """Output tile ``t`` (< `tile_counts`' count, so it is a real tile) ->
        (bidx, bidy, row0, row_end, a_tile0, b_tile0, k_tiles, tok_valid_last, group), with
        ``(bidx, bidy, bidz)`` its coordinates along x (fastest), y and z (K-grouped: group)."""
        bidx = t % tiles_x
        bidy = (t % tiles_xy) // tiles_x
        bidz = t // tiles_xy
        num_groups = cute.size(offs, mode=[0])
        row0 = Int32(0)
        row_end = Int32(0)
        a_tile0 = Int32(0)
        b_tile0 = Int32(0)
        k_tiles = Int32(0)
        tok_valid_last = Int32(TILE_K)
        grp = Int32(0)
        if cutlass.const_expr(self.is_m):
            m_rows = cute.size(tA, mode=[0])
            k_len = cute.size(tA, mode=[1])
            n_len = cute.size(tB, mode=[0])
            g, start, end, tiles_before = GC.find_m_tile_group(offs, num_groups, bidy, TILE_M)
            grp = g
            row0 = start + (bidy - tiles_before) * TILE_M
            row_end = cutlass.min(end, m_rows)
            k_tiles = (k_len + TILE_K - 1) // TILE_K
            t_k = (k_len + 127) // 128  # packed tiles per 128-row tile: ceil(ceil(K/32)/4)
            # grouped-rows packing: the m-tile's packed row tile equals the global m-tile index
            a_tile0 = bidy * t_k
            b_tile0 = (g * ((n_len + 127) // 128) + bidx) * t_k
        else:
            n_len = cute.size(tA, mode=[0])
            k_len = cute.size(tB, mode=[0])
            m_tok = cute.size(tA, mode=[1])
            grp = bidz
            start = Int32(0)
            if bidz > 0:
                start = offs[bidz - 1]
            end = cutlass.min(offs[bidz], m_tok)
            ntok = cutlass.max(end - start, 0)
            row0 = start
            row_end = end
            k_tiles = (ntok + TILE_K - 1) // TILE_K
            tok_valid_last = ntok - (k_tiles - 1) * TILE_K
            before = GC.sum_tiles_before(offs, bidz, TILE_K)
            # group g's packed matrix starts at tile (Rp/128) * sum_{h<g} ceil(m_h/128)
            a_tile0 = ((n_len + 127) // 128) * before + bidy * k_tiles
            b_tile0 = ((k_len + 127) // 128) * before + bidx * k_tiles
        return bidx, bidy, row0, row_end, a_tile0, b_tile0, k_tiles, tok_valid_last, grp

    @cute.jit
    def tma_producer(self, pipe, state, tma_a, tA: cute.Tensor, tma_b, tB: cute.Tensor,
                     sA: cute.Tensor, sB: cute.Tensor, row0: Int32, bidx: Int32, bidy: Int32,
                     grp: Int32, k_tiles: Int32, rank: Int32):
        if cutlass.const_expr(self.is_m):
            gA = cute.local_tile(cute.domain_offset((row0, 0), tA), (TILE_M, TILE_K),
                                 (0, None))
            gB = cute.local_tile(tB, (TILE_N, TILE_K, 1), (bidx, None, grp))
            gB = gB[(None, None, 0, None)]
        else:
            gA = cute.local_tile(cute.domain_offset((0, row0), tA), (TILE_M, TILE_K),
                                 (bidy, None))
            gB = cute.local_tile(cute.domain_offset((0, row0), tB), (TILE_N, TILE_K),
                                 (bidx, None))
        cl = self.cfg.cluster_n
        # with a cluster, this CTA's TMA moves slice `rank` of the A tile into every CTA
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, rank, cute.make_layout(cl), cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        for kt in range(k_tiles):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            if cutlass.const_expr(cl > 1):
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                          mcast_mask=cutlass.Int16((1 << cl) - 1))
            else:
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def copy_producer(self, pipe, state, mA: cute.Tensor, mB: cute.Tensor, pA, pB,
                      tok_start: Int32, tok_end: Int32, bidx: Int32, bidy: Int32,
                      k_tiles: Int32):
        """K-grouped slow path for a group whose first token is not 16-byte aligned (TMA
        cannot start there): the warp copies each k-tile window with 4-byte loads + funnel
        shifts into the 128B-swizzled stage, zero past the group end, then arrives."""
        lane = cute.arch.lane_idx()
        sA_w = cute.make_tensor(cute.recast_ptr(pA, dtype=Int32),
                                cute.make_layout(self.stages * TILE_M * TILE_K // 4))
        sB_w = cute.make_tensor(cute.recast_ptr(pB, dtype=Int32),
                                cute.make_layout(self.stages * TILE_N * TILE_K // 4))
        for kt in range(k_tiles):
            pipe.sync_object_empty.wait(state.index, state.phase)
            t0 = tok_start + kt * TILE_K
            self.copy_window(mA, sA_w, state.index, bidy * TILE_M, t0, tok_end, lane)
            self.copy_window(mB, sB_w, state.index, bidx * TILE_N, t0, tok_end, lane)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(pipe.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def copy_window(self, mSrc: cute.Tensor, sDst: cute.Tensor, stage: Int32, row_base: Int32,
                    t0: Int32, t_end: Int32, lane: Int32):
        """Tokens [t0, t0+128) of 128 rows -> swizzled smem words; lane i makes word i."""
        n_rows = cute.size(mSrc, mode=[0])
        row_words = cute.size(mSrc, mode=[1]) // 4
        gw = cute.make_tensor(cute.recast_ptr(mSrc.iterator, dtype=Int32),
                              cute.make_layout(n_rows * row_words))
        wbase = t0 // 4
        sh = (t0 % 4) * 8
        nvalid = cutlass.min(cutlass.max(t_end - (t0 + 4 * lane), 0), 4)
        mask = Int32(-1)
        if nvalid < 4:
            mask = (Int32(1) << (8 * nvalid)) - 1
        lo_ok = (wbase + lane) * 4 < t_end
        hi_ok = lane == 31 and (wbase + 32) * 4 < t_end
        for rb in range(0, TILE_K, COPY_ROWS):
            lo = cute.make_rmem_tensor((COPY_ROWS,), Int32)
            ext = cute.make_rmem_tensor((COPY_ROWS,), Int32)
            for u in cutlass.range_constexpr(COPY_ROWS):
                grow = row_base + rb + u
                lo[u] = 0
                ext[u] = 0
                if grow < n_rows and lo_ok:
                    lo[u] = gw[grow * row_words + wbase + lane]
                if grow < n_rows and hi_ok:
                    ext[u] = gw[grow * row_words + wbase + 32]
            for u in cutlass.range_constexpr(COPY_ROWS):
                r = rb + u
                hi = cute.arch.shuffle_sync_down(lo[u], 1)
                if lane == 31:
                    hi = ext[u]
                out = lo[u]
                if sh != 0:
                    out = Int32((cutlass.Uint32(lo[u]) >> sh) | (cutlass.Uint32(hi) << (32 - sh)))
                sDst[stage * (TILE_K * TILE_K // 4) + r * 32 + (lane ^ ((r % 8) * 4))] = out & mask

    @cute.jit
    def scale_producer(self, pipe, sfA: cute.Tensor, sfB: cute.Tensor, sSFA: cute.Tensor,
                       sSFB: cute.Tensor, a_tile0: Int32, b_tile0: Int32, kbase: Int32,
                       k_tiles: Int32, which: Int32):
        """E8M0 bytes -> fp32 in smem, in the order the consumer threads read them.

        Lane l holds packed word w of a tile: rows ``r = l + 32 w``, its 4 bytes = blocks 0..3.
        1x32 (`write_scales`): A rows at ``pos_a(r)`` (each consumer thread's two rows r, r+8
        adjacent); B columns at ``pos_b(c) = q*36 + j*2 + e`` for ``c = 8j + 2q + e`` (a
        thread's 32 columns contiguous: 8 x 16-byte loads; the 4-float pad per q keeps the four
        q-groups of a warp on different banks). 32x32: `write_products`.
        SCALE_WARPS warps take the pipeline's k-tiles round-robin: one warp's loop waits on
        its global loads (~1 us), three keep ahead of the consumers (removing the scale work
        altogether, diag "no_scale_wait", did not speed up 1x32 mode).
        """
        lane = cute.arch.lane_idx()
        ahead = self.cfg.scale_lookahead
        # pipeline position of this tile's k-tile kt is kbase + kt; this warp takes those with
        # (kbase + kt) % SCALE_WARPS == which: kt = first + SCALE_WARPS * j, j < n_own. Slot
        # j % ahead of a register ring holds k-tile j's words while later loads fly.
        first = (which - kbase % SCALE_WARPS + SCALE_WARPS) % SCALE_WARPS
        n_own = (k_tiles - first + SCALE_WARPS - 1) // SCALE_WARPS
        wa = cute.make_rmem_tensor((4, ahead), Int32)
        wb = cute.make_rmem_tensor((4, ahead), Int32)
        for s in cutlass.range_constexpr(ahead):
            if s < n_own:
                self.load_scale_words(sfA, sfB, wa, wb, s, a_tile0, b_tile0,
                                      first + SCALE_WARPS * s, lane)
        for j0 in range(0, n_own, ahead):
            for s in cutlass.range_constexpr(ahead):
                j = j0 + s
                if j < n_own:
                    kt = first + SCALE_WARPS * j
                    pos = kbase + kt
                    stage = pos % self.stages
                    # producer phase starts at 1 (make_pipeline_state) and flips per wrap
                    pipe.sync_object_empty.wait(stage, ((pos // self.stages) % 2) ^ 1)
                    if cutlass.const_expr(self.k128):
                        self.write_scales_128(sSFA, sSFB, wa, wb, s, stage, lane)
                    elif cutlass.const_expr(self.products):
                        self.write_products(sSFA, wa, wb, s, stage, lane)
                    else:
                        self.write_scales(sSFA, sSFB, wa, wb, s, stage, lane)
                    cute.arch.mbarrier_arrive(pipe.sync_object_full.get_barrier(stage))
                    if j + ahead < n_own:
                        self.load_scale_words(sfA, sfB, wa, wb, s, a_tile0, b_tile0,
                                              kt + SCALE_WARPS * ahead, lane)

    @cute.jit
    def write_scales(self, sSFA: cute.Tensor, sSFB: cute.Tensor, wa: cute.Tensor,
                     wb: cute.Tensor, slot: cutlass.Constexpr[int], stage: Int32, lane: Int32):
        """1x32: row scales at ``pos_a(r)``, column scales at ``pos_b(c)`` (fp32)."""
        for w in cutlass.range_constexpr(4):
            r = lane + 32 * w
            pos_a = (((r // 64) * 4 + (r % 64) // 16) * 8 + r % 8) * 2 + (r % 16) // 8
            pos_b = ((r % 8) // 2) * SFB_Q_STRIDE + (r // 8) * 2 + r % 2
            for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                sSFA[pos_a, c, stage] = _e8m0_to_f32((wa[w, slot] >> (8 * c)) & 0xFF)
                sSFB[pos_b, c, stage] = _e8m0_to_f32((wb[w, slot] >> (8 * c)) & 0xFF)

    @cute.jit
    def write_scales_128(self, sSFA: cute.Tensor, sSFB: cute.Tensor, wa: cute.Tensor,
                         wb: cute.Tensor, slot: cutlass.Constexpr[int], stage: Int32,
                         lane: Int32):
        """1x128 recipe: one scale per row (and per column, or per 128x128 B tile) per k-tile.

        The packed tiles hold each row's 4 block bytes, which this recipe makes equal (the
        128-block's scale, replicated; blocks past a group's or K's end are 0 = pad): the scale
        is their maximum, and bytes that disagree (an operand not quantized 1x128) give NaN, so
        a wrong operand cannot give a plausible result. With 128x128 weight tiles, B's scale is
        row 0's byte (every byte of the tile equals it or is pad) and the scale warps store the
        products row scale x tile scale at ``pos_a(r)``; otherwise row scales at ``pos_a(r)``
        and column scales at ``pos_b(c)`` as in 1x32 mode.
        """
        bt = Float32(1.0)
        if cutlass.const_expr(self.tile128):
            ref = cute.arch.shuffle_sync(wb[0, slot], 0) & 0xFF
            bad = Int32(0)
            for w in cutlass.range_constexpr(4):
                for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                    b = (wb[w, slot] >> (8 * c)) & 0xFF
                    bad = bad | (b * (ref - b))  # 0 iff b is the tile's byte or pad (0)
            tile_byte = ref
            if cute.arch.vote_any_sync(bad != 0):
                tile_byte = Int32(E8M0_NAN)
            bt = _e8m0_to_f32(tile_byte)
        for w in cutlass.range_constexpr(4):
            r = lane + 32 * w
            pos_a = (((r // 64) * 4 + (r % 64) // 16) * 8 + r % 8) * 2 + (r % 16) // 8
            sa = _e8m0_to_f32(_block128_byte(wa[w, slot]))
            if cutlass.const_expr(self.tile128):
                sSFA[pos_a, 0, stage] = sa * bt
            else:
                sSFA[pos_a, 0, stage] = sa
                pos_b = ((r % 8) // 2) * SFB_Q_STRIDE + (r // 8) * 2 + r % 2
                sSFB[pos_b, 0, stage] = _e8m0_to_f32(_block128_byte(wb[w, slot]))

    @cute.jit
    def write_products(self, sSFA: cute.Tensor, wa: cute.Tensor, wb: cute.Tensor,
                       slot: cutlass.Constexpr[int], stage: Int32, lane: Int32):
        """32x32: the 8 products ``sa[row] * sb[column group]`` each consumer thread needs,
        contiguous per thread: rows r0 = 64 cwg + 16 warp + lane/4 and r0 + 8 (h = 0, 1),
        column groups 0..3 -> ``(r0 // 16 * 8 + r0 % 8) * 8 + 4 h + cg``. Moving the 8 FMULs
        per k-step out of the consumers' promotion (whose issue time adds to the MMA time,
        docs/NOTES.md) onto these otherwise idle warps."""
        # column group cg's scale is row 32*cg of the packed B tile: lane 0, word cg
        sbw = cute.make_rmem_tensor((4,), Int32)
        for cg in cutlass.range_constexpr(TILE_N // 32):
            sbw[cg] = cute.arch.shuffle_sync(wb[cg, slot], 0)
        for w in cutlass.range_constexpr(4):
            r = lane + 32 * w
            base = ((r // 16) * 8 + r % 8) * 8 + ((r % 16) // 8) * 4
            for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                sa = _e8m0_to_f32((wa[w, slot] >> (8 * c)) & 0xFF)
                prod = cute.make_rmem_tensor((TILE_N // 32,), Float32)
                for cg in cutlass.range_constexpr(TILE_N // 32):
                    prod[cg] = sa * _e8m0_to_f32((sbw[cg] >> (8 * c)) & 0xFF)
                # one 16-byte store per (row, block): base is a multiple of 4 floats
                dst = cute.make_tensor(sSFA[(None, c, stage)].iterator + base,
                                       cute.make_layout((TILE_N // 32,)))
                dst.store(prod.load())

    @cute.jit
    def load_scale_words(self, sfA: cute.Tensor, sfB: cute.Tensor, wa: cute.Tensor,
                         wb: cute.Tensor, slot: cutlass.Constexpr[int], a_tile0: Int32,
                         b_tile0: Int32, kt: Int32, lane: Int32):
        """Lane ``lane``'s 4 words of k-tile ``kt``'s two packed scale tiles -> ring slot."""
        for w in cutlass.range_constexpr(4):
            wa[w, slot] = sfA[(a_tile0 + kt) * SCALE_TILE_WORDS + lane * 4 + w]
            wb[w, slot] = sfB[(b_tile0 + kt) * SCALE_TILE_WORDS + lane * 4 + w]

    @cute.jit
    def zero_tail(self, sA: cute.Tensor, sB: cute.Tensor, stage: Int32, ct: Int32,
                  valid_tok: Int32):
        """Zero token columns >= valid_tok of both operands' stage (K-grouped last k-tile)."""
        # the mbarrier spin of consumer_wait can leave a warp diverged; bar.sync is aligned
        cute.arch.sync_warp()
        for it in range(TILE_M * TILE_K // (THREADS_PER_WG * NUM_CONSUMER_WG)):
            idx = ct + it * THREADS_PER_WG * NUM_CONSUMER_WG
            r = idx // TILE_K
            c = idx % TILE_K
            if c >= valid_tok:
                sA[r, c, stage] = self.ab_dtype(0.0)
                sB[r, c, stage] = self.ab_dtype(0.0)
        # the generic-proxy stores must be visible to the wgmma (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        pipeline.NamedBarrier(barrier_id=CONSUMER_BARRIER_ID,
                              num_threads=THREADS_PER_WG * NUM_CONSUMER_WG).arrive_and_wait()

    @cute.jit
    def consumer(self, pipe, state, tiled_mma: cute.TiledMma, sA: cute.Tensor,
                 sB: cute.Tensor,
                 sSFA: cute.Tensor, sSFB: cute.Tensor, mOut: cute.Tensor, tidx: Int32,
                 wg_idx: Int32, row0: Int32, row_end: Int32, bidx: Int32, bidy: Int32,
                 grp: Int32, k_tiles: Int32, tok_valid_last: Int32):
        cwg = wg_idx - 1
        ct = tidx - THREADS_PER_WG  # 0..255 over both consumer warpgroups
        lane = ct % 32
        warp_in_wg = (ct % THREADS_PER_WG) // 32
        thr_mma = tiled_mma.get_slice(cwg * THREADS_PER_WG)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_shape_C((TILE_M, TILE_N))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        tmp0 = cute.make_rmem_tensor(acc_shape, Float32)
        tmp1 = cute.make_rmem_tensor(acc_shape, Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.cfg.diag == "promote_only"):
            # no wgmma writes the temporaries: left undefined, ptxas folds the promotion away
            # (FADD +QNAN); a runtime value keeps it (per-element values get rematerialized)
            tmp0.fill(Float32(row0))
            tmp1.fill(Float32(row0))
        # this thread's scale offsets inside a stage (see scale_producer)
        pos_a = ((cwg * 4 + warp_in_wg) * 8 + lane // 4) * 2
        q = lane % 4

        if cutlass.const_expr(self.k128 and self.overlap):
            state = self.consumer_k128_overlapped(
                pipe, state, tiled_mma, acc, tmp0, tmp1, tCrA, tCrB, sA, sB, sSFA, sSFB, ct,
                pos_a, q, row0, k_tiles, tok_valid_last)
        else:
            for kt in range(k_tiles):
                pipe.consumer_wait(state)
                stage = state.index
                if cutlass.const_expr(not self.is_m):
                    # (the slow copy path zero-fills past the group end itself)
                    if (kt == k_tiles - 1 and tok_valid_last < TILE_K
                            and row0 % TMA_INNER_ALIGN == 0):
                        self.zero_tail(sA, sB, stage, ct, tok_valid_last)
                if cutlass.const_expr(self.k128):
                    # 1x128: the k-tile's 4 wgmmas accumulate in the tensor core (one scale for
                    # all of them), then one promotion per k-tile. The scales are in smem already
                    # (same full barrier), so they load while the wgmmas run.
                    sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, 0, pos_a, q)
                    cute.nvgpu.warpgroup.fence()
                    for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, blk != 0)
                        cute.gemm(tiled_mma, tmp0, tCrA[(None, None, blk, stage)],
                                  tCrB[(None, None, blk, stage)], tmp0)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    self.promote(acc, tmp0, sa0, sa1, sb)
                elif cutlass.const_expr(self.cfg.diag == "no_promote"):
                    for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, blk, stage)],
                                  tCrB[(None, None, blk, stage)], acc)
                        cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                elif cutlass.const_expr(self.cfg.double_tmp):
                    # tmp0 takes blocks 0, 2 and tmp1 blocks 1, 3; block j is promoted while the
                    # wgmma of block j+1 runs. Scales are read before the wait (hoist_scales) so
                    # the shared-memory latency hides under the wgmma.
                    self.mma_step(tiled_mma, tmp0, tCrA, tCrB, 0, stage)
                    self.mma_step(tiled_mma, tmp1, tCrA, tCrB, 1, stage)
                    self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, 0, pos_a, q, 1)
                    self.mma_step(tiled_mma, tmp0, tCrA, tCrB, 2, stage)
                    self.wait_and_promote(acc, tmp1, sSFA, sSFB, stage, 1, pos_a, q, 1)
                    self.mma_step(tiled_mma, tmp1, tCrA, tCrB, 3, stage)
                    self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, 2, pos_a, q, 1)
                    self.wait_and_promote(acc, tmp1, sSFA, sSFB, stage, 3, pos_a, q, 0)
                else:
                    for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
                        self.mma_step(tiled_mma, tmp0, tCrA, tCrB, blk, stage)
                        self.wait_and_promote(acc, tmp0, sSFA, sSFB, stage, blk, pos_a, q, 0)
                pipe.consumer_release(state)
                state.advance()

        self.epilogue(acc, mOut, cwg, warp_in_wg, lane, row0, row_end, bidx, bidy, grp)
        return state

    @cute.jit
    def consumer_k128_overlapped(self, pipe, state, tiled_mma: cute.TiledMma, acc: cute.Tensor,
                                 tmp0: cute.Tensor, tmp1: cute.Tensor, tCrA: cute.Tensor,
                                 tCrB: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                                 sSFA: cute.Tensor, sSFB: cute.Tensor, ct: Int32, pos_a: Int32,
                                 q: Int32, row0: Int32, k_tiles: Int32, tok_valid_last: Int32):
        """1x128 k-loop over pairs of k-tiles: the wgmmas of both are issued (into tmp0 and
        tmp1), then k-tile 2p is promoted while those of 2p+1 run.

        Straight-line code between the issue and the last wait of a pair: an accumulator whose
        wgmma is in flight across a branch or loop edge makes ptxas serialise every wgmma
        (seen in SASS: one ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` per wgmma, docs/NOTES.md), so
        both stages are waited for (and tail-zeroed) before either is issued. ``rel`` trails
        ``state`` and releases the stages in order.
        """
        rel = state.clone()
        for p in range(k_tiles // 2):
            kt = 2 * p
            st0 = self.wait_ktile(pipe, state, sA, sB, ct, row0, kt, k_tiles, tok_valid_last)
            state.advance()
            st1 = self.wait_ktile(pipe, state, sA, sB, ct, row0, kt + 1, k_tiles,
                                  tok_valid_last)
            state.advance()
            self.issue_ktile(tmp0, tCrA, tCrB, st0)
            self.issue_ktile(tmp1, tCrA, tCrB, st1)
            rel = self.finish_ktile(pipe, rel, acc, tmp0, sSFA, sSFB, pos_a, q, 1)
            rel = self.finish_ktile(pipe, rel, acc, tmp1, sSFA, sSFB, pos_a, q, 0)
        if k_tiles % 2 == 1:
            st0 = self.wait_ktile(pipe, state, sA, sB, ct, row0, k_tiles - 1, k_tiles,
                                  tok_valid_last)
            state.advance()
            self.issue_ktile(tmp0, tCrA, tCrB, st0)
            rel = self.finish_ktile(pipe, rel, acc, tmp0, sSFA, sSFB, pos_a, q, 0)
        return state

    @cute.jit
    def wait_ktile(self, pipe, state, sA: cute.Tensor, sB: cute.Tensor, ct: Int32, row0: Int32,
                   kt: Int32, k_tiles: Int32, tok_valid_last: Int32) -> Int32:
        """Wait for k-tile ``kt``'s stage (K-grouped: zero a group's tail); its index."""
        pipe.consumer_wait(state)
        stage = state.index
        if cutlass.const_expr(not self.is_m):
            if kt == k_tiles - 1 and tok_valid_last < TILE_K and row0 % TMA_INNER_ALIGN == 0:
                self.zero_tail(sA, sB, stage, ct, tok_valid_last)
        return stage

    @cute.jit
    def issue_ktile(self, tmp: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
                    stage: Int32):
        """Issue the 4 wgmmas of the k-tile in ``stage`` into ``tmp`` (one commit group).

        The ACCUMULATE flag is a value of the tiled MMA that ``set`` replaces: a tiled MMA made
        here keeps those values inside this call's control-flow region (the caller's, set
        inside a loop, would not dominate its next use outside)."""
        tiled_mma = self._make_tiled_mma()
        cute.nvgpu.warpgroup.fence()
        for blk in cutlass.range_constexpr(BLOCKS_PER_KTILE):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, blk != 0)
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, blk, stage)],
                      tCrB[(None, None, blk, stage)], tmp)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def finish_ktile(self, pipe, rel, acc: cute.Tensor, tmp: cute.Tensor, sSFA: cute.Tensor,
                     sSFB: cute.Tensor, pos_a: Int32, q: Int32,
                     pending: cutlass.Constexpr[int]):
        """Wait until ``tmp``'s wgmmas are done (``pending`` groups may stay in flight),
        promote it with the scales of stage ``rel`` and release that stage."""
        cute.nvgpu.warpgroup.wait_group(pending)
        sa0, sa1, sb = self.load_scales(sSFA, sSFB, rel.index, 0, pos_a, q)
        self.promote(acc, tmp, sa0, sa1, sb)
        pipe.consumer_release(rel)
        rel.advance()
        return rel

    @cute.jit
    def mma_step(self, tiled_mma: cute.TiledMma, tmp: cute.Tensor, tCrA: cute.Tensor,
                 tCrB: cute.Tensor, blk: cutlass.Constexpr[int], stage: Int32):
        """tmp = A[:, blk] . B[:, blk]^T: one wgmma k=32 step, i.e. one scale block."""
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        if cutlass.const_expr(self.cfg.diag != "promote_only"):
            cute.gemm(tiled_mma, tmp, tCrA[(None, None, blk, stage)],
                      tCrB[(None, None, blk, stage)], tmp)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def wait_and_promote(self, acc: cute.Tensor, tmp: cute.Tensor, sSFA: cute.Tensor,
                         sSFB: cute.Tensor, stage: Int32, blk: cutlass.Constexpr[int],
                         pos_a: Int32, q: Int32, pending: cutlass.Constexpr[int]):
        """Wait until at most ``pending`` wgmma groups are in flight (the one that wrote
        ``tmp`` is done), then ``acc += tmp * sa[row] * sb[col]`` for scale block ``blk``."""
        if cutlass.const_expr(self.hoist_scales):
            sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, blk, pos_a, q)
            cute.nvgpu.warpgroup.wait_group(pending)
            self.promote(acc, tmp, sa0, sa1, sb)
        else:
            cute.nvgpu.warpgroup.wait_group(pending)
            sa0, sa1, sb = self.load_scales(sSFA, sSFB, stage, blk, pos_a, q)
            self.promote(acc, tmp, sa0, sa1, sb)

    @cute.jit
    def load_scales(self, sSFA: cute.Tensor, sSFB: cute.Tensor, stage: Int32,
                    blk: cutlass.Constexpr[int], pos_a: Int32, q: Int32):
        """(sa0, sa1, sb): this thread's two row scales and its column scales of ``blk``.

        1x32: ``sb`` holds the thread's 32 column scales (8 x 16-byte loads); 32x32: ``sb``
        holds the 8 products row scale x column-group scale (4 column groups x 2 rows).
        """
        if cutlass.const_expr(self.tile128):
            # row scale x tile scale of this thread's rows r0, r0 + 8 (write_scales_128)
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_rmem_tensor((1,), Float32)
            sb[0] = Float32(1.0)
        elif cutlass.const_expr(self.products):
            # the 8 products written by write_products (pos_a // 2 = this thread's r0 index)
            sa0 = Float32(1.0)
            sa1 = Float32(1.0)
            sb = cute.make_rmem_tensor((2 * (TILE_N // 32),), Float32)
            view = cute.make_tensor(sSFA[(None, blk, stage)].iterator + (pos_a // 2) * 8,
                                    cute.make_layout((2 * (TILE_N // 32),)))
            sb.store(view.load())
        elif cutlass.const_expr(self.block32):
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_rmem_tensor((2 * (TILE_N // 32),), Float32)
            for cg in cutlass.range_constexpr(TILE_N // 32):
                sbc = sSFB[8 * cg, blk, stage]  # column 32*cg: j = 4*cg, q = 0, e = 0
                sb[cg] = sa0 * sbc
                sb[TILE_N // 32 + cg] = sa1 * sbc
        else:
            sa0 = sSFA[pos_a, blk, stage]
            sa1 = sSFA[pos_a + 1, blk, stage]
            sb = cute.make_rmem_tensor((TILE_N // 4,), Float32)
            sb_view = cute.make_tensor(sSFB[(None, blk, stage)].iterator + q * SFB_Q_STRIDE,
                                       cute.make_layout((TILE_N // 4,)))
            sb.store(sb_view.load())
        return sa0, sa1, sb

    @cute.jit
    def promote(self, acc: cute.Tensor, tmp: cute.Tensor, sa0: Float32, sa1: Float32,
                sb: cute.Tensor):
        """acc += tmp * sa[row] * sb[col] (scales from `load_scales`).

        Accumulator fragment of wgmma m64nN (fp32): value i sits at row ``lane/4 + 8*((i/2)%2)``
        and column ``8*(i/4) + 2*(lane%4) + i%2`` of the warp's 16-row slab.
        """
        if cutlass.const_expr(self.tile128):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + tmp[i] * (sa0 if (i // 2) % 2 == 0 else sa1)
        elif cutlass.const_expr(self.block32):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + tmp[i] * sb[((i // 2) % 2) * (TILE_N // 32) + (i // 4) // 4]
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                sa = sa0 if (i // 2) % 2 == 0 else sa1
                acc[i] = acc[i] + tmp[i] * (sa * sb[(i // 4) * 2 + i % 2])

    @cute.jit
    def epilogue(self, acc: cute.Tensor, mOut: cute.Tensor, cwg: Int32, warp_in_wg: Int32,
                 lane: Int32, row0: Int32, row_end: Int32, bidx: Int32, bidy: Int32,
                 grp: Int32):
        out = cute.make_rmem_tensor(acc.shape, self.out_dtype)
        out.store(acc.load().to(self.out_dtype))
        r_base = cwg * 64 + warp_in_wg * 16 + lane // 4
        c_base = bidx * TILE_N + (lane % 4) * 2
        if cutlass.const_expr(self.is_m):
            n_len = cute.size(mOut, mode=[1])
            for i in cutlass.range_constexpr(cute.size(acc)):
                row = row0 + r_base + 8 * ((i // 2) % 2)
                col = c_base + 8 * (i // 4) + i % 2
                if row < row_end and col < n_len:
                    mOut[row, col] = out[i]
        else:
            n_len = cute.size(mOut, mode=[0])
            k_len = cute.size(mOut, mode=[1])
            for i in cutlass.range_constexpr(cute.size(acc)):
                row = bidy * TILE_M + r_base + 8 * ((i // 2) % 2)
                col = c_base + 8 * (i // 4) + i % 2
                if row < n_len and col < k_len:
                    mOut[row, col, grp] = out[i]


@cute.jit
def _e8m0_to_f32(byte: Int32) -> Float32:
    """2^(byte-127) built from the bits (byte 0 gives 0, not 2^-127); 0xFF gives NaN."""
    bits = byte << 23
    if byte == E8M0_NAN:
        bits = Int32(F32_NAN_BITS)
    return bits.bitcast(Float32)


@cute.jit
def _block128_byte(word: Int32) -> Int32:
    """A packed word's 4 block bytes of one row -> its 1x128 scale byte: their maximum, or
    0xFF (NaN) unless every byte equals it or is 0 (pad past a group's or K's end)."""
    top = Int32(0)
    for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
        top = cutlass.max(top, (word >> (8 * c)) & 0xFF)
    bad = Int32(0)
    for c in cutlass.range_constexpr(BLOCKS_PER_KTILE):
        b = (word >> (8 * c)) & 0xFF
        bad = bad | (b * (top - b))
    if bad != 0:
        top = Int32(E8M0_NAN)
    return top


# ---------------------------------------------------------------------------------------------
# host entry points
# ---------------------------------------------------------------------------------------------

_CACHE = CompileCache("grouped_gemm_sm90")


def _dyn(t: torch.Tensor, leading_dim: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading_dim)


def _words(scale: torch.Tensor) -> torch.Tensor:
    """Packed scale bytes viewed as int32 words (sizes are multiples of 512 bytes)."""
    return scale.reshape(-1).view(torch.int32)


@functools.cache
def _max_active_clusters(device_index: int, cluster_size: int) -> int:
    """How many clusters of ``cluster_size`` CTAs (one per SM) the GPU runs at once: a
    persistent grid larger than that would leave whole clusters waiting for a second wave."""
    from cutlass.utils import HardwareInfo

    return HardwareInfo(device_index).get_max_active_clusters(cluster_size)


def can_cluster(variant: str, n: int, k: int, cluster_n: int) -> bool:
    """Whether output tiles along the fast axis (M-grouped: N, K-grouped: K) pair up evenly
    into clusters of ``cluster_n`` CTAs (the cluster's CTAs must share every tile's A rows)."""
    x_extent = n if variant == "m" else k
    return -(-x_extent // TILE_N) % cluster_n == 0


def _fit_cluster(cfg: Sm90GroupedGemmConfig, p: GC.GroupedProblem,
                 t: torch.Tensor) -> Sm90GroupedGemmConfig:
    """``cfg`` with ``cluster_n`` dropped to 1 where the tiles do not pair up, and the
    persistent grid cut to the clusters that fit on the GPU at once."""
    cl = cfg.cluster_n
    if cl == 1:
        return cfg
    if not can_cluster(cfg.variant, p.n, p.k, cl):
        return dataclasses.replace(cfg, cluster_n=1)
    fit = cl * _max_active_clusters(t.device.index or 0, cl)
    return dataclasses.replace(cfg, max_ctas=min(cfg.max_ctas, fit))


def _run(cfg: Sm90GroupedGemmConfig, key_static: tuple, tensors: list, out: torch.Tensor):
    args = [_dyn(t, ld) for t, ld in tensors]
    stream = current_stream()
    key = (cfg, key_static, target_arch())
    fn = _CACHE.get(key, lambda: cute.compile(Sm90GroupedGemm(cfg), *args, stream))
    fn(*args, stream)
    return out


def _output(p: GC.GroupedProblem, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return GC.alloc_output(p)
    if out.shape != p.out_shape or out.dtype != p.out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {p.out_dtype} tensor of shape {p.out_shape}")
    return out


def _sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of ``t``'s GPU: the persistent grid's size (one CTA per SM fits)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count


def _tuned(cfg: Sm90GroupedGemmConfig, tuning: dict | None) -> Sm90GroupedGemmConfig:
    """``cfg`` with the tuning fields of ``tuning`` (benchmarks/tune_grouped_gemm_sm90.py)."""
    if not tuning:
        return cfg
    fixed = {"variant", "out_dtype", "b_block_rows", "promote_k"}
    if fixed & set(tuning):
        raise ValueError(f"tuning may not change {sorted(fixed & set(tuning))}")
    return dataclasses.replace(cfg, **tuning)


def grouped_mm_m(a, b, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                 out: torch.Tensor | None = None, tuning: dict | None = None):
    """2D x 3D M-grouped MXFP8 GEMM on sm_90a (see `moe_mxfp8.gemm.grouped_mm_m`).

    ``out`` (optional, tests): a preallocated output that the kernel overwrites entirely.
    ``tuning`` (optional, benchmarks): overrides of `Sm90GroupedGemmConfig`'s tuning fields.
    128x128 weight tiles (``b.block_rows == 128``) select the 1x128 recipe (one promotion per
    k=128); ``a`` must then be quantized 1x128 along K (otherwise the kernel's scale check
    makes the affected outputs NaN).
    """
    p = GC.describe_m(a, b, offs, out_dtype)
    GC.check_implementable(p, n_multiple=32, k_multiple=32)
    out = _output(p, out)
    if p.m == 0:
        return out
    promote_k = TILE_K if b.block_rows == TILE_N else MMA_K
    cfg = _tuned(Sm90GroupedGemmConfig("m", str(out_dtype).split(".")[-1], b.block_rows,
                                       promote_k, max_ctas=_sm_count(out)), tuning)
    cfg = _fit_cluster(cfg, p, out)
    tensors = [(a.data, 1), (b.data.permute(1, 2, 0), 1), (out, 1), (_words(a.scale), 0),
               (_words(b.scale), 0), (offs, 0)]
    return _run(cfg, p.static_key(), tensors, out)


def grouped_mm_k(a, b, offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                 out: torch.Tensor | None = None, tuning: dict | None = None,
                 groups_aligned: bool = False, scale_blocks: str = "1x32"):
    """2D x 2D K-grouped (wgrad) MXFP8 GEMM on sm_90a (see `moe_mxfp8.gemm.grouped_mm_k`).

    ``scale_blocks="1x128"``: both operands quantized 1x128 along the tokens (blocks restart at
    each group start, like the k-tiles): one promotion per k-tile (otherwise the kernel's scale
    check makes the affected outputs NaN). "1x32" and "32x32" (whose activations are 1x32) are
    the exact-MXFP8 kernel.

    TMA reads the tokens, so every group must start on a 16-token boundary: unless the caller
    says so (``groups_aligned=True``, e.g. `MXFP8MoE`, which pads its groups), the fp8 data of
    both operands is first re-laid out on the GPU with each group moved to a 16-aligned start
    (`grouped_gemm_common.align_k_groups`: one gather per operand, ~1.2 ms at the dsv3 wgrad
    shape; the scales and the result are unchanged). A group that is nevertheless unaligned
    takes the kernel's slow copy path (correct, ~20x slower).
    """
    p = GC.describe_k(a, b, offs, out_dtype)
    # TMA reads tokens along rows: the row stride must be 16-byte aligned (M % 16 == 0), which
    # the re-layout provides (its width is a multiple of 16)
    GC.check_implementable(p, n_multiple=32, k_multiple=32,
                           m_multiple=16 if groups_aligned else 1)
    out = _output(p, out)
    if p.m == 0:
        return out.zero_()
    a_data, b_data = a.data, b.data
    if not groups_aligned:
        a_data, b_data, offs = GC.align_k_groups(a_data, b_data, offs)
    if scale_blocks not in R.SCALE_BLOCKS:
        raise ValueError(f"scale_blocks must be one of {R.SCALE_BLOCKS}, got {scale_blocks!r}")
    promote_k = TILE_K if R.ACT_BLOCK[scale_blocks] == TILE_K else MMA_K
    # 1x128: 2-CTA clusters (TMA multicast of A). With the promotion 4x cheaper the K-grouped
    # kernel is feed-bound again: measured (H100, 2026-11-23) dsv3 wgrad16 13312 -> 11258 us
    cluster_n = 2 if promote_k == TILE_K else 1
    cfg = _tuned(Sm90GroupedGemmConfig("k", str(out_dtype).split(".")[-1], 1, promote_k,
                                       cluster_n=cluster_n, max_ctas=_sm_count(out)), tuning)
    cfg = _fit_cluster(cfg, p, out)
    tensors = [(a_data, 1), (b_data, 1), (out.permute(1, 2, 0), 1), (_words(a.scale), 0),
               (_words(b.scale), 0), (offs, 0)]
    return _run(cfg, p.static_key(), tensors, out)


def grouped_mm_ref(a, b, offs, out_dtype=torch.bfloat16):
    """The pure-PyTorch reference this kernel is tested against."""
    return R.grouped_mm(a, b, offs, out_dtype)


# ---------------------------------------------------------------------------------------------
# compile-only (CPU CI): fake tensors, symbolic token count
# ---------------------------------------------------------------------------------------------


def compile_fake(cfg: Sm90GroupedGemmConfig, n: int, k: int, options: str | None = None):
    """Compile ``cfg`` for ``$CUTE_DSL_ARCH`` with fake tensors (M and E symbolic)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    fp8 = cutlass.Float8E4M3FN
    outd = _cutlass_out_dtype(cfg.out_dtype)
    m = cute.sym_int()
    e = cute.sym_int()
    words_a = cute.sym_int()
    words_b = cute.sym_int()
    if cfg.variant == "m":
        mA = make_fake_tensor(fp8, (m, k), (k, 1), assumed_align=16)
        mB = make_fake_tensor(fp8, (n, k, e), (k, 1, n * k), assumed_align=16)
        mOut = make_fake_tensor(outd, (m, n), (n, 1), assumed_align=16)
    else:
        ms = cute.sym_int(divisibility=16)
        mA = make_fake_tensor(fp8, (n, m), (ms, 1), assumed_align=16)
        mB = make_fake_tensor(fp8, (k, m), (ms, 1), assumed_align=16)
        mOut = make_fake_tensor(outd, (n, k, e), (k, 1, n * k), assumed_align=16)
    sfA = make_fake_compact_tensor(Int32, (words_a,), assumed_align=16)
    sfB = make_fake_compact_tensor(Int32, (words_b,), assumed_align=16)
    offs = make_fake_compact_tensor(Int32, (e,), assumed_align=4)
    kw = {"options": options} if options else {}
    return cute.compile(Sm90GroupedGemm(cfg), mA, mB, mOut, sfA, sfB, offs, make_fake_stream(),
                        **kw)


__all__ = ["Sm90GroupedGemm", "Sm90GroupedGemmConfig", "grouped_mm_m", "grouped_mm_k",
           "grouped_mm_ref", "compile_fake"]
